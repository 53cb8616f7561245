"""Small shard folders in other libraries' layouts, written by hand from their documented
formats (WebDataset tars with Python's ``tarfile``, Parquet with pyarrow, MosaicML
Streaming MDS and LitData chunks byte by byte), for the format tests.

Sample ``j`` of a folder carries ``j`` in a field (``__key__`` ``sample{j:05d}`` for
tars, ``id`` elsewhere), so streams can be compared by id.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SIZES = [5, 3, 7, 5]  # 20 samples: 10 per rank over 2 ranks, 5 per worker


def tar_members(j: int) -> dict[str, bytes]:
    """The members of tar sample ``j``."""
    return {
        "txt": f"text {j}".encode(),
        "cls": str(j % 3).encode(),
        "json": json.dumps({"id": j}).encode(),
        "bin": bytes(range(j % 7)) * (j + 1),
    }


def indexed_blob(items: Sequence[bytes], extra: bytes = b"") -> bytes:
    """``uint32 n``, ``uint32 offsets[n + 1]`` (absolute), ``extra``, then the items: the
    layout of an MDS shard (``extra`` = its JSON settings) and of a LitData chunk."""
    start = 4 + 4 * (len(items) + 1) + len(extra)
    offsets = np.cumsum([start] + [len(item) for item in items]).astype("<u4")
    return struct.pack("<I", len(items)) + offsets.tobytes() + extra + b"".join(items)


def write_tar(
    path: Path,
    samples: Sequence[tuple[str, dict[str, bytes]]],
    fmt: int = tarfile.PAX_FORMAT,
    extra: Sequence[tuple[str, bytes]] = (),
) -> None:
    """A tar of ``(key, {ext: bytes})`` samples; ``extra`` members (name, data) come first."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in extra:
            _add(tar, name, data)
        for key, members in samples:
            for ext, data in members.items():
                _add(tar, f"{key}.{ext}", data)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def write_tar_folder(folder: Path, sizes: Sequence[int] = SIZES, fmt: int = tarfile.PAX_FORMAT) -> Path:
    """``shard-{i:03d}.tar`` files; sample ``j`` is ``sample{j:05d}`` with ``tar_members(j)``."""
    folder.mkdir(parents=True, exist_ok=True)
    j = 0
    for i, n in enumerate(sizes):
        write_tar(folder / f"shard-{i:03d}.tar", [(f"sample{k:05d}", tar_members(k)) for k in range(j, j + n)], fmt)
        j += n
    return folder


def write_parquet_folder(folder: Path, sizes: Sequence[int] = SIZES, row_group: int = 2) -> Path:
    """``part-{i}.parquet`` files with row groups of ``row_group`` rows; row ``j`` has id ``j``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    j = 0
    for i, n in enumerate(sizes):
        ids = list(range(j, j + n))
        table = pa.table(
            {
                "id": ids,
                "text": [f"row {k}" for k in ids],
                "tags": [[k, k % 3] for k in ids],
                "score": [k / 4 for k in ids],
            }
        )
        pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=row_group)
        j += n
    return folder


# -- MosaicML Streaming (MDS) -----------------------------------------------------------

MDS_COLUMNS = {
    "id": "int",
    "text": "str",
    "blob": "bytes",
    "x": "ndarray",
    "y": "ndarray:float32:3",
    "f": "float32",
    "u": "uint8",
    "meta": "json",
}


def mds_row(j: int) -> dict[str, Any]:
    return {
        "id": j,
        "text": f"text {j}",
        "blob": bytes([j % 256]) * (j % 4),
        "x": np.arange(j + 1, dtype=np.int16),
        "y": np.full(3, j / 2, np.float32),
        "f": np.float32(j / 3),
        "u": np.uint8(j),
        "meta": {"j": [j]},
    }


def _mds_encode(encoding: str, value: Any) -> bytes:
    if encoding == "int":
        return struct.pack("<q", value)
    if encoding == "str":
        return value.encode()
    if encoding == "bytes":
        return value
    if encoding == "json":
        return json.dumps(value).encode()
    if encoding in ("float32", "uint8"):
        return np.asarray(value, encoding).tobytes()
    if encoding == "ndarray":  # dynamic dtype and shape: dtype code, (ndim << 2 | uint8 shape), shape, values
        codes = {"int16": 17, "float32": 34}
        return (
            bytes([codes[value.dtype.name], value.ndim << 2])
            + np.array(value.shape, np.uint8).tobytes()
            + value.tobytes()
        )
    if encoding == "ndarray:float32:3":
        return value.astype("<f4").tobytes()
    raise ValueError(encoding)


def write_mds_folder(folder: Path, sizes: Sequence[int] = SIZES, columns: dict[str, str] = MDS_COLUMNS) -> Path:
    """MDS shards ``shard.{i:05d}.mds`` and their ``index.json`` (version 2, uncompressed)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(columns)
    encodings = [columns[n] for n in names]
    fixed = {"int": 8, "float32": 4, "uint8": 1, "ndarray:float32:3": 12}
    col_sizes = [fixed.get(e) for e in encodings]
    shards, j = [], 0
    for i, n in enumerate(sizes):
        samples = []
        for k in range(j, j + n):
            row = mds_row(k)
            parts = [_mds_encode(e, row[name]) for name, e in zip(names, encodings)]
            head = b"".join(struct.pack("<I", len(p)) for p, s in zip(parts, col_sizes) if s is None)
            samples.append(head + b"".join(parts))
        data = indexed_blob(samples, json.dumps({"version": 2, "format": "mds"}, sort_keys=True).encode())
        name = f"shard.{i:05d}.mds"
        (folder / name).write_bytes(data)
        shards.append(
            {
                "column_encodings": encodings,
                "column_names": names,
                "column_sizes": col_sizes,
                "compression": None,
                "format": "mds",
                "hashes": [],
                "raw_data": {"basename": name, "bytes": len(data), "hashes": {}},
                "samples": n,
                "size_limit": 1 << 26,
                "version": 2,
                "zip_data": None,
            }
        )
        j += n
    (folder / "index.json").write_text(json.dumps({"shards": shards, "version": 2}, sort_keys=True))
    return folder


