"""``Recorder``: the main process's side of ``loader.stats()``, fed by hand with worker
reports and ``next()`` call times on a clock the test sets (``recorder._now``): the wait
share, the items ready at each call (exact, the ``ahead`` rule included), the workers' and
stages' sums, the series thinning, the windows (``take()``, epochs) and the log's."""

from __future__ import annotations

import itertools

import pytest

from savable_loader.stats import recorder as recorder_module
from savable_loader.stats.clock import StageTime
from savable_loader.stats.record import LoaderStats
from savable_loader.stats.recorder import SERIES_POINTS, Recorder


class Clock:
    """``time.monotonic()`` as the test sets it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(recorder_module, "_now", fake)
    return fake


def step(
    rec: Recorder,
    clock: Clock,
    called: float,
    done: float | None,
    returned: float,
    worker: int = 0,
    samples: int = 4,
    busy: float = 0.0,
    stages: tuple[StageTime, ...] | None = None,
) -> None:
    """One ``next()``: called at ``called``, its item (finished by ``worker`` at ``done``)
    arrives and is returned at ``returned``."""
    clock.now = returned
    rec.report((worker, done, busy, samples, stages))
    rec.yielded(called)


# A run with ahead=2 (2 items in flight at most): (called, done, returned) per next() call.
# Item k+2 is asked for while call k runs, so it cannot be done before call k: the depth
# of call j (items j, j+1, ... done before it was called) is final after call j+2.
CALLS = [
    (2.0, 1.0, 2.0),  # items 0 (1.0) and 1 (1.2) ready: 2
    (2.5, 1.2, 2.5),  # items 1 and 2 (2.4) ready: 2
    (3.0, 2.4, 3.0),  # item 2 ready, item 3 (3.5) not: 1
    (3.1, 3.5, 3.5),  # item 3 not ready: 0, the loop waits 0.4 s
    (3.7, 3.6, 3.7),  # item 4 (3.6) ready, item 5 (4.0) not: 1
    (4.5, 4.0, 4.5),  # items 5 and 6 (4.2) ready: 2
    (4.6, 4.2, 4.6),  # item 6 ready, item 7 (4.8) not: 1
    (4.7, 4.8, 4.8),  # item 7 not ready: 0, the loop waits 0.1 s
]
DEPTHS = [2, 2, 1, 0, 1, 2, 1, 0]
START = 1.9


def run_calls(rec: Recorder, clock: Clock) -> None:
    for called, done, returned in CALLS:
        step(rec, clock, called, done, returned)


def test_queue_depths_are_exact_and_final_after_ahead_calls(clock):
    rec = Recorder(rank=0, ahead=2)
    clock.now = START
    rec.begin(epoch=0)
    run_calls(rec, clock)
    clock.now = 5.0
    mid = rec.take()
    # the last `ahead` calls are pending: a later item could still count for them
    assert mid.steps == 8
    assert mid.queue is not None
    assert [d for _, d in mid.queue.series] == DEPTHS[:6]
    assert mid.queue.series == [(round(c - START, 6), d) for (c, _, _), d in zip(CALLS, DEPTHS[:6])]
    assert mid.queue.mean == pytest.approx(sum(DEPTHS[:6]) / 6)
    assert mid.queue.max == 2
    assert mid.queue.empty_share == pytest.approx(1 / 6)
    # the iteration ends: the pending calls are final, in the window current then
    clock.now = 6.0
    rec.end()
    rest = rec.take()
    assert rest.steps == 0
    assert rest.queue is not None
    assert rest.queue.series == [(0.0, 1), (0.0, 0)]  # made before the window: at its start
    assert rest.queue.empty_share == 0.5


def test_queue_depths_of_a_whole_epoch(clock):
    rec = Recorder(rank=0, ahead=2)
    clock.now = START
    rec.begin(epoch=0)
    run_calls(rec, clock)
    clock.now = 5.0
    rec.end()
    stats = rec.take()
    assert stats.queue is not None
    assert [d for _, d in stats.queue.series] == DEPTHS
    assert stats.queue.mean == pytest.approx(9 / 8)
    assert stats.queue.max == 2
    assert stats.queue.empty_share == pytest.approx(2 / 8)


def test_an_item_done_after_its_call_is_not_in_that_calls_queue(clock):
    # the main process (ahead=1) makes each item inside the call: nothing is ever ready
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    for k in range(5):
        step(rec, clock, called=k + 0.1, done=k + 0.6, returned=k + 0.6, worker=-1, busy=0.5)
    clock.now = 5.0
    rec.end()
    stats = rec.take()
    assert stats.queue is not None
    assert (stats.queue.mean, stats.queue.max, stats.queue.empty_share) == (0.0, 0, 1.0)
    assert stats.wait_seconds == pytest.approx(2.5)
    assert stats.wait_share == pytest.approx(0.5)
    assert [(w.worker, w.items, w.samples) for w in stats.workers] == [(-1, 5, 20)]
    assert stats.workers[0].busy_seconds == pytest.approx(2.5)
    assert stats.workers[0].busy_share == pytest.approx(0.5)


def test_wait_share_throughput_workers_and_stages(clock):
    rec = Recorder(rank=3, ahead=4)
    clock.now = 10.0
    rec.begin(epoch=5)
    fast = (("IterableSource(read)", 0.2, 8, True), ("collate", 0.01, 2, False))
    slow = (("MapDataset(augment)", 0.9, 8, False), ("IterableSource(read)", 0.1, 8, True))
    step(rec, clock, 10.0, 9.0, 10.5, worker=0, samples=4, busy=0.3, stages=fast)
    step(rec, clock, 11.0, 9.5, 11.0, worker=1, samples=4, busy=0.2, stages=slow)
    step(rec, clock, 11.5, 12.0, 12.0, worker=0, samples=4, busy=0.4)
    clock.now = 12.0
    rec.report((1, None, 0.0, 0, (("MapDataset(augment)", 0.5, 0, False),)))  # an end marker
    clock.now = 14.0
    stats = rec.take()
    assert isinstance(stats, LoaderStats)
    assert (stats.rank, stats.epoch, stats.step) == (3, 5, 3)
    assert stats.seconds == pytest.approx(4.0)
    assert (stats.steps, stats.samples) == (3, 12)
    assert stats.wait_seconds == pytest.approx(0.5 + 0.0 + 0.5)
    assert stats.wait_share == pytest.approx(1.0 / 4.0)
    assert stats.steps_per_s == pytest.approx(3 / 4)
    assert stats.samples_per_s == pytest.approx(12 / 4)
    assert [(w.worker, w.items, w.samples) for w in stats.workers] == [(0, 2, 8), (1, 1, 4)]
    assert [w.busy_seconds for w in stats.workers] == pytest.approx([0.7, 0.2])
    assert [w.busy_share for w in stats.workers] == pytest.approx([0.7 / 4, 0.2 / 4])
    assert [(s.name, s.items) for s in stats.stages] == [
        ("MapDataset(augment)", 8),
        ("IterableSource(read)", 16),
        ("collate", 2),
    ]
    assert [s.seconds for s in stats.stages] == pytest.approx([1.4, 0.3, 0.01])
    assert [s.share for s in stats.stages] == pytest.approx([1.4 / 1.71, 0.3 / 1.71, 0.01 / 1.71])
    assert stats.slowest == "MapDataset(augment)"
    assert stats.queue is None  # ahead=4: no call is final yet


def test_shares_are_capped_at_one(clock):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 1.0
    rec.begin(epoch=0)
    step(rec, clock, called=0.0, done=1.5, returned=2.0, busy=5.0)  # called before the window began
    stats = rec.take()
    assert stats.wait_seconds == pytest.approx(2.0)
    assert stats.wait_share == 1.0
    assert stats.workers[0].busy_share == 1.0


def test_take_starts_a_new_window(clock):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    stages = (("S", 0.3, 4, True),)
    step(rec, clock, 0.0, 0.5, 1.0, busy=0.5, stages=stages)
    step(rec, clock, 1.0, 1.5, 2.0, busy=0.5)
    first = rec.take()
    assert (first.steps, first.samples, first.seconds) == (2, 8, pytest.approx(2.0))
    assert first.slowest == "S"
    clock.now = 3.0
    empty = rec.take()
    assert empty.seconds == pytest.approx(1.0)
    assert (empty.steps, empty.samples, empty.wait_seconds, empty.wait_share) == (0, 0, 0.0, 0.0)
    assert (empty.workers, empty.stages, empty.slowest, empty.queue) == ([], [], None, None)
    assert empty.step == 2  # the loader's count goes on
    step(rec, clock, 3.0, 3.2, 3.5, busy=0.2)
    clock.now = 4.0
    third = rec.take()
    assert (third.steps, third.samples, third.step) == (1, 4, 3)
    assert third.wait_seconds == pytest.approx(0.5)
    assert third.seconds == pytest.approx(1.0)
    # call 2's depth became final at call 3 (ahead=1): it lands in the window current then
    assert third.queue is not None and third.queue.series == [(0.0, 0)]


def test_a_new_epoch_restarts_the_window(clock):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    step(rec, clock, 0.0, 0.5, 1.0)
    step(rec, clock, 1.0, 1.5, 2.0)
    clock.now = 2.5
    rec.end()
    clock.now = 3.0
    rec.begin(epoch=1)
    step(rec, clock, 3.0, 3.5, 4.0)
    clock.now = 5.0
    stats = rec.take()
    assert (stats.epoch, stats.steps, stats.samples, stats.step) == (1, 1, 4, 3)
    assert stats.seconds == pytest.approx(2.0)
    assert stats.wait_seconds == pytest.approx(1.0)


def test_a_stage_without_time_is_not_the_slowest(clock):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    step(rec, clock, 0.0, 0.1, 0.2, stages=(("S", 0.0, 4, True),))
    stats = rec.take()
    assert [(s.name, s.seconds, s.share) for s in stats.stages] == [("S", 0.0, 0.0)]
    assert stats.slowest is None


def test_the_series_keeps_every_call_then_every_second_then_every_fourth(clock):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    calls = 450
    for c in range(1, calls + 1):  # call c at c s, its item done at c - 0.5: depth 1
        step(rec, clock, called=float(c), done=c - 0.5, returned=float(c))
    clock.now = calls + 1.0
    rec.end()
    stats = rec.take()
    assert stats.queue is not None
    series = stats.queue.series
    # every call until 2 x SERIES_POINTS points, then every second, then every fourth
    assert series == [(float(c), 1) for c in range(1, calls + 1, 4)]
    assert SERIES_POINTS <= len(series) < 2 * SERIES_POINTS
    assert (stats.queue.mean, stats.queue.max, stats.queue.empty_share) == (1.0, 1, 0.0)


@pytest.mark.parametrize("calls", [1, SERIES_POINTS, 2 * SERIES_POINTS - 1, 2 * SERIES_POINTS, 5 * SERIES_POINTS])
def test_the_series_stays_short_and_evenly_spaced(clock, calls):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    for c in range(calls):
        step(rec, clock, called=float(c), done=c - 0.5, returned=float(c))
    rec.end()
    series = rec.take().queue.series  # type: ignore[union-attr]
    assert min(calls, SERIES_POINTS) <= len(series) < 2 * SERIES_POINTS
    assert series[0] == (0.0, 1)
    gaps = {b[0] - a[0] for a, b in itertools.pairwise(series)}
    stride = int(gaps.pop()) if gaps else 1
    assert not gaps  # evenly spaced
    assert stride & (stride - 1) == 0  # every call, every second, fourth, ...
    assert [c for c, _ in series] == [float(c) for c in range(0, calls, stride)]


def test_the_log_gets_a_window_every_log_every_seconds_and_at_the_end(clock):
    lines: list[LoaderStats] = []
    rec = Recorder(rank=2, ahead=1, log=lines.append, log_every=1.0)
    clock.now = 0.0
    rec.begin(epoch=0)
    step(rec, clock, 0.0, 0.4, 0.5)
    assert lines == []
    step(rec, clock, 0.6, 0.9, 1.2)  # 1.2 s into the log's window: it is written
    assert [(s.steps, s.seconds, s.rank, s.step) for s in lines] == [(2, pytest.approx(1.2), 2, 2)]
    assert lines[0].wait_seconds == pytest.approx(0.5 + 0.6)
    step(rec, clock, 1.3, 1.4, 1.5)
    user = rec.take()  # the user's window is its own
    assert user.steps == 3
    assert len(lines) == 1
    clock.now = 1.7
    rec.end()  # the iteration's end writes the rest
    assert [(s.steps, s.seconds) for s in lines[1:]] == [(1, pytest.approx(0.5))]
    # call 2 (at 0.6 s) became final in this window (at call 3), call 3 at its end
    assert lines[1].queue is not None and lines[1].queue.series == [(0.0, 0), (0.1, 0)]
    clock.now = 3.0
    rec.end()  # nothing new: no empty line
    rec.begin(epoch=1)
    assert len(lines) == 2
    step(rec, clock, 3.0, 3.1, 3.2)
    clock.now = 3.5
    rec.begin(epoch=2)  # (an iteration that began before the last ended) writes its window too
    assert [(s.epoch, s.steps) for s in lines[2:]] == [(1, 1)]


def test_no_log_no_log_windows(clock):
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    for c in range(3):
        step(rec, clock, float(c), c + 0.5, c + 0.5)
    rec.end()
    assert rec.take().steps == 3
