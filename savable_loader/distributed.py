"""Gather and scatter loader states across data-parallel ranks with torch.distributed.

States cross process boundaries as MessagePack bytes (``state.encode``), never as pickled
objects: torch's ``*_object`` collectives pickle only the ``bytes``. Every check that can
fail is made on every rank with the same inputs, or its verdict is broadcast first, so a
bad argument raises on all ranks instead of leaving some of them waiting in a collective.

Without torch.distributed initialised, everything behaves as a world of one.

Example::

    states = loader.save_state_global(global_dst_rank=0)   # list on rank 0, None elsewhere
    if rank == 0:
        sl.state.save_file("loader.state", states)
    ...
    loader.restore_state_global(sl.state.load_file("loader.state") if rank == 0 else None, src_rank=0)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from savable_loader.config import WorkerConfig
from savable_loader.errors import ConfigMismatchError, LoaderUsageError, StateError
from savable_loader.state.codec import decode, encode
from savable_loader.state.schema import RankState

__all__ = [
    "DataParallelGroup",
    "check_gathered",
    "gather_states",
    "is_resize",
    "scatter_states",
    "select_rank_state",
]


class DataParallelGroup:
    """This process's place in the data-parallel group of a ``WorkerConfig``.

    Without torch.distributed the ``WorkerConfig``'s rank and world size are taken as
    given (a world of one by default); collectives then need a world of one.
    """

    def __init__(self, worker_config: WorkerConfig) -> None:
        self.initialized = dist.is_available() and dist.is_initialized()
        self.group = worker_config.data_parallel_group
        if self.initialized:
            self.rank = dist.get_rank(group=self.group)
            self.size = dist.get_world_size(group=self.group)
        else:
            self.rank, self.size = worker_config.rank, worker_config.world_size
        if (self.rank, self.size) != (worker_config.rank, worker_config.world_size):
            raise LoaderUsageError(
                f"the loader's WorkerConfig says rank {worker_config.rank} of {worker_config.world_size}, "
                f"but torch.distributed says rank {self.rank} of {self.size} in the data-parallel group"
            )

    def require_collectives(self, what: str) -> None:
        """LoaderUsageError if ``what`` would need torch.distributed and it is not there."""
        if not self.initialized and self.size > 1:
            raise LoaderUsageError(
                f"{what} is a collective over {self.size} ranks and needs torch.distributed initialised; "
                "without it, use save_state_rank() / restore_state_rank() per rank, or "
                "restore_state_global(states) with the whole list"
            )

    def global_ranks(self) -> list[int]:
        """Global ranks of the group's members, ordered by group rank."""
        if not self.initialized:
            return [self.rank]
        if self.group is None:
            return list(range(self.size))
        return list(dist.get_process_group_ranks(self.group))

    def check_member(self, global_rank: int, what: str) -> None:
        members = self.global_ranks()
        if global_rank not in members:
            raise LoaderUsageError(
                f"{what}={global_rank} is not in the data-parallel group (its global ranks are {members})"
            )


def gather_states(group: DataParallelGroup, state: RankState, dst: int) -> list[RankState] | None:
    """Gather every rank's state to global rank ``dst``: the list there, None elsewhere."""
    group.require_collectives("save_state_global")
    group.check_member(dst, "global_dst_rank")
    if not group.initialized:
        return [state]
    data = encode(state)
    is_dst = dist.get_rank() == dst
    gathered: list[Any] | None = [None] * group.size if is_dst else None
    dist.gather_object(data, gathered, dst=dst, group=group.group)
    if not is_dst:
        return None
    return [_decode_rank(item, i) for i, item in enumerate(gathered or [])]


