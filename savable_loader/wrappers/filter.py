"""FilterDataset: keep the samples a predicate accepts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import UsageTypeError
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["FilterDataset"]


class FilterDataset(BaseWrapperDataset):
    """Yields the samples of ``dataset`` for which ``predicate(sample)`` is true.

    Example::

        ds = FilterDataset(source, lambda x: x % 2 == 0)
    """

    def __init__(self, dataset: SavableDataset, predicate: Callable[[Any], bool]) -> None:
        super().__init__(dataset)
        if not callable(predicate):
            raise UsageTypeError(f"FilterDataset predicate must be callable, got {predicate!r}")
        self.predicate = predicate

    def __iter__(self) -> Iterator[Any]:
        predicate = self.predicate
        inner = self.dataset
        for part in parts_of(inner):  # (see stats/timed.py)
            for sample in part:
                if predicate(sample):
                    self.sample_key = inner.sample_key
                    yield sample

    def restore_sample(self, key: Any) -> Any:
        """The inner sample ``key`` names (the predicate runs again for its random draws)."""
        sample = self.dataset.restore_sample(key)
        self.predicate(sample)  # it ran before the yield: replay its random draws, if any
        return sample

    def config(self) -> dict[str, Any]:
        return {"predicate": self.predicate}
