"""Bookkeeping of the savable-pipeline path in the main process.

Per iteration (:class:`PipelineIteration`) it records, for every logical worker, how
many samples were yielded from it, the newest snapshots its items carried (see
``pipeline/worker.py``), and which worker yields next. A save is answered here, from those
snapshots (in-process: from the runtime's ring), without a message to any worker;
workers that yielded nothing are still at their start state, which the main process
already knows. On restore the
logical worker that yields next is played by physical worker 0 (torch always starts its
round robin there): physical ``p`` plays logical ``(p + rotation) % num_workers``.

A state saved with another ``num_workers`` keeps its logical workers for the rest of its
epoch, hosted by the loader's loading contexts (``pipeline/hosting.py``: ``hosts`` contexts,
slot ``s`` hosting logical workers ``s, s + hosts, ...``; physical ``p`` plays slot
``(p + rotation) % hosts``). The bookkeeping stays per logical worker; ``next_worker`` is
then the lowest logical worker of the slot that yields next. Later epochs use the
loader's own workers, except for pipelines that carry state across epochs, whose logical
workers go on hosted (each one's stream is that of the uninterrupted run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
from torch.utils.data import default_convert

from savable_loader.config import WorkerConfig, _ActiveWorker, _LogicalWorkers
from savable_loader.core.checks import (
    check_global_rngs,
    check_key_global_rngs,
    check_key_int,
    check_key_seed_formula,
    check_key_setting,
)
from savable_loader.core.elastic import batch_rescale_factor
from savable_loader.core.engine import NO_SCOPE, SKIP, Iteration, Mode, Policy
from savable_loader.core.tensordict import convert as tensordict_convert
from savable_loader.dataset.base import SavableDataset, config_fingerprint
from savable_loader.dataset.checks import check_dataset_config
from savable_loader.dataset.guards import release
from savable_loader.dataset.values import plain_dataset_state
from savable_loader.errors import ConfigMismatchError, InternalError, RestoreKeyError, StateError
from savable_loader.pipeline.hosting import MAX_LOGICAL_WORKERS, hosts, slot_of
from savable_loader.pipeline.resize import resize_blocker, resized_state
from savable_loader.pipeline.worker import End, Item, PipelineWorkerDataset, walk
from savable_loader.rng.formulas import pipeline_base, pipeline_item
from savable_loader.rng.global_rngs import GlobalRngs
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES, SEED_FORMULA, preserve_global_rng
from savable_loader.sources.torch_iterable import TorchIterableSource
from savable_loader.state.codec import decode_part
from savable_loader.state.schema import (
    ORDER_ALGORITHM,
    DatasetState,
    LoaderConfig,
    PipelinePosition,
    RankState,
    RestoreKey,
    WorkerState,
)

__all__ = ["SKIP", "PipelineIteration", "PipelineMode"]


def _fresh(worker_id: int, carried: DatasetState | None = None) -> WorkerState:
    return WorkerState(worker_id=worker_id, index=0, snapshot_index=0, dataset=None, carried=carried)


def _fixed_workers(dataset: SavableDataset) -> str | None:
    """Why ``dataset``'s logical workers cannot be hosted by other workers, if so: a torch
    IterableDataset splits itself by ``get_worker_info()`` and ``worker_init_fn``, which
    torch gives each worker process once, under one id (and never the main process)."""
    if not any(isinstance(ds, TorchIterableSource) for ds in walk(dataset)):
        return None
    return (
        "a torch IterableDataset splits itself by get_worker_info() and worker_init_fn, which torch gives each "
        "worker process once, under one id, so a worker cannot play several saved workers nor the main process "
        "one: restore mid-epoch with the saved num_workers (another num_workers is fine at an epoch's start), "
        "or make the data a savable pipeline (a SavableDataset source, e.g. savable_loader.sources.IterableSource), "
        "whose logical workers a loader with any num_workers can host"
    )


def _pristine(ws: WorkerState) -> bool:
    """``ws`` is a logical worker at its epoch's start, with nothing carried into it."""
    return ws.index == 0 and ws.dataset is None and ws.carried is None and not ws.exhausted


