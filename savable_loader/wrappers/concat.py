"""ConcatDataset: one dataset after another."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from savable_loader.dataset.base import SavableDataset, wrap_key
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers.base import check_datasets, split_index_key

__all__ = ["ConcatDataset"]


class ConcatDataset(SavableDataset):
    """Yields every sample of ``datasets[0]``, then of ``datasets[1]``, and so on.

    Each worker goes through its own share of every dataset in turn (the datasets split
    their data across workers themselves). The index of the dataset being read is state.
    Every dataset must have the same ``WorkerConfig``. Restore keys are
    ``[dataset index, inner key]``.

    Example::

        ds = ConcatDataset([warmup_data, main_data])
    """

    _savable_fields = ("part",)

    def __init__(self, datasets: Sequence[SavableDataset]) -> None:
        datasets = check_datasets("ConcatDataset", datasets)
        super().__init__(datasets[0].worker_config)
        self.datasets = datasets
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.part = 0

    def children(self) -> Sequence[SavableDataset]:
        return self.datasets

    def __iter__(self) -> Iterator[Any]:
        while self.part < len(self.datasets):
            inner = self.datasets[self.part]
            for run in parts_of(inner):  # (see stats/timed.py)
                for sample in run:
                    self.sample_key = wrap_key(self.part, inner.sample_key)
                    yield sample
            self.part += 1

    def restore_sample(self, key: Any) -> Any:
        """The sample of dataset ``key[0]`` whose inner key is ``key[1]``."""
        index, inner = split_index_key("ConcatDataset", key, len(self.datasets))
        return self.datasets[index].restore_sample(inner)

    def config(self) -> dict[str, Any]:
        return {"parts": len(self.datasets)}
