"""Where a loading context's time goes: each stage's own time, and the reports sent with items.

A loading context (a worker process, or the main process when ``num_workers=0``) that
records statistics holds one :class:`StageClock`. While the context makes an item, the
clock is the thread's *active* clock (:func:`activate`, entered by the pipeline runtime
around each item), and every ``iter()`` of a :class:`~savable_loader.SavableDataset`
made then returns its iterator wrapped by :func:`timed` (see :func:`timed_iter`,
applied to every subclass's ``__iter__``). A wrapped iterator times
each ``next()`` and keeps the **own time** of its stage: the time of that ``next()``
less the time spent in the ``next()`` of the stages it pulls from. A ``MapDataset`` over
a source is then charged its function's time, the source its reading, however they nest.

Outside an active clock (a pipeline iterated by hand, or statistics turned off) nothing
is wrapped: ``iter()`` returns the dataset's own iterator.

**Cost.** Timing a ``next()`` reads the clock twice (0.03 to 0.2 µs a read, by machine),
which is nothing next to a sample of a millisecond but several percent of a sample of a
few microseconds. So the clock times the stages of some items only, enough to keep
the timing under :data:`TIMING_BUDGET` of the pipeline's time: every item while the
timing of one item costs less than that share of an item (the usual case: all items are
timed, and the stage times are exact), else one item in so many. The items' count is
exact either way, and each item's pipeline time is measured always; a stage's seconds
are then its own time in the timed items times the pipeline's time in all items over
that in the timed ones (a ratio estimate, which holds when a costly item, a shuffle
buffer's fill, is among the timed ones: its weight is its time).

Even untimed, a wrapped ``next()`` costs a Python call (about 0.07 µs). Where that alone
exceeds the budget (samples of a few microseconds: judged over each
:data:`PROBE_ITEMS` items), the clock **settles**: the stages' generators hand over to
their datasets' own (``yield from``, about 0.02 µs a call) for the rest of the run, and
each later report divides the pipeline's measured time among the stages, and its items,
in the proportions measured until then.

A clock's totals leave the context in :data:`WorkerReport` s, one per item: when the
item was ready (``time.perf_counter()``: the system's monotonic clock, one for every
process of the machine), the context's busy seconds for it, and, at most every
:data:`FLUSH_SECONDS` and at the end of an epoch, the stage seconds accumulated since the
last report.

Example (what the pipeline runtime does per item)::

    clock = StageClock()
    clock.name_stages(walk(pipeline))
    with activate(clock):
        clock.begin_item()
        sample = next(iterator)          # each stage's own time added to the clock
        clock.end_item(seeding=0.00001, pipeline=0.004)
    report = clock.report(worker=0, busy=0.004, now=time.perf_counter())
"""

from __future__ import annotations

import functools
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = [
    "FLUSH_SECONDS",
    "PROBE_ITEMS",
    "TIMING_BUDGET",
    "StageClock",
    "StageTime",
    "TimedIterator",
    "WorkerReport",
    "activate",
    "active_clock",
    "stage_name",
    "timed",
    "timed_iter",
]

#: A context sends its stage totals at most this often (and at each epoch's end).
FLUSH_SECONDS = 0.1

#: The share of a pipeline's time its stage timing may cost (see the module docstring).
TIMING_BUDGET = 0.003

#: Items over which the clock judges whether wrapping the stages fits the budget.
PROBE_ITEMS = 32

_now = time.perf_counter
_local = threading.local()


def _layer_cost() -> float:
    """Seconds a wrapped, untimed ``next()`` adds in this process (cheapest of a few tries)."""
    clock = StageClock.__new__(StageClock)
    clock.on, clock.settled = False, False
    slot: list[Any] = ["", 0.0, 0, False, 0, 0.0, 0]
    best = float("inf")
    for _ in range(3):
        plain = iter(range(200))
        start = _now()
        for _ in plain:
            pass
        middle = _now()
        for _ in timed(iter(range(200)), slot, clock):
            pass
        best = min(best, (_now() - middle - (middle - start)) / 200)
    return max(best, 0.0)


def _read_cost() -> float:
    """Seconds one clock read costs in this process (the cheapest of a few tries)."""
    best = float("inf")
    for _ in range(5):
        start = _now()
        for _ in range(100):
            _now()
        best = min(best, (_now() - start) / 101)
    return best


