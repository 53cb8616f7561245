"""WebDataset tar shards: samples as webdataset groups them (USTAR, PAX, GNU headers),
an Energon-prepared folder read unchanged, decoders, and a named DataError (shard and
byte offset) for every corrupt, truncated or mismatched tar and index."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.sources import DEFAULT_DECODERS, ShardedFileDataset, decode_sample, index_folder, open_shard
from savable_loader.sources.shards.store import LocalShardFile
from savable_loader.sources.shards.tar import scan_tar
from tests.shard_writers import tar_members, write_tar, write_tar_folder

pytestmark = pytest.mark.timeout(180)

WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


def read_all(folder: Path, **kw: Any) -> list[dict[str, Any]]:
    ds = ShardedFileDataset(folder, WC, shuffle=False, **kw)
    with _ActiveWorker(0, 0):
        ds.reset_state_deep()
        return list(ds)


def webdataset_reading(tars: list[Path]) -> list[dict[str, Any]]:
    wds = pytest.importorskip("webdataset", reason="webdataset (test extra) is not installed")
    out = []
    for sample in wds.WebDataset([str(t) for t in tars], shardshuffle=False):
        out.append({k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")})
    return out


def tricky_samples() -> list[tuple[str, dict[str, bytes]]]:
    """Keys with folders, dots in extensions, upper-case extensions, a long path and
    non-ASCII names (PAX headers in PAX format, prefix or GNU long names otherwise)."""
    return [
        ("a/b/0001", {"jpg": b"\xff\xd8jpeg", "seg.png": b"png", "JSON": b"{}"}),
        ("a/b/0002", {"txt": b"two"}),
        ("deep/" + "x" * 120 + "/0003", {"txt": b"long", "cls": b"3"}),
        ("caf\u00e9-0004", {"txt": "\u00e9t\u00e9".encode()}),
        ("0005", {"txt": b"", "bin": bytes(1500)}),
    ]


@pytest.mark.parametrize(
    "fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT], ids=["pax", "gnu", "ustar"]
)
def test_samples_equal_webdataset_reading(tmp_path, fmt):
    samples = tricky_samples()
    if fmt == tarfile.USTAR_FORMAT:  # no room for non-ASCII names or a 100+ char file name
        samples = [s for s in samples if s[0].isascii()]
    extra = [("__meta__", b"skipped"), ("README", b"no extension: not a sample member")]
    write_tar(tmp_path / "a.tar", samples[:3], fmt, extra)
    write_tar(tmp_path / "b.tar", samples[3:], fmt)
    with tarfile.open(tmp_path / "a.tar", "a", format=fmt) as tar:  # directories and links are no members
        info = tarfile.TarInfo("a/dir")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    index_folder(tmp_path, progress=False)
    ours = read_all(tmp_path)
    expected = [{"__key__": key, **{ext.lower(): data for ext, data in members.items()}} for key, members in samples]
    assert ours == expected
    assert ours == webdataset_reading([tmp_path / "a.tar", tmp_path / "b.tar"])


def test_webdataset_tarwriter_output_and_decoders(tmp_path):
    wds = pytest.importorskip("webdataset", reason="webdataset (test extra) is not installed")
    with wds.TarWriter(str(tmp_path / "w.tar")) as writer:
        for j in range(6):
            writer.write(
                {
                    "__key__": f"k{j}",
                    "txt": f"text {j}",
                    "cls": j % 3,
                    "json": {"j": j},
                    "npy": np.arange(j, dtype=np.float32),
                    "pth": torch.full((2,), float(j)),
                }
            )
    index_folder(tmp_path, progress=False)
    ours = read_all(tmp_path)
    assert ours == webdataset_reading([tmp_path / "w.tar"])
    decoded = read_all(tmp_path, decode=True)
    assert decoded[4]["txt"] == "text 4" and decoded[4]["cls"] == 1 and decoded[4]["json"] == {"j": 4}
    assert decoded[4]["npy"].tolist() == [0, 1, 2, 3] and torch.equal(decoded[4]["pth"], torch.full((2,), 4.0))
    assert decode_sample(ours[4])["json"] == {"j": 4}
    own = read_all(tmp_path, decode={"txt": lambda b: b.decode().upper()})
    assert own[2]["txt"] == "TEXT 2" and own[2]["cls"] == b"2"  # extensions without a decoder stay bytes
    both = read_all(tmp_path, decode={**DEFAULT_DECODERS, "cls": lambda b: -int(b)})
    assert both[2]["cls"] == -2 and both[2]["txt"] == "text 2"
    with pytest.raises(sl.LoaderUsageError, match="decode must be"):
        ShardedFileDataset(tmp_path, WC, decode="yes")
    failing = ShardedFileDataset(tmp_path, WC, shuffle=False, decode={"txt": int})
    with (
        _ActiveWorker(0, 0),
        pytest.raises(sl.DataError, match=r"w.tar: cannot decode 'txt' of sample 'k0' \(at byte \d+\): ValueError"),
    ):
        next(iter(failing))


def test_image_decoding(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(buf, format="PNG")
    write_tar(tmp_path / "i.tar", [("im", {"png": buf.getvalue()})])
    index_folder(tmp_path, progress=False)
    image = read_all(tmp_path, decode=True)[0]["png"]
    assert image.size == (4, 3) and image.getpixel((0, 0)) == (10, 20, 30)


# -- Energon ------------------------------------------------------------------------------


def folder_snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def energon_prepare(folder: Path) -> None:
    pytest.importorskip("megatron.energon", reason="megatron-energon (test extra) is not installed")
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    tars = sorted(p.name for p in folder.glob("*.tar"))
    WebdatasetPreparator.prepare_dataset(folder, tars, split_parts_ratio=[("train", 1.0)], workers=1)


def test_energon_prepared_dataset_is_read_unchanged(tmp_path):
    folder = write_tar_folder(tmp_path / "en", [4, 6, 3])
    energon_prepare(folder)
    assert (folder / ".nv-meta" / ".info.json").is_file() and (folder / "shard-000.tar.idx").is_file()
    before = folder_snapshot(folder)
    ours = read_all(folder)
    assert sorted(s["__key__"] for s in ours) == [f"sample{j:05d}" for j in range(13)]
    split = ShardedFileDataset(folder, WC).metadata.shards  # the order of the train part of split.yaml
    assert sorted(e.path for e in split) == ["shard-000.tar", "shard-001.tar", "shard-002.tar"]
    assert ours == webdataset_reading([folder / e.path for e in split])
    shuffled = ShardedFileDataset(
        folder, sl.WorkerConfig(rank=1, world_size=2, num_workers=0, seed=3), strategy="undersampling"
    )
    assert shuffled.metadata.source == "energon"
    assert {e.index for e in shuffled.metadata.shards} == {f"shard-00{i}.tar.idx" for i in range(3)}
    with _ActiveWorker(0, 1):
        got = list(shuffled)
        assert shuffled.restore_sample(shuffled.sample_key) == got[-1]
    assert folder_snapshot(folder) == before  # nothing written, nothing touched


def test_our_index_is_energons(tmp_path):
    """index_folder writes the .tar.idx bytes Energon's prepare writes (so Energon reads ours)."""
    ours = write_tar_folder(tmp_path / "ours", [4, 6, 3])
    theirs = write_tar_folder(tmp_path / "theirs", [4, 6, 3])
    with tarfile.open(ours / "shard-001.tar", "a") as tar:  # a trailing non-sample member changes the end offset
        tar.addfile(tarfile.TarInfo("__end__"), io.BytesIO(b""))
    with tarfile.open(theirs / "shard-001.tar", "a") as tar:
        tar.addfile(tarfile.TarInfo("__end__"), io.BytesIO(b""))
    energon_prepare(theirs)
    index_folder(ours, progress=False)
    for name in ("shard-000.tar.idx", "shard-001.tar.idx", "shard-002.tar.idx"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    offsets = np.frombuffer((ours / "shard-000.tar.idx").read_bytes(), "<u8")
    assert len(offsets) == 5 and offsets[0] == 0


def test_open_shard_scans_a_tar_without_index(tmp_path):
    write_tar(tmp_path / "x.tar", [(f"s{j}", tar_members(j)) for j in range(3)])
    reader = open_shard(tmp_path / "x.tar", expected=3, columns=["txt"])
    assert reader.read(2) == {"__key__": "s2", "txt": b"text 2"}
    with pytest.raises(sl.DataError, match="the metadata says 4 samples, the shard holds 3"):
        open_shard(tmp_path / "x.tar", expected=4)


# -- errors -------------------------------------------------------------------------------


def indexed(tmp_path: Path, sizes: list[int] = (3, 4)) -> Path:  # type: ignore[assignment]
    folder = write_tar_folder(tmp_path / "d", list(sizes))
    index_folder(folder, progress=False)
    return folder


def first_error(folder: Path, **kw: Any) -> str:
    ds = ShardedFileDataset(folder, WC, shuffle=False, **kw)
    with _ActiveWorker(0, 0), pytest.raises(sl.DataError) as info:
        list(ds)
    return str(info.value)


def header_offsets(path: Path) -> list[int]:
    with tarfile.open(path) as tar:
        return [m.offset for m in tar.getmembers()]


def test_truncated_tar_is_named_when_indexing(tmp_path):
    folder = write_tar_folder(tmp_path / "d", [3, 4])
    path = folder / "shard-001.tar"
    third = header_offsets(path)[11]  # sample00005.bin, 30 bytes of data
    path.write_bytes(path.read_bytes()[: third + 512 + 3])  # cut inside its data
    with pytest.raises(
        sl.DataError,
        match=rf"shard-001.tar: truncated: member 'sample00005.bin' \(header at byte "
        rf"{third}\) needs bytes up to \d+, the file has {third + 515}",
    ):
        index_folder(folder, progress=False)
    path.write_bytes(path.read_bytes()[:third])  # cut at a member boundary: no end-of-archive block
    with pytest.raises(
        sl.DataError,
        match=rf"shard-001.tar: truncated: no end-of-archive block after the last "
        rf"member \(it ends at byte {third}",
    ):
        index_folder(folder, progress=False)


def test_truncated_after_indexing(tmp_path):
    folder = indexed(tmp_path)
    path = folder / "shard-001.tar"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-2048])
    assert f"shard-001.tar: the file has {size - 2048} bytes, the folder's manifest says {size}" in first_error(folder)
    (folder / "metadata.json").unlink()  # an Energon-style folder without sizes: the index catches it
    info = folder / ".nv-meta" / ".info.json"
    info.parent.mkdir()
    info.write_text(json.dumps({"shard_counts": {"shard-000.tar": 3, "shard-001.tar": 4}}))
    path.write_bytes(path.read_bytes()[:-4096])
    assert "shard-001.tar.idx: the samples end at byte" in first_error(folder)
    assert f"but the tar has {size - 6144} bytes (truncated?)" in first_error(folder)


