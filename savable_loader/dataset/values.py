"""Values inside dataset states: copy live values at snapshot time, convert to and from
the plain values the state schema can encode.

A value comes back from a state as the same type with the same value, or is refused when
the state is taken (:func:`freeze`), with the field's path. What a state holds, and what
comes back:

* ``None``, ``bool``, ``int`` (64-bit range, checked when encoded), ``float``, ``str``,
  ``bytes``: themselves (exact types only: subclasses such as ``IntEnum`` are refused);
* ``list``, ``tuple`` (as :class:`TupleValue`), ``dict`` with ``str`` / ``int`` keys:
  the same container type (subclasses such as namedtuples and ``OrderedDict`` are
  refused);
* tensors (strided CPU tensors not requiring grad, the dtypes of ``_TORCH_DTYPES``):
  a tensor of the same dtype, shape and values, contiguous;
* NumPy arrays (numeric, bool, complex, ``datetime64`` / ``timedelta64``, fixed-width
  ``U`` / ``S`` strings; either byte order): an array of the same dtype, shape and values,
  C-contiguous and writeable;
* NumPy scalars of those dtypes, ``np.str_`` and ``np.bytes_``: the same scalar type;
* ``array.array`` of the fixed-size typecodes of ``state.schema.ARRAY_TYPECODES`` (``"q"``, ``"d"``,
  ...): an ``array.array`` of the same typecode and values. A big list of numbers held
  this way is snapshot as one copy of its memory, with no work per item (the shuffle
  buffer keeps a stream of ints or floats so);
* RNG objects (only as a whole field): their state, put back into the live generator.

Everything else (``long double``, object and structured dtypes, sets, ``bytearray``,
custom classes) raises :class:`StateError` naming the field.
"""

from __future__ import annotations

import array
import re
import sys
from typing import Any, cast

import numpy as np
import torch

from savable_loader.errors import StateError
from savable_loader.rng.seeding import capture_generator, capture_kind
from savable_loader.state.schema import ARRAY_TYPECODES, ArrayValue, DatasetState, TupleValue

__all__ = ["freeze", "from_plain", "plain_dataset_state", "to_plain"]

_LITTLE = sys.byteorder == "little"

_SCALARS = (type(None), bool, int, float, str, bytes)
_SCALAR_TYPES = frozenset(_SCALARS)


def _all_scalars(values: list[Any] | tuple[Any, ...]) -> bool:
    """True if every item's type is exactly one of ``_SCALARS`` (subclasses such as NumPy
    scalars or ``IntEnum`` take the slow path, which refuses them).

    At C speed, with no Python code per item: about 7 ns an item for a homogeneous list
    (a 100k-entry buffer of ints in 0.7 ms), where a set of the types costs 11 ns.
    """
    if len(values) < _SAMPLED:
        return set(map(type, values)) <= _SCALAR_TYPES
    types = list(map(type, values))
    first = types[0]
    # A homogeneous list (what big buffers are): counting identical entries is a pointer
    # comparison each. A sample tells whether to try it (a count that meets other types
    # compares them the slow way).
    sample = types[:: len(types) // _SAMPLED]
    if first in _SCALAR_TYPES and len(set(sample)) == 1 and types.count(first) == len(types):
        return True
    return set(types) <= _SCALAR_TYPES


#: Lists at least this long are checked by counting (``_all_scalars``); also the size of
#: the sample that decides whether to count.
_SAMPLED = 64


class _Scalars(list[Any]):
    """A frozen list whose items ``freeze`` found to be exact scalars: ``to_plain`` and
    ``from_plain`` copy it without looking at the items again (a snapshot of a big buffer
    checks it once). Never leaves this module's functions: both return plain lists."""

    __slots__ = ()


_TORCH_DTYPES = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
}
_TORCH_BY_NAME = {name: dtype for dtype, name in _TORCH_DTYPES.items()}
# NumPy numeric dtypes a state holds by name (NumPy has no bfloat16; long double's layout
# differs between platforms).
_NUMPY_NUMERIC = frozenset(_TORCH_BY_NAME) - {"bfloat16"}
_TIME_NAME = re.compile(r"(datetime64|timedelta64)(\[\d*[a-zA-Z]+\])?")


def numpy_dtype_code(dtype: np.dtype) -> str | None:
    """The name a state gives a NumPy dtype (``"float32"``, ``"U5"``, ``">int32"``,
    ``"datetime64[ns]"``), or None if a state cannot hold it."""
    if dtype.kind in "biufc":
        name = dtype.name
        if name not in _NUMPY_NUMERIC:
            return None
    elif dtype.kind == "U":
        name = f"U{dtype.itemsize // 4}"
    elif dtype.kind == "S":
        name = f"S{dtype.itemsize}"
    elif dtype.kind in "mM" and _TIME_NAME.fullmatch(dtype.name):
        name = dtype.name
    else:
        return None
    if dtype.itemsize == 0:
        return None
    return ">" + name if dtype.byteorder == ">" else name


