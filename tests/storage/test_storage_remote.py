"""savable_loader.storage.remote: URLs and options as plain data, one filesystem per
process, length-checked ranged reads (short reads retried, ignored ranges named), the
S3 backend's own retries turned off, timeouts, and no backend imported before use."""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path
from typing import Any

import cloudpickle
import fsspec
import pytest

from savable_loader.errors import LoaderUsageError, RangeIgnoredError, StorageError
from savable_loader.storage import Remote, RetryPolicy, ShortRead
from savable_loader.storage.remote import check_length, normalize_etag
from tests.storage_servers import FileServer

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(attempts=3, initial_delay=0.01, timeout=5.0, deadline=10.0)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "sub" / "b.bin").write_bytes(b"hello")
    return tmp_path


def test_locations(folder: Path) -> None:
    local = Remote(folder)
    assert local.is_local and local.protocol == "file" and local.url_of("sub/b.bin") == str(folder / "sub" / "b.bin")
    assert Remote(f"file://{folder}").is_local and Remote(f"file://{folder}").root == folder
    s3 = Remote("s3://bucket/train/")
    assert not s3.is_local and s3.protocol == "s3" and s3.url_of("x/y.tar") == "s3://bucket/train/x/y.tar"
    assert Remote("https://h.org/d").url_of("m.json") == "https://h.org/d/m.json"
    assert Remote("simplecache::s3://b/x").is_local is False
    for bad in ["/abs", "../up", "a/../../b", "", "a\\b"]:
        with pytest.raises(LoaderUsageError, match="must be relative"):
            s3.url_of(bad)
    with pytest.raises(LoaderUsageError, match="storage_options must be a dict"):
        Remote("s3://b/x", storage_options=[("key", "v")])  # type: ignore[arg-type]
    with pytest.raises(LoaderUsageError, match="retry must be"):
        Remote("s3://b/x", retry=3)  # type: ignore[arg-type]


def test_local_reads(folder: Path) -> None:
    remote = Remote(folder)
    assert remote.read("sub/b.bin") == b"hello"
    assert remote.read_range("a.bin", 250, 260) == bytes(range(250, 256)) + bytes(range(4))
    assert remote.read_range("a.bin", 5, 5) == b""
    assert remote.info("a.bin") == {"size": 1024, "etag": None, "stamp": (folder / "a.bin").stat().st_mtime_ns}
    with pytest.raises(StorageError, match=r"a.bin bytes \[1000, 1030\): the file ends after 1024 bytes"):
        remote.read_range("a.bin", 1000, 1030)
    with pytest.raises(StorageError, match="nope.bin: FileNotFoundError"):
        remote.read("nope.bin")
    assert remote.read("nope.bin", missing_ok=True) is None and remote.read("sub/b.bin", missing_ok=True) == b"hello"
    with pytest.raises(LoaderUsageError, match="0 <= start <= end"):
        remote.read_range("a.bin", 10, 5)


def test_memory_reads() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/remote-test/a.bin", b"0123456789")
    remote = Remote("memory://remote-test", retry=FAST)
    assert remote.read("a.bin") == b"0123456789" and remote.read_range("a.bin", 2, 5) == b"234"
    assert remote.info("a.bin")["size"] == 10
    with pytest.raises(StorageError, match="not retried"):
        remote.read("missing.bin")
    assert remote.read("missing.bin", missing_ok=True) is None


def test_length_checks() -> None:
    assert check_length(b"abc", "u", 0, 3) == b"abc"
    with pytest.raises(ShortRead, match=r"u bytes \[0, 4\): got 3 of 4 bytes"):
        check_length(b"abc", "u", 0, 4)
    with pytest.raises(RangeIgnoredError, match=r"the server sent 10 bytes for a range of 2: it ignores the Range"):
        check_length(b"0" * 10, "u", 3, 5)