def check_gathered(states: Any) -> list[RankState]:
    """A gathered list checked for itself: RankStates of ranks 0..W-1, all saved on W ranks."""
    if isinstance(states, RankState):
        states = [states]
    if not isinstance(states, (list, tuple)) or not states:
        raise StateError(f"restore_state_global needs a non-empty list of RankState, got {states!r:.80}")
    for i, s in enumerate(states):
        if not isinstance(s, RankState):
            raise StateError(f"entry {i} of the gathered state is a {type(s).__qualname__}, not a RankState")
        if s.config.rank != i:
            raise StateError(f"entry {i} of the gathered state was saved by rank {s.config.rank}")
        if s.config.world_size != len(states):
            raise StateError(
                f"entry {i} was saved on {s.config.world_size} ranks, but the gathered list holds {len(states)}"
            )
    return list(states)


def is_resize(states: Any, world_size: int) -> bool:
    """True if ``states`` is a consistent gathered list made on another world size."""
    try:
        return len(check_gathered(states)) != world_size
    except StateError:
        return False


def select_rank_state(states: Any, rank: int, world_size: int) -> RankState:
    """This rank's entry of a gathered list, after checking the list fits the world."""
    if isinstance(states, RankState):
        states = [states]
    if not isinstance(states, (list, tuple)):
        raise StateError(f"restore_state_global needs a list of RankState, got {type(states).__qualname__}")
    if len(states) != world_size:
        raise ConfigMismatchError(
            "world_size",
            len(states),
            world_size,
            f"the gathered state holds {len(states)} ranks, the data-parallel group has {world_size}",
        )
    for i, s in enumerate(states):
        if not isinstance(s, RankState):
            raise StateError(f"entry {i} of the gathered state is a {type(s).__qualname__}, not a RankState")
        if s.config.world_size != world_size:
            raise ConfigMismatchError(
                "world_size",
                s.config.world_size,
                world_size,
                f"entry {i} was saved on {s.config.world_size} ranks, restoring on {world_size}",
            )
        if s.config.rank != i:
            raise StateError(f"entry {i} of the gathered state was saved by rank {s.config.rank}")
    return states[rank]


def scatter_states(
    group: DataParallelGroup, states: Any, src: int, allow_resize: bool = False
) -> RankState | list[RankState]:
    """Give every rank its entry of the list ``states`` held by global rank ``src``.

    ``src`` checks the list and broadcasts its verdict first: a bad list raises on every
    rank, nobody is left waiting. With ``allow_resize``, a list saved on another world
    size is broadcast whole (every rank needs all old states to take its share).
    """
    group.require_collectives("restore_state_global(src_rank=...)")
    group.check_member(src, "src_rank")
    if not group.initialized:
        if allow_resize and is_resize(states, 1):
            return check_gathered(states)
        return select_rank_state(states, 0, 1)
    is_src = dist.get_rank() == src
    verdict: list[Any] = [None]
    payload: list[bytes] | None = None
    if is_src:
        try:
            if allow_resize and is_resize(states, group.size):
                verdict = [["resize"]]
            else:
                for i in range(group.size):
                    select_rank_state(states, i, group.size)
            payload = [encode(s) for s in states]
        except (StateError, ConfigMismatchError) as e:
            verdict = [
                [
                    type(e).__name__,
                    str(e),
                    getattr(e, "field", None),
                    getattr(e, "saved", None),
                    getattr(e, "current", None),
                    getattr(e, "hint", ""),
                ]
            ]
    dist.broadcast_object_list(verdict, src=src, group=group.group)
    if verdict[0] == ["resize"]:
        whole: list[Any] = [payload]
        dist.broadcast_object_list(whole, src=src, group=group.group)
        return [_decode_rank(item, i) for i, item in enumerate(whole[0])]
    if verdict[0] is not None:
        kind, message, field, saved, current, hint = verdict[0]
        if kind == "ConfigMismatchError":
            raise ConfigMismatchError(field, saved, current, f"{hint}; checked on rank {src}")
        raise StateError(f"rank {src} refused the gathered state: {message}")
    received: list[Any] = [None]
    dist.scatter_object_list(received, payload if is_src else None, src=src, group=group.group)
    return _decode_rank(received[0], group.rank)


def _decode_rank(data: Any, index: int) -> RankState:
    state = decode(data)
    if not isinstance(state, RankState):
        raise StateError(f"entry {index} of the gathered state is not a rank state")
    return state
