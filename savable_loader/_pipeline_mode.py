"""Bookkeeping of the savable-pipeline path in the main process.

Per iteration (:class:`PipelineIteration`) it records, for every logical worker, how
many samples were yielded from it, and which worker yields next. A save asks each worker that yielded something for
its checkpoint at that count (see ``_worker.py``); workers that yielded nothing are
still at their start state, which the main process already knows. On restore the
logical worker that yields next is played by physical worker 0 (torch always starts its
round robin there): physical ``p`` plays logical ``(p + rotation) % num_workers``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
from torch.utils.data import default_convert

from savable_loader._channels import WorkerChannels
from savable_loader._elastic import batch_rescale_factor
from savable_loader._index_mode import (
    check_dataset_config,
    check_key_int,
    check_key_setting,
)
from savable_loader._mode import SKIP, Iteration, Mode
from savable_loader._worker import END, PipelineWorkerDataset
from savable_loader.config import WorkerConfig, _ActiveWorker
from savable_loader.dataset import SavableDataset, config_fingerprint
from savable_loader.errors import ConfigMismatchError, RestoreKeyError, StateError
from savable_loader.rng import (
    SEED_FORMULA,
    counter_seed,
    derive_seed,
    item_seed,
    preserve_global_rng,
    seed_global,
)
from savable_loader.state.codec import decode_part
from savable_loader.state.schema import (
    DatasetState,
    LoaderConfig,
    PipelinePosition,
    RestoreKey,
    WorkerState,
)

__all__ = ["SKIP", "PipelineIteration", "PipelineMode"]


def _fresh(worker_id: int) -> WorkerState:
    return WorkerState(worker_id=worker_id, index=0, snapshot_index=0, dataset=None)


class _TaggedCollate:
    """Applies the per-item collate function to a pipeline item, keeping its tag."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, item: tuple[Any, ...]) -> tuple[Any, ...]:
        # (worker_id, index, key, payload) or, from worker processes, (..., snapshot)
        if item[1] == END:
            return item
        return (item[0], item[1], item[2], self.collate(item[3]), *item[4:])


