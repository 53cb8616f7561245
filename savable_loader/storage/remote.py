"""A folder where files live: a local path or an fsspec URL, plus ``storage_options``.

``Remote`` holds the URL and the options as plain data (it pickles as them); the fsspec
filesystem is opened on first use in each process, again after a fork, so ``fork``,
``spawn`` and ``forkserver`` workers all work (a client created before a fork is never
used in the child, nor closed there: see ``_abandon_inherited``). Local folders (a path,
or ``file://``) are read with plain file I/O: they need neither fsspec nor a cache.

Every remote call goes through the :class:`~savable_loader.storage.retry.RetryPolicy`
with a timeout per attempt: an async filesystem (``s3://``, ``gs://``, ``az://``,
``http(s)://``) cancels the attempt on fsspec's event loop; a blocking one (``hf://``...)
runs it in a helper thread that is abandoned when it does not answer in time;
``memory://`` is in the process and is called directly. For ``s3://`` the backend's own
retries are turned off (``retries=1`` for s3fs, ``total_max_attempts=1`` and connect /
read timeouts for botocore, unless ``config_kwargs`` sets them), for ``az://`` the Azure
SDK's: one policy decides. ``gcsfs`` and ``huggingface_hub`` keep a few quick retries of
their own inside each attempt (no option turns them off); the attempt's timeout bounds them.

Ranged reads are length-checked: fewer bytes is a short read (retried), more bytes means
the server ignored ``Range`` (fsspec then hands back the whole file), a
:class:`~savable_loader.errors.RangeIgnoredError`.

Example::

    remote = Remote("s3://bucket/train", {"endpoint_url": "http://127.0.0.1:9000"})
    header = remote.read_range("shard-00000.tar", 0, 512)
"""

from __future__ import annotations

import copy
import email.utils
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from savable_loader.errors import LoaderUsageError, RangeIgnoredError, StorageError
from savable_loader.storage.retry import RetryPolicy, ShortRead, describe

__all__ = ["Remote", "normalize_etag"]

_LOCAL_PROTOCOLS = ("file", "local")
_IN_PROCESS_PROTOCOLS = ("memory",)

#: The filesystems this process opened, weakly held and keyed by id: fsspec filesystems of
#: the same URL and options compare equal, a ``WeakSet`` would keep only one of them.
_OPENED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
#: The filesystems a forked child inherited: held until the child exits, never closed.
_INHERITED: list[Any] = []


def _abandon_inherited() -> None:
    """In a child just forked: make sure the filesystems the parent opened are never
    closed, finalized or garbage-collected here.

    Their sessions, connection pools and event loop belong to the parent, whose event loop
    thread does not exist in the child. Closing one there (fsspec's finalizer, when the
    child drops it) waits on that loop until a timeout (a second for ``http(s)://``), then
    closes the pooled connections through the loop's selector, an epoll instance the child
    shares with the parent: the parent's sockets leave its epoll set and its next request
    on one of them hangs until its timeout. So the child detaches their finalizers and
    holds them until it exits (their sockets are the parent's copies, closed with the
    child); :meth:`Remote.filesystem` opens a fresh filesystem for the child.
    """
    inherited = list(_OPENED.values())
    _OPENED.clear()
    for fs in inherited:
        for ref in weakref.getweakrefs(fs):
            finalizer = getattr(ref, "__callback__", None)
            if isinstance(finalizer, weakref.finalize):
                finalizer.detach()
    _INHERITED.extend(inherited)


if hasattr(os, "register_at_fork"):  # POSIX; spawn and forkserver children inherit nothing
    os.register_at_fork(after_in_child=_abandon_inherited)


def _protocol(url: str) -> str:
    parts = re.split(r"(::|://)", url, maxsplit=1)
    return parts[0] if len(parts) > 1 and len(parts[0]) > 1 else "file"  # "C:\\" is a path