def _numpy_dtype(code: str) -> np.dtype:
    """The dtype of the bytes stored under ``code``: little-endian unless ``code`` starts
    with ``">"`` (the codec has validated ``code``)."""
    if code.startswith(">"):
        return np.dtype(code[1:]).newbyteorder(">")
    return np.dtype(code).newbyteorder("<")


def _little_endian_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _where(path: str) -> str:
    return f"state field {path or '<root>'}"


def _refuse(value: Any, path: str) -> StateError:
    """The error for a value a state cannot give back identical, with a hint."""
    cls = type(value)
    what = cls.__qualname__
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        hint = "a namedtuple, it would come back as a plain tuple; convert it (tuple(x) or x._asdict())"
    elif isinstance(value, (bool, int, float, str, bytes, list, tuple, dict)):
        base = next(b for b in (bool, int, float, str, bytes, list, tuple, dict) if isinstance(value, b))
        hint = f"a subclass of {base.__name__}, it would come back as a plain {base.__name__}; convert it"
    elif isinstance(value, bytearray):
        hint = "it would come back as bytes; store bytes(x)"
    elif isinstance(value, array.array):
        hint = (
            f"an array.array of typecode {value.typecode!r}; a state holds typecodes "
            f"{''.join(ARRAY_TYPECODES)} (their size is the same on every platform), of the class array.array"
        )
    elif isinstance(value, np.generic):
        hint = f"NumPy dtype {value.dtype} has no portable layout; convert it"
    elif isinstance(value, np.ndarray):
        hint = (
            f"an array of dtype {value.dtype}, which a state cannot hold"
            if cls is np.ndarray
            else ("a subclass of numpy.ndarray, it would come back as a plain array; convert it (np.asarray)")
        )
    elif capture_kind(value) is not None:
        hint = (
            "an RNG object inside a container; only a field that is itself an RNG object is restored "
            "into the live generator"
        )
    else:
        hint = (
            "allowed: None, bool, int, float, str, bytes, list, tuple, dict, tensors, NumPy arrays "
            "and scalars, and RNG objects as whole fields"
        )
    return StateError(f"{_where(path)} holds a value of type {what}, which a state cannot give back identical ({hint})")


def freeze(value: Any, path: str = "") -> Any:
    """Copy a live value so that later mutation by the iterator cannot change it.

    Containers are copied, tensors and arrays cloned, an RNG object (a whole field)
    captured. Anything a state cannot give back identical is a :class:`StateError`
    naming ``path`` (see the module docstring for what a state holds).
    """
    if capture_kind(value) is not None:
        return capture_generator(value)
    return _freeze(value, path)


