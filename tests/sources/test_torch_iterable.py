"""Plain torch IterableDatasets in SavableDataLoader (sources/torch_iterable.py): the same
batches as torch's DataLoader, resume at every step (by replay, or by state_dict without
replay), logical worker ids, the replay warning and the errors."""

from __future__ import annotations

import multiprocessing
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import savable_loader as sl
import savable_loader.pipeline.worker
from savable_loader.errors import (
    ConfigMismatchError,
    DataError,
    LoaderUsageError,
    RestoreKeyError,
    StateError,
)
from savable_loader.sources import ReplayWarning, TorchIterableSource
from savable_loader.state import decode, encode
from tests.common import check_resume_everywhere, epochs_of
from tests.wrapper_common import set_snapshot_policy

pytestmark = pytest.mark.timeout(300)

N = 23
ignore_replay = pytest.mark.filterwarnings("ignore::savable_loader.sources.ReplayWarning")
#: saves while iterating, after ``break`` and after an exception in the loop body (the
#: live loader's next ``iter()`` then starts the next epoch, as torch's)
VARIANTS = ("live", "break", "raise")


def _shard() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Sharded(IterableDataset):
    """Integers below ``n`` split by ``get_worker_info()``, each with draws from the three
    global RNGs made inside ``__iter__`` (the draw in ``__iter__`` itself too)."""

    def __init__(self, n: int = N, counter: Any = None) -> None:
        self.n = n
        self.counter = counter  # a shared multiprocessing Value: items produced, in all processes

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        worker, workers = _shard()
        offset = random.randint(0, 10**6)
        for i in range(worker, self.n, workers):
            if self.counter is not None:
                with self.counter.get_lock():
                    self.counter.value += 1
            yield torch.tensor(
                [
                    i,
                    offset,
                    random.randint(0, 10**6),
                    int(np.random.randint(0, 10**6)),
                    int(torch.randint(0, 10**6, ())),
                ]
            )


class StatefulSharded(Sharded):
    """``Sharded`` with torchdata's Stateful protocol: the state is the position in this
    worker's share and a private RNG (a tuple, as ``random.getstate()`` gives)."""

    def __init__(self, n: int = N, counter: Any = None) -> None:
        super().__init__(n, counter)
        self.pos = 0
        self.rng = random.Random(5)
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state

    def __iter__(self):
        worker, workers = _shard()
        self.pos, self.rng = 0, random.Random(5 + worker)
        if self.loaded is not None:
            self.pos = self.loaded["pos"]
            self.rng.setstate(self.loaded["rng"])
        mine = list(range(worker, self.n, workers))
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            if self.counter is not None:
                with self.counter.get_lock():
                    self.counter.value += 1
            yield torch.tensor(
                [i, self.rng.randint(0, 10**6), random.randint(0, 10**6), int(torch.randint(0, 10**6, ()))]
            )


def loader(ds: IterableDataset, num_workers: int = 0, **kw: Any) -> sl.SavableDataLoader:
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(ds, num_workers=num_workers, seed=4, **kw)


