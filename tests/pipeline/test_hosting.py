"""Resume a savable pipeline with another ``num_workers`` (``savable_loader/pipeline/hosting.py``).

A state saved with K workers restored with K' (0: in the main process): the rest of the
saved epoch keeps the K logical workers, hosted by the K' loading contexts. The tests
compare whole streams, each item tagged with its logical worker:

* over the two runs each logical worker yields exactly its items of the uninterrupted
  K run, in the same order (so every item exactly once), at every save point;
* a state saved during such a resized run and restored with K' again continues it bit
  for bit (order included); restored with yet another K'' still exactly once;
* later epochs are ordinary K'-worker epochs, except for pipelines that carry state
  across epochs, whose K logical workers go on hosted.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.pipeline.hosting import MAX_LOGICAL_WORKERS, hosted_by, hosts, interleave
from savable_loader.pipeline.worker import End, Item
from savable_loader.sources import ShardedFileDataset, write_shards
from savable_loader.state import decode, encode
from savable_loader.wrappers import EpochizeDataset, MapDataset, ShuffleBufferDataset
from tests.common import RangeSource, assert_same, assert_streams, check_resume_everywhere

pytestmark = pytest.mark.timeout(300)

SEED = 5
N = 14  # samples per epoch (the shuffle-buffer pipeline)
PAIRS = [(2, 1), (2, 3), (3, 2), (2, 0), (0, 2), (1, 2)]

Factory = Callable[[int], sl.SavableDataLoader]
Tagged = list[tuple[int, Any]]


def augment(x: Any) -> tuple[Any, float, float, float]:
    """A per-sample random augmentation from the three global RNGs."""
    return x, random.random(), float(np.random.rand()), float(torch.rand(()))


def loader_of(ds: sl.SavableDataset, **kw: Any) -> sl.SavableDataLoader:
    if ds.worker_config.num_workers:
        kw.setdefault("multiprocessing_context", "fork")
        kw.setdefault("timeout", 60)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, **kw)


def shuffled(workers: int, n: int = N, **kw: Any) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
    return loader_of(ShuffleBufferDataset(MapDataset(RangeSource(n, wc), augment), 4), **kw)


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hosting_shards")
    write_shards(folder, [np.arange(a, b, dtype=np.int64).reshape(-1, 1) for a, b in ((0, 5), (5, 8), (8, 14))])
    return folder


def sharded(folder: Path) -> Factory:
    def make(workers: int, **kw: Any) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
        return loader_of(MapDataset(ShardedFileDataset(folder, wc), augment), **kw)

    return make


def tagged(loader: sl.SavableDataLoader, it: Any, limit: int | None = None) -> Tagged:
    """Items of ``it`` (an iterator of ``loader``), each with its logical worker."""
    out: Tagged = []
    for item in it:
        out.append((loader._mode.last_item[1], item))
        if limit is not None and len(out) == limit:
            break
    return out


def epochs(loader: sl.SavableDataLoader, count: int) -> list[Tagged]:
    return [tagged(loader, iter(loader)) for _ in range(count)]


def roundtrip(loader: sl.SavableDataLoader) -> sl.state.RankState:
    return decode(encode(loader.save_state_rank()))


def per_worker(items: Tagged) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for w, x in items:
        out.setdefault(w, []).append(x)
    return out


def assert_exactly_once(parts: list[Tagged], reference: Tagged, what: str) -> None:
    """The items of ``parts`` (one epoch over several runs) are the reference's: per
    logical worker the same items in the same order."""
    got, want = per_worker([x for p in parts for x in p]), per_worker(reference)
    assert sorted(got) == sorted(want), f"{what}: logical workers {sorted(got)}, expected {sorted(want)}"
    for w in want:
        assert_streams(got[w], want[w], f"{what}, logical worker {w}")


def saved_at(factory: Factory, workers: int, k: int, between: bool) -> tuple[Tagged, sl.state.RankState]:
    """``k`` items of epoch 0 (``between``: the whole epoch, the loop ended), then a save."""
    loader = factory(workers)
    it = iter(loader)
    before = tagged(loader, it, limit=k) if k else []
    if between:
        assert not tagged(loader, it)
    state = roundtrip(loader)
    del it
    return before, state


def save_points(n: int, in_process: bool) -> list[tuple[int, bool]]:
    ks = range(n + 1) if in_process else sorted({0, 1, 3, n // 2, n - 1, n})
    return [(k, False) for k in ks] + [(n, True)]


# -- the layout and the interleaving ------------------------------------------------------


def test_layout_hosts_every_logical_worker_once_and_rotates_the_slots():
    for logical in range(1, 6):
        for contexts in range(1, 6):
            n = hosts(logical, contexts)
            for rotation in range(n):
                ids = [hosted_by(p, rotation, logical, contexts) for p in range(contexts)]
                assert sorted(i for part in ids for i in part) == list(range(logical)), (logical, contexts, rotation)
                assert ids[0][0] == rotation  # the slot that yields next is played by worker 0
                assert all(not i for i in ids[n:])  # more contexts than logical workers: idle
    assert hosted_by(0, 0, logical=1, contexts=1) == [0]


def test_interleave_takes_the_fewest_produced_then_the_lowest_id():
    a = iter([Item(0, 2, None, "a2"), Item(0, 3, None, "a3"), End(0, 4)])
    b = iter([Item(2, 0, None, "b0"), Item(2, 1, None, "b1"), Item(2, 2, None, "b2"), End(2, 3)])
    exhausted = iter([])  # a logical worker restored exhausted yields nothing
    got = [getattr(i, "payload", f"end{i.worker}") for i in interleave([(0, 2, a), (2, 0, b), (1, 5, exhausted)])]
    assert got == ["b0", "b1", "a2", "b2", "a3", "end2", "end0"]


# -- 1. saved with K, restored with K': every item exactly once, each logical worker's stream


def check_resized(factory: Factory, k_from: int, k_to: int, steps: list[tuple[int, bool]] | None = None) -> None:
    reference = epochs(factory(k_from), 1)[0]
    following = epochs(factory(k_to), 3)  # the K' run's epochs 1 and 2
    n = len(reference)
    points = steps if steps is not None else save_points(n, in_process=not (k_from or k_to))
    for k, between in points:
        before, state = saved_at(factory, k_from, k, between)
        assert state.config.num_workers == k_from
        loader = factory(k_to)
        loader.restore_state_rank(state)
        after = epochs(loader, 2)
        where = f"K={k_from} -> K'={k_to}, saved after {k} items{' (loop ended)' if between else ''}"
        if between or k == 0:  # an epoch's start: that epoch is an ordinary K' epoch
            e = 1 if between else 0
            assert_streams(after[0], following[e], f"{where}: epoch {e} (the K' split)")
            assert_streams(after[1], following[e + 1], f"{where}: epoch {e + 1} (the K' split)")
            assert_exactly_once([before], reference if between else [], f"{where}: epoch 0")
            continue
        assert_exactly_once([before, after[0]], reference, f"{where}: epoch 0")
        assert_streams(after[1], following[1], f"{where}: epoch 1 (the K' split)")


@pytest.mark.parametrize(("k_from", "k_to"), PAIRS)
def test_shuffle_buffer_pipeline_resumes_with_another_num_workers(k_from: int, k_to: int) -> None:
    check_resized(shuffled, k_from, k_to)


@pytest.mark.parametrize(("k_from", "k_to"), PAIRS)
def test_sharded_pipeline_with_augmentation_resumes_with_another_num_workers(
    shard_folder: Path, k_from: int, k_to: int
) -> None:
    factory = sharded(shard_folder)
    check_resized(factory, k_from, k_to)
    # the K' epochs read every sample exactly once
    ids = sorted(int(x[0][0]) for _, x in epochs(factory(k_to), 1)[0])
    assert ids == list(range(14))


def test_in_process_hosting_keeps_the_callers_rng(shard_folder: Path) -> None:
    _, state = saved_at(shuffled, 3, 4, False)
    loader = shuffled(0)
    loader.restore_state_rank(state)
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    assert len(list(loader)) == N - 4
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


# -- 2. a state saved during the resized run ---------------------------------------------


def resized(factory: Factory, k_from: int, k: int, k_to: int, **kw: Any) -> Callable[[], sl.SavableDataLoader]:
    """Loaders with ``k_to`` workers restored from the ``k_from`` state after ``k`` items."""
    _, state = saved_at(factory, k_from, k, False)

    def make() -> sl.SavableDataLoader:
        loader = factory(k_to, **kw)
        loader.restore_state_rank(state)
        return loader

    return make


@pytest.mark.parametrize(("k_from", "k_to", "k"), [(3, 0, 4), (2, 0, 1), (0, 2, 5), (3, 2, 5), (2, 1, 3)])
def test_a_state_saved_during_the_resized_run_continues_it_bit_for_bit(k_from: int, k_to: int, k: int) -> None:
    make = resized(shuffled, k_from, k, k_to)
    steps = None if k_to == 0 else [0, 1, 2, 4, 6, N - k, N - k + 3]
    assert check_resume_everywhere(make, epochs=2, steps=steps, restore_factory=lambda: shuffled(k_to)) > 0


def test_a_state_saved_during_the_resized_run_goes_on_exactly_once_under_a_third_num_workers() -> None:
    reference = epochs(shuffled(3), 1)[0]
    for k_to, j, k_third in [(0, 3, 2), (2, 2, 0), (1, 4, 3), (0, 0, 1)]:
        before, state = saved_at(shuffled, 3, 4, False)
        middle = shuffled(k_to)
        middle.restore_state_rank(state)
        it = iter(middle)
        mid = tagged(middle, it, limit=j) if j else []
        state2 = roundtrip(middle)
        assert len(state2.position.workers) == 3 and state2.config.num_workers == k_to
        del it
        last = shuffled(k_third)
        last.restore_state_rank(state2)
        rest = tagged(last, iter(last))
        assert_exactly_once([before, mid, rest], reference, f"3 -> {k_to} ({j} items) -> {k_third}")


def test_num_workers_changed_again_and_again() -> None:
    reference = epochs(shuffled(2), 1)[0]
    following = epochs(shuffled(3), 2)[1]
    parts: list[Tagged] = []
    state = None
    for workers, take in [(2, 3), (1, 2), (3, 1), (0, 2), (2, 0), (3, 2)]:
        loader = shuffled(workers)
        if state is not None:
            loader.restore_state_rank(state)
        it = iter(loader)
        parts.append(tagged(loader, it, limit=take) if take else [])
        state = roundtrip(loader)
        del it
    loader = shuffled(3)
    loader.restore_state_rank(state)
    parts.append(tagged(loader, iter(loader)))
    assert_exactly_once(parts, reference, "2 -> 1 -> 3 -> 0 -> 2 -> 3")
    assert_streams(tagged(loader, iter(loader)), following, "the next epoch: the 3-worker split")


# -- 3. pipelines that carry state across epochs ------------------------------------------


def epochized(workers: int, **kw: Any) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
    inner = ShuffleBufferDataset(MapDataset(RangeSource(60, wc), augment), 3)
    return loader_of(EpochizeDataset(inner, 8), **kw)


@pytest.mark.parametrize(("k_from", "k_to"), [(2, 0), (2, 3), (0, 2), (3, 2)])
def test_a_carrying_pipeline_keeps_its_logical_workers_hosted_in_later_epochs(k_from: int, k_to: int) -> None:
    reference = epochs(epochized(k_from), 4)
    for k in (1, 3, 5):
        before, state = saved_at(epochized, k_from, k, False)
        loader = epochized(k_to)
        loader.restore_state_rank(state)
        after = epochs(loader, 4)
        assert_exactly_once([before, after[0]], reference[0], f"{k_from} -> {k_to} at {k}: epoch 0")
        for e in (1, 2, 3):  # the logical workers go on: each one's stream is unchanged
            assert_exactly_once([after[e]], reference[e], f"{k_from} -> {k_to} at {k}: epoch {e}")
        # and a state of a later hosted epoch, restored with the saved num_workers, goes on exactly
        again = epochized(k_to)
        again.restore_state_rank(state)
        it = iter(again)
        list(it)
        it = iter(again)
        head = tagged(again, it, limit=2)
        mid = roundtrip(again)
        del it
        back = epochized(k_from)
        back.restore_state_rank(mid)
        assert_exactly_once([head, tagged(back, iter(back))], reference[1], f"{k_from} -> {k_to} -> {k_from}")


def test_a_carrying_pipeline_saved_between_epochs_goes_on_hosted() -> None:
    reference = epochs(epochized(3), 3)
    before, state = saved_at(epochized, 3, 8, True)  # epoch 1's start, carrying 3 end states
    assert_exactly_once([before], reference[0], "epoch 0")
    loader = epochized(2)
    loader.restore_state_rank(state)
    after = epochs(loader, 2)
    for e in (1, 2):
        assert_exactly_once([after[e - 1]], reference[e], f"epoch {e}")


def test_a_carrying_pipeline_with_persistent_workers_goes_on_hosted() -> None:
    reference = epochs(epochized(2), 3)
    before, state = saved_at(epochized, 2, 3, False)
    loader = epochized(1, persistent_workers=True)
    loader.restore_state_rank(state)
    after = epochs(loader, 3)
    assert_exactly_once([before, after[0]], reference[0], "epoch 0")
    for e in (1, 2):
        assert_exactly_once([after[e]], reference[e], f"epoch {e}")


# -- 4. persistent workers, spawn, restore keys ------------------------------------------


@pytest.mark.parametrize(("k_from", "k_to"), [(2, 3), (3, 1)])
def test_persistent_workers_host_then_take_their_own_split(k_from: int, k_to: int) -> None:
    reference = epochs(shuffled(k_from), 1)[0]
    following = epochs(shuffled(k_to), 3)
    for k in (1, 5):
        before, state = saved_at(shuffled, k_from, k, False)
        loader = shuffled(k_to, persistent_workers=True)
        loader.restore_state_rank(state)
        after = epochs(loader, 3)
        assert_exactly_once([before, after[0]], reference, f"persistent {k_from} -> {k_to} at {k}")
        assert_streams(after[1], following[1], "epoch 1")
        assert_streams(after[2], following[2], "epoch 2")


def test_spawn_workers_host_logical_workers() -> None:
    reference = epochs(shuffled(3), 1)[0]
    before, state = saved_at(shuffled, 3, 4, False)
    loader = shuffled(2, multiprocessing_context="spawn")
    loader.restore_state_rank(state)
    assert_exactly_once([before, tagged(loader, iter(loader))], reference, "3 -> 2 (spawn)")


def test_restore_sample_rebuilds_a_key_made_under_other_logical_workers() -> None:
    loader = shuffled(0)
    _, state = saved_at(shuffled, 3, 2, False)
    loader.restore_state_rank(state)
    keyed = []
    for item in loader:
        keyed.append((loader.restore_key, item))
    assert {k.num_workers for k, _ in keyed} == {3}  # the key names the logical view
    for key, item in keyed:
        for target in (shuffled(0), shuffled(2), shuffled(3)):  # any num_workers rebuilds it
            assert_same(target.restore_sample(str(key)), item)
    # and a key of an ordinary 3-worker run, on a 1-worker loader
    run = shuffled(3)
    it = iter(run)
    first = next(it)
    key = run.restore_key
    del it
    assert key is not None and key.num_workers == 3
    assert_same(shuffled(1).restore_sample(key), first)
    # a key's num_workers is checked like its other fields
    for bad, message in ((-1, "expected an int >= 0"), (True, "expected an int >= 0"), (10**6, "at most 1024")):
        with pytest.raises(sl.errors.RestoreKeyError, match=message):
            shuffled(1).restore_sample(msgspec.structs.replace(key, num_workers=bad))


class _Locked(RangeSource):
    """A source holding a lock: fine in forked workers, but it cannot be copied."""

    def __init__(self, n: int, wc: sl.WorkerConfig) -> None:
        super().__init__(n, wc)
        self.lock = threading.Lock()


def test_a_pipeline_that_cannot_be_copied_names_num_workers() -> None:
    # resumed with fewer workers, a process hosts several logical workers, each in a copy
    def make(workers: int) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
        return loader_of(_Locked(N, wc))

    loader = make(2)
    it = iter(loader)
    next(it)
    state = roundtrip(loader)
    del it
    fewer = make(0)
    fewer.restore_state_rank(state)
    with pytest.raises(
        sl.ConfigMismatchError, match=r"num_workers was 2 .* cannot be copied .*restore with num_workers=2"
    ):
        list(fewer)
    same = make(2)  # the saved num_workers: no copy needed
    same.restore_state_rank(state)
    assert len(list(same)) == N - 1


# -- 6. hostile cases --------------------------------------------------------------------


def test_a_save_right_after_the_restore_and_a_peek() -> None:
    reference = epochs(shuffled(2), 1)[0]
    before, state = saved_at(shuffled, 2, 5, False)
    loader = shuffled(0)
    loader.restore_state_rank(state)
    same = roundtrip(loader)  # before any item: the restored position, as saved
    assert same.position == state.position
    peeked = shuffled(3)
    peeked.restore_state_rank(same)
    first = tagged(peeked, iter(peeked), limit=1)  # a peek consumes the restored item
    after_peek = roundtrip(peeked)
    last = shuffled(1)
    last.restore_state_rank(after_peek)
    assert_exactly_once([before, first, tagged(last, iter(last))], reference, "restore, save, peek, save")


def test_more_workers_than_logical_workers_over_an_infinite_stream() -> None:
    """K' > K with a stream that never ends: the extra workers host nothing and end at
    once; the K logical workers go on, no hang, no error."""

    def endless(workers: int, **kw: Any) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
        return loader_of(MapDataset(RangeSource(10**9, wc), augment), **kw)

    plain = endless(1)
    reference = tagged(plain, iter(plain), limit=12)
    loader = endless(1)
    it = iter(loader)
    before = tagged(loader, it, limit=4)
    state = roundtrip(loader)
    del it
    wide = endless(3)
    wide.restore_state_rank(state)
    after = tagged(wide, iter(wide), limit=8)
    assert [w for w, _ in after] == [0] * 8
    assert_streams([x for _, x in before + after], [x for _, x in reference], "1 -> 3 over an endless stream")


def test_an_epoch_start_position_takes_the_loaders_own_split() -> None:
    _, state = saved_at(shuffled, 3, N, True)  # between epochs: epoch 1's start
    loader = shuffled(2)
    loader.restore_state_rank(state)
    assert len(loader.save_state_rank().position.workers) == 2
    assert_streams(tagged(loader, iter(loader)), epochs(shuffled(2), 2)[1], "epoch 1 with 2 workers")


def test_a_malformed_position_is_refused() -> None:
    _, state = saved_at(shuffled, 2, 3, False)
    position = state.position
    broken = sl.state.RankState(
        config=state.config,
        position=type(position)(epoch=0, next_worker=0, workers=[position.workers[1]]),
        library_version=state.library_version,
    )
    with pytest.raises(sl.StateError, match=r"worker ids \[1\]"):
        shuffled(3).restore_state_rank(broken)


def test_a_state_with_too_many_logical_workers_is_refused() -> None:
    # each hosted logical worker is a copy of the pipeline: a hostile count must raise,
    # not exhaust memory
    _, state = saved_at(shuffled, 2, 3, False)
    template = state.position.workers[0]
    many = [msgspec.structs.replace(template, worker_id=w) for w in range(MAX_LOGICAL_WORKERS + 1)]
    broken = msgspec.structs.replace(state, position=msgspec.structs.replace(state.position, workers=many))
    with pytest.raises(sl.StateError, match=rf"{MAX_LOGICAL_WORKERS + 1} logical workers, expected at most"):
        shuffled(1).restore_state_rank(broken)


# -- two ranks (gloo on 127.0.0.1) ---------------------------------------------------------


def _ranks_resize(rank: int, world: int, folder: str, k_from: int, k_to: int, k: int) -> list[int]:
    """On each rank: a sharded pipeline saved with ``k_from`` workers after ``k`` items
    (gathered to rank 0, scattered back), restored with ``k_to``; the epoch's ids."""

    def make(workers: int) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=SEED)
        return loader_of(MapDataset(ShardedFileDataset(folder, wc), augment))

    reference = epochs(make(k_from), 1)[0]
    loader = make(k_from)
    it = iter(loader)
    before = tagged(loader, it, limit=k)
    states = loader.save_state_global(0)
    del it
    if states is not None:
        states = [decode(encode(s)) for s in states]
    resumed = make(k_to)
    resumed.restore_state_global(states, src_rank=0)
    after = tagged(resumed, iter(resumed))
    assert_exactly_once([before, after], reference, f"rank {rank}: {k_from} -> {k_to} at {k}")
    return sorted(int(x[0][0]) for _, x in before + after)


