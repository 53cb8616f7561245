"""Encoding of states to MessagePack bytes and back (msgspec; never pickle).

``encode`` takes a :class:`RankState`, a :class:`GlobalState` or a list of rank states
(the gathered form); ``decode`` returns a ``RankState`` or a ``list[RankState]``. Any
malformed, truncated or foreign input raises :class:`StateError`; a state written by a
newer schema raises :class:`StateVersionError`.

Example::

    data = encode(loader.save_state_rank())
    state = decode(data)
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from savable_loader._version import __version__
from savable_loader.errors import StateError, StateVersionError
from savable_loader.state.schema import (
    ARRAY_TYPECODES,
    SCHEMA_VERSION,
    ArrayValue,
    DatasetState,
    GlobalState,
    RankState,
    TupleValue,
)

__all__ = ["decode", "decode_part", "encode", "encode_part"]

_EXT_ARRAY = 1
_EXT_TUPLE = 2
# dtypes an ArrayValue may carry, with their item sizes. Anything else is refused on
# decode so that a state can never name an arbitrary type.
_DTYPE_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
_TIME_UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")
# NumPy-only dtypes: fixed-width strings and dates/durations (a multiple of a unit)
_NUMPY_DTYPE = re.compile(r"(U|S)([1-9][0-9]{0,9})|(datetime64|timedelta64)(?:\[([1-9][0-9]{0,9})?([a-zA-Z]{1,2})\])?")
_MAX_ITEMSIZE = (1 << 31) - 1  # NumPy's limit for U / S, and for a time unit's multiplier
_MAX_NDIM = 32
_LIBRARIES = ("torch", "numpy", "numpy-scalar", "array")

_TopLevel = RankState | GlobalState


class _Peek(msgspec.Struct):
    """Only the fields needed to choose how to decode the rest."""

    schema_version: int = 0
    kind: str = ""


def _itemsize(library: str, dtype: str) -> int | None:
    """The item size of ``dtype`` in ``library`` (None: any length, for the NumPy scalars
    ``"str"`` and ``"bytes"``); ValueError if an ArrayValue cannot carry it."""
    if library == "numpy-scalar" and dtype in ("str", "bytes"):
        return None
    if library == "array":
        if dtype not in ARRAY_TYPECODES:
            raise ValueError(f"array.array typecode must be one of {''.join(ARRAY_TYPECODES)}, got {dtype!r}")
        return ARRAY_TYPECODES[dtype]
    name = dtype
    if library != "torch" and name.startswith(">"):
        name = name[1:]  # big-endian NumPy data
        if library == "numpy-scalar" or name in ("bool", "int8", "uint8") or name.startswith("S"):
            raise ValueError(f"array dtype {dtype!r} cannot be big-endian")
    if name in _DTYPE_SIZES and not (library != "torch" and name == "bfloat16"):
        return _DTYPE_SIZES[name]
    match = _NUMPY_DTYPE.fullmatch(name) if library != "torch" else None
    if match is not None:
        kind, width, _, multiple, unit = match.groups()
        if kind is not None and library == "numpy":
            size = int(width) * (4 if kind == "U" else 1)
            if size <= _MAX_ITEMSIZE:
                return size
        elif kind is None and (unit is None or (unit in _TIME_UNITS and int(multiple or 1) <= _MAX_ITEMSIZE)):
            return 8
    raise ValueError(f"array dtype {dtype!r} is not valid for library {library!r}")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, ArrayValue):
        header = msgspec.msgpack.encode((obj.library, obj.dtype, list(obj.shape), obj.data))
        return msgspec.msgpack.Ext(_EXT_ARRAY, header)
    if isinstance(obj, TupleValue):
        return msgspec.msgpack.Ext(_EXT_TUPLE, msgspec.msgpack.encode(obj.items, enc_hook=_enc_hook))
    raise NotImplementedError(
        f"a state value of type {type(obj).__qualname__} cannot be encoded: states hold "
        "None, bool, int, float, str, bytes, lists, dicts, arrays and tuples only"
    )


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_TUPLE:
        return TupleValue(msgspec.msgpack.decode(data, type=list, ext_hook=_ext_hook))
    if code != _EXT_ARRAY:
        raise ValueError(f"unknown MessagePack extension code {code}")
    library, dtype, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, str, list[int], bytes])
    if library not in _LIBRARIES:
        raise ValueError(f"array library must be one of {list(_LIBRARIES)}, got {library!r}")
    size = _itemsize(library, dtype)
    if (
        len(shape) > _MAX_NDIM
        or any(d < 0 for d in shape)
        or (library == "numpy-scalar" and shape)
        or (library == "array" and len(shape) != 1)
    ):
        raise ValueError(f"invalid array shape {shape} for library {library!r}")
    if size is None:
        if dtype == "str":
            raw.decode("utf-8", "surrogatepass")  # UnicodeDecodeError is a ValueError
    elif math.prod(shape) * size != len(raw):
        expected = math.prod(shape) * size
        raise ValueError(f"array of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(raw)}")
    return ArrayValue(library=library, dtype=dtype, shape=tuple(shape), data=raw)


class _Malformed:
    """An extension value that failed to decode, in place (see :func:`_where_malformed`)."""

    __slots__ = ()


def _lenient_ext_hook(code: int, data: memoryview) -> Any:
    try:
        return _ext_hook(code, data)
    except (msgspec.DecodeError, ValueError, TypeError):
        return _Malformed()


def _where_malformed(data: bytes | bytearray | memoryview, type: Any) -> str:
    """`` at <path>`` of the first malformed extension value (an array, a tuple) in
    ``data``, named as :func:`_locate` names a field (``""``: none found, or the rest of
    ``data`` is malformed too)."""
    try:
        obj = msgspec.msgpack.decode(data, type=type, ext_hook=_lenient_ext_hook)
        where = _find_malformed(obj, "")
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return ""
    return "" if where is None else f" at {where}"


def _find_malformed(value: Any, path: str, node: str = "") -> str | None:
    if isinstance(value, _Malformed):
        return path or "<root>"
    found: str | None = None
    if isinstance(value, DatasetState):
        node = node or path
        owner = value.type.rsplit(".", 1)[-1]
        for name, field in value.fields.items():
            found = found or _find_malformed(field, f"{node}: {owner}.{name}" if node else f"{owner}.{name}")
        for child in value.children:
            found = found or _find_malformed(child, path, node)
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            found = found or _find_malformed(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            found = found or _find_malformed(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, TupleValue)):
        items = value.items if isinstance(value, TupleValue) else value
        for i, item in enumerate(items):
            found = found or _find_malformed(item, f"{path}[{i}]")
    return found


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_peek_decoder = msgspec.msgpack.Decoder(_Peek, ext_hook=lambda code, data: None)
_decoder = msgspec.msgpack.Decoder(_TopLevel, ext_hook=_ext_hook)


_ENCODE_ERRORS = (NotImplementedError, TypeError, OverflowError, ValueError, UnicodeEncodeError)


def _encodes(value: Any) -> bool:
    try:
        _encoder.encode(value)
    except _ENCODE_ERRORS:
        return False
    return True


def _locate(value: Any, path: str, node: str = "") -> str:
    """The path of a value inside ``value`` that cannot be encoded (``value`` cannot).

    Inside a dataset state the path is the field's, as ``freeze`` names it
    (``ShuffleBufferDataset.buffer[3]``), after ``node``, the path of the state tree.
    """
    if isinstance(value, DatasetState):
        node = node or path
        owner = value.type.rsplit(".", 1)[-1]
        for name, field in value.fields.items():
            if not _encodes(field):
                return _locate(field, f"{node}: {owner}.{name}" if node else f"{owner}.{name}")
        for child in value.children:
            if not _encodes(child):
                return _locate(child, path, node)
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            field = getattr(value, name)
            if not _encodes(field):
                return _locate(field, f"{path}.{name}" if path else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not _encodes(key):
                return f"{path} (dict key {key!r})"
            if not _encodes(item):
                return _locate(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple, TupleValue)):
        items = value.items if isinstance(value, TupleValue) else value
        for i, item in enumerate(items):
            if not _encodes(item):
                return _locate(item, f"{path}[{i}]")
    return path or "<root>"


def _encode_error(obj: Any, error: Exception) -> StateError:
    """The StateError for ``obj`` failing to encode, naming the value's path."""
    try:
        where = _locate(obj, "")
    except RecursionError:  # pragma: no cover - nested deeper than the encoder allows
        where = "<too deep to locate>"
    value = ""
    if type(error) is OverflowError or "out of range" in str(error).lower():
        value = " (integers in a state must be within [-2**63, 2**64))"
    return StateError(f"state cannot be encoded: {error} at {where}{value}")


