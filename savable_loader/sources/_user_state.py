"""A dataset's own ``state_dict()`` as values a savable_loader state can hold, and back.

torchdata's ``Stateful`` protocol lets ``state_dict()`` return any Python object; a
savable_loader state holds plain values only (never a pickle). :func:`to_state_tree`
converts what can be carried **exactly** and refuses the rest with a
:class:`~savable_loader.errors.StateError` naming the path of the value;
:func:`from_state_tree` gives back equal values of the same types, so that
``load_state_dict`` receives what ``state_dict`` returned.

Carried as they are: None, bool, int (64-bit), float, str, bytes, lists, dicts with str
or int keys, tensors and NumPy arrays (the loader's state encoding stores them). Carried
through a tagged dict ``{"__savable_loader__": kind, "value": ...}``: tuples (e.g.
``random.getstate()``), ints beyond 64 bits (NumPy PCG64 states), NumPy scalars,
bytearrays, and dicts that themselves use the tag key.

Example::

    tree = to_state_tree({"rng": random.Random(1).getstate(), "pos": 3}, "MyStream.state_dict()")
    from_state_tree(tree) == {"rng": random.Random(1).getstate(), "pos": 3}   # True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from savable_loader.errors import StateError

__all__ = ["TAG", "from_state_tree", "to_state_tree"]

#: The key of a tagged dict.
TAG = "__savable_loader__"

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_PLAIN = (type(None), bool, float, str, bytes)


def _tagged(kind: str, value: Any) -> dict[str, Any]:
    return {TAG: kind, "value": value}


def to_state_tree(value: Any, path: str) -> Any:
    """``value`` as plain values (see the module docstring); :class:`StateError` naming
    ``path`` (e.g. ``"MyStream.state_dict()['rng'][1]"``) for what cannot be held."""
    if isinstance(value, np.generic):  # before _PLAIN: np.float64 subclasses float
        if value.dtype.kind not in "biufc":
            raise _refuse(value, path)
        return _tagged("numpy-scalar", np.asarray(value))
    if isinstance(value, int) and not isinstance(value, bool):
        if type(value) is not int:  # IntEnum and other int subclasses would come back as int
            raise _refuse(value, path)
        return value if _INT_MIN <= value <= _INT_MAX else _tagged("int", str(value))
    if type(value) in _PLAIN:
        return value
    if type(value) is list:
        return [to_state_tree(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return _tagged("tuple", [to_state_tree(v, f"{path}[{i}]") for i, v in enumerate(value)])
    if type(value) is dict:
        out = {}
        for k, v in value.items():
            if not (type(k) is str or type(k) is int):
                raise StateError(
                    f"{path} has the dict key {k!r} ({type(k).__qualname__}): a state holds dicts with str or int keys"
                )
            out[k] = to_state_tree(v, f"{path}[{k!r}]")
        return _tagged("dict", out) if TAG in out else out
    if type(value) is bytearray:
        return _tagged("bytearray", bytes(value))
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        return value.detach().clone()
    if type(value) is np.ndarray:
        return value.copy()
    raise _refuse(value, path)


def _refuse(value: Any, path: str) -> StateError:
    return StateError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which a savable_loader state cannot "
        "hold exactly (it holds None, bool, int, float, str, bytes, lists, tuples, dicts with str or int keys, "
        "tensors, NumPy arrays and NumPy scalars; never a pickle)"
    )


def from_state_tree(value: Any) -> Any:
    """The values :func:`to_state_tree` was given, from its result (after a trip through
    the state encoding: tensors and arrays come back as copies)."""
    if isinstance(value, list):
        return [from_state_tree(v) for v in value]
    if isinstance(value, dict):
        kind = value.get(TAG)
        if kind is None:
            return {k: from_state_tree(v) for k, v in value.items()}
        inner = value.get("value")
        if kind == "tuple" and isinstance(inner, list):
            return tuple(from_state_tree(v) for v in inner)
        if kind == "dict" and isinstance(inner, dict):
            return {k: from_state_tree(v) for k, v in inner.items()}
        if kind == "int" and isinstance(inner, str):
            return int(inner)
        if kind == "numpy-scalar" and isinstance(inner, np.ndarray) and inner.ndim == 0:
            return inner[()]
        if kind == "bytearray" and isinstance(inner, bytes):
            return bytearray(inner)
        raise StateError(f"malformed tagged value in a dataset's state_dict: {kind!r} holding {type(inner).__name__}")
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value
