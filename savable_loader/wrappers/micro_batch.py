"""MicroBatchDataset: split every batch into micro-batches of a given size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from savable_loader.core.tensordict import (
    collection_size,
    contains_collection,
    decode_rest,
    encode_rest,
    is_collection,
    is_jagged,
    slice_collection,
    slice_jagged,
)
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers.base import BaseWrapperDataset
from savable_loader.wrappers.batch import BatchDataset

__all__ = ["MicroBatchDataset"]


def _is_structure(seq: list[Any] | tuple[Any, ...]) -> bool:
    """A list/tuple of containers is a structure (fields of a batch); one of plain values
    (ints, strings) is itself a batch dimension."""
    return any(isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)) or is_collection(v) for v in seq)


def batch_sizes(batch: Any, path: str = "batch") -> dict[str, int]:
    """The length along the batch dimension of every leaf of ``batch``, by path."""
    if is_collection(batch):
        return {path: collection_size(batch, path)}
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return {path: int(batch.shape[0])} if batch.ndim else {}
    if isinstance(batch, dict):
        out: dict[str, int] = {}
        for k, v in batch.items():
            out.update(batch_sizes(v, f"{path}[{k!r}]"))
        return out
    if isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            return {path: len(batch)}
        out = {}
        for i, v in enumerate(batch):
            out.update(batch_sizes(v, f"{path}[{i}]"))
        return out
    return {}  # a scalar: the same for every micro-batch


def slice_batch(batch: Any, start: int, stop: int, path: str = "batch") -> Any:
    """Samples ``start:stop`` of a batch: tensors, arrays, dicts, lists and tuples (nested),
    tensordict collections and jagged nested tensors (``savable_loader.core.tensordict``)."""
    if is_collection(batch):
        return slice_collection(batch, start, stop, path)
    if is_jagged(batch):
        return slice_jagged(batch, start, stop, path)
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[start:stop] if batch.ndim else batch
    if isinstance(batch, dict):
        return {k: slice_batch(v, start, stop, f"{path}[{k!r}]") for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            return batch[start:stop]
        parts = [slice_batch(v, start, stop, f"{path}[{i}]") for i, v in enumerate(batch)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    return batch


class MicroBatchDataset(BaseWrapperDataset):
    """Splits every batch of ``dataset`` into micro-batches of ``micro_batch_size``.

    Batches may be tensors, NumPy arrays, dicts, lists and tuples of them, nested; every
    leaf is split along its first dimension (lists of plain values such as strings count
    as leaves, scalars are repeated in every micro-batch). A ``tensordict`` batch (any
    ``TensorDictBase`` or tensorclass, nested, lazy stacks and jagged nested tensors
    included) is split along dim 0 of its ``batch_size``, which it must have. The last
    micro-batch of a batch may be smaller. Sits after ``BatchDataset``: when the batch size is known (the wrapped
    dataset is a ``BatchDataset``, or ``batch_size=`` is given) a micro-batch size larger
    than it is refused at once; otherwise any batch smaller than ``micro_batch_size`` is an
    error (pass ``batch_size=`` when short last batches are expected).

    State: the part of the current batch not yet yielded (it keeps its types: tuples,
    NumPy scalars, TensorDicts, lazy stacks, non-tensor data and jagged tensors; a
    namedtuple or tensorclass batch is refused when the state is taken, since it would not
    come back identical), the batch's key and the next micro index. Restore keys
    are ``[batch key, micro index]``, marked before each micro-batch is yielded (the RNG
    rule of ``SavableDataset``).

    Example::

        ds = MicroBatchDataset(BatchDataset(source, batch_size=32), micro_batch_size=8)
    """

    _savable_fields = ("rest", "batch_key", "micro")

    def __init__(self, dataset: SavableDataset, micro_batch_size: int, *, batch_size: int | None = None) -> None:
        super().__init__(dataset)
        for name, value in (("micro_batch_size", micro_batch_size), ("batch_size", batch_size)):
            if value is None and name == "batch_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoaderUsageError(f"MicroBatchDataset {name} must be a positive int, got {value!r}")
        if batch_size is None and isinstance(dataset, BatchDataset):
            batch_size = dataset.batch_size
        if batch_size is not None and micro_batch_size > batch_size:
            raise LoaderUsageError(
                f"MicroBatchDataset micro_batch_size={micro_batch_size} is larger than the batch size "
                f"{batch_size}: expected a micro-batch size of at most {batch_size}"
            )
        self.micro_batch_size = micro_batch_size
        self.batch_size = batch_size
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self._rest: Any = None
        self.batch_key: Any = None
        self.micro = 0

    @property
    def rest(self) -> Any:
        """The state's view of the part of the current batch not yet yielded: the batch
        itself, or a tagged tree of plain values when it holds a ``tensordict`` collection
        or a jagged tensor (``savable_loader.core.tensordict.encode_rest``)."""
        live = self._rest
        return encode_rest(live, "MicroBatchDataset.rest") if contains_collection(live) else live

    @rest.setter
    def rest(self, value: Any) -> None:
        self._rest = decode_rest(value)

    def _size(self, batch: Any) -> int:
        sizes = batch_sizes(batch)
        if not sizes:
            raise LoaderUsageError(
                f"MicroBatchDataset found nothing to split in a batch of type {type(batch).__qualname__}"
            )
        distinct = set(sizes.values())
        if len(distinct) > 1:
            raise LoaderUsageError(f"MicroBatchDataset: the parts of a batch differ in batch size: {sizes}")
        return distinct.pop()

    def __iter__(self) -> Iterator[Any]:
        inner = self.dataset
        it = iter(inner)
        m = self.micro_batch_size
        while True:
            if self._rest is None:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                size = self._size(batch)
                if size == 0:
                    continue
                if self.batch_size is None and size < m:
                    raise LoaderUsageError(
                        f"MicroBatchDataset micro_batch_size={m} is larger than a batch of {size} samples: "
                        f"expected a micro-batch size of at most {size} (pass batch_size= if short last "
                        "batches are expected)"
                    )
                self._rest, self.batch_key, self.micro = batch, inner.sample_key, 0
            size = self._size(self._rest)
            out = slice_batch(self._rest, 0, m)
            self._rest = None if size <= m else slice_batch(self._rest, m, size)
            key = None if self.batch_key is None else [self.batch_key, self.micro]
            self.micro += 1
            self.mark_sample(key)  # the RNG rule: re-seed from the key (None: no key, no re-seed)
            yield out

    def restore_sample(self, key: Any) -> Any:
        """Micro-batch ``key[1]`` of the batch whose key is ``key[0]``."""
        if not isinstance(key, (list, tuple)) or len(key) != 2 or not isinstance(key[1], int) or key[1] < 0:
            raise RestoreKeyError(f"MicroBatchDataset key must be [batch key, micro index], got {key!r}")
        batch = self.dataset.restore_sample(key[0])
        size = self._size(batch)
        m = self.micro_batch_size
        start = key[1] * m
        if start >= size:
            raise RestoreKeyError(
                f"MicroBatchDataset key {key!r}: micro index {key[1]} is past the end of a batch of {size} samples"
            )
        self.mark_sample(key)
        return slice_batch(batch, start, min(start + m, size))

    def config(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "batch_size": self.batch_size}
