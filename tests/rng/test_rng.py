"""Tests for savable_loader.rng: seeds from counters, global capture/restore, generator states."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from savable_loader.errors import StateError
from savable_loader.rng.seeding import (
    GlobalRngState,
    capture_generator,
    capture_global,
    capture_kind,
    derive_seed,
    preserve_global_rng,
    restore_generator,
    restore_global,
    seed_global,
)
from savable_loader.state.codec import decode_part, encode_part
from tests.common import empty_numpy_gaussian_cache


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """Leave the session's global RNG streams as they were."""
    with preserve_global_rng():
        yield


def draws() -> tuple[list[float], list[float], list[float]]:
    """A few draws from each of the three global streams (advances them)."""
    py = [random.random() for _ in range(3)] + [random.gauss(0, 1)]
    npy = np.random.random(3).tolist() + [float(np.random.standard_normal())]
    th = torch.rand(3).tolist() + torch.randn(2).tolist()
    return py, npy, th


# -- derive_seed ------------------------------------------------------------------------


def test_derive_seed_is_deterministic_and_64_bit() -> None:
    a = derive_seed(0, "sample", 3, 17)
    assert a == derive_seed(0, "sample", 3, 17)
    assert isinstance(a, int) and 0 <= a < 2**64
    # pinned: the value must be stable across runs, processes and versions
    assert derive_seed() == int.from_bytes(__import__("hashlib").blake2b(b"", digest_size=8).digest(), "little")
    assert derive_seed(0, "sample", 3, 17) == int.from_bytes(
        __import__("hashlib").blake2b(b"0\x1fsample\x1f3\x1f17", digest_size=8).digest(), "little"
    )


def test_derive_seed_is_stable_across_processes() -> None:
    import subprocess
    import sys

    code = "import hashlib;print(int.from_bytes(hashlib.blake2b(b'7\\x1fworker\\x1f1\\x1f2', digest_size=8).digest(), 'little'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    ).stdout
    assert derive_seed(7, "worker", 1, 2) == int(out)


def test_derive_seed_is_sensitive_to_every_part() -> None:
    base = (0, "sample", 3, 17)
    seen = {derive_seed(*base)}
    variants = [
        (1, "sample", 3, 17),
        (0, "samplf", 3, 17),
        (0, "sample", 4, 17),
        (0, "sample", 3, 18),
        (0, "sample", 3),
        (0, "sample", 3, 17, 0),
        (17, 3, "sample", 0),
        (-1, "sample", 3, 17),
        (0, "sample", 317),
        (0, "sample", 31, 7),
        (2**64, "sample", 3, 17),
    ]
    for parts in variants:
        seed = derive_seed(*parts)
        assert seed not in seen, parts
        seen.add(seed)


def test_derive_seed_has_no_collisions_over_a_grid() -> None:
    seeds = {derive_seed(s, "sample", e, i) for s in range(4) for e in range(5) for i in range(200)}
    assert len(seeds) == 4 * 5 * 200


# -- seed_global ------------------------------------------------------------------------


def test_seed_global_makes_all_three_streams_reproducible() -> None:
    with preserve_global_rng():
        seed_global(1234)
        first = draws()
        seed_global(1234)
        second = draws()
        seed_global(1235)
        other = draws()
    assert first == second
    for a, b in zip(first, other):
        assert a != b


def test_seed_global_matches_documented_seeding() -> None:
    seed = derive_seed(5, "sample", 0, 1)
    with preserve_global_rng():
        seed_global(seed)
        got = (random.random(), float(np.random.random()), torch.rand(1).item())
    # NumPy gets the high word of seed * golden ratio (not torch's low word)
    word = ((seed * 0x9E3779B97F4A7C15) % 2**64) >> 32
    assert got[0] == random.Random(seed).random()
    assert got[1] == float(np.random.RandomState(word).random_sample())
    assert got[2] == torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


