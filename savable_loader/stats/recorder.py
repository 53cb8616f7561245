"""The main-process side of ``loader.stats()``: the training loop's waits, the workers' reports.

A loader that records statistics (``record_stats=True``, the default) holds one
:class:`Recorder`. Its iterations tell it when each ``next()`` was called and when it
returned (:meth:`Recorder.yielded`), and hand it what came with each item
(:meth:`Recorder.report`): from a worker process, the time the item was ready, and at
most every :data:`~savable_loader.stats.clock.FLUSH_SECONDS` the worker's
:data:`~savable_loader.stats.clock.WorkerReport` on the items it made since its last
(their count, busy time, samples and stage times). It keeps two windows: the user's
(since the last ``stats()`` call or the epoch's start, whichever is later) and, with a
stats log, the log's (written every ``stats_log_every`` seconds and at each epoch's end).
The wait, the steps and the queue's depths are exact per call; the workers' figures and
the stage times reach the windows with the reports, at most ``FLUSH_SECONDS`` late.

**Items ready when the loop asked.** The depth of the loader's queue at a ``next()`` call
is the number of items, that one included, whose worker had finished them before the
call (``time.perf_counter()`` is the system's monotonic clock, one for every process of
the machine). It is known once the items that could have been finished by then have
arrived: torch's iterator has at most ``ahead`` items (``prefetch_factor x
num_workers``) in flight, so the depth of call ``j`` is final at call ``j + ahead``,
exactly, and a few calls are pending at any moment (they land in the windows current
when they are folded in, below). With ``num_workers=0`` there is no queue: each item is
made in the call that returns it.

**Cost.** Per item, the main process appends the call's times to three lists (with no
queue: adds its wait to a sum); every :data:`FOLD_ITEMS` items, and whenever a window
is read, they are summed (in C) and the depths worked out, into the windows.

Example (what an iteration does per item)::

    called = time.perf_counter()
    recorder.begin(epoch=0, called_at=called)      # the iteration's first next()
    recorder.report(ready_or_report)  # in the engine's on_item
    recorder.yielded(called)          # the item is returned to the loop
    stats = recorder.take()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from savable_loader.stats.clock import WorkerReport
from savable_loader.stats.record import LoaderStats, QueueStats, StageStats, WorkerStats

__all__ = ["FOLD_ITEMS", "SERIES_POINTS", "Recorder"]

#: Queue depths a window keeps for its ``series`` (every call at first, then every
#: second, fourth, ... call once the series is full).
SERIES_POINTS = 100

#: Items booked between two folds of the counters into the windows.
FOLD_ITEMS = 256

_now = time.perf_counter

#: The ready time of an item made in the ``next()`` that returned it (or not known): it
#: was in no queue.
_NOT_READY = float("inf")


def _depths(at: Any, ready_at: Any, count: int, ahead: int) -> list[int]:
    """The depths of the first ``count`` calls, made at ``at`` (an array), whose items
    were ready at ``ready_at``: call ``j``'s is the items ``j`` to ``j + ahead`` (those
    that arrived) ready by then."""
    n = len(at)
    depth = np.zeros(count, dtype=np.int64)
    for d in range(ahead + 1):
        upto = min(count, n - d)
        if upto <= 0:
            break
        depth[:upto] += ready_at[d : d + upto] <= at[:upto]
    out: list[int] = depth.tolist()
    return out


def _add_worker(workers: dict[int, list[Any]], who: int, items: int, samples: int, busy: float) -> None:
    """Add to worker ``who``'s ``[items, samples, busy seconds]`` in ``workers``."""
    worker = workers.get(who)
    if worker is None:
        worker = workers[who] = [0, 0, 0.0]
    worker[0] += items
    worker[1] += samples
    worker[2] += busy


