"""WebDataset tar shards: O(1) access to sample ``i`` through a byte-offset index.

A sample is every regular member sharing a key, as webdataset groups them: the member
``dir/0001.seg.png`` has key ``dir/0001`` and extension ``seg.png`` (lower-cased), and
consecutive members with one key form the sample ``{"__key__": "dir/0001", "jpg": b"...",
"seg.png": b"..."}`` (bytes; decoding is the ``decode=`` option or the user's map).
Members whose name has no extension, names like ``__meta__``, directories and links are
not part of any sample.

The index is Energon's ``.tar.idx`` layout, so a folder prepared by ``energon prepare``
is read unchanged and ours is read by Energon: ``samples + 1`` little-endian ``uint64``
values, the byte offset where each sample's first header starts (extension headers
included) and, last, the offset where the last member ends. Sample ``i`` is the bytes
``[offset[i], offset[i + 1])``: one read, then its headers are parsed in memory.

Headers: POSIX USTAR (with the ``prefix`` field), PAX extended headers (``path``,
``size``, ``linkpath``), GNU long names and links, GNU base-256 sizes. Compressed tars,
sparse members and global PAX headers that rename members are refused. Every problem
(bad checksum, a header where none can be, a member running past the end of the file,
an index that does not match the tar) is a :class:`~savable_loader.errors.DataError`
naming the shard and the byte offset.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from savable_loader.errors import DataError
from savable_loader.sources.shards.manifest import ShardEntry
from savable_loader.sources.shards.reader import ReadOptions, ShardReader
from savable_loader.sources.shards.store import ShardFile, ShardStore, byte_getter

__all__ = ["TarIndexError", "TarReader", "check_index", "encode_index", "scan_tar", "split_name", "tar_sample"]

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = frozenset(b"07\0")  # typeflags of regular files (tarfile.REGULAR_TYPES without sparse)
_NO_DATA = frozenset(b"123456")  # links, devices, directories, fifos: the size field is not data
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's and Energon's key / extension split
_META = re.compile(r"__[^/]*__($|/)")  # names Energon and webdataset keep out of samples


class TarIndexError(DataError):
    """A tar's index does not match it (used internally to suggest re-indexing)."""


