"""Bookkeeping of the drop-in path: which epoch, how many of this rank's samples yielded.

The state is two numbers (plus the stages of an epoch resumed on another world size).
Saving reads them (microseconds, no worker involved); restoring sets them, and the next
iteration's sampler starts at that sample.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import msgspec

from savable_loader._permutation import ORDER_ALGORITHMS, ORDER_LEGACY
from savable_loader.dataset import config_fingerprint, plain_config, type_name
from savable_loader.errors import ConfigMismatchError, RestoreKeyError
from savable_loader.sources.index import IndexedDataset, IndexPlan, IndexSampler
from savable_loader.state.schema import IndexPosition, IndexStage, LoaderConfig, RestoreKey

__all__ = ["IndexMode", "check_key_int", "check_key_setting", "map_dataset_config"]


def map_dataset_config(dataset: Any) -> dict[str, Any]:
    """What identifies a map-style dataset: type, length and its ``config()`` if any."""
    config: dict[str, Any] = {"type": type_name(dataset), "len": len(dataset)}
    own = getattr(dataset, "config", None)
    if callable(own):
        config["config"] = plain_config(own())
    return config


class IndexMode:
    """Epoch and position of a loader over a map-style dataset."""

    kind = "index"

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        batch_size: int | None,
        drop_last: bool,
        collate_fn: Any,
    ) -> None:
        self.plan = IndexPlan(
            len(dataset), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
            batch_size=batch_size, drop_last=drop_last,
        )
        self.sampler = IndexSampler(self.plan)
        self.torch_dataset = IndexedDataset(dataset, seed, collate_fn, batched=batch_size is not None)
        self.dataset_config = map_dataset_config(dataset)
        self.fingerprint = config_fingerprint(self.dataset_config)
        self._lock = threading.Lock()
        self.epoch = 0  # the next epoch to start
        self.pending: IndexPosition | None = None
        # (epoch, consumed, stages) while iterating
        self.current: tuple[int, int, tuple[IndexStage, ...]] | None = None
        # (epoch, stages, first, last): the rank-share slice of the batch yielded last
        self.last_item: tuple[int, tuple[IndexStage, ...], int, int] | None = None
        self._epoch_len = self.plan.epoch_len()

    def loader_config(self, num_workers: int) -> LoaderConfig:
        p = self.plan
        return LoaderConfig(
            rank=p.rank, world_size=p.world_size, num_workers=num_workers, seed=p.seed,
            batch_size=p.batch_size, shuffle=p.shuffle, drop_last=p.drop_last,
            dataset_fingerprint=self.fingerprint, dataset_config=self.dataset_config,
            order_algorithm=p.order_algorithm,
        )

    # -- iteration --------------------------------------------------------------------

    def begin(self, context: Any = None, reuse_workers: bool = False) -> bool:
        """Set the sampler up for the next iteration; True if it resumes a saved epoch.

        (The arguments serve the pipeline path; the index path has no worker plan.)
        """
        resumed = self.pending is not None
        stages: tuple[IndexStage, ...] = ()
        if self.pending is not None:
            epoch, start, stages = self.pending.epoch, self.pending.consumed, tuple(self.pending.stages)
        else:
            epoch, start = self.epoch, 0
        self.sampler.epoch, self.sampler.start, self.sampler.stages = epoch, start, stages
        self._epoch_len = self.plan.epoch_len(stages)
        with self._lock:
            self.current = (epoch, start, stages)
            self.pending = None
        return resumed

    def on_item(self, item: Any) -> Any:
        with self._lock:
            epoch, consumed, stages = self.current  # type: ignore[misc]
            done = min(consumed + self.plan.step, self._epoch_len)
            self.current = (epoch, done, stages)
            self.last_item = (epoch, stages, consumed, done)
        return item

    def workers_started(self) -> None:
        """Nothing to do: index workers need no channels."""

    def end(self, keep_channels: bool = False) -> None:
        with self._lock:
            if self.current is not None:
                self.epoch = self.current[0] + 1
            self.current = None

    def logical(self, physical: int) -> int:
        """Index workers are not rotated."""
        return physical

    # -- state ------------------------------------------------------------------------

    def save(self, processes: Any = None, timeout: float = 0.0) -> IndexPosition:
        """The position (never asks a worker; the arguments serve the pipeline path)."""
        with self._lock:
            iterating = self.current is not None
            if self.current is not None:
                epoch, consumed, stages = self.current
            elif self.pending is not None:
                epoch, consumed, stages = self.pending.epoch, self.pending.consumed, tuple(self.pending.stages)
            else:
                epoch, consumed, stages = self.epoch, 0, ()
        if iterating and consumed and consumed >= self._epoch_len:
            # The epoch is over: the next sample is the first of the next epoch. (Only for
            # an iteration that yielded its last batch: an empty epoch stays where it is,
            # so that saving without iterating gives equal states.)
            epoch, consumed, stages = epoch + 1, 0, ()
        return IndexPosition(epoch=epoch, consumed=consumed, dataset_len=self.plan.dataset_len, stages=list(stages))

    def check(
        self, saved: LoaderConfig, position: IndexPosition, num_workers: int, elastic: bool = False
    ) -> IndexPosition:
        """Raise ConfigMismatchError for a change the drop-in path cannot honour; the
        position to restore.

        ``elastic``: the position was made for this world size from all old ranks'
        states (rank and world size are not compared).
        """
        current = self.loader_config(num_workers)
        if position.dataset_len != self.plan.dataset_len:
            raise ConfigMismatchError("len(dataset)", position.dataset_len, self.plan.dataset_len)
        if saved.order_algorithm not in ORDER_ALGORITHMS:
            raise ConfigMismatchError(
                "order_algorithm", saved.order_algorithm, current.order_algorithm,
                f"this version knows {list(ORDER_ALGORITHMS)}: the state was written by a newer savable_loader",
            )
        check_dataset_config(saved, current)
        for name in ("seed", "shuffle", "drop_last"):
            if getattr(saved, name) != getattr(current, name):
                raise ConfigMismatchError(name, getattr(saved, name), getattr(current, name))
        if not elastic and saved.world_size != current.world_size:
            raise ConfigMismatchError(
                "world_size", saved.world_size, current.world_size,
                "a drop-in state can move to another world size: pass every old rank's state to "
                "restore_state_global(states)",
            )
        if not elastic and saved.rank != current.rank:
            raise ConfigMismatchError("rank", saved.rank, current.rank)
        check_batch_size(saved.batch_size, current.batch_size)
        stages = tuple(position.stages)
        for stage in stages:
            if len(stage.consumed) != stage.world_size:
                raise ConfigMismatchError(
                    "position.stages.consumed", len(stage.consumed), stage.world_size, "one count per rank of the stage"
                )
        if position.consumed > self.plan.epoch_len(stages):
            raise ConfigMismatchError("position.consumed", position.consumed, f"<= {self.plan.epoch_len(stages)}")
        if current.batch_size and position.consumed % current.batch_size and position.consumed != self.plan.rank_len(stages):
            raise ConfigMismatchError(
                "position.consumed", position.consumed, f"a multiple of batch_size={current.batch_size}"
            )
        # The saved order goes on (a state of an earlier version keeps its stream); the
        # loader writes it from now on. Set last: nothing changes if a check fails.
        self.plan.order_algorithm = saved.order_algorithm
        return position

    # -- restore keys -----------------------------------------------------------------

    def restore_key(self, seed: int) -> RestoreKey | None:
        """The key of the batch yielded last (None before the first)."""
        if self.last_item is None:
            return None
        epoch, stages, first, last = self.last_item
        share = self.plan.share(stages)[first:last]
        p = self.plan
        key = RestoreKey(
            kind="index", seed=seed, fingerprint=self.fingerprint, epoch=epoch, rank=p.rank,
            positions=_ranges([int(x) for x in share]), shuffle=p.shuffle, batched=p.batch_size is not None,
            world_size=p.world_size,
        )  # the default order is left out of str(key), as earlier versions wrote it
        order = p.order_algorithm
        return key if order == ORDER_LEGACY else msgspec.structs.replace(key, order_algorithm=order)

    def restore_sample(self, key: RestoreKey) -> Any:
        """The batch ``key`` names, rebuilt in this process.

        The key is checked whole before anything is built or expanded: its settings
        against the loader's, its ranges against the dataset (constant memory for any key).
        """
        p = self.plan
        if key.kind != "index":
            raise RestoreKeyError(f"key.kind is {key.kind!r}, this drop-in loader expects 'index'")
        if key.shuffle is None:
            raise RestoreKeyError(
                f"key.shuffle is missing (the key was made by an earlier savable-loader), this loader has "
                f"shuffle={p.shuffle}: a key cannot be rebuilt without knowing which order it names; add "
                '"shuffle": true or false (the setting of the loader that made it) to the key'
            )
        check_key_setting("shuffle", key.shuffle, p.shuffle)
        check_key_setting(
            "batched", key.batched, p.batch_size is not None, f"batch_size is {p.batch_size}; None means unbatched"
        )
        check_key_int("epoch", key.epoch)
        if key.order_algorithm not in ORDER_ALGORITHMS:
            raise RestoreKeyError(
                f"key.order_algorithm is {key.order_algorithm!r}, this version knows {list(ORDER_ALGORITHMS)}"
            )
        if key.world_size is None:  # an earlier version's key: the bound it was checked against
            limit = p.dataset_len + p.world_size
        else:
            check_key_int("world_size", key.world_size, 1)
            limit = math.ceil(p.dataset_len / key.world_size) * key.world_size  # the padded order
        # a batch holds at most one rank's share of an epoch: at most len(dataset) samples
        positions = _key_positions(key.positions, limit, p.dataset_len)
        if not p.batch_size and len(positions) != 1:
            raise RestoreKeyError(f"key.positions names {len(positions)} samples, this loader is unbatched (one)")
        # the key's own order: a key made before a restore from an older state still names its batch
        return self.torch_dataset[p.key(key.epoch, positions, key.order_algorithm)]

    def restore(self, position: IndexPosition) -> None:
        if position.consumed and position.consumed >= self.plan.epoch_len(tuple(position.stages)):
            # saved at the very end of an epoch: the next sample is the next epoch's first
            position = IndexPosition(epoch=position.epoch + 1, consumed=0, dataset_len=position.dataset_len)
        with self._lock:
            self.pending = position
            self.epoch = position.epoch
            self.last_item = None


def check_batch_size(saved: int | None, current: int | None) -> None:
    """A restore may keep the batch size or divide it (drop-in: the same sample order)."""
    if saved == current:
        return
    if saved is None or current is None or current > saved or saved % current:
        raise ConfigMismatchError(
            "batch_size", saved, current, "a restore may keep the batch size or use one that divides it"
        )


def check_key_setting(name: str, in_key: Any, current: Any, hint: str = "") -> None:
    """RestoreKeyError naming the setting and both values if a key (made after the setting
    was recorded: ``in_key`` is not None) was made under another one."""
    if in_key is not None and in_key != current:
        raise RestoreKeyError(
            f"key.{name} is {in_key!r}, this loader's {name} is {current!r}: the key names data of a loader "
            f"built with another {name}{f' ({hint})' if hint else ''}"
        )


def check_key_int(name: str, value: Any, low: int = 0) -> None:
    """RestoreKeyError unless a key field is an int >= ``low`` (a key built in Python is
    not validated as a parsed one is)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RestoreKeyError(f"key.{name} is {value!r}, expected an int >= {low}")