class PipelineIteration(Iteration):
    """One iteration of a savable pipeline: per logical worker, the items yielded and
    the newest snapshot attached to them; which worker yields next."""

    def __init__(
        self, mode: PipelineMode, epoch: int, rotation: int, starts: list[WorkerState | None],
        channels: WorkerChannels | None, resumed: bool,
    ) -> None:
        self.mode = mode
        self.epoch = epoch
        self.resumed = resumed
        self.rotation = rotation
        self.starts = [s if s is not None else _fresh(i) for i, s in enumerate(starts)]
        self.consumed = [s.index for s in self.starts]
        self.exhausted = [s.exhausted for s in self.starts]
        self.next_worker = rotation
        self.workers = len(self.starts)
        # Per logical worker: the newest snapshot attached to an item yielded from it, as
        # [snapshot index, encoded DatasetState, decoded DatasetState or None].
        self.held: list[list[Any] | None] = [None] * self.workers
        self.attaching = [False] * self.workers  # its items carry a snapshot slot
        self.channels = channels
        self.processes: list[Any] | None = None
        # The last save and the position it was taken at: a save at the same position
        # returns it, so that saving twice without iterating gives equal states even when
        # a worker took a newer snapshot in between.
        self._last_save: tuple[Any, PipelinePosition] | None = None
        self._lock = threading.Lock()

    def workers_started(self, torch_iter: Any) -> None:
        self.processes = getattr(torch_iter, "_workers", None)
        if self.channels is not None:
            self.channels.close_worker_ends()

    def physical(self, logical: int) -> int:
        return (logical - self.rotation) % self.workers

    def logical(self, physical: int) -> int:
        return (physical + self.rotation) % self.workers

    def on_item(self, item: Any) -> Any:
        # (worker_id, index, key, payload) in process; worker processes add a snapshot
        worker_id, index, key, payload, *snapshot = item
        with self._lock:
            self.next_worker = (worker_id + 1) % self.workers
            if snapshot:
                self.attaching[worker_id] = True
                if snapshot[0] is not None:
                    self.held[worker_id] = [*snapshot[0], None]
            if index != END:
                self.consumed[worker_id] = index + 1
                self.mode.last_item = (self.epoch, worker_id, index, key)
                return payload
            self.exhausted[worker_id] = True
        # The worker holds its end of iteration back until this release (see _worker.py).
        if self.channels is not None:
            self.channels.release(self.physical(worker_id), self.epoch)
        return SKIP

    def on_error(self, error: BaseException) -> bool:
        """A pipeline's iterator cannot go on after it raised: the iteration fails."""
        return False

    def remaining(self) -> int | None:
        return None

    def end(self, finished: bool, keep_workers: bool) -> None:
        channels = self.channels
        if channels is not None and not finished:
            # An abandoned iteration: workers holding back their end (see _worker.py) must
            # end it, or persistent workers could not start the next iteration.
            for physical in range(self.mode.worker_config.num_workers):
                channels.release(physical, self.epoch)
        if channels is not None and not keep_workers:
            channels.close()
            if self.mode.channels is channels:
                self.mode.channels = None

    def position(self, timeout: float) -> PipelinePosition:
        with self._lock:
            consumed = list(self.consumed)
            exhausted = list(self.exhausted)
            next_worker = self.next_worker
            key = (tuple(consumed), tuple(exhausted), next_worker)
            if self._last_save is not None and self._last_save[0] == key:
                return self._last_save[1]
        mode = self.mode
        states = list(self.starts)
        for w in range(self.workers):
            if exhausted[w] and not states[w].exhausted:
                states[w] = WorkerState(
                    worker_id=w, index=consumed[w], snapshot_index=consumed[w], exhausted=True
                )
        asks = {
            w: consumed[w] for w in range(self.workers) if not exhausted[w] and consumed[w] != self.starts[w].index
        }
        if asks and mode.worker_config.num_workers > 0 and mode.torch_dataset.attach:
            for w, index in list(asks.items()):
                ws = self._held_state(w, index)
                if ws is not None:
                    states[w] = ws
                    del asks[w]
        if asks:  # the fallback: ask the workers' command threads
            runtime = mode.torch_dataset.runtime
            if mode.worker_config.num_workers == 0:
                if runtime is None:
                    raise StateError("the in-process pipeline has not started")
                states[0] = runtime.checkpoint(self.epoch, asks[0])
            else:
                if self.channels is None or self.channels.closed:
                    raise StateError("the worker channels are closed")
                requests = {self.physical(w): (w, self.epoch, index) for w, index in asks.items()}
                for physical, ws in self.channels.checkpoint(requests, self.processes, timeout).items():
                    states[self.logical(physical)] = ws
        position = PipelinePosition(epoch=self.epoch, next_worker=next_worker, workers=states)
        with self._lock:
            self._last_save = (key, position)
        return position

    def _held_state(self, w: int, index: int) -> WorkerState | None:
        """Worker ``w``'s state after ``index`` samples from the snapshot the main process
        holds (attached to the items it yielded), or None to ask the worker."""
        if not self.attaching[w]:
            return None
        held = self.held[w]
        start = self.starts[w]
        if held is None:
            return WorkerState(worker_id=w, index=index, snapshot_index=start.snapshot_index, dataset=start.dataset)
        snap_index, data, decoded = held
        if snap_index > index:
            return None
        if decoded is None:
            decoded = held[2] = decode_part(data, DatasetState)
        return WorkerState(worker_id=w, index=index, snapshot_index=snap_index, dataset=decoded)


