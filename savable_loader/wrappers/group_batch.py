"""GroupBatchDataset: batches of samples that share a group key (bucketing)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import default_collate

from savable_loader.dataset.base import SavableDataset
from savable_loader.dataset.inline import collate_for_inline
from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["GroupBatchDataset"]

_PLAIN = frozenset({type(None), bool, int, float, str})


def _hashable(key: Any) -> Hashable:
    """A group key as a dict key (states of earlier versions hold tuples as lists)."""
    if isinstance(key, (list, tuple)):
        return tuple(_hashable(k) for k in key)
    return key


def _plain_group(key: Any) -> Any:
    """``key`` as plain Python values, for the bucket and the state.

    Subclasses and NumPy scalars of the plain types (``torch.Size``, ``IntEnum``,
    ``np.int64``, ``np.float32``) become the plain value they equal, with the same hash:
    the buckets are the same, and a state holds the key (a state refuses subclasses).
    """
    cls = type(key)
    if cls in _PLAIN:
        return key
    if isinstance(key, tuple):
        return tuple(_plain_group(k) for k in key)
    if isinstance(key, (bool, np.bool_)):
        return bool(key)
    if isinstance(key, (int, np.integer)):
        return int(key)
    if isinstance(key, (float, np.floating)):
        return float(key)
    if isinstance(key, str):
        return str(key)
    raise LoaderUsageError(
        f"GroupBatchDataset key_fn must return None, bool, int, float, str or a tuple of them, got {key!r}"
    )


class GroupBatchDataset(BaseWrapperDataset):
    """Puts each sample in the bucket of ``key_fn(sample)`` and yields a bucket as a
    collated batch as soon as it holds ``batch_size`` samples.

    Typical use: batches of similar length (``key_fn=lambda s: len(s["tokens"]) // 64``)
    or of one modality. At the end of the epoch the partial buckets are yielded, oldest
    first, unless ``drop_last``. ``collate_fn`` defaults to torch's ``default_collate``
    (small tensor batches stacked in ordinary memory in a worker, as ``BatchDataset``
    does).
    Group keys must be plain values (None, bool, int, float, str, tuples of them);
    subclasses and NumPy scalars of these (``torch.Size``, ``IntEnum``, ``np.int64``)
    are taken as the plain value they equal.

    State: the buckets with their samples and the samples' restore keys (samples must not
    be modified in place after they are pulled). A batch's restore key is the list of its
    samples' keys, marked before the batch is collated and yielded.

    Example::

        ds = GroupBatchDataset(source, batch_size=16, key_fn=lambda s: s["image"].shape[-2:])
    """

    # ``ended``: the wrapped dataset has ended this epoch (the partial buckets drain); a
    # restore then does not run its end of stream again (see ``SavableDataset``).
    _savable_fields = ("buckets", "ended")
    _savable_optional = frozenset({"ended"})

    def __init__(
        self,
        dataset: SavableDataset,
        batch_size: int,
        key_fn: Callable[[Any], Any],
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(dataset)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise LoaderUsageError(f"GroupBatchDataset batch_size must be a positive int, got {batch_size!r}")
        if not callable(key_fn):
            raise LoaderUsageError(f"GroupBatchDataset key_fn must be callable, got {key_fn!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise LoaderUsageError(f"GroupBatchDataset collate_fn must be callable, got {collate_fn!r}")
        self.batch_size = batch_size
        self.key_fn = key_fn
        self.drop_last = drop_last
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.reset_state_own()

    def reset_state_own(self) -> None:
        # [group key, samples, sample keys] per bucket, oldest first
        self.buckets: list[list[Any]] = []
        self.ended = False

    def _emit(self, bucket: list[Any]) -> Any:
        _, samples, keys = bucket
        # the RNG rule: re-seed from the batch's key (None: a sample has no key, no re-seed)
        self.mark_sample(None if any(k is None for k in keys) else list(keys))
        return collate_for_inline(self.collate_fn)(samples)

    def __iter__(self) -> Iterator[Any]:
        inner = self.dataset
        index = {_hashable(b[0]): b for b in self.buckets}
        for sample in () if self.ended else inner:
            group = _plain_group(self.key_fn(sample))
            h = _hashable(group)
            bucket = index.get(h)
            if bucket is None:
                bucket = [group, [], []]
                index[h] = bucket
                self.buckets.append(bucket)
            bucket[1].append(sample)
            bucket[2].append(inner.sample_key)
            if len(bucket[1]) >= self.batch_size:
                del index[h]
                self.buckets = [b for b in self.buckets if b is not bucket]
                yield self._emit(bucket)
        self.ended = True
        while self.buckets:
            bucket = self.buckets.pop(0)
            if not self.drop_last:
                yield self._emit(bucket)

    def restore_sample(self, key: Any) -> Any:
        """The batch whose samples have the keys in the list ``key``."""
        if not isinstance(key, (list, tuple)) or not key:
            raise RestoreKeyError(f"GroupBatchDataset key must be a non-empty list of sample keys, got {key!r}")
        samples = [self.dataset.restore_sample(k) for k in key]
        self.mark_sample(list(key))
        return collate_for_inline(self.collate_fn)(samples)

    def config(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "key_fn": self.key_fn,
            "drop_last": self.drop_last,
            "collate_fn": self.collate_fn,
        }
