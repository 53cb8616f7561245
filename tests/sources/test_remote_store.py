"""ShardedFileDataset over storage (sources/_remote_store.py): every format through a local
folder, memory://, S3 (a moto server behind a fault proxy) and HTTP (a server honouring
Range) gives the bytes the local folder gives; resume at every step is exact, also with a
cold cache; faults mid-epoch give the same stream or a named StorageError; changed
shards and servers ignoring Range are named errors; a restore downloads nothing it has
consumed; indexing works on a URL."""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

import savable_loader as sl
import savable_loader.pipeline.worker as worker_module
from savable_loader.errors import DataError, IntegrityError, RangeIgnoredError, StorageError
from savable_loader.sources import ShardedFileDataset, index_folder
from savable_loader.sources.shards.remote import StorageShardStore
from savable_loader.storage import RetryPolicy, Storage
from savable_loader.wrappers import MapDataset, RepeatDataset
from tests.common import assert_same, check_resume_everywhere
from tests.sources.test_shard_formats import make_folder, sample_id, wconf
from tests.storage_servers import FileServer, Replicas
from tests.wrapper_common import make_loader, set_snapshot_policy

pytestmark = pytest.mark.timeout(300)

FORMATS = ["tar", "parquet", "mds", "litdata"]
BACKENDS = ["local", "memory", "s3", "http"]
FAST = RetryPolicy(attempts=4, initial_delay=0.01, max_delay=0.05, timeout=10.0, deadline=20.0)
MEMORY = "sharded-remote"
BUCKET = "sharded"


class Remotes(Replicas):
    """One copy of each format's folder (``data/<fmt>``) locally, in memory://, in a moto
    bucket (reached through a fault proxy) and behind an HTTP server."""

    def __init__(self, root: Path) -> None:
        self.folders = {fmt: make_folder(fmt, root / "data" / fmt) for fmt in FORMATS}
        index_folder(root / "data" / "tar", progress=False, sha256=True)  # checksums checked on download
        super().__init__(root, MEMORY, BUCKET)

    def location(self, backend: str, fmt: str, cache: Path, **kw: Any) -> Any:  # type: ignore[override]
        """What ShardedFileDataset is given: a path, or a Storage for a URL."""
        url, options = super().location(backend, fmt)
        if backend == "local":
            return self.folders[fmt]
        kw.setdefault("retry", FAST)
        return Storage(url, storage_options=options, cache_dir=cache, **kw)


@pytest.fixture(scope="module")
def remotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remotes]:
    r = Remotes(tmp_path_factory.mktemp("remote"))
    yield r
    r.close()


@pytest.fixture(autouse=True)
def no_faults(remotes: Remotes) -> Iterator[None]:
    remotes.reset_faults()
    yield
    remotes.reset_faults()


def epoch(
    location: Any, workers: int = 0, context: str = "fork", rank: int = 0, world: int = 1, **kw: Any
) -> list[Any]:
    ds = ShardedFileDataset(location, wconf(rank, world, workers), **kw)
    extra = {"multiprocessing_context": context} if workers else {}
    return list(sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, **extra))


# -- the same bytes everywhere -----------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_format_reads_the_same_through_every_backend(
    remotes: Remotes, backend: str, fmt: str, tmp_path: Path
) -> None:
    want = epoch(remotes.folders[fmt], rank=1, world=2)
    got = epoch(remotes.location(backend, fmt, tmp_path / "cache"), rank=1, world=2)
    assert_same(got, want)
    assert sorted(sample_id(s) for s in got) == sorted(sample_id(s) for s in want) and len(got) == 10
    ds = ShardedFileDataset(remotes.location(backend, fmt, tmp_path / "cold"), wconf())
    local = ShardedFileDataset(remotes.folders[fmt], wconf())
    for key in ([0, 0, 0], [2, 6, 0], [3, 4, 1]):  # restore_sample: ranged reads, no download
        assert_same(ds.restore_sample(key), local.restore_sample(key))
    if backend != "local":
        assert not (tmp_path / "cold" / "data").exists() or not any((tmp_path / "cold" / "data").iterdir())