class _Window:
    """What one window has seen so far."""

    __slots__ = (
        "calls",
        "depth_max",
        "depth_sum",
        "depth_zero",
        "epoch",
        "samples",
        "series",
        "stages",
        "start",
        "steps",
        "stride",
        "waited",
        "workers",
    )

    def __init__(self, start: float, epoch: int) -> None:
        self.start = start
        self.epoch = epoch
        self.waited = 0.0
        self.steps = 0
        self.samples = 0
        #: worker -> [items, samples, busy seconds]
        self.workers: dict[int, list[Any]] = {}
        #: stage name -> [seconds, items]
        self.stages: dict[str, list[Any]] = {}
        self.calls = 0
        self.depth_sum = 0
        self.depth_max = 0
        self.depth_zero = 0
        self.series: list[tuple[float, int]] = []
        self.stride = 1

    def fold(self, batch: _Batch) -> None:
        """Add what ``batch`` booked."""
        self.waited += batch.waited
        self.steps += batch.steps
        self.samples += batch.samples
        for who, (items, samples, busy) in batch.workers.items():
            _add_worker(self.workers, who, items, samples, busy)
        stages = self.stages
        for reported in batch.stages:
            for name, seconds, items, _ in reported:
                slot = stages.get(name)
                if slot is None:
                    slot = stages[name] = [0.0, 0]
                slot[0] += seconds
                slot[1] += items
        if batch.times:
            self.depths(batch.times, batch.depths)

    def depths(self, times: list[float], depths: list[int]) -> None:
        """Book calls made at ``times`` (``time.perf_counter()``) and their depths."""
        n = len(depths)
        self.depth_sum += sum(depths)
        self.depth_max = max(self.depth_max, max(depths))
        self.depth_zero += depths.count(0)
        base, k, series = self.calls, 0, self.series
        while True:  # every stride-th call of the window goes into the series
            k += -(base + k) % self.stride
            if k >= n:
                break
            # (a call made before the window began, whose depth became final in it: at 0)
            series.append((round(max(times[k] - self.start, 0.0), 6), depths[k]))
            if len(series) >= 2 * SERIES_POINTS:
                series = self.series = series[::2]
                self.stride *= 2
            k += 1
        self.calls += n

    def result(self, now: float, rank: int, step: int) -> LoaderStats:
        seconds = max(now - self.start, 1e-9)
        total = sum(s[0] for s in self.stages.values())
        stages = sorted(
            (
                StageStats(name=name, seconds=s[0], items=s[1], share=s[0] / total if total > 0 else 0.0)
                for name, s in self.stages.items()
            ),
            key=lambda s: (-s.seconds, s.name),
        )
        workers = [
            WorkerStats(worker=w, items=v[0], samples=v[1], busy_seconds=v[2], busy_share=min(v[2] / seconds, 1.0))
            for w, v in sorted(self.workers.items())
        ]
        queue = None
        if self.calls:
            queue = QueueStats(
                mean=self.depth_sum / self.calls,
                max=self.depth_max,
                empty_share=self.depth_zero / self.calls,
                series=list(self.series),
            )
        return LoaderStats(
            rank=rank,
            epoch=self.epoch,
            time=time.time(),
            step=step,
            seconds=seconds,
            steps=self.steps,
            samples=self.samples,
            wait_seconds=self.waited,
            wait_share=min(self.waited / seconds, 1.0),
            steps_per_s=self.steps / seconds,
            samples_per_s=self.samples / seconds,
            workers=workers,
            queue=queue,
            stages=stages,
            slowest=stages[0].name if stages and stages[0].seconds > 0 else None,
        )


class _Batch:
    """What the reports since the last fold booked, and the calls whose depth became final."""

    __slots__ = ("depths", "samples", "stages", "steps", "times", "waited", "workers")

    def __init__(self) -> None:
        self.waited = 0.0
        self.steps = 0
        self.samples = 0
        #: worker -> [items, samples, busy seconds]
        self.workers: dict[int, list[Any]] = {}
        #: the stage times reports carried
        self.stages: list[Any] = []
        #: when the calls whose depth became final were made, and their depths
        self.times: list[float] = []
        self.depths: list[int] = []

    def report(self, r: WorkerReport) -> None:
        who, _, items, busy, samples, reported = r
        _add_worker(self.workers, who, items, samples, busy)
        self.samples += samples
        if reported:
            self.stages.append(reported)