def test_corrupt_header(tmp_path):
    folder = indexed(tmp_path)
    path = folder / "shard-001.tar"
    offset = header_offsets(path)[5]
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 0xFF  # a byte of the name: the checksum no longer matches
    path.write_bytes(bytes(data))
    assert f"shard-001.tar: no valid tar header at byte {offset} (bad checksum)" in first_error(folder)
    with pytest.raises(sl.DataError, match=f"no valid tar header at byte {offset}"):
        index_folder(folder, progress=False, force=True)


def test_not_a_tar_and_gzip(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.tar").write_bytes(b"hello" * 300)
    with pytest.raises(
        sl.DataError,
        match=r"x.tar: no valid tar header at byte 0 \(bad checksum\); the file is "
        "corrupt or not a tar",
    ):
        index_folder(tmp_path / "a", progress=False)
    write_tar(tmp_path / "y.tar", [("k", {"txt": b"x"})])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.tar").write_bytes(gzip.compress((tmp_path / "y.tar").read_bytes()))
    with pytest.raises(sl.DataError, match="z.tar: a gzip-compressed tar"):
        index_folder(tmp_path / "b", progress=False)


def test_duplicate_extension_in_a_sample(tmp_path):
    write_tar(tmp_path / "x.tar", [("k", {"txt": b"1"}), ("k", {"txt": b"2"})])
    index_folder(tmp_path, progress=False)  # one key: one sample in the index
    assert "x.tar: sample 'k' has two members with extension 'txt' (at byte 1024)" in first_error(tmp_path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o[:-1].tobytes() + b"\x00", r"not a tar index \(a non-empty multiple of 8 bytes\)"),
        (lambda o: o[1:].tobytes(), r"shard-001.tar.idx: indexes 3 samples, the metadata says 4"),
        (lambda o: o[[0, 2, 1, 3, 4]].tobytes(), r"offset 2 \(\d+\) does not grow"),
        (lambda o: (o + np.array([0, 8, 0, 0, 0], "<u8")).tobytes(), r"offset 1 \(\d+\) is not a multiple of 512"),
        (
            lambda o: (o + np.array([0, 0, 0, 0, 10240], "<u8")).tobytes(),
            r"the samples end at byte \d+, but the tar has",
        ),
        (
            lambda o: (o - np.array([0, 512, 0, 0, 0], "<u8")).tobytes(),
            r"the index says a sample ends at byte (\d+), but no tar header starts there",
        ),
        (
            lambda o: (o + np.array([0, 512, 0, 0, 0], "<u8")).tobytes(),
            r"hold the keys 'sample00003' and 'sample00004'",
        ),
        (
            lambda o: (o - np.array([0, 1024, 0, 0, 0], "<u8")).tobytes(),  # one member (header + data) too early
            r"sample 'sample00003' continues past byte \d+, where the index says it ends",
        ),
    ],
    ids=["length", "count", "order", "alignment", "end", "start", "boundaries", "early"],
)
def test_bad_index(tmp_path, mutate, message):
    folder = indexed(tmp_path, [3, 4])
    idx = folder / "shard-001.tar.idx"
    idx.write_bytes(mutate(np.frombuffer(idx.read_bytes(), "<u8").copy()))
    text = first_error(folder)
    assert "shard-001.tar" in text and "run `python -m savable_loader index" in text
    import re

    assert re.search(message, text), text


