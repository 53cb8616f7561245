"""BatchDataset: group consecutive samples into batches and collate them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import default_collate

from savable_loader.dataset.base import SavableDataset
from savable_loader.dataset.inline import collate_for_inline
from savable_loader.errors import LoaderUsageError, RestoreKeyError, UsageTypeError
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["BatchDataset"]


class BatchDataset(BaseWrapperDataset):
    """Collates every ``batch_size`` consecutive samples into one batch.

    ``collate_fn`` defaults to torch's ``default_collate`` (in a worker process, a small
    batch of tensors is stacked in ordinary memory, not shared memory: it travels inside
    the worker's message, see ``savable_loader/dataset/inline.py``). The last, shorter batch of an
    epoch is yielded unless ``drop_last``. The batch under construction is local to the
    iterator: a batch is only yielded whole, and the state is taken between batches. The
    state's ``ended`` says that the wrapped dataset has ended this epoch (the short last
    batch was yielded), so that a restore does not run its end of stream again (see
    ``SavableDataset``).

    Example::

        ds = BatchDataset(source, batch_size=32)
    """

    _savable_fields = ("ended",)
    _savable_optional = frozenset({"ended"})

    def __init__(
        self,
        dataset: SavableDataset,
        batch_size: int,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(dataset)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise LoaderUsageError(f"BatchDataset batch_size must be a positive int, got {batch_size!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise UsageTypeError(f"BatchDataset collate_fn must be callable, got {collate_fn!r}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.ended = False

    def __iter__(self) -> Iterator[Any]:
        if self.ended:
            return
        batch: list[Any] = []
        keys: list[Any] = []
        inner = self.dataset
        collate = collate_for_inline(self.collate_fn)
        for part in parts_of(inner):  # (see stats/timed.py)
            for sample in part:
                batch.append(sample)
                keys.append(inner.sample_key)
                if len(batch) == self.batch_size:
                    self.sample_key = None if None in keys else keys
                    yield collate(batch)
                    batch, keys = [], []
        self.ended = True
        if batch and not self.drop_last:
            self.sample_key = None if None in keys else keys
            yield collate(batch)

    def restore_sample(self, key: Any) -> Any:
        """The batch whose samples have the keys in the list ``key``."""
        if not isinstance(key, (list, tuple)) or not key:
            raise RestoreKeyError(f"BatchDataset key must be a non-empty list of sample keys, got {key!r}")
        return collate_for_inline(self.collate_fn)([self.dataset.restore_sample(k) for k in key])

    def config(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "drop_last": self.drop_last, "collate_fn": self.collate_fn}