@pytest.mark.parametrize(("k_from", "k_to"), [(2, 1), (1, 3)])
def test_two_ranks_resume_with_another_num_workers(shard_folder: Path, k_from: int, k_to: int) -> None:
    from tests.dist_harness import run_ranks, values

    ids = values(run_ranks(_ranks_resize, 2, str(shard_folder), k_from, k_to, 3, timeout=180))
    assert sorted(ids[0] + ids[1]) == list(range(14))


# -- 5. a plain torch IterableDataset: refused mid-epoch, fine at an epoch's start ----------


class _Split(torch.utils.data.IterableDataset):
    """Integers below 12 split by ``get_worker_info()``."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(worker, 12, workers))


def _plain(workers: int) -> sl.SavableDataLoader:
    kw: dict[str, Any] = {"multiprocessing_context": "fork", "timeout": 60} if workers else {}
    return sl.SavableDataLoader(_Split(), batch_size=2, num_workers=workers, seed=SEED, **kw)


@pytest.mark.parametrize(("k_from", "k_to"), [(2, 1), (2, 0), (0, 1), (1, 3)])
def test_a_torch_iterable_dataset_refuses_another_num_workers_mid_epoch(k_from: int, k_to: int) -> None:
    loader = _plain(k_from)
    it = iter(loader)
    next(it)
    state = roundtrip(loader)
    del it
    with pytest.raises(sl.ConfigMismatchError, match="get_worker_info") as info:
        _plain(k_to).restore_state_rank(state)
    assert (info.value.field, info.value.saved, info.value.current) == ("num_workers", k_from, k_to)
    assert "restore mid-epoch with the saved num_workers" in str(info.value)


def test_a_torch_iterable_dataset_takes_another_num_workers_at_an_epochs_start() -> None:
    loader = _plain(2)
    list(loader)  # the loop ended: the state is epoch 1's start
    state = roundtrip(loader)
    resumed = _plain(1)
    resumed.restore_state_rank(state)
    reference = _plain(1)
    list(reference)
    assert_streams(list(resumed), list(reference), "epoch 1 with 1 worker")


def test_a_stream_source_job_comes_back_with_fewer_workers() -> None:
    """Issue #23: an IterableSource (a stream with an explicit position) saved with 3
    workers, resumed with 1: every item exactly once over the two runs."""

    def make(workers: int) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
        source = sl.sources.IterableSource(lambda info: info.split(range(40)), wc)
        return loader_of(MapDataset(source, augment))

    reference = epochs(make(3), 1)[0]
    for k in (1, 7, 20):
        before, state = saved_at(make, 3, k, False)
        loader = make(1)
        loader.restore_state_rank(state)
        assert_exactly_once([before, tagged(loader, iter(loader))], reference, f"3 -> 1 at {k}")


def test_a_save_leaving_out_the_last_item_in_a_hosted_epoch() -> None:
    """A framework that fetched one item ahead saves without it (``held=1``): restored,
    that item comes first again, and the rest is the hosted run's."""
    make = resized(shuffled, 3, 4, 0)
    reference = make()
    run = tagged(reference, iter(reference))
    for j in (1, 3, 6):
        loader = make()
        it = iter(loader)
        head = tagged(loader, it, limit=j)
        state = decode(encode(loader._save(held=1)))
        del it
        again = shuffled(0)
        again.restore_state_rank(state)
        assert_streams(head[:-1] + tagged(again, iter(again)), run, f"held item after {j}")