def _freeze(value: Any, path: str) -> Any:
    cls = type(value)
    if cls in _SCALAR_TYPES:
        return value
    if cls is list:
        if _all_scalars(value):
            return _Scalars(value)
        return [_freeze(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if cls is tuple:
        if _all_scalars(value):
            return value  # immutable all the way down
        return tuple(_freeze(v, f"{path}[{i}]") for i, v in enumerate(value))
    if cls is dict:
        return {_check_key(k, path): _freeze(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        _check_tensor(value, path)
        return value.detach().clone(memory_format=torch.contiguous_format)
    if cls is np.ndarray:
        if numpy_dtype_code(value.dtype) is None:
            raise StateError(f"{_where(path)} holds an array of dtype {value.dtype}, which a state cannot hold")
        return value.copy()
    if cls is array.array and ARRAY_TYPECODES.get(value.typecode) == value.itemsize:
        # already in its plain form (bytes, immutable): one copy of the memory, which
        # to_plain and the encoding of the snapshot take as it is
        return to_plain(value)
    if isinstance(value, np.generic) and _scalar_code(value) is not None:
        return value  # NumPy scalars are immutable
    raise _refuse(value, path)


def _scalar_code(value: np.generic) -> str | None:
    if type(value) is np.str_:
        return "str"
    if type(value) is np.bytes_:
        return "bytes"
    code = numpy_dtype_code(value.dtype)
    return None if code is None or code[0] in "US>" else code


def _check_tensor(t: torch.Tensor, path: str) -> None:
    problem = None
    if type(t) is not torch.Tensor:
        problem = f"a {type(t).__qualname__} (a subclass of torch.Tensor, it would come back as a plain tensor)"
    elif t.dtype not in _TORCH_DTYPES:
        problem = f"a tensor of dtype {t.dtype}"
    elif t.layout != torch.strided:
        problem = f"a tensor of layout {t.layout} (a state holds strided tensors)"
    elif t.device.type != "cpu":
        problem = f"a tensor on {t.device} (a state holds CPU tensors; move samples to the device after loading)"
    elif t.requires_grad:
        problem = "a tensor that requires grad (it would come back detached; detach it)"
    if problem is not None:
        raise StateError(f"{_where(path)} holds {problem}, which a state cannot give back identical")


def _check_key(key: Any, path: str) -> Any:
    if type(key) is str or type(key) is int:
        return key
    raise StateError(f"{_where(path)} has a dict key {key!r} of type {type(key).__qualname__}: keys must be str or int")


def to_plain(value: Any) -> Any:
    """Turn a frozen value into schema values: tensors, arrays and NumPy scalars become
    ``ArrayValue``, tuples ``TupleValue``."""
    cls = type(value)
    if cls in _SCALAR_TYPES:
        return value
    if cls is _Scalars:
        return value[:]  # a plain list (checked by freeze)
    if cls is list:
        if _all_scalars(value):
            return list(value)
        return [to_plain(v) for v in value]
    if cls is tuple:
        return TupleValue(list(value) if _all_scalars(value) else [to_plain(v) for v in value])
    if cls is dict:
        return {k: to_plain(v) for k, v in value.items()}
    if cls is torch.Tensor:
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
    if cls is ArrayValue or cls is TupleValue:
        return value
    if cls is array.array:
        if ARRAY_TYPECODES.get(value.typecode) != value.itemsize:
            raise StateError(f"a state cannot hold an array.array of typecode {value.typecode!r}")
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            value = value[:]
            value.byteswap()
        return ArrayValue(library="array", dtype=value.typecode, shape=(len(value),), data=value.tobytes())
    if cls is np.ndarray:
        code = numpy_dtype_code(value.dtype)
        if code is None:
            raise StateError(f"a state cannot hold an array of dtype {value.dtype}")
        # big-endian arrays keep their bytes (and come back big-endian); others are stored
        # little-endian and come back in native order
        data = np.ascontiguousarray(value).tobytes() if code[0] == ">" else _little_endian_bytes(value)
        return ArrayValue(library="numpy", dtype=code, shape=value.shape, data=data)
    if isinstance(value, np.generic):
        code = _scalar_code(value)
        if code == "str":
            data = str.encode(cast(str, value), "utf-8", "surrogatepass")  # str() drops trailing NULs
        elif code == "bytes":
            data = bytes(cast(bytes, value))  # np.bytes_ is a bytes
        elif code is not None:
            data = _little_endian_bytes(np.asarray(value))
        else:
            raise StateError(f"a state cannot hold a NumPy scalar of dtype {value.dtype}")
        return ArrayValue(library="numpy-scalar", dtype=code, shape=(), data=data)
    raise StateError(f"a state cannot hold a {cls.__qualname__}")


def from_plain(value: Any) -> Any:
    """Inverse of :func:`to_plain` (values of a state not yet encoded are copied)."""
    cls = type(value)
    if cls is _Scalars:  # a frozen state not yet converted
        return value[:]
    if cls is list:
        if _all_scalars(value):
            return list(value)
        return [from_plain(v) for v in value]
    if cls is dict:
        return {k: from_plain(v) for k, v in value.items()}
    if cls is TupleValue:
        items = value.items
        return tuple(items) if _all_scalars(items) else tuple(from_plain(v) for v in items)
    if cls is tuple:  # a frozen state not yet converted
        return value if _all_scalars(value) else tuple(from_plain(v) for v in value)
    if isinstance(value, torch.Tensor):  # a state not yet encoded: never alias its arrays
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if cls is array.array:  # a frozen state not yet converted
        return value[:]
    if cls is ArrayValue:
        return _from_array_value(value)
    return value


def _from_array_value(value: ArrayValue) -> Any:
    if value.library == "array":  # the codec has checked typecode, shape and length
        back = array.array(value.dtype)
        back.frombytes(value.data)
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            back.byteswap()
        return back
    if value.library == "torch":
        torch_dtype = _TORCH_BY_NAME[value.dtype]
        if not value.data:
            return torch.empty(value.shape, dtype=torch_dtype)
        return torch.frombuffer(bytearray(value.data), dtype=torch_dtype).reshape(value.shape)
    if value.library == "numpy-scalar":
        if value.dtype == "str":
            return np.str_(value.data.decode("utf-8", "surrogatepass"))
        if value.dtype == "bytes":
            return np.bytes_(value.data)
        return np.frombuffer(value.data, dtype=_numpy_dtype(value.dtype))[0]  # a native scalar
    if value.dtype == "bfloat16":
        raise StateError("a NumPy array cannot have dtype bfloat16")
    dtype: Any = _numpy_dtype(value.dtype)
    data = np.frombuffer(value.data, dtype=dtype).reshape(value.shape)
    if value.dtype[0] != ">" and not dtype.isnative:
        return data.astype(dtype.newbyteorder("="))  # pragma: no cover - big-endian hosts
    return data.copy()


def plain_dataset_state(state: DatasetState | None) -> DatasetState | None:
    """A snapshot's state tree with every field converted by :func:`to_plain`."""
    return None if state is None else _plain_tree(state)


def _plain_tree(state: DatasetState) -> DatasetState:
    return DatasetState(
        type=state.type,
        fields={k: to_plain(v) for k, v in state.fields.items()},
        children=[_plain_tree(c) for c in state.children],
    )
