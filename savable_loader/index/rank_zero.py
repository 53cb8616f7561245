"""A rank's position derived from another rank's state: checkpoints that keep rank 0's.

Lightning's Trainer and Fabric write a checkpoint from global rank 0 only, and
Accelerate's ``save_state`` writes the objects given to ``register_for_checkpointing``
from the main process only; on load, every rank gets rank 0's ``state_dict()``. The
loader's :meth:`~savable_loader.SavableDataLoader.load_state_dict` then finds
``dp_rank_0`` where it looks for its own ``dp_rank_<r>`` and asks :func:`derive_state`
for its own position.

**What makes the derivation sound.** Data-parallel training steps the ranks in lockstep:
each step takes one batch on every rank (DDP's gradient all-reduce enforces it). So when
rank 0 had consumed ``b`` batches of an epoch, every rank had consumed ``b`` batches of
its own share — provided every rank's share of that epoch has as many batches as rank
0's. The loader's own order gives every rank an equal share (padded as
``DistributedSampler`` pads), so rank ``r``'s position is rank 0's with ``r`` in place of
0. After a world-size change (``stages``) the shares of the interrupted epoch may differ
by one sample: the position is derived when it is unambiguous (every rank has that
many batches, or rank 0 is mid-epoch) and refused otherwise. With a sampler of the
user's, torch's ``DistributedSampler`` (alone or in torch's ``BatchSampler``) gives equal
shares and an order decided by its seed and epoch: rank ``r`` replays its own share up
to the same count, and the digest a restore checks is recomputed for it.

Everything else is refused with :class:`~savable_loader.StateError` naming the way out:
a savable pipeline's per-worker states, and samplers whose order on another rank the
state cannot tell, need every rank's state in the checkpoint. The integrations' hooks
put it there (:func:`entries_of_every_rank`, a collective they run where the framework
asks every rank: ``SavableLoaderCallback``, ``FabricLoaderState``, ``EveryRankState``);
``torch.distributed.checkpoint`` keeps each rank's entry anyway; in a loop of one's own,
``save_state_global``.

Example::

    state = derive_state(loader, rank0_state)     # rank 1's position, for restore_state_rank
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler

from savable_loader.core.checks import check_state_formulas
from savable_loader.core.elastic import epoch_length
from savable_loader.distributed import DataParallelGroup, gather_states
from savable_loader.errors import ConfigMismatchError, StateError
from savable_loader.index.engine import OrderMode
from savable_loader.index.sampler_engine import SamplerMode
from savable_loader.index.samplers import PrivateRng, apply, index_digest, new_digest
from savable_loader.rng.formulas import sampler_seed
from savable_loader.state.codec import encode
from savable_loader.state.schema import IndexPosition, RankState

__all__ = ["RECIPE", "derivable", "derive_state", "entries_of_every_rank"]

#: Where the docs show how to keep every rank's state in a checkpoint.
RECIPE = (
    "keep every rank's state in the checkpoint: with Lightning's Trainer, "
    "Trainer(callbacks=[savable_loader.integrations.lightning.SavableLoaderCallback()]); with Fabric, "
    'state["loader"] = savable_loader.integrations.fabric.FabricLoaderState(loader); with Accelerate, '
    "accelerator.register_for_checkpointing(savable_loader.integrations.EveryRankState(loader)); in a loop of "
    "your own, states = loader.save_state_global(0) on every rank, stored from rank 0, and "
    'loader.restore_state_global(states) on every rank (docs/recipes.md, "Checkpoints written by rank 0"), or '
    "torch.distributed.checkpoint, which stores each rank's entry"
)


def derivable(loader: Any) -> bool:
    """Whether another rank's state tells this loader's position (see the module doc)."""
    mode = loader._mode
    if isinstance(mode, OrderMode):
        return True
    wc = loader.worker_config
    return isinstance(mode, SamplerMode) and _split_by_ranks(mode.index_sampler, wc.world_size, wc.rank)


def entries_of_every_rank(loader: Any, state: RankState) -> dict[str, bytes]:
    """``state_dict()`` entries for a framework that asks every rank and writes rank 0's
    answer (called by the integrations' hooks, on every rank): on global rank 0, every
    rank's entry (gathered; a collective), if this loader's position cannot be derived
    from rank 0's; else this rank's entry."""
    own = {loader._state_key(): encode(state)}
    wc = loader.worker_config
    if (
        wc.world_size < 2
        or derivable(loader)
        or wc.data_parallel_group is not None
        or not (dist.is_available() and dist.is_initialized())
        or dist.get_world_size() != wc.world_size
    ):
        return own
    states = gather_states(DataParallelGroup(wc), state, 0)
    if states is None:
        return own
    for i, s in enumerate(states):
        if s.config.rank != i:
            raise StateError(f"rank {i} of the data-parallel group saved a state of rank {s.config.rank}")
    return {f"dp_rank_{i}": encode(s) for i, s in enumerate(states)}


def derive_state(loader: Any, state: RankState) -> RankState:
    """``loader``'s own state derived from ``state``, saved by another rank of the same
    world (see the module docstring); raises :class:`StateError` or
    :class:`ConfigMismatchError` where that cannot be exact."""
    check_state_formulas(state.config)  # (before a sampler's draws are replayed under this version's)
    wc = loader.worker_config
    rank, world = wc.rank, wc.world_size
    src = state.config.rank
    if state.config.world_size != world:
        raise ConfigMismatchError(
            "world_size",
            state.config.world_size,
            world,
            f"the checkpoint holds the loader state of rank {src} only, saved on {state.config.world_size} ranks: "
            f"another world size needs every rank's state; {RECIPE}",
        )
    mode = loader._mode
    position = state.position
    if isinstance(mode, OrderMode) and isinstance(position, IndexPosition) and position.sampler is None:
        position = _order_position(state, position, rank)
    elif isinstance(mode, SamplerMode) and isinstance(position, IndexPosition) and position.sampler is not None:
        position = _sampler_position(
            mode, loader.seed if mode.seed_explicit else state.config.seed, state, position, rank
        )
    elif isinstance(position, IndexPosition) and isinstance(mode, (OrderMode, SamplerMode)):
        return state  # another order than the loader's: the restore names the difference
    else:
        raise StateError(
            f"the checkpoint holds the loader state of rank {src} only (frameworks such as Lightning, Fabric and "
            f"Accelerate write rank 0's), and this rank ({rank}) cannot derive its own from it: a {mode.path_name} "
            f"loader's position is per rank and worker. To resume every rank exactly, {RECIPE}"
        )
    config = msgspec.structs.replace(state.config, rank=rank)
    return msgspec.structs.replace(state, config=config, position=position)


def _order_position(state: RankState, position: IndexPosition, rank: int) -> IndexPosition:
    """The loader's own order: the same number of batches as rank ``src`` (lockstep)."""
    stages = tuple(position.stages)
    if not position.consumed or not stages:
        return position  # equal shares: the same count
    config = state.config
    step = config.batch_size or 1
    lengths = [
        epoch_length(position.dataset_len, config.world_size, r, stages, config.batch_size, config.drop_last)
        for r in (config.rank, rank)
    ]
    batches = [math.ceil(n / step) for n in lengths]
    done = math.ceil(position.consumed / step)
    if done >= batches[0] and batches[1] > batches[0]:
        raise StateError(
            f"the checkpoint holds the loader state of rank {config.rank} only, which had finished its "
            f"{batches[0]} batches of epoch {position.epoch} (resumed on another world size, so that shares "
            f"differ); rank {rank} has {batches[1]} batches in that epoch and whether it took its last one cannot "
            f"be told. To resume every rank exactly, {RECIPE}"
        )
    return msgspec.structs.replace(position, consumed=min(done * step, lengths[1]))


def _split_by_ranks(index_sampler: Any, world: int, rank: int) -> bool:
    """Whether the sampler is torch's DistributedSampler (alone or in torch's BatchSampler)
    split over this world, the one sampler whose order on another rank is known."""
    sampler = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return type(sampler) is DistributedSampler and sampler.num_replicas == world and sampler.rank == rank


def _sampler_position(
    mode: SamplerMode, seed: int, state: RankState, position: IndexPosition, rank: int
) -> IndexPosition:
    """A DistributedSampler's: the same count of items, this rank's digest."""
    record = position.sampler
    sampler = mode.index_sampler
    world = state.config.world_size
    if not _split_by_ranks(sampler, world, rank):
        raise StateError(
            f"the checkpoint holds the loader state of rank {state.config.rank} only (frameworks such as Lightning, "
            f"Fabric and Accelerate write rank 0's), and the order of {type(sampler).__qualname__} on rank {rank} "
            "cannot be derived from it (torch's DistributedSampler can: equal shares, an order decided by its seed "
            f"and epoch). Give the loader no sampler (its own order is split over the ranks), or, to resume every "
            f"rank exactly, {RECIPE}"
        )
    if record is None or record.at_start or not position.consumed:
        return position
    apply(sampler, record)
    rng = PrivateRng(record.private_rng, sampler_seed(seed, rank, position.epoch))
    items = rng.call(iter, sampler)
    digest = new_digest()
    batched = mode.auto_collation
    for _ in range(position.consumed):
        item = rng.call(next, items, None)
        if item is None:
            raise ConfigMismatchError(
                "position.consumed",
                position.consumed,
                f"at most the {len(sampler)} items of rank {rank}'s share",
            )
        index_digest(digest, tuple(item) if batched else (item,))
    return msgspec.structs.replace(position, sampler=msgspec.structs.replace(record, digest=digest.hexdigest()))
