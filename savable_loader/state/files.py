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

Temporary files are named ``.<name>.tmp-<machine>_<pid>_<start>_<random>``: ``machine``
is a hash of the host name and the PID namespace (so containers sharing a host name are
told apart), ``start`` the writer's start time (``/proc``; 0 where there is none). A
writer killed mid-save leaves its temporary file behind; each successful save of the
same target removes those of writers on this machine that are dead: no process with that
pid, a zombie, or a process started at another time (the pid was reused). Files of live
writers, of other machines (a shared filesystem) and of earlier versions are never
touched. Errors name the target and the reason (:class:`StateFileError`).

Example::

    save_file("ckpt/loader.state", loader.save_state_rank())
    state = load_file("ckpt/loader.state")
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import struct
from pathlib import Path

from savable_loader.errors import StateError, StateFileError
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

    Raises :class:`StateFileError` naming ``path`` when the file cannot be written (a
    missing or read-only folder, a folder at ``path``, a full disk); the old file, if any,
    is then left as it was. A successful save removes the temporary files earlier writers
    of ``path`` on this machine left when they were killed.

    Example::

        save_file("ckpt/loader.state", loader.save_state_rank())
    """
    payload = encode(state)
    target = Path(path)
    header = _HEADER.pack(MAGIC, FILE_FORMAT, len(payload), _digest(payload))
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise StateFileError(f"{target}: cannot save a state file there: it is a folder", str(target), errno.EISDIR)
    tmp = target.with_name(f".{target.name}{_TMP}{_writer()}_{os.urandom(4).hex()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise _file_error(target, folder, e) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _file_error(target, folder, e) from e
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise _file_error(target, folder, e) from e
    _sweep(target, folder)


_TMP = ".tmp-"


def _file_error(target: Path, folder: Path, e: OSError) -> StateFileError:
    if isinstance(e, FileNotFoundError) and not folder.exists():
        reason = f"the folder {folder} does not exist"
    elif isinstance(e, NotADirectoryError) or (folder.exists() and not folder.is_dir()):
        reason = f"{folder} is not a folder"
    elif isinstance(e, IsADirectoryError) or target.is_dir():
        reason = "it is a folder"
    elif isinstance(e, PermissionError) or e.errno == errno.EROFS:
        reason = f"cannot write in the folder {folder} ({e.strerror or e})"
    else:
        reason = e.strerror or str(e)
    return StateFileError(f"{target}: cannot save: {reason}", str(target), e.errno)


_WRITER: tuple[int, str] | None = None


def _writer() -> str:
    """``<machine>_<pid>_<start>`` of this process (computed again after a fork)."""
    global _WRITER
    pid = os.getpid()
    if _WRITER is None or _WRITER[0] != pid:
        _WRITER = (pid, f"{_machine()}_{pid}_{max(_start_time(pid) or 0, 0)}")
    return _WRITER[1]


def _machine() -> str:
    """A hash of the host name and the PID namespace: pids are comparable within it."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    text = f"{socket.gethostname()}\x00{namespace}".encode()
    return hashlib.blake2b(text, digest_size=4).hexdigest()


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), -1 if it is a zombie (it has
    ended), None if ``/proc`` has no entry for it (no such process, hidden, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return -1
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start: int) -> bool:
    """Whether the writer ``(pid, start)`` of this machine may still be writing."""
    if os.name == "nt":  # no /proc, and os.kill would terminate the process: keep its file
        return True
    now = _start_time(pid)
    if now is None:  # gone, hidden from this user (hidepid), or no /proc on this system
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return False
        except OSError:
            return True  # it exists (another user's)
        return True
    if now == -1:
        return False
    return start == 0 or now == start  # another start time: the pid was reused, the writer is dead


def _sweep(target: Path, folder: Path) -> None:
    """Remove temporary files of ``target`` left by dead writers of this machine."""
    prefix = f".{target.name}{_TMP}"
    machine = _writer().split("_", 1)[0]
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        parts = entry.name[len(prefix) :].split("_")
        if len(parts) != 4 or parts[0] != machine or not (parts[1].isdigit() and parts[2].isdigit()):
            continue  # another machine's, an earlier version's, or not ours
        pid, start = int(parts[1]), int(parts[2])
        if pid > 0 and not _alive(pid, start):
            try:
                os.unlink(entry.path)
            except OSError:
                pass  # removed meanwhile, or not ours to remove


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
        raise StateFileError(f"{target}: cannot read state file: {e}", str(target), e.errno) from e
    if _digest(payload) != digest:
        raise StateError(f"{target}: checksum mismatch, the file is corrupted")
    try:
        return decode(payload)
    except StateError as e:
        raise type(e)(f"{target}: {e}") from e
