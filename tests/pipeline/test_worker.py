"""savable_loader.pipeline.worker: the snapshot ring, the worker runtime (in-process) and the
dataset torch's DataLoader sees on the pipeline path."""

from __future__ import annotations

import pickle
import random
import threading
import time

import numpy as np
import pytest
import torch

import savable_loader as sl
import savable_loader.pipeline.worker as worker_module
from savable_loader.errors import StateError
from savable_loader.pipeline.worker import (
    End,
    PipelineWorkerDataset,
    SnapshotRing,
    WorkerRuntime,
)
from savable_loader.rng import counter_seed, derive_seed, item_seed, seed_global
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import DatasetState, WorkerState
from savable_loader.wrappers import MapDataset, ShuffleBufferDataset
from tests.common import RangeSource, assert_same, assert_streams

pytestmark = pytest.mark.timeout(60)

N = 13


def _state(i: int) -> DatasetState:
    return DatasetState(type=f"snap{i}")


# -- SnapshotRing ---------------------------------------------------------------------


def test_ring_reset_replaces_everything():
    ring = SnapshotRing()
    assert len(ring) == 0 and ring.find(0) is None and ring.find(10**9) is None
    ring.reset(0, None)
    ring.add(3, _state(3), bound=-1)
    ring.add(7, _state(7), bound=-1)
    assert len(ring) == 3
    ring.reset(5, _state(5))
    assert len(ring) == 1 and ring.newest_index() == 5
    assert ring.find(4) is None
    assert ring.find(5) == (5, _state(5))
    assert ring.find(10**9) == (5, _state(5))


def test_ring_find_returns_newest_at_or_before():
    ring = SnapshotRing()
    ring.reset(0, None)
    for i in (2, 4, 9):
        ring.add(i, _state(i), bound=-1)  # a bound below every index keeps everything
    assert len(ring) == 4 and ring.newest_index() == 9
    assert ring.find(-1) is None
    assert ring.find(0) == (0, None)
    assert ring.find(1) == (0, None)
    assert ring.find(2) == (2, _state(2))
    assert ring.find(3) == (2, _state(2))
    assert ring.find(8) == (4, _state(4))
    assert ring.find(9) == (9, _state(9))
    assert ring.find(100) == (9, _state(9))


def test_ring_prune_keeps_newest_at_or_before_bound_and_everything_after():
    ring = SnapshotRing()
    ring.reset(0, None)

    def indices() -> list[int]:
        return [i for i in range(-1, 200) if ring.find(i) is not None and ring.find(i)[0] == i]

    ring.add(2, _state(2), bound=1)  # newest <= 1 is 0: nothing older to drop
    assert indices() == [0, 2]
    ring.add(4, _state(4), bound=3)  # newest <= 3 is 2: 0 goes
    assert indices() == [2, 4] and ring.find(1) is None and ring.find(3) == (2, _state(2))
    ring.add(6, _state(6), bound=4)  # a bound equal to a snapshot keeps that snapshot
    assert indices() == [4, 6] and ring.find(4) == (4, _state(4))
    ring.add(8, _state(8), bound=-5)  # a bound below everything keeps everything
    assert indices() == [4, 6, 8]
    ring.add(10, _state(10), bound=100)  # a bound past the newest keeps only the newest
    assert indices() == [10] and len(ring) == 1
    ring.add(11, _state(11), bound=10)
    ring.add(12, _state(12), bound=10)
    assert indices() == [10, 11, 12]


