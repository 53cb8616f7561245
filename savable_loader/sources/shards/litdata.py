"""LitData chunks (``litdata.optimize`` / ``BinaryWriter`` output), read-only, from the
folder's own ``index.json``.

``index.json`` (``{"chunks": [...], "config": {...}}``) lists the chunk files
(``filename``, ``chunk_size`` samples, ``chunk_bytes``) and how samples were flattened:
``data_format`` (one serializer name per leaf) and ``data_spec`` (the pytree structure,
torch's JSON tree-spec format). A chunk is ``uint32 n``, ``uint32 offsets[n + 1]``, then
the samples; a sample is a ``uint32`` size per leaf, then the leaves' bytes.

Leaves: ``int``, ``float``, ``bool``, ``str``, ``text``, ``bytes``, ``file[:ext]`` (bytes),
``numpy``, ``no_header_numpy:K``, ``tensor``, ``no_header_tensor:K`` (as LitData decodes
them, tensors and arrays as fresh copies), ``json`` (lists and dicts LitData stores as
one leaf, in its tagged binary layout or as JSON text), ``pil`` and ``jpeg`` / ``image:*`` (as
``PIL.Image`` objects; needs Pillow; LitData itself decodes the latter to tensors with
torchvision). Structures: dicts, lists, tuples, ``OrderedDict``. Newer LitData writers
store text and nested dict samples as a trailing Arrow IPC table instead (the chunk
ends with ``LDARW01\\0``): those rows are read with pyarrow (the ``parquet`` extra).
Refused with a named error: compressed or encrypted chunks, other item loaders
(``TokensLoader``), ``pickle`` and the other leaf kinds.
"""

from __future__ import annotations

import collections
import copy
import io
import json
import struct
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from savable_loader.errors import DataError
from savable_loader.sources.shards.manifest import ShardEntry, check_path
from savable_loader.sources.shards.parquet import require_pyarrow
from savable_loader.sources.shards.reader import ReadOptions, ShardReader
from savable_loader.sources.shards.store import ShardFile, ShardStore, byte_getter

__all__ = ["LitDataReader", "entries_from_index"]

_NUMPY = [
    np.dtype(t)
    for t in (
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        np.bool_,
    )
]
_TORCH = {
    0: torch.float32,
    1: torch.float32,
    2: torch.float64,
    3: torch.float64,
    4: torch.complex64,
    5: torch.complex64,
    6: torch.complex128,
    7: torch.complex128,
    8: torch.float16,
    9: torch.float16,
    10: torch.bfloat16,
    11: torch.uint8,
    12: torch.int8,
    13: torch.int16,
    14: torch.int16,
    15: torch.int32,
    16: torch.int32,
    17: torch.int64,
    18: torch.int64,
    19: torch.bool,
    20: torch.uint16,
}
_ARROW_MAGIC = b"LDARW01\0"  # a chunk whose rows follow as an Arrow IPC table ends with it
_CONTAINERS = ("builtins.dict", "builtins.list", "builtins.tuple", "collections.OrderedDict")


