"""The whole-file cache: downloaded shards in a local folder, under a byte budget, shared
by the workers of a job and by several jobs on one node.

Layout of the folder::

    data/<key>              complete files, and only those (a file appears by rename)
    tmp/<key>.<pid>.<rand>  downloads in progress (or left by a killed downloader)
    locks/<key>.lock        one lock file per key (empty; kept)

``<key>`` is the file's SHA-256 when its metadata gives one (moved copies of the same
data share entries), otherwise a hash of its URL, size and version (the store's ETag,
else its modification time: see ``Storage``), followed by the file's name.

How processes agree (``fcntl.flock`` locks, released by the kernel when a process dies):

* **Download**: under an exclusive lock on ``locks/<key>.lock``, into ``tmp/``, fsynced,
  then renamed into ``data/``. Whoever finds the lock taken waits for the file to appear
  (one download, everyone reads the complete file); a wait during which the holder's
  temporary file does not grow for ``stall_timeout`` seconds is a
  :class:`~savable_loader.errors.StorageError`, never a hang. A killed download leaves
  only its temporary file, which the next holder of the lock (or an eviction) removes.
* **Use**: a :class:`CachedFile` holds a shared lock on the file from the moment it is
  handed out until it is closed, so an eviction never removes a file in use.
* **Eviction** (least recently used first: every use touches the file's mtime): before a
  download, files are removed until the new one fits in ``max_bytes``; files in use are
  skipped, so the cache exceeds its budget only by files in use (a ``RuntimeWarning``
  says so, once).

Lock and lease descriptors inherited through a ``fork`` are closed in the child (closing
never releases the parent's locks): a forked worker never pins the parent's files.

Example::

    cache = ShardCache("/local/cache", max_bytes=50 * 2**30)
    with cache.fill(key, size, lambda f: f.write(data), url=url) as cached:
        np.load(cached.path)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from savable_loader.errors import LoaderUsageError, StorageError

__all__ = ["CachedFile", "ShardCache", "cache_key"]

_HELD: set[int] = set()  # descriptors holding our locks in this process


def _forget_inherited() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)  # a close, not an unlock: the parent keeps its locks
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)


def _open_held(path: Path, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    _HELD.add(fd)
    return fd


def _close_held(fd: int) -> None:
    _HELD.discard(fd)
    os.close(fd)


def cache_key(url: str, size: int | None, sha256: str | None = None, etag: str | None = None) -> str:
    """The cache's name for a file: its SHA-256 when known (moved copies share it), else
    a hash of URL, size and ``etag`` (the store's version of the file: its ETag, or
    another stamp of its content such as its modification time); then the file's name.

    Example::

        cache_key("s3://bucket/train/shard-00001.tar", 1048576)   # '5d1c...-shard-00001.tar'
    """
    if sha256:
        ident = sha256.lower()
    else:
        ident = hashlib.blake2b(f"{url}\0{size}\0{etag or ''}".encode(), digest_size=16).hexdigest()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", url.rsplit("/", 1)[-1])[-80:].lstrip(".")
    return f"{ident}-{name}"


class CachedFile:
    """A complete file of the cache, kept from eviction until :meth:`close` (a shared
    lock on it). ``path`` is the local file to open; ``size`` its size in bytes.

    Example::

        with storage.open("shard-00003.npy") as cached:
            array = np.load(cached.path, mmap_mode="r")
    """

    def __init__(self, path: Path, size: int, fd: int | None = None) -> None:
        self.path = path
        self.size = size
        self._fd = fd
        self._pid = os.getpid()

    def close(self) -> None:
        """Release the file: from now on an eviction may remove it.

        Example::

            cached = storage.open(ref); ...; cached.close()
        """
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():  # after a fork the number is not ours
            _close_held(fd)

    def __enter__(self) -> CachedFile:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CachedFile({str(self.path)!r}, size={self.size})"


class ShardCache:
    """Whole files in ``folder``, at most ``max_bytes`` of them (None: no limit) beside
    the files in use. See the module docstring for the layout and the locking.

    Example::

        cache = ShardCache("/local/cache", max_bytes=50 * 2**30)
        cache.usage()   # {'bytes': ..., 'files': ..., 'in_use': ...}
    """

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int | None) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise LoaderUsageError(f"cache_bytes is {max_bytes!r}; expected an int >= 0 or None (no limit)")
        self.folder = Path(folder).expanduser()
        self.max_bytes = max_bytes
        self._runtime: tuple[int, threading.Condition] | None = None
        self._warned = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_runtime": None}

    def __repr__(self) -> str:
        return f"ShardCache({str(self.folder)!r}, max_bytes={self.max_bytes})"

    def _cond(self) -> threading.Condition:
        runtime = self._runtime
        if runtime is None or runtime[0] != os.getpid():
            self._runtime = runtime = (os.getpid(), threading.Condition())
        return runtime[1]

    def _dirs(self) -> tuple[Path, Path, Path]:
        data, tmp, locks = self.folder / "data", self.folder / "tmp", self.folder / "locks"
        try:
            for d in (data, tmp, locks):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(
                f"cache_dir {self.folder}: cannot create the cache there ({e.strerror or e})",
                str(self.folder),
                None,
                1,
                str(e),
            ) from e
        return data, tmp, locks

    # -- using complete files ---------------------------------------------------------

    def lookup(self, key: str, size: int | None) -> CachedFile | None:
        """The complete file ``key`` (held until closed), or None if the cache lacks it.

        A file whose size is not ``size`` is ignored (the next download replaces it).

        Example::

            cached = cache.lookup(key, 1048576)
        """
        path = self.folder / "data" / key
        try:
            fd = _open_held(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StorageError(f"{path}: cannot open the cached file ({e.strerror or e})", str(path)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for an eviction deciding on it
            st = os.fstat(fd)
            now = os.stat(path)
            if (st.st_ino, st.st_dev) != (now.st_ino, now.st_dev) or (size is not None and st.st_size != size):
                raise FileNotFoundError(path)  # evicted or replaced meanwhile, or not the expected file
        except FileNotFoundError:
            _close_held(fd)
            return None
        except BaseException:
            _close_held(fd)
            raise
        try:
            os.utime(path)  # least recently used first
        except OSError:
            pass
        return CachedFile(path, st.st_size, fd)

    def fill(
        self,
        key: str,
        size: int | None,
        write: Callable[[IO[bytes]], None],
        *,
        url: str,
        stall_timeout: float = 120.0,
    ) -> CachedFile:
        """The complete file ``key``: from the cache, or written by ``write(file)`` (once
        for every process that asks at the same time), checked to hold ``size`` bytes.

        ``write`` raises to abandon the download (its temporary file is removed).

        Example::

            cached = cache.fill(key, len(data), lambda f: f.write(data), url="memory://x")
        """
        data, tmp_dir, locks = self._dirs()
        while True:
            cached = self.lookup(key, size)
            if cached is not None:
                return cached
            lock = self._lock(key, size, locks / f"{key}.lock", tmp_dir, url, stall_timeout)
            if lock is None:
                continue  # someone else completed it: use theirs
            try:
                cached = self.lookup(key, size)
                if cached is not None:
                    return cached
                self._remove_parts(tmp_dir, key)  # we hold the lock: those writers are dead
                self.evict(incoming=size or 0)
                return self._write(key, size, write, data, tmp_dir, url)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
                _close_held(lock)
                cond = self._cond()
                with cond:
                    cond.notify_all()

    def _write(
        self, key: str, size: int | None, write: Callable[[IO[bytes]], None], data: Path, tmp_dir: Path, url: str
    ) -> CachedFile:
        tmp = tmp_dir / f"{key}.{os.getpid()}.{os.urandom(4).hex()}"
        fd = _open_held(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # the lease of the finished file: taken before it is visible
            with os.fdopen(fd, "wb", closefd=False) as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                written = f.tell()
            if size is not None and written != size:
                raise StorageError(f"{url}: the download wrote {written} bytes, {size} expected", url)
            os.replace(tmp, data / key)
        except BaseException as e:
            _close_held(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(
                    f"{url}: cannot write its copy in cache_dir {self.folder} ({e.strerror or e})", url, None, 1, str(e)
                ) from e
            raise
        _fsync_dir(data)
        return CachedFile(data / key, written, fd)

    def _lock(
        self, key: str, size: int | None, lock_path: Path, tmp_dir: Path, url: str, stall_timeout: float
    ) -> int | None:
        """The exclusive download lock of ``key``, or None once another process has
        completed the file. Raises when the holder makes no progress for ``stall_timeout``."""
        fd = _open_held(lock_path, os.O_RDWR | os.O_CREAT)
        last, since, delay = -1, time.monotonic(), 0.002
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    pass
                if self._complete(key, size):
                    _close_held(fd)
                    return None
                cond = self._cond()
                with cond:
                    cond.wait(delay)  # woken at once by a download of this process
                delay = min(delay * 2, 0.1)
                progress = self._parts_size(tmp_dir, key)
                if progress != last:
                    last, since = progress, time.monotonic()
                elif time.monotonic() - since > stall_timeout:
                    raise StorageError(
                        f"{url}: another process has been downloading it into cache_dir {self.folder} for "
                        f"{stall_timeout:g} s without progress (its lock is {lock_path})",
                        url,
                        None,
                        0,
                        "a stalled download",
                    )
        except BaseException:
            if fd in _HELD:
                _close_held(fd)
            raise

    def _complete(self, key: str, size: int | None) -> bool:
        try:
            st = os.stat(self.folder / "data" / key)
        except OSError:
            return False
        return size is None or st.st_size == size

    @staticmethod
    def _parts(tmp_dir: Path, key: str | None = None) -> list[os.DirEntry[str]]:
        try:
            entries = list(os.scandir(tmp_dir))
        except OSError:
            return []
        return [e for e in entries if key is None or e.name.rsplit(".", 2)[0] == key]

    def _parts_size(self, tmp_dir: Path, key: str) -> int:
        total = 0
        for e in self._parts(tmp_dir, key):
            try:
                total += e.stat().st_size
            except OSError:
                pass
        return total

    def _remove_parts(self, tmp_dir: Path, key: str) -> None:
        for e in self._parts(tmp_dir, key):
            try:
                os.unlink(e.path)
            except OSError:
                pass

    # -- budget -----------------------------------------------------------------------

    def _sweep_dead_parts(self, tmp_dir: Path, locks: Path) -> int:
        """Remove temporary files whose download lock is free (their writer died); the
        bytes of live downloads."""
        live = 0
        for key in {e.name.rsplit(".", 2)[0] for e in self._parts(tmp_dir)}:
            try:
                fd = _open_held(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live += self._parts_size(tmp_dir, key)
            else:
                self._remove_parts(tmp_dir, key)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                _close_held(fd)
        return live

    def _entries(self) -> list[tuple[int, int, str]]:
        out = []
        try:
            scan = list(os.scandir(self.folder / "data"))
        except OSError:
            return []
        for e in scan:
            try:
                st = e.stat()
            except OSError:
                continue
            out.append((st.st_mtime_ns, st.st_size, e.name))
        return out

    def _try_remove(self, name: str) -> bool:
        path = self.folder / "data" / name
        try:
            fd = _open_held(path, os.O_RDONLY)
        except FileNotFoundError:
            return True  # someone else removed it
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_ino, st.st_dev) != (now.st_ino, now.st_dev):
                return False
            os.unlink(path)
            return True
        except (BlockingIOError, FileNotFoundError):
            return False  # in use, or gone
        finally:
            _close_held(fd)

    def evict(self, incoming: int = 0) -> int:
        """Remove least recently used files not in use until ``incoming`` more bytes fit in
        the budget; also removes temporary files of dead downloads. Returns the bytes freed.

        Example::

            cache.evict()   # after lowering max_bytes
        """
        _, tmp_dir, locks = self._dirs()
        live = self._sweep_dead_parts(tmp_dir, locks)
        if self.max_bytes is None:
            return 0
        entries = sorted(self._entries())
        excess = live + sum(size for _, size, _ in entries) + incoming - self.max_bytes
        freed = 0
        for _, size, name in entries:
            if excess <= 0:
                break
            if self._try_remove(name):
                excess -= size
                freed += size
        if excess > 0 and not self._warned:
            self._warned = True
            warnings.warn(
                f"shard cache {self.folder}: {excess} bytes over its budget of {self.max_bytes} bytes, held by files "
                "in use; give cache_bytes room for (prefetch + 1) shards per worker and job",
                RuntimeWarning,
                stacklevel=2,
            )
        return freed

    def usage(self) -> dict[str, int]:
        """``{"bytes", "files", "in_use"}``: what the complete files take, how many there
        are, how many of them are in use (by any process).

        Example::

            cache.usage()["bytes"] <= cache.max_bytes   # unless files in use exceed it
        """
        entries = self._entries()
        in_use = 0
        for _, _, name in entries:
            try:
                fd = _open_held(self.folder / "data" / name, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                in_use += 1
            finally:
                _close_held(fd)
        return {"bytes": sum(s for _, s, _ in entries), "files": len(entries), "in_use": in_use}

    def clear(self) -> int:
        """Remove every file not in use (and dead downloads); returns how many files went.

        Example::

            ShardCache("/local/cache", None).clear()
        """
        _, tmp_dir, locks = self._dirs()
        self._sweep_dead_parts(tmp_dir, locks)
        return sum(self._try_remove(name) for _, _, name in self._entries())


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