def test_ring_is_thread_safe_under_concurrent_add_and_find():
    """One thread adds snapshots at even indices with the bound the other thread
    publishes (the lowest index it may still ask for), as the iterating thread does; the
    other keeps asking for indices at or above that bound and raising it. Every answer
    must be exact, and nothing may raise (a deque mutated during iteration would)."""
    ring = SnapshotRing()
    ring.reset(0, _state(0))
    low = [0]  # lowest index the finder may still ask for
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"adds": 0, "finds": 0}

    def adder() -> None:
        try:
            i = 0
            while not stop.is_set():
                i += 2
                ring.add(i, _state(i), bound=low[0])
                counts["adds"] += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def finder() -> None:
        rnd = random.Random(0)
        try:
            while not stop.is_set():
                newest = ring.newest_index()
                q = rnd.randint(low[0], newest)
                found = ring.find(q)
                expected = q - q % 2
                assert found == (expected, _state(expected)), (q, found, low[0])
                counts["finds"] += 1
                if rnd.random() < 0.05:
                    low[0] = q  # the finder will never ask below q again
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=adder), threading.Thread(target=finder)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors[0]
    assert counts["adds"] > 100 and counts["finds"] > 100, counts
    items = list(ring._items)
    indices = [i for i, _ in items]
    assert indices == sorted(set(indices)), "ring not in strictly increasing order"
    assert all(state == _state(i) for i, state in items)


# -- WorkerRuntime ----------------------------------------------------------------------


def _draws() -> torch.Tensor:
    return torch.tensor([random.randint(0, 10**6), int(np.random.randint(0, 10**6)), int(torch.randint(0, 10**6, ()))])