#: A stage's own time over some items, as it travels: ``(name, seconds, items, source)``,
#: ``items`` the items it yielded, ``source`` whether it wraps no dataset (its items are
#: samples). Plain tuples, as :data:`WorkerReport`: they cross a process boundary with
#: every item, and a plain tuple is the cheapest thing to pickle.
StageTime = tuple[str, float, int, bool]

#: What a loading context says about one item it made (or its epoch's end):
#: ``(worker, done_at, busy, samples, stages)``. ``worker``: the worker (-1: the main
#: process); ``done_at``: ``time.perf_counter()`` when the item was ready (None: an end
#: marker); ``busy``: the context's seconds spent on it; ``samples``: samples in it (a
#: pipeline's: the items its sources yielded for it); ``stages``: the stage times since
#: the context's previous report, or None.
WorkerReport = tuple[int, "float | None", float, int, "tuple[StageTime, ...] | None"]


def stage_name(dataset: Any) -> str:
    """How reports name a dataset's stage: its class, and the name of the function it
    applies when it has one (``MapDataset(augment)``)."""
    name = type(dataset).__name__
    fn = getattr(dataset, "fn", None)
    label = getattr(fn, "__name__", None)
    if isinstance(label, str) and label and label != "<lambda>":
        name = f"{name}({label})"
    return name