def test_missing_index(tmp_path):
    folder = indexed(tmp_path)
    (folder / "shard-001.tar.idx").unlink()
    with pytest.raises(
        sl.DataError,
        match=r"shard-001.tar.idx: the index of tar shard .*shard-001.tar does not "
        r"exist: write it with `python -m savable_loader index",
    ):
        ShardedFileDataset(folder, WC)


def test_scan_reads_gnu_base256_sizes(tmp_path):
    """A member size in GNU's base-256 form (used for members of 8 GiB and more)."""
    write_tar(tmp_path / "x.tar", [("k", {"bin": bytes(range(256)) * 3})], tarfile.GNU_FORMAT)
    data = bytearray((tmp_path / "x.tar").read_bytes())
    field = b"\x80" + (768).to_bytes(11, "big")
    data[124:136] = field
    data[148:156] = b"        "
    data[148:156] = f"{sum(data[:512]):06o}\0 ".encode()
    (tmp_path / "x.tar").write_bytes(bytes(data))
    file = LocalShardFile(tmp_path / "x.tar")
    assert scan_tar(file).tolist() == [0, 512 + 1024]
    file.close()
    assert open_shard(tmp_path / "x.tar").read(0)["bin"] == bytes(range(256)) * 3


def test_energon_splits(tmp_path):
    """A dataset prepared with train / val parts: one is chosen with split=, in the order
    the split config lists its shards; without split= it is refused, never mixed."""
    folder = write_tar_folder(tmp_path / "en", [2, 3, 4, 5])
    pytest.importorskip("yaml", reason="PyYAML is not installed")
    pytest.importorskip("megatron.energon", reason="megatron-energon (test extra) is not installed")
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    tars = sorted(p.name for p in folder.glob("*.tar"))
    WebdatasetPreparator.prepare_dataset(folder, tars, split_parts_ratio=[("train", 0.5), ("val", 0.5)], workers=1)
    import yaml

    parts = yaml.safe_load((folder / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    with pytest.raises(
        sl.DataError,
        match=r"split.yaml: the dataset is split into 'train' \(2 shards\), "
        r"'val' \(2 shards\): pass split= to choose one",
    ):
        ShardedFileDataset(folder, WC)
    for part in ("train", "val"):
        got = read_all(folder, split=part)
        assert got == webdataset_reading([folder / name for name in parts[part]])
        assert ShardedFileDataset(folder, WC, split=part).config()["split"] == part
    with pytest.raises(sl.DataError, match=r"no split 'test'"):
        ShardedFileDataset(folder, WC, split="test")
    with pytest.raises(sl.DataError, match="an Energon folder needs no indexing"):
        index_folder(folder, progress=False)
    (folder / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n  - shard-00{0..2}.tar\n  val:\n  - shard-003.tar\nexclude:\n  - shard-001.tar\n"
    )
    assert [s["__key__"] for s in read_all(folder, split="train")] == [f"sample{j:05d}" for j in (0, 1, 5, 6, 7, 8)]
    (folder / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n  - shard-000.tar\nexclude:\n  - shard-000.tar/sample00001\n"
    )
    with pytest.raises(sl.DataError, match="sample-level excludes are not supported"):
        ShardedFileDataset(folder, WC)
    (folder / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n  - shard-000.tar\nexclude:\n  - shard-000.tar\n"
    )
    with pytest.raises(sl.DataError, match="split 'train' has no shards left"):
        ShardedFileDataset(folder, WC)
    (folder / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train: shard-000.tar\n")
    with pytest.raises(sl.DataError, match=r"split.yaml: Expected `array`, got `str` - at `\$.split_parts\[...\]`"):
        ShardedFileDataset(folder, WC)
    (folder / ".nv-meta" / "split.yaml").write_text("- shard-000.tar\n")
    with pytest.raises(sl.DataError, match="expected a mapping with `split_parts`, got list"):
        ShardedFileDataset(folder, WC)
    write_tar_folder(tmp_path / "plain", [2])
    index_folder(tmp_path / "plain", progress=False)
    with pytest.raises(sl.LoaderUsageError, match="split='train' selects a part of an Energon dataset"):
        ShardedFileDataset(tmp_path / "plain", WC, split="train")
