"""savable_loader/rng/states.py: the global generators through their public APIs only."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from savable_loader.rng import capture_global, restore_global, seed_global
from savable_loader.rng import states as rs


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    saved, bit = capture_global(), np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(bit)
    restore_global(saved)


def draws() -> list[float]:
    return [
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        float(torch.rand(())),
        float(torch.randn(())),
    ]


def empty_numpy_gaussian_cache() -> None:
    """What the loader does to NumPy's legacy cached Gaussian: it is dropped (a no-op
    swap of the bit generator empties it)."""
    np.random.set_bit_generator(np.random.get_bit_generator())


def test_the_global_generators_are_found_through_public_names() -> None:
    assert rs.PY_RANDOM is random.random.__self__ and isinstance(rs.PY_RANDOM, random.Random)
    assert rs.NUMPY_GLOBAL is np.random.rand.__self__ and isinstance(rs.NUMPY_GLOBAL, np.random.RandomState)
    r = random.Random()
    rs.C_RANDOM_SEED(r, 3)
    assert r.random() == random.Random(3).random()


def test_caller_streams_go_on_where_they_were() -> None:
    seed_global(7)
    draws()  # mid-stream, with cached Gaussians in Python's, NumPy's and torch's
    reference = capture_global()
    bit = np.random.get_bit_generator()
    empty_numpy_gaussian_cache()
    expected = draws()
    restore_global(reference)
    with rs.CallerStreams():
        seed_global(1)
        draws()
        assert np.random.get_bit_generator() is rs.loader_bit_generator()
    assert np.random.get_bit_generator() is bit  # the caller's own object, set aside and put back
    assert draws() == expected


def test_caller_streams_keep_pythons_cached_gaussian_and_drop_numpys() -> None:
    random.seed(1)
    np.random.seed(1)
    random.gauss(0, 1)
    np.random.randn()
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    words = np.random.get_state()[1].copy()
    with rs.CallerStreams():
        pass
    assert random.getstate()[2] is not None  # Python's gauss_next is part of getstate()
    after = np.random.get_state()
    assert np.array_equal(after[1], words) and after[3] == 0  # the words kept, the cache dropped


def test_caller_streams_put_back_on_an_exception_and_nest() -> None:
    seed_global(5)
    reference = capture_global()
    expected = draws()
    restore_global(reference)
    with pytest.raises(ZeroDivisionError), rs.CallerStreams():
        with rs.CallerStreams():
            draws()
        draws()
        1 / 0
    assert draws() == expected


def test_the_loader_bit_generator_draws_as_the_callers_would_when_seeded() -> None:
    np.random.seed(123)
    expected = np.random.rand(4).tolist() + np.random.randn(3).tolist()
    with rs.CallerStreams():
        np.random.seed(123)  # seeds the loader's Mersenne Twister, as a worker's
        got = np.random.rand(4).tolist() + np.random.randn(3).tolist()
    assert got == expected


@pytest.mark.parametrize("names", [("numpy", "random", "torch"), ("numpy", "random"), ("random",), ("numpy",)])
def test_fixed_states_see_every_draw_and_only_draws(names: tuple[str, ...]) -> None:
    fixed = rs.FixedStates(names)
    fixed.put(99)
    assert fixed.changed() == []
    fixed.put(99)  # (the check draws from Python's: put it in again before each use)
    torch.initial_seed()
    np.random.get_state(legacy=False)
    random.getstate()  # reading is not a change
    assert fixed.changed() == []
    draws_by_name = {
        "random": [random.random, lambda: random.gauss(0, 1), lambda: random.getrandbits(624 * 32)],
        "numpy": [np.random.rand, np.random.randn, lambda: np.random.set_bit_generator(np.random.PCG64(1))],
        "torch": [torch.rand, torch.randn],
    }
    for name in names:
        for draw in draws_by_name[name]:
            fixed.put(99)
            draw() if draw not in (torch.rand, torch.randn) else draw(())
            assert fixed.changed() == [name], (name, draw)
    fixed.put(99)
    assert fixed.changed() == []


def test_fixed_states_are_the_same_state_every_time() -> None:
    a, b = rs.FixedStates(("numpy", "random", "torch")), rs.FixedStates(("numpy", "random", "torch"))
    a.put(7)
    first = draws()
    a.put(7)
    assert draws() == first  # put back exactly, cached values dropped
    b.put(7)
    assert draws() == first  # another object, the same fixed state
    b.put(8)
    assert draws() != first
    a.put(7)
    assert torch.initial_seed() == 7
    assert isinstance(np.random.get_bit_generator(), np.random.PCG64)


def test_a_draw_of_a_whole_block_of_words_is_seen() -> None:
    fixed = rs.FixedStates(("random",))
    for words in (1, 623, 624, 625, 2 * 624):
        fixed.put(5)
        random.getrandbits(32 * words)
        assert fixed.changed() == ["random"], words
    fixed.put(5)
    random.gauss(0, 1)
    random.gauss(0, 1)  # an even number: gauss_next empty again, the words moved
    assert fixed.changed() == ["random"]


def test_a_gaussian_taken_from_a_cache_put_in_by_set_state_is_seen() -> None:
    # torch: a cached normal that set_state puts in and an item takes moves no words
    fixed = rs.FixedStates(("torch",))
    fixed.put(3)
    torch.randn(())
    with_cache = torch.get_rng_state()
    fixed.put(3)
    torch.set_rng_state(with_cache)
    assert fixed.changed() == ["torch"]
    # NumPy: the fixed state has no cached Gaussian (the swap empties it): one taken in an
    # item was made from the PCG64, which moved; the state put back as it was is no change
    fixed = rs.FixedStates(("numpy",))
    fixed.put(3)
    assert np.random.get_state(legacy=False)["has_gauss"] == 0
    np.random.randn()
    assert fixed.changed() == ["numpy"]
    fixed.put(3)
    kept = np.random.get_state(legacy=False)
    np.random.randn(3)
    np.random.set_state(kept)  # drawn and put back: the same state, the same data everywhere
    assert fixed.changed() == []


def test_no_module_reads_or_writes_another_librarys_memory() -> None:
    import savable_loader

    for path in Path(savable_loader.__file__).parent.rglob("*.py"):
        assert "ctypes" not in path.read_text(), path


def test_draws_between_a_check_and_the_next_put_are_undone() -> None:
    # the fixed state stays in NumPy's RandomState after a check (in a worker, between
    # items): whatever draws from it then, the next put() starts from the seed's state
    fixed = rs.FixedStates(("numpy", "random", "torch"))
    fixed.put(4)
    expected = draws()
    fixed.put(4)
    assert fixed.changed() == []
    draws()  # between items
    fixed.put(4)
    assert draws() == expected


def _words(gen: random.Random) -> tuple[int, ...]:
    return rs._PY_GETSTATE(gen)


@pytest.mark.parametrize("seed", range(8))
def test_between_blocks_the_callers_python_stream_is_read_exactly_whatever_it_drew(seed: int) -> None:
    """Outermost blocks read the caller's Python state by drawing; a caller that draws
    any number of words between two blocks (across the twist of a new block of words
    too) or re-seeds goes on exactly as a generator that never met a block: the same
    draws and, after a seed, the same getstate()."""
    plan = random.Random(seed)
    random.seed(seed)
    twin = random.Random(seed)
    for step in range(60):
        with rs.CallerStreams():
            random.seed(10_000 + step)  # the loader's own draws
            random.random()
        action = plan.randrange(5)
        if action == 0:
            pass  # the caller draws nothing: the kept state is read by two draws
        elif action == 1:  # a few draws, or enough to reach the end of the 624 words
            for _ in range(plan.choice([1, 2, 3, 620, 621, 622, 623, 624, 625, 1300])):
                assert random.getrandbits(32) == twin.getrandbits(32)
        elif action == 2:  # re-seeded: position 624, the next draw twists
            random.seed(step)
            twin.seed(step)
        elif action == 3:  # put at a position near the end of the words
            twin.setstate(random.getstate())
            for _ in range(plan.randrange(1, 624)):
                random.getrandbits(32)
                twin.getrandbits(32)
        else:
            assert random.gauss(0, 1) == twin.gauss(0, 1)
        if action == 2:
            assert random.getstate() == twin.getstate()
        assert random.random() == twin.random()
    assert [random.getrandbits(32) for _ in range(2000)] == [twin.getrandbits(32) for _ in range(2000)]


def test_a_twist_among_the_reading_draws_is_stepped_back_over() -> None:
    """The state before one or two draws is worked out from the state after them, also
    when a draw began a new block of words: exactly after a seed (word 0's low bits are
    0 then), and with the same outputs otherwise."""
    for seed in range(20):
        seeded = random.Random(seed)
        before = _words(seeded)
        for drawn in (1, 2):
            gen = random.Random(seed)
            for _ in range(drawn):
                gen.getrandbits(32)
            assert rs._before_draws(_words(gen), drawn) == before
        for position in (621, 622, 623, 624, 300):
            gen = random.Random(seed)
            for _ in range(position + 624):
                gen.getrandbits(32)
            state = _words(gen)
            for drawn in (1, 2):
                rs._PY_SETSTATE(gen, state)
                for _ in range(drawn):
                    gen.getrandbits(32)
                back = random.Random()
                rs._PY_SETSTATE(back, rs._before_draws(_words(gen), drawn))
                rs._PY_SETSTATE(gen, state)
                assert [back.getrandbits(32) for _ in range(1500)] == [gen.getrandbits(32) for _ in range(1500)]


def test_a_nested_block_reads_the_outer_blocks_state_with_getstate() -> None:
    random.seed(3)
    twin = random.Random(3)
    with rs.CallerStreams():
        random.seed(1)
        random.random()
        inner_before = random.getstate()
        with rs.CallerStreams():
            random.seed(2)
        assert random.getstate() == inner_before
    assert random.random() == twin.random()
