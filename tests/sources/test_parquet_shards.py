"""Parquet shards: rows as dicts, a row group decoded once with only the columns asked
for, ranged reads without a local file, and named errors for files that changed."""

from __future__ import annotations

from pathlib import Path

import pytest

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.sources import ShardedFileDataset, index_folder, open_shard
from savable_loader.sources.shards.manifest import ShardEntry
from savable_loader.sources.shards.parquet import ParquetReader, _RangeFile
from savable_loader.sources.shards.readers import ReadOptions
from savable_loader.sources.shards.store import LocalShardFile, LocalShardStore
from tests.shard_writers import write_parquet_folder

pa = pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(120)
WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_parquet_folder(tmp_path, [5, 4], row_group=2)
    index_folder(tmp_path, progress=False)
    return tmp_path


def test_rows_equal_pyarrows_reading(folder):
    ds = ShardedFileDataset(folder, WC, shuffle=False)
    with _ActiveWorker(0, 0):
        ours = list(ds)
    theirs = [row for p in sorted(folder.glob("*.parquet")) for row in pq.read_table(p).to_pylist()]
    assert ours == theirs
    assert ds.metadata.shards[0].row_groups == [2, 2, 1]


def test_one_row_group_decoded_at_a_time_with_a_projection(folder, monkeypatch):
    reads = []
    real = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kw):
        reads.append((i, tuple(columns)))
        return real(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    ds = ShardedFileDataset(folder, WC, columns=["text"])
    with _ActiveWorker(0, 0):
        rows = list(ds)
    assert {tuple(r) for r in rows} == {("text",)}
    assert len(reads) == 5 and all(c == ("text",) for _, c in reads)  # each of the 5 row groups once


def test_nested_values_are_fresh_objects(folder):
    reader = open_shard(folder / "part-0.parquet")
    first = reader.read(1)
    first["tags"].append("mutated")
    assert reader.read(1)["tags"] == [1, 1]


def test_ranged_reads_without_a_local_file(folder):
    """What a remote store does for restore_sample: no local path, only ranged reads."""

    class Ranged(LocalShardFile):
        reads = 0

        @property
        def local_path(self):
            return None

        def read(self, offset, length):
            Ranged.reads += 1
            return super().read(offset, length)

    store = LocalShardStore(folder)
    entry = ShardEntry(path="part-1.parquet", samples=4, format="parquet", row_groups=[2, 2])
    reader = ParquetReader(Ranged(folder / "part-1.parquet"), entry, store, ReadOptions(columns=("id",)))
    assert [reader.read(i) for i in (3, 0)] == [{"id": 8}, {"id": 5}]
    assert Ranged.reads > 0
    raw = _RangeFile(LocalShardFile(folder / "part-1.parquet"))
    raw.seek(-4, 2)
    assert raw.read(4) == b"PAR1" and raw.tell() == raw.file.size


def test_changed_files_are_named(folder):
    pq.write_table(
        pa.table({"id": list(range(5)), "text": ["x"] * 5, "tags": [[1]] * 5, "score": [0.0] * 5}),
        folder / "part-0.parquet",
        row_group_size=5,
    )
    ds = ShardedFileDataset(folder, WC, shuffle=False)
    with (
        _ActiveWorker(0, 0),
        pytest.raises(sl.DataError, match="part-0.parquet: the file has .* bytes, the folder's manifest says"),
    ):
        list(ds)
    meta = (folder / "metadata.json").read_text()
    size = (folder / "part-0.parquet").stat().st_size
    import re

    (folder / "metadata.json").write_text(re.sub(r'"size": \d+', f'"size": {size}', meta, count=1))
    ds = ShardedFileDataset(folder, WC, shuffle=False)
    with (
        _ActiveWorker(0, 0),
        pytest.raises(
            sl.DataError,
            match=r"part-0.parquet: the metadata says row groups of "
            r"\[2, 2, 1\] rows, the file has \[5\] \(it changed",
        ),
    ):
        list(ds)
    (folder / "part-1.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(sl.DataError, match="part-1.parquet: cannot read the Parquet file"):
        index_folder(folder, progress=False)


def test_metadata_rules_for_parquet(tmp_path):
    write_parquet_folder(tmp_path, [3], row_group=2)
    (tmp_path / "metadata.json").write_text(
        '{"format": 2, "shards": [{"path": "part-0.parquet", "samples": 3, "format": "parquet"}]}'
    )
    with pytest.raises(sl.DataError, match=r"`\$.shards\[0\].row_groups` is missing"):
        ShardedFileDataset(tmp_path, WC)
    (tmp_path / "metadata.json").write_text(
        '{"format": 2, "shards": [{"path": "part-0.parquet", "samples": 3, "format": "parquet", "row_groups": [2, 2]}]}'
    )
    with pytest.raises(sl.DataError, match=r"`\$.shards\[0\].row_groups` add up to 4 rows, but `samples` is 3"):
        ShardedFileDataset(tmp_path, WC)


@pytest.mark.parametrize("left", [0, 100])
def test_a_shard_cut_between_the_size_check_and_the_footer_read_is_named_truncated(folder, left):
    # the store checked the size when it opened the shard; a sync job cuts the file before
    # pyarrow reads its footer: the truncation error, not pyarrow's "file size is 0 bytes"
    path = folder / "part-1.parquet"
    size = path.stat().st_size
    file = LocalShardFile(path, size)
    entry = ShardEntry(path="part-1.parquet", samples=4, format="parquet", row_groups=[2, 2])
    with open(path, "r+b") as f:
        f.truncate(left)
    with pytest.raises(
        sl.DataError,
        match=rf"part-1\.parquet: the shard was truncated while open: reading byte offset {size - 8}, the file has {left} bytes, {size} expected",
    ):
        ParquetReader(file, entry, LocalShardStore(folder), ReadOptions())
    file.close()


def test_a_parquet_file_that_is_not_one_is_still_named_as_such(folder):
    path = folder / "part-1.parquet"
    path.write_bytes(b"not a parquet file at all")
    file = LocalShardFile(path)
    entry = ShardEntry(path="part-1.parquet", samples=4, format="parquet")
    with pytest.raises(sl.DataError, match=r"part-1\.parquet: cannot read the Parquet file \(ArrowInvalid"):
        ParquetReader(file, entry, LocalShardStore(folder), ReadOptions())
    file.close()
