"""index_folder / ``savable_loader index``: metadata.json v2 for every format, parallel,
resumable after a kill (journal), never writing to a shard, a progress line, re-indexing
a version-1 folder keeps its states valid."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.__main__ import main
from savable_loader.config import _ActiveWorker
from savable_loader.sources import ShardedFileDataset, index_folder, indexing, read_metadata, write_shards
from savable_loader.sources.indexing import JOURNAL, IndexProgress
from savable_loader.state import decode, encode
from tests.common import assert_streams
from tests.shard_writers import write_mds_folder, write_tar, write_tar_folder
from tests.wrapper_common import make_loader

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


def read_all(folder: Path) -> list:
    ds = ShardedFileDataset(folder, WC, shuffle=False)
    with _ActiveWorker(0, 0):
        return list(ds)


def shard_snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and p.suffix in (".tar", ".parquet", ".npy", ".pt", ".jsonl")
    }


def mixed_folder(folder: Path) -> Path:
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    import pyarrow as pa

    write_tar_folder(folder / "tars", [3, 2])
    pq.write_table(pa.table({"id": [1, 2, 3]}), folder / "rows.parquet", row_group_size=2)
    np.save(folder / "a.npy", np.arange(8).reshape(4, 2))
    torch.save({"x": torch.zeros(2, 3)}, folder / "b.pt")
    (folder / "c.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (folder / "README.md").write_text("not a shard")
    (folder / ".hidden").mkdir()
    np.save(folder / ".hidden" / "x.npy", np.zeros(3))
    return folder


def test_a_mixed_folder(tmp_path):
    folder = mixed_folder(tmp_path)
    before = shard_snapshot(folder)
    meta = index_folder(folder, progress=False, sha256=True)
    assert shard_snapshot(folder) == before  # no shard written
    doc = json.loads((folder / "metadata.json").read_text())
    assert doc["format"] == 2
    by_path = {s["path"]: s for s in doc["shards"]}
    assert list(by_path) == ["a.npy", "b.pt", "c.jsonl", "rows.parquet", "tars/shard-000.tar", "tars/shard-001.tar"]
    assert by_path["rows.parquet"]["row_groups"] == [2, 1] and by_path["rows.parquet"]["format"] == "parquet"
    assert by_path["tars/shard-000.tar"]["index"] == "tars/shard-000.tar.idx"
    assert [s["samples"] for s in doc["shards"]] == [4, 2, 2, 3, 3, 2]
    for s in doc["shards"]:
        data = (folder / s["path"]).read_bytes()
        assert s["size"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()
    assert [s.path for s in meta.shards] == list(by_path)
    assert len(read_all(folder)) == 16
    assert not (folder / JOURNAL).exists()
    new = sorted(p.name for p in folder.rglob("*") if p.is_file() and p.name not in before)
    assert new == ["README.md", "metadata.json", "shard-000.tar.idx", "shard-001.tar.idx"]


def test_reindexing_a_version_1_folder_keeps_its_states(tmp_path, monkeypatch):
    """A state saved before `index` restores after it: same order, same dataset config."""
    write_shards(tmp_path, [np.arange(i, i + 12).reshape(6, 2) for i in range(3)])
    loader = make_loader(ShardedFileDataset(tmp_path, WC))
    it = iter(loader)
    seen = [next(it) for _ in range(7)]
    state = encode(loader.save_state_rank())
    reference = list(make_loader(ShardedFileDataset(tmp_path, WC)))
    config = ShardedFileDataset(tmp_path, WC).config()
    index_folder(tmp_path, progress=False)
    assert json.loads((tmp_path / "metadata.json").read_text())["format"] == 2
    assert ShardedFileDataset(tmp_path, WC).config() == config
    fresh = make_loader(ShardedFileDataset(tmp_path, WC))
    fresh.restore_state_rank(decode(state))
    assert_streams(seen + list(fresh), reference, "after re-indexing")


def test_an_energon_folder_keeps_its_indexes(tmp_path):
    folder = write_tar_folder(tmp_path, [3, 4])
    index_folder(folder, progress=False)
    (folder / "metadata.json").unlink()
    (folder / ".nv-meta").mkdir()
    (folder / ".nv-meta" / ".info.json").write_text(
        json.dumps({"shard_counts": {"shard-000.tar": 3, "shard-001.tar": 4}})
    )
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.idx")}
    index_folder(folder, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.idx")} == stamps  # reused, not rewritten
    assert read_metadata(folder).source == "metadata.json"
    index_folder(folder, progress=False, force=True)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.idx")} != stamps  # rebuilt on request


def test_a_stale_tar_index_is_rebuilt(tmp_path):
    folder = write_tar_folder(tmp_path, [3])
    index_folder(folder, progress=False)
    write_tar(folder / "shard-000.tar", [(f"k{j}", {"txt": b"x"}) for j in range(5)])  # newer than its index
    os.utime(folder / "shard-000.tar.idx", ns=(1, 1))
    meta = index_folder(folder, progress=False)
    assert meta.shards[0].samples == 5 and len(read_all(folder)) == 5


def test_mds_folder(tmp_path):
    folder = write_mds_folder(tmp_path, [3, 2])
    direct = read_all(folder)
    meta = index_folder(folder, progress=False)
    assert [s.format for s in meta.shards] == ["mds", "mds"] and meta.shards[0].options["column_names"][0] == "blob"
    assert read_metadata(folder).source == "metadata.json"
    assert str(read_all(folder)) == str(direct)


def test_shards_are_indexed_in_parallel(tmp_path, monkeypatch):
    folder = write_tar_folder(tmp_path, [2] * 6)
    active, peak, lock = [0], [0], threading.Lock()
    real = indexing._index_one

    def slow(*args, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        try:
            return real(*args, **kw)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(indexing, "_index_one", slow)
    index_folder(folder, workers=3, progress=False)
    assert peak[0] == 3


def test_an_interrupted_run_resumes(tmp_path, monkeypatch):
    folder = write_tar_folder(tmp_path, [2] * 6)
    done = []

    def stop_after_two(entry):
        done.append(entry.path)
        if len(done) == 2:
            raise KeyboardInterrupt  # what a kill looks like from here: the run stops mid-way

    with pytest.raises(KeyboardInterrupt):
        index_folder(folder, workers=1, progress=False, on_shard=stop_after_two)
    assert not (folder / "metadata.json").exists()
    journaled = [json.loads(line)["path"] for line in (folder / JOURNAL).read_bytes().splitlines()]
    assert done[:2] == journaled[:2] and len(journaled) < 6  # (the pool may finish the shard it had started)
    with open(folder / JOURNAL, "ab") as f:
        f.write(b'{"path": "shard-005.tar", "si')  # a torn last line
    calls = []
    real = indexing._index_one
    monkeypatch.setattr(
        indexing, "_index_one", lambda store, entry, *a: calls.append(entry.path) or real(store, entry, *a)
    )
    progress = io.StringIO()
    meta = index_folder(folder, workers=2, progress=IndexProgress(progress))
    assert sorted(calls) == sorted({f"shard-{i:03d}.tar" for i in range(6)} - set(journaled))
    assert f"{len(journaled)} from an earlier run" in progress.getvalue()
    assert "indexing: 6/6 shards" in progress.getvalue()
    assert not (folder / JOURNAL).exists()
    fresh = write_tar_folder(tmp_path / "fresh", [2] * 6)
    assert meta == index_folder(fresh, progress=False)


def test_a_killed_command_resumes(tmp_path):
    """SIGKILL the command line mid-run (each shard slowed down), run it again: it finishes,
    skipping what the journal holds, and writes what an uninterrupted run writes."""
    folder = write_tar_folder(tmp_path / "d", [2] * 12)
    script = (
        "import sys, time; import savable_loader.sources.indexing as ix; real = ix._index_one\n"
        "def slow(*a): time.sleep(0.3); return real(*a)\n"
        "ix._index_one = slow\n"
        "from savable_loader.__main__ import main; sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "index", str(folder), "--workers", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = folder / JOURNAL
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not journal.exists() or len(journal.read_bytes().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (folder / "metadata.json").exists()
    kept = len(journal.read_bytes().splitlines())
    assert 3 <= kept < 12
    out = subprocess.run(
        [sys.executable, "-m", "savable_loader", "index", str(folder), "--json", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["samples"] == 24
    expected = write_tar_folder(tmp_path / "e", [2] * 12)
    index_folder(expected, progress=False)
    assert (folder / "metadata.json").read_bytes() == (expected / "metadata.json").read_bytes()
    for i in range(12):
        name = f"shard-{i:03d}.tar.idx"
        assert (folder / name).read_bytes() == (expected / name).read_bytes()


def test_command_line(tmp_path, capsys):
    folder = write_tar_folder(tmp_path / "d", [3, 2])
    assert main(["index", str(folder), "--workers", "2"]) == 0
    out, err = capsys.readouterr()
    assert "2 shards (2 tar), 5 samples" in out and "wrote metadata.json" in out
    assert "indexing: 2/2 shards" in err
    assert main(["index", str(folder), "--json", "--quiet", "--sha256"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["formats"] == {"tar": 2} and err == ""
    assert "sha256" in (folder / "metadata.json").read_text()
    (tmp_path / "empty").mkdir()
    assert main(["index", str(tmp_path / "empty")]) == 2
    assert "no shard files (.tar, .parquet, .npy, .pt, .jsonl) to index" in capsys.readouterr().err
    (folder / "shard-001.tar").write_bytes(b"junk" * 200)
    assert main(["index", str(folder), "--quiet"]) == 2
    assert "shard-001.tar: no valid tar header at byte 0" in capsys.readouterr().err


def test_bad_arguments(tmp_path):
    with pytest.raises(sl.LoaderUsageError, match="workers must be an int >= 1"):
        index_folder(tmp_path, workers=0)
    with pytest.raises(sl.DataError, match="not a folder"):
        index_folder(tmp_path / "missing")


def test_index_only_the_files_chosen(tmp_path):
    """``files=slice(None, -1)`` indexes all but the last file (nanochat keeps its last
    for validation): the manifest lists only those, and the dataset reads only them."""
    from tests.shard_writers import write_parquet_folder

    folder = write_parquet_folder(tmp_path / "data")
    meta = index_folder(folder, files=slice(None, -1), progress=False)
    assert [s.path for s in meta.shards] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert [s.path for s in read_metadata(folder).shards] == [s.path for s in meta.shards]
    wc = sl.WorkerConfig(num_workers=0, seed=0)
    ds = ShardedFileDataset(folder, wc, shuffle=False)
    assert [int(r["id"]) for r in sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)] == list(range(15))
    (folder / "metadata.json").unlink()
    assert [s.path for s in index_folder(folder, files="*-3.parquet", progress=False).shards] == ["part-3.parquet"]
    (folder / "metadata.json").unlink()
    with pytest.raises(sl.errors.DataError, match=r"'val\.parquet' matches none"):
        index_folder(folder, files=["part-0.parquet", "val.parquet"], progress=False)


def test_metadata_is_readable_per_the_umask(tmp_path):
    """``metadata.json`` (and a tar's index) get the mode open() gives: 0o666 less the
    umask (they were 0o600, unreadable to the other users of a shared data folder)."""
    write_shards(tmp_path / "npy", [np.arange(4)])
    old = os.umask(0o022)
    try:
        (tmp_path / "npy" / "metadata.json").unlink()
        index_folder(tmp_path / "npy", progress=False)
        assert (tmp_path / "npy" / "metadata.json").stat().st_mode & 0o777 == 0o644
        os.umask(0o002)
        write_shards(tmp_path / "npy2", [np.arange(4)])
        assert (tmp_path / "npy2" / "metadata.json").stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(old)
    assert not [p.name for p in (tmp_path / "npy").iterdir() if p.name.endswith(".tmp")]
