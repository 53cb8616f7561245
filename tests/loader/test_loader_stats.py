"""``loader.stats()`` and the stats log end to end (issue #34, the input-stall report):
stage times against known sleeps on both paths with and without workers, the wait share
of a compute-bound and of an input-bound loop, the windows, the argument checks, the
stream left exactly as it is without statistics (saves and restores, peeks, ``zip``),
and the log (its lines, a cut last line, a malformed one, a path that cannot be
written)."""

from __future__ import annotations

import itertools
import multiprocessing
import random
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

import savable_loader as sl
from savable_loader.cli.main import main
from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.pipeline import worker as worker_module
from savable_loader.sources import IterableSource
from savable_loader.stats import LoaderStats, read_log
from savable_loader.stats import clock as clock_module
from savable_loader.stats.clock import FLUSH_SECONDS
from savable_loader.wrappers import (
    BatchDataset,
    ConcatDataset,
    FilterDataset,
    GcDataset,
    LimitDataset,
    MapDataset,
    ShuffleBufferDataset,
)
from tests.common import RandomMapDataset, RangeSource, assert_streams, check_resume_everywhere, epochs_of

pytestmark = pytest.mark.timeout(120)

# -- known costs: each stage's seconds within 20 % of its sleeps -------------------------

# (sleeps of several ms: a sleeping thread may wait for a core to wake up on, and CI's 2
# cores are busy with the rest of the suite)
SAMPLES = 16
BATCH = 4
SOURCE_COST = 0.008  # seconds per sample read
MAP_COST = 0.02  # seconds per sample mapped (the slow stage)
TOLERANCE = 0.2  # the bound

#: The truth: seconds each stage actually slept (a sleep on a busy machine may overrun by
#: a few ms), added up across the workers (forked: the values are shared).
SLEPT = {name: multiprocessing.get_context("fork").Value("d", 0.0) for name in ("read", "map", "getitem", "collate")}


def nap(name: str, seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    spent = time.perf_counter() - start
    with SLEPT[name].get_lock():
        SLEPT[name].value += spent


@pytest.fixture
def slept() -> dict[str, Any]:
    for value in SLEPT.values():
        value.value = 0.0
    return SLEPT


def read(info):
    for i in info.split(range(SAMPLES)):
        nap("read", SOURCE_COST)
        yield i


def slow(x):
    nap("map", MAP_COST)
    return x


def sleeping_pipeline(num_workers: int, **kw: Any) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=0)
    ds = BatchDataset(MapDataset(IterableSource(read, wc), slow), BATCH)
    kw.setdefault("multiprocessing_context", "fork" if num_workers else None)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, **kw)


def by_name(stats: LoaderStats) -> dict[str, tuple[float, int]]:
    return {s.name: (s.seconds, s.items) for s in stats.stages}