class Recorder:
    """One loader's statistics (see the module docstring).

    ``rank``: the loader's rank (recorded in each :class:`LoaderStats`); ``ahead``: the
    items torch's iterator may have in flight (``prefetch_factor x num_workers``; 0: the
    main process makes each item in the call, there is no queue, and the windows'
    ``queue`` is None); ``log``: called with each finished log window, every
    ``log_every`` seconds and at the end of each iteration (None: no log).
    """

    __slots__ = (
        "_batch",
        "_called",
        "_done",
        "_held",
        "_lock",
        "_log",
        "_log_due",
        "_logged",
        "_ready",
        "_returned",
        "_stamped",
        "_user",
        "ahead",
        "epoch",
        "log_every",
        "plain",
        "queued",
        "rank",
        "step",
        "step_count",
        "wait_sum",
        "yielded",
    )

    def __init__(
        self,
        rank: int,
        ahead: int,
        log: Callable[[LoaderStats], None] | None = None,
        log_every: float = 10.0,
    ) -> None:
        self.rank = rank
        self.queued = ahead > 0
        self.ahead = max(1, ahead)
        self._log = log
        self.log_every = log_every
        self._lock = threading.Lock()
        now = _now()
        self.epoch = 0
        self.step = 0
        self._user = _Window(now, 0)
        self._logged = _Window(now, 0) if log is not None else None
        self._log_due = now + log_every if log is not None else float("inf")
        #: (called_at, ready_at) of the calls whose depth is not final yet, oldest first
        self._held: list[tuple[float, float]] = []
        #: when the item being returned was ready (inf: not known, or made in the call)
        self._done = _NOT_READY
        #: of each call not folded in yet: when it was made, when it returned, when its
        #: item was ready (three lists: appended to in C, summed in C)
        self._called: list[float] = []
        self._returned: list[float] = []
        self._ready: list[float] = []
        self._stamped = False  # a ready time arrived since the last fold
        #: Neither ``queued`` nor logging: a call's count and wait are all there is to
        #: book, and the loop may book them itself, sparing a call per item (what
        #: :attr:`yielded` does then): ``step_count += 1``, ``wait_sum += now - called_at``
        self.plain = not self.queued and log is None
        #: without a queue: the calls' count and wait since the last fold
        self.step_count = 0
        self.wait_sum = 0.0
        self._batch = _Batch()
        #: ``yielded(called_at)``: ``next()``, called at ``called_at``, returns an item
        #: to the loop now (one method or the other, so that no call asks which)
        self.yielded: Callable[[float], None] = self._yielded_queued if self.queued else self._yielded_direct

    def _fold(self) -> None:
        """Add the calls made and the reports booked since the last fold to the windows
        (the lock held)."""
        called, returned, ready = self._called, self._returned, self._ready
        count = min(len(called), len(returned), len(ready))  # (a call appended meanwhile waits)
        batch, self._batch = self._batch, _Batch()
        if self.step_count:
            steps, waited, self.step_count, self.wait_sum = self.step_count, self.wait_sum, 0, 0.0
            batch.steps += steps
            batch.waited += waited
            self.step += steps
        if count:
            batch.waited += sum(returned[:count]) - sum(called[:count])
            batch.steps += count
            self.step += count
            times, depths = batch.times, batch.depths
            if not self._stamped and not self._held:  # no item was ready before its call
                times.extend(called[:count])
                depths.extend([0] * count)
            else:
                held = self._held
                at = np.array([c for c, _ in held] + called[:count])
                ready_at = np.array([r for _, r in held] + ready[:count])
                final = len(at) - self.ahead  # (the calls with all their possible items in)
                if final > 0:
                    times.extend(at[:final].tolist())
                    depths.extend(_depths(at, ready_at, final, self.ahead))
                    self._held = list(zip(at[final:].tolist(), ready_at[final:].tolist()))
                else:
                    self._held = list(zip(at.tolist(), ready_at.tolist()))
                self._stamped = False
            del called[:count], returned[:count], ready[:count]
        self._user.fold(batch)
        if self._logged is not None:
            self._logged.fold(batch)

    def begin(self, epoch: int, called_at: float | None = None) -> None:
        """An iteration of ``epoch`` begins, in a ``next()`` called at ``called_at``
        (default: now): the user's window restarts there (the iteration's start is time
        the loop waits)."""
        with self._lock:
            self._fold()
            self._settle()
            now = _now() if called_at is None else called_at
            self.epoch = epoch
            self._user = _Window(now, epoch)
            if self._logged is not None:
                self._flush_log(now)
                self._logged = _Window(now, epoch)

    def report(self, r: WorkerReport | float) -> None:
        """What came with an item: the time it was ready (kept for :meth:`yielded`) or a
        loading context's report (booked now), with an item or its epoch's end marker."""
        if type(r) is float:
            self._done = r
            self._stamped = True
            return
        with self._lock:
            self._batch.report(r)  # type: ignore[arg-type]
        if r[1] is not None:  # type: ignore[index]
            self._done = r[1]  # type: ignore[index]
            self._stamped = True

    def _yielded_direct(self, called_at: float) -> None:
        """:attr:`yielded` without a queue: the count and the wait, and the log when due."""
        now = _now()
        self.wait_sum += now - called_at
        self.step_count += 1
        if now >= self._log_due:
            self._next_log_window(now)

    def _next_log_window(self, now: float) -> None:
        """The log's window is due at ``now``: written, and a new one begun."""
        with self._lock:
            self._fold()
            self._flush_log(now)
            self._logged = _Window(now, self.epoch)

    def _yielded_queued(self, called_at: float) -> None:
        """:attr:`yielded` with a queue: the call's times, and when its item was ready."""
        now = _now()
        self._called.append(called_at)
        self._returned.append(now)
        self._ready.append(self._done)
        self._done = _NOT_READY
        if now >= self._log_due:
            self._next_log_window(now)
        elif len(self._called) >= FOLD_ITEMS:
            with self._lock:
                self._fold()

    def waited(self, called_at: float) -> None:
        """``next()``, called at ``called_at``, ends the iteration now (StopIteration):
        the loop waited for it, no item came."""
        now = _now()
        with self._lock:
            self._batch.waited += now - called_at

    def _settle(self) -> None:
        """The iteration is over: every pending depth is final (the calls folded in)."""
        batch = _Batch()
        if self._held:
            at = np.array([c for c, _ in self._held])
            ready_at = np.array([r for _, r in self._held])
            batch.times.extend(at.tolist())
            batch.depths.extend(_depths(at, ready_at, len(at), self.ahead))
            self._held = []
        self._user.fold(batch)
        if self._logged is not None:
            self._logged.fold(batch)

    def end(self) -> None:
        """The iteration ends (finished, abandoned or failed): the log gets its window."""
        with self._lock:
            self._fold()
            self._settle()
            if self._logged is not None:
                now = _now()
                self._flush_log(now)
                self._logged = _Window(now, self.epoch)

    def _flush_log(self, now: float) -> None:
        logged, log = self._logged, self._log
        self._log_due = now + self.log_every if log is not None else float("inf")
        # (a window without steps is written when reports came in it: the workers' last,
        # with their epoch's end markers, after the log's last window of steps)
        if logged is not None and log is not None and (logged.steps or logged.workers):
            log(logged.result(now, self.rank, self.step))

    def take(self) -> LoaderStats:
        """The user's window, and a new one from now."""
        with self._lock:
            self._fold()
            now = _now()
            stats = self._user.result(now, self.rank, self.step)
            self._user = _Window(now, self.epoch)
        return stats
