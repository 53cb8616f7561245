"""savable_loader.storage.cache: complete files only, one download for many processes, the
byte budget with LRU eviction of files not in use, killed downloads, stalled downloads,
and descriptors inherited through fork."""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import IO, Any

import pytest

from savable_loader.errors import LoaderUsageError, StorageError
from savable_loader.storage import ShardCache, cache_key

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def payload(n: int, seed: int = 0) -> bytes:
    out = b""
    while len(out) < n:
        out += hashlib.sha256(f"{seed}-{len(out)}".encode()).digest()
    return out[:n]


def writer(data: bytes) -> Any:
    def write(f: IO[bytes]) -> None:
        f.write(data)

    return write


def test_fill_then_lookup(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=None)
    data = payload(1000)
    key = cache_key("memory://d/a.bin", 1000)
    assert cache.lookup(key, 1000) is None
    with cache.fill(key, 1000, writer(data), url="memory://d/a.bin") as cached:
        assert cached.path == tmp_path / "data" / key and cached.path.read_bytes() == data and cached.size == 1000
    calls: list[int] = []
    with cache.fill(key, 1000, lambda f: calls.append(1), url="memory://d/a.bin") as again:
        assert again.path.read_bytes() == data
    assert calls == []  # served from the cache
    assert cache.lookup(key, 999) is None  # another size: not this file
    assert sorted(os.listdir(tmp_path)) == ["data", "locks", "tmp"] and os.listdir(tmp_path / "tmp") == []


def test_keys() -> None:
    a = cache_key("s3://b/train/shard-1.tar", 10)
    assert a.endswith("-shard-1.tar") and a != cache_key("s3://b/train/shard-1.tar", 11)
    assert a != cache_key("s3://b/train/shard-1.tar", 10, etag="x")
    digest = "ab" * 32
    moved = cache_key("s3://other/copy/shard-1.tar", 10, sha256=digest)
    assert moved == cache_key("s3://b/train/shard-1.tar", 10, sha256=digest.upper()) == f"{digest}-shard-1.tar"
    assert "/" not in cache_key("http://h/a b?c=d", 1) and not cache_key("http://h/.hidden", 1).split("-", 1)[
        1
    ].startswith(".")


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=None)

    def broken(f: IO[bytes]) -> None:
        f.write(b"half")
        raise StorageError("network gone")

    with pytest.raises(StorageError, match="network gone"):
        cache.fill("k-a", 8, broken, url="u")
    assert os.listdir(tmp_path / "data") == [] and os.listdir(tmp_path / "tmp") == []
    with pytest.raises(StorageError, match="the download wrote 4 bytes, 8 expected"):
        cache.fill("k-a", 8, writer(b"four"), url="u")
    assert os.listdir(tmp_path / "data") == [] and os.listdir(tmp_path / "tmp") == []


def test_budget_and_least_recently_used_eviction(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=300)
    for i in range(3):
        cache.fill(f"k{i}", 100, writer(payload(100, i)), url=f"u{i}").close()
        time.sleep(0.01)  # distinct mtimes
    assert cache.usage() == {"bytes": 300, "files": 3, "in_use": 0}
    cache.lookup("k0", 100).close()  # k0 used again: k1 is now the least recently used
    time.sleep(0.01)
    cache.fill("k3", 100, writer(payload(100, 3)), url="u3").close()
    assert sorted(os.listdir(tmp_path / "data")) == ["k0", "k2", "k3"]
    cache.fill("k4", 250, writer(payload(250, 4)), url="u4").close()
    assert sorted(os.listdir(tmp_path / "data")) == ["k4"]
    assert cache.usage()["bytes"] <= 300


def test_files_in_use_are_never_evicted(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=150)
    held = cache.fill("k0", 100, writer(payload(100)), url="u0")
    with pytest.warns(RuntimeWarning, match="over its budget of 150 bytes, held by files in use"):
        cache.fill("k1", 100, writer(payload(100, 1)), url="u1").close()
    assert sorted(os.listdir(tmp_path / "data")) == ["k0", "k1"] and cache.usage()["in_use"] == 1
    assert held.path.read_bytes() == payload(100)
    held.close()
    cache.fill("k2", 100, writer(payload(100, 2)), url="u2").close()  # k0 and k1 may go now
    assert sorted(os.listdir(tmp_path / "data")) == ["k2"]


