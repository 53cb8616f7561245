"""BaseWrapperDataset: a savable dataset that wraps another and shares its WorkerConfig."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, RestoreKeyError

__all__ = ["BaseWrapperDataset", "check_datasets", "split_index_key"]


def check_datasets(owner: str, datasets: Any) -> list[SavableDataset]:
    """``datasets`` as a non-empty list of savable datasets sharing one WorkerConfig;
    LoaderUsageError naming ``owner`` and the entry otherwise."""
    datasets = list(datasets) if isinstance(datasets, (list, tuple)) else datasets
    if not isinstance(datasets, list) or not datasets:
        raise LoaderUsageError(f"{owner} datasets must be a non-empty list of SavableDataset, got {datasets!r}")
    for i, ds in enumerate(datasets):
        if not isinstance(ds, SavableDataset):
            raise LoaderUsageError(f"{owner} datasets[{i}] must be a SavableDataset, got {type(ds).__qualname__}")
        if ds.worker_config != datasets[0].worker_config:
            raise LoaderUsageError(
                f"{owner} datasets[{i}].worker_config is {ds.worker_config}, "
                f"expected datasets[0]'s {datasets[0].worker_config}"
            )
    return datasets


def split_index_key(owner: str, key: Any, count: int) -> tuple[int, Any]:
    """``(index, inner key)`` of a ``[index, inner key]`` key whose index picks one of
    ``count`` datasets; RestoreKeyError naming ``owner`` otherwise."""
    if not isinstance(key, (list, tuple)) or len(key) != 2 or not isinstance(key[0], int) or not 0 <= key[0] < count:
        raise RestoreKeyError(f"{owner} key must be [dataset index below {count}, inner key], got {key!r}")
    return key[0], key[1]


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
            raise LoaderUsageError(f"{type(self).__name__} wraps a SavableDataset, got {type(dataset).__qualname__}")
        super().__init__(dataset.worker_config)
        self.dataset = dataset

    def children(self) -> Sequence[SavableDataset]:
        return (self.dataset,)

    def config(self) -> dict[str, Any]:
        return {}
