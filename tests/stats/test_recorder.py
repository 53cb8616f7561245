"""``Recorder``: the main process's side of ``loader.stats()``, fed by hand with what
items carry (their ready time, or a worker report) and ``next()`` call times on a clock
the test sets (``recorder._now``): the wait share, the items ready at each call (exact,
the ``ahead`` rule included, however the calls are folded in), the workers' and stages'
sums, the series thinning, the windows (``take()``, epochs, another thread's) and the
log's."""

from __future__ import annotations

import itertools
import sys
import threading

import pytest

from savable_loader.stats import recorder as recorder_module
from savable_loader.stats.clock import StageTime, WorkerReport
from savable_loader.stats.record import LoaderStats, QueueStats
from savable_loader.stats.recorder import FOLD_ITEMS, SERIES_POINTS, Recorder


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


def report(
    worker: int = 0,
    done: float | None = None,
    items: int = 1,
    busy: float = 0.0,
    samples: int = 4,
    stages: tuple[StageTime, ...] = (),
) -> WorkerReport:
    """A worker's report on its ``items`` since its last one, sent with an item ready at
    ``done`` (None: with its end marker)."""
    return (worker, done, items, busy, samples, stages)


def step(
    rec: Recorder,
    clock: Clock,
    called: float,
    done: float | None,
    returned: float,
    worker: int = 0,
    samples: int = 4,
    busy: float = 0.0,
    stages: tuple[StageTime, ...] = (),
    carried: WorkerReport | float | None | str = "report",
) -> None:
    """One ``next()``: called at ``called``, its item (finished by ``worker`` at ``done``)
    arrives and is returned at ``returned``. What the item carries: ``"report"``: a report
    on it alone; ``"ready"``: its ready time alone (its worker reports later); else
    ``carried`` itself (None: nothing, an item of the main process's own pipeline)."""
    clock.now = returned
    if carried == "report":
        carried = report(worker, done, 1, busy, samples, stages)
    elif carried == "ready":
        carried = done
    if carried is not None:
        rec.report(carried)  # type: ignore[arg-type]
    rec.yielded(called)


@pytest.fixture
def fold_every(monkeypatch: pytest.MonkeyPatch):
    """Fold the calls into the windows every ``n`` calls (``fold_every(n)``)."""

    def set_fold(n: int) -> None:
        monkeypatch.setattr(recorder_module, "FOLD_ITEMS", n)

    return set_fold


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


def run_calls(rec: Recorder, clock: Clock, carried: str = "ready") -> None:
    """The calls of ``CALLS``, their items carrying their ready time (``"ready"``), a
    report on each (``"report"``), or (``"mixed"``) their ready time but every third
    item, and the last, a report on the items since the last report."""
    last = -1
    for k, (called, done, returned) in enumerate(CALLS):
        what: WorkerReport | str = carried
        if carried == "mixed":
            what = "ready"
            if k % 3 == 2 or k == len(CALLS) - 1:
                what, last = report(0, done, items=k - last, samples=4 * (k - last)), k
        step(rec, clock, called, done, returned, carried=what)


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


@pytest.mark.parametrize("fold", [1, 3, FOLD_ITEMS])
@pytest.mark.parametrize("carried", ["ready", "report", "mixed"])
def test_queue_depths_of_a_whole_epoch(clock, fold_every, carried, fold):
    fold_every(fold)  # (the calls folded in bulk: the same depths)
    rec = Recorder(rank=0, ahead=2)
    clock.now = START
    rec.begin(epoch=0)
    run_calls(rec, clock, carried)
    clock.now = 5.0
    rec.end()
    stats = rec.take()
    assert (stats.steps, stats.step) == (8, 8)
    assert stats.wait_seconds == pytest.approx(0.4 + 0.1)
    assert [(w.worker, w.items, w.samples) for w in stats.workers] == ([] if carried == "ready" else [(0, 8, 32)])
    assert stats.queue is not None
    assert stats.queue.series == [(round(c - START, 6), d) for (c, _, _), d in zip(CALLS, DEPTHS)]
    assert stats.queue.mean == pytest.approx(9 / 8)
    assert stats.queue.max == 2
    assert stats.queue.empty_share == pytest.approx(2 / 8)


