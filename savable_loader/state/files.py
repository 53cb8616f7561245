"""State files: atomic writes with a checksum, safe loads.

File layout (all integers little-endian)::

    8 bytes   magic  b"SLSTATE\\x00"
    4 bytes   file format version (1)
    8 bytes   payload length
    32 bytes  BLAKE2b-256 of the payload
    payload   MessagePack state (see codec.py)

``save_file`` writes a temporary file in the same folder, fsyncs it, renames it over the
target and fsyncs the folder: a crash leaves the old file or the new one, never a torn
one. ``load_file`` checks magic, length and checksum before decoding.

Example::

    save_file("ckpt/loader.state", loader.save_state_rank())
    state = load_file("ckpt/loader.state")
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from savable_loader.errors import StateError
from savable_loader.state.codec import decode, encode
from savable_loader.state.schema import GlobalState, RankState

__all__ = ["load_file", "save_file"]

MAGIC = b"SLSTATE\x00"
FILE_FORMAT = 1
_HEADER = struct.Struct("<8sIQ32s")


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def save_file(path: str | os.PathLike[str], state: RankState | GlobalState | list[RankState]) -> None:
    """Atomically write ``state`` (a rank state or the gathered list) to ``path``.

    Example::

        save_file("ckpt/loader.state", loader.save_state_rank())
    """
    payload = encode(state)
    target = Path(path)
    header = _HEADER.pack(MAGIC, FILE_FORMAT, len(payload), _digest(payload))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent if str(target.parent) else ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_file(path: str | os.PathLike[str]) -> RankState | list[RankState]:
    """Read a file written by :func:`save_file`; :class:`StateError` names what is wrong.

    Example::

        loader.restore_state_rank(load_file("ckpt/loader.state"))
    """
    target = Path(path)
    try:
        with open(target, "rb") as f:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise StateError(f"{target}: file is {len(header)} bytes, too short for a state file header")
            magic, version, length, digest = _HEADER.unpack(header)
            if magic != MAGIC:
                raise StateError(f"{target}: not a savable_loader state file (magic {magic!r}, expected {MAGIC!r})")
            if version != FILE_FORMAT:
                raise StateError(f"{target}: file format version {version}, expected {FILE_FORMAT}")
            size = os.fstat(f.fileno()).st_size - _HEADER.size
            if length != size:
                raise StateError(f"{target}: header says {length} payload bytes, file has {size} (truncated?)")
            payload = f.read(length)
    except OSError as e:
        raise StateError(f"{target}: cannot read state file: {e}") from e
    if _digest(payload) != digest:
        raise StateError(f"{target}: checksum mismatch, the file is corrupted")
    try:
        return decode(payload)
    except StateError as e:
        raise type(e)(f"{target}: {e}") from e
