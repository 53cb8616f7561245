"""Worker side of the savable-pipeline protocol: snapshots attached to items, skip replay.

Each loading context (a worker process, or the main process when ``num_workers=0``) runs
one :class:`WorkerRuntime`. Its iterating thread walks the pipeline and, between two
samples, may take a **snapshot** (the pipeline's ``save_state()``); the policy
(:func:`snapshot_due`) keeps snapshot time below ``SNAPSHOT_BUDGET`` of sample time, and
bounds the replay a restore needs by the worker's cold start. Before producing sample
``i`` it re-seeds the global RNGs from ``(seed, rank, worker, epoch, i)`` (a seed below
``2**63``, see ``savable_loader.rng.seeding.item_seed``), so the RNG state at any sample is
implied by its index and never needs saving.

In a worker process each new snapshot is encoded (MessagePack, never a pickle) and
**attached to the next item the worker sends**, its end marker included: the main
process keeps the newest snapshots per worker and answers a save alone, as that snapshot
plus a **skip offset** (samples to replay after restoring it). A save never waits on a
worker, and nothing a save needs is lost when torch retires a worker after its end
marker. In the main process (``num_workers=0``) the snapshots stay in a small ring
(:class:`SnapshotRing`) that :meth:`WorkerRuntime.checkpoint` reads.

An exception the pipeline raises ends the iteration, except on a plain IterableDataset's
path (``errors_go_on``), where it is sent in the item's place (:class:`ItemError`) and
counts as that item, as torch's workers go on after a failed batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple, NoReturn, cast

import cloudpickle
from torch.utils.data import IterableDataset, get_worker_info

from savable_loader._torch.internals import ExceptionWrapper, torch_worker_id
from savable_loader.config import (
    SNAPSHOT_FORCED,
    SNAPSHOT_HINT,
    WorkerConfig,
    _ActiveWorker,
    take_snapshot_request,
)
from savable_loader.dataset.base import SavableDataset
from savable_loader.dataset.guards import exclusive
from savable_loader.dataset.inline import inline_small_tensors
from savable_loader.dataset.values import plain_dataset_state
from savable_loader.errors import ConfigMismatchError, DataError, StateError
from savable_loader.pipeline.hosting import hosted_by, in_view, interleave
from savable_loader.rng.formulas import pipeline_base, pipeline_item
from savable_loader.rng.global_rngs import GlobalRngs
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES, global_seeder
from savable_loader.state.codec import encode_part
from savable_loader.state.schema import DatasetState, WorkerState
from savable_loader.stats.clock import StageClock, WorkerReport
from savable_loader.stats.timed import activate

__all__ = [
    "SNAPSHOT_BUDGET",
    "End",
    "Item",
    "ItemError",
    "PipelineWorkerDataset",
    "SnapshotRing",
    "WorkerRuntime",
    "snapshot_due",
    "walk",
]

#: Fraction of sample-production time that snapshots may cost.
SNAPSHOT_BUDGET = 0.02

#: A restore replays the samples produced since the snapshot it starts from. Besides the
#: budget above, a snapshot is also due once that replay would exceed this fraction of
#: the worker's cold start (from the plan of its first iteration to its first sample:
#: process start, reset, filling a shuffle buffer), so that a restore (a process start,
#: the snapshot's restore, the replay) costs at most about 1.5 cold starts at any save
#: point ...
REPLAY_FRACTION = 0.15
#: ... but the replay bound is never below this many snapshot costs (snapshots then take
#: at most a quarter of the worker's time, when a snapshot is costly next to a cold start) ...
REPLAY_FLOOR_SNAPSHOTS = 3
#: ... nor below this many seconds (small states keep to the budget: a replay of a few
#: tens of milliseconds is small next to starting a worker process).
REPLAY_FLOOR_SECONDS = 0.02

#: A snapshot a dataset asks for (``SavableDataset.request_snapshot``: a source at the end
#: of a shard) is taken if the last snapshot cost at most this share of the sample work
#: since it (a small state: always; a big shuffle buffer over small shards: not always).
HINTED_SNAPSHOT_SHARE = 0.25


def snapshot_due(work: float, cost: float | None, cold: float, first: bool = False) -> bool:
    """The snapshot policy: ``work`` seconds of sample production since the last snapshot,
    which cost ``cost`` seconds (``None``: not measured, the restored snapshot a run
    started from); ``cold`` the worker's cold start (0: not measured); ``first``: the last
    snapshot was the run's first.

    Due when the budget pays for it (``work * SNAPSHOT_BUDGET >= cost``), or when a
    restore would replay more than ``max(REPLAY_FRACTION * cold, REPLAY_FLOOR_SNAPSHOTS *
    cost, REPLAY_FLOOR_SECONDS)`` seconds of work. A run's first snapshot pays for first
    touches (a fresh process's pages, caches): its cost does not raise the replay floor.
    After a restore only the replay bound applies until the run's own first snapshot
    (a snapshot of a big state right away would delay the restored first sample).

    >>> snapshot_due(work=0.5, cost=0.01, cold=0.0)  # 2 % of 0.5 s pays for 10 ms
    True
    >>> snapshot_due(work=0.04, cost=None, cold=1.0)  # restored: 0.3 x cold not reached
    False
    """
    if cost is not None and work * SNAPSHOT_BUDGET >= cost:
        return True
    floor = 0.0 if first or cost is None else REPLAY_FLOOR_SNAPSHOTS * cost
    return work >= max(REPLAY_FRACTION * cold, floor, REPLAY_FLOOR_SECONDS)


#: A snapshot as it travels with an item: ``(snapshot index, encoded DatasetState)``.
Snapshot = tuple[int, bytes]


class Item(NamedTuple):
    """One item of a pipeline worker's epoch, as it travels to the main process.

    ``worker``: the logical worker; ``item_index``: the item's index in the worker's epoch;
    ``key``: the pipeline's restore key for it; ``payload``: what the loader yields
    (after the collate function); ``snapshot``: the snapshot the worker took since the
    item before, if any (worker processes only, see ``WorkerRuntime._snapshot``);
    ``report``: with a loader recording statistics (``stats/clock.py``), the time the
    item was ready, or the worker's report on the items it made since its last one.

    >>> Item(worker=1, item_index=0, key=None, payload="a")
    Item(worker=1, item_index=0, key=None, payload='a', snapshot=None, report=None)
    """

    worker: int
    item_index: int
    key: Any
    payload: Any
    snapshot: Snapshot | None = None
    report: WorkerReport | float | None = None


class End(NamedTuple):
    """What a worker sends after its epoch's last item: ``produced`` items in all, and
    its final snapshot when the pipeline carries state across epochs, and the stage
    times since its last report (a loader recording statistics).

    >>> End(worker=1, produced=6)
    End(worker=1, produced=6, snapshot=None, report=None)
    """

    worker: int
    produced: int
    snapshot: Snapshot | None = None
    report: WorkerReport | None = None


class ItemError:
    """An exception a pipeline raised for one item, sent in the item's place by a runtime
    whose pipeline goes on after it (``errors_go_on``: a plain IterableDataset's path,
    see ``pipeline/iterable.py``). The main process books the item as consumed and raises
    the exception, as torch does: the original exception in the main process, torch's
    ``ExceptionWrapper`` ("Caught ... in DataLoader worker process N") from a worker,
    ``N`` the logical worker (what ``get_worker_info().id`` says on that path, so that a
    resumed run names the worker the uninterrupted one named).

    Example::

        try:
            sample = next(iterator)
        except Exception as e:
            sample = ItemError.capture(e, in_process=False, worker=3)   # picklable
        ...
        sample.reraise()                                       # in the main process
    """

    __slots__ = ("error", "wrapper")

    def __init__(self, error: BaseException | None, wrapper: ExceptionWrapper | None) -> None:
        self.error = error
        self.wrapper = wrapper

    @classmethod
    def capture(cls, error: BaseException, in_process: bool, worker: int) -> ItemError:
        """``error`` as an item: itself in the main process, torch's picklable wrapper
        naming logical ``worker`` in a worker process."""
        if in_process:
            return cls(error, None)
        where = f"in DataLoader worker process {worker}"
        return cls(None, ExceptionWrapper((type(error), error, error.__traceback__), where=where))

    def reraise(self) -> NoReturn:
        if self.wrapper is not None:
            self.wrapper.reraise()
        if self.error is None:  # pragma: no cover - capture() sets one of them
            raise RuntimeError("an ItemError without its exception")
        raise self.error


class SnapshotRing:
    """Snapshots ``(index, state)`` in increasing index order; thread-safe.

    ``prune(bound)`` drops snapshots no request can need any more: those older than the
    newest snapshot at or before ``bound`` (the lowest index the main process may still
    ask for).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[tuple[int, DatasetState | None]] = deque()

    def reset(self, index: int, state: DatasetState | None) -> None:
        with self._lock:
            self._items.clear()
            self._items.append((index, state))

    def add(self, index: int, state: DatasetState | None, bound: int) -> None:
        with self._lock:
            self._items.append((index, state))
            items = self._items
            while len(items) >= 2 and items[1][0] <= bound:
                items.popleft()

    def newest_index(self) -> int:
        with self._lock:
            return self._items[-1][0]

    def find(self, index: int) -> tuple[int, DatasetState | None] | None:
        """The newest snapshot taken at or before ``index``, or None."""
        with self._lock:
            for snap_index, state in reversed(self._items):
                if snap_index <= index:
                    return snap_index, state
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class WorkerRuntime:
    """Runs a pipeline in one loading context: snapshots, attached to items in a worker
    process, kept in a ring in the main process (:meth:`checkpoint`).

    ``max_in_flight`` bounds how many produced samples the main process may not have
    yielded yet (prefetching); snapshots older than that window are dropped.
    """

    def __init__(
        self,
        dataset: SavableDataset,
        worker_config: WorkerConfig,
        max_in_flight: int,
        *,
        in_process: bool,
        global_rngs: tuple[str, ...] = GLOBAL_RNG_NAMES,
    ) -> None:
        self.dataset = dataset
        #: The global RNGs re-seeded per sample and item (the loader's ``global_rngs=``).
        self.global_rngs = global_rngs
        #: The loader's per-item collate function (``Item`` to ``Item``), applied to each
        #: item where it is made (None: items leave as they are).
        self.collate: Callable[[Item | End], Item | End] | None = None
        self.worker_config = worker_config
        self.max_in_flight = max_in_flight
        self.in_process = in_process
        self.ring = SnapshotRing()
        self.epoch = -1
        self.worker_id = -1
        self.snapshots_taken = 0
        self.snapshot_seconds = 0.0
        #: Seconds from the plan of this context's first iteration (process start
        #: included) to its first sample: the cold start a restore compares with (0: not yet).
        self.cold_seconds = 0.0
        #: Encode each snapshot into ``outbox`` for the main process (worker processes).
        self.attach = not in_process
        #: An exception the pipeline raises for an item is sent as an :class:`ItemError`
        #: in the item's place and the iteration goes on (False: it ends the iteration).
        self.errors_go_on = False
        self.outbox: Snapshot | None = None
        #: The pipeline has a dataset whose position crosses epochs: snapshot each epoch's end.
        self.carries = any(type(ds).carries_across_epochs for ds in walk(dataset))
        #: The previous epoch's end state this epoch started from (``WorkerState.carried``).
        self.carried: DatasetState | None = None
        #: Time each stage and report it with each item (``stats/clock.py``).
        self.timing = False
        #: What the item being sent carries for the statistics (worker processes: put in
        #: it on its way out, with its snapshot; see :meth:`_with_report`).
        self.report: WorkerReport | float | None = None

    # -- iterating thread -------------------------------------------------------------

    def run(
        self, epoch: int, worker_id: int, start: WorkerState | None, started: float | None = None
    ) -> Iterator[Item | End]:
        """Yield an :class:`Item` per sample of the epoch, from ``start`` on, then the
        :class:`End` marker (snapshots not attached yet: see ``PipelineWorkerDataset``).

        ``started``: ``time.monotonic()`` when the main process planned the iteration, so
        that this worker's cold start counts its process start too (see ``snapshot_due``).
        """
        begun = time.monotonic() if started is None else started
        if start is not None and start.exhausted:
            return
        wc = self.worker_config
        base_seed = pipeline_base(wc.seed, wc.rank, worker_id, epoch)
        names = self.global_rngs
        collate = self.collate
        # global_rngs=: only those re-seeded (mark_sample too), the others checked per item
        guard = None if names == GLOBAL_RNG_NAMES else GlobalRngs(names)
        seed_all = global_seeder(names)
        self.carried = None if start is None or start.dataset is not None else start.carried
        # In the caller's process (num_workers=0) everything below, user code included
        # (reset_state_own, restore_state, items, collate), runs inside torch's next(), which
        # the loader runs with the caller's RNG streams set aside (PipelineIteration.caller_scope)
        if self.carried is not None:  # go on from the previous epoch's end (EpochizeDataset)
            with _ActiveWorker(worker_id, epoch - 1, names):
                self.dataset.restore_state(self.carried)
        with _ActiveWorker(worker_id, epoch, names):
            if start is None:
                self.dataset.reset_state_deep()
                index, skip, snapshot = 0, 0, None
            elif start.dataset is None:  # the epoch's start, then a replay of `skip` samples
                self.dataset.reset_state_deep()
                index, skip, snapshot = start.snapshot_index, start.skip, None
            else:
                self.dataset.restore_state(start.dataset)
                index, skip, snapshot = start.snapshot_index, start.skip, start.dataset
        self.ring.reset(index, snapshot)
        self.epoch, self.worker_id = epoch, worker_id
        self.outbox = self.report = None
        # A fresh run snapshots its first sample (which measures the cost); a restored run
        # holds the restored snapshot already, of unknown cost: no snapshot while it
        # replays (nothing is yielded, so nothing can be saved past it), and then one
        # when the replay bound says so (see ``snapshot_due``).
        snapshot_cost: float | None = 0.0 if snapshot is None else None
        work = 0.0
        taken = 0  # snapshots of this run
        costs: list[float] = []
        iterator: Iterator[Any] | None = None
        active = _ActiveWorker(worker_id, epoch, names)  # (entered once per item)
        clock = None
        if self.timing:  # (-1: the main process, whose items need no ready time)
            clock = StageClock(-1 if self.in_process else worker_id, stamp=not self.in_process)
            clock.name_stages(walk(self.dataset))
        # once the clock settles, its items, busy seconds and snapshots are summed here, in
        # locals (cheaper per item than the clock's attributes), and added to it with each
        # report: the items are those after `booked` (an index)
        settled: StageClock | None = None  # (the clock, once it has settled)
        stamp, due, booked, busy = clock is not None and clock.stamp, 0.0, 0, 0.0
        snapshot_sum, snapshots = 0.0, 0
        collate_timed = clock is not None  # (once settled, maybe at its measured share)
        timed = activate(clock)  # the stages' iterators made while it is active are timed
        while True:
            with active, timed:
                begun_item = time.perf_counter()
                if guard is not None:  # the generators left out in their fixed state
                    guard.begin(wc.seed, epoch)  # (before every item: the check after it draws)
                if names:  # (global_rngs=(): nothing to re-seed)
                    seed_all(pipeline_item(base_seed, index))
                t0 = time.perf_counter()
                if iterator is None:
                    iterator = iter(self.dataset)
                try:
                    sample = next(iterator)
                except StopIteration:
                    if guard is not None:  # the pipeline's end-of-epoch code is checked too
                        guard.check(f"the end of worker {worker_id}'s epoch {epoch}", "in the pipeline")
                    if skip:  # the restored worker had yielded more than this: not the same data
                        raise DataError(
                            f"worker {worker_id}'s pipeline ended after {index} samples while replaying to the "
                            f"saved position of {index + skip} samples: the data changed since the state was saved"
                        ) from None
                    break
                except Exception as e:  # the item's exception, raised in the main process
                    if guard is not None:  # np.random.seed() on the fixed state: say what to declare
                        guard.explain(e, f"item {index} of worker {worker_id} in epoch {epoch}")
                    if not self.errors_go_on:
                        raise
                    sample = ItemError.capture(e, self.in_process, worker_id)  # counts as an item
                item: Item | End = Item(worker_id, index, self.dataset.sample_key, sample)
                made = mark = time.perf_counter()
                work += made - t0
                index += 1
                if not self.cold_seconds:  # what a restore is measured against (first run)
                    cold = time.monotonic() - begun
                    self.cold_seconds = cold if 0 < cold < 3600 else work
                # The state after `index` samples, taken before the sample leaves: attached
                # to it, the main process holds the snapshot of the position it yields.
                request = take_snapshot_request()
                hinted = request == SNAPSHOT_FORCED or (
                    request == SNAPSHOT_HINT and (snapshot_cost or 0.0) <= HINTED_SNAPSHOT_SHARE * work
                )
                if not skip and (hinted or snapshot_due(work, snapshot_cost, self.cold_seconds, first=taken == 1)):
                    # the policy's cost: the cheapest of the last 3 snapshots, so that one
                    # slowed by a garbage collection or a page fault burst does not push
                    # the next snapshot (and the replay) far out
                    costs = [*costs[-2:], self._snapshot(index)]
                    if clock is not None:
                        snapped = time.perf_counter()
                        if settled is not None:
                            snapshot_sum, snapshots = snapshot_sum + snapped - mark, snapshots + 1
                        else:
                            clock.add("snapshot", snapped - mark)
                        mark = snapped
                    snapshot_cost = min(costs)
                    taken += 1
                    work = 0.0
                collated = None
                if collate is not None and not skip:
                    # the loader's collate_fn draws right after the item (and its snapshot,
                    # which refuses a state by name first), from the RNG state the item's
                    # seeding left: in the main process too, where the caller's own
                    # streams are put back after the batch
                    item = collate(item)
                    if collate_timed:
                        collating, mark = mark, time.perf_counter()
                        collated = mark - collating
                if guard is not None:  # a draw the loader did not seed: an error, never the item
                    guard.check(
                        partial("item {} of worker {} in epoch {}".format, index - 1, worker_id, epoch),
                        "in the pipeline",
                    )
                if settled is not None:  # (what clock.made() would do, without a call per item;
                    # never in a replay, which is first in a run: a clock settles on sent items)
                    busy += mark - begun_item
                    if mark >= due:
                        settled.sent += index - booked
                        settled.busy += busy
                        if snapshots:
                            settled.add("snapshot", snapshot_sum, snapshots)
                        booked, busy, snapshot_sum, snapshots = index, 0.0, 0.0, 0
                        item = self._with_report(item, settled.report(mark))
                        due = settled.due
                    elif stamp:
                        item = self._with_report(item, mark)
                elif clock is not None:
                    if skip:
                        clock.replayed(begun_item, t0, made)
                    else:
                        report = clock.made(begun_item, t0, made, mark, collated)
                        if report is not None:
                            item = self._with_report(item, report)
                    if clock.settled:
                        settled, due, booked = clock, clock.due, index
                        collate_timed = not clock.collate_estimated
            if skip:
                skip -= 1
                continue
            yield item
        if self.carries and self.ring.newest_index() != index:
            # the state at the epoch's end rides with the end marker: the next epoch's
            # (fresh) worker goes on from it (WorkerState.carried)
            with _ActiveWorker(worker_id, epoch, names):
                self._snapshot(index)
        # Tell the main process this worker is done (its final snapshot, if any, rides
        # with the marker): torch may retire the worker as soon as it has sent it, and
        # every item before it already carried what a save needs.
        if settled is not None:
            settled.sent += index - booked
            settled.busy += busy
            if snapshots:
                settled.add("snapshot", snapshot_sum, snapshots)
        yield End(
            worker_id,
            index,
            None,
            None if clock is None else clock.report(time.perf_counter(), final=True),
        )

    def _with_report(self, item: Item | End, report: WorkerReport | float) -> Item | End:
        """``item`` with ``report`` (a :class:`~savable_loader.stats.clock.StageClock`'s,
        or the time it was ready). A worker process's items are rebuilt on their way out
        anyway (``_with_snapshots``): the report goes in then, sparing a copy per item."""
        if self.attach:
            self.report = report
            return item
        return _reported(item, report)

    def _snapshot(self, index: int) -> float:
        """Snapshot the pipeline after ``index`` samples; returns the seconds it took.

        With ``attach`` the snapshot is also encoded into ``outbox`` (the next item sent
        carries it to the main process); encoding counts towards the snapshot budget.
        The cost returned is the thread's CPU time (the policy's measure: a snapshot
        preempted by other work on the machine did not cost more), ``snapshot_seconds``
        adds up wall time.
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        state = self.dataset.save_state()
        self.ring.add(index, state, index - self.max_in_flight)
        if self.attach:
            self.outbox = (index, encode_part(plain_dataset_state(state)))
        cost = time.thread_time() - c0
        self.snapshots_taken += 1
        self.snapshot_seconds += time.perf_counter() - t0
        return cost

    # -- saves in the main process ----------------------------------------------------

    def checkpoint(self, epoch: int, index: int) -> WorkerState:
        """The state after ``index`` samples of ``epoch``: a snapshot plus a skip offset
        (in the main process, ``num_workers=0``; worker processes attach theirs to items)."""
        if epoch != self.epoch:
            raise StateError(f"worker {self.worker_id} is in epoch {self.epoch}, asked for epoch {epoch}")
        found = self.ring.find(index)
        if found is None:
            raise StateError(
                f"worker {self.worker_id} has no snapshot at or before sample {index} "
                f"(the prefetch window was exceeded)"
            )
        snap_index, state = found
        return WorkerState(
            worker_id=self.worker_id,
            index=index,
            snapshot_index=snap_index,
            dataset=plain_dataset_state(state),
            carried=self.carried if state is None else None,
        )


def _reported(item: Item | End, report: WorkerReport | float) -> Item | End:
    """``item`` with its report (or the time it was ready)."""
    if type(item) is Item:
        return Item(item.worker, item.item_index, item.key, item.payload, item.snapshot, report)
    return item._replace(report=cast(WorkerReport, report))  # (an end marker's is a report)


def walk(dataset: SavableDataset) -> Iterator[SavableDataset]:
    """``dataset`` and every dataset it wraps, depth first."""
    yield dataset
    for child in dataset.children():
        yield from walk(child)


class PipelineWorkerDataset(IterableDataset):
    """The dataset torch's DataLoader sees on the pipeline path.

    It carries the user's pipeline (cloudpickled, so lambdas cross ``spawn``) and the plan
    of the first epoch it runs (epoch, rotation, per-logical-worker start states, whose
    number may differ from the loader's workers after a restore: ``pipeline/hosting.py``). Later
    epochs of persistent workers start fresh with one logical worker per context and no
    rotation, as the main process expects.
    """

    def __init__(self, dataset: SavableDataset, max_in_flight: int) -> None:
        self.dataset = dataset
        self.worker_config = dataset.worker_config
        self.max_in_flight = max_in_flight
        self.epoch = 0
        self.rotation = 0
        self.starts: list[WorkerState | None] = [None] * self.worker_config.workers_per_rank
        self.planned_at: float | None = None
        #: The global RNGs re-seeded per sample (the loader's ``global_rngs=``).
        self.global_rngs: tuple[str, ...] = GLOBAL_RNG_NAMES
        #: ``WorkerRuntime.collate`` (the loader's collate function, per item).
        self.collate: Callable[[Item | End], Item | End] | None = None
        #: ``WorkerRuntime.errors_go_on``.
        self.errors_go_on = False
        #: ``WorkerRuntime.timing`` (the loader's ``record_stats=``).
        self.timing = False
        self._iterations = 0
        #: This context's runtimes: the first over ``dataset``, the others (logical
        #: workers hosted beside it, ``pipeline/hosting.py``) over copies of it.
        self._runtimes: list[WorkerRuntime] = []
        #: The runtime of each logical worker this context ran last (main-process lookups).
        self._hosted: dict[int, WorkerRuntime] = {}

    def set_plan(self, epoch: int, rotation: int, starts: list[WorkerState | None]) -> None:
        self.epoch, self.rotation, self.starts = epoch, rotation, starts
        self.planned_at = time.monotonic()  # the workers' cold start counts from here
        self._iterations = 0

    @property
    def user_dataset(self) -> SavableDataset:
        """The user's pipeline (what ``get_worker_info().dataset`` shows in a worker)."""
        return self.dataset

    @property
    def runtime(self) -> WorkerRuntime | None:
        """The runtime of this loading context (None before the first iteration)."""
        return self._runtimes[0] if self._runtimes else None

    def runtime_of(self, logical: int) -> WorkerRuntime:
        """The runtime that ran logical worker ``logical`` last in this context."""
        found = self._hosted.get(logical)
        if found is None:
            raise StateError(f"the in-process pipeline has not started logical worker {logical}")
        return found

    def _runtime_at(self, j: int, in_process: bool, workers: int = 1) -> WorkerRuntime:
        """The runtime of this context's ``j``-th hosted logical worker (made on first use;
        ``workers``: the logical workers of this epoch, for the error message)."""
        while len(self._runtimes) <= j:
            dataset = self.dataset if not self._runtimes else _copy_pipeline(self.dataset, workers)
            self._runtimes.append(WorkerRuntime(dataset, self.worker_config, self.max_in_flight, in_process=in_process))
        runtime = self._runtimes[j]
        runtime.global_rngs = self.global_rngs
        runtime.collate = self.collate
        runtime.errors_go_on = self.errors_go_on
        runtime.timing = self.timing
        return runtime

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["dataset"] = cloudpickle.dumps(self.dataset)
        state["collate"] = cloudpickle.dumps(self.collate)  # a lambda crosses spawn too
        state["worker_config"] = None
        state["_runtimes"] = []
        state["_hosted"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.dataset = cloudpickle.loads(state["dataset"])
        self.collate = cloudpickle.loads(state["collate"])
        self.worker_config = self.dataset.worker_config

    def __iter__(self) -> Iterator[Item | End]:
        info = get_worker_info()
        contexts = self.worker_config.workers_per_rank
        physical = torch_worker_id() or 0  # info.id may be a logical id; 0 in the main process
        count = self._iterations
        self._iterations += 1
        if count == 0:
            epoch, rotation, starts = self.epoch, self.rotation, self.starts
        else:
            epoch, rotation, starts = self.epoch + count, 0, [None] * contexts
        workers = len(starts)  # logical workers: the saved num_workers of a resized restore
        runs: list[tuple[int, int, Iterator[Item | End]]] = []
        self._hosted = {}
        hosted_here = hosted_by(physical, rotation, workers, contexts)
        del self._runtimes[max(len(hosted_here), 1) :]  # copies of a past hosted epoch: freed
        for j, logical in enumerate(hosted_here):
            runtime = self._runtime_at(j, in_process=info is None, workers=workers)
            self._hosted[logical] = runtime
            start = starts[logical]
            items = runtime.run(epoch, logical, start, self.planned_at if count == 0 else None)
            if info is not None:
                items = _with_snapshots(runtime, items)
            runs.append((logical, 0 if start is None else start.index, items))
        hosted = interleave(runs) if len(runs) > 1 else runs[0][2] if runs else iter(())
        items = in_view(hosted, workers)
        if info is None:  # in the main process: one live iteration per pipeline object
            return exclusive(items, self.dataset, self._runtime_at(0, in_process=True))
        return items


def _copy_pipeline(dataset: SavableDataset, workers: int) -> SavableDataset:
    """A copy of ``dataset`` for another hosted logical worker; a pipeline that cannot be
    copied is a ``ConfigMismatchError`` naming ``num_workers`` (it only needs copying
    because the state was saved with ``workers`` workers)."""
    try:
        return cast(SavableDataset, cloudpickle.loads(cloudpickle.dumps(dataset)))
    except Exception as e:  # whatever the pipeline's objects raise on pickling
        info = get_worker_info()
        raise ConfigMismatchError(
            "num_workers",
            workers,
            0 if info is None else info.num_workers,
            f"resuming this state with fewer workers runs several of its {workers} logical workers in one process, "
            f"each in a copy of the pipeline, and the pipeline cannot be copied ({type(e).__name__}: {e}); restore "
            f"with num_workers={workers}, or make the pipeline picklable",
        ) from e


def _with_snapshots(runtime: WorkerRuntime, items: Iterator[Item | End]) -> Iterator[Item | End]:
    """Each item (and the end marker) with the snapshot taken since the previous one, if
    any (see ``WorkerRuntime._snapshot``), and each item with its report (see
    ``WorkerRuntime._with_report``), on its way out of a worker process."""
    for item in items:
        outbox, report = runtime.outbox, runtime.report
        runtime.outbox = runtime.report = None
        if isinstance(item, Item):  # its small tensors ride in the message (dataset/inline.py)
            payload = inline_small_tensors(item.payload)
            item = Item(item.worker, item.item_index, item.key, payload, outbox, report)
        elif outbox is not None:
            item = item._replace(snapshot=outbox)
        yield item
