"""ShardedFileDataset over WebDataset tars, Parquet, MDS and LitData folders: each sample
once per epoch over ranks x workers with the three strategies, Parquet row groups as
units, resume at every step inside a tar shard and inside a row group (0 and 2 workers,
1 and 2 ranks), restore keys, pipelines on top."""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.sources import ShardedFileDataset, index_folder
from tests.common import assert_same, check_resume_everywhere
from tests.shard_writers import (
    SIZES,
    write_litdata_folder,
    write_mds_folder,
    write_parquet_folder,
    write_tar_folder,
)
from tests.wrapper_common import make_loader, set_snapshot_policy

pytestmark = pytest.mark.timeout(300)

FORMATS = ["tar", "parquet", "mds", "litdata"]
UNEVEN = [5, 3, 7, 6]  # 21 samples


def make_folder(fmt: str, folder: Path, sizes: list[int] = SIZES) -> Path:
    if fmt == "tar":
        write_tar_folder(folder, sizes)
        index_folder(folder, progress=False)
    elif fmt == "parquet":
        pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
        write_parquet_folder(folder, sizes, row_group=2)
        index_folder(folder, progress=False)
    elif fmt == "mds":
        write_mds_folder(folder, sizes)
    else:
        write_litdata_folder(folder, sizes)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {fmt: make_folder(fmt, tmp_path_factory.mktemp(fmt)) for fmt in FORMATS}


def sample_id(sample: Any) -> int:
    if "__key__" in sample:
        return int(sample["__key__"][len("sample") :])
    return int(sample["id"])


def wconf(rank: int = 0, world: int = 1, workers: int = 0, seed: int = 5) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=seed)


def worker_ids(ds: ShardedFileDataset, worker: int, epoch: int) -> tuple[list[int], list[Any]]:
    ids, keys = [], []
    with _ActiveWorker(worker, epoch):
        ds.reset_state_deep()
        for s in ds:
            ids.append(sample_id(s))
            keys.append(ds.sample_key)
    return ids, keys


