"""RepeatDataset: iterate a dataset again and again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from savable_loader.config import _Repetition
from savable_loader.dataset import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["RepeatDataset"]


class RepeatDataset(BaseWrapperDataset):
    """Repeats ``dataset`` ``repeats`` times, or forever when ``repeats`` is None.

    Each pass resets the wrapped dataset; sources that seed from
    ``worker_config.epoch_seed()`` are shuffled anew on every pass. A pass that yields
    nothing ends the repetition (an endless loop over an empty dataset would hang).

    Example::

        ds = RepeatDataset(source)             # endless stream
        ds = RepeatDataset(source, repeats=3)  # three passes per epoch
    """

    # ``pass_yielded``: the current pass has yielded a sample. It must be state, not a
    # local: a state saved after the last sample of a pass restores into a pass that
    # yields nothing more, which is not an empty dataset.
    _savable_fields = ("repetition", "pass_yielded")

    def __init__(self, dataset: SavableDataset, repeats: int | None = None) -> None:
        super().__init__(dataset)
        if repeats is not None and (not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 0):
            raise LoaderUsageError(f"RepeatDataset repeats must be None or a non-negative int, got {repeats!r}")
        self.repeats = repeats
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.repetition = 0
        self.pass_yielded = False

    def __iter__(self) -> Iterator[Any]:
        while self.repeats is None or self.repetition < self.repeats:
            for sample in self.dataset:
                self.pass_yielded = True
                yield sample
            empty = not self.pass_yielded
            self.repetition += 1
            self.pass_yielded = False
            with _Repetition(self.repetition):
                self.dataset.reset_state_deep()
            if empty and self.repeats is None:
                return

    def config(self) -> dict[str, Any]:
        return {"repeats": self.repeats}
