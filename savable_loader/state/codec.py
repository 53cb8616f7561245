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
from typing import Any

import msgspec

from savable_loader._version import __version__
from savable_loader.errors import StateError, StateVersionError
from savable_loader.state.schema import SCHEMA_VERSION, ArrayValue, GlobalState, RankState

__all__ = ["decode", "decode_part", "encode", "encode_part"]

_EXT_ARRAY = 1
# dtypes an ArrayValue may carry, with their item sizes. Anything else is refused on
# decode so that a state can never name an arbitrary type.
_DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
}
_MAX_NDIM = 32

_TopLevel = RankState | GlobalState


class _Peek(msgspec.Struct):
    """Only the fields needed to choose how to decode the rest."""

    schema_version: int = 0
    kind: str = ""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, ArrayValue):
        header = msgspec.msgpack.encode((obj.library, obj.dtype, list(obj.shape), obj.data))
        return msgspec.msgpack.Ext(_EXT_ARRAY, header)
    raise NotImplementedError(
        f"a state value of type {type(obj).__qualname__} cannot be encoded: states hold "
        "None, bool, int, float, str, bytes, lists, dicts and arrays only"
    )


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _EXT_ARRAY:
        raise ValueError(f"unknown MessagePack extension code {code}")
    library, dtype, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, str, list[int], bytes])
    if library not in ("torch", "numpy"):
        raise ValueError(f"array library must be 'torch' or 'numpy', got {library!r}")
    if dtype not in _DTYPE_SIZES:
        raise ValueError(f"array dtype {dtype!r} is not one of {sorted(_DTYPE_SIZES)}")
    if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"invalid array shape {shape}")
    expected = math.prod(shape) * _DTYPE_SIZES[dtype]
    if expected != len(raw):
        raise ValueError(f"array of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(raw)}")
    return ArrayValue(library=library, dtype=dtype, shape=tuple(shape), data=raw)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_peek_decoder = msgspec.msgpack.Decoder(_Peek, ext_hook=lambda code, data: None)
_decoder = msgspec.msgpack.Decoder(_TopLevel, ext_hook=_ext_hook)


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
    except (NotImplementedError, TypeError, OverflowError, ValueError) as e:
        raise StateError(f"state cannot be encoded: {e}") from e


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
        raise StateError(f"malformed savable_loader state: {e}") from e
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
    except (NotImplementedError, TypeError, OverflowError, ValueError) as e:
        raise StateError(f"state cannot be encoded: {e}") from e


def decode_part(data: bytes | memoryview, type: Any) -> Any:
    """Decode bytes from :func:`encode_part` as ``type``; :class:`StateError` on bad input."""
    try:
        return msgspec.msgpack.decode(data, type=type, ext_hook=_ext_hook)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:
        raise StateError(f"malformed state part: {e}") from e