@pytest.mark.parametrize("fold", [1, 2, FOLD_ITEMS])
def test_an_item_done_after_its_call_is_not_in_that_calls_queue(clock, fold_every, fold):
    # the main process (ahead=1) makes each item inside the call: nothing is ever ready;
    # its items carry nothing but, now and then, a report (ready in the call)
    fold_every(fold)
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    reports = {2: report(-1, 2.6, items=3, busy=1.5, samples=12), 4: report(-1, 4.6, items=2, busy=1.0, samples=8)}
    for k in range(5):
        step(rec, clock, called=k + 0.1, done=k + 0.6, returned=k + 0.6, carried=reports.get(k))
    clock.now = 5.0
    rec.end()
    stats = rec.take()
    assert stats.queue is not None
    assert (stats.queue.mean, stats.queue.max, stats.queue.empty_share) == (0.0, 0, 1.0)
    assert stats.queue.series == [(round(k + 0.1, 6), 0) for k in range(5)]
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
    # worker 0's items carry their ready time only, its end marker the report on both
    step(rec, clock, 10.0, 9.0, 10.5, worker=0, carried="ready")
    step(rec, clock, 11.0, 9.5, 11.0, worker=1, samples=4, busy=0.2, stages=slow)
    step(rec, clock, 11.5, 12.0, 12.0, worker=0, carried="ready")
    clock.now = 12.0
    rec.report(report(0, None, items=2, busy=0.7, samples=8, stages=fast))  # end markers
    rec.report(report(1, None, items=0, busy=0.0, samples=0, stages=(("MapDataset(augment)", 0.5, 0, False),)))
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


@pytest.mark.parametrize("fold", [1, 7, FOLD_ITEMS])
def test_the_series_keeps_every_call_then_every_second_then_every_fourth(clock, fold_every, fold):
    fold_every(fold)  # (the series the same however the calls are folded in)
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    calls = 450
    for c in range(1, calls + 1):  # call c at c s, its item done at c - 0.5: depth 1
        step(rec, clock, called=float(c), done=c - 0.5, returned=float(c), carried="ready")
    clock.now = calls + 1.0
    rec.end()
    stats = rec.take()
    assert stats.queue is not None
    series = stats.queue.series
    # every call until 2 x SERIES_POINTS points, then every second, then every fourth
    assert series == [(float(c), 1) for c in range(1, calls + 1, 4)]
    assert SERIES_POINTS <= len(series) < 2 * SERIES_POINTS
    assert (stats.queue.mean, stats.queue.max, stats.queue.empty_share) == (1.0, 1, 0.0)


@pytest.mark.parametrize("fold", [3, FOLD_ITEMS])
@pytest.mark.parametrize("calls", [1, SERIES_POINTS, 2 * SERIES_POINTS - 1, 2 * SERIES_POINTS, 5 * SERIES_POINTS])
def test_the_series_stays_short_and_evenly_spaced(clock, fold_every, calls, fold):
    fold_every(fold)
    rec = Recorder(rank=0, ahead=1)
    clock.now = 0.0
    rec.begin(epoch=0)
    for c in range(calls):
        step(rec, clock, called=float(c), done=c - 0.5, returned=float(c), carried="ready")
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
        step(rec, clock, float(c), c + 0.5, c + 0.5, carried="ready")
    rec.end()
    assert rec.take().steps == 3


def every_call_once(rec: Recorder, windows: list[LoaderStats], calls: int) -> list[QueueStats]:
    """End ``rec``'s iteration and check that its ``windows`` (the last taken here) hold
    each of its ``calls`` once, each having waited 0.25 s; their queues."""
    rec.end()
    windows.append(rec.take())
    assert sum(w.steps for w in windows) == calls
    assert rec.step == windows[-1].step == calls
    assert sum(w.wait_seconds for w in windows) == 0.25 * calls
    return [w.queue for w in windows if w.queue is not None]


def test_calls_made_while_another_thread_takes_a_window_are_not_lost(clock):
    """``take()`` from another thread (``loader.stats()`` off the training thread) folds
    the calls while the loop appends more: none is lost, none booked twice, each keeps
    its own times."""
    rec = Recorder(rank=0, ahead=2)
    clock.now = 0.0
    rec.begin(epoch=0)
    windows: list[LoaderStats] = []
    stop = threading.Event()

    def taking() -> None:
        while not stop.is_set():
            windows.append(rec.take())

    thread = threading.Thread(target=taking)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (switch threads as often as possible)
    calls = 0
    try:
        thread.start()
        # (until the other thread took many windows meanwhile)
        while calls < 20_000 or len(windows) < 200:
            # call c at 2c s, returned 0.25 s later; its item ready at 2c - 0.5, the
            # next one's after the call: a depth of 1
            clock.now = 2.0 * calls + 0.25
            rec.report(2.0 * calls - 0.5)
            rec.yielded(2.0 * calls)
            calls += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    queues = every_call_once(rec, windows, calls)
    assert all((q.mean, q.max, q.empty_share) == (1.0, 1, 0.0) for q in queues)


class Midway(list):
    """A list that runs ``during()`` right after each append."""

    def __init__(self, during) -> None:
        super().__init__()
        self.during = during

    def append(self, value) -> None:
        super().append(value)
        self.during()