class _Chunk(msgspec.Struct):
    filename: str
    chunk_size: Annotated[int, msgspec.Meta(ge=0)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _Config(msgspec.Struct):
    data_format: list[str]
    data_spec: str | None = None
    compression: str | None = None
    encryption: Any = None
    item_loader: str = "PyTreeLoader"
    ipc_compression: str | None = None


class _Index(msgspec.Struct):
    chunks: list[_Chunk]
    config: _Config


def entries_from_index(doc: Any, where: str) -> list[ShardEntry]:
    """Manifest entries of a LitData ``index.json`` (decoded JSON ``doc``)."""
    try:
        index = msgspec.convert(doc, _Index)
    except msgspec.ValidationError as e:
        raise DataError(f"{where}: not a LitData index: {e}") from None
    config = index.config
    if config.item_loader != "PyTreeLoader":
        raise DataError(
            f"{where}: `$.config.item_loader` is {config.item_loader!r}; savable_loader reads "
            "LitData chunks written with the default PyTreeLoader only"
        )
    if config.compression or config.encryption or config.ipc_compression:
        raise DataError(
            f"{where}: the chunks are compressed or encrypted; savable_loader reads plain LitData "
            "chunks only (optimize without compression=)"
        )
    for leaf in config.data_format:
        _leaf_decoder(leaf, where)  # refuses unknown leaves now, not in a worker
    _unflattener(config.data_spec, len(config.data_format), where)
    entries = []
    for i, chunk in enumerate(index.chunks):
        check_path(chunk.filename, f"{where}: `$.chunks[{i}].filename`")
        entries.append(
            ShardEntry(
                path=chunk.filename,
                samples=chunk.chunk_size,
                format="litdata",
                size=chunk.chunk_bytes,
                options={"data_format": config.data_format, "data_spec": config.data_spec},
            )
        )
    return entries


def _pil_image() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise DataError("decoding LitData image leaves needs Pillow (pip install pillow)") from None
    return Image


def _image(data: bytes) -> Any:
    return _pil_image().open(io.BytesIO(data))


def _pil(data: bytes) -> Any:
    width, height, mode_size = struct.unpack_from("<III", data, 0)
    mode = data[12 : 12 + mode_size].decode("utf-8")
    return _pil_image().frombytes(mode, (width, height), data[12 + mode_size :])


def _numpy(data: bytes) -> np.ndarray:
    kind, ndim = struct.unpack_from("<II", data, 0)
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    return np.frombuffer(data, _NUMPY[kind], offset=8 + 4 * ndim).copy().reshape(shape)


def _tensor(data: bytes) -> torch.Tensor:
    kind, rank = struct.unpack_from(">II", data, 0)
    shape = struct.unpack_from(f">{rank}I", data, 8)
    body = bytearray(data[8 + 4 * rank :])
    if not body:
        return torch.empty(shape, dtype=_TORCH[kind])
    return torch.frombuffer(body, dtype=_TORCH[kind]).reshape(shape)


_U32 = struct.Struct("<I")


def _utf8(raw: bytes, at: int) -> tuple[str, int]:
    n = _U32.unpack_from(raw, at)[0]
    return raw[at + 4 : at + 4 + n].decode("utf-8"), at + 4 + n


def _record_value(raw: bytes, at: int) -> tuple[Any, int]:
    kind = raw[at]
    at += 1
    if kind == 0x10:
        return None, at
    if kind == 0x11:
        return _utf8(raw, at)
    if kind == 0x12:
        return struct.unpack_from("<q", raw, at)[0], at + 8
    if kind == 0x13:
        return struct.unpack_from("<d", raw, at)[0], at + 8
    if kind == 0x14:
        return raw[at] != 0, at + 1
    raise ValueError(f"unknown record value tag {kind}")


def _nested(raw: bytes, at: int) -> tuple[Any, int]:
    """One value of LitData's ``json`` leaf encoding: a tag byte, then the value."""
    tag = raw[at]
    if tag == 0:  # JSON text
        n = _U32.unpack_from(raw, at + 1)[0]
        return json.loads(raw[at + 5 : at + 5 + n]), at + 5 + n
    if tag in (1, 2, 3, 4, 5, 6):  # lists of str / int64 / float64 / bool, a dict, records
        n = _U32.unpack_from(raw, at + 1)[0]
        at += 5
        if tag == 1:
            out = []
            for _ in range(n):
                text, at = _utf8(raw, at)
                out.append(text)
            return out, at
        if tag in (2, 3):
            return np.frombuffer(raw, "<i8" if tag == 2 else "<f8", n, at).tolist(), at + 8 * n
        if tag == 4:
            return [b != 0 for b in raw[at : at + n]], at + n
        if tag == 5:
            mapping = {}
            for _ in range(n):
                key, at = _utf8(raw, at)
                mapping[key], at = _nested(raw, at)
            return mapping, at
        keys = []
        count = _U32.unpack_from(raw, at)[0]
        at += 4
        for _ in range(count):
            key, at = _utf8(raw, at)
            keys.append(key)
        rows = []
        for _ in range(n):
            row = {}
            for key in keys:
                row[key], at = _record_value(raw, at)
            rows.append(row)
        return rows, at
    if tag == 7:
        return _utf8(raw, at + 1)
    if tag == 8:
        return struct.unpack_from("<q", raw, at + 1)[0], at + 9
    if tag == 9:
        return struct.unpack_from("<d", raw, at + 1)[0], at + 9
    if tag == 10:
        return raw[at + 1] != 0, at + 2
    if tag == 11:
        return None, at + 1
    raise ValueError(f"unknown nested value tag {tag}")


def _json_leaf(data: bytes) -> Any:
    if not data or data[0] > 0x20:  # plain JSON text (older writers)
        return json.loads(data)
    return _nested(data, 0)[0]


def _leaf_decoder(leaf: str, where: str) -> Callable[[bytes], Any]:
    name, _, arg = leaf.partition(":")
    simple: dict[str, Callable[[bytes], Any]] = {
        "int": lambda data: struct.unpack("<q", data)[0],
        "float": lambda data: struct.unpack("<d", data)[0],
        "bool": lambda data: data[0] != 0,
        "str": lambda data: data.decode("utf-8"),
        "text": lambda data: data.decode("utf-8"),
        "bytes": bytes,
        "file": bytes,
        "numpy": _numpy,
        "tensor": _tensor,
        "pil": _pil,
        "jpeg": _image,
        "image": _image,
        "json": _json_leaf,
    }
    try:
        if name == "no_header_numpy":
            dtype = _NUMPY[int(arg)]
            return lambda data: np.frombuffer(data, dtype).copy()
        if name == "no_header_tensor":
            torch_dtype = _TORCH[int(arg)]
            return lambda data: (
                torch.frombuffer(bytearray(data), dtype=torch_dtype) if data else torch.empty((0,), dtype=torch_dtype)
            )
    except (ValueError, IndexError, KeyError):
        raise DataError(f"{where}: unknown LitData leaf format {leaf!r}") from None
    if name in simple:
        return simple[name]
    reason = " (a pickle: loading one can run code)" if name == "pickle" else ""
    raise DataError(f"{where}: LitData leaves of format {leaf!r} are not supported{reason}")


def _unflattener(spec_text: str | None, leaves: int, where: str) -> Callable[[list[Any]], Any]:
    """A function rebuilding a sample from its leaves, from LitData's ``data_spec``."""
    if spec_text is None:
        if leaves != 1:
            raise DataError(f"{where}: `$.config.data_spec` is missing for {leaves} leaves")
        return lambda values: values[0]
    try:
        protocol, spec = json.loads(spec_text)
    except (ValueError, TypeError):
        raise DataError(f"{where}: `$.config.data_spec` is not a tree spec") from None
    if protocol != 1:
        raise DataError(f"{where}: `$.config.data_spec` uses tree-spec protocol {protocol!r}; this reader knows 1")

    def build(node: Any) -> tuple[Callable[[list[Any], int], tuple[Any, int]], int]:
        kind, children = node.get("type"), node.get("children_spec", [])
        if kind is None:
            return (lambda values, at: (values[at], at + 1)), 1
        if kind not in _CONTAINERS:
            raise DataError(f"{where}: `$.config.data_spec` holds a {kind!r}; this reader knows {_CONTAINERS}")
        parts = [build(child) for child in children]
        keys = json.loads(node["context"]) if kind in ("builtins.dict", "collections.OrderedDict") else None

        def rebuild(values: list[Any], at: int) -> tuple[Any, int]:
            items = []
            for part, _ in parts:
                item, at = part(values, at)
                items.append(item)
            if keys is not None:
                made = dict(zip(keys, items))
                return (collections.OrderedDict(made) if kind == "collections.OrderedDict" else made), at
            return (tuple(items) if kind == "builtins.tuple" else items), at

        return rebuild, sum(n for _, n in parts)

    rebuild, count = build(spec)
    if count != leaves:
        raise DataError(f"{where}: `$.config.data_spec` has {count} leaves, `data_format` {leaves}")
    return lambda values: rebuild(values, 0)[0]


class LitDataReader(ShardReader):
    """Samples of one LitData chunk: one read per sample."""

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        where = file.name
        opts = entry.options or {}
        self.leaves = [_leaf_decoder(leaf, where) for leaf in opts["data_format"]]
        self.unflatten = _unflattener(opts.get("data_spec"), len(self.leaves), where)
        self._get, self._held = byte_getter(file)
        if file.size < 4:
            raise DataError(f"{where}: {file.size} bytes, too short for a LitData chunk")
        n = struct.unpack("<I", self._get(0, 4))[0]
        header = 4 * (n + 2)
        if file.size < header:
            raise DataError(
                f"{where}: truncated: {n} samples need a header of {header} bytes, the file has {file.size}"
            )
        offsets = np.frombuffer(self._get(4, 4 * (n + 1)), "<u4").astype(np.int64)
        self.rows: list[Any] | None = None
        if file.size >= header + 12 and self._get(file.size - 8, 8) == _ARROW_MAGIC:
            self.rows = self._arrow_rows(n, header)
        if n and (bool(np.any(offsets[1:] < offsets[:-1])) or int(offsets[0]) < header):
            raise DataError(f"{where}: the sample offsets of the header do not grow; not a LitData chunk")
        if int(offsets[-1]) > file.size:
            raise DataError(f"{where}: truncated: the samples end at byte {int(offsets[-1])}, the file has {file.size}")
        self.offsets = offsets.tolist()
        self.sizes = struct.Struct(f"<{len(self.leaves)}I")

    def _arrow_rows(self, n: int, header: int) -> list[Any]:
        """The rows of a chunk whose samples are stored in a trailing Arrow IPC table."""
        require_pyarrow(self.file.name)
        import pyarrow as pa  # type: ignore[import-untyped]

        size = self.file.size
        length = struct.unpack("<I", self._get(size - 12, 4))[0]
        start = size - 12 - length
        if length <= 0 or start < header:
            raise DataError(f"{self.file.name}: malformed Arrow footer (length {length})")
        blob = pa.py_buffer(self._get(start, length))
        try:
            reader = pa.ipc.open_file(blob) if blob.to_pybytes()[:6] == b"ARROW1" else pa.ipc.open_stream(blob)
            rows = reader.read_all().to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow's errors
            raise DataError(f"{self.file.name}: cannot read the Arrow footer ({type(e).__name__}: {e})") from None
        if len(rows) != n:
            raise DataError(f"{self.file.name}: the Arrow footer holds {len(rows)} rows, the header says {n}")
        return rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def read(self, i: int) -> Any:
        if self.rows is not None:
            return self.project(copy.deepcopy(self.rows[i]))
        start, stop = self.offsets[i], self.offsets[i + 1]
        data = self._get(start, stop - start)
        try:
            sizes = self.sizes.unpack_from(data, 0)
            at = self.sizes.size
            values = []
            for size, decode in zip(sizes, self.leaves):
                if at + size > len(data):
                    raise DataError(f"{self.file.name}: sample {i} (bytes [{start}, {stop})) is too short")
                values.append(decode(data[at : at + size]))
                at += size
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - malformed sample bytes
            raise DataError(f"{self.file.name}: cannot decode sample {i} ({type(e).__name__}: {e})") from None
        return self.project(self.unflatten(values))

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        super().close()
