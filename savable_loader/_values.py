"""Values inside dataset states: copy live values at snapshot time, convert to and from
the plain values the state schema can encode (tensors and arrays as ``ArrayValue``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from savable_loader.errors import StateError
from savable_loader.rng import capture_generator, capture_kind
from savable_loader.state.schema import ArrayValue, DatasetState

__all__ = ["freeze", "from_plain", "plain_dataset_state", "to_plain"]

_SCALARS = (type(None), bool, int, float, str, bytes)
_SCALAR_TYPES = frozenset(_SCALARS)


def _all_scalars(values: list[Any] | tuple[Any, ...]) -> bool:
    # exact types (subclasses such as NumPy scalars or IntEnum take the slow path); at C
    # speed, so a 100k-entry buffer of ints is copied in about a millisecond
    return set(map(type, values)) <= _SCALAR_TYPES
_TORCH_DTYPES = {
    torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
    torch.complex64: "complex64", torch.complex128: "complex128",
    torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
}
_TORCH_BY_NAME = {name: dtype for dtype, name in _TORCH_DTYPES.items()}
# NumPy has no bfloat16; other dtypes (object, str, datetime, float128...) cannot be decoded.
_NUMPY_DTYPE_NAMES = frozenset(_TORCH_BY_NAME) - {"bfloat16"}


def freeze(value: Any, path: str = "") -> Any:
    """Copy a live value so that later mutation by the iterator cannot change it.

    Containers are copied, tensors and arrays cloned, RNG objects captured. Everything
    else must be a plain scalar; anything the state cannot hold is a :class:`StateError`
    naming ``path``.
    """
    if isinstance(value, np.generic):  # before _SCALARS: np.float64 and np.str_ subclass float and str
        return value.item()
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        if _all_scalars(value):
            return list(value)
        return [freeze(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {_check_key(k, path): freeze(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        if value.dtype not in _TORCH_DTYPES:
            raise StateError(
                f"state field {path or '<root>'} holds a tensor of dtype {value.dtype}, which a state cannot hold"
            )
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        if value.dtype.name not in _NUMPY_DTYPE_NAMES:
            raise StateError(
                f"state field {path or '<root>'} holds an array of dtype {value.dtype}, which a state cannot hold"
            )
        return value.copy()
    if isinstance(value, bytearray):
        return bytes(value)
    if capture_kind(value) is not None:
        return capture_generator(value)
    raise StateError(
        f"state field {path or '<root>'} holds a {type(value).__qualname__}, which a state "
        "cannot hold (allowed: None, bool, int, float, str, bytes, list, tuple, dict, "
        "tensors, NumPy arrays and RNG objects)"
    )


def _check_key(key: Any, path: str) -> Any:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    raise StateError(f"state field {path or '<root>'} has a dict key {key!r}: keys must be str or int")


def to_plain(value: Any) -> Any:
    """Turn a frozen value into schema values (tensors and arrays become ``ArrayValue``)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, list):
        if _all_scalars(value):
            return list(value)
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        name = _TORCH_DTYPES.get(t.dtype)
        if name is None:
            raise StateError(f"a state cannot hold a tensor of dtype {t.dtype}")
        # A size-1 dimension may keep any stride through contiguous() and reshape():
        # force unit stride before viewing the memory as bytes.
        flat = t.reshape(-1)
        if flat.numel() and flat.stride(0) != 1:
            flat = flat.clone(memory_format=torch.contiguous_format)
        raw = flat.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ArrayValue(library="torch", dtype=name, shape=tuple(t.shape), data=raw)
    if isinstance(value, ArrayValue):
        return value
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        # shape of `value`: ascontiguousarray turns a 0-d array into shape (1,)
        return ArrayValue(library="numpy", dtype=a.dtype.name, shape=value.shape, data=a.tobytes())
    raise StateError(f"a state cannot hold a {type(value).__qualname__}")


def from_plain(value: Any) -> Any:
    """Inverse of :func:`to_plain`: ``ArrayValue`` back to tensors and arrays."""
    if isinstance(value, list):
        if _all_scalars(value):
            return list(value)
        return [from_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):  # a state not yet encoded: never alias its arrays
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, ArrayValue):
        if value.library == "torch":
            dtype = _TORCH_BY_NAME[value.dtype]
            if not value.data:
                return torch.empty(value.shape, dtype=dtype)
            return torch.frombuffer(bytearray(value.data), dtype=dtype).reshape(value.shape)
        if value.dtype == "bfloat16":
            raise StateError("a NumPy array cannot have dtype bfloat16")
        return np.frombuffer(value.data, dtype=np.dtype(value.dtype).newbyteorder("<")).reshape(value.shape).copy()
    return value


def plain_dataset_state(state: DatasetState | None) -> DatasetState | None:
    """A snapshot's state tree with every field converted by :func:`to_plain`."""
    if state is None:
        return None
    return DatasetState(
        type=state.type,
        fields={k: to_plain(v) for k, v in state.fields.items()},
        children=[plain_dataset_state(c) for c in state.children],
    )