def assert_near(seconds: float, truth: float, what: str) -> None:
    assert abs(seconds - truth) <= TOLERANCE * truth, f"{what}: {seconds:.4f} s, truth {truth:.4f} s"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pipeline_stage_times_match_their_sleeps(num_workers, slept):
    loader = sleeping_pipeline(num_workers)
    batches = list(loader)
    stats = loader.stats()
    assert sorted(int(x) for b in batches for x in b) == list(range(SAMPLES))
    stages = by_name(stats)
    assert stats.slowest == "MapDataset(slow)", stages
    source_seconds, source_items = stages["IterableSource(read)"]
    map_seconds, map_items = stages["MapDataset(slow)"]
    assert source_items == map_items == SAMPLES
    assert_near(source_seconds, slept["read"].value, "IterableSource(read)")
    assert_near(map_seconds, slept["map"].value, "MapDataset(slow)")
    assert slept["map"].value >= SAMPLES * MAP_COST
    assert stages["BatchDataset"][1] == SAMPLES // BATCH
    assert stages["collate"][1] == SAMPLES // BATCH
    assert stages["BatchDataset"][0] < 0.1 * map_seconds
    assert sum(s.share for s in stats.stages) == pytest.approx(1.0)
    assert (stats.steps, stats.samples, stats.step) == (SAMPLES // BATCH, SAMPLES, SAMPLES // BATCH)
    if num_workers:
        assert [(w.worker, w.items, w.samples) for w in stats.workers] == [(0, 2, 8), (1, 2, 8)]
    else:
        assert [(w.worker, w.items, w.samples) for w in stats.workers] == [(-1, 4, 16)]
    truth = SAMPLES * (SOURCE_COST + MAP_COST) / max(num_workers, 1)
    for w in stats.workers:  # each worker's busy time holds its stages' time
        assert w.busy_seconds >= (1 - TOLERANCE) * truth
        assert 0.0 < w.busy_share <= 1.0


GETITEM_COST = 0.01  # seconds per sample (the slow stage)
COLLATE_COST = 0.015  # seconds per batch


class SleepingMap:
    """Map-style: sample i is ``i``, after a sleep."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> int:
        nap("getitem", GETITEM_COST)
        return i


def sleeping_collate(samples: list[int]) -> torch.Tensor:
    nap("collate", COLLATE_COST)
    return torch.tensor(samples)


def sleeping_dropin(num_workers: int, **kw: Any) -> sl.SavableDataLoader:
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(
        SleepingMap(),
        batch_size=BATCH,
        shuffle=True,
        seed=1,
        num_workers=num_workers,
        collate_fn=sleeping_collate,
        **kw,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropin_stage_times_match_their_sleeps(num_workers, slept):
    loader = sleeping_dropin(num_workers)
    batches = list(loader)
    stats = loader.stats()
    assert sorted(torch.cat(batches).tolist()) == list(range(SAMPLES))
    stages = by_name(stats)
    assert set(stages) == {"SleepingMap", "collate"}
    assert stats.slowest == "SleepingMap"
    assert stages["SleepingMap"][1] == SAMPLES
    assert stages["collate"][1] == SAMPLES // BATCH
    assert_near(stages["SleepingMap"][0], slept["getitem"].value, "SleepingMap")
    assert_near(stages["collate"][0], slept["collate"].value, "collate")
    assert slept["getitem"].value >= SAMPLES * GETITEM_COST
    assert (stats.steps, stats.samples) == (SAMPLES // BATCH, SAMPLES)
    workers = [(w.worker, w.items, w.samples) for w in stats.workers]
    assert workers == ([(0, 2, 8), (1, 2, 8)] if num_workers else [(-1, 4, 16)])


# -- the wait share ---------------------------------------------------------------------


def two_worker_loader(path: str, samples: int, delay: float) -> sl.SavableDataLoader:
    """Batches of 4 of ``samples`` samples costing ``delay`` seconds each, from 2 forked
    workers, on the drop-in path (``"dropin"``) or a savable pipeline (``"pipeline"``)."""
    if path == "dropin":
        ds = RandomMapDataset(samples, delay=delay)
        return sl.SavableDataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
    pipeline = BatchDataset(RangeSource(samples, wc, delay=delay), 4)
    return sl.SavableDataLoader(pipeline, batch_size=None, worker_config=wc, multiprocessing_context="fork")


@pytest.mark.parametrize("path", ["dropin", "pipeline"])
def test_wait_share_is_near_zero_when_the_loop_is_slower(path):
    # 1 ms of data per batch, 2 workers, a loop of 30 ms per step; batches wait in the
    # queue (their ready times came with them: on the pipeline path, in each item a worker
    # sends, see WorkerRuntime._with_report)
    loader = two_worker_loader(path, 80, delay=0.00025)
    it = iter(loader)
    for _ in range(3):  # the workers' start
        next(it)
        time.sleep(0.03)
    loader.stats()
    for _ in range(12):
        next(it)
        time.sleep(0.03)
    stats = loader.stats()
    assert stats.steps == 12
    assert stats.wait_share < 0.15, stats.summary()
    assert stats.verdict == "compute-bound"
    # batches were waiting for the loop: about all 4 in flight (prefetch 2 x 2 workers) at each call
    assert stats.queue is not None and stats.queue.mean >= 2.5, stats.queue


@pytest.mark.parametrize("path", ["dropin", "pipeline"])
def test_wait_share_is_near_one_when_the_loader_is_slower(path):
    # the loop does nothing; 5 ms of data per sample, 2 workers
    loader = two_worker_loader(path, 64, delay=0.005)
    it = iter(loader)
    for _ in range(2):
        next(it)
    loader.stats()
    for _ in range(10):
        next(it)
    stats = loader.stats()
    assert stats.steps == 10
    assert stats.wait_share > 0.85, stats.summary()
    assert stats.verdict == "input-bound"
    assert all(w.busy_share > 0.5 for w in stats.workers), stats.summary()


class SlowStart:
    """A sampler that takes 0.25 s before its first index (reading an index file, say)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        time.sleep(0.25)
        yield from range(self.n)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_slow_start_of_the_epoch_is_time_the_loop_waited(num_workers):
    """The epoch's window begins inside the loop's first ``next()``: all the time of that
    call, the start of the iteration included, is time the loop waited for data."""
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = sl.SavableDataLoader(
        RandomMapDataset(16), batch_size=4, sampler=SlowStart(16), num_workers=num_workers, **kw
    )
    it = iter(loader)
    inside = 0.0
    for _ in range(4):  # the loop does nothing but ask
        called = time.perf_counter()
        next(it)
        inside += time.perf_counter() - called
    stats = loader.stats()
    assert inside >= 0.25
    assert stats.wait_seconds >= 0.25, stats.summary()
    assert stats.wait_share > 0.85, stats.summary()


# -- windows ------------------------------------------------------------------------------


def dropin(num_workers: int = 0, n: int = 24, **kw: Any) -> sl.SavableDataLoader:
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(RandomMapDataset(n), batch_size=3, shuffle=True, seed=5, num_workers=num_workers, **kw)


def pipeline(num_workers: int = 0, n: int = 23, **kw: Any) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=3)
    ds = ShuffleBufferDataset(RangeSource(n, wc), size=4)
    ds = MapDataset(ds, lambda x: x * 2 + random.randint(0, 3) + int(torch.randint(0, 5, ())))
    ds = BatchDataset(ds, batch_size=3)
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, **kw)


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
def test_stats_covers_the_time_since_the_last_call(make):
    loader = make()
    before = loader.stats()  # nothing iterated yet
    assert (before.steps, before.samples, before.step, before.queue, before.slowest) == (0, 0, 0, None, None)
    it = iter(loader)
    began = time.perf_counter()
    for _ in range(3):
        next(it)
    first = loader.stats()
    assert first.seconds <= time.perf_counter() - began
    assert (first.epoch, first.steps, first.step) == (0, 3, 3)
    for _ in range(2):
        next(it)
    second = loader.stats()
    assert (second.steps, second.step) == (2, 5)
    assert loader.stats().steps == 0
    rest = list(it)
    third = loader.stats()
    assert (third.steps, third.step) == (len(rest), 5 + len(rest))
    # samples: the drop-in path's are the batches' samples, reported with each batch; a
    # pipeline's, the samples its source read for them (a shuffle buffer reads ahead),
    # reported at most every FLUSH_SECONDS and at the epoch's end: all of them over the epoch
    if make is dropin:
        assert (first.samples, second.samples) == (9, 6)
    else:
        assert first.samples <= 9 + 4 and first.samples + second.samples <= 15 + 4
    assert first.samples + second.samples + third.samples == 24 if make is dropin else 23