def normalize_etag(value: Any) -> str | None:
    """An ETag as metadata records it: without quotes and without the weak ``W/`` prefix.

    Example::

        normalize_etag('"9b2cf535f27731c974343645a3985328"')   # '9b2cf535f27731c974343645a3985328'
    """
    if value is None:
        return None
    text = str(value).strip()
    text = text.removeprefix("W/")
    return text.strip('"')


def _checked_path(path: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path:
        raise LoaderUsageError(f"a file path inside a storage location must be relative, without '..', got {path!r}")
    return p.as_posix()


class Remote:
    """A folder given as a local path or an fsspec URL, and how to reach it.

    ``storage_options`` are passed to the fsspec filesystem (credentials, an endpoint, a
    region...); they must pickle, since every worker process opens its own filesystem.

    Example::

        remote = Remote("https://example.org/data")
        remote.info("metadata.json")["size"]
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        text = os.fspath(url)
        if not isinstance(text, str) or not text:
            raise LoaderUsageError(f"a storage location must be a non-empty path or URL, got {url!r}")
        if storage_options is not None and (
            not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options)
        ):
            raise LoaderUsageError(f"storage_options must be a dict with str keys, got {storage_options!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise LoaderUsageError(f"retry must be a savable_loader.storage.RetryPolicy, got {retry!r}")
        self.protocol = _protocol(text)
        self.is_local = self.protocol in _LOCAL_PROTOCOLS and "::" not in text
        if self.is_local:
            self.root = Path(re.sub(r"^(file|local)://", "", text))
            self.url = str(self.root)
        else:
            self.url = text.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self._fs: tuple[int, Any] | None = None
        self._fs_lock: tuple[int, threading.Lock] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The filesystem (sessions, event loops, sockets) stays in the process that opened it.
        return {**self.__dict__, "_fs": None, "_fs_lock": None}

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def url_of(self, path: str) -> str:
        """The full URL (or local path) of ``path``, a file inside the folder.

        Example::

            Remote("s3://bucket/train").url_of("a/shard-0.tar")   # 's3://bucket/train/a/shard-0.tar'
        """
        rel = _checked_path(path)
        return str(self.root / rel) if self.is_local else f"{self.url}/{rel}"

    # -- the filesystem, one per process ----------------------------------------------

    def filesystem(self) -> Any:
        """This process's fsspec filesystem (opened on first use, again after a fork).

        Example::

            Remote("memory://data").filesystem().pipe("/data/x", b"abc")
        """
        pid = os.getpid()
        fs = self._fs
        if fs is not None and fs[0] == pid:
            return fs[1]
        lock = self._fs_lock
        if lock is None or lock[0] != pid:  # a lock inherited through a fork may be held forever
            self._fs_lock = lock = (pid, threading.Lock())
        with lock[1]:
            if self._fs is None or self._fs[0] != pid:
                self._fs = (pid, self._open_filesystem())
            return self._fs[1]

    def _open_filesystem(self) -> Any:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a dependency
            raise StorageError(f"{self.url}: reading remote files needs fsspec ({e})", self.url) from e
        options = copy.deepcopy(self.storage_options)
        if self.protocol in ("s3", "s3a"):
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            config.setdefault("connect_timeout", self.retry.timeout)
            config.setdefault("read_timeout", self.retry.timeout)
            options["config_kwargs"] = config
        try:
            fs, _ = fsspec.core.url_to_fs(self.url, **{"skip_instance_cache": True, **options})
        except ImportError as e:
            extra = {
                "s3": "s3",
                "s3a": "s3",
                "gs": "gcs",
                "gcs": "gcs",
                "az": "azure",
                "abfs": "azure",
                "abfss": "azure",
                "hf": "hf",
                "http": "http",
                "https": "http",
            }.get(self.protocol)
            hint = f"pip install 'savable_loader[{extra}]'" if extra else "install the fsspec backend it names"
            raise StorageError(
                f"{self.url}: the {self.protocol!r} backend is not installed ({e}); {hint}", self.url
            ) from e
        except Exception as e:
            raise StorageError(f"{self.url}: cannot open the filesystem ({type(e).__name__}: {e})", self.url) from e
        if self.protocol in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
            fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option): ours decides
        if self.protocol in ("az", "abfs", "abfss"):
            _no_azure_retries(fs)
        _OPENED[id(fs)] = fs  # a fork abandons it in the child (_abandon_inherited)
        return fs

    def _call(self, method: str, url: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(path, *args, **kwargs)``, given up after ``timeout`` seconds."""
        fs = self.filesystem()
        path = fs._strip_protocol(url)
        if getattr(fs, "async_impl", False):
            from fsspec.asyn import sync

            return sync(fs.loop, getattr(fs, f"_{method}"), path, *args, timeout=timeout, **kwargs)
        call = getattr(fs, method)
        if self.protocol in _IN_PROCESS_PROTOCOLS:
            return call(path, *args, **kwargs)
        return _in_thread(lambda: call(path, *args, **kwargs), timeout)

    # -- reads ------------------------------------------------------------------------

    def info(self, path: str) -> dict[str, Any]:
        """``{"size": int or None, "etag": str or None, "stamp": int}`` of a file
        (retried): ``stamp`` is its modification time in nanoseconds when the store
        reports one, else 0.

        Example::

            remote.info("shard-00000.tar")   # {'size': 1048576, 'etag': '9b2c...', 'stamp': 17...}
        """
        url = self.url_of(path)
        if self.is_local:
            try:
                st = os.stat(url)
            except OSError as e:
                raise StorageError(f"{url}: {type(e).__name__}: {e.strerror or e}", url, None, 1, str(e)) from e
            return {"size": st.st_size, "etag": None, "stamp": st.st_mtime_ns}
        raw = self.retry.call(lambda t: self._call("info", url, t), url=url)
        etag = next((raw[k] for k in ("ETag", "etag", "Etag") if raw.get(k)), None)
        size = raw.get("size")
        return {"size": int(size) if size is not None else None, "etag": normalize_etag(etag), "stamp": _stamp(raw)}

    def stat(self, path: str) -> tuple[int, int]:
        """``(size, stamp)`` of a file (retried): the stamp is its modification time in
        nanoseconds when the store reports one, else 0. For the indexer.

        Example::

            size, stamp = remote.stat("shard-00000.tar")
        """
        url = self.url_of(path)
        if self.is_local:
            st = os.stat(url)
            return st.st_size, st.st_mtime_ns
        try:
            raw = self.retry.call(lambda t: self._call("info", url, t), url=url)
        except StorageError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise FileNotFoundError(url) from e
            raise
        return int(raw.get("size") or 0), _stamp(raw)

    def find(self) -> list[str]:
        """Every file under the folder, as sorted relative POSIX paths (retried). For the
        indexer.

        Example::

            Remote("memory://data").find()   # ['metadata.json', 'shard-0.tar', ...]
        """
        if self.is_local:
            return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        url = self.url
        found = self.retry.call(lambda t: self._call("find", url, t), url=url)
        root = self.filesystem()._strip_protocol(url).rstrip("/")
        out = []
        for name in found:
            name = str(name)
            if name.startswith(root + "/"):
                out.append(name[len(root) + 1 :])
        return sorted(out)

    def write(self, path: str, data: bytes) -> None:
        """Write a whole small file (retried: a whole-object write is idempotent). For the
        indexer (``metadata.json``, tar indexes); never used on a shard.

        Example::

            remote.write("metadata.json", encoded)
        """
        url = self.url_of(path)
        if self.is_local:
            Path(url).write_bytes(data)
            return
        self.retry.call(lambda t: self._call("pipe_file", url, t, bytes(data)), url=url)

    def read(self, path: str, missing_ok: bool = False) -> bytes | None:
        """The whole file (retried): for small files such as ``metadata.json``. With
        ``missing_ok``, None when the file does not exist (a ``StorageError`` otherwise).

        Example::

            meta = json.loads(remote.read("metadata.json"))
        """
        url = self.url_of(path)
        if self.is_local:
            try:
                return Path(url).read_bytes()
            except (FileNotFoundError, NotADirectoryError) as e:
                if missing_ok:
                    return None
                raise StorageError(f"{url}: {type(e).__name__}: {e.strerror or e}", url, None, 1, str(e)) from e
            except OSError as e:
                raise StorageError(f"{url}: {type(e).__name__}: {e.strerror or e}", url, None, 1, str(e)) from e
        try:
            return self.retry.call(lambda t: bytes(self._call("cat_file", url, t)), url=url)
        except StorageError as e:
            if missing_ok and isinstance(e.__cause__, FileNotFoundError):
                return None
            raise

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, exactly ``end - start`` of them (retried;
        fewer is a short read, more a :class:`RangeIgnoredError`).

        Example::

            remote.read_range("shard-00000.tar", 0, 512)   # the first tar header
        """
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise LoaderUsageError(f"a byte range must be 0 <= start <= end, got [{start!r}, {end!r})")
        url = self.url_of(path)
        if start == end:
            return b""
        if self.is_local:
            return self._read_local(url, start, end)

        def attempt(timeout: float) -> bytes:
            data = self._call("cat_file", url, timeout, start=start, end=end)
            return check_length(data, url, start, end)

        return self.retry.call(attempt, url=url, byte_range=(start, end))

    def _read_local(self, url: str, start: int, end: int) -> bytes:
        try:
            with open(url, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        except OSError as e:
            raise StorageError(
                f"{describe(url, (start, end))}: {type(e).__name__}: {e.strerror or e}", url, (start, end), 1, str(e)
            ) from e
        if len(data) != end - start:
            raise StorageError(
                f"{describe(url, (start, end))}: the file ends after {start + len(data)} bytes",
                url,
                (start, end),
                1,
                "end of file",
            )
        return data


def _no_azure_retries(fs: Any) -> None:
    """Turn off the Azure SDK's own retries (3 of them, 15 s apart at first) on an adlfs
    filesystem, as ``s3fs``'s are: one policy decides. adlfs has no option for it; its
    client's retry policy is reached through the client's configuration (a no-op when the
    layout differs)."""
    policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if isinstance(getattr(policy, name, None), int):
            setattr(policy, name, 0)


def _stamp(raw: Mapping[str, Any]) -> int:
    """A file's modification time in nanoseconds from an fsspec ``info`` dict, else 0."""
    for k in ("LastModified", "last_modified", "mtime", "created", "Last-Modified"):
        value: Any = raw.get(k)
        stamp = 0
        if hasattr(value, "timestamp"):
            stamp = int(value.timestamp() * 1e9)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            stamp = int(value * 1e9)
        elif isinstance(value, str):
            try:
                stamp = int(email.utils.parsedate_to_datetime(value).timestamp() * 1e9)
            except (TypeError, ValueError, IndexError):
                stamp = 0
        if stamp:
            return stamp
    return 0


def check_length(data: bytes, url: str, start: int, end: int) -> bytes:
    """``data`` if it is the ``end - start`` bytes asked for; :class:`ShortRead` if fewer,
    :class:`RangeIgnoredError` if more.

    Example::

        check_length(fs.cat_file(path, start=0, end=512), url, 0, 512)
    """
    n, want = len(data), end - start
    if n == want:
        return bytes(data)
    if n < want:
        raise ShortRead(f"{describe(url, (start, end))}: got {n} of {want} bytes")
    raise RangeIgnoredError(
        f"{describe(url, (start, end))}: the server sent {n} bytes for a range of {want}: it ignores the Range "
        "header (Python's http.server does). Serve the files from a server that honours Range (nginx, a bucket)",
        url,
        (start, end),
        1,
        f"{n} bytes for a range of {want}",
    )


def _in_thread(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread, abandoned after ``timeout`` seconds (a ``TimeoutError``)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            error.append(e)

    thread = threading.Thread(target=run, name="savable_loader-storage-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout:.1f} s")
    if error:
        raise error[0]
    return result[0]