def encode(obj: RankState | GlobalState | list[RankState]) -> bytes:
    """Encode a rank state or the gathered states of all ranks to MessagePack bytes.

    Example::

        data = encode(loader.save_state_rank())
        data = encode(loader.save_state_global(0))   # on rank 0: all ranks
    """
    if isinstance(obj, (list, tuple)):
        if not all(isinstance(s, RankState) for s in obj):
            kinds = sorted({type(s).__name__ for s in obj})
            raise StateError(f"a gathered state must be a list of RankState, got items of type {kinds}")
        obj = GlobalState(ranks=list(obj), library_version=__version__)
    if not isinstance(obj, (RankState, GlobalState)):
        raise StateError(f"can only encode a RankState or a list of them, got {type(obj).__qualname__}")
    try:
        return _encoder.encode(obj)
    except _ENCODE_ERRORS as e:
        raise _encode_error(obj, e) from e


def decode(data: bytes | bytearray | memoryview) -> RankState | list[RankState]:
    """Decode bytes made by :func:`encode`. Raises :class:`StateError` on any bad input.

    Example::

        state = decode(data)   # a RankState, or a list[RankState] for a gathered state
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise StateError(f"decode needs bytes, got {type(data).__qualname__}")
    try:
        peek = _peek_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:
        raise StateError(f"not a savable_loader state: {e}") from e
    if peek.kind not in ("rank", "global"):
        raise StateError(f"not a savable_loader state: 'kind' is {peek.kind!r}, expected 'rank' or 'global'")
    if peek.schema_version > SCHEMA_VERSION:
        raise StateVersionError(
            f"the state has schema version {peek.schema_version}, but this savable-loader "
            f"({__version__}) reads versions up to {SCHEMA_VERSION}: upgrade savable-loader"
        )
    try:
        obj = _decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:
        raise StateError(f"malformed savable_loader state: {e}{_where_malformed(data, _TopLevel)}") from e
    if isinstance(obj, GlobalState):
        for i, rank in enumerate(obj.ranks):
            if rank.schema_version > SCHEMA_VERSION:
                raise StateVersionError(
                    f"rank {i} of the gathered state has schema version {rank.schema_version}, but this "
                    f"savable-loader ({__version__}) reads versions up to {SCHEMA_VERSION}: upgrade savable-loader"
                )
        return list(obj.ranks)
    return obj  # type: ignore[no-any-return]


def encode_part(obj: Any) -> bytes:
    """Encode one part of a state (for example a ``WorkerState``) on its own."""
    try:
        return _encoder.encode(obj)
    except _ENCODE_ERRORS as e:
        raise _encode_error(obj, e) from e


def decode_part(data: bytes | memoryview, type: Any) -> Any:
    """Decode bytes from :func:`encode_part` as ``type``; :class:`StateError` on bad input."""
    try:
        return msgspec.msgpack.decode(data, type=type, ext_hook=_ext_hook)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:
        raise StateError(f"malformed state part: {e}{_where_malformed(data, type)}") from e