def half_flush(x: int) -> int:
    """A sample of half of FLUSH_SECONDS: an item of two is due a report."""
    time.sleep(FLUSH_SECONDS / 2)
    return x


@pytest.mark.parametrize("num_workers", [0, 2])
def test_items_slower_than_the_flush_interval_each_carry_their_report(num_workers):
    """A context reports at most every FLUSH_SECONDS: items that take longer each carry
    one, so every window has its own samples and busy time."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=3)
    ds = BatchDataset(MapDataset(RangeSource(12, wc), half_flush), batch_size=2)
    kw: dict[str, Any] = {"multiprocessing_context": "fork", "prefetch_factor": 1} if num_workers else {}
    loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, **kw)
    it = iter(loader)
    windows = []
    for _ in range(3):
        next(it)
        next(it)
        windows.append(loader.stats())
    assert [w.samples for w in windows] == [4, 4, 4]
    for w in windows:
        assert sum(worker.busy_seconds for worker in w.workers) >= 2 * FLUSH_SECONDS * 0.9, w.summary()
        assert sum(worker.items for worker in w.workers) == 2


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
def test_a_new_epoch_restarts_the_window(make):
    loader = make()
    first = len(list(loader))  # epoch 0, stats() never called
    began = time.perf_counter()
    second = len(list(loader))
    stats = loader.stats()
    assert (stats.epoch, stats.steps, stats.step) == (1, second, first + second)
    assert stats.seconds <= time.perf_counter() - began


def test_stats_needs_record_stats():
    loader = dropin(record_stats=False)
    assert len(list(loader)) == 8
    with pytest.raises(LoaderUsageError, match="record_stats"):
        loader.stats()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"record_stats": "yes"}, "record_stats must be True or False, got 'yes'"),
        ({"record_stats": 1}, "record_stats must be True or False, got 1"),
        ({"stats_log_every": 0}, "stats_log_every must be a number of seconds > 0, got 0"),
        ({"stats_log_every": -1}, "stats_log_every must be a number of seconds > 0, got -1"),
        ({"stats_log_every": float("inf")}, "stats_log_every must be a number of seconds > 0, got inf"),
        ({"stats_log_every": float("nan")}, "stats_log_every must be a number of seconds > 0, got nan"),
        ({"stats_log_every": True}, "stats_log_every must be a number of seconds > 0, got True"),
        ({"stats_log_every": "10"}, "stats_log_every must be a number of seconds > 0, got '10'"),
        ({"stats_log": 123}, "stats_log must be a path .*123"),
        ({"stats_log": ""}, "stats_log must be a path or None, got ''"),
        ({"stats_log": "s.jsonl", "record_stats": False}, "stats_log='s.jsonl' needs record_stats=True"),
    ],
)
@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
def test_arguments_are_checked(make, kw, message):
    with pytest.raises(LoaderUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**kw)


def test_the_arguments_are_kept_for_frameworks_that_rebuild_the_loader(tmp_path):
    loader = dropin(stats_log=tmp_path / "s.jsonl", stats_log_every=2.5)
    assert (loader.record_stats, loader.stats_log, loader.stats_log_every) == (True, tmp_path / "s.jsonl", 2.5)
    off = dropin(record_stats=False)
    assert (off.record_stats, off.stats_log, off.stats_log_every) == (False, None, 10.0)


# -- the stream is the same with statistics -------------------------------------------------


class TupleCollate:
    """A batch of several kinds: a tuple of a tensor, an array and a list (a path that
    rebuilt the batch on its way would show)."""

    def __call__(self, samples):
        stacked = torch.stack(samples)
        return stacked, stacked.numpy() * np.random.rand(), [int(s[0]) for s in samples]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropin_stream_is_the_same_with_statistics(num_workers):
    on = epochs_of(dropin(num_workers, collate_fn=TupleCollate()), 2)
    off = epochs_of(dropin(num_workers, collate_fn=TupleCollate(), record_stats=False), 2)
    for a, b in zip(on, off):
        assert_streams(a, b, "record_stats=True against record_stats=False")
    assert type(on[0][0]) is tuple and type(on[0][0][1]) is np.ndarray


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pipeline_stream_is_the_same_with_statistics(num_workers):
    on = epochs_of(pipeline(num_workers), 2)
    off = epochs_of(pipeline(num_workers, record_stats=False), 2)
    for a, b in zip(on, off):
        assert_streams(a, b, "record_stats=True against record_stats=False")


#: Clocks that settled, counted across forked workers.
SETTLED = multiprocessing.get_context("fork").Value("i", 0)


@pytest.fixture
def settling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every clock settles after its first probe window (samples of a few µs settle the
    clocks, but not surely on a loaded machine: a budget no wrapper fits in does), and
    counts itself in :data:`SETTLED`."""
    judge = clock_module.StageClock._judge

    def counting(self: clock_module.StageClock) -> None:
        judge(self)
        if self.settled:
            with SETTLED.get_lock():
                SETTLED.value += 1

    monkeypatch.setattr(clock_module.StageClock, "_judge", counting)
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 1e-6)
    SETTLED.value = 0


