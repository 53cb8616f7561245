"""Shard folders on disk: the ``metadata.json`` format, per-format shard readers, a writer.

A shard folder holds shard files and a ``metadata.json`` that lists them in order with
their sample counts (version 1 of the format)::

    {"format": 1,
     "shards": [{"path": "shard-00000.npy", "samples": 100},
                {"path": "sub/shard-00001.pt", "samples": 80}]}

``path`` is relative to the folder (no absolute paths, no ``..``); its suffix selects
the reader:

* ``.npy``: a NumPy array (not an object array), memory-mapped; sample ``i`` is row
  ``i`` (``array[i]``) copied into a ``torch.Tensor``.
* ``.pt``: a file written by ``torch.save`` holding a tensor or a dict of tensors with
  a common first dimension, loaded with ``weights_only=True`` and ``mmap=True``; sample
  ``i`` is ``tensor[i]`` (or ``{name: tensor[i]}``), cloned.
* ``.jsonl``: one JSON value per line (UTF-8, ``\\n`` separated, a final newline
  optional), each decoded with msgspec when it is read.

Every problem with the data is a :class:`~savable_loader.errors.DataError` naming the
file (and the field or line). ``write_shards`` writes such a folder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from savable_loader.errors import DataError

__all__ = ["FORMATS", "METADATA_NAME", "Metadata", "ShardEntry", "ShardReader", "open_shard", "read_metadata",
           "write_shards"]

METADATA_NAME = "metadata.json"
METADATA_VERSION = 1
FORMATS = (".npy", ".pt", ".jsonl")


class ShardEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One shard of ``metadata.json``: its path in the folder and its number of samples."""

    path: str
    samples: Annotated[int, msgspec.Meta(ge=0)]


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    """The whole ``metadata.json`` (``format`` is the version of this layout, 1)."""

    format: int
    shards: list[ShardEntry]


def read_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """Parse and check ``folder/metadata.json``; every shard file must exist.

    Example::

        meta = read_metadata("data/train")
        sum(s.samples for s in meta.shards)
    """
    path = Path(folder) / METADATA_NAME
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the shard metadata ({e.strerror or e})") from None
    try:
        meta = msgspec.json.decode(raw, type=Metadata)
    except msgspec.ValidationError as e:
        raise DataError(f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if meta.format != METADATA_VERSION:
        raise DataError(f"{path}: `$.format` is {meta.format!r}, this version of savable_loader reads format 1")
    seen: set[str] = set()
    for i, shard in enumerate(meta.shards):
        where = f"{path}: `$.shards[{i}].path`"
        p = PurePosixPath(shard.path)
        if not shard.path or p.is_absolute() or ".." in p.parts:
            raise DataError(f"{where} is {shard.path!r}; expected a path relative to the folder, without '..'")
        if p.suffix not in FORMATS:
            raise DataError(f"{where} is {shard.path!r}; expected a file ending in one of {', '.join(FORMATS)}")
        if shard.path in seen:
            raise DataError(f"{where} is {shard.path!r}, which is listed twice")
        seen.add(shard.path)
        if not (Path(folder) / p).is_file():
            raise DataError(f"{where}: shard file {Path(folder) / p} does not exist")
    return meta


class ShardReader:
    """Random access to the samples of one open shard file (see ``open_shard``)."""

    path: Path

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def read(self, i: int) -> Any:  # pragma: no cover - abstract
        """Sample ``i`` of the shard, a fresh object (never a view into the file)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the file (memory maps are released when the last view goes)."""


class _NpyReader(ShardReader):
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.array = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any failure means an unreadable file
            raise DataError(f"{path}: cannot read the .npy shard ({type(e).__name__}: {e})") from None
        if not isinstance(self.array, np.ndarray) or self.array.ndim == 0:
            raise DataError(f"{path}: a .npy shard must hold an array with at least one dimension")
        try:
            torch.from_numpy(np.zeros(0, dtype=self.array.dtype))
        except TypeError:
            raise DataError(f"{path}: dtype {self.array.dtype} cannot become a torch.Tensor") from None

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def read(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.array[i]))

    def close(self) -> None:
        del self.array


