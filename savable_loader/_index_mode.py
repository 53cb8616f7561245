"""Bookkeeping of the drop-in path: which epoch, how many of this rank's samples yielded.

The state is two numbers. Saving reads them (microseconds, no worker involved);
restoring sets them, and the next iteration's sampler starts at that sample.
"""

from __future__ import annotations

import threading
from typing import Any

from savable_loader.dataset import config_fingerprint, plain_config, type_name
from savable_loader.errors import ConfigMismatchError
from savable_loader.sources.index import IndexedDataset, IndexPlan, IndexSampler
from savable_loader.state.schema import IndexPosition, LoaderConfig

__all__ = ["IndexMode", "map_dataset_config"]


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
        self.current: tuple[int, int] | None = None  # (epoch, consumed) while iterating

    def loader_config(self, num_workers: int) -> LoaderConfig:
        p = self.plan
        return LoaderConfig(
            rank=p.rank, world_size=p.world_size, num_workers=num_workers, seed=p.seed,
            batch_size=p.batch_size, shuffle=p.shuffle, drop_last=p.drop_last,
            dataset_fingerprint=self.fingerprint, dataset_config=self.dataset_config,
        )

    # -- iteration --------------------------------------------------------------------

    def begin(self, context: Any = None, reuse_workers: bool = False) -> bool:
        """Set the sampler up for the next iteration; True if it resumes a saved epoch.

        (The arguments serve the pipeline path; the index path has no worker plan.)
        """
        resumed = self.pending is not None
        if self.pending is not None:
            epoch, start = self.pending.epoch, self.pending.consumed
        else:
            epoch, start = self.epoch, 0
        self.sampler.epoch, self.sampler.start = epoch, start
        with self._lock:
            self.current = (epoch, start)
            self.pending = None
        return resumed

    def on_item(self, item: Any) -> Any:
        with self._lock:
            epoch, consumed = self.current  # type: ignore[misc]
            self.current = (epoch, min(consumed + self.plan.step, self.plan.epoch_len))
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
            if self.current is not None:
                epoch, consumed = self.current
            elif self.pending is not None:
                epoch, consumed = self.pending.epoch, self.pending.consumed
            else:
                epoch, consumed = self.epoch, 0
        if consumed >= self.plan.epoch_len:
            # The epoch is over: the next sample is the first of the next epoch.
            epoch, consumed = epoch + 1, 0
        return IndexPosition(epoch=epoch, consumed=consumed, dataset_len=self.plan.dataset_len)

    def check(self, saved: LoaderConfig, position: IndexPosition, num_workers: int) -> None:
        """Raise ConfigMismatchError for a change the drop-in path cannot honour."""
        current = self.loader_config(num_workers)
        if position.dataset_len != self.plan.dataset_len:
            raise ConfigMismatchError("len(dataset)", position.dataset_len, self.plan.dataset_len)
        check_dataset_config(saved, current)
        for name in ("seed", "shuffle", "rank", "world_size", "batch_size", "drop_last"):
            if getattr(saved, name) != getattr(current, name):
                raise ConfigMismatchError(name, getattr(saved, name), getattr(current, name))
        if position.consumed > self.plan.epoch_len:
            raise ConfigMismatchError("position.consumed", position.consumed, f"<= {self.plan.epoch_len}")

    def restore(self, position: IndexPosition) -> None:
        with self._lock:
            self.pending = position
            self.epoch = position.epoch


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
