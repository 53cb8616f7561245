"""The cloud backends ``gs://``, ``az://`` and ``hf://`` against real local servers: Google
Cloud Storage's JSON API (``gcp-storage-emulator``, with ``gcsfs``), Azure Blob Storage
(Azurite, with ``adlfs``) and a Hugging Face Hub dataset repository
(``tests/storage_servers.py::HubServer``, with ``huggingface_hub``'s ``HfFileSystem``).

For each: the same seed gives the local folder's bytes (tar and Parquet, in process and
with 2 spawn workers), ``restore_sample`` reads ranges without downloading, a resume at
every step with a cold cache is exact, and faults on the k-th request change nothing.
The GCS and Azure emulators sit behind a ``FaultProxy``; the Hub server injects faults
itself. Servers start once per session.

Without the backend or its server these tests skip with the command that installs them;
under CI (``CI=true``, where ``.ci/run`` installs them) they fail instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import savable_loader as sl
from savable_loader.errors import StorageError
from savable_loader.sources import ShardedFileDataset, index_folder
from savable_loader.storage import RetryPolicy, Storage
from tests.common import assert_same, check_resume_everywhere
from tests.sources.test_shard_formats import make_folder, sample_id, wconf
from tests.storage_servers import (
    AZURITE_INSTALL,
    GCS_ENV,
    AzuriteServer,
    FaultProxy,
    GcsEmulator,
    HubServer,
    azurite_executable,
)
from tests.wrapper_common import make_loader, set_snapshot_policy

pytestmark = pytest.mark.timeout(300)

BACKENDS = ["gs", "az", "hf"]
FORMATS = ["tar", "parquet"]
FAST = RetryPolicy(attempts=4, initial_delay=0.01, max_delay=0.05, timeout=10.0, deadline=30.0)


def _missing(what: str, how: str) -> None:
    message = f"{what} is not installed: {how}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI installs it in .ci/run)")
    pytest.skip(message)


def _require(module: str, pip: str) -> None:
    try:
        __import__(module)
    except ImportError:
        _missing(module, f"pip install {pip} -c constraints.txt (the test extra)")


def _check_gcs_env() -> None:
    """Fail at once, rather than hang on the emulator, if gcsfs was imported before
    conftest switched its gRPC layout lookup off (``GCS_ENV``)."""
    import gcsfs
    import gcsfs.core

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        pytest.fail(
            f"gcsfs was imported with its gRPC layout lookup on; its requests to the emulator would hang: set {GCS_ENV} before gcsfs is imported"
        )


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backends")
    out = {}
    for fmt in FORMATS:
        out[fmt] = make_folder(fmt, root / fmt)
        index_folder(out[fmt], progress=False, sha256=True)  # downloads are checked against it
    return out


def _files(folders: dict[str, Path]) -> dict[str, bytes]:
    return {
        f"{fmt}/{p.relative_to(folder).as_posix()}": p.read_bytes()
        for fmt, folder in folders.items()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class Backend:
    """One backend's server, its copy of the folders and the proxy faults go through."""

    def __init__(self, name: str, url: str, options: dict[str, Any], faulty: Any, stop: list[Any]) -> None:
        self.name, self.url, self.options, self.faulty, self._stop = name, url, options, faulty, stop

    def storage(self, fmt: str, cache: Path, **kw: Any) -> Storage:
        kw.setdefault("retry", FAST)
        return Storage(f"{self.url}/{fmt}", storage_options=self.options, cache_dir=cache, **kw)

    def close(self) -> None:
        for server in self._stop:
            server.stop()


def _start(name: str, folders: dict[str, Path], root: Path) -> Backend:
    files = _files(folders)
    if name == "gs":
        _require("gcsfs", "gcsfs")
        _check_gcs_env()
        _require("gcp_storage_emulator", "gcp-storage-emulator")
        gcs = GcsEmulator()
        gcs.bucket("shards", files)
        proxy = FaultProxy(gcs.port)
        return Backend(name, "gs://shards", gcs.options(proxy.port), proxy.faults, [proxy, gcs])
    if name == "az":
        _require("adlfs", "adlfs")
        executable = azurite_executable()
        if executable is None:
            _missing("Azurite (Azure Storage's emulator)", AZURITE_INSTALL)
        assert executable is not None
        azurite = AzuriteServer(executable)
        azurite.container("shards", files)
        proxy = FaultProxy(azurite.port)
        return Backend(name, "az://shards", azurite.options(proxy.port), proxy.faults, [proxy, azurite])
    _require("huggingface_hub", "huggingface_hub")
    for rel, data in files.items():
        (root / "hub" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "hub" / rel).write_bytes(data)
    hub = HubServer(root / "hub")
    return Backend(name, f"hf://datasets/{hub.repo_id}", hub.options(), hub.faults, [hub])


