"""Storage: a dataset's files wherever they live, as local files to read.

``Storage(url, storage_options=..., cache_dir=..., cache_bytes=..., prefetch=2)`` joins
the pieces of this package:

* a local folder is read in place (no copy, no fsspec); its files are checked against
  the size their metadata gives;
* a remote folder (any fsspec URL) is read through the whole-file cache
  (:class:`~savable_loader.storage.cache.ShardCache`): ``open(file)`` downloads the file
  once per node (in ranged requests of ``chunk_bytes``, up to ``parallel_requests`` of
  them in flight, each retried and length-checked),
  checks its size, ETag and SHA-256 against the metadata when it has them, and hands out
  the local copy;
* ``prefetch(files)`` names the files this process will open next, in order: background
  threads download the first ``prefetch`` of them (up to ``parallel_requests`` files at
  once, the first named first) and keep them from
  eviction until they are opened or no longer named. A failed prefetch is not an error:
  the ``open`` that needs the file downloads it again, under the full retry policy;
* ``read_range(file, start, end)`` reads some bytes of one file (the cached copy if there
  is one, otherwise a ranged request): for reading one sample alone (``restore_sample``,
  inspection), not for iterating.

A ``Storage`` pickles as its settings (URL, options, cache folder and budget, retry
policy); clients, threads and held files belong to the process that made them. Nothing
of it enters a loader state: where the files are, and whether a cache holds them, never
changes what is read.

Example::

    storage = Storage("s3://bucket/train", storage_options={"anon": True}, cache_dir="/local/cache")
    storage.prefetch([FileRef("shard-00001.tar", size=1 << 30), FileRef("shard-00002.tar", size=1 << 30)])
    with storage.open(FileRef("shard-00000.tar", size=1 << 30)) as cached:
        data = cached.path.read_bytes()
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import cloudpickle

from savable_loader.errors import IntegrityError, LoaderUsageError, StorageError
from savable_loader.storage.cache import CachedFile, ShardCache, cache_key
from savable_loader.storage.remote import Remote, normalize_etag
from savable_loader.storage.retry import RetryPolicy

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_CHUNK_BYTES", "FileRef", "Storage", "default_cache_dir"]

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 20 * 2**30
DEFAULT_CHUNK_BYTES = 16 * 2**20
IDLE_EXIT = 10.0  # seconds a prefetch thread waits for work before it ends


def default_cache_dir() -> Path:
    """``$SAVABLE_LOADER_CACHE``, else ``$XDG_CACHE_HOME/savable_loader``, else
    ``~/.cache/savable_loader``: one folder shared by the jobs of a user on a node.

    Example::

        Storage("s3://bucket/train").cache.folder == default_cache_dir()
    """
    if os.environ.get("SAVABLE_LOADER_CACHE"):
        return Path(os.environ["SAVABLE_LOADER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "savable_loader"


@dataclass(frozen=True)
class FileRef:
    """A file inside a storage location, and what its metadata says about it: ``size``
    in bytes, ``sha256`` (hex), ``etag`` (as the store reports it, quotes optional). Each
    given value is checked when the file is downloaded (the size also when a local file
    or a cached copy is opened). Without a SHA-256 (which names the content), every
    ``open`` of a remote file first asks the store for its size, ETag and modification
    time (one request), so that a file changed in place, even to the same size, is never
    served from the cache.

    Example::

        FileRef("shard-00000.tar", size=1048576, sha256="9f86d081884c7d65...")
    """

    path: str
    size: int | None = None
    sha256: str | None = None
    etag: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise LoaderUsageError(f"FileRef path must be a non-empty str, got {self.path!r}")
        if self.size is not None and (not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0):
            raise LoaderUsageError(f"FileRef({self.path!r}) size is {self.size!r}; expected an int >= 0 or None")
        if self.sha256 is not None and not (
            isinstance(self.sha256, str) and re.fullmatch(r"[0-9a-fA-F]{64}", self.sha256)
        ):
            raise LoaderUsageError(f"FileRef({self.path!r}) sha256 is {self.sha256!r}; expected 64 hex digits or None")
        if self.etag is not None and not isinstance(self.etag, str):
            raise LoaderUsageError(f"FileRef({self.path!r}) etag is {self.etag!r}; expected a str or None")


def _ref(file: FileRef | str) -> FileRef:
    if isinstance(file, FileRef):
        return file
    if isinstance(file, str):
        return FileRef(file)
    raise LoaderUsageError(f"a file must be a FileRef or a path str, got {file!r}")


class Storage:
    """Files under ``url`` (a local folder or any fsspec URL), read as local files.

    * ``storage_options``: passed to the fsspec filesystem (credentials, endpoint,
      region...); they must pickle: every worker process opens its own filesystem.
    * ``cache_dir``: where remote files are kept (default :func:`default_cache_dir`);
      ``cache_bytes``: its budget (default 20 GiB, ``None`` for no limit), exceeded only
      by files in use. Local folders are not cached.
    * ``prefetch``: how many of the files named by :meth:`prefetch` are downloaded ahead
      (default 2; 0 turns prefetching off).
    * ``retry``: the :class:`~savable_loader.storage.RetryPolicy` of every request.
    * ``chunk_bytes``: the size of the ranged requests a download is made of (default
      16 MiB), ``parallel_requests``: how many of them are in flight at once (default 4).
    * ``verify_local_sha256``: for a local folder, also check each file's SHA-256 (when
      its metadata records one) the first time a process opens it; the default checks the
      size only. The cost: one more read of every file per process (SHA-256 hashes
      about 0.5-2 GB/s per core), so off by default. Downloads are always checked.

    ``downloads`` and ``downloaded_bytes`` count this process's downloads (monitoring,
    not state). See the module docstring for what each method does.

    Example::

        storage = Storage("https://example.org/data", cache_dir="/tmp/cache", cache_bytes=10 * 2**30)
        with storage.open(FileRef("shard-00000.npy", size=8128)) as cached:
            array = np.load(cached.path)
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | None = DEFAULT_CACHE_BYTES,
        prefetch: int = 2,
        retry: RetryPolicy | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        parallel_requests: int = 4,
        verify_local_sha256: bool = False,
    ) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise LoaderUsageError(f"prefetch is {prefetch!r}; expected an int >= 0 (files downloaded ahead)")
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
            raise LoaderUsageError(f"chunk_bytes is {chunk_bytes!r}; expected an int >= 1")
        if not isinstance(parallel_requests, int) or isinstance(parallel_requests, bool) or parallel_requests < 1:
            raise LoaderUsageError(f"parallel_requests is {parallel_requests!r}; expected an int >= 1")
        self.remote = Remote(url, storage_options, retry)
        if storage_options:
            try:
                cloudpickle.dumps(dict(storage_options))
            except Exception as e:  # noqa: BLE001 - any pickling failure
                raise LoaderUsageError(
                    f"storage_options must pickle (every worker process opens its own filesystem): "
                    f"{type(e).__name__}: {e}"
                ) from None
        self.cache: ShardCache | None = None
        if not self.remote.is_local:
            self.cache = ShardCache(cache_dir if cache_dir is not None else default_cache_dir(), cache_bytes)
        if not isinstance(verify_local_sha256, bool):
            raise LoaderUsageError(f"verify_local_sha256 is {verify_local_sha256!r}; expected a bool")
        self.verify_local_sha256 = verify_local_sha256
        self.prefetch_depth = prefetch
        self.chunk_bytes = chunk_bytes
        self.parallel_requests = parallel_requests
        self._token = os.urandom(8).hex()  # names copies of files whose store gives no version
        self._runtime: _Runtime | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_runtime": None}

    def __repr__(self) -> str:  # never the options: they may hold credentials
        cache = f", cache_dir={str(self.cache.folder)!r}" if self.cache is not None else ""
        return f"Storage({self.remote.url!r}{cache})"

    @property
    def url(self) -> str:
        """The location's URL (or local path), without a trailing slash.

        Example::

            Storage("s3://bucket/train/").url   # 's3://bucket/train'
        """
        return self.remote.url

    @property
    def is_local(self) -> bool:
        """Whether the files are read in place (a local folder): no cache, no prefetch.

        Example::

            Storage("/data/train").is_local   # True
        """
        return self.remote.is_local

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of every request.

        Example::

            Storage("s3://bucket/x", retry=RetryPolicy(attempts=3)).retry.attempts   # 3
        """
        return self.remote.retry

    def _rt(self) -> _Runtime:
        rt = self._runtime
        if rt is None or rt.pid != os.getpid():
            self._runtime = rt = _Runtime()
        return rt

    @property
    def downloads(self) -> int:
        """Files this process downloaded into the cache (monitoring, not state).

        Example::

            storage.downloads   # 0 when every file was already cached
        """
        return self._rt().downloads

    @property
    def downloaded_bytes(self) -> int:
        """Bytes this process downloaded into the cache.

        Example::

            storage.downloaded_bytes
        """
        return self._rt().downloaded_bytes

    # -- whole files ------------------------------------------------------------------

    def read(self, path: str, missing_ok: bool = False) -> bytes | None:
        """A small file, whole and uncached (``metadata.json``, an index), retried; with
        ``missing_ok``, None if it does not exist.

        Example::

            meta = json.loads(storage.read("metadata.json"))
        """
        return self.remote.read(path, missing_ok)

    def open(self, file: FileRef | str) -> CachedFile:
        """The file as a local file, held until closed: the file itself for a local
        folder, the cached copy (downloaded now unless cached or prefetched) otherwise.

        Raises :class:`~savable_loader.errors.IntegrityError` when its size, ETag or
        SHA-256 differs from ``file``'s, :class:`~savable_loader.errors.StorageError` when
        it cannot be read.

        Example::

            with storage.open(FileRef("shard-00000.npy", size=8128)) as cached:
                array = np.load(cached.path)
        """
        ref = _ref(file)
        if self.remote.is_local:
            return self._open_local(ref)
        rt = self._rt()
        held = rt.prefetcher.take(self.key(ref)) if rt.prefetcher is not None else None
        return held if held is not None else self._fetch(ref)

    def key(self, file: FileRef | str) -> str:
        """The name of ``file`` as its metadata describes it (see
        :func:`~savable_loader.storage.cache.cache_key`): the cache key of its copy when
        the metadata records its SHA-256 and size; otherwise the copy's key also names the
        version the store reports (ETag, else modification time), asked for at each open.

        Example::

            storage.key(FileRef("shard-00000.tar", size=1024))
        """
        ref = _ref(file)
        return cache_key(self.remote.url_of(ref.path), ref.size, ref.sha256, ref.etag)

    def _open_local(self, ref: FileRef) -> CachedFile:
        path = Path(self.remote.url_of(ref.path))
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise StorageError(f"{path}: {type(e).__name__}: {e.strerror or e}", str(path), None, 1, str(e)) from e
        if ref.size is not None and size != ref.size:
            raise integrity_mismatch(str(path), "size", ref.size, size)
        if self.verify_local_sha256 and ref.sha256 is not None:
            rt = self._rt()
            stamp = f"{path}:{size}:{os.stat(path).st_mtime_ns}"
            if stamp not in rt.verified:
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(8 * 2**20):
                        digest.update(chunk)
                if digest.hexdigest() != ref.sha256.lower():
                    raise integrity_mismatch(str(path), "sha256", ref.sha256.lower(), digest.hexdigest())
                rt.verified.add(stamp)
        return CachedFile(path, size)

    def _resolve(self, ref: FileRef) -> tuple[str, FileRef]:
        """The cache key of the file's current content, and ``ref`` with its size.

        A file whose metadata records its SHA-256 and size is named by them (its content:
        no request). Any other is asked for (one request), and its copy is named by URL,
        size and the store's version of the file: its ETag, else its modification time,
        else (a store that reports neither) this ``Storage``'s own token, so that a copy is
        shared by the workers of a job but never read by a later job. A file rewritten in
        place, even with the same size, is therefore never served from the cache."""
        if ref.sha256 is not None and ref.size is not None:
            return self.key(ref), ref
        info = self._checked_info(ref)
        size = ref.size if ref.size is not None else info["size"]
        ref = FileRef(ref.path, size, ref.sha256, ref.etag or info["etag"])
        if ref.sha256 is not None:
            return self.key(ref), ref
        if info["etag"]:
            version = f"etag:{info['etag']}"
        elif info["stamp"]:
            version = f"mtime:{info['stamp']}"
        else:
            version = f"storage:{self._token}"
        return cache_key(self.remote.url_of(ref.path), size, None, version), ref

    def _checked_info(self, ref: FileRef) -> dict[str, Any]:
        """The remote's ``info`` of ``ref``'s file, an ``IntegrityError`` where its size or
        ETag is not what ``ref`` records."""
        url = self.remote.url_of(ref.path)
        info = self.remote.info(ref.path)
        if ref.size is not None and info["size"] is not None and info["size"] != ref.size:
            raise integrity_mismatch(url, "size", ref.size, info["size"])
        if ref.etag is not None and info["etag"] is not None and normalize_etag(ref.etag) != info["etag"]:
            raise integrity_mismatch(url, "etag", normalize_etag(ref.etag), info["etag"])
        return info

    def _fetch(self, ref: FileRef) -> CachedFile:
        if self.cache is None:  # pragma: no cover - local folders return before
            raise StorageError(f"{self.url}: no cache for a local folder")
        key, ref = self._resolve(ref)
        cached = self.cache.lookup(key, ref.size)
        if cached is not None:
            return cached
        url = self.remote.url_of(ref.path)
        rt = self._rt()

        def download(f: IO[bytes]) -> None:
            written = self._download(ref, url, f)
            with rt.lock:
                rt.downloads += 1
                rt.downloaded_bytes += written

        policy = self.remote.retry
        return self.cache.fill(key, ref.size, download, url=url, stall_timeout=policy.deadline + policy.timeout + 5)

    def _download(self, ref: FileRef, url: str, f: IO[bytes]) -> int:
        info = self.remote.info(ref.path)
        size = info["size"]
        if ref.size is not None and size is not None and size != ref.size:
            raise integrity_mismatch(url, "size", ref.size, size)
        if ref.etag is not None and info["etag"] is not None and normalize_etag(ref.etag) != info["etag"]:
            raise integrity_mismatch(url, "etag", normalize_etag(ref.etag), info["etag"])
        total = ref.size if ref.size is not None else size
        digest = hashlib.sha256() if ref.sha256 else None
        if total is None:  # the server does not say: one whole request
            pieces: Any = [self.remote.read(ref.path) or b""]
        else:
            ranges = [(s, min(total, s + self.chunk_bytes)) for s in range(0, total, self.chunk_bytes)]
            pieces = self._ranges(ref.path, ranges)
        written = 0
        for data in pieces:
            f.write(data)
            written += len(data)
            if digest is not None:
                digest.update(data)
        if digest is not None and ref.sha256 is not None and digest.hexdigest() != ref.sha256.lower():
            raise integrity_mismatch(url, "sha256", ref.sha256.lower(), digest.hexdigest())
        return written

    def _ranges(self, path: str, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
        """The ranges' bytes in order, up to ``parallel_requests`` requests in flight."""
        if self.parallel_requests == 1 or len(ranges) == 1:
            for start, end in ranges:
                yield self.remote.read_range(path, start, end)
            return
        pool = ThreadPoolExecutor(self.parallel_requests, thread_name_prefix="savable_loader-download")
        pending: deque[Future[bytes]] = deque()
        try:
            for start, end in ranges:
                pending.append(pool.submit(self.remote.read_range, path, start, end))
                if len(pending) >= self.parallel_requests:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)

    # -- prefetch ---------------------------------------------------------------------

    def prefetch(self, files: Sequence[FileRef | str]) -> None:
        """Name the files this process will open next, in the order it will open them:
        the first ``prefetch`` are downloaded in the background (those already cached are
        just held), and files named before but not now are let go. Calling it again
        replaces the list; ``prefetch([])`` stops prefetching. Nothing happens for a local
        folder or with ``prefetch=0``.

        Example::

            storage.prefetch(upcoming[:2])     # while reading the current shard
            cached = storage.open(upcoming[0])  # no wait if the download finished
        """
        refs = [_ref(f) for f in files]
        if self.remote.is_local or self.prefetch_depth == 0:
            return
        rt = self._rt()
        if rt.prefetcher is None:
            if not refs:
                return
            rt.prefetcher = _Prefetcher(self, min(self.prefetch_depth, self.parallel_requests))
        rt.prefetcher.set([(self.key(r), r) for r in refs[: self.prefetch_depth]])

    def close(self) -> None:
        """Stop prefetching and let go of the files held for it (the cache keeps them).

        Example::

            storage.close()
        """
        rt = self._runtime
        if rt is not None and rt.pid == os.getpid() and rt.prefetcher is not None:
            rt.prefetcher.set([])

    # -- parts of files ---------------------------------------------------------------

    def read_range(self, file: FileRef | str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``file``: from the cached copy if the cache holds it,
        otherwise with one ranged request (retried and length-checked; a server that
        ignores ``Range`` is a :class:`~savable_loader.errors.RangeIgnoredError`). The
        first ranged request for a file in a process also checks its size and ETag.

        Example::

            header = storage.read_range(FileRef("shard-00000.tar", size=10240), 0, 512)
        """
        ref = _ref(file)
        if ref.size is not None and not (isinstance(end, int) and end <= ref.size):
            raise LoaderUsageError(
                f"{self.remote.url_of(ref.path)}: range [{start}, {end}) ends past the file's {ref.size} bytes"
            )
        if self.remote.is_local:
            if ref.size is not None:
                self._open_local(ref)  # size check
            return self.remote.read_range(ref.path, start, end)
        key = self.key(ref)
        if self.cache is not None and (ref.sha256 is None or ref.size is None):
            key, ref = self._resolve(ref)  # the store's version names the copy; size and ETag checked
            self._rt().verified.add(key)
        cached = self.cache.lookup(key, ref.size) if self.cache is not None and ref.size is not None else None
        if cached is not None:
            with cached, open(cached.path, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        rt = self._rt()
        if key not in rt.verified and (ref.size is not None or ref.etag is not None):
            self._checked_info(ref)
            rt.verified.add(key)
        return self.remote.read_range(ref.path, start, end)


def integrity_mismatch(url: str, field: str, expected: Any, found: Any) -> IntegrityError:
    """The :class:`~savable_loader.errors.IntegrityError` of a file whose ``field``
    (``size``, ``sha256``, ``etag``) is ``found`` where its metadata says ``expected``.

    Example::

        raise integrity_mismatch("/data/shard-0.tar", "sha256", expected_hex, found_hex)
    """
    what = {"size": "bytes", "sha256": "SHA-256", "etag": "ETag"}[field]
    if field == "size":
        text = f"{url}: the metadata says {expected} bytes, the file has {found}"
    else:
        text = f"{url}: the metadata's {what} is {expected}, the file's is {found}"
    return IntegrityError(
        f"{text}: the file changed since the metadata was written (write the metadata again, or restore the file)",
        url,
        field,
        expected,
        found,
    )


class _Runtime:
    """What a Storage holds in one process: counters, the prefetcher, checked files."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.downloads = 0
        self.downloaded_bytes = 0
        self.prefetcher: _Prefetcher | None = None
        self.verified: set[str] = set()


class _Prefetcher:
    """Background threads downloading the named files in order, up to ``parallel`` at
    once (the first named starts first), holding each until it is taken by ``open`` or no
    longer named."""

    def __init__(self, storage: Storage, parallel: int = 1) -> None:
        self.storage = storage
        self.parallel = max(1, parallel)
        self.cond = threading.Condition()
        self.wanted: list[tuple[str, FileRef]] = []  # still to download, in order
        self.named: set[str] = set()
        self.held: dict[str, CachedFile] = {}
        self.fetching: set[str] = set()  # being downloaded by a thread now
        self.failures: dict[str, str] = {}
        self.threads = 0

    def set(self, files: list[tuple[str, FileRef]]) -> None:
        with self.cond:
            self.named = {key for key, _ in files}
            for key in [k for k in self.held if k not in self.named]:
                self.held.pop(key).close()
            # a file held or being downloaded is not queued again (a second thread would
            # only wait on the cache's lock for it and keep a parallel slot busy)
            self.wanted = [(key, ref) for key, ref in files if key not in self.held and key not in self.fetching]
            while self.threads < min(self.parallel, len(self.wanted) + len(self.fetching)):  # (busy ones count)
                self.threads += 1
                threading.Thread(target=self._run, name="savable_loader-prefetch", daemon=True).start()
            self.cond.notify_all()

    def take(self, key: str) -> CachedFile | None:
        with self.cond:
            self.wanted = [(k, r) for k, r in self.wanted if k != key]  # the caller fetches it now
            self.named.discard(key)
            return self.held.pop(key, None)

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.wanted:
                    self.cond.wait(IDLE_EXIT)
                if not self.wanted:  # idle: the thread ends, the next set() starts another
                    self.threads -= 1
                    return
                key, ref = self.wanted.pop(0)
                self.fetching.add(key)
            try:
                cached = self.storage._fetch(ref)
            except Exception as e:  # noqa: BLE001 - the open that needs the file tries again
                self.failures[key] = f"{type(e).__name__}: {e}"
                log.debug("prefetch of %s failed: %s", ref.path, e)
                with self.cond:
                    self.fetching.discard(key)
                continue
            with self.cond:
                self.fetching.discard(key)
                if key in self.named and key not in self.held:
                    self.held[key] = cached
                else:
                    cached.close()
