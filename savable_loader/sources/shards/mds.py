"""MosaicML Streaming (MDS) shards, read-only, from the folder's own ``index.json``.

``index.json`` (``{"version": 2, "shards": [...]}``) lists the shards with their columns
(``column_names``, ``column_encodings``, ``column_sizes``), sample counts and sizes;
:func:`entries_from_index` turns it into manifest entries (``options`` keeps the column
settings). A ``.mds`` shard is ``uint32 n``, ``uint32 offsets[n + 1]`` (absolute byte
offsets of the samples), the writer's JSON settings, then the samples; a sample is a
``uint32`` size for every variable-size column, then each column's bytes. All integers
little-endian.

A sample is a dict of the columns, decoded as MosaicML Streaming decodes them: ``int``
as a Python int; ``int8`` ... ``float64`` as NumPy scalars; ``str``, ``bytes``, ``json``,
``str_int``, ``str_float``, ``str_decimal``; ``ndarray[:dtype[:shape]]`` as a (writable)
NumPy array; images (``pil``, ``jpeg``, ``png``, their ``list[...]`` forms and
``jpeg_array``) as ``PIL.Image`` objects (needs Pillow). ``pkl`` columns are refused
(unpickling can run code): leave them out with ``columns=``. Compressed shards
(``compression`` set in ``index.json``) are refused too.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Annotated, Any

import msgspec
import numpy as np

from savable_loader.errors import DataError
from savable_loader.sources.shards.manifest import ShardEntry, check_path
from savable_loader.sources.shards.reader import ReadOptions, ShardReader
from savable_loader.sources.shards.store import ShardFile, ShardStore, byte_getter

__all__ = ["MdsReader", "entries_from_index"]

_SCALARS = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
_ARRAY_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
_IMAGES = ("pil", "jpeg", "png", "list[pil]", "list[jpeg]", "list[png]", "jpeg_array", "jpegarray")
_OTHERS = ("bytes", "str", "int", "str_int", "str_float", "str_decimal", "json", "pkl")


class _FileInfo(msgspec.Struct):
    basename: str
    bytes: Annotated[int, msgspec.Meta(ge=0)]


class _Shard(msgspec.Struct):
    format: str
    samples: Annotated[int, msgspec.Meta(ge=0)]
    raw_data: _FileInfo
    column_names: list[str]
    column_encodings: list[str]
    column_sizes: list[Annotated[int, msgspec.Meta(ge=0)] | None]
    version: int = 2
    compression: str | None = None
    zip_data: _FileInfo | None = None


class _Index(msgspec.Struct):
    shards: list[_Shard]
    version: int = 2


def _known(encoding: str) -> bool:
    if encoding in _SCALARS or encoding in _IMAGES or encoding in _OTHERS:
        return True
    parts = encoding.split(":")
    return parts[0] == "ndarray" and len(parts) <= 3 and (len(parts) < 2 or parts[1] in _ARRAY_DTYPES.values())


def entries_from_index(doc: Any, where: str) -> list[ShardEntry]:
    """Manifest entries of a MosaicML Streaming ``index.json`` (decoded JSON ``doc``)."""
    try:
        index = msgspec.convert(doc, _Index)
    except msgspec.ValidationError as e:
        raise DataError(f"{where}: not a MosaicML Streaming index: {e}") from None
    if index.version != 2:
        raise DataError(f"{where}: `$.version` is {index.version}; this reader knows MosaicML Streaming version 2")
    entries = []
    for i, shard in enumerate(index.shards):
        at = f"{where}: `$.shards[{i}]"
        if shard.format != "mds":
            raise DataError(f"{at}.format` is {shard.format!r}; savable_loader reads MDS shards ('mds') only")
        if shard.zip_data is not None or shard.compression:
            raise DataError(
                f"{at}` is compressed ({shard.compression!r}); savable_loader reads uncompressed MDS shards only "
                "(write them with compression=None)"
            )
        if not len(shard.column_names) == len(shard.column_encodings) == len(shard.column_sizes):
            raise DataError(f"{at}`: column_names, column_encodings and column_sizes differ in length")
        for name, encoding in zip(shard.column_names, shard.column_encodings):
            if not _known(encoding):
                raise DataError(f"{at}`: column {name!r} has the unknown encoding {encoding!r}")
        check_path(shard.raw_data.basename, f"{at}.raw_data.basename`")
        entries.append(
            ShardEntry(
                path=shard.raw_data.basename,
                samples=shard.samples,
                format="mds",
                size=shard.raw_data.bytes,
                options={
                    "column_names": shard.column_names,
                    "column_encodings": shard.column_encodings,
                    "column_sizes": shard.column_sizes,
                },
            )
        )
    return entries


def _u32(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 4], "little")


def _ndarray(encoding: str) -> Callable[[bytes], np.ndarray]:
    parts = encoding.split(":")
    dtype = np.dtype(parts[1]).newbyteorder("<") if len(parts) > 1 else None
    shape = tuple(int(d) for d in parts[2].split(",")) if len(parts) > 2 else None

    def decode(data: bytes) -> np.ndarray:
        at, dt, sh = 0, dtype, shape
        if dt is None:
            dt = np.dtype(_ARRAY_DTYPES[data[0]]).newbyteorder("<")
            at = 1
        if sh is None:
            ndim, kind = data[at] >> 2, data[at] & 3
            width = 1 << kind
            sh = tuple(np.frombuffer(data, _SHAPE_DTYPES[kind], ndim, at + 1).tolist())
            at += 1 + ndim * width
        return np.frombuffer(data, dt, offset=at).reshape(sh).copy()

    return decode


def _image_module() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise DataError(
            "decoding MDS image columns needs Pillow (pip install pillow); or leave them out with columns="
        ) from None
    return Image


def _pil(data: bytes) -> Any:
    width, height, mode_size = _u32(data, 0), _u32(data, 4), _u32(data, 8)
    mode = data[12 : 12 + mode_size].decode("utf-8")
    return _image_module().frombytes(mode, (width, height), data[12 + mode_size :])


def _encoded_image(data: bytes) -> Any:
    return _image_module().open(io.BytesIO(data))


def _parts(data: bytes, at: int) -> list[bytes]:
    """``uint32 n`` at ``at``, ``n`` uint32 sizes, then the ``n`` parts: the parts."""
    n = _u32(data, at)
    start = at + 4 + 4 * n
    out = []
    for k in range(n):
        size = _u32(data, at + 4 + 4 * k)
        out.append(data[start : start + size])
        start += size
    return out


def _image_list(item: Callable[[bytes], Any]) -> Callable[[bytes], list[Any]]:
    # 4 reserved bytes, then the parts
    return lambda data: [item(part) for part in _parts(data, 4)]


def _jpeg_array(data: bytes) -> list[Any]:
    return [_encoded_image(part) for part in _parts(data, 0)]


def _decoder(encoding: str, column: str, where: str) -> Callable[[bytes], Any]:
    if encoding in _SCALARS:
        dtype = _SCALARS[encoding]
        return lambda data: np.frombuffer(data, dtype, 1)[0]
    simple: dict[str, Callable[[bytes], Any]] = {
        "bytes": bytes,
        "str": lambda data: data.decode("utf-8"),
        "int": lambda data: int.from_bytes(data, "little", signed=True),
        "str_int": lambda data: int(data.decode("utf-8")),
        "str_float": lambda data: float(data.decode("utf-8")),
        "str_decimal": lambda data: Decimal(data.decode("utf-8")),
        "json": lambda data: json.loads(data.decode("utf-8")),
        "pil": _pil,
        "jpeg": _encoded_image,
        "png": _encoded_image,
        "list[pil]": _image_list(_pil),
        "list[jpeg]": _image_list(_encoded_image),
        "list[png]": _image_list(_encoded_image),
        "jpeg_array": _jpeg_array,
        "jpegarray": _jpeg_array,
    }
    if encoding in simple:
        return simple[encoding]
    if encoding.split(":")[0] == "ndarray":
        return _ndarray(encoding)
    if encoding == "pkl":
        raise DataError(
            f"{where}: column {column!r} is a pickle ('pkl'), which savable_loader does not load "
            "(it can run code); leave it out with columns=[...]"
        )
    raise DataError(f"{where}: column {column!r} has the unknown encoding {encoding!r}")


class MdsReader(ShardReader):
    """Samples of one ``.mds`` shard: one read per sample."""

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        where = file.name
        opts = entry.options or {}
        names, encodings, sizes = opts["column_names"], opts["column_encodings"], opts["column_sizes"]
        wanted = set(options.columns) if options.columns is not None else set(names)
        missing = [c for c in options.columns or () if c not in names]
        if missing:
            raise DataError(f"{where}: no column {missing[0]!r} (columns: {names})")
        # (name, fixed size or None, decoder or None when not wanted), in the file's order
        self.columns = [
            (n, s, _decoder(e, n, where) if n in wanted else None) for n, e, s in zip(names, encodings, sizes)
        ]
        self.order = list(options.columns) if options.columns is not None else names
        self.variable = sum(1 for _, s, _ in self.columns if not s)
        self._get, self._held = byte_getter(file)
        if file.size < 4:
            raise DataError(f"{where}: {file.size} bytes, too short for an MDS shard")
        n = _u32(self._get(0, 4), 0)
        if file.size < 4 * (n + 2):
            raise DataError(
                f"{where}: truncated: {n} samples need a header of {4 * (n + 2)} bytes, the file has {file.size}"
            )
        offsets = np.frombuffer(self._get(4, 4 * (n + 1)), "<u4").astype(np.int64)
        if n and (bool(np.any(offsets[1:] < offsets[:-1])) or int(offsets[0]) < 4 * (n + 2)):
            raise DataError(f"{where}: the sample offsets of the header do not grow; not an MDS shard")
        if int(offsets[-1]) > file.size:
            raise DataError(f"{where}: truncated: the samples end at byte {int(offsets[-1])}, the file has {file.size}")
        self.offsets = offsets.tolist()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def read(self, i: int) -> dict[str, Any]:
        start, stop = self.offsets[i], self.offsets[i + 1]
        data = self._get(start, stop - start)
        at = 4 * self.variable
        if at > len(data):
            raise DataError(f"{self.file.name}: sample {i} (bytes [{start}, {stop})) is too short")
        out: dict[str, Any] = {}
        k = 0
        for name, size, decode in self.columns:
            if not size:
                size = _u32(data, 4 * k)
                k += 1
            if at + size > len(data):
                raise DataError(f"{self.file.name}: sample {i}: column {name!r} runs past the sample's end")
            if decode is not None:
                try:
                    out[name] = decode(data[at : at + size])
                except DataError:
                    raise
                except Exception as e:  # noqa: BLE001 - malformed column bytes
                    raise DataError(
                        f"{self.file.name}: sample {i}: cannot decode column {name!r} ({type(e).__name__}: {e})"
                    ) from None
            at += size
        return {name: out[name] for name in self.order}

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        super().close()