class StageClock:
    """The own time of each stage of one loading context (see the module docstring).

    Stages are named once per epoch (:meth:`name_stages`: the pipeline's datasets, depth
    first; a name met twice gets ``#2``, ``#3``); a dataset the clock meets unnamed
    (made while iterating) is named by :func:`stage_name`. :meth:`add` charges time to a
    named step that is not a dataset (``collate``, ``snapshot``).
    """

    def __init__(self) -> None:
        #: id(dataset) -> [name, seconds, items, source, items counted as samples,
        #: seconds in timed items and items in all items since the run began]
        #: (seconds and items since the stage times were last taken)
        self._slots: dict[int, list[Any]] = {}
        self._sources: list[list[Any]] = []
        self._extra: dict[str, list[Any]] = {}
        self._keep: list[Any] = []  # the named datasets, alive while their ids are keys
        #: the item being made has its stages timed (else their items are only counted)
        self.on = True
        #: timed ``next()`` calls in the item being made
        self.calls = 0
        #: seconds spent in the stages pulled from by the ``next()`` running now
        self.child = 0.0
        self._read = _read_cost()
        #: pipeline seconds of untimed items still to come before the next timed one
        self._owed = 0.0
        #: pipeline seconds of all items and of the timed ones, since the last take()
        self._all = 0.0
        self._timed = 0.0
        self._flushed = _now()
        #: stage timing is over for this run (see the module docstring)
        self.settled = False
        self._layer = 0.0  # measured when first needed
        #: items, timed items, their timed calls and pipeline seconds: in the run, and
        #: in the probe window (the last up to PROBE_ITEMS items)
        self._run = [0, 0, 0, 0.0, 0.0]  # items, timed items, timed calls, all seconds, timed seconds
        self._probe = [0, 0, 0, 0.0]  # items, timed items, timed calls, all seconds
        #: after settling: samples per item, and the fraction of a sample owed
        self._per_item = 0.0
        self._owed_samples = 0.0
        self._items_since = 0  # items made since the last take()

    def name_stages(self, datasets: Iterable[Any]) -> None:
        """Name the stages of a pipeline (``datasets``: outermost first)."""
        seen: dict[str, int] = {}
        for dataset in datasets:
            if id(dataset) in self._slots:
                continue
            name = stage_name(dataset)
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name} #{seen[name]}"
            self._slot(dataset, name)

    def _slot(self, dataset: Any, name: str | None = None) -> list[Any]:
        slot = self._slots.get(id(dataset))
        if slot is None:
            children = getattr(dataset, "children", None)
            source = not (callable(children) and children())
            slot = [name or stage_name(dataset), 0.0, 0, source, 0, 0.0, 0]
            self._slots[id(dataset)] = slot
            self._keep.append(dataset)
            if source:
                self._sources.append(slot)
        return slot

    def wrap(self, dataset: Any, iterator: Iterator[Any]) -> Iterator[Any]:
        """``iterator`` (of ``dataset``) timed as the dataset's stage: by a generator
        when it is one (the cheaper wrapper; a generator ends at its first exception,
        and so does the wrapper), else by a :class:`TimedIterator`, which goes on after
        an exception as the iterator it wraps may (a torch IterableDataset's)."""
        it = iter(iterator)
        if isinstance(it, types.GeneratorType):
            return timed(it, self._slot(dataset), self)
        return TimedIterator(it, self._slot(dataset), self)

    def begin_item(self) -> None:
        """An item is being made: time its stages if the budget allows."""
        self.on = self._owed <= 0.0
        self.calls = 0

    def end_item(self, seeding: float, pipeline: float) -> None:
        """The item was made: ``seeding`` seconds of re-seeding, ``pipeline`` seconds in
        the pipeline's ``next()``."""
        self.add("seeding", seeding)
        self._all += pipeline
        self._items_since += 1
        if self.settled:
            return
        run, probe = self._run, self._probe
        run[0] += 1
        run[3] += pipeline
        probe[0] += 1
        probe[3] += pipeline
        if self.on:
            run[1] += 1
            run[2] += self.calls
            run[4] += pipeline
            probe[1] += 1
            probe[2] += self.calls
        if probe[0] >= PROBE_ITEMS and probe[1]:
            self._judge()
        if self.on:
            self._timed += pipeline
            # (this item's timing cost, in pipeline seconds the budget needs, less the
            # seconds it paid itself: at most 0 when the budget allows timing every item)
            self._owed = 2 * self.calls * self._read / TIMING_BUDGET - pipeline
        else:
            self._owed -= pipeline

    def _judge(self) -> None:
        """End of a probe window: settle if the wrappers' cost alone exceeds the budget."""
        items, timed_items, calls, seconds = self._probe
        self._probe = [0, 0, 0, 0.0]
        if not self._layer:
            self._layer = _layer_cost() or 1e-9
        if calls / timed_items * self._layer <= TIMING_BUDGET * seconds / items:
            return
        items, timed_items, _, _, timed_seconds = self._run
        for slot in self._slots.values():  # the proportions the rest of the run is divided in
            seconds, count = slot[5] + slot[1], slot[6] + slot[2]
            slot[5] = seconds / timed_seconds if timed_seconds > 0 else 0.0
            slot[6] = count / items
            slot[1], slot[2], slot[4] = 0.0, 0, slot[4] - slot[2]
        self._per_item = sum(slot[6] for slot in self._sources)
        self.settled = True
        self.on = False

    def add(self, name: str, seconds: float, items: int = 1) -> None:
        """Charge ``seconds`` to the step ``name`` (not a dataset: ``collate``, ``snapshot``)."""
        slot = self._extra.get(name)
        if slot is None:
            slot = self._extra[name] = [name, 0.0, 0, False, 0]
        slot[1] += seconds
        slot[2] += items

    def take(self, final: bool = False) -> tuple[StageTime, ...]:
        """The stage times since the last :meth:`take` (the datasets' scaled to all items,
        see the module docstring), and start counting anew (``final``: the run's end)."""
        out: list[StageTime] = []
        if self.settled:  # the pipeline's time divided in the measured proportions
            work, self._all = self._all, 0.0
            items, self._items_since = self._items_since, 0
            for slot in self._slots.values():
                if slot[5] or slot[6]:
                    out.append((slot[0], work * slot[5], round(items * slot[6]), slot[3]))
        else:
            # (no item timed since the last take: its pipeline time waits for the next
            # timed item, whose scale then covers it; at the run's end it is divided in
            # the run's proportions so far)
            if self._timed > 0:
                scale = self._all / self._timed
                self._all = self._timed = 0.0
            else:
                scale = 1.0
                if final:
                    carried, self._all = self._all, 0.0
                    if self._run[4] > 0:
                        for slot in self._slots.values():
                            slot[1] += carried * slot[5] / self._run[4]
            self._items_since = 0
            for slot in self._slots.values():
                if slot[2] or slot[1]:
                    out.append((slot[0], slot[1] * scale, slot[2], slot[3]))
                    slot[5] += slot[1]
                    slot[6] += slot[2]
                    slot[1], slot[2], slot[4] = 0.0, 0, slot[4] - slot[2]
        for slot in self._extra.values():
            if slot[2] or slot[1]:
                out.append((slot[0], slot[1], slot[2], slot[3]))
                slot[1], slot[2] = 0.0, 0
        self._flushed = _now()
        return tuple(out)

    def samples(self) -> int:
        """Items the sources (stages that wrap no dataset) yielded since the last call
        (once settled: the item's share of them, at the measured rate)."""
        if self.settled:
            owed = self._owed_samples + self._per_item
            count = int(owed)
            self._owed_samples = owed - count
            return count
        count = 0
        for slot in self._sources:
            count += slot[2] - slot[4]
            slot[4] = slot[2]
        return count

    def report(self, worker: int, busy: float, now: float, final: bool = False) -> WorkerReport:
        """The report of an item ready at ``now`` (``final``: the epoch's end marker): its
        samples (the sources' items since the last report), and the stage times if due
        (always when ``final``)."""
        samples = 0 if final and self.settled else self.samples()
        stages = self.take(final) if final or now - self._flushed >= FLUSH_SECONDS else None
        return (worker, None if final else now, busy, samples, stages)


