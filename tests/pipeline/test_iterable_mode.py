"""The loader's path for plain IterableDatasets (pipeline/iterable.py): per-batch exceptions
as torch's (the batch counts, the iteration goes on) and resumed after them, torch's
length warning across a restore, seeds (below 2**63, a state of another seed formula
refused, a drawn seed adopted), persistent workers restarted only after rotated roles."""

from __future__ import annotations

import random
import warnings
from typing import Any

import msgspec
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    default_collate,
    get_worker_info,
)

import savable_loader as sl
from savable_loader.errors import ConfigMismatchError, LoaderUsageError, StateError
from savable_loader.rng import SEED_FORMULA
from savable_loader.state import decode, encode
from tests.common import assert_streams

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::savable_loader.sources.ReplayWarning")]


def _shard() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _item(i: int, offset: int) -> torch.Tensor:
    return torch.tensor([i, offset, random.randint(0, 10**6), int(torch.randint(0, 10**6, ()))])


class _FlakyIterator:
    def __init__(self, n: int, bad: tuple[int, ...]) -> None:
        worker, workers = _shard()
        self.values = iter(range(worker, n, workers))
        self.bad = bad
        self.offset = random.randint(0, 10**6)

    def __iter__(self) -> _FlakyIterator:
        return self

    def __next__(self) -> torch.Tensor:
        i = next(self.values)
        if i in self.bad:
            raise ValueError(f"bad item {i}")
        return _item(i, self.offset)


class FlakyIter(IterableDataset):
    """Integers below ``n`` split across workers, with global-RNG draws; items in ``bad``
    raise ValueError and the iterator goes on (an iterator object)."""

    def __init__(self, n: int = 20, bad: tuple[int, ...] = (5, 6, 13)) -> None:
        self.n, self.bad = n, bad

    def __iter__(self) -> _FlakyIterator:
        return _FlakyIterator(self.n, self.bad)


class FlakyGen(FlakyIter):
    """The same as a generator: it has ended once it raised."""

    def __iter__(self):
        yield from _FlakyIterator(self.n, self.bad)


def picky_collate(items: list[Any]) -> Any:
    if any(int(x[0]) == 8 for x in items):
        raise ValueError("a batch with 8")
    return default_collate(items)


def trace(loader: Any, epochs: int = 1, values_only: bool = False) -> list[tuple[Any, ...]]:
    """What each ``next()`` gives over ``epochs`` ``iter()`` calls (going on after
    errors): ``("batch", values)`` or ``("error", first line of the message)``."""
    out: list[tuple[Any, ...]] = []
    for _ in range(epochs):
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except ValueError as e:
                out.append(("error", str(e).splitlines()[0]))
            else:
                out.append(("batch", (batch[..., 0] if values_only else batch).tolist()))
    return out


def make(dataset: IterableDataset, num_workers: int = 0, **kw: Any) -> sl.SavableDataLoader:
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(dataset, num_workers=num_workers, seed=kw.pop("seed", 4), **kw)


FLAKY = [
    pytest.param(FlakyIter, {"batch_size": None}, id="iter-nobatch"),
    pytest.param(FlakyIter, {"batch_size": 2}, id="iter-b2"),
    pytest.param(FlakyGen, {"batch_size": 2}, id="gen-b2"),
    pytest.param(FlakyIter, {"batch_size": 3, "collate_fn": picky_collate}, id="collate-b3"),
]


# -- per-batch exceptions ----------------------------------------------------------------


@pytest.mark.parametrize(("dataset", "kw"), FLAKY)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_errors_go_on_as_torchs(dataset, kw, num_workers):
    """The same batches and the same errors, in the same order, as torch's DataLoader;
    a generator that raised has ended (its worker's share stops), an iterator goes on."""
    ours = trace(make(dataset(), num_workers, **kw), values_only=True)
    extra = {"multiprocessing_context": "fork"} if num_workers else {}
    theirs = trace(DataLoader(dataset(), num_workers=num_workers, **kw, **extra), values_only=True)
    assert ours == theirs
    assert any(kind == "error" for kind, _ in ours) and any(kind == "batch" for kind, _ in ours)
    if num_workers:
        assert all(m.startswith("Caught ValueError in DataLoader worker process") for k, m in ours if k == "error")


