"""LimitDataset: stop after a number of samples."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["LimitDataset"]


class LimitDataset(BaseWrapperDataset):
    """Yields at most ``length`` samples per rank and epoch.

    The limit is split across the rank's workers: worker ``w`` of ``W`` yields at most
    ``length // W`` samples, plus one if ``w < length % W``.

    Example::

        ds = LimitDataset(RepeatDataset(source), length=10_000)   # fixed-length epochs
    """

    _savable_fields = ("count",)

    def __init__(self, dataset: SavableDataset, length: int) -> None:
        super().__init__(dataset)
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise LoaderUsageError(f"LimitDataset length must be a non-negative int, got {length!r}")
        self.length = length
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.count = 0

    def worker_length(self) -> int:
        """The number of samples the calling worker may yield."""
        workers = self.worker_config.workers_per_rank
        worker = self.worker_config.rank_worker_id()
        return self.length // workers + (1 if worker < self.length % workers else 0)

    def __iter__(self) -> Iterator[Any]:
        limit = self.worker_length()
        if self.count >= limit:
            return
        inner = self.dataset
        for part in parts_of(inner):  # (see stats/timed.py)
            for sample in part:
                self.count += 1
                self.sample_key = inner.sample_key
                yield sample
                if self.count >= limit:
                    return

    def restore_sample(self, key: Any) -> Any:
        """The sample with the inner key ``key``."""
        return self.dataset.restore_sample(key)

    def config(self) -> dict[str, Any]:
        return {"length": self.length}
