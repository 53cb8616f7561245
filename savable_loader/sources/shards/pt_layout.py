"""Where the tensors of a ``.pt`` shard lie in its file, so that their rows can be read
with ``pread`` (``sources/shards/held_file.py``) instead of through a memory map.

A file written by ``torch.save`` is a zip archive whose storages are stored, uncompressed,
as the records ``<archive>/data/<key>``. ``torch.load(..., mmap=True)`` maps the whole
file once and makes each storage a view of that map at its record's offset; it reads no
data. So the storages' ``data_ptr()`` minus one common base are the offsets of their
records, which the zip's own headers give (Python's ``zipfile``). :func:`storage_offsets`
finds that base and returns each storage's offset in the file; where the storages do not
fit the records that way (a future torch that maps otherwise), it returns ``None`` and
the reader loads the shard into memory instead, never guessing.

Example::

    data = torch.load(path, weights_only=True, mmap=True)
    offsets = storage_offsets(path, [data.untyped_storage()])  # [file offset] or None
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import torch

__all__ = ["storage_offsets"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header (30 bytes)
_LOCAL_MAGIC = 0x04034B50


def _data_records(path: Path) -> dict[int, int]:
    """``{offset of the data: size}`` of the stored ``*/data/*`` records of the zip at ``path``."""
    records: dict[int, int] = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) < 2 or parts[-2] != "data" or info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            header = f.read(_LOCAL_HEADER.size)
            if len(header) != _LOCAL_HEADER.size:
                continue
            fields = _LOCAL_HEADER.unpack(header)
            if fields[0] != _LOCAL_MAGIC:
                continue
            name_length, extra_length = fields[9], fields[10]
            records[info.header_offset + _LOCAL_HEADER.size + name_length + extra_length] = info.file_size
    return records


def storage_offsets(path: Path, storages: list[torch.UntypedStorage]) -> list[int] | None:
    """The file offset of each of ``storages`` (of ``torch.load(path, mmap=True)``), or
    ``None`` when they are not views of one map at the offsets of the file's records.
    A storage of 0 bytes gets offset 0 (there is nothing of it to read)."""
    try:
        records = _data_records(path)
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    spans = [(s.data_ptr(), s.nbytes()) for s in storages]
    sized = [(ptr, n) for ptr, n in spans if n > 0]
    if not sized:
        return [0] * len(spans)
    first_ptr, first_size = sized[0]
    bases = {first_ptr - offset for offset, size in records.items() if size == first_size}
    fitting = [base for base in bases if all(records.get(ptr - base) == n for ptr, n in sized)]
    if len(fitting) != 1:
        return None
    base = fitting[0]
    return [ptr - base if n > 0 else 0 for ptr, n in spans]
