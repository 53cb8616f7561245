"""GcDataset: keep Python's garbage collector from stalling workers at random moments."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import get_worker_info

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["GcDataset"]

# The process that last froze its heap (a forked worker inherits the parent's value).
_frozen_pid: int | None = None


class GcDataset(BaseWrapperDataset):
    """Passes samples through and runs ``gc.collect(generation)`` every ``every_n_samples``.

    Worker processes that hold many small objects (decoded samples, shard indexes) pay
    for the collector's full passes at unpredictable moments, and a forked worker's
    collections touch (and so copy) pages it shares with the main process. This wrapper
    collects at a fixed rhythm instead and, once per worker process when it starts
    iterating, runs ``gc.collect()`` then ``gc.freeze()`` so that everything alive at that
    point (the inherited heap, the pipeline) is left out of later collections. In the main
    process (``num_workers=0``) it does not freeze: the caller's heap is the caller's.

    The collection rhythm does not change the data: it is neither state nor configuration
    (changing it does not refuse a restore). Restore keys are the inner dataset's.

    Example::

        ds = GcDataset(BatchDataset(source, 32), every_n_samples=50)
    """

    def __init__(
        self, dataset: SavableDataset, every_n_samples: int = 100, *, generation: int = 2, freeze: bool = True
    ) -> None:
        super().__init__(dataset)
        if not isinstance(every_n_samples, int) or isinstance(every_n_samples, bool) or every_n_samples < 1:
            raise LoaderUsageError(f"GcDataset every_n_samples must be a positive int, got {every_n_samples!r}")
        if generation not in (0, 1, 2) or isinstance(generation, bool):
            raise LoaderUsageError(f"GcDataset generation must be 0, 1 or 2, got {generation!r}")
        self.every_n_samples = every_n_samples
        self.generation = generation
        self.freeze = freeze

    def _start(self) -> None:
        global _frozen_pid
        if self.freeze and get_worker_info() is not None and _frozen_pid != os.getpid():
            gc.collect()
            gc.freeze()
            _frozen_pid = os.getpid()

    def __iter__(self) -> Iterator[Any]:
        self._start()
        inner = self.dataset
        every, generation = self.every_n_samples, self.generation
        count = 0
        for part in parts_of(inner):  # (see stats/timed.py)
            for sample in part:
                count += 1
                if count % every == 0:
                    gc.collect(generation)
                self.sample_key = inner.sample_key
                yield sample

    def restore_sample(self, key: Any) -> Any:
        """The sample with the inner key ``key`` (no collection here)."""
        return self.dataset.restore_sample(key)