@pytest.mark.parametrize("seed", [0, 2**64 - 1, 2**70 + 5, -1])
def test_seed_global_accepts_any_int(seed: int) -> None:
    with preserve_global_rng():
        seed_global(seed)
        a = draws()
        seed_global(seed & (2**64 - 1))
        assert draws() == a


# -- capture_global / restore_global / preserve_global_rng ------------------------------


def test_capture_restore_global_replays_all_three_streams() -> None:
    with preserve_global_rng():
        seed_global(99)
        draws()  # move away from a freshly seeded state
        state = capture_global()
        assert isinstance(state, GlobalRngState)
        before = draws()
        restore_global(state)
        after = draws()
        assert after == before
        # restoring twice works too: the captured state is not consumed or aliased
        restore_global(state)
        assert draws() == before


def test_capture_global_is_a_snapshot_not_a_view() -> None:
    with preserve_global_rng():
        seed_global(7)
        state = capture_global()
        torch_before = state.torch.clone()
        numpy_key_before = state.numpy[1].copy()
        draws()
        assert torch.equal(state.torch, torch_before)
        assert np.array_equal(state.numpy[1], numpy_key_before)


def test_preserve_global_rng_restores_streams() -> None:
    seed_global(2024)
    draws()
    reference = capture_global()
    empty_numpy_gaussian_cache()  # the one thing the caller's streams lose (see _rng_states)
    expected = draws()
    restore_global(reference)
    with preserve_global_rng():
        seed_global(1)
        draws()
    assert draws() == expected


def test_preserve_global_rng_restores_on_exception() -> None:
    seed_global(5)
    draws()
    reference = capture_global()
    empty_numpy_gaussian_cache()
    expected = draws()
    restore_global(reference)
    with pytest.raises(ZeroDivisionError):
        with preserve_global_rng():
            draws()
            1 / 0
    assert draws() == expected


def test_preserve_global_rng_restores_pythons_gauss_cache_and_drops_numpys() -> None:
    seed_global(3)
    random.gauss(0, 1)  # leaves a cached second gaussian in Python's random
    np.random.standard_normal()  # and in NumPy's legacy RandomState
    reference = capture_global()
    assert reference.python[2] is not None and reference.numpy[3] == 1
    empty_numpy_gaussian_cache()  # dropped (a Mersenne Twister read costs ~25 us), words kept
    expected = draws()
    restore_global(reference)
    with preserve_global_rng():
        random.seed(0)
        np.random.seed(0)
    assert draws() == expected


# -- generator capture / restore --------------------------------------------------------

GENERATORS: dict[str, Callable[[], Any]] = {
    "python": lambda: random.Random(42),
    "numpy-generator-pcg64": lambda: np.random.default_rng(42),
    "numpy-generator-philox": lambda: np.random.Generator(np.random.Philox(42)),
    "numpy-generator-mt19937": lambda: np.random.Generator(np.random.MT19937(42)),
    "numpy-generator-sfc64": lambda: np.random.Generator(np.random.SFC64(42)),
    "numpy-randomstate": lambda: np.random.RandomState(42),
    "torch": lambda: torch.Generator().manual_seed(42),
}
KINDS = {
    "python": "python",
    "numpy-generator-pcg64": "numpy-generator",
    "numpy-generator-philox": "numpy-generator",
    "numpy-generator-mt19937": "numpy-generator",
    "numpy-generator-sfc64": "numpy-generator",
    "numpy-randomstate": "numpy-randomstate",
    "torch": "torch",
}


