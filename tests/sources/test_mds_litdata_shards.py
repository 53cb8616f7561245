"""MosaicML Streaming (MDS) and LitData folders read unchanged from their own
``index.json``: values as those libraries decode them (checked against their own
writers and readers when they are installed), and named errors for what is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.sources import ShardedFileDataset, read_metadata
from tests.common import assert_same
from tests.shard_writers import indexed_blob, litdata_row, mds_row, write_litdata_folder, write_mds_folder

pytestmark = pytest.mark.timeout(120)
WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


def read_all(folder: Path, **kw: Any) -> list[Any]:
    ds = ShardedFileDataset(folder, WC, shuffle=False, **kw)
    with _ActiveWorker(0, 0):
        ds.reset_state_deep()
        return list(ds)


def edit_index(folder: Path, edit: Any) -> None:
    doc = json.loads((folder / "index.json").read_text())
    edit(doc)
    (folder / "index.json").write_text(json.dumps(doc))


# -- MDS ----------------------------------------------------------------------------------


def test_mds_rows(tmp_path):
    folder = write_mds_folder(tmp_path, [3, 2])
    meta = read_metadata(folder)
    assert meta.source == "mds" and [s.path for s in meta.shards] == ["shard.00000.mds", "shard.00001.mds"]
    rows = read_all(folder)
    for j, row in enumerate(rows):
        want = mds_row(j)
        assert_same(row, {k: want[k] for k in sorted(want)}, f"row {j}")
    assert read_all(folder, columns=["text", "id"])[4] == {"text": "text 4", "id": 4}


def test_mds_pickle_columns_are_refused_unless_left_out(tmp_path):
    folder = write_mds_folder(tmp_path, [2])
    edit_index(folder, lambda d: d["shards"][0]["column_encodings"].__setitem__(0, "pkl"))  # "blob"
    ds = ShardedFileDataset(folder, WC, shuffle=False)
    with (
        _ActiveWorker(0, 0),
        pytest.raises(
            sl.DataError,
            match=r"column 'blob' is a pickle \('pkl'\), which "
            r"savable_loader does not load",
        ),
    ):
        next(iter(ds))
    assert read_all(folder, columns=["id"]) == [{"id": 0}, {"id": 1}]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=3), r"`\$.version` is 3"),
        (
            lambda d: d["shards"][0].update(format="jsonl"),
            r"`\$.shards\[0\].format` is 'jsonl'; savable_loader reads MDS",
        ),
        (lambda d: d["shards"][0].update(compression="zstd"), r"`\$.shards\[0\]` is compressed \('zstd'\)"),
        (
            lambda d: d["shards"][0]["column_encodings"].__setitem__(1, "avro"),
            "column 'f' has the unknown encoding 'avro'",
        ),
        (lambda d: d["shards"][0]["column_sizes"].pop(), "column_names, column_encodings and column_sizes differ"),
        (lambda d: d["shards"][0]["raw_data"].update(basename="../x.mds"), r"raw_data.basename` is '../x.mds'"),
        (lambda d: d["shards"][0].pop("samples"), "not a MosaicML Streaming index"),
    ],
    ids=["version", "format", "compressed", "encoding", "sizes", "path", "fields"],
)
def test_mds_index_errors(tmp_path, edit, message):
    assert_refused(write_mds_folder(tmp_path, [2]), edit, message)


def assert_refused(folder: Path, edit: Any, message: str) -> None:
    """After ``edit`` of its index.json, the folder is refused naming that file."""
    edit_index(folder, edit)
    with pytest.raises(sl.DataError, match=message) as info:
        ShardedFileDataset(folder, WC)
    assert str(folder / "index.json") in str(info.value)


def test_mds_damaged_shards(tmp_path):
    folder = write_mds_folder(tmp_path, [3])
    shard = folder / "shard.00000.mds"
    data = shard.read_bytes()
    shard.write_bytes(data[:-5])
    edit_index(folder, lambda d: d["shards"][0]["raw_data"].update(bytes=len(data) - 5))
    ds = ShardedFileDataset(folder, WC)
    with (
        _ActiveWorker(0, 0),
        pytest.raises(
            sl.DataError,
            match=rf"shard.00000.mds: truncated: the samples end at "
            rf"byte {len(data)}, the file has {len(data) - 5}",
        ),
    ):
        next(iter(ds))
    shard.write_bytes(data)
    with (
        _ActiveWorker(0, 0),
        pytest.raises(sl.DataError, match=r"shard.00000.mds: the file has \d+ bytes, the folder's manifest says \d+"),
    ):
        next(iter(ShardedFileDataset(folder, WC)))


def test_mds_against_its_own_writer(tmp_path):
    """Needs mosaicml-streaming (not in the test extra: it pins transformers < 5)."""
    pytest.importorskip("streaming", reason="mosaicml-streaming is not installed")
    from streaming.base.format import reader_from_json
    from streaming.base.format.mds.writer import MDSWriter

    columns = {
        "id": "int",
        "text": "str",
        "x": "ndarray",
        "y": "ndarray:float32:3",
        "u": "uint8",
        "j": "json",
        "f": "float32",
        "b": "bytes",
        "si": "str_int",
        "sf": "str_float",
    }
    with MDSWriter(out=str(tmp_path), columns=columns, size_limit=600) as writer:
        for i in range(9):
            writer.write(
                {
                    "id": i - 4,
                    "text": f"s{i}",
                    "x": np.arange(i + 1, dtype=np.int16).reshape(1, -1),
                    "y": np.ones(3, np.float32) * i,
                    "u": np.uint8(i),
                    "j": {"a": [i]},
                    "f": np.float32(i / 3),
                    "b": bytes([i]) * i,
                    "si": i * 1000,
                    "sf": i / 7,
                }
            )
    index = json.loads((tmp_path / "index.json").read_text())
    theirs = []
    for shard in index["shards"]:
        reader = reader_from_json(str(tmp_path), None, shard)
        theirs += [reader.decode_sample(reader.get_sample_data(k)) for k in range(shard["samples"])]
    ours = read_all(tmp_path)
    assert len(ours) == 9 and len(index["shards"]) > 1
    for a, b in zip(ours, theirs):
        assert_same(a, b)


# -- LitData ------------------------------------------------------------------------------


def test_litdata_rows(tmp_path):
    folder = write_litdata_folder(tmp_path, [3, 2])
    assert read_metadata(folder).source == "litdata"
    for j, row in enumerate(read_all(folder)):
        assert_same(row, litdata_row(j), f"row {j}")


def json_leaf(value: Any) -> bytes:
    """LitData's tagged encoding of a few lists and dicts (the writer picks the tag)."""
    if isinstance(value, dict):
        out = struct.pack("<BI", 5, len(value))
        for k, v in value.items():
            out += struct.pack("<I", len(k)) + k.encode() + json_leaf(v)
        return out
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return struct.pack("<BI", 1, len(value)) + b"".join(struct.pack("<I", len(v)) + v.encode() for v in value)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return struct.pack("<BI", 2, len(value)) + np.array(value, "<i8").tobytes()
    if isinstance(value, str):
        return b"\x07" + struct.pack("<I", len(value)) + value.encode()
    if value is None:
        return b"\x0b"
    text = json.dumps(value).encode()
    return struct.pack("<BI", 0, len(text)) + text