def timed(iterator: Iterator[Any], slot: list[Any], clock: StageClock) -> Iterator[Any]:
    """``iterator`` whose ``next()`` calls add their own time to ``slot`` (see the module
    docstring); closing it closes ``iterator``."""
    now = _now
    pull = iterator.__next__
    try:
        while not clock.settled:
            if clock.on:
                outer = clock.child
                clock.child = 0.0
                start = now()
                try:
                    value = pull()
                finally:
                    spent = now() - start
                    slot[1] += spent - clock.child
                    clock.child = outer + spent
                    clock.calls += 1
            else:
                value = pull()
            slot[2] += 1
            yield value
        yield from iterator  # settled: the dataset's own generator, at C speed
    except StopIteration:
        return
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


class TimedIterator:
    """An iterator that is not a generator, timed as :func:`timed` times a generator:
    an exception from its ``next()`` passes through and the iterator goes on;
    ``close()`` closes it; its other attributes are its own."""

    __slots__ = ("_clock", "_it", "_slot")

    def __init__(self, iterator: Iterator[Any], slot: list[Any], clock: StageClock) -> None:
        self._it = iterator
        self._slot = slot
        self._clock = clock

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        clock, slot = self._clock, self._slot
        if clock.settled:
            return next(self._it)
        if not clock.on:
            value = next(self._it)
            slot[2] += 1
            return value
        outer = clock.child
        clock.child = 0.0
        start = _now()
        try:
            value = next(self._it)
        finally:
            spent = _now() - start
            slot[1] += spent - clock.child
            clock.child = outer + spent
            clock.calls += 1
        slot[2] += 1
        return value

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


def active_clock() -> StageClock | None:
    """The clock of the item the current thread is making, if any."""
    clock: StageClock | None = getattr(_local, "clock", None)
    return clock


class activate:
    """Make ``clock`` the current thread's active clock for a block (None: no clock)."""

    __slots__ = ("_clock", "_saved")

    def __init__(self, clock: StageClock | None) -> None:
        self._clock = clock
        self._saved: StageClock | None = None

    def __enter__(self) -> None:
        self._saved = getattr(_local, "clock", None)
        _local.clock = self._clock

    def __exit__(self, *exc: object) -> None:
        _local.clock = self._saved


def timed_iter(method: Callable[[Any], Iterator[Any]]) -> Callable[[Any], Iterator[Any]]:
    """``method`` (a dataset class's ``__iter__``) returning its iterator wrapped by
    :func:`timed` while a clock is active, and the dataset's own iterator otherwise."""
    if getattr(method, "__timed__", False):
        return method

    # (it names only importable functions: cloudpickle copies a class of the user's
    # ``__main__`` by value, this function with it, to spawned workers)
    @functools.wraps(method)
    def __iter__(self: Any) -> Iterator[Any]:
        iterator = method(self)
        clock = active_clock()
        if clock is None:
            return iterator
        own = type(self).__iter__
        if own is not __iter__ and getattr(own, "__timed__", False):
            # super().__iter__() from a subclass's timed __iter__: the subclass's wrapper
            # times the stage (wrapped here too, its items would count twice)
            return iterator
        return clock.wrap(self, iterator)

    __iter__.__timed__ = True  # type: ignore[attr-defined]
    return __iter__