def _key_positions(runs: Any, limit: int, most: int) -> list[int]:
    """The positions of a key's ``(start, stop, step)`` runs, each checked to lie below
    ``limit`` and counted (at most ``most``) before any is expanded: constant memory for
    any key."""
    if not isinstance(runs, (list, tuple)) or not runs:
        raise RestoreKeyError(f"key.positions is {runs!r}, expected at least one [start, stop, step] range")
    if len(runs) > most:
        raise RestoreKeyError(f"key.positions has {len(runs)} ranges, a batch of this dataset has at most {most} samples")
    total = 0
    for i, run in enumerate(runs):
        if not (isinstance(run, (list, tuple)) and len(run) == 3):
            raise RestoreKeyError(f"key.positions[{i}] is {run!r}, expected [start, stop, step]")
        start, stop, step = run
        for name, value, low in (("start", start, 0), ("stop", stop, 0), ("step", step, 1)):
            check_key_int(f"positions[{i}].{name}", value, low)
        count = (stop - start + step - 1) // step  # len(range(...)) overflows beyond 2**63
        if count <= 0:
            raise RestoreKeyError(f"key.positions[{i}] is {list(run)}: stop {stop} is not after start {start}")
        last = start + (count - 1) * step
        if last >= limit:
            raise RestoreKeyError(f"key.positions[{i}] reaches position {last}, expected positions below {limit}")
        total += count
        if total > most:
            raise RestoreKeyError(f"key.positions name more than {most} samples, a batch of this dataset has at most {most}")
    positions = [x for start, stop, step in runs for x in range(start, stop, step)]
    if len(set(positions)) != len(positions):
        raise RestoreKeyError("key.positions names a position twice; a batch holds each position once")
    return positions


def _ranges(positions: list[int]) -> list[tuple[int, int, int]]:
    """Positions as few ``(start, stop, step)`` runs (one for an ordinary batch)."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(positions):
        start = positions[i]
        if i + 1 == len(positions):
            runs.append((start, start + 1, 1))
            break
        step = positions[i + 1] - start
        if step <= 0:
            runs.append((start, start + 1, 1))
            i += 1
            continue
        j = i + 1
        while j + 1 < len(positions) and positions[j + 1] - positions[j] == step:
            j += 1
        runs.append((start, positions[j] + 1, step))
        i = j + 1
    return runs


def check_dataset_config(saved: LoaderConfig, current: LoaderConfig) -> None:
    """ConfigMismatchError naming the first differing entry of the dataset configs."""
    if saved.dataset_fingerprint == current.dataset_fingerprint:
        return
    path, old, new = _first_difference(saved.dataset_config, current.dataset_config, "dataset_config")
    raise ConfigMismatchError(path, old, new, "the dataset changed since the state was saved")


def _first_difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key, "<missing>") != new.get(key, "<missing>"):
                return _first_difference(old.get(key, "<missing>"), new.get(key, "<missing>"), f"{path}.{key}")
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return path, old, new