class Member(NamedTuple):
    """One member of a tar: where its header chain starts, its name, type and data."""

    header: int  # offset of its first header (extension headers included)
    name: str
    type: int  # typeflag byte
    data: int  # offset of its data
    size: int
    end: int  # offset of the next header


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name as webdataset splits it, or None."""
    if _META.match(name):
        return None
    m = _KEY.match(name)
    return (m.group(1), m.group(2)) if m else None


def _number(field: bytes, where: str, offset: int) -> int:
    if field[0] in (0x80, 0xFF):  # GNU base-256
        if field[0] == 0xFF:
            raise DataError(f"{where}: header at byte {offset} has a negative size")
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise DataError(f"{where}: header at byte {offset} is not a tar header (number {field!r})") from None


def _checksum_ok(header: bytes) -> bool:
    stored = header[148:156].split(b"\0", 1)[0].strip()
    try:
        value = int(stored or b"0", 8)
    except ValueError:
        return False
    unsigned = 256 + sum(header[:148]) + sum(header[156:])  # the checksum field counts as 8 spaces
    if value == unsigned:
        return True
    high = sum(1 for b in header[:148] if b > 127) + sum(1 for b in header[156:] if b > 127)
    return value == unsigned - 256 * high  # some old writers summed signed chars


def _pax(data: bytes, where: str, offset: int) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise DataError(f"{where}: malformed PAX header at byte {offset}") from None
        record = data[space + 1 : pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise DataError(f"{where}: malformed PAX header at byte {offset}")
        key, value = record[:-1].split(b"=", 1)
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def iter_members(get: Callable[[int, int], bytes], start: int, stop: int, size: int, where: str) -> Iterator[Member]:
    """The members whose header chain starts in ``[start, stop)``; ends early at the
    end-of-archive block. ``get(offset, length)`` reads bytes, ``size`` is the file size."""
    pos = start
    while pos < stop:
        chain = pos
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            if pos + BLOCK > size:
                raise DataError(
                    f"{where}: truncated: a tar header at byte {pos} runs past the end of the file ({size} bytes)"
                )
            header = get(pos, BLOCK)
            if header == _ZERO:
                if chain != pos:
                    raise DataError(
                        f"{where}: an extension header at byte {chain} is followed by the end of the archive"
                    )
                return
            if not _checksum_ok(header):
                raise DataError(
                    f"{where}: no valid tar header at byte {pos} (bad checksum); the file is corrupt"
                    + (" or not a tar" if pos == 0 else "")
                )
            kind = header[156]
            length = _number(header[124:136], where, pos)
            data = pos + BLOCK
            padded = -(-length // BLOCK) * BLOCK
            if kind in b"xXgLK":
                if data + length > size:
                    raise DataError(
                        f"{where}: truncated: the extension header at byte {pos} runs past the end of the file"
                    )
                body = get(data, length)
                if kind == ord("L"):
                    long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                elif kind in b"xX":
                    pax.update(_pax(body, where, pos))
                elif kind == ord("g"):
                    renames = sorted({"path", "size", "linkpath"} & _pax(body, where, pos).keys())
                    if renames:
                        raise DataError(f"{where}: the global PAX header at byte {pos} sets {renames}; not supported")
                    chain = data + padded  # a global header belongs to no member
                pos = data + padded
                continue
            if kind == ord("S") or any(k.startswith("GNU.sparse") for k in pax):
                raise DataError(f"{where}: member at byte {chain} is a sparse file; not supported")
            name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = header[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
            if long_name is not None:
                name = long_name
            if "path" in pax:
                name = pax["path"]
            if "size" in pax:
                try:
                    length = int(pax["size"])
                except ValueError:
                    raise DataError(f"{where}: PAX size {pax['size']!r} at byte {chain} is not a number") from None
                padded = -(-length // BLOCK) * BLOCK
            if kind in _NO_DATA:
                length = padded = 0
            elif data + length > size:
                raise DataError(
                    f"{where}: truncated: member {name!r} (header at byte {chain}) needs bytes up to "
                    f"{data + length}, the file has {size}"
                )
            pos = data + padded
            yield Member(chain, name, kind, data, length, pos)
            break


def scan_tar(file: ShardFile) -> np.ndarray:
    """Build the index of a tar (Energon's layout, see the module docstring)."""
    where = file.name
    get, held = byte_getter(file)
    try:
        if file.size >= 2 and get(0, 2) == b"\x1f\x8b":
            raise DataError(f"{where}: a gzip-compressed tar; random access needs an uncompressed tar (gunzip it)")
        offsets: list[int] = []
        last_key: str | None = None
        end = 0
        for m in iter_members(get, 0, file.size, file.size, where):
            end = m.end
            if m.type not in _REGULAR:
                continue
            split = split_name(m.name)
            if split is None:
                continue
            if split[0] != last_key:
                offsets.append(m.header)
                last_key = split[0]
        if file.size - end < BLOCK or get(end, BLOCK) != _ZERO:
            raise DataError(
                f"{where}: truncated: no end-of-archive block after the last member (it ends at byte {end}, "
                f"the file has {file.size} bytes)"
            )
        offsets.append(end)
        return np.array(offsets, dtype="<u8")
    finally:
        if held is not None:
            held.close()


def encode_index(offsets: np.ndarray) -> bytes:
    """The bytes of a ``.tar.idx`` file."""
    return np.asarray(offsets, dtype="<u8").tobytes()


def check_index(raw: bytes, file_size: int, samples: int | None, where: str) -> list[int]:
    """Decode and check a ``.tar.idx``; returns the ``samples + 1`` offsets."""
    if len(raw) % 8 or not raw:
        raise TarIndexError(f"{where}: {len(raw)} bytes, not a tar index (a non-empty multiple of 8 bytes)")
    offsets = np.frombuffer(raw, dtype="<u8")
    if samples is not None and len(offsets) - 1 != samples:
        raise TarIndexError(f"{where}: indexes {len(offsets) - 1} samples, the metadata says {samples}")
    if len(offsets) > 1 and not bool(np.all(offsets[1:] > offsets[:-1])):
        bad = int(np.argmax(offsets[1:] <= offsets[:-1])) + 1
        raise TarIndexError(f"{where}: offset {bad} ({int(offsets[bad])}) does not grow")
    if bool(np.any(offsets % BLOCK)):
        bad = int(np.argmax(offsets % BLOCK != 0))
        raise TarIndexError(f"{where}: offset {bad} ({int(offsets[bad])}) is not a multiple of {BLOCK}")
    if int(offsets[-1]) > file_size:
        raise TarIndexError(
            f"{where}: the samples end at byte {int(offsets[-1])}, but the tar has {file_size} bytes (truncated?)"
        )
    return offsets.tolist()


def _is_header(get: Callable[[int, int], bytes], pos: int, size: int) -> bool:
    if pos + BLOCK > size:
        return False
    header = get(pos, BLOCK)
    return header != _ZERO and _checksum_ok(header)


def tar_sample(
    get: Callable[[int, int], bytes],
    start: int,
    stop: int,
    size: int,
    where: str,
    columns: frozenset[str] | None = None,
    decoders: Mapping[str, Callable[[bytes], Any]] | None = None,
) -> dict[str, Any]:
    """The sample whose members start in ``[start, stop)``; ``columns`` keeps only those
    extensions, ``decoders`` maps an extension to its decoder."""
    if not _is_header(get, start, size):
        raise TarIndexError(f"{where}: the index says a sample starts at byte {start}, but no tar header starts there")
    sample: dict[str, Any] = {}
    key = None
    for m in iter_members(get, start, stop, size, where):
        if m.type not in _REGULAR:
            continue
        split = split_name(m.name)
        if split is None:
            continue
        if key is None:
            if m.header != start:
                raise TarIndexError(f"{where}: the index says a sample starts at byte {start}, but it does not")
            key = split[0]
            sample["__key__"] = key
        elif split[0] != key:
            raise TarIndexError(
                f"{where}: the index says bytes [{start}, {stop}) are one sample, but they hold the keys "
                f"{key!r} and {split[0]!r}"
            )
        ext = split[1].lower()
        if ext in sample:
            raise DataError(f"{where}: sample {key!r} has two members with extension {ext!r} (at byte {m.header})")
        if columns is not None and ext not in columns:
            sample[ext] = None  # marks it seen, removed below
            continue
        value = get(m.data, m.size)
        if decoders is not None:
            fn = decoders.get(ext) or decoders.get(ext.rsplit(".", 1)[-1])
            if fn is not None:
                try:
                    value = fn(value)
                except Exception as e:
                    raise DataError(
                        f"{where}: cannot decode {ext!r} of sample {key!r} (at byte {m.header}): "
                        f"{type(e).__name__}: {e}"
                    ) from e
        sample[ext] = value
    if key is None:
        raise TarIndexError(f"{where}: the index says a sample starts at byte {start}, but no member does")
    if stop + BLOCK <= size and get(stop, BLOCK) != _ZERO:  # the sample must end where the next one starts
        if not _is_header(get, stop, size):
            raise TarIndexError(f"{where}: the index says a sample ends at byte {stop}, but no tar header starts there")
        after = next(iter_members(get, stop, stop + 1, size, where), None)
        if after is not None and after.type in _REGULAR and (split_name(after.name) or ("",))[0] == key:
            raise TarIndexError(f"{where}: sample {key!r} continues past byte {stop}, where the index says it ends")
    if columns is not None:
        missing = columns - sample.keys()
        if missing:
            raise DataError(f"{where}: sample {key!r} has no {sorted(missing)} (it has {sorted(sample)[1:]})")
        sample = {k: v for k, v in sample.items() if k == "__key__" or k in columns}
    return sample


class TarReader(ShardReader):
    """Sample ``i`` of a tar shard: one read of ``[offset[i], offset[i + 1])``."""

    def __init__(self, file: ShardFile, entry: ShardEntry, store: ShardStore, options: ReadOptions) -> None:
        super().__init__(file, entry, store, options)
        self.where = file.name
        index_name = entry.tar_index
        raw = store.read_small(index_name)
        if raw is None:
            if not options.scan_missing_index:
                raise DataError(
                    f"{store.describe(index_name)}: the index of tar shard {file.name} does not exist: "
                    f"write it with `python -m savable_loader index {store.describe()}`"
                )
            raw = encode_index(scan_tar(file))
        self.hint = f" (rebuild the index: delete it and run `python -m savable_loader index {store.describe()}`)"
        expected = None if options.scan_missing_index else entry.samples
        try:
            self.offsets = check_index(raw, file.size, expected, store.describe(index_name))
        except TarIndexError as e:
            raise TarIndexError(f"{e}{self.hint}") from None
        self.columns = frozenset(options.columns) if options.columns is not None else None
        self._get, self._held = byte_getter(file)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def read(self, i: int) -> dict[str, Any]:
        try:
            return tar_sample(
                self._get,
                self.offsets[i],
                self.offsets[i + 1],
                self.file.size,
                self.where,
                self.columns,
                self.options.decoders,
            )
        except TarIndexError as e:
            raise TarIndexError(f"{e}{self.hint}") from None

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
        super().close()