@pytest.mark.parametrize(("dataset", "kw"), FLAKY)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_save_after_an_error_resumes_after_the_failed_batch(dataset, kw, num_workers):
    """Save after every ``next()`` (batch or error) of two epochs, restore, and the
    restored loader gives the rest of the reference: batches, errors (naming the same
    worker) and random draws, epoch boundaries included."""
    reference = trace(make(dataset(), num_workers, **kw), epochs=2)
    epoch0 = len(trace(make(dataset(), num_workers, **kw)))
    points = range(len(reference) + 1) if num_workers == 0 else sorted({1, 3, 4, 5, epoch0, epoch0 + 2})
    for k in points:
        ld = make(dataset(), num_workers, **kw)
        got: list[tuple[Any, ...]] = []
        epoch = 0
        it = iter(ld)
        while len(got) < k:
            try:
                batch = next(it)
            except StopIteration:
                epoch += 1
                it = iter(ld)
                continue
            except ValueError as e:
                got.append(("error", str(e).splitlines()[0]))
            else:
                got.append(("batch", batch.tolist()))
        state = decode(encode(ld.save_state_rank()))
        it.close()
        assert got == reference[:k]
        fresh = make(dataset(), num_workers, **kw)
        fresh.restore_state_rank(state)
        assert trace(fresh, epochs=2 - epoch) == reference[k:], f"k={k}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_that_leaves_the_loop_is_saved_after_the_failed_batch(num_workers):
    """``for batch in loader`` left by the dataset's exception: the iteration is
    abandoned after the failed batch; a restore continues after it, the live loader's
    next ``iter()`` starts the next epoch (as torch's)."""
    reference = trace(make(FlakyIter(), num_workers, batch_size=2), epochs=2)
    first_error = next(i for i, (kind, _) in enumerate(reference) if kind == "error")
    ld = make(FlakyIter(), num_workers, batch_size=2)
    seen = []
    with pytest.raises(ValueError, match="bad item|Caught ValueError"):
        for batch in ld:
            seen.append(("batch", batch.tolist()))
    state = ld.save_state_rank()
    assert seen == reference[:first_error]
    epoch0 = len(trace(make(FlakyIter(), num_workers, batch_size=2)))
    assert trace(ld) == reference[epoch0:]  # the next epoch
    fresh = make(FlakyIter(), num_workers, batch_size=2)
    fresh.restore_state_rank(state)
    assert trace(fresh, epochs=2) == reference[first_error + 1 :]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_in_iter_ends_the_iteration(num_workers):
    class Broken(IterableDataset):
        def __iter__(self):
            raise RuntimeError("Error in __iter__")

    ld = make(Broken(), num_workers, batch_size=2)
    it = iter(ld)
    with pytest.raises(RuntimeError, match="Error in __iter__"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(LoaderUsageError, match="last iteration failed"):
        ld.save_state_rank()


# -- torch's length warning across a restore ---------------------------------------------


class Unsharded(IterableDataset):
    """Every worker yields everything: 2 * len(dataset) items with 2 workers."""

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        yield from range(5)


def test_length_warning_counts_the_batches_before_a_restore():
    ld = make(Unsharded(), 2, batch_size=None)
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = ld.save_state_rank()
    it.close()
    fresh = make(Unsharded(), 2, batch_size=None)
    fresh.restore_state_rank(state)
    assert len(fresh) == 5
    it = iter(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(it), next(it)  # batches 4 and 5 of the epoch
    with pytest.warns(UserWarning, match=r"reported to be 5\(when accessing len\(dataloader\)\), but 6 samples") as w:
        next(it)
    assert w[0].filename == __file__  # at the caller of next()
    it.close()


# -- seeds ---------------------------------------------------------------------------------


class Seeds(IterableDataset):
    """Per item: its value, the torch seed it was made under and get_worker_info().seed."""

    def __iter__(self):
        worker, workers = _shard()
        info = get_worker_info()
        for i in range(worker, 24, workers):
            yield [i, torch.initial_seed(), None if info is None else info.seed, random.random()]


def _plain(items: list[Any]) -> list[Any]:
    return items


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seeds_are_below_2_63(num_workers):
    items = list(make(Seeds(), num_workers, batch_size=None, collate_fn=_plain))
    assert len(items) == 24
    assert all(0 <= item[1] < 2**63 for item in items)
    assert all(item[2] is None if num_workers == 0 else 0 <= item[2] < 2**63 for item in items)


def test_a_state_of_another_seed_formula_is_refused():
    def factory() -> sl.SavableDataLoader:
        return make(Seeds(), 0, batch_size=None, collate_fn=_plain)

    state = factory().save_state_rank()
    assert state.config.seed_formula == SEED_FORMULA
    for formula in (1, 2):  # 1: also what a state written before the field existed holds
        old = msgspec.structs.replace(state, config=msgspec.structs.replace(state.config, seed_formula=formula))
        with pytest.raises(StateError, match=rf"config.seed_formula is {formula}, expected 3: .* unreleased version"):
            factory().restore_state_rank(old)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_drawn_seed_adopts_the_states(num_workers):
    """``seed=None`` draws a seed (torch's global RNG); a restore takes the state's; an
    explicit other seed is refused."""

    def factory(seed: int | None) -> sl.SavableDataLoader:
        kw = {"multiprocessing_context": "fork"} if num_workers else {}
        return sl.SavableDataLoader(
            Seeds(), batch_size=None, collate_fn=_plain, num_workers=num_workers, seed=seed, **kw
        )

    torch.manual_seed(1)
    ld = factory(None)
    reference = list(factory(ld.seed))
    it = iter(ld)
    got = [next(it) for _ in range(7)]
    state = decode(encode(ld.save_state_rank()))
    it.close()
    torch.manual_seed(2)
    fresh = factory(None)
    assert fresh.seed != ld.seed
    fresh.restore_state_rank(state)
    assert fresh.seed == ld.seed == fresh.worker_config.seed
    assert_streams(got + list(fresh), reference, "adopted seed")
    with pytest.raises(ConfigMismatchError, match="seed"):
        factory(ld.seed + 1).restore_state_rank(state)


# -- persistent workers --------------------------------------------------------------------


class Pids(IterableDataset):
    def __iter__(self):
        worker, workers = _shard()
        for i in range(worker, 12, workers):
            yield [i, get_worker_info().id, __import__("os").getpid()]


@pytest.mark.parametrize(("steps", "rotated"), [(2, False), (3, True)])
def test_persistent_workers_restart_only_after_rotated_roles(steps, rotated):
    ld = make(Pids(), 2, batch_size=None, collate_fn=_plain, persistent_workers=True)
    it = iter(ld)
    for _ in range(steps):
        next(it)
    state = ld.save_state_rank()
    it.close()
    assert (state.position.next_worker != 0) == rotated
    fresh = make(Pids(), 2, batch_size=None, collate_fn=_plain, persistent_workers=True)
    fresh.restore_state_rank(state)
    restored = list(fresh)
    following = list(fresh)
    assert [x[:2] for x in following] == [[i, i % 2] for i in range(12)]  # every worker its own role
    pids = {x[2] for x in restored}, {x[2] for x in following}
    assert (pids[0] != pids[1]) == rotated, pids
    assert pids[1] == {x[2] for x in fresh}  # kept from then on


class _Sharded(IterableDataset):
    """0..n-1, split over workers; no randomness of its own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        worker, workers = _shard()
        return iter(range(worker, self.n, workers))


def _masking_collate(batch: list[int]) -> torch.Tensor:
    """A collate function drawing from torch's global RNG, as a masking collator does
    (``torch.bernoulli`` in transformers' DataCollatorForLanguageModeling)."""
    return default_collate(batch).float() * torch.bernoulli(torch.full((len(batch),), 0.5)) + torch.rand(len(batch))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_random_collate_fn_resumes_exactly_while_the_training_loop_draws(num_workers: int) -> None:
    """The loader's collate_fn draws right after its batch, from the RNG state the batch's
    seeding left: with num_workers=0 it ran after the caller's streams were put back, so
    its draws followed the training loop's own (dropout) and differed after a restore."""

    def make() -> sl.SavableDataLoader:
        return sl.SavableDataLoader(
            _Sharded(14), batch_size=3, collate_fn=_masking_collate, num_workers=num_workers, seed=5
        )

    torch.manual_seed(0)
    reference = []
    for batch in make():
        reference.append(batch)
        torch.rand(7)  # the training loop draws between batches
    for stop in range(len(reference) + 1):
        torch.manual_seed(100 + stop)
        loader = make()
        it = iter(loader)
        got = [next(it) for _ in range(stop)]
        torch.rand(3)
        state = loader.save_state_rank()
        torch.manual_seed(200 + stop)  # the restarted job's streams are others
        restored = make()
        restored.restore_state_rank(state)
        for batch in restored:
            got.append(batch)
            torch.rand(5)
        assert_streams(got, reference, f"restored after {stop} batches")
