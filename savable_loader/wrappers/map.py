"""MapDataset: apply a function to every sample."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import UsageTypeError
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["MapDataset"]


class MapDataset(BaseWrapperDataset):
    """Yields ``fn(sample)`` for every sample of ``dataset``.

    ``fn`` may be a lambda or a local function (cloudpickle carries it to workers) and may
    draw from ``random``, NumPy's and torch's global RNGs: the loader re-seeds them per
    sample so that a resume reproduces the same draws.

    Example::

        ds = MapDataset(source, lambda x: x + random.random())
    """

    def __init__(self, dataset: SavableDataset, fn: Callable[[Any], Any]) -> None:
        super().__init__(dataset)
        if not callable(fn):
            raise UsageTypeError(f"MapDataset fn must be callable, got {fn!r}")
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        fn = self.fn
        inner = self.dataset
        for part in parts_of(inner):  # (see stats/timed.py)
            for sample in part:
                self.sample_key = inner.sample_key
                yield fn(sample)

    def restore_sample(self, key: Any) -> Any:
        """``fn`` applied to the inner sample ``key`` names."""
        return self.fn(self.dataset.restore_sample(key))

    def config(self) -> dict[str, Any]:
        return {"fn": self.fn}