def test_litdata_structures_and_json_leaves(tmp_path):
    """A tuple of (int, list-of-str leaf, dict leaf) per sample, and JSON-text leaves."""
    values = [(j, ["a", f"b{j}"], {"k": [j, 2 * j], "s": "x", "n": None, "mix": [1, "two"]}) for j in range(3)]
    items = []
    for j, strs, mapping in values:
        leaves = [struct.pack("<q", j), json_leaf(strs), json_leaf(mapping) if j else json.dumps(mapping).encode()]
        items.append(struct.pack("<3I", *map(len, leaves)) + b"".join(leaves))
    (tmp_path / "c.bin").write_bytes(indexed_blob(items))
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.tuple", "context": "null", "children_spec": [leaf, leaf, leaf]}]
    (tmp_path / "index.json").write_text(
        json.dumps(
            {
                "chunks": [{"chunk_bytes": None, "chunk_size": 3, "filename": "c.bin"}],
                "config": {"data_format": ["int", "json", "json"], "data_spec": json.dumps(spec)},
            }
        )
    )
    assert read_all(tmp_path) == values


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["config"].update(compression="zstd"), "compressed or encrypted"),
        (lambda d: d["config"].update(item_loader="TokensLoader"), "`\\$.config.item_loader` is 'TokensLoader'"),
        (lambda d: d["config"]["data_format"].__setitem__(5, "pickle"), r"'pickle' are not supported \(a pickle"),
        (lambda d: d["config"]["data_format"].__setitem__(5, "video"), "'video' are not supported"),
        (
            lambda d: d["config"].update(
                data_spec=json.dumps([1, {"type": "mymod.Point", "context": "null", "children_spec": []}])
            ),
            "holds a 'mymod.Point'",
        ),
        (lambda d: d["config"]["data_format"].pop(), "data_spec` has 8 leaves, `data_format` 7"),
        (lambda d: d.pop("config"), "neither a MosaicML Streaming index"),
    ],
    ids=["compressed", "loader", "pickle", "video", "namedtuple", "leaves", "shape"],
)
def test_litdata_index_errors(tmp_path, edit, message):
    assert_refused(write_litdata_folder(tmp_path, [2]), edit, message)


