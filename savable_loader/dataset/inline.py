"""A pipeline worker's small tensors travel inside its message, not through shared memory.

torch sends a tensor from a worker process by moving its storage to shared memory and
passing the file descriptor: the main process connects to the worker's resource-sharer
thread and exchanges an authentication handshake for every storage. That thread needs
the worker's GIL, which the worker's loading thread holds while it makes the next item,
so each batch waits on a thread switch in a busy process (about 1-2 ms a batch on 2
cores: more than a packed batch of token rows takes to make). A tensor of up to
:data:`INLINE_MAX_BYTES` is sent instead as its bytes inside the pickled message (one
copy each way, about 0.1 ms for 128 KiB), and is a tensor again in the main process:
same dtype, shape, strides and values.

A tensor goes inline only where nothing but its values can differ: a plain CPU
``torch.Tensor`` (no subclass), contiguous, strided, not requiring grad, no names, a
dtype NumPy has, the only tensor of the item on its storage and covering all of it (a
view of a larger buffer, or two tensors on one storage, keep torch's way, which keeps
the sharing). It is found in the item's payload itself or in lists, tuples, named tuples
and dicts, nested; anything else travels as torch sends it.

In a worker, torch's ``default_collate`` stacks a batch of tensors straight into shared
memory (a new shared-memory file per batch, its pages faulted in fresh), to save a copy
when it is sent. A batch that goes inline never uses that memory: the pipeline's batching
wrappers collate with :func:`inline_default_collate` instead, which is
``default_collate`` but stacks such a batch in ordinary memory (larger batches, dtypes
NumPy lacks and tensor subclasses keep torch's way). Same values, dtypes and shapes.

Example (in a worker, on the way out)::

    payload = inline_small_tensors(payload)   # pickled by the worker's result queue
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from savable_loader._torch.internals import collate_with_tensor_rule

__all__ = ["INLINE_MAX_BYTES", "collate_for_inline", "inline_default_collate", "inline_small_tensors"]

#: The largest tensor (bytes of its values) sent inside the message; larger ones go
#: through shared memory, whose fixed cost is then small against copying them.
INLINE_MAX_BYTES = 1 << 20

_MAX_DEPTH = 8  # levels of containers looked into


class _Inline:
    """A tensor's values as a NumPy array; unpickles as ``torch.from_numpy`` of them."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return torch.from_numpy, (self.array,)


#: Per dtype: whether a tensor of it comes back from NumPy as the same dtype (looked up
#: once per dtype in each process; a dtype NumPy lacks, or maps to another, stays out).
_ROUND_TRIPS: dict[torch.dtype, bool] = {}


def _round_trips(dtype: torch.dtype) -> bool:
    known = _ROUND_TRIPS.get(dtype)
    if known is None:
        try:
            known = torch.from_numpy(torch.empty(0, dtype=dtype).numpy()).dtype == dtype
        except (TypeError, RuntimeError):
            known = False
        _ROUND_TRIPS[dtype] = known
    return known


def _eligible(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and _round_trips(t.dtype)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and t.is_contiguous()
        and t.nbytes <= INLINE_MAX_BYTES
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.nbytes
        and not t.is_quantized
        and not any(getattr(t, "names", None) or ())  # (named tensors, where torch has them)
    )


def _tensors(value: Any, found: list[torch.Tensor], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < _MAX_DEPTH:
        if type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            for v in value:
                _tensors(v, found, depth + 1)
        elif type(value) is dict:
            for v in value.values():
                _tensors(v, found, depth + 1)


def _replace(value: Any, chosen: dict[int, _Inline], depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return chosen.get(id(value), value)
    if depth >= _MAX_DEPTH:
        return value
    if type(value) is list:
        return [_replace(v, chosen, depth + 1) for v in value]
    if type(value) is tuple:
        return tuple(_replace(v, chosen, depth + 1) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_replace(v, chosen, depth + 1) for v in value))
    if type(value) is dict:
        return {k: _replace(v, chosen, depth + 1) for k, v in value.items()}
    return value


def inline_small_tensors(payload: Any) -> Any:
    """``payload`` with each small tensor that can go inline (see the module docstring)
    replaced by its values, which unpickle as an equal tensor; ``payload`` itself when
    none can (no copy of the containers then)."""
    found: list[torch.Tensor] = []
    _tensors(payload, found, 0)
    if not found:
        return payload
    owners: dict[int, set[int]] = {}  # storage address -> the tensors on it (any of them)
    for t in found:
        if t.layout == torch.strided:
            owners.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    chosen: dict[int, _Inline] = {}
    for t in found:
        if id(t) in chosen or not _eligible(t) or len(owners[t.untyped_storage().data_ptr()]) > 1:
            continue
        try:
            chosen[id(t)] = _Inline(t.numpy())
        except (TypeError, RuntimeError):  # a conjugate or negative view
            continue
    if not chosen:
        return payload
    return _replace(payload, chosen, 0)


def _stack_inline(batch: Any, torch_rule: Any, *, collate_fn_map: Any = None) -> Any:
    """A batch of tensors that will go inline stacked in ordinary memory; torch's rule
    (shared memory in a worker) for any other."""
    elem = batch[0]
    if (
        type(elem) is torch.Tensor
        and elem.layout == torch.strided
        and not elem.is_nested
        and elem.device.type == "cpu"
        and _round_trips(elem.dtype)
        and sum(x.numel() for x in batch) * elem.element_size() <= INLINE_MAX_BYTES
    ):
        return torch.stack(batch, 0)
    return torch_rule(batch, collate_fn_map=collate_fn_map)


#: torch's ``default_collate``, small tensor batches stacked in ordinary memory (see the
#: module docstring): what ``BatchDataset`` and ``GroupBatchDataset`` collate with by default.
inline_default_collate = collate_with_tensor_rule(_stack_inline)


def collate_for_inline(collate_fn: Any) -> Any:
    """:func:`inline_default_collate` for torch's ``default_collate``, any other
    ``collate_fn`` as it is."""
    return inline_default_collate if collate_fn is default_collate else collate_fn