@pytest.fixture(scope="session")
def servers(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Backend]]:
    started: dict[str, Backend] = {}
    yield started
    for backend in started.values():
        backend.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, servers: dict[str, Backend], folders: dict[str, Path]) -> Iterator[Backend]:
    name = request.param
    if name not in servers:
        servers[name] = _start(name, folders, request.getfixturevalue("tmp_path_factory").mktemp(name))
    b = servers[name]
    b.faulty.reset()
    yield b
    b.faulty.reset()


def epoch(location: Any, workers: int = 0, context: str = "fork", rank: int = 0, world: int = 1) -> list[Any]:
    ds = ShardedFileDataset(location, wconf(rank, world, workers))
    extra = {"multiprocessing_context": context} if workers else {}
    return list(sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, **extra))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_same_bytes_as_the_local_folder(
    backend: Backend, folders: dict[str, Path], fmt: str, tmp_path: Path
) -> None:
    want = epoch(folders[fmt], rank=1, world=2)
    got = epoch(backend.storage(fmt, tmp_path / "cache"), rank=1, world=2)
    assert_same(got, want)
    assert sorted(sample_id(s) for s in got) == sorted(sample_id(s) for s in want) and len(got) == 10
    cold = tmp_path / "cold"
    remote = ShardedFileDataset(backend.storage(fmt, cold), wconf())
    local = ShardedFileDataset(folders[fmt], wconf())
    for key in ([0, 0, 0], [2, 6, 0], [3, 4, 1]):  # restore_sample: ranged reads, nothing downloaded
        assert_same(remote.restore_sample(key), local.restore_sample(key))
    assert not (cold / "data").exists() or not any((cold / "data").iterdir())


def test_spawn_workers(backend: Backend, folders: dict[str, Path], tmp_path: Path) -> None:
    """Each spawned worker opens its own client from the pickled URL and options."""
    want = epoch(folders["tar"], workers=2)
    assert_same(epoch(backend.storage("tar", tmp_path / "cache"), workers=2, context="spawn"), want)


def test_resume_at_every_step_with_a_cold_cache(
    backend: Backend, folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2, in process, Parquet (row groups of 2: the saves fall inside units and
    inside shards): every save point of two epochs, each restore from an empty cache."""
    set_snapshot_policy(monkeypatch, "every")
    caches = iter(range(10**6))

    def factory() -> sl.SavableDataLoader:
        return make_loader(ShardedFileDataset(backend.storage("parquet", tmp_path / "cache"), wconf(1, 2, 0)))

    def restore_factory() -> sl.SavableDataLoader:
        cold = tmp_path / f"cold-{next(caches)}"
        return make_loader(ShardedFileDataset(backend.storage("parquet", cold), wconf(1, 2, 0)))

    assert check_resume_everywhere(factory, 2, restore_factory=restore_factory, variants=("live",)) >= 20
    assert next(caches) >= 20  # every restore had its own cold cache


@pytest.mark.parametrize("plan", [{2: "503", 6: "reset"}, {3: "short", 5: "429"}])
def test_faults_change_nothing(
    backend: Backend, folders: dict[str, Path], plan: dict[int, str], tmp_path: Path
) -> None:
    want = epoch(folders["tar"], workers=2)
    backend.faulty.plan = dict(plan)
    got = epoch(backend.storage("tar", tmp_path / "cache"), workers=2)
    assert_same(got, want)
    assert sorted(w for *_, w in backend.faulty.log if w in plan.values()) == sorted(plan.values())


def test_a_persistent_fault_is_a_storage_error(backend: Backend, folders: dict[str, Path], tmp_path: Path) -> None:
    """After the first samples every request fails: the samples before are the local
    folder's, then a StorageError in the main process naming the shard, within 60 s (the
    backend's own quick retries, where it keeps some, run inside each timed attempt)."""
    want = epoch(folders["tar"], workers=2)
    policy = RetryPolicy(attempts=3, initial_delay=0.05, timeout=3.0, deadline=10.0)
    ds = ShardedFileDataset(backend.storage("tar", tmp_path / "cache", retry=policy, prefetch=0), wconf(0, 1, 2))
    got: list[Any] = []
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        for sample in make_loader(ds):
            got.append(sample)
            if len(got) == 2:
                backend.faulty.always = "503"
    assert time.monotonic() - start < 60
    assert_same(got, want[: len(got)])
    assert ".tar" in str(info.value)