def test_clear_keeps_files_in_use(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=None)
    held = cache.fill("k0", 10, writer(payload(10)), url="u")
    cache.fill("k1", 10, writer(payload(10)), url="u").close()
    assert cache.clear() == 1 and os.listdir(tmp_path / "data") == ["k0"]
    held.close()
    assert cache.clear() == 1 and os.listdir(tmp_path / "data") == []


def test_bad_budgets_and_folders(tmp_path: Path) -> None:
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(LoaderUsageError, match="cache_bytes is"):
            ShardCache(tmp_path, max_bytes=bad)  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match=r"cache_dir .*file/cache: cannot create the cache there"):
        ShardCache(tmp_path / "file" / "cache", None).fill("k", 1, writer(b"x"), url="u")


# -- several processes ----------------------------------------------------------------


def _fill_slowly(folder: str, log: str, barrier: Any, queue: Any) -> None:
    data = payload(200_000, 7)

    def write(f: IO[bytes]) -> None:
        with open(log, "a") as out:
            out.write(f"{os.getpid()}\n")
        for i in range(0, len(data), 20_000):
            f.write(data[i : i + 20_000])
            time.sleep(0.01)

    barrier.wait(30)
    with ShardCache(folder, max_bytes=None).fill("shared", len(data), write, url="u") as cached:
        queue.put(hashlib.sha256(cached.path.read_bytes()).hexdigest())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_processes_asking_at_once_share_one_download(tmp_path: Path, method: str) -> None:
    ctx = multiprocessing.get_context(method)
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    log = tmp_path / "writers.log"
    procs = [
        ctx.Process(target=_fill_slowly, args=(str(tmp_path / "cache"), str(log), barrier, queue)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    digests = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(log.read_text().split()) == 1  # one download
    assert digests == [hashlib.sha256(payload(200_000, 7)).hexdigest()] * 4  # everyone read it complete


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from savable_loader.storage import ShardCache
    def write(f):
        for _ in range(1000):
            f.write(b"x" * 1000)
            f.flush()
            time.sleep(0.01)
    ShardCache(sys.argv[1], max_bytes=None).fill("victim", 1_000_000, write, url="u")
""")


def test_a_killed_download_leaves_no_readable_file(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(folder)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size > 10_000 for p in (folder / "tmp").glob("victim.*")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    cache = ShardCache(folder, max_bytes=None)
    assert os.listdir(folder / "data") == [] and cache.lookup("victim", 1_000_000) is None
    assert len(os.listdir(folder / "tmp")) == 1  # the dead writer's partial file, never in data/
    with cache.fill("victim", 1_000_000, writer(payload(1_000_000)), url="u") as cached:
        assert cached.path.read_bytes() == payload(1_000_000)
    assert os.listdir(folder / "tmp") == []  # removed by the next holder of the lock


def test_an_eviction_removes_dead_partial_files(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=10_000)
    cache.evict()
    (tmp_path / "tmp" / "gone.123.abcd").write_bytes(b"x" * 500)  # its writer holds no lock: dead
    cache.evict()
    assert os.listdir(tmp_path / "tmp") == []


def test_a_stalled_download_is_an_error_not_a_hang(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=None)
    cache.evict()  # creates the folders
    lock = os.open(tmp_path / "locks" / "k.lock", os.O_RDWR | os.O_CREAT)
    fd2 = None
    try:
        # another "process" holds the download lock and writes nothing
        fd2 = os.open(tmp_path / "locks" / "k.lock", os.O_RDWR)
        fcntl.flock(fd2, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(
            StorageError,
            match=r"http://h/k: another process has been downloading it .* 0.5 s "
            r"without progress",
        ):
            cache.fill("k", 4, writer(b"data"), url="http://h/k", stall_timeout=0.5)
        assert time.monotonic() - start < 5
    finally:
        os.close(lock)
        if fd2 is not None:
            os.close(fd2)
    with cache.fill("k", 4, writer(b"data"), url="http://h/k") as cached:  # lock free again
        assert cached.path.read_bytes() == b"data"


def _wait_in_child(ready: Any, event: Any) -> None:
    ready.set()
    event.wait(30)


def test_forked_children_do_not_pin_the_parents_files(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=None)
    held = cache.fill("k", 10, writer(payload(10)), url="u")
    ctx = multiprocessing.get_context("fork")
    ready, event = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_wait_in_child, args=(ready, event))
    child.start()
    try:
        assert ready.wait(30)  # the child runs (past its at-fork handlers)
        assert cache.clear() == 0  # held by the parent
        held.close()
        assert cache.clear() == 1  # the child, alive, holds nothing
    finally:
        event.set()
        child.join(30)