def fast_pipeline(num_workers: int, **kw: Any) -> sl.SavableDataLoader:
    """Samples of a few µs through every wrapper that loops over its input with
    ``parts_of``: the clocks settle after their first items, and the stages then loop over
    their inputs' own iterators."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=7)
    ds: sl.SavableDataset = ConcatDataset([RangeSource(150, wc), RangeSource(600, wc)])
    ds = GcDataset(ds, 50, generation=0, freeze=False)
    ds = ShuffleBufferDataset(ds, size=8)
    ds = MapDataset(ds, lambda x: x * 3 + random.randint(0, 9))
    ds = FilterDataset(ds, lambda x: int(x.flatten()[0]) % 4 != 1)
    ds = BatchDataset(LimitDataset(ds, 200), batch_size=3)
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_settled_pipeline_gives_the_same_stream_and_resumes_exactly(num_workers, settling):
    """Once the clocks settle (samples of a few µs), the stages loop over their inputs'
    own iterators and the runtime sums the items itself: the stream is the one without
    statistics, a resume anywhere is exact, and the items add up."""
    on = epochs_of(fast_pipeline(num_workers), 2)
    assert SETTLED.value == 2 * max(num_workers, 1)  # (each context's clock, each epoch)
    off = epochs_of(fast_pipeline(num_workers, record_stats=False), 2)
    for a, b in zip(on, off):
        assert_streams(a, b, "record_stats=True against record_stats=False")
    loader = fast_pipeline(num_workers)
    batches = sum(1 for _ in loader)
    stats = loader.stats()
    assert batches == len(on[1]) and stats.steps == batches
    assert sum(w.items for w in stats.workers) == batches
    wrappers = ("Batch", "Limit", "Filter", "Map", "ShuffleBuffer", "Gc", "Concat")
    # (the second source starts after the clocks settled: its time is in the shares
    # measured until then, see stats/clock.py)
    assert {f"{w}Dataset" for w in wrappers} | {"RangeSource"} <= {s.name for s in stats.stages}
    assert all(s.seconds > 0 for s in stats.stages if s.name.endswith(("Dataset", "Source")))
    assert check_resume_everywhere(lambda: fast_pipeline(num_workers), epochs=2, steps=[0, 1, 17, 40, 66]) >= 5


#: In-loop snapshots taken, counted across forked workers.
SNAPPED = multiprocessing.get_context("fork").Value("i", 0)


@pytest.mark.parametrize("flush", [FLUSH_SECONDS, 0.0])  # (0: a report with every item)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_settled_clock_books_the_items_after_a_replay_and_the_snapshots(num_workers, flush, settling, monkeypatch):
    """A restore (a replay of up to 9 items, a snapshot every 10th item), then the clocks
    settle: the stream is exact, the replayed items are not counted as sent, and every
    snapshot the runtime took (summed in its locals once settled, added with each report
    and the last) is in the statistics."""
    monkeypatch.setattr(clock_module, "FLUSH_SECONDS", flush)
    calls = [0]

    def every_10th(work: float, cost: float | None, cold: float, first: bool = False) -> bool:
        calls[0] += 1
        if calls[0] % 10 != 1:
            return False
        with SNAPPED.get_lock():
            SNAPPED.value += 1
        return True

    monkeypatch.setattr(worker_module, "snapshot_due", every_10th)
    reference = list(fast_pipeline(num_workers))
    calls[0] = 0
    loader = fast_pipeline(num_workers)
    it = iter(loader)
    head = [next(it) for _ in range(26)]
    state = loader.state_dict()
    it.close()
    restored = fast_pipeline(num_workers)
    restored.load_state_dict(state)
    calls[0] = SNAPPED.value = SETTLED.value = 0
    rest = list(restored)
    assert SETTLED.value == max(num_workers, 1)  # (each context's clock settled)
    assert_streams(head + rest, reference, "a restore at batch 26 against the uninterrupted epoch")
    stats = restored.stats()
    assert stats.steps == len(rest) == len(reference) - 26
    assert sum(w.items for w in stats.workers) == len(rest)  # (the replayed ones not sent)
    assert by_name(stats)["snapshot"][1] == SNAPPED.value >= 4


class GoesOn(IterableDataset):
    """torch's contract: an iterator may raise for one item and go on (the loader raises
    that batch's error, and the next ``next()`` gets the next batch)."""

    def __iter__(self):
        return _GoesOnIterator()


