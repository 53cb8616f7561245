"""Where a loading context's time goes: each stage's own time, and the reports sent with items.

A loading context (a worker process, or the main process when ``num_workers=0``) that
records statistics holds one :class:`StageClock`. While the context makes an item, the
clock is the thread's *active* clock (``timed.activate``, entered by the pipeline runtime
around each item), and every ``iter()`` of a :class:`~savable_loader.SavableDataset`
made then returns its iterator wrapped (``stats/timed.py``: ``timed_iter``, applied to
every subclass's ``__iter__``, and :meth:`StageClock.wrap`). A wrapped iterator times
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
:data:`PROBE_ITEMS` items), the clock **settles**: every wrapper hands its stage over to
the dataset's own iterator (a :class:`Handover`, an ``itertools.chain`` whose first part
is the timing wrapper: once that ends, the stage's items pass through C code, about
3 ns a sample, or none where the stage that reads them loops over
``timed.parts_of``), and each later report divides the items' measured busy time (less
the snapshots, still timed) among the re-seeding, the stages and the collate function,
and their items, in the proportions measured until then (a stage first met after
settling gets none: its time is in the others'). A settled clock keeps per item only its
count and busy seconds, which a loading loop may sum itself, with its snapshots (see
:meth:`StageClock.made`): a call per item is a share of a µs-sample pipeline's time.
Where the collate function's share of an item's time is at most
:data:`ESTIMATED_COLLATE_SHARE`, those busy seconds end before it, and its seconds are
added at that share (``collate_estimated``: a clock read less per item).

A clock's totals leave the context in :data:`WorkerReport` s, at most every
:data:`FLUSH_SECONDS` (with the item then made) and with the epoch's end marker: the
items made since the last report, the context's busy seconds for them, their samples
and the stage times. Every other item of a worker process carries only the time it was
ready (``time.perf_counter()``: the system's monotonic clock, one for every process of
the machine), which the main process needs for the depth of its queue; an item of the
main process's own pipeline carries nothing. Per item, the clock only adds the item's
seconds to a few sums (a list of them per item would be cheaper still, but it is a
container the garbage collector then walks: 3 % of a packing pipeline's time).

Example (what the pipeline runtime does per item)::

    clock = StageClock(worker=0)
    clock.name_stages(walk(pipeline))
    with activate(clock):
        begun = time.perf_counter()
        ...                              # re-seeding
        pulled = time.perf_counter()
        sample = next(iterator)          # each stage's own time added to the clock
        made = time.perf_counter()
    report = clock.made(begun, pulled, made, ready=made)   # a time, or a WorkerReport when due
    ...
    final = clock.report(time.perf_counter(), final=True)  # with the epoch's end marker
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator
from typing import Any

from savable_loader.stats.timed import handover, timed

__all__ = [
    "ESTIMATED_COLLATE_SHARE",
    "FLUSH_SECONDS",
    "PROBE_ITEMS",
    "TIMING_BUDGET",
    "StageClock",
    "StageTime",
    "WorkerReport",
    "stage_name",
]

#: A context sends its stage totals at most this often (and at each epoch's end).
FLUSH_SECONDS = 0.1

#: The share of a pipeline's time its stage timing may cost (see the module docstring).
TIMING_BUDGET = 0.003

#: Items over which the clock judges whether wrapping the stages fits the budget.
PROBE_ITEMS = 16

#: Once settled, the collate function's seconds are estimated at their share of an
#: item's (measured until then) where that share is at most this, else timed.
ESTIMATED_COLLATE_SHARE = 0.5

_now = time.perf_counter


@functools.cache
def _layer_cost() -> float:
    """Seconds a wrapped, untimed ``next()`` adds in this process (cheapest of a few tries;
    measured once)."""
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


@functools.cache
def _read_cost() -> float:
    """Seconds one clock read costs in this process (the cheapest of a few tries;
    measured once)."""
    best = float("inf")
    for _ in range(5):
        start = _now()
        for _ in range(100):
            _now()
        best = min(best, (_now() - start) / 101)
    return best


#: A stage's own time over some items, as it travels: ``(name, seconds, items, source)``,
#: ``items`` the items it yielded, ``source`` whether it wraps no dataset (its items are
#: samples). Plain tuples, as :data:`WorkerReport`: they cross a process boundary, and a
#: plain tuple is the cheapest thing to pickle.
StageTime = tuple[str, float, int, bool]

#: What a loading context says about the items it made since its last report (sent
#: with an item, or with its epoch's end marker): ``(worker, done_at, items, busy,
#: samples, stages)``. ``worker``: the worker (-1: the main process); ``done_at``:
#: ``time.perf_counter()`` when the item it travels with was ready (None: an end
#: marker); ``items``: the items made since the last report, that one included;
#: ``busy``: the context's seconds spent on them; ``samples``: the samples in them (a
#: pipeline's: the items its sources yielded); ``stages``: the stage times.
WorkerReport = tuple[int, "float | None", int, float, int, "tuple[StageTime, ...]"]


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

    ``worker``: the context's worker, named in its reports (-1: the main process);
    ``stamp``: each item carries the time it was ready (a worker process: the main
    process needs it for its queue's depth; the main process's own pipeline: not).

    Stages are named once per epoch (:meth:`name_stages`: the pipeline's datasets, depth
    first; a name met twice gets ``#2``, ``#3``); a dataset the clock meets unnamed
    (made while iterating) is named by :func:`stage_name`. :meth:`add` charges time to a
    named step that is not a dataset (``snapshot``); ``seeding`` and ``collate`` are
    charged by :meth:`made`.
    """

    def __init__(self, worker: int = 0, stamp: bool = True) -> None:
        self.worker = worker
        self.stamp = stamp
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
        #: pipeline seconds of all items and of the timed ones, and the items made, since
        #: the last take()
        self._all = 0.0
        self._timed = 0.0
        self._made = 0
        #: since the last report, while timing: items sent, and their busy, seeding,
        #: pipeline and collate seconds; items that used the collate function
        self._sums: list[Any] = [0, 0.0, 0.0, 0.0, 0.0, 0]
        #: items sent since the last report, and the seconds spent on them
        self._items = 0
        self._busy = 0.0
        #: items replayed since the last report, while timing, and their busy, seeding
        #: and pipeline seconds
        self._replay: list[Any] = [0, 0.0, 0.0, 0.0]
        #: Once settled: items sent (the loading loop's sums, see :meth:`made`) and
        #: replayed (:meth:`replayed` only), and their busy seconds.
        self.sent = 0
        self.replays = 0
        self.busy = 0.0
        #: seconds of steps timed by :meth:`add` (snapshots) since the settled counters
        #: were last summed: they are in ``busy``, and not divided among the stages
        self._measured = 0.0
        #: in the run until settling, of the items sent: their count, and their busy,
        #: seeding, pipeline, collate and snapshot seconds; items that used the collate
        #: function
        self._totals: list[Any] = [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0]
        #: after settling: the shares of an item's busy seconds (snapshots left out) of
        #: seeding, the pipeline and the collate function; collated items per item
        self._split = (0.0, 0.0, 0.0, 0.0)
        #: when the next report is due (FLUSH_SECONDS after the last)
        self.due = _now() + FLUSH_SECONDS
        #: stage timing is over for this run (see the module docstring)
        self.settled = False
        #: Once settled: the loading loop's busy seconds of an item end before its collate
        #: function, whose seconds are added at the share measured until then (a clock
        #: read less per item; where that share is at most ESTIMATED_COLLATE_SHARE)
        self.collate_estimated = False
        self._layer = 0.0  # measured when first needed
        #: items, timed items, their timed calls and pipeline seconds: in the run, and
        #: in the probe window (the last up to PROBE_ITEMS items)
        self._run = [0, 0, 0, 0.0, 0.0]  # items, timed items, timed calls, all seconds, timed seconds
        self._probe = [0, 0, 0, 0.0]  # items, timed items, timed calls, all seconds
        #: after settling: samples per item, and the fraction of a sample owed
        self._per_item = 0.0
        self._owed_samples = 0.0

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
        """``iterator`` (of ``dataset``) timed as the dataset's stage, in a
        :class:`~savable_loader.stats.timed.Handover` (see ``stats/timed.py``)."""
        return handover(iter(iterator), self._slot(dataset), self)

    def made(self, begun: float, pulled: float, made: float, ready: float, collate: float | None = None) -> Any:
        """An item was made: re-seeded from ``begun`` to ``pulled``, the pipeline's
        ``next()`` from ``pulled`` to ``made``, ``collate`` seconds in the collate
        function (None: none), ready to leave at ``ready``. Returns what travels with it:
        a :data:`WorkerReport` when one is due, else ``ready`` (``stamp``) or None.

        Once the clock has settled, only the item's count and busy seconds are kept
        (the steps are divided in the proportions measured until then), and a loading
        loop may sum them itself, in locals, sparing a call per item, with its snapshots'
        seconds and count, and add them to the clock before each report and the last
        (``pipeline/worker.py`` does, counting the items as the change of their index
        since ``booked``)::

            busy += ready - begun
            if ready >= clock.due:
                clock.sent, clock.busy = clock.sent + index - booked, clock.busy + busy
                if snapshots:
                    clock.add("snapshot", snapshot_seconds, snapshots)
                booked, busy, snapshot_seconds, snapshots = index, 0.0, 0.0, 0
                report = clock.report(ready)
        """
        if self.settled:
            self.sent += 1
            self.busy += ready - begun
            if self.collate_estimated and collate is not None:  # (added at its share, see _sum_items)
                self.busy -= collate
        else:
            sums = self._sums
            sums[0] += 1
            sums[1] += ready - begun
            sums[2] += pulled - begun
            sums[3] += made - pulled
            if collate is not None:
                sums[4] += collate
                sums[5] += 1
            self._account(made - pulled, sent=True)
        if ready >= self.due:
            return self.report(ready)
        return ready if self.stamp else None

    def replayed(self, begun: float, pulled: float, made: float) -> None:
        """An item was made and not sent (a restored worker replaying to its position):
        its time counts, the item does not. A replay is first in its run, and a clock
        settles on sent items only, so the runtime's replays are all before settling."""
        if self.settled:
            self.replays += 1
            self.busy += made - begun
            return
        replay = self._replay
        replay[0] += 1
        replay[1] += made - begun
        replay[2] += pulled - begun
        replay[3] += made - pulled
        self._account(made - pulled, sent=False)

    def _sum_items(self) -> None:
        """Add the items sent and replayed since the last call to the report's items and
        busy seconds, the pipeline's time and the seeding and collate steps (once
        settled: the busy seconds, snapshots left out, divided in the measured shares)."""
        sent, busy, seeding, pipeline, collate, collated = self._sums
        if sent:
            self._sums = [0, 0.0, 0.0, 0.0, 0.0, 0]
            if not self.settled:  # (the shares are of sent items: replays are not collated)
                totals = self._totals
                totals[0] += sent
                totals[1] += busy
                totals[2] += seeding
                totals[3] += pipeline
                totals[4] += collate
                totals[6] += collated
        replayed, replay_busy, replay_seeding, replay_pipeline = self._replay
        if replayed:
            self._replay = [0, 0.0, 0.0, 0.0]
        made = sent + replayed
        if made:
            self.add("seeding", seeding + replay_seeding, made)
            if collated:
                self.add("collate", collate, collated)
            self._items += sent
            self._busy += busy + replay_busy
            self._all += pipeline + replay_pipeline
            self._made += made
        sent, replayed, busy = self.sent, self.replays, self.busy
        if sent or replayed:
            self.sent = self.replays = 0
            self.busy = 0.0
            spent, self._measured = max(busy - self._measured, 0.0), 0.0
            seeding, pipeline, collate, collated = self._split
            made = sent + replayed
            if self.collate_estimated and sent:  # (the sent items' collate seconds, at their share)
                extra = spent * collate / (1.0 - collate) * sent / made
                spent += extra
                busy += extra
            self.add("seeding", spent * seeding, made)
            if collated:
                self.add("collate", spent * collate, round(sent * collated))
            self._items += sent
            self._busy += busy
            self._all += spent * pipeline
            self._made += made

    def _account(self, pipeline: float, sent: bool) -> None:
        """An item's ``pipeline`` seconds (while timing); whether the next item is timed.
        The clock settles once it has timed :data:`PROBE_ITEMS` sent items at least: a
        restored worker's replay (first in its run) is not collated, and the shares
        after settling are measured on items that are."""
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
        if sent and probe[0] >= PROBE_ITEMS and probe[1] and self._sums[0] + self._totals[0] >= PROBE_ITEMS:
            self._judge()
        if self.on:
            self._timed += pipeline
            # (this item's timing cost, in pipeline seconds the budget needs, less the
            # seconds it paid itself: at most 0 when the budget allows timing every item)
            self._owed = 2 * self.calls * self._read / TIMING_BUDGET - pipeline
        else:
            self._owed -= pipeline
        self.on = not self.settled and self._owed <= 0.0
        self.calls = 0

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
        # (the items made since the last take are reported with the later ones, at these
        # proportions: the stages' own counts of them are dropped)
        self._per_item = sum(slot[6] for slot in self._sources)
        self._sum_items()  # (the run's totals complete; the item being made is in them)
        made, busy, seeding, pipeline, collate, snapshots, collated = self._totals
        spent = busy - snapshots
        if spent > 0:
            self._split = (seeding / spent, pipeline / spent, collate / spent, collated / made)
            self.collate_estimated = collate / spent <= ESTIMATED_COLLATE_SHARE
        self.settled = True
        self.on = False

    def add(self, name: str, seconds: float, items: int = 1) -> None:
        """Charge ``seconds`` to the step ``name`` (not a dataset: ``snapshot``)."""
        slot = self._extra.get(name)
        if slot is None:
            slot = self._extra[name] = [name, 0.0, 0, False, 0]
        slot[1] += seconds
        slot[2] += items
        if name not in ("seeding", "collate"):  # (a step inside an item's busy seconds)
            if self.settled:
                self._measured += seconds
            else:
                self._totals[5] += seconds

    def take(self, final: bool = False) -> tuple[StageTime, ...]:
        """The stage times since the last :meth:`take` (the datasets' scaled to all items,
        see the module docstring), and start counting anew (``final``: the run's end)."""
        self._sum_items()
        out: list[StageTime] = []
        if self.settled:  # the pipeline's time divided in the measured proportions
            work, self._all = self._all, 0.0
            items, self._made = self._made, 0
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
            self._made = 0
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
        self.due = _now() + FLUSH_SECONDS
        return tuple(out)

    def samples(self) -> int:
        """Items the sources (stages that wrap no dataset) yielded since the last call
        (once settled: the share of the items made since, at the measured rate)."""
        if self.settled:
            owed = self._owed_samples + self._per_item * self._made
            count = int(owed)
            self._owed_samples = owed - count
            return count
        count = 0
        for slot in self._sources:
            count += slot[2] - slot[4]
            slot[4] = slot[2]
        return count

    def report(self, now: float, final: bool = False) -> WorkerReport:
        """The report of the items made since the last one, sent with an item ready at
        ``now`` or (``final``) with the epoch's end marker; counting starts anew."""
        self._sum_items()
        samples = self.samples()
        stages = self.take(final)
        report = (self.worker, None if final else now, self._items, self._busy, samples, stages)
        self._items, self._busy = 0, 0.0
        return report
