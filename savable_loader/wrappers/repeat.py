"""RepeatDataset: iterate a dataset again and again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from savable_loader.config import _Repetition
from savable_loader.dataset.base import SavableDataset, wrap_key
from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.state.schema import DatasetState
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
        inner = self.dataset
        while self.repeats is None or self.repetition < self.repeats:
            # Each pass pulls inside its repetition, so that keyed sources seed per pass.
            it = iter(inner)
            while True:
                with _Repetition(self.repetition, self.repeats):  # the limit: for sources' prefetch
                    try:
                        sample = next(it)
                    except StopIteration:
                        break
                self.pass_yielded = True
                self.sample_key = wrap_key(self.repetition, inner.sample_key)
                yield sample
            empty = not self.pass_yielded
            self.repetition += 1
            self.pass_yielded = False
            with _Repetition(self.repetition):
                self.dataset.reset_state_deep()
            if empty and self.repeats is None:
                return

    def restore_state(self, state: DatasetState | None) -> None:
        """Put back a state, the wrapped dataset's inside the pass it was saved in: a
        dataset that records its repetition context (``EpochizeDataset``'s end-of-epoch
        carry) sees the context it saw when the state was taken, not the top level."""
        repetition = state.fields.get("repetition") if isinstance(state, DatasetState) else None
        if not isinstance(repetition, int) or isinstance(repetition, bool):
            super().restore_state(state)  # the epoch's start, or a malformed state (refused there)
            return
        with _Repetition(repetition):
            super().restore_state(state)

    def restore_sample(self, key: Any) -> Any:
        """The sample of pass ``key[0]`` whose inner key is ``key[1]``."""
        if not isinstance(key, (list, tuple)) or len(key) != 2 or not isinstance(key[0], int):
            raise RestoreKeyError(f"RepeatDataset key must be [repetition, inner key], got {key!r}")
        with _Repetition(key[0]):
            return self.dataset.restore_sample(key[1])

    def config(self) -> dict[str, Any]:
        return {"repeats": self.repeats}