class PipelineMode(Mode):
    """Epoch, per-worker positions and worker channels of a loader over a pipeline."""

    position_type = PipelinePosition
    path_name = "pipeline"
    fixed_world_size = "a savable pipeline's state is split per rank and worker: restore it on the same world size"
    #: The classes of the engine's dataset and collate function and of the iterations
    #: (a plain IterableDataset's path subclasses them: ``_iterable_mode.py``).
    worker_dataset_type: type[PipelineWorkerDataset] = PipelineWorkerDataset
    collate_type: type[_TaggedCollate] = _TaggedCollate
    iteration_type: type[PipelineIteration] = PipelineIteration

    def __init__(
        self, dataset: SavableDataset, worker_config: WorkerConfig, prefetch_factor: int,
        collate_fn: Callable[[Any], Any] = default_convert,
    ) -> None:
        self.worker_config = worker_config
        self.workers = worker_config.workers_per_rank
        self.seed_formula = SEED_FORMULA
        in_flight = prefetch_factor * worker_config.num_workers + 2 if worker_config.num_workers else 1
        self.torch_dataset = self.worker_dataset_type(dataset, in_flight)
        self.collate = self.collate_type(collate_fn)
        self.dataset_config = dataset.config_tree()
        self.fingerprint = config_fingerprint(self.dataset_config)
        #: the channels of the running worker pool (persistent workers keep theirs)
        self.channels: WorkerChannels | None = None
        # (epoch, logical worker, index, key) of the item yielded last
        self.last_item: tuple[int, int, int, Any] | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        return {"dataset": self.torch_dataset, "batch_size": None, "collate_fn": self.collate}

    def adopt(self, seed: int, seed_formula: int) -> None:
        super().adopt(seed, seed_formula)
        self.torch_dataset.seed_formula = seed_formula

    def concurrent(self, persistent: bool, num_workers: int) -> bool:
        """In-process iterations share the pipeline object and its runtime: one at a time."""
        return not persistent and num_workers > 0

    def reuses_epochs(self, persistent: bool) -> bool:
        """Persistent pipeline workers count their epochs themselves."""
        return not persistent

    def loader_config(self, num_workers: int) -> LoaderConfig:
        wc = self.worker_config
        return LoaderConfig(
            rank=wc.rank, world_size=wc.world_size, num_workers=num_workers, seed=wc.seed,
            batch_size=None, shuffle=False, drop_last=False,
            dataset_fingerprint=self.fingerprint, dataset_config=self.dataset_config,
            seed_formula=self.seed_formula,
        )

    def start_position(self, epoch: int) -> PipelinePosition:
        return PipelinePosition(epoch=epoch, next_worker=0, workers=[_fresh(w) for w in range(self.workers)])

    def remaining(self, position: Any) -> int | None:
        return None

    def restored(self) -> None:
        self.last_item = None

    # -- iteration --------------------------------------------------------------------

    def begin(self, epoch: int, resume: Any, context: Any, reuse_workers: bool) -> PipelineIteration:
        """Plan an iteration; ``reuse_workers``: persistent workers already run and keep
        their own plan (later epochs start fresh, with no rotation)."""
        if resume is not None:
            rotation = resume.next_worker
            starts: list[WorkerState | None] = [None] * self.workers
            for ws in resume.workers:
                starts[ws.worker_id] = ws
        else:
            rotation, starts = 0, [None] * self.workers
        if not reuse_workers:
            pipes = None
            if self.worker_config.num_workers > 0:
                self.channels = WorkerChannels(context, self.worker_config.num_workers)
                pipes = self.channels.worker_ends()
            self.torch_dataset.set_plan(epoch, rotation, starts, pipes)
        return self.iteration_type(self, epoch, rotation, starts, self.channels, resumed=resume is not None)

    def check(
        self, saved: LoaderConfig, position: PipelinePosition, num_workers: int, elastic: bool = False
    ) -> PipelinePosition:
        """Raise for a change the pipeline cannot honour; the position to restore.

        A ``BatchDataset`` batch size divided by ``k`` (nothing else changed) is honoured:
        worker positions and skip offsets are multiplied by ``k``.
        """
        current = self.loader_config(num_workers)
        if saved.num_workers != current.num_workers:
            raise ConfigMismatchError(
                "num_workers", saved.num_workers, current.num_workers,
                "a savable pipeline's state is split per worker; restore with the same num_workers",
            )
        for name in ("rank", "world_size", "seed"):
            if getattr(saved, name) != getattr(current, name):
                hint = (
                    "a savable pipeline's state is split per rank and worker: restore it on the same world size"
                    if name == "world_size" else ""
                )
                raise ConfigMismatchError(name, getattr(saved, name), getattr(current, name), hint)
        factor = None
        if saved.dataset_fingerprint != current.dataset_fingerprint:
            factor = batch_rescale_factor(saved.dataset_config, current.dataset_config)
        if factor is None:
            check_dataset_config(saved, current)
        ids = sorted(ws.worker_id for ws in position.workers)
        if ids != list(range(self.workers)) or position.next_worker >= self.workers:
            raise StateError(
                f"pipeline state has worker ids {ids} and next worker {position.next_worker}, "
                f"expected ids 0..{self.workers - 1}"
            )
        for ws in position.workers:
            if ws.snapshot_index > ws.index:
                raise StateError(
                    f"worker {ws.worker_id}: snapshot index {ws.snapshot_index} is after index {ws.index}"
                )
        if factor is None or factor == 1:
            return position
        workers = [
            msgspec.structs.replace(ws, index=ws.index * factor, snapshot_index=ws.snapshot_index * factor)
            for ws in position.workers
        ]
        return msgspec.structs.replace(position, workers=workers)

    # -- restore keys -----------------------------------------------------------------

    def restore_key(self, seed: int) -> RestoreKey | None:
        """The key of the item yielded last (None before the first)."""
        if self.last_item is None:
            return None
        epoch, worker, index, key = self.last_item
        try:
            sample = msgspec.to_builtins(key)
        except TypeError as e:
            raise RestoreKeyError(f"the pipeline's sample key {key!r} is not plain data: {e}") from None
        wc = self.worker_config
        return RestoreKey(
            kind="pipeline", seed=seed, fingerprint=self.fingerprint, epoch=epoch, rank=wc.rank, worker=worker,
            index=index, sample=sample, world_size=wc.world_size, num_workers=wc.num_workers,
        )

    def restore_sample(self, key: RestoreKey) -> Any:
        """The item ``key`` names, rebuilt in this process (the loader's collate applied)."""
        if key.kind != "pipeline":
            raise RestoreKeyError(f"key.kind is {key.kind!r}, this pipeline loader expects 'pipeline'")
        dataset = self.torch_dataset.dataset
        reason = dataset.restore_sample_blocker()
        if reason is not None:
            raise RestoreKeyError(f"this pipeline cannot rebuild samples: {reason}")
        if key.sample is None:
            raise RestoreKeyError("key.sample is None: the pipeline gave this item no key")
        check_key_setting("world_size", key.world_size, self.worker_config.world_size)
        check_key_setting("num_workers", key.num_workers, self.worker_config.num_workers)
        for name in ("epoch", "worker", "index"):
            check_key_int(name, getattr(key, name))
        if key.rank != self.worker_config.rank:
            raise RestoreKeyError(
                f"key.rank is {key.rank}, this loader is rank {self.worker_config.rank}: a pipeline's keys are "
                "rebuilt by a loader of the same rank, world size and num_workers (its sources split the data so)"
            )
        if key.worker >= self.workers:
            raise RestoreKeyError(
                f"key.worker is {key.worker}, expected a worker below {self.workers}: build the loader with "
                "the num_workers the key was made with"
            )
        wc = self.worker_config
        with preserve_global_rng(), _ActiveWorker(key.worker, key.epoch):
            base = derive_seed(wc.seed, "pipeline", key.rank, key.worker, key.epoch)
            seed_global(item_seed(counter_seed(base, key.index), self.seed_formula))
            return self.collate.collate(dataset.restore_sample(key.sample))