@pytest.mark.parametrize("backend", ["s3", "http"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_processes_of_every_start_method(remotes: Remotes, backend: str, context: str, tmp_path: Path) -> None:
    want = epoch(remotes.folders["tar"], workers=2, context="fork", decode=True)
    got = epoch(remotes.location(backend, "tar", tmp_path / "cache"), workers=2, context=context, decode=True)
    assert_same(got, want)


_COLLECTED: set[int] = set()


def _collect_once(sample: Any) -> Any:
    """The identity, with a full garbage collection in each process at its first sample
    (in a real pipeline a worker's collector runs soon after it starts reading)."""
    if os.getpid() not in _COLLECTED:
        _COLLECTED.add(os.getpid())
        gc.collect()
    return sample


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_forked_workers_leave_the_parents_session_alone(remotes: Remotes, backend: str, tmp_path: Path) -> None:
    """Two forked workers over a session the parent opened (reading the metadata), whose
    collector runs after their first read: the same bytes as the local folder, in the same
    order, and the parent's session still answers at the first attempt afterwards (a child
    that closed its inherited copy took the pooled connections out of the epoll set it
    shares with the parent: the parent's next request on one hung until its timeout)."""
    one_attempt = RetryPolicy(attempts=1, timeout=30.0, deadline=60.0)
    remote = ShardedFileDataset(
        remotes.location(backend, "tar", tmp_path / "cache", retry=one_attempt), wconf(0, 1, 2), decode=True
    )
    local = ShardedFileDataset(remotes.folders["tar"], wconf(0, 1, 2), decode=True)
    got, want = (
        list(
            sl.SavableDataLoader(
                MapDataset(ds, _collect_once),
                batch_size=None,
                worker_config=ds.worker_config,
                multiprocessing_context="fork",
            )
        )
        for ds in (remote, local)
    )
    assert_same(got, want)
    assert len(got) == 20
    assert isinstance(remote.store, StorageShardStore)
    metadata = (remotes.folders["tar"] / "metadata.json").read_bytes()
    assert remote.store.storage.read("metadata.json") == metadata


def test_a_url_string_with_storage_options(remotes: Remotes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAVABLE_LOADER_CACHE", str(tmp_path / "default-cache"))
    remotes.s3()
    assert remotes.moto is not None
    ds = ShardedFileDataset(f"s3://{BUCKET}/data/parquet", wconf(), storage_options=remotes.moto.options())
    assert isinstance(ds.store, StorageShardStore) and ds.store.storage.cache is not None
    assert ds.store.storage.cache.folder == tmp_path / "default-cache"
    assert_same(list(make_loader(ds)), epoch(remotes.folders["parquet"]))
    assert "testing" not in repr(ds.store)  # options (credentials) never shown
    with pytest.raises(sl.LoaderUsageError, match="storage_options are for URLs"):
        ShardedFileDataset(remotes.folders["tar"], wconf(), storage_options={"anon": True})
    local = ShardedFileDataset(Storage(remotes.folders["tar"]), wconf())  # a local Storage: read in place
    assert local.folder == remotes.folders["tar"]


def test_states_do_not_depend_on_where_the_data_is(remotes: Remotes, tmp_path: Path) -> None:
    """A state saved reading the local folder resumes from HTTP with a cold cache, exactly."""
    full = epoch(remotes.folders["tar"])
    loader = make_loader(ShardedFileDataset(remotes.folders["tar"], wconf()))
    it = iter(loader)
    head = [next(it) for _ in range(8)]
    state = loader.save_state_rank()
    remote = ShardedFileDataset(remotes.location("http", "tar", tmp_path / "cache"), wconf())
    assert remote.config() == loader.dataset.config()
    fresh = make_loader(remote)
    fresh.restore_state_rank(state)
    assert_same(head + list(fresh), full)


# -- resume --------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "fmt"), [("http", "tar"), ("s3", "parquet"), ("memory", "mds")])
def test_resume_at_every_step_with_a_cold_cache(
    remotes: Remotes, backend: str, fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2, in process: every save point of two epochs; each restore starts from an
    empty cache folder."""
    set_snapshot_policy(monkeypatch, "every")
    caches = iter(range(10**6))

    def factory() -> sl.SavableDataLoader:
        return make_loader(ShardedFileDataset(remotes.location(backend, fmt, tmp_path / "cache"), wconf(1, 2, 0)))

    def restore_factory() -> sl.SavableDataLoader:
        cold = tmp_path / f"cold-{next(caches)}"
        return make_loader(ShardedFileDataset(remotes.location(backend, fmt, cold), wconf(1, 2, 0)))

    assert check_resume_everywhere(factory, 2, restore_factory=restore_factory, variants=("live", "break")) >= 20


@pytest.mark.parametrize(("backend", "fmt"), [("http", "tar"), ("s3", "parquet")])
def test_resume_at_every_step_with_2_workers(
    remotes: Remotes, backend: str, fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_snapshot_policy(monkeypatch, "every")

    def factory() -> sl.SavableDataLoader:
        return make_loader(ShardedFileDataset(remotes.location(backend, fmt, tmp_path / "cache"), wconf(1, 2, 2)))

    assert check_resume_everywhere(factory, 2) == 2 * 10 + 3


def test_a_restore_downloads_nothing_it_consumed(
    remotes: Remotes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unshuffled, one worker: after a save in the third shard, a restore with a cold cache
    GETs only the third shard, those after it, and small files (metadata, tar indexes).
    (With a snapshot at every item: a state is the newest snapshot plus items to replay,
    and the replay reads the snapshot's shard.)"""
    set_snapshot_policy(monkeypatch, "every")

    def location(cache: str) -> Any:
        return remotes.location("http", "tar", tmp_path / cache, prefetch=0)

    loader = make_loader(ShardedFileDataset(location("a"), wconf(), shuffle=False))
    it = iter(loader)
    for _ in range(5 + 3 + 2):  # shards of 5, 3, 7, 5 samples: 2 into the third
        next(it)
    state = loader.save_state_rank()
    del it, loader
    log = remotes.http.faults
    log.reset()
    fresh = make_loader(ShardedFileDataset(location("b"), wconf(), shuffle=False))
    fresh.restore_state_rank(state)
    rest = list(fresh)
    assert [sample_id(s) for s in rest] == list(range(10, 20))
    assert log.gets("shard-000.tar") == log.gets("shard-001.tar") == 0  # no GET at all for consumed shards
    assert log.gets("shard-002.tar") >= 1 and log.gets("shard-003.tar") >= 1
    shard_gets = [p for m, p, _, _ in log.log if m == "GET" and p.endswith(".tar")]
    assert sorted(shard_gets) == sorted(set(shard_gets))  # each shard downloaded once


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_downloads_no_consumed_shard_with_only_the_sources_snapshots(
    remotes: Remotes, workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot policy switched off: the only snapshots are those the source asks
    for at the end of each shard (``request_snapshot``). A save at every position,
    restored with a cold cache, continues exactly and GETs no shard the restored
    worker had finished (with 2 workers: shards 0-1 are worker 0's, 2-3 worker 1's)."""
    monkeypatch.setattr(worker_module, "snapshot_due", lambda *a, **k: False)
    sizes = [5, 3, 7, 5]
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]

    def loader(cache: str) -> sl.SavableDataLoader:
        storage = remotes.location("http", "tar", tmp_path / cache, prefetch=0)
        return make_loader(ShardedFileDataset(storage, wconf(0, 1, workers), shuffle=False))

    reference = [sample_id(s) for s in loader("reference")]
    assert sorted(reference) == list(range(20))
    log = remotes.http.faults
    points = range(len(reference) + 1)
    if workers:  # (each point starts 4 worker processes) where a shard has just been finished, and the end
        finished = [max(reference.index(i) for i in range(f, f + n)) + 1 for f, n in zip(firsts, sizes, strict=True)]
        points = sorted({*finished, *(k + 1 for k in finished if k < len(reference)), len(reference)})
    for k in points:
        live = loader(f"live-{k}")
        it = iter(live)
        for _ in range(k):
            next(it)
        state = live.save_state_rank()
        del it, live
        log.reset()
        fresh = loader(f"cold-{k}")
        fresh.restore_state_rank(state)
        assert [sample_id(s) for s in fresh] == reference[k:], k
        done = set(reference[:k])
        for shard, (first, size) in enumerate(zip(firsts, sizes, strict=True)):
            if set(range(first, first + size)) <= done:
                assert log.gets(f"shard-{shard:03d}.tar") == 0, (k, shard)


def test_prefetch_downloads_the_next_shards_of_the_reading_order(remotes: Remotes, tmp_path: Path) -> None:
    storage = remotes.location("http", "tar", tmp_path / "cache", prefetch=2)
    ds = ShardedFileDataset(storage, wconf())
    loader = make_loader(ds)
    it = iter(loader)
    next(it)
    upcoming = ds.upcoming_shards(3)
    deadline = time.monotonic() + 30
    entries = [ds.metadata.shards[s] for s in upcoming[1:]]
    keys = [storage.key(ds.store._ref(e.path, e.size, e.sha256, e.etag)) for e in entries]
    assert storage.cache is not None
    while not all(storage.cache.lookup(k, e.size) for k, e in zip(keys, entries)):
        assert time.monotonic() < deadline, "the next two shards were not prefetched"
        time.sleep(0.05)

    def shard_gets() -> int:
        return sum(1 for m, p, _, _ in remotes.http.faults.log if m == "GET" and p.endswith(".tar"))

    before = shard_gets()
    rest = list(it)
    assert len(rest) == 19
    assert shard_gets() - before <= 1  # only the last shard was left to download (or its prefetch)
    assert shard_gets() == 4  # each shard downloaded once
    ds.close()


# -- faults ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["s3", "http"])
@pytest.mark.parametrize("plan", [{1: "503"}, {3: "reset", 6: "short"}, {2: "429", 5: "503", 9: "reset"}])
def test_faults_mid_epoch_change_nothing(remotes: Remotes, backend: str, plan: dict[int, str], tmp_path: Path) -> None:
    want = epoch(remotes.folders["tar"], workers=2)
    server = remotes.server(backend)
    server.faults.plan = dict(plan)
    got = epoch(remotes.location(backend, "tar", tmp_path / "cache"), workers=2)
    assert_same(got, want)
    assert len([w for *_, w in server.faults.log if w in plan.values()]) == len(plan)  # the faults did happen


@pytest.mark.parametrize(("backend", "fault"), [("http", "503"), ("http", "short"), ("s3", "reset")])
def test_a_persistent_fault_mid_epoch_is_a_storage_error(
    remotes: Remotes, backend: str, fault: str, tmp_path: Path
) -> None:
    """The first shards read fine, then every request fails: the samples before are the
    reference's, then a StorageError in the main process, within 60 s; never other data."""
    want = epoch(remotes.folders["tar"], workers=2)
    server = remotes.server(backend)
    policy = RetryPolicy(attempts=3, initial_delay=0.05, timeout=2.0, deadline=8.0)
    location = remotes.location(backend, "tar", tmp_path / "cache", retry=policy, prefetch=0)
    ds = ShardedFileDataset(location, wconf(0, 1, 2))
    loader = make_loader(ds)
    got: list[Any] = []
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        for sample in loader:
            got.append(sample)
            if len(got) == 2:
                server.faults.always = fault
    assert time.monotonic() - start < 60
    assert_same(got, want[: len(got)])
    assert "3 attempts" in str(info.value) and ".tar" in str(info.value)


def test_a_missing_shard_is_a_named_error(remotes: Remotes, tmp_path: Path) -> None:
    memory = fsspec.filesystem("memory")
    for name, data in remotes.files.items():
        if name.startswith("tar/"):
            memory.pipe(f"/{MEMORY}-missing/{name}", data)
    memory.rm(f"/{MEMORY}-missing/tar/shard-002.tar")
    ds = ShardedFileDataset(
        Storage(f"memory://{MEMORY}-missing/tar", cache_dir=tmp_path, retry=FAST), wconf(), shuffle=False
    )
    with pytest.raises(StorageError, match=r"memory://sharded-remote-missing/tar/shard-002.tar.*FileNotFoundError"):
        list(make_loader(ds))


# -- integrity ----------------------------------------------------------------------------


def _copy_to_server_root(remotes: Remotes, root: Path, fmt: str) -> Path:
    shutil.copytree(remotes.folders[fmt], root / fmt)
    return root / fmt


def test_a_changed_shard_is_a_named_error(remotes: Remotes, tmp_path: Path) -> None:
    folder = _copy_to_server_root(remotes, tmp_path / "served", "tar")
    with FileServer(tmp_path / "served") as server:
        url = f"{server.url}/tar"
        shard = folder / "shard-001.tar"
        data = shard.read_bytes()
        shard.write_bytes(data + b"\0" * 512)  # grown: the size differs
        with pytest.raises(IntegrityError, match=r"shard-001.tar: the metadata says 20480 bytes, the file has 20992"):
            epoch(Storage(url, cache_dir=tmp_path / "c1", retry=FAST), shuffle=False)
        shard.write_bytes(data[:-1] + b"\1")  # same size, other bytes: the SHA-256 differs
        with pytest.raises(IntegrityError, match=r"shard-001.tar: the metadata's SHA-256 is [0-9a-f]{64}, the file's"):
            epoch(Storage(url, cache_dir=tmp_path / "c2", retry=FAST), shuffle=False)
        assert issubclass(IntegrityError, DataError)


def test_a_server_ignoring_range_is_a_named_error(remotes: Remotes, tmp_path: Path) -> None:
    _copy_to_server_root(remotes, tmp_path / "served", "tar")
    with FileServer(tmp_path / "served", honour_range=False) as server:
        storage = Storage(f"{server.url}/tar", cache_dir=tmp_path / "c", retry=FAST, chunk_bytes=4096)
        with pytest.raises(RangeIgnoredError, match=r"tar/shard-00\d.tar bytes \[0, 4096\): the server sent \d+ bytes"):
            epoch(storage)
        ds = ShardedFileDataset(Storage(f"{server.url}/tar", cache_dir=tmp_path / "c", retry=FAST), wconf())
        with pytest.raises(RangeIgnoredError, match="ignores the Range header"):
            ds.restore_sample([0, 1, 0])  # ranged reads, never the whole file read as a sample


# -- indexing ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_index_a_url(remotes: Remotes, backend: str, tmp_path: Path) -> None:
    """Tars and Parquet files uploaded without metadata: indexed where they are (metadata.json
    and tar indexes written beside them), then read as the local folder reads."""
    for fmt in ("tar", "parquet"):
        files = {
            name: data
            for name, data in remotes.files.items()
            if name.startswith(f"{fmt}/") and not name.endswith((".idx", "metadata.json"))
        }
        if backend == "memory":
            memory = fsspec.filesystem("memory")
            for name, data in files.items():
                memory.pipe(f"/{MEMORY}-index/{name}", data)
            storage = Storage(f"memory://{MEMORY}-index/{fmt}", cache_dir=tmp_path / "c", retry=FAST)
        else:
            remotes.s3()
            assert remotes.moto is not None
            remotes.moto.bucket(f"index-{fmt}", {name[len(fmt) + 1 :]: data for name, data in files.items()})
            storage = Storage(
                f"s3://index-{fmt}", storage_options=remotes.moto.options(), cache_dir=tmp_path / "c", retry=FAST
            )
        meta = index_folder(storage, progress=False, sha256=True, workers=2)
        assert [(e.path, e.samples, e.size, e.row_groups) for e in meta.shards] == [
            (e.path, e.samples, e.size, e.row_groups) for e in sl.sources.read_metadata(remotes.folders[fmt]).shards
        ]
        assert storage.read("metadata.json") is not None
        assert_same(epoch(storage), epoch(remotes.folders[fmt]))
        assert not list((tmp_path / "c" / "index-journals").glob("*.jsonl"))  # removed when done


def test_the_index_command_takes_a_url(
    remotes: Remotes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from savable_loader.__main__ import main

    monkeypatch.setenv("SAVABLE_LOADER_CACHE", str(tmp_path / "cache"))
    memory = fsspec.filesystem("memory")
    for name, data in remotes.files.items():
        if name.startswith("tar/") and not name.endswith((".idx", "metadata.json")):
            memory.pipe(f"/{MEMORY}-cli/{name}", data)
    assert main(["index", f"memory://{MEMORY}-cli/tar", "--quiet", "--storage-options", "{}"]) == 0
    assert "4 shards (4 tar), 20 samples" in capsys.readouterr().out
    assert memory.exists(f"/{MEMORY}-cli/tar/shard-000.tar.idx")
    with pytest.raises(SystemExit):
        main(["index", f"memory://{MEMORY}-cli/tar", "--storage-options", "[1]"])


def test_an_energon_folder_in_a_bucket_is_read_unchanged(tmp_path: Path) -> None:
    """Energon's .nv-meta/.info.json and .tar.idx files are read over the URL, as from disk."""
    pytest.importorskip("megatron.energon", reason="megatron-energon (test extra) is not installed")
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    from tests.shard_writers import write_tar_folder

    folder = write_tar_folder(tmp_path / "en", [4, 6, 3])
    WebdatasetPreparator.prepare_dataset(
        folder, sorted(p.name for p in folder.glob("*.tar")), split_parts_ratio=[("train", 1.0)], workers=1
    )
    memory = fsspec.filesystem("memory")
    for p in folder.rglob("*"):
        if p.is_file():
            memory.pipe(f"/{MEMORY}-energon/{p.relative_to(folder).as_posix()}", p.read_bytes())
    remote = ShardedFileDataset(Storage(f"memory://{MEMORY}-energon", cache_dir=tmp_path / "c", retry=FAST), wconf())
    assert remote.metadata.source == "energon"
    assert_same(list(make_loader(remote)), epoch(folder))
    assert remote.config() == ShardedFileDataset(folder, wconf()).config()


# -- prefetch across the end of a pass -------------------------------------------------------


def _shard_of(ds: ShardedFileDataset, sample: Any) -> str:
    bounds = np.cumsum(ds.counts)
    return ds.metadata.shards[int(np.searchsorted(bounds, sample_id(sample), side="right"))].path


def _shard_gets(log: Any) -> list[str]:
    """The shards GET requests asked for, in order (not their .idx files)."""
    with log.lock:
        return [p.rsplit("/", 1)[-1] for m, p, _, _ in log.log if m == "GET" and p.endswith(".tar")]


def _gets(log: Any, name: str) -> int:
    return _shard_gets(log).count(name)


def _read_from_the_prefetch(later: list[str], first: str) -> None:
    """The second pass did not download its first shard again: the downloads it made are
    its other shards, and at most one more of ``first``, last: the prefetch for the pass
    after it (one shard ahead)."""
    assert later and later[0] != first, later
    assert first not in later[:-1], later


def _wait_for_gets(log: Any, name: str, n: int, what: str) -> None:
    deadline = time.monotonic() + 30
    while _gets(log, name) < n:
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _crossing_seed(folder: Path, repeat: bool) -> tuple[int, list[Any], str]:
    """A seed whose second pass (a ``RepeatDataset`` pass, else the loader's next epoch)
    starts with a shard that is not one of the last two the first pass reads (with a cache
    that keeps only files in use, it is then gone from the cache when the first pass ends),
    its 2-pass local stream, and that first shard."""
    for seed in range(5, 40):
        ds = ShardedFileDataset(folder, wconf(seed=seed))
        if repeat:
            stream = list(make_loader(RepeatDataset(ds, repeats=2)))
        else:
            loader = make_loader(ds)
            stream = list(loader) + list(loader)
        order = list(dict.fromkeys(_shard_of(ds, sample) for sample in stream[:20]))
        if _shard_of(ds, stream[20]) not in order[-2:]:
            return seed, stream, _shard_of(ds, stream[20])
    raise AssertionError("no seed")


@pytest.mark.filterwarnings("ignore:shard cache")  # a budget of 1 byte: only files in use are kept
def test_prefetch_crosses_into_the_next_repeat_pass(remotes: Remotes, tmp_path: Path) -> None:
    """RepeatDataset, in process, a cache that keeps only the files in use: the next pass's
    first shard is downloaded (a second GET) before the last sample of this pass is
    consumed, and that download is the one the next pass reads (no third GET). The stream
    is the local folder's."""
    seed, want, first = _crossing_seed(remotes.folders["tar"], repeat=True)
    storage = remotes.location("http", "tar", tmp_path / "cache", prefetch=1, cache_bytes=1)
    ds = ShardedFileDataset(storage, wconf(seed=seed))
    log = remotes.http.faults
    it = iter(make_loader(RepeatDataset(ds, repeats=2)))
    got = [next(it) for _ in range(20)]  # the whole first pass, not one more
    _wait_for_gets(log, first, 2, f"{first} (the next pass's first shard) was not prefetched before the pass ended")
    mark = len(_shard_gets(log))
    got += list(it)
    assert_same(got, want)
    _read_from_the_prefetch(_shard_gets(log)[mark:], first)
    _settle(storage)  # the prefetch for the loader's next epoch: not a GET of the next test's


def _settle(storage: Storage) -> None:
    """Stop ``storage``'s prefetching in this process and wait for a download in flight to
    end, so that no request of this test reaches the shared server's log after it."""
    storage.close()
    prefetcher = storage._rt().prefetcher
    deadline = time.monotonic() + 30
    while prefetcher is not None and prefetcher.fetching:
        assert time.monotonic() < deadline, "a prefetch did not end within 30 s"
        time.sleep(0.01)


@pytest.mark.filterwarnings("ignore:shard cache")
def test_prefetch_crosses_into_the_next_epoch_of_persistent_workers(remotes: Remotes, tmp_path: Path) -> None:
    """A persistent worker: while it reads the last shard of epoch 0 it downloads the first
    shard of epoch 1; epoch 1 does not download it again."""
    seed, want, first = _crossing_seed(remotes.folders["tar"], repeat=False)
    storage = remotes.location("http", "tar", tmp_path / "cache", prefetch=1, cache_bytes=1)
    ds = ShardedFileDataset(storage, wconf(0, 1, 1, seed=seed))
    loader = make_loader(ds, persistent_workers=True)
    log = remotes.http.faults
    got = list(loader)
    _wait_for_gets(log, first, 2, f"{first} (epoch 1's first shard) was not prefetched during epoch 0")
    mark = len(_shard_gets(log))
    got += list(loader)
    assert_same(got, want)
    _read_from_the_prefetch(_shard_gets(log)[mark:], first)


@pytest.mark.parametrize("repeats", [(2,), (None,), (2, 3), (3, 2)])
def test_the_next_pass_predicted_at_each_pass_end_is_the_pass_that_follows(
    remotes: Remotes, repeats: tuple[int | None, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nested RepeatDatasets (and the loader's next epoch after the last pass): at the last
    sample of every pass the source predicts the layout key its next pass uses. (The
    endless repeat is cut by the loop: its last pass of an epoch never ends.)"""
    ds = ShardedFileDataset(remotes.folders["tar"], wconf())
    top: Any = ds
    for n in repeats:
        top = RepeatDataset(top, repeats=n)
    predicted: dict[int, tuple[int, ...]] = {}  # pass number -> the key predicted at its end
    keys: list[tuple[int, ...]] = []  # the key of each pass, in order
    mark = ds.mark_sample

    def marking(key: Any) -> None:  # runs inside the source's iteration, in its repetition context
        if not keys or keys[-1] != tuple(ds.epoch):
            keys.append(tuple(ds.epoch))
        if ds.position == 20:  # the pass's last sample: what comes next?
            predicted[len(keys) - 1] = ds._next_pass()
        mark(key)

    monkeypatch.setattr(ds, "mark_sample", marking)
    loader = make_loader(top)
    for _ in range(2):  # two loader epochs
        it = iter(loader)
        for _sample in itertools.islice(it, 20 * 7 - 3):  # an endless repeat is cut mid-pass
            pass
        del it
    checked = [(predicted[i], keys[i + 1]) for i in sorted(predicted) if i + 1 < len(keys)]
    assert len(checked) >= 3 and all(p == k for p, k in checked), checked