def stateful_pipeline(num_workers: int = 0, n: int = N) -> sl.SavableDataset:
    """A shuffle buffer (real state: buffered tensors, seed, draw count) and a lambda that
    draws from random, NumPy and torch."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=3)
    ds = ShuffleBufferDataset(RangeSource(n, wc), size=4)
    return MapDataset(ds, lambda x: torch.cat([x, _draws()]))


def plain_pipeline(num_workers: int = 0, n: int = N) -> sl.SavableDataset:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=3)
    return MapDataset(RangeSource(n, wc, keyed=False), lambda x: torch.cat([x, _draws()]))


def runtime(ds: sl.SavableDataset, max_in_flight: int = 1) -> WorkerRuntime:
    return WorkerRuntime(ds, ds.worker_config, max_in_flight, in_process=True)


def reference(epoch: int = 0, worker_id: int = 0, factory=stateful_pipeline) -> list:
    return list(runtime(factory()).run(epoch, worker_id, None))


def test_run_yields_indexed_samples_then_end_marker():
    items = reference()
    assert len(items) == N + 1
    assert [(x.worker, x.item_index) for x in items[:-1]] == [(0, i) for i in range(N)]
    assert items[-1] == End(0, N)
    ids = sorted(int(x.payload[0]) for x in items[:-1])
    assert ids == list(range(N))  # every source value once, shuffled by the buffer
    assert [int(x.payload[0]) for x in items[:-1]] != list(range(N))
    # deterministic: a second runtime gives the same stream, bit for bit
    assert_streams(reference(), items, "second run")


def test_run_reseeds_global_rngs_from_seed_rank_worker_epoch_index():
    # without a buffer, output i is source value i: its draws follow from the re-seeding
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
    items = list(runtime(plain_pipeline(num_workers=2)).run(5, 1, None))
    assert items[-1] == End(1, 6)
    base = derive_seed(wc.seed, "pipeline", wc.rank, 1, 5)
    for i, (w, index, _, sample, _, _) in enumerate(items[:-1]):
        assert (w, index) == (1, i)
        seed_global(item_seed(counter_seed(base, i)))  # below 2**63
        source_draws = _draws()
        map_draws = _draws()
        # worker 1 of 2 reads 1, 3, 5, ...
        assert_same(sample, torch.cat([torch.tensor([2 * i + 1]), source_draws, map_draws]), f"sample {i}")
    other_epoch = list(runtime(plain_pipeline(num_workers=2)).run(6, 1, None))
    assert [int(x.payload[0]) for x in other_epoch[:-1]] == [int(x.payload[0]) for x in items[:-1]]
    assert not torch.equal(
        torch.stack([x.payload for x in other_epoch[:-1]]), torch.stack([x.payload for x in items[:-1]])
    )


@pytest.mark.parametrize("budget", ["default", "every", "never"])
def test_checkpoint_and_restore_at_every_index(budget, monkeypatch):
    if budget == "every":
        monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 1e12)
    elif budget == "never":
        monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 0.0)
    ref = reference(epoch=2)
    assert ref[-1] == End(0, N)
    for k in range(1, N + 2):  # k = N + 1: after the end marker was taken
        rt = runtime(stateful_pipeline())
        run = rt.run(2, 0, None)
        taken = [next(run) for _ in range(k)]
        assert_streams(taken, ref[:k], f"k={k} prefix")
        index = min(k, N)
        state = rt.checkpoint(2, index)
        assert state.worker_id == 0 and state.index == index and not state.exhausted
        assert 0 <= state.snapshot_index <= index
        assert state.skip == index - state.snapshot_index
        if budget == "every":
            # a snapshot after every sample, taken before the sample is yielded
            assert state.snapshot_index == index
            assert rt.snapshots_taken == index
        assert (state.dataset is None) == (state.snapshot_index == 0)
        decoded = decode_part(encode_part(state), WorkerState)
        assert decoded == state
        resumed = list(runtime(stateful_pipeline()).run(2, 0, decoded))
        assert_streams(resumed, ref[index:], f"k={k} continuation")


def test_checkpoint_within_prefetch_window_and_beyond(monkeypatch):
    monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 1e12)
    ref = reference()
    rt = runtime(stateful_pipeline(), max_in_flight=3)
    run = rt.run(0, 0, None)
    for _ in range(8):
        next(run)
    # produced 8 (a snapshot after each); the main process may lag up to 3 behind:
    # snapshots from index 5 on kept
    for index in (5, 6, 7, 8):
        state = rt.checkpoint(0, index)
        assert state.snapshot_index == index
        assert_streams(list(runtime(stateful_pipeline()).run(0, 0, state)), ref[index:], f"index {index}")
    with pytest.raises(StateError, match="no snapshot at or before sample 2"):
        rt.checkpoint(0, 2)


def test_checkpoint_for_wrong_epoch_is_a_state_error():
    rt = runtime(stateful_pipeline())
    with pytest.raises(StateError, match="worker -1 is in epoch -1, asked for epoch 0"):
        rt.checkpoint(0, 0)  # nothing started yet
    run = rt.run(3, 0, None)
    next(run)
    with pytest.raises(StateError, match="worker 0 is in epoch 3, asked for epoch 2"):
        rt.checkpoint(2, 1)
    with pytest.raises(StateError, match="asked for epoch 4"):
        rt.checkpoint(4, 1)
    assert rt.checkpoint(3, 1).index == 1


def test_exhausted_start_yields_nothing():
    rt = runtime(stateful_pipeline())
    start = WorkerState(worker_id=0, index=N, snapshot_index=N, exhausted=True)
    assert list(rt.run(0, 0, start)) == []
    assert rt.snapshots_taken == 0


def test_restore_from_start_state_with_skip_counts_replayed_samples():
    # a start with no snapshot (dataset None) and skip 5: replays 5 samples, yields the rest
    ref = reference()
    start = WorkerState(worker_id=0, index=5, snapshot_index=0, dataset=None)
    got = list(runtime(stateful_pipeline()).run(0, 0, start))
    assert_streams(got, ref[5:], "skip 5")
    assert got[-1] == End(0, N)


def _in_process_loader(ds: sl.SavableDataset) -> sl.SavableDataLoader:
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config)


def test_in_process_loading_leaves_caller_rng_untouched():
    """The loader's next() sets the caller's streams aside around the runtime's items
    (PipelineIteration.caller_scope); the runtime itself, as in a worker process, draws
    from the global generators."""

    def caller_draws():
        return (random.random(), float(np.random.rand()), float(torch.rand(())))

    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    expected = [caller_draws() for _ in range(N + 1)]
    loader = _in_process_loader(stateful_pipeline())
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    got = [caller_draws()]
    samples = []
    for payload in loader:
        got.append(caller_draws())
        samples.append(payload[1:])
    assert got == expected
    # the pipeline did draw: the per-sample draws differ from each other
    assert len({tuple(s.tolist()) for s in samples}) == N

    # contrast: the runtime alone (no loader around it) moves the global streams
    random.seed(11)
    next(runtime(stateful_pipeline()).run(0, 0, None))
    assert random.random() != expected[0][0]


class ResetDrawsSource(sl.SavableDataset):
    """Draws from the global RNGs in ``reset_state_own`` (at the start of every epoch and
    of every restore), not only while iterating."""

    _savable_fields = ("order", "pos")

    def __init__(self, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.order = list(range(6))
        random.shuffle(self.order)
        self.order.append(int(np.random.randint(0, 100)) + int(torch.randint(0, 100, ())))
        self.pos = 0

    def __iter__(self):
        while self.pos < len(self.order):
            self.pos += 1
            yield self.order[self.pos - 1]

    def config(self) -> dict:
        return {}


@pytest.mark.parametrize("seed", range(4))
def test_a_caller_drawing_any_amount_between_batches_keeps_its_python_stream(seed):
    """Between two next() of an in-process loader the caller draws from Python's random
    (a few words, up to and across the end of a block of 624, a gauss, a re-seed): its
    stream is a twin's that never met the loader (the same draws; after a seed the same
    getstate()), and the batches are the reference's."""
    plan = random.Random(seed)
    reference = list(_in_process_loader(stateful_pipeline()))
    random.seed(seed)
    twin = random.Random(seed)
    got = []
    for payload in _in_process_loader(stateful_pipeline()):
        got.append(payload)
        how = plan.randrange(4)
        if how == 0:
            for _ in range(plan.choice([1, 2, 3, 300, 622, 623, 624, 625, 2000])):
                assert random.getrandbits(32) == twin.getrandbits(32)
        elif how == 1:
            assert random.gauss(0, 1) == twin.gauss(0, 1)
        elif how == 2:
            k = plan.randrange(10**6)
            random.seed(k)
            twin.seed(k)
            assert random.getstate() == twin.getstate()
    assert [random.getrandbits(32) for _ in range(2000)] == [twin.getrandbits(32) for _ in range(2000)]
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))