class _GoesOnIterator:
    def __init__(self) -> None:
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        i = self.i
        self.i += 1
        if i >= 8:
            raise StopIteration
        if i == 3:
            raise ValueError("item 3 is bad")
        return torch.tensor(i)


def drain(loader) -> list[Any]:
    got: list[Any] = []
    it = iter(loader)
    while True:
        try:
            got.append(int(next(it)))
        except ValueError as e:  # (from a worker, torch adds the worker's traceback)
            got.append("item 3 is bad" if "item 3 is bad" in str(e) else str(e))
        except StopIteration:
            return got


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_that_goes_on_after_an_error_goes_on_with_statistics(num_workers):
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    off = drain(
        sl.SavableDataLoader(GoesOn(), batch_size=None, num_workers=num_workers, seed=0, record_stats=False, **kw)
    )
    on = drain(sl.SavableDataLoader(GoesOn(), batch_size=None, num_workers=num_workers, seed=0, **kw))
    assert off.count("item 3 is bad") == max(num_workers, 1) and len(off) == 8 * max(num_workers, 1)
    assert on == off


def test_dropin_resumes_exactly_with_statistics():
    assert check_resume_everywhere(lambda: dropin(2), epochs=2, steps=[0, 3, 8, 11]) >= 4


def test_pipeline_resumes_exactly_with_statistics():
    assert check_resume_everywhere(lambda: pipeline(2), epochs=2, steps=[0, 4, 8, 12]) >= 4