def test_short_reads_are_retried_and_ignored_ranges_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    remote = Remote("memory://fake", retry=FAST)
    answers = [b"ab", b"a", b"abcd"]
    calls: list[dict[str, Any]] = []

    def fake_call(method: str, url: str, timeout: float, **kw: Any) -> bytes:
        calls.append(kw)
        return answers[len(calls) - 1]

    monkeypatch.setattr(remote, "_call", fake_call)
    assert remote.read_range("x", 10, 14) == b"abcd" and len(calls) == 3
    assert calls[0] == {"start": 10, "end": 14}
    answers[:] = [b"0123456789"]
    calls.clear()
    with pytest.raises(RangeIgnoredError):
        remote.read_range("x", 1, 3)
    assert len(calls) == 1
    answers[:] = [b"a"] * 5
    calls.clear()
    with pytest.raises(StorageError, match=r"3 attempts .* the last with short read"):
        remote.read_range("x", 0, 2)


def test_http(folder: Path) -> None:
    with FileServer(folder) as server:
        remote = Remote(server.url, retry=FAST)
        assert remote.read_range("a.bin", 1, 4) == bytes([1, 2, 3])
        assert remote.info("sub/b.bin")["size"] == 5 and len(remote.info("sub/b.bin")["etag"]) == 32
        with pytest.raises(StorageError, match="not retried"):
            remote.read_range("missing.bin", 0, 2)
        assert server.faults.gets("missing") == 1
        assert remote.read("missing.bin", missing_ok=True) is None
        server.faults.always = "503"  # missing_ok is for missing files only
        with pytest.raises(StorageError, match="3 attempts"):
            remote.read("sub/b.bin", missing_ok=True)
    with FileServer(folder, honour_range=False) as server:
        with pytest.raises(RangeIgnoredError, match=r"a.bin bytes \[1, 4\): the server sent 1024 bytes"):
            Remote(server.url, retry=FAST).read_range("a.bin", 1, 4)
        assert server.faults.gets("a.bin") == 1  # not retried


def test_a_server_that_does_not_answer_times_out(folder: Path) -> None:
    with FileServer(folder) as server:
        server.faults.always, server.faults.stall_seconds = "stall", 3.0
        policy = RetryPolicy(attempts=2, initial_delay=0.01, timeout=0.5, deadline=5.0)
        start = time.monotonic()
        with pytest.raises(StorageError, match=r"2 attempts .* the last with timeout"):
            Remote(server.url, retry=policy).read_range("a.bin", 0, 10)
        assert time.monotonic() - start < 3


def test_s3_backend_retries_are_ours() -> None:
    pytest.importorskip("s3fs")
    fs = Remote("s3://bucket/x", {"anon": True}, retry=RetryPolicy(timeout=7.0)).filesystem()
    assert fs.retries == 1
    assert fs.config_kwargs == {"retries": {"total_max_attempts": 1}, "connect_timeout": 7.0, "read_timeout": 7.0}
    mine = Remote("s3://bucket/x", {"anon": True, "config_kwargs": {"read_timeout": 99}}).filesystem()
    assert mine.config_kwargs["read_timeout"] == 99 and mine.config_kwargs["retries"] == {"total_max_attempts": 1}


def test_azure_backend_retries_are_ours() -> None:
    pytest.importorskip("adlfs")
    from tests.storage_servers import AZURITE_KEY

    connection = f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
    connection += "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"  # never reached: nothing is read
    fs = Remote("az://container/x", {"connection_string": connection}).filesystem()
    policy = fs.service_client._config.retry_policy
    assert (policy.total_retries, policy.connect_retries, policy.read_retries, policy.status_retries) == (0, 0, 0, 0)


def test_a_missing_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        monkeypatch.setitem(sys.modules, "gcsfs", None)  # an import of it fails, as when not installed
        for protocol in ("gs", "gcs"):  # and fsspec forgets a class it imported before
            monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, protocol, raising=False)
    with pytest.raises(StorageError, match=r"gs://bucket/x: the 'gs' backend is not installed .*savable_loader\[gcs\]"):
        Remote("gs://bucket/x").filesystem()


def test_pickles_as_plain_data() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/pickle-test/a.bin", b"abc")
    remote = Remote("memory://pickle-test", {"skip_instance_cache": False}, retry=FAST)
    remote.read("a.bin")
    assert remote._fs is not None
    for back in (pickle.loads(pickle.dumps(remote)), cloudpickle.loads(cloudpickle.dumps(remote))):
        assert back._fs is None and back._fs_lock is None
        assert (back.url, back.storage_options, back.retry) == (remote.url, remote.storage_options, remote.retry)
        assert back.read("a.bin") == b"abc"
    assert repr(remote) == "Remote('memory://pickle-test')"
    assert normalize_etag('W/"abc"') == "abc" and normalize_etag(None) is None


