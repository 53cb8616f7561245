"""A savable pipeline's states carried to another world size: for sources that re-split.

Most pipelines cannot move to another world size: what a rank's workers hold (a shuffle
buffer, a position in shards the rank owns) belongs to that rank. A **stream source**
whose entries are dealt out by their ordinal (``RedisStreamSource``) can: it declares
``resplits = True`` and a ``resplit(fields, world_size, new_world_size)`` that turns the
source fields of every old (rank, logical worker), taken at what the training loop
consumed, into the one source state every new worker starts from (a new *stage*: the
entries no old worker consumed, in stream order, entry ``n`` of the stage to new rank
``n % W'``, each exactly once). This module makes that a loader restore:
``restore_state_global(states)`` on ``W'`` ranks.

Only wrappers that hold none of the source's samples between the pipeline's items can
sit above such a source (:data:`FOLLOWING`: ``MapDataset``, ``FilterDataset``,
``BatchDataset``): the new stage starts with every new worker at its pipeline's start.
A ``BatchDataset`` qualifies because a state is taken at an item boundary and the source
fields are read at what the loop consumed (below): samples a worker had read into an
unfinished batch were never consumed, so they go back to the pool with the rest of the
stage, and each is read once, in some new worker's batch (batches after the resize are
cut from the new stage, so their composition differs from an uninterrupted run's).
Anything else (a buffer, a limit, a packer) keeps the ``ConfigMismatchError``, which
says which dataset refuses.

**Exactly what the loop consumed.** A worker's saved state is a snapshot plus a skip
offset (items to replay after it, ``pipeline/worker.py``). To know which entries the worker had
consumed, the main process replays those items once, in a copy of the pipeline under the
old rank's view (the same per-item seeding as the worker), and reads the source's
fields there. The skip is short (snapshots are frequent), so this costs a few reads.

Another ``num_workers`` may change at the same time: the new position has one fresh
logical worker per new worker, each starting from the new stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import cloudpickle
import msgspec

from savable_loader.config import _ActiveWorker, _LogicalWorkers
from savable_loader.core.elastic import ALL_CONSUMED
from savable_loader.dataset.base import SavableDataset, type_name
from savable_loader.errors import DataError, StateError
from savable_loader.pipeline.hosting import MAX_LOGICAL_WORKERS
from savable_loader.pipeline.worker import walk
from savable_loader.rng.formulas import pipeline_base, pipeline_item
from savable_loader.rng.global_rngs import GlobalRngs
from savable_loader.rng.seeding import preserve_global_rng
from savable_loader.state.schema import PipelinePosition, RankState, WorkerState

__all__ = ["FOLLOWING", "resize_blocker", "resized_state"]

#: Wrappers that may sit above a re-splitting source on another world size: they hold
#: nothing between items, so a new worker can start them anywhere in the stream.
FOLLOWING = frozenset(
    {
        "savable_loader.wrappers.map.MapDataset",
        "savable_loader.wrappers.filter.FilterDataset",
        "savable_loader.wrappers.batch.BatchDataset",
    }
)


def _chain(dataset: SavableDataset) -> tuple[list[SavableDataset], SavableDataset]:
    nodes = list(walk(dataset))
    return nodes[:-1], nodes[-1]


def resize_blocker(dataset: SavableDataset) -> str | None:
    """Why a state of this pipeline cannot move to another world size (None: it can)."""
    wrappers, source = _chain(dataset)
    for node in wrappers:
        if len(node.children()) != 1 or type_name(node) not in FOLLOWING:
            return (
                f"a savable pipeline's state is split per rank and worker: restore it on the same world size "
                f"({type(node).__name__} holds what it has read per rank; only a stream source that re-splits, "
                f"under {', '.join(sorted(n.rsplit('.', 1)[-1] for n in FOLLOWING))} alone, can move to another "
                "world size)"
            )
    if not getattr(type(source), "resplits", False):
        return (
            f"a savable pipeline's state is split per rank and worker: restore it on the same world size "
            f"({type(source).__name__} cannot re-split its data over other ranks; a stream source such as "
            "RedisStreamSource can)"
        )
    return None


def _source_fields(dataset: SavableDataset) -> dict[str, Any]:
    source = _chain(dataset)[1]
    state = source.save_state()
    return {k: msgspec.to_builtins(v) for k, v in state.fields.items()}


def _consumed_fields(
    pipeline: SavableDataset, states: Sequence[RankState], epoch: int, rank: int, ws: WorkerState, workers: int
) -> dict[str, Any] | None:
    """The source fields of old rank ``rank``'s logical worker ``ws`` at what the loop
    consumed (a replay of its skip offset in a copy of the pipeline); None if it consumed
    nothing this epoch."""
    if ws.index == 0 and ws.dataset is None:
        return None
    skip = ws.index - ws.snapshot_index
    if skip == 0 and ws.dataset is not None:
        source_node = ws.dataset
        while source_node.children:
            source_node = source_node.children[0]
        return {k: msgspec.to_builtins(v) for k, v in source_node.fields.items()}
    config = states[rank].config
    copy = _copy(pipeline)
    wc = copy.worker_config
    wc.rank, wc.world_size, wc.num_workers, wc.seed = rank, len(states), config.num_workers, config.seed
    base = pipeline_base(config.seed, rank, ws.worker_id, epoch)
    names = tuple(config.global_rngs)  # as the run re-seeded (checked against the loader's)
    guard = GlobalRngs(names)  # the generators left out in the run's fixed state
    with preserve_global_rng(), _ActiveWorker(ws.worker_id, epoch, names), _LogicalWorkers(workers):
        copy.restore_state(ws.dataset)
        it = iter(copy)
        for index in range(ws.snapshot_index, ws.index):
            guard.begin(config.seed, epoch)
            guard.seed(pipeline_item(base, index))
            try:
                next(it)
            except StopIteration:
                raise DataError(
                    f"rank {rank} worker {ws.worker_id}'s pipeline ended after {index} items while replaying to its "
                    f"saved position of {ws.index} items: the data changed since the state was saved"
                ) from None
        return _source_fields(copy)


def resized_state(
    pipeline: SavableDataset, states: Sequence[RankState], rank: int, world_size: int, num_workers: int
) -> RankState:
    """The state (its position included) of new rank ``rank`` of ``world_size`` (with
    ``num_workers`` workers) from all old ranks' ``states``."""
    positions = []
    for i, s in enumerate(states):
        if not isinstance(s.position, PipelinePosition):
            raise StateError(f"entry {i} of the states is a drop-in state, this loader is a pipeline loader")
        positions.append(s.position)
    first = states[0].config
    for i, s in enumerate(states):
        for name in ("seed", "dataset_fingerprint", "num_workers", "world_size", "global_rngs"):
            if getattr(s.config, name) != getattr(first, name):
                raise StateError(
                    f"entry {i} was saved with {name}={getattr(s.config, name)!r}, entry 0 with {getattr(first, name)!r}"
                )
        if s.config.rank != i:
            raise StateError(f"entry {i} of the states was saved by rank {s.config.rank}: pass them in rank order")
    logical = {len(p.workers) for p in positions}
    if len(logical) != 1:
        raise StateError(f"the ranks' states have different numbers of logical workers: {sorted(logical)}")
    workers = logical.pop()
    if workers > MAX_LOGICAL_WORKERS:
        raise StateError(
            f"the ranks' states have {workers} logical workers each, expected at most {MAX_LOGICAL_WORKERS}"
        )
    epoch = min(p.epoch for p in positions)
    if max(p.epoch for p in positions) > epoch + 1:
        raise StateError(f"the ranks' states are in epochs {sorted({p.epoch for p in positions})}, more than one apart")
    for r, p in enumerate(positions):
        ahead = [ws.worker_id for ws in p.workers if ws.index > 0 or ws.dataset is not None or ws.carried is not None]
        if p.epoch > epoch and ahead:
            # what it consumed of the next epoch would be dealt out again in that epoch
            raise StateError(
                f"rank {r}'s state is in epoch {p.epoch} and its logical workers {ahead} had consumed items of it, "
                f"while another rank was still in epoch {epoch}: a state on another world size can carry one epoch "
                "only; restore on the same world size, or save when the ranks are in the same epoch"
            )
    fields: list[list[dict[str, Any] | None]] = []
    ended = []
    for r, p in enumerate(positions):
        per_rank: list[dict[str, Any] | None] = []
        for ws in sorted(p.workers, key=lambda w: w.worker_id):
            done = p.epoch > epoch or ws.exhausted
            ended.append(done)
            if done:  # it consumed every entry of its share this epoch
                per_rank.append({ALL_CONSUMED: True})
            else:
                per_rank.append(_consumed_fields(pipeline, states, epoch, r, ws, workers))
        fields.append(per_rank)
    source = _chain(pipeline)[1]
    new_workers = max(num_workers, 1)
    config = msgspec.structs.replace(first, rank=rank, world_size=world_size, num_workers=num_workers)
    if all(ended):  # the epoch is over everywhere: the next one, from its start
        fresh = [WorkerState(worker_id=w, index=0, snapshot_index=0) for w in range(new_workers)]
        return RankState(config=config, position=PipelinePosition(epoch=epoch + 1, next_worker=0, workers=fresh))
    plain = type(source).resplit(fields, len(states), world_size)  # type: ignore[attr-defined]
    copy = _copy(pipeline)
    copy.reset_state_deep()
    target = _chain(copy)[1]
    for name, value in plain.items():
        setattr(target, name, value)
    tree = copy.save_state()
    news = [WorkerState(worker_id=w, index=0, snapshot_index=0, dataset=tree) for w in range(new_workers)]
    return RankState(config=config, position=PipelinePosition(epoch=epoch, next_worker=0, workers=news))


def _copy(pipeline: SavableDataset) -> SavableDataset:
    return cast(SavableDataset, cloudpickle.loads(cloudpickle.dumps(pipeline)))