def test_a_restored_loader_counts_from_the_restore():
    loader = pipeline(2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.save_state_rank()
    del it
    fresh = pipeline(2)
    fresh.restore_state_rank(state)
    rest = list(fresh)
    stats = fresh.stats()
    assert (stats.epoch, stats.steps, stats.step) == (0, len(rest), len(rest))
    assert sum(w.items for w in stats.workers) == len(rest)


def test_a_peek_inside_a_loop_does_not_break_stats():
    loader = dropin(2)
    it = iter(loader)
    for _ in range(4):
        next(it)
    loader.stats()
    peeked = next(iter(loader))  # a peek at the next epoch's first batch, dropped at once
    assert peeked is not None
    for _ in range(3):
        next(it)
    after = loader.stats()
    assert after.steps == 4  # the peek's batch and the loop's three
    assert after.epoch == 0, "the loop is in epoch 0: the peek gave its epoch back"
    rest = list(it)
    assert len(rest) == 1
    end = loader.stats()
    assert (end.steps, end.epoch) == (1, 0)
    next_epoch = list(loader)
    stats = loader.stats()
    assert (stats.epoch, stats.steps) == (1, len(next_epoch))


def test_zip_of_two_iterators_does_not_break_stats():
    loader = dropin(2)
    pairs = zip(loader, loader)
    next(pairs)
    loader.stats()  # both iterations have begun
    rest = list(pairs)
    stats = loader.stats()
    assert stats.steps == 2 * len(rest) == 2 * 7
    assert stats.samples == 3 * stats.steps
    assert sum(w.items for w in stats.workers) == stats.steps
    assert 0.0 <= stats.wait_share <= 1.0
    assert stats.queue is not None and stats.queue.max <= 2 * 2 * 2  # two iterations' prefetch


# -- the stats log --------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])  # (0: no queue, and with a log the loop calls yielded())
def test_the_stats_log_gets_lines_that_read_back(tmp_path, capsys, num_workers):
    wc = sl.WorkerConfig(rank=1, world_size=2, num_workers=num_workers, seed=0)
    ds = BatchDataset(RangeSource(80, wc), 4)
    loader = sl.SavableDataLoader(
        ds,
        batch_size=None,
        worker_config=wc,
        multiprocessing_context="fork" if num_workers else None,
        stats_log=tmp_path / "s-{rank}.jsonl",
        stats_log_every=0.05,
    )
    steps = []
    for _ in range(2):
        count = 0
        for _batch in loader:
            time.sleep(0.01)
            count += 1
        steps.append(count)
    path = tmp_path / "s-1.jsonl"
    assert [p.name for p in tmp_path.iterdir()] == ["s-1.jsonl"]
    lines = path.read_text().splitlines()
    windows = [LoaderStats.from_json(line) for line in lines]
    assert list(read_log(path)) == windows
    assert len(windows) >= 4  # every 0.05 s of a 0.1 s epoch, and at each epoch's end
    assert {w.rank for w in windows} == {1}
    assert [w.epoch for w in windows] == sorted(w.epoch for w in windows)
    # the log's windows follow each other: every step is in exactly one
    assert [sum(w.steps for w in windows if w.epoch == e) for e in (0, 1)] == steps
    assert sum(w.samples for w in windows) == 4 * sum(steps)
    # (a window without steps has the workers' last reports, sent with their end markers)
    assert all(w.seconds > 0 and (w.steps > 0 or w.workers) for w in windows)
    assert windows[-1].step == sum(steps)
    assert all(a.time <= b.time for a, b in itertools.pairwise(windows))
    # the report reads it
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: rank 1, {len(windows)} windows, epochs 0-1, {sum(steps)} steps" in out


def test_a_log_cut_by_a_kill_reads_without_its_last_line(tmp_path):
    path = tmp_path / "s.jsonl"
    loader = dropin(2, stats_log=path, stats_log_every=0.02)
    for _batch in loader:
        time.sleep(0.01)
    whole = list(read_log(path))
    assert len(whole) >= 2
    with open(path, "a") as f:
        f.write(whole[0].to_json()[:40])  # killed mid-write
    assert list(read_log(path)) == whole
    lines = path.read_text().split("\n")
    lines.insert(1, '{"version": 1, "steps": "three"}')
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=rf"{path} line 2: malformed stats line"):
        list(read_log(path))


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
def test_a_log_that_cannot_be_written_warns_once_and_the_loader_goes_on(tmp_path, make):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    loader = make(2, stats_log=blocker / "s-{rank}.jsonl", stats_log_every=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = []
        for _ in range(2):
            for batch in loader:
                time.sleep(0.005)
                got.append(batch)
    ours = [w for w in caught if "stats_log" in str(w.message)]
    assert [w.category for w in ours] == [RuntimeWarning]
    assert str(blocker / "s-0.jsonl") in str(ours[0].message)
    reference = epochs_of(make(2, record_stats=False), 2)
    assert_streams(got, reference[0] + reference[1], "with a log that cannot be written")
    assert loader.stats().steps == len(reference[1])