def _child_filesystem(remote: Remote, queue: Any) -> None:
    inherited = remote._fs[0] if remote._fs else None
    remote.filesystem()
    queue.put((inherited, remote._fs[0], os.getpid()))


def test_a_forked_child_opens_its_own_filesystem() -> None:
    remote = Remote("memory://fork-test")
    remote.filesystem()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_filesystem, args=(remote, queue))
    child.start()
    inherited, now, pid = queue.get(timeout=30)
    child.join(30)
    assert inherited == os.getpid() and now == pid != os.getpid()


def _forked_http_reader(remote: Remote, queue: Any) -> None:
    inherited = remote._fs[1] if remote._fs else None
    data = remote.read_range("a.bin", 0, 16)  # the child's own filesystem replaces the inherited one
    fresh = remote.filesystem() is not inherited
    del inherited
    gc.collect()  # the inherited filesystems are garbage here, as in a worker whose collector runs
    queue.put((data, fresh))


def test_a_forked_child_never_closes_the_parents_http_session(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session inherited through a fork belongs to the parent's event loop: the child
    neither closes it (fsspec's finalizer would wait a second on a loop thread the child
    does not have) nor closes its pooled connections (they would leave the parent's epoll
    set: the parent's next request on one would hang until its timeout)."""
    pytest.importorskip("aiohttp")
    from fsspec.implementations.http import HTTPFileSystem

    closes = tmp_path / "closes"
    original = HTTPFileSystem.close_session
    parent = os.getpid()

    def spy(loop: Any, session: Any) -> None:
        if os.getpid() != parent:  # the parent closes its own sessions when it collects them
            with open(closes, "a") as f:
                f.write(f"{os.getpid()}\n")
        original(loop, session)

    monkeypatch.setattr(HTTPFileSystem, "close_session", staticmethod(spy))  # before any session exists
    one_attempt = RetryPolicy(attempts=1, timeout=30.0, deadline=60.0)
    with FileServer(folder) as server:
        dropped = Remote(server.url, retry=one_attempt)  # an equal filesystem (same URL and options)
        assert dropped.read("sub/b.bin") == b"hello"
        remote = Remote(server.url, retry=one_attempt)
        assert remote.read_range("a.bin", 16, 32) == bytes(range(16, 32))  # a pooled connection
        assert remote.filesystem() == dropped.filesystem()
        fs = weakref.ref(remote.filesystem())  # no strong reference for the children to inherit
        ctx = multiprocessing.get_context("fork")
        gc.disable()  # the parent keeps its garbage until the children have run
        try:
            del dropped  # garbage (filesystems are reference cycles) the children inherit
            for _ in range(2):
                queue = ctx.Queue()
                child = ctx.Process(target=_forked_http_reader, args=(remote, queue))
                child.start()
                assert queue.get(timeout=60) == (bytes(range(16)), True)
                child.join(60)
                assert child.exitcode == 0
        finally:
            gc.enable()
        assert not closes.exists(), f"a forked child closed the parent's session: pids {closes.read_text().split()}"
        # the parent's session and pooled connections still work, at the first attempt
        assert remote.filesystem() is fs() and not remote.filesystem()._session.closed
        assert remote.read_range("a.bin", 32, 48) == bytes(range(32, 48))
        assert remote.read("sub/b.bin") == b"hello"


IMPORTS = textwrap.dedent("""
    import sys
    import savable_loader, savable_loader.storage
    from savable_loader.storage import Storage, RetryPolicy
    s = Storage("s3://bucket/train", storage_options={"anon": True}, cache_dir=sys.argv[1])
    Storage(sys.argv[1])
    savable_loader.sources, savable_loader.errors.StorageError
    savable_loader.sources.RedisStreamSource("redis://127.0.0.1:1/0", "s", savable_loader.WorkerConfig(0, 1, 0))
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"fsspec", "s3fs", "gcsfs", "adlfs", "aiohttp",
                   "botocore", "aiobotocore", "huggingface_hub", "pyarrow", "requests", "redis"})
    print(heavy)
""")


def test_importing_imports_no_backend(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