def gen_draws(gen: Any, n: int = 5) -> list[float]:
    if isinstance(gen, random.Random):
        return [gen.random() for _ in range(n)] + [gen.gauss(0, 1), gen.gauss(0, 1), float(gen.getrandbits(100))]
    if isinstance(gen, np.random.Generator):
        return (
            gen.random(n).tolist()
            + gen.standard_normal(3).tolist()
            + [float(gen.integers(0, 2**31)), float(gen.integers(0, 2**31, dtype=np.int32))]
        )
    if isinstance(gen, np.random.RandomState):
        return gen.random_sample(n).tolist() + gen.standard_normal(3).tolist() + [float(gen.randint(0, 2**31))]
    return torch.rand(n, generator=gen).tolist() + torch.randn(3, generator=gen).tolist()


def advance(gen: Any) -> None:
    """Leave a generator mid-stream, with half-used caches where it has them."""
    gen_draws(gen, 3)
    if isinstance(gen, random.Random):
        gen.gauss(0, 1)  # cache one gaussian
    elif isinstance(gen, np.random.Generator):
        gen.integers(0, 10, dtype=np.int32)  # uses half a 64-bit draw (has_uint32)
    elif isinstance(gen, np.random.RandomState):
        gen.standard_normal()  # cache one gaussian


def msgpack_trip(plain: dict[str, Any]) -> Any:
    return decode_part(encode_part(plain), dict)


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("through_msgpack", [False, True], ids=["plain", "msgpack"])
def test_capture_restore_generator_round_trip(name: str, through_msgpack: bool) -> None:
    gen = GENERATORS[name]()
    advance(gen)
    plain = capture_generator(gen)
    assert plain["kind"] == KINDS[name] == capture_kind(gen)
    if through_msgpack:
        plain = msgpack_trip(plain)
    expected = gen_draws(gen)
    # restore into the same object and into a fresh, differently seeded one
    restore_generator(gen, plain)
    assert gen_draws(gen) == expected
    other = GENERATORS[name]()
    gen_draws(other, 11)
    restore_generator(other, plain)
    assert gen_draws(other) == expected


@pytest.mark.parametrize("name", list(GENERATORS))
def test_capture_is_a_copy(name: str) -> None:
    gen = GENERATORS[name]()
    plain = capture_generator(gen)
    encoded = encode_part(plain)
    gen_draws(gen)
    assert encode_part(plain) == encoded
    assert encode_part(capture_generator(gen)) != encoded


@pytest.mark.parametrize("name", list(GENERATORS))
def test_captured_state_is_plain_and_encodable(name: str) -> None:
    plain = capture_generator(GENERATORS[name]())

    def check(value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                assert type(k) is str
                check(v)
        elif isinstance(value, list):
            for v in value:
                check(v)
        else:
            assert type(value) in (type(None), bool, int, float, str, bytes), type(value)

    check(plain)
    assert msgpack_trip(plain) == plain
    assert encode_part(msgpack_trip(plain)) == encode_part(plain)


def test_pcg64_state_carries_128_bit_integers() -> None:
    gen = np.random.default_rng(2**100 + 12345)
    live = gen.bit_generator.state
    assert live["state"]["state"] >= 2**64 or live["state"]["inc"] >= 2**64
    plain = msgpack_trip(capture_generator(gen))
    fresh = np.random.default_rng(0)
    restore_generator(fresh, plain)
    assert fresh.bit_generator.state == live


def test_torch_state_is_bytes_and_device_is_recorded() -> None:
    gen = torch.Generator().manual_seed(1)
    plain = capture_generator(gen)
    assert plain["device"] == "cpu"
    assert isinstance(plain["state"], bytes)
    assert plain["state"] == gen.get_state().numpy().tobytes()


# -- wrong kinds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj", [None, 3, "random", object(), np.random.PCG64(1), torch.tensor([1])], ids=lambda o: type(o).__name__
)
def test_capture_of_non_rng_raises_state_error(obj: Any) -> None:
    assert capture_kind(obj) is None
    with pytest.raises(StateError, match="not a known RNG"):
        capture_generator(obj)


