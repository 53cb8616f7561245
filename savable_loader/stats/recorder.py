"""The main-process side of ``loader.stats()``: the training loop's waits, the workers' reports.

A loader that records statistics (``record_stats=True``, the default) holds one
:class:`Recorder`. Its iterations tell it when each ``next()`` was called and when it
returned (:meth:`Recorder.yielded`), and hand it the :data:`~savable_loader.stats.clock.WorkerReport`
that came with each item (:meth:`Recorder.report`). It keeps two windows: the user's
(since the last ``stats()`` call or the epoch's start, whichever is later) and, with a
stats log, the log's (written every ``stats_log_every`` seconds and at each epoch's end).

**Items ready when the loop asked.** The depth of the loader's queue at a ``next()`` call
is the number of items, that one included, whose worker had finished them before the
call (a :data:`~savable_loader.stats.clock.WorkerReport`'s ``done_at``;
``time.perf_counter()`` is the system's monotonic clock, one for every process of the
machine). It is known once the items that could have been finished by then have
arrived: torch's iterator has at most ``ahead`` items (``prefetch_factor x
num_workers``) in flight, so the depth of call ``j`` is final at call ``j + ahead``,
exactly, and a few calls are pending at any moment (they land in the windows current
when they are folded in, below).

**Cost.** The main process books each item in a few plain counters and appends its call
to a list; every :data:`FOLD_ITEMS` items, and whenever a window is read, the counters
are added into the windows (so a log window costs nothing per item).

Example (what an iteration does per item)::

    called = time.perf_counter()
    recorder.begin(epoch=0, called_at=called)      # the iteration's first next()
    recorder.report(report)           # in the engine's on_item
    recorder.yielded(called)          # the item is returned to the loop
    stats = recorder.take()
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from savable_loader.stats.clock import WorkerReport
from savable_loader.stats.record import LoaderStats, QueueStats, StageStats, WorkerStats

__all__ = ["FOLD_ITEMS", "SERIES_POINTS", "Recorder"]

#: Queue depths a window keeps for its ``series`` (every call at first, then every
#: second, fourth, ... call once the series is full).
SERIES_POINTS = 100

#: Items booked between two folds of the counters into the windows.
FOLD_ITEMS = 256

_now = time.perf_counter


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
            worker = self.workers.get(who)
            if worker is None:
                worker = self.workers[who] = [0, 0, 0.0]
            worker[0] += items
            worker[1] += samples
            worker[2] += busy
        stages = self.stages
        for reported in batch.stages:
            for name, seconds, items, _ in reported:
                slot = stages.get(name)
                if slot is None:
                    slot = stages[name] = [0.0, 0]
                slot[0] += seconds
                slot[1] += items
        for called_at, depth in batch.calls:
            self.depth(called_at, depth)

    def depth(self, called_at: float, depth: int) -> None:
        self.calls += 1
        self.depth_sum += depth
        self.depth_max = max(self.depth_max, depth)
        if depth == 0:
            self.depth_zero += 1
        if (self.calls - 1) % self.stride == 0:
            # (a call made before the window began, whose depth became final in it: at 0)
            self.series.append((round(max(called_at - self.start, 0.0), 6), depth))
            if len(self.series) >= 2 * SERIES_POINTS:
                self.series = self.series[::2]
                self.stride *= 2

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
    """What the items since the last fold booked (see the module docstring)."""

    __slots__ = ("calls", "samples", "stages", "steps", "waited", "workers")

    def __init__(self) -> None:
        self.waited = 0.0
        self.steps = 0
        self.samples = 0
        #: worker -> [items, samples, busy seconds]
        self.workers: dict[int, list[Any]] = {}
        #: the stage times reports carried
        self.stages: list[Any] = []
        #: [called_at, depth] of the calls whose depth became final
        self.calls: list[list[Any]] = []

    def report(self, r: WorkerReport) -> None:
        who, done_at, busy, samples, reported = r
        worker = self.workers.get(who)
        if worker is None:
            worker = self.workers[who] = [0, 0, 0.0]
        if done_at is not None:
            worker[0] += 1
        worker[1] += samples
        worker[2] += busy
        self.samples += samples
        if reported:
            self.stages.append(reported)


class Recorder:
    """One loader's statistics (see the module docstring).

    ``rank``: the loader's rank (recorded in each :class:`LoaderStats`); ``ahead``: the
    items torch's iterator may have in flight (``prefetch_factor x num_workers``, 1 in
    the main process); ``log``: called with each finished log window, every
    ``log_every`` seconds and at the end of each iteration (None: no log).
    """

    def __init__(
        self,
        rank: int,
        ahead: int,
        log: Callable[[LoaderStats], None] | None = None,
        log_every: float = 10.0,
    ) -> None:
        self.rank = rank
        self.ahead = max(1, ahead)
        self._log = log
        self.log_every = log_every
        self._lock = threading.Lock()
        now = _now()
        self.epoch = 0
        self.step = 0
        self._user = _Window(now, 0)
        self._logged = _Window(now, 0) if log is not None else None
        #: [called_at, depth] of the calls whose depth is not final yet, oldest first
        self._pending: deque[list[Any]] = deque()
        self._item: WorkerReport | None = None  # the report of the item being returned
        self._batch = _Batch()

    def _fold(self) -> None:
        """Add the booked items to the windows (the lock held)."""
        batch, self._batch = self._batch, _Batch()
        self._user.fold(batch)
        if self._logged is not None:
            self._logged.fold(batch)

    def begin(self, epoch: int, called_at: float | None = None) -> None:
        """An iteration of ``epoch`` begins, in a ``next()`` called at ``called_at``
        (default: now): the user's window restarts there (the iteration's start is time
        the loop waits)."""
        with self._lock:
            self._settle()
            self._fold()
            now = _now() if called_at is None else called_at
            self.epoch = epoch
            self._user = _Window(now, epoch)
            if self._logged is not None:
                self._flush_log(now)
                self._logged = _Window(now, epoch)

    def report(self, r: WorkerReport) -> None:
        """A loading context's report on an item (kept for :meth:`yielded`, which books
        it with the call) or on its epoch's end (booked now)."""
        if r[1] is not None:
            self._item = r
            return
        with self._lock:
            self._batch.report(r)

    def yielded(self, called_at: float) -> None:
        """``next()``, called at ``called_at``, returns an item to the loop now."""
        now = _now()
        item, self._item = self._item, None
        with self._lock:
            self.step += 1
            batch = self._batch
            batch.waited += now - called_at
            batch.steps += 1
            pending = self._pending
            pending.append([called_at, 0])
            if item is not None:
                batch.report(item)
                ready = item[1]  # ready before the calls made since: one more in their queue
                for call in reversed(pending):
                    if call[0] < ready:
                        break
                    call[1] += 1
            if len(pending) > self.ahead:
                batch.calls.append(pending.popleft())
            if batch.steps >= FOLD_ITEMS:
                self._fold()
            logged = self._logged
            if logged is not None and now - logged.start >= self.log_every:
                self._fold()
                self._flush_log(now)
                self._logged = _Window(now, self.epoch)

    def waited(self, called_at: float) -> None:
        """``next()``, called at ``called_at``, ends the iteration now (StopIteration):
        the loop waited for it, no item came."""
        now = _now()
        with self._lock:
            self._batch.waited += now - called_at

    def _settle(self) -> None:
        """The iteration is over: every pending depth is final."""
        self._batch.calls.extend(self._pending)
        self._pending.clear()

    def end(self) -> None:
        """The iteration ends (finished, abandoned or failed): the log gets its window."""
        with self._lock:
            self._settle()
            self._fold()
            if self._logged is not None:
                now = _now()
                self._flush_log(now)
                self._logged = _Window(now, self.epoch)

    def _flush_log(self, now: float) -> None:
        logged, log = self._logged, self._log
        if logged is not None and log is not None and logged.steps:
            log(logged.result(now, self.rank, self.step))

    def take(self) -> LoaderStats:
        """The user's window, and a new one from now."""
        with self._lock:
            self._fold()
            now = _now()
            stats = self._user.result(now, self.rank, self.step)
            self._user = _Window(now, self.epoch)
        return stats