class _PtReader(ShardReader):
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{path}: cannot read the .pt shard ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        if isinstance(data, torch.Tensor):
            tensors = {"": data}
        elif isinstance(data, dict) and data and all(isinstance(k, str) for k in data):
            tensors = data
        else:
            raise DataError(f"{path}: a .pt shard must hold a tensor or a dict of tensors, got {type(data).__name__}")
        lengths = set()
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise DataError(f"{path}: entry {name!r} is not a tensor with at least one dimension")
            lengths.add(t.shape[0])
        if len(lengths) != 1:
            sizes = {k: int(v.shape[0]) for k, v in tensors.items()}
            raise DataError(f"{path}: the tensors of a .pt shard must have a common first dimension, got {sizes}")
        self.tensors = tensors
        self.single = isinstance(data, torch.Tensor)
        self.length = int(lengths.pop())

    def __len__(self) -> int:
        return self.length

    def read(self, i: int) -> Any:
        if self.single:
            return self.tensors[""][i].clone()
        return {k: v[i].clone() for k, v in self.tensors.items()}

    def close(self) -> None:
        del self.tensors


class _JsonlReader(ShardReader):
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read the .jsonl shard ({e.strerror or e})") from None
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        self.lines = lines
        self.decoder = msgspec.json.Decoder()

    def __len__(self) -> int:
        return len(self.lines)

    def read(self, i: int) -> Any:
        try:
            return self.decoder.decode(self.lines[i])
        except msgspec.DecodeError as e:
            raise DataError(f"{self.path}: line {i + 1} is not valid JSON ({e})") from None

    def close(self) -> None:
        del self.lines


_READERS = {".npy": _NpyReader, ".pt": _PtReader, ".jsonl": _JsonlReader}


def open_shard(path: str | os.PathLike[str], expected: int | None = None) -> ShardReader:
    """Open one shard file; with ``expected``, its length must agree with the metadata.

    Example::

        reader = open_shard("data/train/shard-00000.npy", expected=100)
        first = reader.read(0)
    """
    path = Path(path)
    cls = _READERS.get(path.suffix)
    if cls is None:
        raise DataError(f"{path}: unknown shard format {path.suffix!r}; expected one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise DataError(f"{path}: shard file does not exist")
    reader = cls(path)
    if expected is not None and len(reader) != expected:
        found = len(reader)
        reader.close()
        raise DataError(f"{path}: the metadata says {expected} samples, the shard holds {found}")
    return reader


def _shard_length(shard: Any, fmt: str) -> int:
    if fmt == ".jsonl":
        return len(shard)
    if isinstance(shard, dict):
        return int(next(iter(shard.values())).shape[0]) if shard else 0
    return int(shard.shape[0])


def write_shards(
    folder: str | os.PathLike[str],
    shards: Sequence[Any],
    *,
    fmt: str = ".npy",
    prefix: str = "shard",
) -> Path:
    """Write ``shards`` as a shard folder and return the path of its ``metadata.json``.

    Each element of ``shards`` is one shard: a NumPy array (``fmt=".npy"``), a tensor or
    a dict of tensors with a common first dimension (``".pt"``), or a list of
    JSON-encodable values (``".jsonl"``). Files are named ``{prefix}-00000{fmt}``, ...;
    the metadata is written last, atomically.

    Example::

        write_shards("data/train", [np.arange(100).reshape(50, 2), np.arange(40).reshape(20, 2)])
        ds = ShardedFileDataset("data/train", worker_config=wc)
    """
    if fmt not in FORMATS:
        raise DataError(f"write_shards: fmt is {fmt!r}; expected one of {', '.join(FORMATS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    encoder = msgspec.json.Encoder()
    for i, shard in enumerate(shards):
        name = f"{prefix}-{i:05d}{fmt}"
        path = folder / name
        if fmt == ".npy":
            np.save(path, np.asarray(shard), allow_pickle=False)
        elif fmt == ".pt":
            torch.save(shard, path)
        else:
            with open(path, "wb") as f:
                for value in shard:
                    f.write(encoder.encode(value))
                    f.write(b"\n")
        entries.append(ShardEntry(path=name, samples=_shard_length(shard, fmt)))
    meta = msgspec.json.format(msgspec.json.encode(Metadata(format=METADATA_VERSION, shards=entries)))
    target = folder / METADATA_NAME
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".metadata-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