# -- LitData ----------------------------------------------------------------------------

LITDATA_FORMAT = ["int", "str", "no_header_numpy:9", "numpy", "tensor", "bytes", "float", "bool"]
LITDATA_KEYS = ["id", "text", "x", "m", "t", "b", "f", "ok"]


def litdata_row(j: int) -> dict[str, Any]:
    import torch

    return {
        "id": j,
        "text": f"s{j}",
        "x": np.arange(j + 1, dtype=np.float32),
        "m": np.ones((2, 2)) * j,
        "t": torch.arange(3) * j,
        "b": b"xy" * (j % 3),
        "f": 0.5 * j,
        "ok": j % 2 == 0,
    }


def _litdata_leaf(fmt: str, value: Any) -> bytes:
    if fmt == "int":
        return struct.pack("<q", value)
    if fmt == "float":
        return struct.pack("<d", value)
    if fmt == "bool":
        return b"\x01" if value else b"\x00"
    if fmt == "str":
        return value.encode()
    if fmt == "bytes":
        return value
    if fmt == "no_header_numpy:9":  # float32 (index 9 of LitData's NumPy dtype table)
        return value.astype(np.float32).tobytes()
    if fmt == "numpy":  # dtype index, ndim, dims (uint32 each), values
        return struct.pack(f"<II{value.ndim}I", 10, value.ndim, *value.shape) + value.astype(np.float64).tobytes()
    if fmt == "tensor":  # big-endian dtype index (17: int64) and rank, big-endian shape, values
        return struct.pack(f">II{value.dim()}I", 17, value.dim(), *value.shape) + value.numpy().tobytes()
    raise ValueError(fmt)


def write_litdata_folder(folder: Path, sizes: Sequence[int] = SIZES) -> Path:
    """LitData chunks ``chunk-0-{i}.bin`` and their ``index.json`` (PyTreeLoader, uncompressed)."""
    folder.mkdir(parents=True, exist_ok=True)
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = json.dumps(
        [1, {"type": "builtins.dict", "context": json.dumps(LITDATA_KEYS), "children_spec": [leaf] * len(LITDATA_KEYS)}]
    )
    chunks, j = [], 0
    for i, n in enumerate(sizes):
        items = []
        for k in range(j, j + n):
            row = litdata_row(k)
            leaves = [_litdata_leaf(fmt, row[key]) for fmt, key in zip(LITDATA_FORMAT, LITDATA_KEYS)]
            items.append(struct.pack(f"<{len(leaves)}I", *map(len, leaves)) + b"".join(leaves))
        data = indexed_blob(items)
        name = f"chunk-0-{i}.bin"
        (folder / name).write_bytes(data)
        chunks.append({"chunk_bytes": len(data), "chunk_size": n, "dim": None, "filename": name})
        j += n
    config = {
        "chunk_bytes": None,
        "chunk_size": 8,
        "compression": None,
        "data_format": LITDATA_FORMAT,
        "data_spec": spec,
        "encryption": None,
        "item_loader": "PyTreeLoader",
    }
    (folder / "index.json").write_text(json.dumps({"chunks": chunks, "config": config}, sort_keys=True))
    return folder