class _TaggedCollate:
    """Applies the per-item collate function to a pipeline item, keeping its tag."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        # torch's default_convert fails on batched TensorDicts: theirs pass as they are
        self.collate = tensordict_convert if collate is default_convert else collate

    def __call__(self, item: Item | End) -> Item | End:
        if isinstance(item, End):
            return item
        return item._replace(payload=self.collate(item.payload))


def _as_made(item: Item | End) -> Item | End:
    """The engine's collate function: items arrive collated (``WorkerRuntime.collate``)."""
    return item


class PipelineIteration(Iteration[PipelinePosition]):
    """One iteration of a savable pipeline: per logical worker, the items yielded and
    the newest snapshot attached to them; which worker yields next."""

    def __init__(
        self,
        mode: PipelineMode,
        epoch: int,
        rotation: int,
        starts: list[WorkerState | None],
        resumed: bool,
    ) -> None:
        self.mode = mode
        self.epoch = epoch
        self.resumed = resumed
        self.rotation = rotation
        self.starts = [s if s is not None else _fresh(i) for i, s in enumerate(starts)]
        self.consumed = [s.index for s in self.starts]
        self.exhausted = [s.exhausted for s in self.starts]
        self.next_worker = rotation
        self.last_worker: int | None = None  # the logical worker of the item yielded last
        self.workers = len(self.starts)
        # loading contexts that host the logical workers (``pipeline/hosting.py``): ``workers``
        # unless the state was saved with another num_workers
        self.hosts = hosts(self.workers, mode.worker_config.workers_per_rank)
        # Per logical worker: the newest snapshot attached to an item yielded from it, as
        # [snapshot index, encoded DatasetState, decoded DatasetState or None] (None: the
        # start state), and the one before it (a save that leaves out the item yielded
        # last needs it when that item carried the newest).
        self.held: list[list[Any] | None] = [None] * self.workers
        self.previous: list[list[Any] | None] = [None] * self.workers
        self.in_process = mode.worker_config.num_workers == 0
        # Per logical worker: its state at the end of this epoch (pipelines that carry
        # state across epochs): the start of the next epoch.
        self.ended: list[DatasetState | None] = [s.dataset if s.exhausted else None for s in self.starts]
        # The last save and the position it was taken at: a save at the same position
        # returns it, so that saving twice without iterating gives equal states even when
        # a worker took a newer snapshot in between.
        self._last_save: tuple[Any, PipelinePosition] | None = None
        self._lock = threading.Lock()

    def logical(self, physical: int) -> int:
        """The (lowest) logical worker physical worker ``physical`` hosts; a worker that
        hosts none (more workers than the state's logical workers) keeps its own id."""
        return (physical + self.rotation) % self.hosts if physical < self.hosts else physical

    def on_item(self, item: Item | End) -> Any:
        worker_id = item.worker
        if item.report is not None and self.recorder is not None:
            self.recorder.report(item.report)
        with self._lock:
            self.next_worker = (slot_of(worker_id, self.hosts) + 1) % self.hosts
            if item.snapshot is not None:  # (worker processes attach them)
                self.previous[worker_id] = self.held[worker_id]
                self.held[worker_id] = [*item.snapshot, None]
            if isinstance(item, Item):
                self.consumed[worker_id] = item.item_index + 1
                self.last_worker = worker_id
                self.mode.last_item = (self.epoch, worker_id, item.item_index, item.key, self.workers)
                return item.payload
            self.exhausted[worker_id] = True
            self.ended[worker_id] = self._end_state(worker_id, item.produced)
        return SKIP

    def _end_state(self, w: int, produced: int) -> DatasetState | None:
        """Worker ``w``'s state at its end marker (after ``produced`` samples), if a
        snapshot of exactly that point was taken (pipelines that carry state across epochs)."""
        start = self.starts[w]
        if not self.in_process:
            held = self.held[w]
            if held is None or held[0] != produced:
                # no snapshot since the start: the start itself may be the end (restored
                # right after the worker's last sample)
                same = start.dataset is not None and start.snapshot_index == produced
                return start.dataset if same else None
            if held[2] is None:
                held[2] = decode_part(held[1], DatasetState)
            return held[2]
        found = self.mode.torch_dataset.runtime_of(w).ring.find(produced)
        if found is not None and found[0] == produced:
            return plain_dataset_state(found[1])
        return None

    def caller_scope(self) -> Any:
        """In the caller's process the pipeline's items run inside torch's ``next()``: the
        caller's global RNG streams are set aside for the batch (the items in it re-seed
        or guard the generators each, as in a worker process)."""
        return preserve_global_rng() if self.in_process else NO_SCOPE

    def on_error(self, error: BaseException) -> bool:
        """A pipeline's iterator cannot go on after it raised: the iteration fails."""
        return False

    def remaining(self) -> int | None:
        return None

    def end(self, finished: bool, keep_workers: bool) -> None:
        runtime = self.mode.torch_dataset.runtime
        if runtime is not None and runtime.in_process:  # the pipeline object is free again
            release(self.mode.torch_dataset.dataset, runtime)
        # a finished epoch hands each worker's end state on to the next; an abandoned one nothing
        self.mode.carry_on(self.epoch + 1, list(self.ended) if finished and all(self.exhausted) else None)

    def position(self, held: int = 0) -> PipelinePosition:
        with self._lock:
            consumed = list(self.consumed)
            exhausted = list(self.exhausted)
            next_worker = self.next_worker
            if held:
                # the item yielded last is still the caller's: its worker yields it again,
                # next (the workers between, if any, had ended: their ends came before it)
                last = self.last_worker
                if held > 1 or last is None or consumed[last] <= self.starts[last].index:
                    raise StateError(
                        f"cannot leave the last {held} items out of a savable pipeline's state: it can leave out "
                        f"the last item of the iteration, {'and no item was yielded yet' if last is None else 'only'}"
                    )
                consumed[last] -= 1
                next_worker = slot_of(last, self.hosts)
            key = (tuple(consumed), tuple(exhausted), next_worker)
            if self._last_save is not None and self._last_save[0] == key:
                return self._last_save[1]
        states = list(self.starts)
        for w in range(self.workers):
            if exhausted[w] and not states[w].exhausted:
                states[w] = WorkerState(
                    worker_id=w,
                    index=consumed[w],
                    snapshot_index=consumed[w],
                    exhausted=True,
                    dataset=self.ended[w],
                )
        for w in range(self.workers):
            if not exhausted[w] and consumed[w] != self.starts[w].index:
                states[w] = self._state_at(w, consumed[w])
        position = PipelinePosition(epoch=self.epoch, next_worker=next_worker, workers=states)
        with self._lock:
            self._last_save = (key, position)
        return position

    def _state_at(self, w: int, index: int) -> WorkerState:
        """Worker ``w``'s state after ``index`` samples: from the snapshots attached to
        the items it yielded (worker processes) or the runtime's ring (in-process)."""
        if self.in_process:
            return self.mode.torch_dataset.runtime_of(w).checkpoint(self.epoch, index)
        for held in (self.held[w], self.previous[w]):
            if held is None:  # the start state (with what it carried from the previous epoch)
                return msgspec.structs.replace(self.starts[w], worker_id=w, index=index)
            snap_index, data, decoded = held
            if snap_index <= index:
                if decoded is None:
                    decoded = held[2] = decode_part(data, DatasetState)
                return WorkerState(worker_id=w, index=index, snapshot_index=snap_index, dataset=decoded)
        # a snapshot is attached at most once per item, after the sample it follows: the
        # one before the newest is at or before any index a save can ask (held <= 1)
        raise InternalError(f"worker {w} holds no snapshot at or before sample {index}")