def test_a_window_taken_between_the_appends_of_a_call_leaves_the_call_whole(clock):
    """The same, with each window taken by the other thread right after a call's time is
    appended and before its return and ready times are (a switch of threads there is
    rare, but possible)."""
    rec = Recorder(rank=0, ahead=2)
    clock.now = 0.0
    rec.begin(epoch=0)
    windows: list[LoaderStats] = []
    go, taken = threading.Event(), threading.Event()
    stop = False

    def taking() -> None:
        while go.wait() and not stop:
            go.clear()
            windows.append(rec.take())
            taken.set()

    def take_now() -> None:
        go.set()
        assert taken.wait(10.0)
        taken.clear()

    rec._called = Midway(take_now)  # (the calls' times: appended first)
    thread = threading.Thread(target=taking)
    thread.start()
    calls = 100
    try:
        for c in range(calls):  # (as in the test above)
            clock.now = 2.0 * c + 0.25
            rec.report(2.0 * c - 0.5)
            rec.yielded(2.0 * c)
    finally:
        stop = True
        go.set()
        thread.join()
    assert len(windows) == calls
    queues = every_call_once(rec, windows, calls)
    assert sum(len(q.series) for q in queues) == calls  # (every call in a series: fewer than SERIES_POINTS a window)
    assert all((q.mean, q.max, q.empty_share) == (1.0, 1, 0.0) for q in queues)


def test_without_a_queue_calls_count_and_wait_and_there_is_no_queue(clock):
    """``ahead=0`` (``num_workers=0``): each item is made in the call, so the calls are
    counted and their waits summed, and no window has a queue."""
    lines: list[LoaderStats] = []
    rec = Recorder(rank=0, ahead=0, log=lines.append, log_every=1.0)
    clock.now = 0.0
    rec.begin(epoch=0)
    step(rec, clock, 0.0, None, 0.25, worker=-1, carried=None)
    step(rec, clock, 0.5, None, 0.75, worker=-1, carried=report(-1, 0.7, 2, 0.5, 8))
    step(rec, clock, 1.0, None, 1.5, worker=-1, carried=None)  # 1.5 s: the log's window
    stats = rec.take()
    assert (stats.steps, stats.step, stats.queue, stats.samples) == (3, 3, None, 8)
    assert stats.wait_seconds == pytest.approx(0.25 + 0.25 + 0.5)
    assert [(w.worker, w.items, w.busy_seconds) for w in stats.workers] == [(-1, 2, 0.5)]
    assert [(s.steps, s.queue) for s in lines] == [(3, None)]
    assert lines[0].wait_seconds == pytest.approx(1.0)


@pytest.mark.parametrize(("ahead", "log", "plain"), [(0, False, True), (0, True, False), (2, False, False)])
def test_the_loop_books_a_call_itself_only_without_a_queue_or_a_log(clock, ahead, log, plain):
    """``plain``: a call's count and wait are all there is to book (no queue, no log),
    and the two additions the loop makes then (``loader/iterations.py``) give the window
    that :attr:`Recorder.yielded` gives. (That the loop asks ``plain``, so that a log is
    written without a queue, is ``test_the_stats_log_gets_lines_that_read_back[0]``'s.)"""
    lines: list[LoaderStats] = []
    rec = Recorder(rank=0, ahead=ahead, log=lines.append if log else None, log_every=1.0)
    assert rec.plain is plain
    clock.now = 0.0
    rec.begin(epoch=0)
    if plain:
        for called, returned in [(0.0, 0.25), (0.5, 0.75), (1.0, 1.5)]:
            clock.now = returned
            rec.wait_sum += recorder_module._now() - called
            rec.step_count += 1
        stats = rec.take()
        assert (stats.steps, stats.step, stats.queue) == (3, 3, None)
        assert stats.wait_seconds == pytest.approx(1.0)
    else:
        assert rec.yielded == (rec._yielded_direct if ahead == 0 else rec._yielded_queued)


def test_a_log_window_with_reports_and_no_steps_is_written(clock):
    """The workers' last reports come with their end markers, in the ``next()`` that
    ends the epoch: after the log's last window of steps, they get a window of their own."""
    lines: list[LoaderStats] = []
    rec = Recorder(rank=0, ahead=2, log=lines.append, log_every=1.0)
    clock.now = 0.0
    rec.begin(epoch=0)
    step(rec, clock, 0.0, 0.1, 1.2, carried="ready")  # 1.2 s: the log's first window
    assert [s.steps for s in lines] == [1]
    rec.report(report(0, None, 1, 0.4, 12))  # the end marker's report
    clock.now = 1.5
    rec.waited(1.3)
    rec.end()
    assert [(s.steps, s.samples) for s in lines] == [(1, 0), (0, 12)]
    assert lines[1].wait_seconds == pytest.approx(0.2)