def steps_for(num_workers: int, length: int) -> list[int] | None:
    """Every save point in-process; with workers (each point starts worker processes
    several times) the start, both epoch ends, their neighbours and a middle point."""
    if num_workers == 0:
        return None
    n = length
    return sorted({k for k in (0, 1, 2, n // 2, n - 1, n, n + 1, n + 3, 2 * n - 1, 2 * n) if 0 <= k <= 2 * n})


def values(stream: list[Any]) -> list[list[int]]:
    """The dataset values (column 0) of each batch or item, without the random draws."""
    return [b[..., 0].tolist() for b in stream]


BATCHINGS = [
    pytest.param({"batch_size": None}, id="nobatch"),
    pytest.param({"batch_size": 3}, id="b3"),
    pytest.param({"batch_size": 4, "drop_last": True}, id="b4-droplast"),
]


# -- torch's semantics ---------------------------------------------------------------------


@pytest.mark.parametrize("kw", BATCHINGS)
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_same_batches_as_torch(num_workers, kw):
    ours = loader(Sharded(), num_workers, **kw)
    theirs = DataLoader(Sharded(), num_workers=num_workers, **kw)
    for _ in range(2):
        got, want = list(ours), list(theirs)
        assert values(got) == values(want)
        assert [(b.dtype, b.shape) for b in got] == [(b.dtype, b.shape) for b in want]
    assert len(ours) == len(theirs)
    assert (ours.batch_size, ours.drop_last) == (theirs.batch_size, theirs.drop_last)


def test_unbatched_items_are_not_converted_and_custom_collate_runs_per_batch():
    class Ints(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    assert list(loader(Ints(), batch_size=None)) == [0, 1, 2, 3, 4]
    got = list(loader(Ints(), batch_size=2, collate_fn=lambda items: ("batch", items)))
    assert got == [("batch", [0, 1]), ("batch", [2, 3]), ("batch", [4])]


def test_len_and_torch_length_warning():
    class Unsharded(Sharded):  # every worker yields everything: 2 * len(dataset) items
        def __iter__(self):
            yield from range(self.n)

    ld = loader(Unsharded(5), 2, batch_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(1 for _ in ld) == 10  # no warning before len() was asked (list() would ask it)
    assert len(ld) == 5
    it = iter(ld)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            next(it)
    with pytest.warns(
        UserWarning,
        match=r"was reported to be 5\(when accessing len\(dataloader\)\), but 6 samples "
        r"have been fetched\. For multiprocessing data-loading, this",
    ):
        next(it)
    it.close()
    assert len(loader(Sharded(10), batch_size=3)) == 4
    assert len(loader(Sharded(10), batch_size=3, drop_last=True)) == 3
    with pytest.raises(TypeError):
        len(loader(Unsharded.__bases__[0].__bases__[0]()))  # an IterableDataset without __len__


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_in_iter_propagates(num_workers):
    class Broken(IterableDataset):
        def __iter__(self):
            raise RuntimeError("Error in __iter__")

    with pytest.raises(RuntimeError, match="Error in __iter__"):
        list(loader(Broken(), num_workers))


def test_torch_argument_errors():
    with pytest.raises(
        ValueError, match="DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle=True"
    ):
        loader(Sharded(), shuffle=True)
    with pytest.raises(
        ValueError, match="batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
    ):
        loader(Sharded(), batch_size=None, drop_last=True)
    with pytest.raises(ValueError, match="batch_size should be a positive integer value, but got batch_size=0"):
        loader(Sharded(), batch_size=0)
    with pytest.raises(LoaderUsageError, match="not a SavableDataset"):
        TorchIterableSource(sl.sources.IterableSource(lambda info: [], sl.WorkerConfig()), sl.WorkerConfig())


# -- worker ids ----------------------------------------------------------------------------


class WhoAmI(IterableDataset):
    """Yields, per item of its share, what get_worker_info() says."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        assert info is not None and info.dataset is self
        for i in range(info.id, self.n, info.num_workers):
            yield [i, info.id, info.num_workers, int(info.seed < 2**63)]


def test_workers_see_logical_ids_after_a_restore():
    ld = loader(WhoAmI(), 2, batch_size=None)
    it = iter(ld)
    first = [next(it) for _ in range(3)]  # workers 0, 1, 0: worker 1 yields next
    state = ld.save_state_rank()
    it.close()
    assert state.position.next_worker == 1
    fresh = loader(WhoAmI(), 2, batch_size=None)
    with pytest.warns(ReplayWarning):
        fresh.restore_state_rank(decode(encode(state)))
    rest = list(fresh)
    full = list(loader(WhoAmI(), 2, batch_size=None))
    assert first + rest == full
    assert all(item[0] % 2 == item[1] and item[2:] == [2, 1] for item in full)


class StartEnd(IterableDataset):
    """torch's documentation example: ``worker_init_fn`` gives each worker's copy its range."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        for i in range(self.start, self.end):
            yield torch.tensor([i, random.randint(0, 10**6)])


def start_end_init(worker_id: int) -> None:
    info = get_worker_info()
    ds = info.dataset
    assert worker_id == info.id and isinstance(ds, StartEnd)
    per_worker = -(-(ds.end - ds.start) // info.num_workers)
    ds.start = ds.start + worker_id * per_worker
    ds.end = min(ds.start + per_worker, ds.end)


@ignore_replay
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_init_fn_sharding_resumes_everywhere(persistent):
    # persistent workers restored with rotated roles (odd save points) are restarted
    # after the restored epoch, or their copies would serve the other worker's range
    def factory():
        return loader(StartEnd(3, 20), 2, batch_size=2, worker_init_fn=start_end_init, persistent_workers=persistent)

    assert values(list(factory())) == values(
        list(DataLoader(StartEnd(3, 20), batch_size=2, num_workers=2, worker_init_fn=start_end_init))
    )
    assert check_resume_everywhere(factory, 3, steps=[0, 1, 3, 4, 7, 9, 10, 12], variants=VARIANTS) == 23


# -- resume ------------------------------------------------------------------------------


@ignore_replay
@pytest.mark.parametrize("kw", BATCHINGS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_everywhere_by_replay(num_workers, kw):
    def factory():
        return loader(Sharded(), num_workers, **kw)

    length = len(list(factory()))
    assert check_resume_everywhere(factory, 2, steps=steps_for(num_workers, length), variants=VARIANTS) >= 20


@pytest.mark.parametrize("kw", BATCHINGS[:2])
@pytest.mark.parametrize(("num_workers", "policy"), [(0, "every"), (0, "default"), (2, "every"), (2, "default")])
def test_resume_everywhere_by_state_dict(num_workers, policy, kw, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)

    def factory():
        return loader(StatefulSharded(), num_workers, **kw)

    length = len(list(factory()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayWarning)  # a Stateful dataset is never replayed
        assert check_resume_everywhere(factory, 2, steps=steps_for(num_workers, length), variants=VARIANTS) >= 20


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_restore_produces_no_item_twice(num_workers, monkeypatch):
    """With a snapshot before every batch, a resumed run produces exactly the items it
    yields: nothing is replayed (counted across processes)."""
    set_snapshot_policy(monkeypatch, "every")
    counter = multiprocessing.get_context("fork").Value("i", 0)
    for k in (1, 4, 7):
        ld = loader(StatefulSharded(N, counter), num_workers, batch_size=2)
        it = iter(ld)
        for _ in range(k):
            next(it)
        state = ld.save_state_rank()
        it.close()
        fresh = loader(
            StatefulSharded(N, counter), num_workers, batch_size=2, prefetch_factor=1 if num_workers else None
        )
        fresh.restore_state_rank(decode(encode(state)))
        counter.value = 0
        rest = list(fresh)
        assert sum(len(b) for b in rest) == N - 2 * k
        assert counter.value == N - 2 * k, f"k={k}: produced {counter.value} items for {N - 2 * k} left"


def test_replay_warning_says_how_many_items_per_worker():
    ld = loader(Sharded(), 2, batch_size=3)
    it = iter(ld)
    for _ in range(3):  # worker 0: 2 batches, worker 1: 1 batch
        next(it)
    state = ld.save_state_rank()
    it.close()
    fresh = loader(Sharded(), 2, batch_size=3)
    with pytest.warns(ReplayWarning) as record:
        fresh.restore_state_rank(state)
    assert len(record) == 1 and record[0].filename == __file__  # raised once, at the user's restore call
    assert str(record[0].message) == (
        "Sharded is a torch IterableDataset without state_dict()/load_state_dict(): rank 0 resumes epoch 0 by "
        "iterating it again and discarding the items its workers had produced (worker 0: 6 items; worker 1: 3 "
        "items), which costs as long as producing them did. To restore without replay: implement "
        "state_dict()/load_state_dict() returning plain values (torchdata's Stateful protocol), or use "
        "savable_loader.sources.IterableSource (a generator function with an explicit position)"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(fresh)
        # after the restored epoch ended the state points at the next epoch's start: no replay
        loader(Sharded(), 2, batch_size=3).restore_state_rank(fresh.save_state_rank())


class ShuffledInIter(IterableDataset):
    """``__iter__`` itself (not a generator) shuffles with the global RNG, as many do."""

    def __iter__(self):
        worker, workers = _shard()
        order = list(range(worker, 19, workers))
        random.shuffle(order)
        return iter(order)


class DifferentOwnSeed(IterableDataset):
    """Seeds a private generator from ``get_worker_info().seed`` (workers) or
    ``torch.initial_seed()`` (main process) in ``__iter__``, as augmentation code does."""

    def __iter__(self):
        info = get_worker_info()
        seed = info.seed if info is not None else torch.initial_seed()
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        worker, workers = _shard()
        for i in range(worker, 15, workers):
            yield torch.tensor([i, int(torch.randint(0, 10**6, (), generator=g)), int(rng.integers(10**6))])


@ignore_replay
@pytest.mark.parametrize("dataset", [ShuffledInIter, DifferentOwnSeed])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_draws_outside_the_batches_resume(num_workers, dataset):
    """Draws made by ``__iter__`` itself, or by generators seeded from the worker's seed."""

    def factory():
        return loader(dataset(), num_workers, batch_size=2)

    epochs = epochs_of(factory(), 2)
    assert not all(torch.equal(a, b) for a, b in zip(*epochs)), "every epoch drew the same numbers"
    assert check_resume_everywhere(factory, 2, steps=steps_for(num_workers, len(epochs[0]))) >= 8


@ignore_replay
@pytest.mark.parametrize("dataset", [Sharded, StatefulSharded])
def test_restored_into_spawn_workers(dataset):
    # the stream does not depend on the start method: fork for the reference and the
    # saves, spawn (each worker imports torch: slow) for one restore
    def spawn():
        return loader(dataset(), 2, batch_size=3, multiprocessing_context="spawn")

    assert check_resume_everywhere(lambda: loader(dataset(), 2, batch_size=3), 1, restore_factory=spawn, steps=[3]) == 1


@ignore_replay
@pytest.mark.parametrize("dataset", [Sharded, StatefulSharded])
def test_persistent_workers_resume(dataset):
    def factory():
        return loader(dataset(), 2, batch_size=3, persistent_workers=True)

    assert check_resume_everywhere(factory, 3, steps=[0, 3, 8, 9, 12, 17], variants=VARIANTS) >= 16


# -- errors ------------------------------------------------------------------------------


class Opaque:
    pass


class BadState(Sharded):
    def __init__(self, late: bool = False) -> None:
        super().__init__()
        self.late = late
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.seen, "cache": Opaque() if (self.seen or not self.late) else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __iter__(self):
        for item in super().__iter__():
            self.seen += 1
            yield item


def test_state_dict_that_cannot_be_stored_is_refused_naming_the_field_and_the_way_out():
    with pytest.raises(StateError) as e:
        loader(BadState())
    assert str(e.value).startswith(
        "BadState.state_dict()['cache'] is a tests.sources.test_torch_iterable.Opaque, which a savable_loader state "
        "cannot hold exactly"
    )
    assert "savable_loader.sources.IterableSource" in str(e.value) and "state_dict()/load_state_dict()" in str(e.value)
    with pytest.raises(
        StateError, match=r"BadState.state_dict\(\)\['cache'\] is a tests.sources.test_torch_iterable.Opaque"
    ):
        list(loader(BadState(late=True), batch_size=2))  # refused at the first snapshot


def test_changed_num_workers_world_size_and_batch_size_are_refused():
    ld = loader(Sharded(), 2, batch_size=3)
    it = iter(ld)
    next(it)
    state = ld.save_state_rank()
    it.close()
    with pytest.raises(ConfigMismatchError, match="num_workers was 2 when the state was saved, but is 3 now"):
        loader(Sharded(), 3, batch_size=3).restore_state_rank(state)
    with pytest.raises(
        ConfigMismatchError, match=r"dataset_config.batch_size was 3 when the state was saved, but is 4"
    ):
        loader(Sharded(), 2, batch_size=4).restore_state_rank(state)
    with pytest.raises(ConfigMismatchError, match="world_size"):
        loader(Sharded(), 2, batch_size=3).restore_state_global([state, state])


def test_restore_keys_are_refused_with_the_reason():
    ld = loader(Sharded(), batch_size=2)
    next(iter(ld))
    key = ld.restore_key
    assert key is not None
    with pytest.raises(RestoreKeyError, match="Sharded is a torch IterableDataset: it cannot build one batch alone"):
        ld.restore_sample(key)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        # a snapshot before every batch: this source replays to the saved position itself
        (
            1e12,
            (
                r"Sharded: worker 0's iterator ended after 4 batches \(7 items\) while replaying to the saved "
                r"position of 5 batches \(10 items\)"
            ),
        ),
        # one snapshot, after the first batch: the worker replays the other four (skip offset)
        (0.0, r"worker 0's pipeline ended after 4 samples while replaying to the saved position of 5 samples"),
    ],
)
def test_a_dataset_that_yields_less_on_replay_is_an_error(budget, message, monkeypatch):
    monkeypatch.setattr("savable_loader.pipeline.worker.SNAPSHOT_BUDGET", budget)
    ld = loader(Sharded(), batch_size=2)
    it = iter(ld)
    for _ in range(5):
        next(it)
    state = ld.save_state_rank()
    it.close()
    fresh = loader(Sharded(), batch_size=2)
    with pytest.warns(ReplayWarning):
        fresh.restore_state_rank(state)
    fresh._mode.source.dataset.n = 7  # the stream changed: 3 batches and a short one
    with pytest.raises(DataError, match=message):
        list(fresh)


def test_pipeline_composition():
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=1)

    def factory():
        pipeline = sl.wrappers.BatchDataset(TorchIterableSource(StatefulSharded(), wc), 4)
        return sl.SavableDataLoader(pipeline, batch_size=None, worker_config=wc)

    assert check_resume_everywhere(factory, 2) >= 14
    first = next(iter(factory()))
    assert isinstance(first, torch.Tensor) and first.shape == (4, 4)


def test_state_round_trip_keeps_tuples_for_load_state_dict():
    ds = StatefulSharded()
    ld = loader(ds, batch_size=2)
    it = iter(ld)
    next(it)
    state = decode(encode(ld.save_state_rank()))
    it.close()
    fresh = StatefulSharded()
    fl = loader(fresh, batch_size=2)
    fl.restore_state_rank(state)
    next(iter(fl))
    assert fresh.loaded is None, "load_state_dict went to the user's object, not to a copy"
    live = fl._mode.source._live
    assert live is not fresh and isinstance(live.loaded["rng"], tuple)
    assert live.loaded["pos"] == 2


def datapipe() -> Any:
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(list(range(30))).shuffle(buffer_size=7).sharding_filter().map(lambda x: [x, random.random()])


@ignore_replay
@pytest.mark.parametrize("num_workers", [0, 2])
def test_datapipe_shuffles_and_shards_as_torch_and_resumes(num_workers):
    def factory():
        return loader(datapipe(), num_workers, batch_size=4, shuffle=True)

    epochs = epochs_of(factory(), 2)
    assert [sorted(x for b in e for x in b[0].tolist()) for e in epochs] == [list(range(30))] * 2
    assert epochs[0][0][0].tolist() != epochs[1][0][0].tolist(), "both epochs were shuffled alike"
    ours = [b[0].tolist() for b in loader(datapipe(), num_workers, batch_size=4, shuffle=False)]
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    theirs = [b[0].tolist() for b in DataLoader(datapipe(), num_workers=num_workers, batch_size=4, shuffle=False, **kw)]
    assert ours == theirs  # torch's sharding over workers
    assert check_resume_everywhere(factory, 2, steps=steps_for(num_workers, len(epochs[0]))) >= 8