@pytest.mark.parametrize("restore", [False, True])
def test_in_process_reset_and_restore_leave_caller_rng_untouched(restore):
    """reset_state_own draws at an epoch's start and at a restore: inside the loader's
    next(), so the caller's streams are where they were after the whole epoch."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    state = None
    if restore:
        it = iter(_in_process_loader(ResetDrawsSource(wc)))
        next(it), next(it)
        state = it._owner.save_state_rank()
        it.close()
    loader = _in_process_loader(ResetDrawsSource(wc))  # the constructor draws too: before the caller seeds
    if state is not None:
        loader.restore_state_rank(state)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    items = list(loader)
    assert len(items) == (5 if restore else 7)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


@pytest.mark.parametrize(("budget", "taken"), [(1e12, N), (0.0, 1)])
def test_snapshot_budget_controls_snapshot_count(budget, taken, monkeypatch):
    monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", budget)
    rt = runtime(stateful_pipeline(), max_in_flight=10**6)
    items = list(rt.run(0, 0, None))
    assert items[-1] == End(0, N)
    # huge budget: a snapshot before every sample after the first and before the end
    # (indices 1..N). Zero budget: only the first snapshot, which measures the cost;
    # after it no sample time can pay for another.
    assert rt.snapshots_taken == taken
    snap_indices = [i for i in range(N + 1) if rt.ring.find(i) is not None and rt.ring.find(i)[0] == i]
    assert snap_indices == (list(range(N + 1)) if taken == N else [0, 1])
    assert rt.snapshot_seconds > 0


def test_snapshot_policy_bounds_the_replay_by_the_cold_start():
    due = worker_module.snapshot_due
    frac, floor_s, floor_k = (
        worker_module.REPLAY_FRACTION,
        worker_module.REPLAY_FLOOR_SECONDS,
        worker_module.REPLAY_FLOOR_SNAPSHOTS,
    )
    assert (frac, floor_s, floor_k) == (0.15, 0.02, 3)  # the values the bench measured
    # the budget: 2 % of the work pays for the last snapshot's cost (0.1 ms: under the floors)
    assert due(work=0.006, cost=0.0001, cold=0.0) and not due(work=0.004, cost=0.0001, cold=0.0)
    # a costly snapshot (10 ms) next to a 1 s cold start: due after 0.15 s of work, not 0.5 s
    assert not due(work=0.14, cost=0.01, cold=1.0) and due(work=0.16, cost=0.01, cold=1.0)
    # ... but never after less than 3 snapshot costs (at most a quarter of the time) ...
    assert not due(work=0.2, cost=0.08, cold=0.1) and due(work=0.25, cost=0.08, cold=0.1)
    # ... except after a run's first snapshot, whose cost includes first touches
    assert due(work=0.03, cost=0.08, cold=0.1, first=True)
    # ... nor after less than 20 ms: a cheap state keeps to the budget
    assert not due(work=0.015, cost=0.002, cold=0.01) and due(work=0.025, cost=0.002, cold=0.01)


@pytest.mark.parametrize("at", range(1, N + 1))
def test_a_restored_run_takes_no_snapshot_while_it_replays(at, monkeypatch):
    # save after `at` samples of a run whose only snapshot is its first (zero budget):
    # the restore starts from that snapshot and replays `at - 1` samples
    monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 0.0)
    monkeypatch.setattr(worker_module, "REPLAY_FLOOR_SECONDS", 3600.0)  # nor the replay bound, under load
    ref = reference()
    rt = runtime(stateful_pipeline(), max_in_flight=10**6)
    run = rt.run(0, 0, None)
    for _ in range(at):
        next(run)
    start = rt.checkpoint(0, at)
    assert (start.snapshot_index, start.skip) == (1, at - 1)
    # a huge budget would snapshot before every sample if the restored snapshot's cost
    # counted as 0 (as a fresh run's first does): a restored run waits for the replay bound
    monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 1e12)
    restored = runtime(stateful_pipeline(), max_in_flight=10**6)
    items = list(restored.run(0, 0, start))
    assert_streams(ref[at:], items, f"restored after {at}")
    assert restored.snapshots_taken == 0
    # once the replay bound is reached, snapshots resume (and the stream stays exact)
    monkeypatch.setattr(worker_module, "REPLAY_FLOOR_SECONDS", 0.0)
    monkeypatch.setattr(worker_module, "REPLAY_FRACTION", 0.0)  # reached at once, however slow the machine
    again = runtime(stateful_pipeline(), max_in_flight=10**6)
    items = list(again.run(0, 0, start))
    assert_streams(ref[at:], items, f"restored after {at}, snapshots on")
    snaps = [i for i in range(N + 1) if again.ring.find(i) is not None and again.ring.find(i)[0] == i]
    # the restored snapshot, then none while replaying (samples 2..at), then every sample
    # once the replay bound is reached (at once here: both bounds are 0)
    assert snaps[0] == 1 and all(i > at for i in snaps[1:]), snaps
    assert at == N or (again.snapshots_taken >= 1 and snaps[-1] == N), snaps


def test_snapshot_policy_after_a_restore_waits_for_the_replay_bound():
    due = worker_module.snapshot_due
    assert due(work=10.0, cost=0.0, cold=1000.0)  # a fresh run's first: the budget pays
    assert not due(work=0.015, cost=None, cold=0.0) and due(work=0.025, cost=None, cold=0.0)
    assert not due(work=0.14, cost=None, cold=1.0) and due(work=0.16, cost=None, cold=1.0)


def test_the_cold_start_counts_from_the_plan():
    rt = runtime(stateful_pipeline())
    list(rt.run(0, 0, None, started=time.monotonic() - 2.0))  # a process start of 2 s
    assert 2.0 <= rt.cold_seconds < 60
    list(rt.run(1, 0, None, started=time.monotonic() - 9.0))  # measured once per context
    assert rt.cold_seconds < 9.0
    fresh = runtime(stateful_pipeline())
    list(fresh.run(0, 0, None))
    assert 0 < fresh.cold_seconds < 2.0


def test_run_as_another_logical_worker():
    items = list(runtime(plain_pipeline(num_workers=3)).run(0, 2, None))
    assert [(x.worker, x.item_index) for x in items[:-1]] == [(2, i) for i in range(4)]
    assert [int(x.payload[0]) for x in items[:-1]] == [2, 5, 8, 11]
    assert items[-1] == End(2, 4)


# -- PipelineWorkerDataset ---------------------------------------------------------------


def test_pipeline_worker_dataset_pickles_lambda_and_plan():
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
    ds = MapDataset(RangeSource(N, wc), lambda x: x * 10)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(ds)  # the plain pickle cannot carry the lambda
    pwd = PipelineWorkerDataset(ds, max_in_flight=5)
    starts = [None, WorkerState(worker_id=1, index=2, snapshot_index=0)]
    pwd.set_plan(3, 1, starts)
    loaded = pickle.loads(pickle.dumps(pwd))
    expected = list(pwd)  # in the main process: physical 0 plays logical (0 + 1) % 2 = 1
    assert pwd.runtime is not None

    assert loaded.dataset is not ds and loaded.dataset.fn is not ds.fn
    assert loaded.worker_config == wc
    assert (loaded.epoch, loaded.rotation, loaded.starts, loaded.max_in_flight) == (3, 1, starts, 5)
    assert loaded.runtime is None
    assert loaded.dataset.fn(torch.tensor([4])).tolist() == [40]

    first = list(loaded)
    assert loaded.runtime is not None and loaded.runtime.epoch == 3 and loaded.runtime.worker_id == 1
    # logical worker 1 (values 1, 3, 5, ...) from its third sample on, times ten
    assert [(x.worker, x.item_index) for x in first[:-1]] == [(1, i) for i in range(2, 6)]
    assert [int(x.payload[0]) for x in first[:-1]] == [50, 70, 90, 110]
    assert first[-1] == End(1, 6)
    assert_streams(first, expected, "unpickled vs original")

    # the next iteration of the same dataset is the next epoch, fresh, unrotated
    second = list(loaded)
    assert loaded.runtime.epoch == 4 and loaded.runtime.worker_id == 0
    assert [int(x.payload[0]) for x in second[:-1]] == [0, 20, 40, 60, 80, 100, 120]
    assert second[-1] == End(0, 7)


def test_saves_of_a_restored_loader_before_its_first_snapshot_restore_exactly(monkeypatch):
    # The original run snapshots only its first sample (zero budget); restored runs take
    # none (the replay bound is out of reach): every save of a restored loader is the
    # restored snapshot plus a growing skip, and must restore to the same continuation.
    monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 0.0)
    monkeypatch.setattr(worker_module, "REPLAY_FLOOR_SECONDS", 3600.0)  # forked workers inherit

    def make() -> sl.SavableDataLoader:
        ds = stateful_pipeline(num_workers=2, n=24)
        return sl.SavableDataLoader(
            ds, batch_size=None, worker_config=ds.worker_config, multiprocessing_context="fork", timeout=60
        )

    ref = list(make())
    assert len(ref) == 24
    for k in (1, 11):
        first = make()
        it = iter(first)
        for _ in range(k):
            next(it)
        state = first.save_state_rank()
        del it
        restored = make()
        restored.restore_state_rank(state)
        it = iter(restored)
        for j in range(len(ref) - k + 1):
            again = restored.save_state_rank()
            assert again.position.workers[0].snapshot_index <= 1  # still the first snapshot
            third = make()
            third.restore_state_rank(again)
            assert_streams(ref[k + j :], list(third), f"saved {j} after a restore at {k}")
            if k + j < len(ref):
                assert_same(next(it), ref[k + j], f"restored at {k}, item {j}")
        del it


class _AskingSource(RangeSource):
    """RangeSource that asks for a snapshot after the values in ``asks`` (forced ones
    after those in ``forces``)."""

    def __init__(self, n: int, worker_config: sl.WorkerConfig, asks: set[int], forces: set[int] = frozenset()) -> None:
        super().__init__(n, worker_config)
        self.asks = asks
        self.forces = forces

    def __iter__(self):
        for value in super().__iter__():
            if int(value[0]) in self.asks:
                self.request_snapshot()
            if int(value[0]) in self.forces:
                self.request_snapshot(force=True)
            yield value


def _snapshot_points(rt: WorkerRuntime) -> list[int]:
    return [i for i in range(N + 1) if rt.ring.find(i) is not None and rt.ring.find(i)[0] == i]


def test_a_snapshot_a_dataset_asks_for_is_taken_after_its_sample(monkeypatch):
    monkeypatch.setattr(worker_module, "snapshot_due", lambda *a, **k: False)  # only the asked ones
    monkeypatch.setattr(worker_module, "HINTED_SNAPSHOT_SHARE", 1e12)  # however cheap the samples
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    rt = runtime(_AskingSource(N, wc, {2, 5}), max_in_flight=10**6)
    items = list(rt.run(0, 0, None))
    assert _snapshot_points(rt) == [0, 3, 6]  # the state after values 2 and 5 (3 and 6 samples)
    # restored from the asked snapshot: exact, and no further snapshot while replaying
    start = rt.checkpoint(0, 5)
    assert (start.snapshot_index, start.skip) == (3, 2)
    again = runtime(_AskingSource(N, wc, {2, 5}), max_in_flight=10**6)
    assert_streams(items[5:], list(again.run(0, 0, start)), "restored from an asked snapshot")
    assert _snapshot_points(again) == [3, 6]


def test_an_asked_snapshot_is_skipped_when_snapshots_cost_too_much(monkeypatch):
    # a snapshot share of 0: every asked snapshot after the first (measured) one is refused
    monkeypatch.setattr(worker_module, "snapshot_due", lambda *a, **k: False)
    monkeypatch.setattr(worker_module, "HINTED_SNAPSHOT_SHARE", 0.0)
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    rt = runtime(_AskingSource(N, wc, set(range(N))), max_in_flight=10**6)
    list(rt.run(0, 0, None))
    assert _snapshot_points(rt) == [0, 1]  # the start, then the first (its cost unknown: 0)


def test_a_forced_snapshot_is_taken_whatever_it_costs(monkeypatch):
    """``request_snapshot(force=True)`` (a producer's stream, whose consumed items may be
    gone) is taken at every item even when snapshots cost more than the hint allows; a
    plain request in the same sample does not weaken it; restores from each are exact
    and replay nothing."""
    monkeypatch.setattr(worker_module, "snapshot_due", lambda *a, **k: False)
    monkeypatch.setattr(worker_module, "HINTED_SNAPSHOT_SHARE", 0.0)
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    everything = set(range(N))
    rt = runtime(_AskingSource(N, wc, everything, forces=everything), max_in_flight=10**6)
    items = list(rt.run(0, 0, None))
    assert _snapshot_points(rt) == list(range(N + 1))
    for k in range(N + 1):
        start = rt.checkpoint(0, k)
        assert (start.snapshot_index, start.skip) == (k, 0)
        again = runtime(_AskingSource(N, wc, everything, forces=everything), max_in_flight=10**6)
        assert_streams(items[k:], list(again.run(0, 0, start)), f"restored at {k}")