class PipelineMode(Mode[PipelinePosition]):
    """Epoch and per-worker positions of a loader over a pipeline."""

    position_type = PipelinePosition
    indexed = False
    path_name = "pipeline"
    fixed_world_size = "a savable pipeline's state is split per rank and worker: restore it on the same world size"
    #: The classes of the engine's dataset and collate function and of the iterations
    #: (a plain IterableDataset's path subclasses them: ``pipeline/iterable.py``).
    worker_dataset_type: type[PipelineWorkerDataset] = PipelineWorkerDataset
    collate_type: type[_TaggedCollate] = _TaggedCollate
    iteration_type: type[PipelineIteration] = PipelineIteration

    def __init__(
        self,
        dataset: SavableDataset,
        worker_config: WorkerConfig,
        prefetch_factor: int,
        collate_fn: Callable[[Any], Any] = default_convert,
        global_rngs: tuple[str, ...] = GLOBAL_RNG_NAMES,
        timing: bool = False,
    ) -> None:
        self.worker_config = worker_config
        self.workers = worker_config.workers_per_rank
        #: The global RNGs re-seeded per sample and item (``SavableDataLoader(global_rngs=...)``).
        self.global_rngs = global_rngs
        in_flight = prefetch_factor * worker_config.num_workers + 2 if worker_config.num_workers else 1
        self.torch_dataset = self.worker_dataset_type(dataset, in_flight)
        self.torch_dataset.global_rngs = global_rngs
        self.torch_dataset.timing = timing  # each item's worker time reported (loader.stats())
        self.collate = self.collate_type(collate_fn)
        # applied where each item is made, under the item's RNG seeding (pipeline/worker.py)
        self.torch_dataset.collate = self.collate
        self.dataset_config = dataset.config_tree()
        self.fingerprint = config_fingerprint(self.dataset_config)
        # (epoch, logical worker, index, key, logical workers) of the item yielded last
        self.last_item: tuple[int, int, int, Any, int] | None = None
        # (epoch, each logical worker's state at the end of the epoch before it): what that
        # epoch goes on from (pipelines that carry state across epochs)
        self.carry: tuple[int, list[DatasetState | None]] | None = None
        self.carries = any(type(ds).carries_across_epochs for ds in walk(dataset))
        #: Why a position cannot go on under another num_workers (None: it can, hosted).
        self.fixed_workers = _fixed_workers(dataset)
        #: Why the ranks' states cannot move to another world size (None: the source
        #: re-splits, ``pipeline/resize.py``).
        resize_reason = resize_blocker(dataset)
        self.resizable = resize_reason is None
        if resize_reason is not None and type(self).fixed_world_size == PipelineMode.fixed_world_size:
            self.fixed_world_size = resize_reason
        # the rotation of the worker pool started last (persistent workers keep theirs),
        # and whether it hosted another number of logical workers than its own
        self.pool_rotation = 0
        self.pool_hosting = False

    def resized(self, states: list[RankState], world_size: int, num_workers: int) -> tuple[RankState, Any]:
        """This rank's share of the ranks' ``states`` on ``world_size`` ranks: a source
        that re-splits starts a new stage of the epoch (``pipeline/resize.py``)."""
        if states:  # the replays below re-seed as the states' run did: the loader's setting
            check_global_rngs(states[0].config, self.loader_config(num_workers))
        state = resized_state(self.torch_dataset.dataset, states, self.worker_config.rank, world_size, num_workers)
        return state, state.position

    def carry_on(self, epoch: int, ended: list[DatasetState | None] | None) -> None:
        """``epoch`` goes on from the workers' states ``ended`` (None: from scratch)."""
        carried = self.carries and ended is not None and any(e is not None for e in ended)
        self.carry = (epoch, ended) if carried and ended is not None else None

    def _carried(self, epoch: int) -> list[DatasetState | None]:
        carry = self.carry
        return carry[1] if carry is not None and carry[0] == epoch else [None] * self.workers

    def engine_kwargs(self) -> dict[str, Any]:
        return {"dataset": self.torch_dataset, "batch_size": None, "collate_fn": _as_made}

    def policy(self, persistent: bool, num_workers: int) -> Policy:
        """In-process iterations share the pipeline object and its runtime: one at a time.
        Persistent pipeline workers count their epochs themselves. Persistent workers
        started rotated or hosting another number of logical workers (by a restore) play
        other logical workers than the next epoch's: a pipeline that carries state across
        epochs then needs new workers, which restore each logical worker's end state
        (else they would replay)."""
        return Policy(
            concurrent=not persistent and num_workers > 0,
            reuses_epochs=not persistent,
            workers_reusable=not (self.carries and (self.pool_rotation or self.pool_hosting)),
        )

    def loader_config(self, num_workers: int) -> LoaderConfig:
        wc = self.worker_config
        return LoaderConfig(
            rank=wc.rank,
            world_size=wc.world_size,
            num_workers=num_workers,
            seed=wc.seed,
            batch_size=None,
            shuffle=False,
            drop_last=False,
            dataset_fingerprint=self.fingerprint,
            dataset_config=self.dataset_config,
            seed_formula=SEED_FORMULA,
            order_algorithm=ORDER_ALGORITHM,
            global_rngs=list(self.global_rngs),
        )

    def start_position(self, epoch: int) -> PipelinePosition:
        return PipelinePosition(
            epoch=epoch, next_worker=0, workers=[_fresh(w, c) for w, c in enumerate(self._carried(epoch))]
        )

    def remaining(self, position: Any) -> int | None:
        return None

    def restored(self) -> None:
        self.last_item = None
        self.carry = None  # the restored position carries its own

    # -- iteration --------------------------------------------------------------------

    def begin(self, epoch: int, resume: Any, reuse_workers: bool) -> PipelineIteration:
        """Plan an iteration; ``reuse_workers``: persistent workers already run and keep
        their own plan (later epochs start fresh, with no rotation)."""
        if resume is not None:
            starts: list[WorkerState | None] = [None] * len(resume.workers)
            for ws in resume.workers:
                starts[ws.worker_id] = ws
            # the slot that yields next (``pipeline/hosting.py``) is played by physical worker 0
            rotation = slot_of(resume.next_worker, hosts(len(starts), self.workers))
        else:
            rotation = 0
            starts = [None if c is None else _fresh(w, c) for w, c in enumerate(self._carried(epoch))]
        if not reuse_workers:
            self.torch_dataset.set_plan(epoch, rotation, starts)
            self.pool_rotation = rotation
            self.pool_hosting = len(starts) != self.workers
        return self.iteration_type(self, epoch, rotation, starts, resumed=resume is not None)

    def check(
        self, saved: LoaderConfig, position: PipelinePosition, num_workers: int, elastic: bool = False
    ) -> PipelinePosition:
        """Raise for a change the pipeline cannot honour; the position to restore.

        Another ``num_workers`` is honoured: the position's logical workers go on,
        hosted by this loader's workers (``pipeline/hosting.py``); a position at an epoch's
        start that nothing carries into starts that epoch with this loader's workers.
        A ``BatchDataset`` batch size divided by ``k`` (nothing else changed) is honoured:
        worker positions and skip offsets are multiplied by ``k``.
        """
        current = self.loader_config(num_workers)
        for name in ("rank", "world_size", "seed"):
            if getattr(saved, name) != getattr(current, name):
                hint = self.fixed_world_size if name == "world_size" else ""
                if name == "world_size" and self.resizable:
                    hint = (
                        "this pipeline's source re-splits: pass every rank's state to restore_state_global "
                        "(a list from save_state_global) to restore it on another world size"
                    )
                raise ConfigMismatchError(name, getattr(saved, name), getattr(current, name), hint)
        check_global_rngs(saved, current)
        factor = None
        if saved.dataset_fingerprint != current.dataset_fingerprint:
            factor = batch_rescale_factor(saved.dataset_config, current.dataset_config)
        if factor is None:
            check_dataset_config(saved, current)
        n = len(position.workers)
        if n > MAX_LOGICAL_WORKERS:
            raise StateError(
                f"pipeline state has {n} logical workers, expected at most {MAX_LOGICAL_WORKERS} (num_workers of the "
                "loader that saved it): each would be a copy of the pipeline in this loader's workers"
            )
        ids = sorted(ws.worker_id for ws in position.workers)
        if not n or ids != list(range(n)) or position.next_worker >= n:
            raise StateError(
                f"pipeline state has worker ids {ids} and next worker {position.next_worker}, "
                f"expected ids 0..{n - 1} (one per logical worker) and a next worker among them"
            )
        for ws in position.workers:
            if ws.snapshot_index > ws.index:
                raise StateError(f"worker {ws.worker_id}: snapshot index {ws.snapshot_index} is after index {ws.index}")
        if saved.num_workers != num_workers or n != self.workers:
            if all(_pristine(ws) for ws in position.workers):
                # an epoch's start: nothing to keep per logical worker, the loader's own split
                fresh = [_fresh(w) for w in range(self.workers)]
                position = PipelinePosition(epoch=position.epoch, next_worker=0, workers=fresh)
            elif self.fixed_workers is not None:
                raise ConfigMismatchError("num_workers", saved.num_workers, num_workers, self.fixed_workers)
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
        epoch, worker, index, key, logical = self.last_item
        try:
            sample = msgspec.to_builtins(key)
        except TypeError as e:
            raise RestoreKeyError(f"the pipeline's sample key {key!r} is not plain data: {e}") from None
        wc = self.worker_config
        made = RestoreKey(
            kind="pipeline",
            seed=seed,
            fingerprint=self.fingerprint,
            epoch=epoch,
            rank=wc.rank,
            worker=worker,
            index=index,
            sample=sample,
            world_size=wc.world_size,
            seed_formula=SEED_FORMULA,
            # the logical workers the item was made under (a resized restore's: hosted)
            num_workers=wc.num_workers if logical == self.workers else logical,
        )
        if self.global_rngs != GLOBAL_RNG_NAMES:  # the default is left out of str(key)
            made = msgspec.structs.replace(made, global_rngs=self.global_rngs)
        return made

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
        # a key made under another num_workers is rebuilt under its logical worker's view
        if key.num_workers is not None:
            check_key_int("num_workers", key.num_workers)
            if key.num_workers > MAX_LOGICAL_WORKERS:
                raise RestoreKeyError(
                    f"key.num_workers is {key.num_workers}, expected at most {MAX_LOGICAL_WORKERS} (the most logical "
                    "workers a pipeline state may have per rank)"
                )
        workers = self.workers if key.num_workers is None else max(key.num_workers, 1)
        for name in ("epoch", "worker", "index"):
            check_key_int(name, getattr(key, name))
        if key.rank != self.worker_config.rank:
            raise RestoreKeyError(
                f"key.rank is {key.rank}, this loader is rank {self.worker_config.rank}: a pipeline's keys are "
                "rebuilt by a loader of the same rank and world size (its sources split the data so)"
            )
        if key.worker >= workers:
            raise RestoreKeyError(
                f"key.worker is {key.worker}, expected a worker below {workers}: "
                + (
                    "the key has no num_workers (made by an older savable_loader): build the loader with the "
                    "num_workers the key was made with"
                    if key.num_workers is None
                    else f"key.num_workers is {key.num_workers}, the key is malformed"
                )
            )
        check_key_global_rngs(key, self.global_rngs)
        check_key_seed_formula(key)
        wc = self.worker_config
        names = self.global_rngs
        guard = GlobalRngs(names)  # as the item was made: only these re-seeded, the others fixed
        with preserve_global_rng(), _ActiveWorker(key.worker, key.epoch, names), _LogicalWorkers(workers):
            base = pipeline_base(wc.seed, key.rank, key.worker, key.epoch)
            guard.begin(wc.seed, key.epoch)
            guard.seed(pipeline_item(base, key.index))
            item = self.collate.collate(dataset.restore_sample(key.sample))
            guard.check(f"the item of restore key {key}", "in the pipeline's restore_sample or collate_fn")
            return item