def test_litdata_arrow_footer_chunks(tmp_path):
    """Newer LitData writers keep text and nested dict rows in a trailing Arrow IPC table."""
    pa = pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
    rows = [{"text": f"s{j}", "meta": {"a": j}, "n": [j] * j} for j in range(4)]
    header = 4 + 4 * 5
    sink = pa.BufferOutputStream()
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    ipc = sink.getvalue().to_pybytes()
    body = struct.pack("<I", 4) + np.full(5, header, "<u4").tobytes()
    (tmp_path / "c.bin").write_bytes(body + ipc + struct.pack("<I", len(ipc)) + b"LDARW01\0")
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.dict", "context": json.dumps(["text", "a", "n"]), "children_spec": [leaf] * 3}]
    (tmp_path / "index.json").write_text(
        json.dumps(
            {
                "chunks": [{"chunk_size": 4, "filename": "c.bin"}],
                "config": {"data_format": ["str", "int", "json"], "data_spec": json.dumps(spec)},
            }
        )
    )
    assert read_all(tmp_path) == rows
    got = read_all(tmp_path)
    got[1]["n"].append(9)
    assert read_all(tmp_path)[1]["n"] == [1]


def test_litdata_against_its_own_writer(tmp_path):
    """Needs litdata (not in the test extra: it pulls torchvision)."""
    pytest.importorskip("litdata", reason="litdata is not installed")
    from litdata import StreamingDataset
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(tmp_path), chunk_size=3)
    for i in range(8):
        writer[i] = {
            "id": i - 3,
            "text": f"s{i}",
            "x": np.arange(i + 1, dtype=np.float32),
            "m": np.ones((2, 2)) * i,
            "t": torch.arange(3) * i,
            "tt": torch.ones(2, 2, dtype=torch.float16) * i,
            "b": b"xy" * i,
            "f": 0.5 * i,
            "ok": i % 2 == 0,
            "pair": (i, f"p{i}"),
            "l": [i, 2.5],
        }
    writer.done()
    writer.merge()
    theirs = list(StreamingDataset(str(tmp_path), shuffle=False))
    ours = read_all(tmp_path)
    assert len(ours) == 8
    for a, b in zip(ours, theirs):
        b = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in b.items()}  # LitData hands out views
        assert_same(a, b)
