"""Worker side of the savable-pipeline protocol: snapshot ring, skip replay, command thread.

Each loading context (a worker process, or the main process when ``num_workers=0``) runs
one :class:`WorkerRuntime`. Its iterating thread walks the pipeline and, between two
samples, may take a **snapshot** (the pipeline's ``save_state()``) into a small ring; the
policy keeps snapshot time below ``SNAPSHOT_BUDGET`` of sample time. Before producing
sample ``i`` it re-seeds the global RNGs from ``(seed, rank, worker, epoch, i)`` (a seed
below ``2**63``, see ``savable_loader.rng.item_seed``), so the RNG state at any sample
is implied by its index and never needs saving.

An exception the pipeline raises ends the iteration, except on a plain IterableDataset's
path (``errors_go_on``), where it is sent in the item's place (:class:`ItemError`) and
counts as that item, as torch's workers go on after a failed batch.

A daemon **command thread** answers ``checkpoint`` requests from the main process: given
the number of samples the main process has yielded from this worker, it returns the
newest snapshot at or before that point and the **skip offset** (samples to replay after
restoring it). It never waits for the iterating thread, so a save costs a queue round
trip even while a sample takes seconds to load.

After its end marker a worker process holds back the end of its iteration until the main
process has taken that marker (a ``release`` command): torch shuts a worker down as soon
as it *receives* the worker's end of iteration, possibly before the main process has
yielded the worker's last samples, and the snapshots needed to save at those samples
would die with the process.

Messages on the command and result pipes are MessagePack, never pickles.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from typing import Any, NoReturn

import cloudpickle
import msgspec
from torch._utils import ExceptionWrapper
from torch.utils.data import IterableDataset, get_worker_info

from savable_loader._torch_internals import torch_worker_id
from savable_loader._values import plain_dataset_state
from savable_loader.config import WorkerConfig, _ActiveWorker
from savable_loader.dataset import SavableDataset
from savable_loader.errors import DataError, StateError
from savable_loader.rng import (
    SEED_FORMULA,
    counter_seed,
    derive_seed,
    item_seed,
    preserve_global_rng,
    seed_global,
)
from savable_loader.state.codec import encode_part
from savable_loader.state.schema import DatasetState, WorkerState

__all__ = ["END", "SNAPSHOT_BUDGET", "ItemError", "PipelineWorkerDataset", "SnapshotRing", "WorkerRuntime"]

#: Fraction of sample-production time that snapshots may cost.
SNAPSHOT_BUDGET = 0.02

#: Index of the item a worker sends after its last sample (its payload: samples produced).
END = -1

#: Seconds between liveness checks while a worker waits for the release of its end.
RELEASE_POLL_SECONDS = 0.1


class ItemError:
    """An exception a pipeline raised for one item, sent in the item's place by a runtime
    whose pipeline goes on after it (``errors_go_on``: a plain IterableDataset's path,
    see ``_iterable_mode.py``). The main process books the item as consumed and raises
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
    """Runs a pipeline in one loading context and answers checkpoint requests.

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
        seed_formula: int = SEED_FORMULA,
    ) -> None:
        self.dataset = dataset
        self.seed_formula = seed_formula
        self.worker_config = worker_config
        self.max_in_flight = max_in_flight
        self.in_process = in_process
        self.ring = SnapshotRing()
        self.epoch = -1
        self.worker_id = -1
        self.snapshots_taken = 0
        self.snapshot_seconds = 0.0
        #: Encode each snapshot into ``outbox`` for the main process (worker processes).
        self.attach = False
        #: An exception the pipeline raises for an item is sent as an :class:`ItemError`
        #: in the item's place and the iteration goes on (False: it ends the iteration).
        self.errors_go_on = False
        self.outbox: tuple[int, bytes] | None = None
        self._thread: threading.Thread | None = None
        self._parent_pid = -1
        self._release = threading.Condition()
        self._released_epoch = -1

    # -- iterating thread -------------------------------------------------------------

    def run(self, epoch: int, worker_id: int, start: WorkerState | None) -> Iterator[tuple[int, int, Any, Any]]:
        """Yield ``(worker_id, index, restore key, sample)`` for the epoch, from ``start``
        on, then the end marker ``(worker_id, END, None, samples produced)``."""
        if start is not None and start.exhausted:
            return
        wc = self.worker_config
        base_seed = derive_seed(wc.seed, "pipeline", wc.rank, worker_id, epoch)
        # reset/restore run user code too (reset_state_own): keep the caller's RNG out of it
        with _ActiveWorker(worker_id, epoch), _rng_scope(self.in_process):
            if start is None:
                self.dataset.reset_state_deep()
                index, skip, snapshot = 0, 0, None
            else:
                self.dataset.restore_state(start.dataset)
                index, skip, snapshot = start.snapshot_index, start.skip, start.dataset
        self.ring.reset(index, snapshot)
        self.epoch, self.worker_id = epoch, worker_id
        self.outbox = None
        snapshot_cost = 0.0
        work = 0.0
        iterator: Iterator[Any] | None = None
        while True:
            with _ActiveWorker(worker_id, epoch), _rng_scope(self.in_process):
                seed_global(item_seed(counter_seed(base_seed, index), self.seed_formula))
                t0 = time.perf_counter()
                if iterator is None:
                    iterator = iter(self.dataset)
                try:
                    sample = next(iterator)
                except StopIteration:
                    if skip:  # the restored worker had yielded more than this: not the same data
                        raise DataError(
                            f"worker {worker_id}'s pipeline ended after {index} samples while replaying to the "
                            f"saved position of {index + skip} samples: the data changed since the state was saved"
                        ) from None
                    break
                except Exception as e:  # the item's exception, raised in the main process
                    if not self.errors_go_on:
                        raise
                    sample = ItemError.capture(e, self.in_process, worker_id)  # counts as an item
                work += time.perf_counter() - t0
                index += 1
                # The state after `index` samples, taken before the sample leaves: attached
                # to it, the main process holds the snapshot of the position it yields.
                if work * SNAPSHOT_BUDGET >= snapshot_cost:
                    snapshot_cost = self._snapshot(index)
                    work = 0.0
            if skip:
                skip -= 1
                continue
            yield worker_id, index - 1, self.dataset.sample_key, sample
        # Tell the main process this worker is done before torch retires it, so that a
        # later save knows its final state without asking a process that may be gone.
        yield worker_id, END, None, index
        # Torch retires a worker when it receives the worker's end of iteration, which may
        # overtake this worker's last samples (prefetch): keep serving checkpoints for
        # them until the main process has taken the end marker.
        self._wait_released(epoch)

    def _snapshot(self, index: int) -> float:
        """Snapshot the pipeline after ``index`` samples; returns the seconds it took.

        With ``attach`` the snapshot is also encoded into ``outbox`` (the next item sent
        carries it to the main process); encoding counts towards the snapshot budget.
        """
        t0 = time.perf_counter()
        state = self.dataset.save_state()
        self.ring.add(index, state, index - self.max_in_flight)
        if self.attach:
            self.outbox = (index, encode_part(plain_dataset_state(state)))
        cost = time.perf_counter() - t0
        self.snapshots_taken += 1
        self.snapshot_seconds += cost
        return cost

    def release(self, epoch: int) -> None:
        """Let the iteration of ``epoch`` (and earlier ones) end (command thread)."""
        with self._release:
            self._released_epoch = max(self._released_epoch, epoch)
            self._release.notify_all()

    def _wait_released(self, epoch: int) -> None:
        thread = self._thread
        if self.in_process or thread is None:
            return
        with self._release:
            while self._released_epoch < epoch:
                self._release.wait(RELEASE_POLL_SECONDS)
                if not thread.is_alive() or os.getppid() != self._parent_pid:
                    return  # the main process is gone or closed the pipes

    # -- command thread ---------------------------------------------------------------

    def checkpoint(self, epoch: int, index: int) -> WorkerState:
        """The state after ``index`` samples of ``epoch``: a snapshot plus a skip offset."""
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
        )

    def serve(self, cmd: Any, res: Any) -> None:
        """Start the daemon command thread on the two pipe ends (once per process)."""
        if self._thread is None:
            self._parent_pid = os.getppid()
            self._thread = threading.Thread(
                target=self._serve, args=(cmd, res), name="savable-loader-commands", daemon=True
            )
            self._thread.start()

    def _serve(self, cmd: Any, res: Any) -> None:
        while True:
            try:
                message = cmd.recv_bytes()
            except (EOFError, OSError):
                return
            request_id = -1
            try:
                kind, request_id, epoch, index = msgspec.msgpack.decode(message)
                if kind == "release":  # no answer
                    self.release(epoch)
                    continue
                if kind != "checkpoint":
                    raise StateError(f"unknown command {kind!r}")
                reply = ["ok", request_id, encode_part(self.checkpoint(epoch, index))]
            except Exception as e:  # answered to the main process, which raises it
                reply = ["error", request_id, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]
            try:
                res.send_bytes(msgspec.msgpack.encode(reply))
            except (OSError, ValueError):
                return


class _NoScope:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _rng_scope(in_process: bool) -> Any:
    # In the main process the loader must leave the caller's RNG streams untouched.
    return preserve_global_rng() if in_process else _NoScope()


class PipelineWorkerDataset(IterableDataset):
    """The dataset torch's DataLoader sees on the pipeline path.

    It carries the user's pipeline (cloudpickled, so lambdas cross ``spawn``), the plan
    of the first epoch it runs (epoch, worker rotation, per-worker start states) and the
    command/result pipe ends of every worker. Later epochs of persistent workers start
    fresh with no rotation, as the main process expects.
    """

    def __init__(self, dataset: SavableDataset, max_in_flight: int) -> None:
        self.dataset = dataset
        self.worker_config = dataset.worker_config
        self.max_in_flight = max_in_flight
        self.epoch = 0
        self.rotation = 0
        self.starts: list[WorkerState | None] = [None] * self.worker_config.workers_per_rank
        self.pipes: list[tuple[Any, Any]] | None = None
        #: Worker processes attach each new snapshot to the next item they send, so that
        #: the main process answers a save alone; False: saves ask the command threads.
        self.attach = True
        #: The per-item seed formula (``savable_loader.rng.item_seed``).
        self.seed_formula = SEED_FORMULA
        #: ``WorkerRuntime.errors_go_on``.
        self.errors_go_on = False
        self._iterations = 0
        self._runtime: WorkerRuntime | None = None

    def set_plan(self, epoch: int, rotation: int, starts: list[WorkerState | None], pipes: Any) -> None:
        self.epoch, self.rotation, self.starts, self.pipes = epoch, rotation, starts, pipes
        self._iterations = 0

    @property
    def user_dataset(self) -> SavableDataset:
        """The user's pipeline (what ``get_worker_info().dataset`` shows in a worker)."""
        return self.dataset

    @property
    def runtime(self) -> WorkerRuntime | None:
        """The runtime of this loading context (None before the first iteration)."""
        return self._runtime

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["dataset"] = cloudpickle.dumps(self.dataset)
        state["worker_config"] = None
        state["_runtime"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.dataset = cloudpickle.loads(state["dataset"])
        self.worker_config = self.dataset.worker_config

    def __iter__(self) -> Iterator[tuple[int, int, Any, Any]]:
        info = get_worker_info()
        workers = self.worker_config.workers_per_rank
        physical = torch_worker_id() or 0  # info.id may be a logical id; 0 in the main process
        count = self._iterations
        self._iterations += 1
        if count == 0:
            epoch, rotation, starts = self.epoch, self.rotation, self.starts
        else:
            epoch, rotation, starts = self.epoch + count, 0, [None] * workers
        logical = (physical + rotation) % workers
        if self._runtime is None:
            self._runtime = WorkerRuntime(
                self.dataset, self.worker_config, self.max_in_flight, in_process=info is None,
                seed_formula=self.seed_formula,
            )
            if info is not None and self.pipes is not None:
                cmd, res = self.pipes[physical]
                self._runtime.serve(cmd, res)
        runtime = self._runtime
        runtime.seed_formula = self.seed_formula
        runtime.errors_go_on = self.errors_go_on
        items = runtime.run(epoch, logical, starts[logical])
        if info is None:
            return items
        runtime.attach = self.attach
        return _with_snapshots(runtime, items)


def _with_snapshots(runtime: WorkerRuntime, items: Iterator[tuple[int, int, Any, Any]]) -> Iterator[tuple[Any, ...]]:
    """Items as ``(worker_id, index, key, sample, snapshot)``: ``snapshot`` is None or the
    ``(index, encoded DatasetState)`` taken since the previous item (see ``_snapshot``)."""
    for worker_id, index, key, sample in items:
        outbox = runtime.outbox
        runtime.outbox = None
        yield worker_id, index, key, sample, outbox
