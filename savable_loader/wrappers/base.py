"""BaseWrapperDataset: a savable dataset that wraps another and shares its WorkerConfig."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from savable_loader.dataset import SavableDataset
from savable_loader.errors import LoaderUsageError

__all__ = ["BaseWrapperDataset"]


class BaseWrapperDataset(SavableDataset):
    """Wraps one savable dataset; the worker config is taken from it.

    Example::

        class Twice(BaseWrapperDataset):
            def __iter__(self):
                for x in self.dataset:
                    yield x
                    yield x
    """

    def __init__(self, dataset: SavableDataset) -> None:
        if not isinstance(dataset, SavableDataset):
            raise LoaderUsageError(
                f"{type(self).__name__} wraps a SavableDataset, got {type(dataset).__qualname__}"
            )
        super().__init__(dataset.worker_config)
        self.dataset = dataset

    def children(self) -> Sequence[SavableDataset]:
        return (self.dataset,)

    def config(self) -> dict[str, Any]:
        return {}