def epoch_ids(folder: Path, world: int, workers: int, epoch: int, **kw: Any) -> list[list[int]]:
    out = []
    for rank in range(world):
        ds = ShardedFileDataset(folder, wconf(rank, world, workers), **kw)
        out.append([i for w in range(max(workers, 1)) for i in worker_ids(ds, w, epoch)[0]])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_unshuffled_order_is_the_metadata_order(folders, fmt):
    ds = ShardedFileDataset(folders[fmt], wconf(), shuffle=False)
    ids, keys = worker_ids(ds, 0, 0)
    assert ids == list(range(20))
    assert keys[:6] == [[0, i, 0] for i in range(5)] + [[1, 0, 0]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_sample_once_per_epoch_over_2_ranks_x_2_workers(folders, fmt):
    orders = []
    for epoch in range(2):
        per_rank = epoch_ids(folders[fmt], 2, 2, epoch)
        assert [len(r) for r in per_rank] == [10, 10]
        assert sorted(per_rank[0] + per_rank[1]) == list(range(20)), f"epoch {epoch}"
        orders.append(per_rank[0] + per_rank[1])
    assert orders[0] != orders[1]
    assert epoch_ids(folders[fmt], 2, 2, 1) == [orders[1][:10], orders[1][10:]]


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
@pytest.mark.parametrize("world", [2, 3])
def test_strategies_on_an_uneven_folder(tmp_path, fmt, world):
    folder = make_folder(fmt, tmp_path / fmt, UNEVEN)
    if 21 % world:
        with pytest.raises(sl.DataError, match=f"21 samples in 4 shards do not split evenly over world_size={world}"):
            ShardedFileDataset(folder, wconf(0, world))
    over = [x for r in epoch_ids(folder, world, 2, 0, strategy="oversampling") for x in r]
    assert set(over) == set(range(21)) and len(over) == world * -(-21 // world)
    assert sum(c - 1 for c in Counter(over).values()) == -21 % world
    under = [x for r in epoch_ids(folder, world, 2, 0, strategy="undersampling") for x in r]
    assert len(set(under)) == len(under) == 21 - 21 % world


def test_parquet_units_are_row_groups(folders):
    """With shuffle, row groups (of 2 rows here) are permuted, then rows inside each: a
    file's rows are no longer read together, a row group's are."""
    ds = ShardedFileDataset(folders["parquet"], wconf(seed=1))
    ids, keys = worker_ids(ds, 0, 0)
    assert sorted(ids) == list(range(20))
    groups = [(k[0], k[1] // 2) for k in keys]  # (file, row group) of every sample in reading order
    runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
    assert len(runs) == len(set(groups)) == sum(-(-n // 2) for n in SIZES)  # each group read in one go
    files = [k[0] for k in keys]
    assert sum(1 for i in range(1, 20) if files[i] != files[i - 1]) > len(SIZES) - 1  # files interleave
    assert ds.unit_count.tolist() == [2, 2, 1, 2, 1, 2, 2, 2, 1, 2, 2, 1]


# -- resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_resume_at_every_step_in_process(folders, fmt, rank, world, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")

    def factory():
        return make_loader(ShardedFileDataset(folders[fmt], wconf(rank, world, 0)))

    assert check_resume_everywhere(factory, 2, variants=("live", "break")) >= 2 * 20 // world


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
@pytest.mark.parametrize("policy", ["every", "default"])
def test_resume_at_every_step_with_2_workers(folders, fmt, policy, monkeypatch):
    """Rank 1 of 2, 2 worker processes, shuffled: every save point of two epochs (the
    workers' pieces start and end inside shards and row groups)."""
    set_snapshot_policy(monkeypatch, policy)

    def factory():
        return make_loader(ShardedFileDataset(folders[fmt], wconf(1, 2, 2)))

    assert check_resume_everywhere(factory, 2) == 2 * 10 + 3


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_resume_through_a_pipeline(folders, fmt, monkeypatch):
    """Map (random draws) + shuffle buffer + batch on top, oversampling over 3 ranks."""
    set_snapshot_policy(monkeypatch, "every")

    def factory():
        ds = ShardedFileDataset(folders[fmt], wconf(2, 3, 0), strategy="oversampling")
        mapped = sl.wrappers.MapDataset(ds, lambda s: (sample_id(s), torch.rand(2), random.random()))
        shuffled = sl.wrappers.ShuffleBufferDataset(mapped, 3)
        return make_loader(sl.wrappers.BatchDataset(shuffled, 2, collate_fn=list))

    assert check_resume_everywhere(factory, 2) == 2 * 4 + 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_sample_rebuilds_samples_and_their_random_draws(folders, fmt):
    wc = wconf(1, 2, 2)
    ds = ShardedFileDataset(folders[fmt], wc, columns=None)
    seen = []
    with _ActiveWorker(1, 3):
        ds.reset_state_deep()
        for s in ds:
            seen.append((ds.sample_key, s, torch.rand(2)))
    rebuild = ShardedFileDataset(folders[fmt], wc)
    for key, sample, draw in random.Random(0).sample(seen, 3) + [seen[-1]]:
        with _ActiveWorker(1, 3):
            assert_same(rebuild.restore_sample(list(key)), sample, f"key {key}")
            assert torch.equal(torch.rand(2), draw)


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_loader_restore_sample_with_workers(folders, fmt):
    def build():
        ds = ShardedFileDataset(folders[fmt], wconf(0, 2, 2), columns=["txt"] if fmt == "tar" else ["id"])
        return make_loader(sl.wrappers.BatchDataset(ds, 3, collate_fn=list))

    loader = build()
    seen = [(batch, str(loader.restore_key)) for batch in loader]
    other = build()
    for batch, key in seen:
        assert_same(other.restore_sample(key), batch, key)


def test_upcoming_shards_follow_the_reading_order(folders):
    """The rest of this epoch's reading order, then the next epoch's (for prefetch)."""
    keys = worker_ids(ShardedFileDataset(folders["parquet"], wconf()), 0, 0)[1]
    following = worker_ids(ShardedFileDataset(folders["parquet"], wconf()), 0, 1)[1]
    ds = ShardedFileDataset(folders["parquet"], wconf())
    with _ActiveWorker(0, 0):
        ds.reset_state_deep()
        it = iter(ds)
        for p in range(21):
            ahead = list(dict.fromkeys(k[0] for k in keys[p:] + following))
            assert ds.upcoming_shards(10) == ahead and ds.upcoming_shards(2) == ahead[:2], f"position {p}"
            next(it, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_columns_select_fields(folders, fmt):
    columns = {"tar": ["txt", "cls"], "parquet": ["text", "id"], "mds": ["text", "id"], "litdata": ["text", "id"]}[fmt]
    ds = ShardedFileDataset(folders[fmt], wconf(), shuffle=False, columns=columns)
    with _ActiveWorker(0, 0):
        ds.reset_state_deep()
        first = next(iter(ds))
    assert list(first) == (["__key__"] if fmt == "tar" else []) + columns
    assert ds.config()["columns"] == columns
    bad = ShardedFileDataset(folders[fmt], wconf(), columns=["nope"])
    with _ActiveWorker(0, 0), pytest.raises(sl.DataError, match="nope"):
        next(iter(bad))
    for wrong in ("text", [], ["a", "a"], [1]):
        with pytest.raises(sl.LoaderUsageError, match="columns"):
            ShardedFileDataset(folders[fmt], wconf(), columns=wrong)


def test_values_of_each_format(folders):
    reads = {}
    for fmt in FORMATS:
        ds = ShardedFileDataset(folders[fmt], wconf(), shuffle=False)
        with _ActiveWorker(0, 0):
            ds.reset_state_deep()
            reads[fmt] = list(ds)[7]
    assert reads["tar"] == {
        "__key__": "sample00007",
        "bin": bytes(range(0)) * 8,
        "cls": b"1",
        "json": b'{"id": 7}',
        "txt": b"text 7",
    }
    assert reads["parquet"] == {"id": 7, "text": "row 7", "tags": [7, 1], "score": 1.75}
    mds = reads["mds"]
    assert list(mds) == sorted(mds) and mds["id"] == 7 and mds["text"] == "text 7" and mds["meta"] == {"j": [7]}
    assert mds["x"].dtype == np.int16 and mds["x"].tolist() == list(range(8)) and mds["x"].flags.writeable
    assert type(mds["f"]) is np.float32 and type(mds["u"]) is np.uint8 and mds["y"].tolist() == [3.5] * 3
    lit = reads["litdata"]
    assert lit["id"] == 7 and lit["text"] == "s7" and lit["ok"] is False and lit["f"] == 3.5 and lit["b"] == b"xy"
    assert lit["x"].dtype == np.float32 and lit["m"].shape == (2, 2) and torch.equal(lit["t"], torch.arange(3) * 7)


@pytest.mark.parametrize("fmt", ["tar"])
def test_spawned_workers_read_what_one_process_reads(folders, fmt):
    """Readers (memory maps) are opened in each worker, never pickled."""

    def epoch(workers: int, context: str | None) -> list[int]:
        ds = ShardedFileDataset(folders[fmt], wconf(0, 1, workers), decode=True if fmt == "tar" else None)
        kw = {"multiprocessing_context": context} if context else {}
        return [sample_id(s) for s in sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, **kw)]

    spawned = epoch(2, "spawn")
    assert sorted(spawned) == list(range(20))
    assert spawned == epoch(2, "fork")


_TRUNCATE = """
import os, sys
from pathlib import Path
import numpy as np, torch
import savable_loader as sl
from savable_loader.errors import DataError
from savable_loader.sources import ShardedFileDataset, write_shards
from tests.sources.test_shard_formats import make_folder

fmt, workers, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
if fmt == "npy":
    write_shards(folder, [np.full((64, 4096), s, np.uint8) for s in range(4)])
elif fmt == "pt":
    write_shards(folder, [torch.full((64, 4096), s, dtype=torch.uint8) for s in range(4)], fmt=".pt")
else:
    make_folder(fmt, folder, [16, 16, 16, 16])
wc = sl.WorkerConfig(num_workers=workers, seed=0)
loader = sl.SavableDataLoader(ShardedFileDataset(folder, wc), batch_size=None, worker_config=wc)
try:
    for n, _ in enumerate(loader):
        if n == 0:  # a sync job rewrites the shards (open with O_TRUNC, then writes)
            for shard in folder.iterdir():
                if shard.name != "metadata.json" and not shard.name.endswith((".idx", ".json")):
                    os.truncate(shard, 0)
except DataError as e:
    print("CAUGHT", type(e).__name__, e)
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", ["npy", "pt", *FORMATS])
def test_a_shard_truncated_while_open_is_a_data_error_naming_it(tmp_path: Path, fmt: str, workers: int) -> None:
    """A memory-mapped shard cut short mid-epoch: a DataError naming the shard and the
    offset being read, with and without workers (never SIGBUS, never a worker death)."""
    import os
    import subprocess
    import sys

    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _TRUNCATE, fmt, str(workers), str(tmp_path / "shards")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    assert out.stdout.startswith("CAUGHT DataError"), out.stdout + out.stderr[-3000:]
    opened = r"the shard was truncated while open: reading byte offset \d+"  # the shard being read
    later = r"the file has 0 bytes(, the folder's manifest says \d+)?"  # one opened after the cut
    assert re.search(rf"/[^ /]+: ({opened}|{later})", out.stdout), out.stdout + out.stderr[-3000:]


def test_a_shard_cut_before_the_reader_opened_it_is_named_against_the_manifest(tmp_path: Path) -> None:
    """The moment between the store's look at a shard and the reader's own open: a file
    cut there is a DataError naming the manifest's size (or the size it had when opened),
    never the parser's bare complaint."""
    from savable_loader.errors import DataError
    from savable_loader.sources.shards.readers import _check_not_cut

    shard = tmp_path / "shard-00000.npy"
    shard.write_bytes(b"")
    with pytest.raises(DataError, match=r"shard-00000\.npy: the file has 0 bytes, the folder's manifest says 4224"):
        _check_not_cut(shard, 0, 4224)
    with pytest.raises(DataError, match=r"shard-00000\.npy: the shard was truncated while open"):
        _check_not_cut(shard, 4224, 4224)
    with pytest.raises(DataError, match=r"shard-00000\.npy: the file has 0 bytes \(something cut"):
        _check_not_cut(shard, 0, None)  # a manifest without sizes: an empty file is never a shard
    shard.write_bytes(b"x" * 10)
    _check_not_cut(shard, 10, None)  # nothing wrong with the size: the parser's own error follows
    _check_not_cut(shard, 10, 10)