@pytest.mark.parametrize(
    "source, target",
    [
        (s, t)
        for s in GENERATORS
        for t in ("python", "numpy-generator-pcg64", "numpy-randomstate", "torch")
        if KINDS[s] != KINDS[t]
    ],
)
def test_restore_into_wrong_kind_raises_state_error(source: str, target: str) -> None:
    plain = capture_generator(GENERATORS[source]())
    gen = GENERATORS[target]()
    expected = capture_generator(GENERATORS[target]())
    with pytest.raises(StateError, match=f"RNG state kind is '{KINDS[source]}'.*'{KINDS[target]}'"):
        restore_generator(gen, plain)
    assert encode_part(capture_generator(gen)) == encode_part(expected)  # untouched


@pytest.mark.parametrize("plain", [None, 5, [1, 2], "python", {"state": b""}], ids=repr)
def test_restore_non_state_raises_state_error(plain: Any) -> None:
    with pytest.raises(StateError, match="RNG state must be a dict with a 'kind'"):
        restore_generator(random.Random(0), plain)


def test_restore_into_non_rng_raises_state_error() -> None:
    with pytest.raises(StateError, match="RNG state kind is 'python'"):
        restore_generator(object(), capture_generator(random.Random(0)))


@pytest.mark.parametrize(
    "name, corrupt",
    [
        ("python", lambda p: p.pop("internal")),
        ("python", lambda p: p.update(internal=p["internal"][:10])),
        ("python", lambda p: p.update(version=99)),
        ("numpy-generator-pcg64", lambda p: p.pop("state")),
        ("numpy-generator-pcg64", lambda p: p["state"].update(bit_generator="MT19937")),
        ("numpy-generator-pcg64", lambda p: p.update(state="nope")),
        ("numpy-randomstate", lambda p: p["state"].update(bit_generator="PCG64")),
        ("numpy-randomstate", lambda p: p["state"]["state"].pop("key")),
        ("torch", lambda p: p.update(state=p["state"][:-8])),
        ("torch", lambda p: p.update(state=b"")),
        ("torch", lambda p: p.pop("state")),
        ("torch", lambda p: p.update(state=2**40)),  # must not allocate a terabyte
        ("torch", lambda p: p.update(state=list(p["state"]))),
        ("torch", lambda p: p.update(state="abc")),
    ],
)
def test_restore_corrupt_state_raises_state_error(name: str, corrupt: Callable[[dict], Any]) -> None:
    plain = msgpack_trip(capture_generator(GENERATORS[name]()))
    corrupt(plain)
    with pytest.raises(StateError, match=f"invalid {KINDS[name]} RNG state"):
        restore_generator(GENERATORS[name](), plain)


_REPLACEMENTS = [
    None,
    0,
    -1,
    2**64 - 1,
    1.5,
    "x",
    b"\x00\x01",
    [],
    [1, 2],
    {},
    True,
    [[1]],
    {"a": 1},
    {"__array__": "<u4"},
    {"__array__": "O", "values": [1]},
    {"__array__": "bogus", "values": []},
    {"__array__": "<u4", "values": "ab"},
    {"__bigint__": "zz"},
    {"__bigint__": "-1"},
    "PCG64",
    "MT19937",
]


def _node_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _node_paths(v, path + (k,))
    elif isinstance(value, list) and len(value) <= 8:
        for i, v in enumerate(value):
            out += _node_paths(v, path + (i,))
    return out


@pytest.mark.parametrize("name", list(GENERATORS))
def test_restore_of_any_corrupted_node_raises_only_state_error(name: str) -> None:
    """Replace every node of a captured state by odd values: restore succeeds or raises StateError."""
    import copy

    plain = msgpack_trip(capture_generator(GENERATORS[name]()))
    gen = GENERATORS[name]()
    for path in _node_paths(plain):
        for replacement in _REPLACEMENTS:
            corrupted = copy.deepcopy(plain)
            node = corrupted
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = replacement
            try:
                restore_generator(gen, corrupted)
            except StateError:
                pass
