"""metadata.json version 2 (and 1), the manifests of other libraries, and the storage
seam (LocalShardStore / LocalShardFile): every malformed field a named DataError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import savable_loader as sl
from savable_loader.sources import ShardedFileDataset, read_metadata
from savable_loader.sources.shards.manifest import Metadata, ShardEntry, encode_metadata, order_digest_input
from savable_loader.sources.shards.remote import store_for
from savable_loader.sources.shards.store import LocalShardFile, LocalShardStore
from tests.shard_writers import write_tar_folder

WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


def folder_with(tmp_path: Path, metadata: Any) -> Path:
    write_tar_folder(tmp_path, [2, 2])
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    return tmp_path


def tar(path: str = "shard-000.tar", **kw: Any) -> dict[str, Any]:
    return {"path": path, "samples": 2, "format": "tar", **kw}


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        ([tar(format="zip")], r"`\$.shards\[0\].format` is 'zip'; expected one of npy, pt, jsonl, tar, parquet, mds"),
        ([{"path": "shard-000.tar", "samples": 2}], r"`\$.shards\[0\].format` is None"),
        ([tar(size=-1)], r"Expected `int` >= 0 - at `\$.shards\[0\].size`"),
        ([tar(sha256="XYZ")], r"`\$.shards\[0\].sha256` is 'XYZ'; expected 64 lowercase hexadecimal digits"),
        ([tar(index="../x.idx")], r"`\$.shards\[0\].index` is '../x.idx'; expected a path relative"),
        (
            [{"path": "a.npy", "samples": 2, "format": "npy", "index": "a.idx"}],
            r"`\$.shards\[0\].index` is set for a 'npy'",
        ),
        ([tar(row_groups=[2])], r"`\$.shards\[0\].row_groups` is set for a 'tar' shard"),
        ([{"path": "s.mds", "samples": 2, "format": "mds"}], r"`\$.shards\[0\].options` is missing"),
        ([tar(colour="red")], r"unknown field `colour` - at `\$.shards\[0\]`"),
        ([tar(), tar()], r"`\$.shards\[1\].path` is 'shard-000.tar', which is listed twice"),
        ([tar("gone.tar")], r"`\$.shards\[0\].path`: shard file .*gone.tar does not exist"),
    ],
)
def test_bad_version_2_metadata(tmp_path, shards, message):
    folder = folder_with(tmp_path, {"format": 2, "shards": shards})
    with pytest.raises(sl.DataError, match=message) as info:
        ShardedFileDataset(folder, WC)
    assert str(folder / "metadata.json") in str(info.value)


def test_version_1_refuses_version_2_fields(tmp_path):
    folder = folder_with(tmp_path, {"format": 1, "shards": [{"path": "a.npy", "samples": 2, "size": 3}]})
    with pytest.raises(sl.DataError, match=r"`\$.shards\[0\].size` is a field of format 2, but `\$.format` is 1"):
        read_metadata(folder)
    folder = folder_with(tmp_path, {"format": 1, "shards": [{"path": "shard-000.tar", "samples": 2}]})
    with pytest.raises(sl.DataError, match=r"expected a file ending in one of .npy, .pt, .jsonl"):
        read_metadata(folder)


def test_a_folder_without_a_manifest(tmp_path):
    write_tar_folder(tmp_path, [2])
    with pytest.raises(sl.DataError) as info:
        ShardedFileDataset(tmp_path, WC)
    text = str(info.value)
    assert "metadata.json: cannot read the shard metadata (No such file; no Energon .nv-meta/.info.json" in text
    assert f"write one with `python -m savable_loader index {tmp_path}`" in text
    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / ".info.yaml").write_text("shard_counts:\n  shard-000.tar: 2\n")
    with pytest.raises(sl.DataError, match=r"found .nv-meta/.info.yaml of an older Energon version"):
        ShardedFileDataset(tmp_path, WC)
    (tmp_path / ".nv-meta" / ".info.json").write_text('{"shard_counts": {"shard-000.tar": "2"}}')
    with pytest.raises(sl.DataError, match=r".info.json: Expected `int`, got `str` - at `\$.shard_counts\[...\]`"):
        ShardedFileDataset(tmp_path, WC)
    (tmp_path / ".nv-meta" / ".info.json").write_text('{"shard_counts": {"shard-000.tar": 2}}')
    with pytest.raises(sl.DataError, match=r"shard-000.tar.idx: the index of tar shard .* does not exist"):
        ShardedFileDataset(tmp_path, WC)
    (tmp_path / "index.json").write_text("[1]")
    (tmp_path / ".nv-meta" / ".info.json").unlink()
    with pytest.raises(sl.DataError, match="index.json: neither a MosaicML Streaming index"):
        ShardedFileDataset(tmp_path, WC)


def test_order_digest_ignores_what_does_not_change_the_order():
    v1 = Metadata(format=1, shards=[ShardEntry(path="a.npy", samples=3)])
    v2 = Metadata(format=2, shards=[ShardEntry(path="a.npy", samples=3, format="npy", size=200, sha256="0" * 64)])
    assert order_digest_input(v1) == order_digest_input(v2) == [{"path": "a.npy", "samples": 3}]
    pq = Metadata(format=2, shards=[ShardEntry(path="p.parquet", samples=3, format="parquet", row_groups=[2, 1])])
    assert order_digest_input(pq) == [{"path": "p.parquet", "samples": 3, "units": [2, 1]}]
    assert b'"row_groups"' in encode_metadata(pq) and b"sha256" not in encode_metadata(pq)


def test_local_store(tmp_path):
    store = store_for(tmp_path)
    assert isinstance(store, LocalShardStore) and store_for(store) is store
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"0123456789")
    (tmp_path / "a.txt").write_text("x")
    assert store.list_files() == ["a.txt", "sub/b.bin"]
    assert store.read_small("missing") is None and store.read_small("a.txt/x") is None
    with pytest.raises(sl.DataError, match="is a folder, expected a file"):
        store.read_small("sub")
    store.write_small("sub/c.json", b"{}")
    assert store.read_small("sub/c.json") == b"{}" and sorted(p.name for p in (tmp_path / "sub").iterdir()) == [
        "b.bin",
        "c.json",
    ]  # no temp file left
    file = store.open_shard("sub/b.bin", 10, whole=False)
    assert file.read(2, 3) == b"234" and file.read(10, 0) == b""
    with pytest.raises(sl.DataError, match=r"b.bin: truncated: wanted bytes \[8, 12\), the file has 10 bytes"):
        file.read(8, 4)
    file.close()
    with pytest.raises(sl.DataError, match="read after close"):
        file.read(0, 1)
    with pytest.raises(sl.DataError, match=r"b.bin: the file has 10 bytes, the folder's manifest says 11"):
        store.open_shard("sub/b.bin", 11, whole=True)
    with pytest.raises(sl.DataError, match="nope.bin: shard file does not exist"):
        LocalShardFile(tmp_path / "nope.bin")
