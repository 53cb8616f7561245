"""``savable-loader inspect``: summaries of real states, gathered lists, raw bytes, garbage."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

import savable_loader as sl
from savable_loader.__main__ import main
from savable_loader.cli import inspect as _inspect
from savable_loader.state import (
    ArrayValue,
    DatasetState,
    IndexPosition,
    LoaderConfig,
    PipelinePosition,
    RankState,
    TupleValue,
    WorkerState,
    encode,
    save_file,
)
from savable_loader.state.codec import encode_part
from savable_loader.wrappers import BatchDataset, MapDataset, ShuffleBufferDataset
from tests.common import RangeSource

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
HEADER = struct.Struct("<8sIQ32s")
RANK_KEYS = {
    "rank",
    "path",
    "epoch",
    "num_workers",
    "encoded_size",
    "schema_version",
    "library_version",
    "config",
    "position",
}


def _double(x: Any) -> Any:
    return x * 2


@pytest.fixture(scope="module")
def dropin_state() -> RankState:
    loader = sl.SavableDataLoader(
        list(range(100)),
        batch_size=4,
        shuffle=True,
        num_workers=0,
        worker_config=sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=5),
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    return loader.save_state_rank()


@pytest.fixture(scope="module")
def pipeline_state() -> RankState:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
    # (buffer_state="payload": the samples in the state, whose outline the test reads)
    ds = BatchDataset(
        MapDataset(ShuffleBufferDataset(RangeSource(29, wc), size=4, buffer_state="payload"), _double), batch_size=3
    )
    loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.save_state_rank()
    del it
    return state


def synthetic_state(rank: int = 0, world_size: int = 1) -> RankState:
    """A pipeline state with an exhausted worker, a worker at the epoch start and arrays."""
    node = DatasetState(
        type="pkg.Outer",
        fields={"n": 7, "name": "x" * 100, "blob": b"\x00" * 40},
        children=[
            DatasetState(
                type="pkg.Inner",
                fields={
                    "arr": ArrayValue(library="numpy", dtype="float32", shape=(2, 3), data=b"\x00" * 24),
                    "items": [1, "a"],
                    "d": {"k": None},
                    "pair": TupleValue(
                        [1, ArrayValue(library="numpy-scalar", dtype="float32", shape=(), data=b"\x00\x00\xc0?")]
                    ),
                },
            )
        ],
    )
    return RankState(
        config=LoaderConfig(
            rank=rank,
            world_size=world_size,
            num_workers=2,
            seed=9,
            batch_size=None,
            shuffle=False,
            drop_last=False,
            dataset_fingerprint="b" * 24,
        ),
        position=PipelinePosition(
            epoch=4,
            next_worker=1,
            workers=[
                WorkerState(worker_id=0, index=10, snapshot_index=7, dataset=node, exhausted=True),
                WorkerState(worker_id=1, index=0, snapshot_index=0),
            ],
        ),
    )


def index_state(rank: int, consumed: int) -> RankState:
    return RankState(
        config=LoaderConfig(
            rank=rank,
            world_size=2,
            num_workers=3,
            seed=11,
            batch_size=8,
            shuffle=True,
            drop_last=True,
            dataset_fingerprint="f" * 24,
            dataset_config={"n": 1000},
        ),
        position=IndexPosition(epoch=1, consumed=consumed, dataset_len=1000),
    )


def inspect(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["inspect", str(path), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def inspect_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = inspect(path, capsys, "--json")
    assert code == 0, err
    assert err == ""
    return json.loads(out)


def assert_rank_matches(summary: dict[str, Any], state: RankState) -> None:
    """Every scalar of the state appears in the summary with its value."""
    assert set(summary) == RANK_KEYS
    assert summary["rank"] == state.config.rank
    assert summary["epoch"] == state.position.epoch
    assert summary["num_workers"] == state.config.num_workers
    assert summary["encoded_size"] == len(encode_part(state))
    assert summary["schema_version"] == state.schema_version
    assert summary["library_version"] == state.library_version
    assert summary["config"] == msgspec.to_builtins(state.config)


def assert_outline(outline: dict[str, Any] | None, node: DatasetState | None) -> None:
    if node is None:
        assert outline is None
        return
    assert outline is not None
    assert (outline["type"], outline["size"]) == (node.type, len(encode_part(node)))
    assert list(outline["fields"]) == list(node.fields)
    for name, value in node.fields.items():
        assert outline["fields"][name]["size"] == len(encode_part(value))
    assert len(outline["children"]) == len(node.children)
    for o, n in zip(outline["children"], node.children):
        assert_outline(o, n)


# -- real states --------------------------------------------------------------------------


def test_dropin_state_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], dropin_state: RankState) -> None:
    path = tmp_path / "loader.state"
    save_file(path, dropin_state)
    doc = inspect_json(path, capsys)
    assert set(doc) == set(_inspect.DOCUMENT_KEYS)
    payload = encode(dropin_state)
    assert doc | {"ranks": None} == {
        "format": 1,
        "file": str(path),
        "container": "state-file",
        "file_size": path.stat().st_size,
        "encoded_size": len(payload),
        "kind": "rank",
        "schema_version": dropin_state.schema_version,
        "library_version": sl.__version__,
        "world_size": 1,
        "num_ranks": 1,
        "ranks": None,
    }
    assert doc["file_size"] == HEADER.size + len(payload)
    (rank,) = doc["ranks"]
    assert_rank_matches(rank, dropin_state)
    assert rank["path"] == "index"
    assert rank["position"] == {"type": "index", **msgspec.structs.asdict(dropin_state.position)}
    assert rank["position"]["consumed"] == 12 and rank["config"]["seed"] == 5

    code, text, err = inspect(path, capsys)
    assert code == 0 and err == ""
    assert "kind            rank: one rank's state" in text
    assert "path            index (drop-in, map-style dataset)" in text
    assert "consumed        12 samples of this rank's share of the epoch (dataset length 100)" in text
    assert "seed=5 batch_size=4 shuffle=true" in text
    assert f"fingerprint     {dropin_state.config.dataset_fingerprint}" in text
    assert f"file            {path.stat().st_size:,} bytes: state file format 1, checksum ok" in text


def test_pipeline_state_file_two_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pipeline_state: RankState
) -> None:
    path = tmp_path / "loader.state"
    save_file(path, pipeline_state)
    doc = inspect_json(path, capsys)
    (rank,) = doc["ranks"]
    assert_rank_matches(rank, pipeline_state)
    position = rank["position"]
    assert (rank["path"], position["type"]) == ("pipeline", "pipeline")
    assert position["next_worker"] == pipeline_state.position.next_worker
    assert len(position["workers"]) == 2
    for summary, worker in zip(position["workers"], pipeline_state.position.workers):
        assert {k: summary[k] for k in ("worker_id", "index", "snapshot_index", "exhausted", "skip")} == {
            "worker_id": worker.worker_id,
            "index": worker.index,
            "snapshot_index": worker.snapshot_index,
            "exhausted": worker.exhausted,
            "skip": worker.skip,
        }
        assert summary["dataset_size"] == len(encode_part(worker.dataset))
        assert_outline(summary["dataset"], worker.dataset)
    # 3 batches of 3 from 2 round-robin workers: worker 0 gave 2, worker 1 gave 1
    assert [w["index"] for w in position["workers"]] == [2, 1]
    shuffle = position["workers"][0]["dataset"]["children"][0]["children"][0]
    assert shuffle["type"] == "savable_loader.wrappers.shuffle_buffer.ShuffleBufferDataset"
    assert shuffle["fields"]["buffer"]["item_types"] == ["array"]
    assert shuffle["children"][0]["fields"]["pos"]["type"] == "int"

    code, text, err = inspect(path, capsys)
    assert code == 0 and err == ""
    assert "path            pipeline (savable pipeline)" in text
    assert "next worker     1" in text
    for w in pipeline_state.position.workers:
        assert f"worker {w.worker_id}        consumed {w.index}, snapshot at {w.snapshot_index} (skip {w.skip})" in text
    assert text.count("tests.common.RangeSource") == 2
    assert ".buffer: list[3] of array" in text


def test_raw_state_dict_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str], dropin_state: RankState) -> None:
    framed, raw = tmp_path / "loader.state", tmp_path / "loader.msgpack"
    save_file(framed, dropin_state)
    raw.write_bytes(encode(dropin_state))  # what loader.state_dict() holds as its value
    a, b = inspect_json(framed, capsys), inspect_json(raw, capsys)
    assert (b["container"], b["file_size"], b["encoded_size"]) == ("raw", raw.stat().st_size, raw.stat().st_size)
    different = {"file", "container", "file_size"}
    assert {k: v for k, v in a.items() if k not in different} == {k: v for k, v in b.items() if k not in different}
    code, text, _ = inspect(raw, capsys)
    assert code == 0 and "raw encoded state (no file header, no checksum)" in text


def test_gathered_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    states = [index_state(0, 40), index_state(1, 48)]
    path = tmp_path / "global.state"
    save_file(path, states)  # what save_state_global's list is saved as
    doc = inspect_json(path, capsys)
    assert (doc["kind"], doc["num_ranks"], doc["world_size"]) == ("global", 2, 2)
    assert doc["encoded_size"] == len(encode(states))
    for summary, state in zip(doc["ranks"], states):
        assert_rank_matches(summary, state)
    assert [r["position"]["consumed"] for r in doc["ranks"]] == [40, 48]
    code, text, _ = inspect(path, capsys)
    assert code == 0
    assert "kind            global: the gathered states of 2 ranks" in text
    assert "ranks           0, 1" in text
    assert "\nrank 0 (" in text and "\nrank 1 (" in text
    assert text.index("consumed        40 samples") < text.index("consumed        48 samples")


def test_synthetic_pipeline_outline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = synthetic_state()
    path = tmp_path / "s.state"
    save_file(path, state)
    doc = inspect_json(path, capsys)
    workers = doc["ranks"][0]["position"]["workers"]
    assert_outline(workers[0]["dataset"], state.position.workers[0].dataset)
    assert workers[1]["dataset"] is None and workers[1]["dataset_size"] == 0
    outer = workers[0]["dataset"]["fields"]
    assert outer["n"] == {"type": "int", "size": 1, "value": 7}
    assert outer["name"] == {"type": "str", "size": 102, "length": 100}  # long: no value
    assert outer["blob"] == {"type": "bytes", "size": 42, "length": 40}
    inner = workers[0]["dataset"]["children"][0]["fields"]
    assert inner["arr"] | {"size": 0} == {
        "type": "array",
        "size": 0,
        "library": "numpy",
        "dtype": "float32",
        "shape": [2, 3],
    }
    assert inner["items"]["item_types"] == ["int", "str"]
    assert inner["pair"] | {"size": 0} == {"type": "tuple", "size": 0, "length": 2, "item_types": ["array", "int"]}
    code, text, _ = inspect(path, capsys)
    assert code == 0
    assert "worker 0        consumed 10, snapshot at 7 (skip 3), exhausted; dataset state" in text
    assert "worker 1        consumed 0, snapshot at 0 (skip 0); no dataset state (epoch start)" in text
    assert ".arr: numpy float32[2,3] (" in text
    assert ".n: int 7 (1 B)" in text
    assert "x" * 49 not in text  # values are outlined, not printed


def test_every_schema_field_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fields are rendered generically: a field the schema gains shows up without changes here."""
    path = tmp_path / "s.state"
    state = synthetic_state()
    save_file(path, state)
    rank = inspect_json(path, capsys)["ranks"][0]
    assert set(rank["config"]) == set(LoaderConfig.__struct_fields__)
    assert set(rank["position"]) == {"type", *PipelinePosition.__struct_fields__}
    assert set(rank["position"]["workers"][0]) == {
        "skip",
        "dataset_size",
        "carried_size",
        *WorkerState.__struct_fields__,
    }
    assert set(IndexPosition.__struct_fields__) <= set(_inspect._plain(index_state(0, 1).position))


def test_unknown_struct_fields_render_generically() -> None:
    class Stage(msgspec.Struct, kw_only=True):
        world_size: int
        consumed: int

    class FuturePosition(msgspec.Struct, kw_only=True, tag="future"):
        epoch: int
        stages: list[Stage]
        key: bytes

    plain = _inspect._plain(FuturePosition(epoch=2, stages=[Stage(world_size=4, consumed=8)], key=b"\x01"))
    assert plain == {"type": "future", "epoch": 2, "stages": [{"world_size": 4, "consumed": 8}], "key": "AQ=="}
    json.dumps(plain)


# -- garbage ------------------------------------------------------------------------------


def _garbage(tmp_path: Path, kind: str) -> tuple[Path, str]:
    good = encode(index_state(0, 8))
    framed = HEADER.pack(b"SLSTATE\x00", 1, len(good), hashlib.blake2b(good, digest_size=32).digest()) + good
    path = tmp_path / f"{kind}.bin"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "file is empty"
    if kind == "missing":
        return path, "no such file"
    if kind == "directory":
        path.mkdir()
        return path, "is a directory"
    if kind == "json":
        path.write_text(json.dumps({"kind": "rank", "config": {}}))
        return path, "a JSON file"
    if kind == "text":
        path.write_text("epoch=3\n")
        return path, "not a savable_loader state"
    if kind == "truncated":
        path.write_bytes(framed[:-5])
        return path, "truncated"
    if kind == "short-header":
        path.write_bytes(framed[:20])
        return path, "too short for a state file header"
    if kind == "checksum":
        path.write_bytes(framed[:-1] + bytes([framed[-1] ^ 1]))
        return path, "checksum mismatch"
    if kind == "magic":
        path.write_bytes(b"XLSTATE\x00" + framed[8:])
        return path, "magic b'SLSTATE\\x00', found b'XLSTATE\\x00'"
    if kind == "format":
        path.write_bytes(framed[:8] + struct.pack("<I", 9) + framed[12:])
        return path, "file format version 9"
    if kind == "raw-truncated":
        path.write_bytes(good[:-3])
        return path, "raw encoded state bytes (no file header) that do not decode"
    if kind == "foreign-msgpack":
        path.write_bytes(msgspec.msgpack.encode({"kind": "model", "w": [1, 2]}))
        return path, "'kind' is 'model'"
    if kind == "newer-schema":
        path.write_bytes(msgspec.msgpack.encode({**msgspec.to_builtins(index_state(0, 8)), "schema_version": 99}))
        return path, "schema version 99"
    if kind == "zip":
        path.write_bytes(b"PK\x03\x04" + b"\x00" * 60)
        return path, "zip archive"
    raise AssertionError(kind)


GARBAGE = [
    "empty",
    "missing",
    "directory",
    "json",
    "text",
    "truncated",
    "short-header",
    "checksum",
    "magic",
    "format",
    "raw-truncated",
    "foreign-msgpack",
    "newer-schema",
    "zip",
]


@pytest.mark.parametrize("kind", GARBAGE)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_garbage_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, as_json: bool
) -> None:
    path, expected = _garbage(tmp_path, kind)
    code, out, err = inspect(path, capsys, *(["--json"] if as_json else []))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"savable-loader inspect: error: {path}: "), err
    assert expected in err, err


# -- no torch -----------------------------------------------------------------------------


def test_runs_without_torch(tmp_path: Path, pipeline_state: RankState) -> None:
    good = tmp_path / "loader.state"
    save_file(good, pipeline_state)
    save_file(tmp_path / "global.state", [index_state(0, 1), index_state(1, 2)])
    (tmp_path / "bad.state").write_bytes(b"nope")
    code = (
        "import sys\n"
        "from savable_loader.__main__ import main\n"
        "codes = [main(['inspect', p, *flags]) for p in sys.argv[1:] for flags in ([], ['--json'])]\n"
        "print(codes, 'torch' in sys.modules, 'numpy' in sys.modules, file=sys.stderr)\n"
    )
    paths = [str(good), str(tmp_path / "global.state"), str(tmp_path / "bad.state")]
    out = subprocess.run(
        [sys.executable, "-c", code, *paths], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    last = out.stderr.strip().splitlines()[-1]
    assert last == "[0, 0, 0, 0, 2, 2] False False", out.stderr
    assert out.stdout.count("savable_loader state: ") == 2


def test_new_rank_state_fields_are_reported_as_extra() -> None:
    class FutureRankState(RankState, frozen=True, kw_only=True, tag="rank", tag_field="kind"):
        restore_keys: tuple[str, ...] = ()

    state = FutureRankState(
        config=index_state(0, 3).config, position=index_state(0, 3).position, restore_keys=("a", "b")
    )
    summary = _inspect._rank(state)
    assert summary["extra"] == {"restore_keys": ["a", "b"]}
    doc = {
        "file": "f",
        "container": "raw",
        "file_size": 1,
        "encoded_size": 1,
        "kind": "rank",
        "schema_version": 1,
        "library_version": "",
        "world_size": 2,
        "num_ranks": 1,
        "ranks": [summary],
    }
    assert '  restore keys    ["a","b"]' in _inspect.render_text(doc).splitlines()


def test_readme_documents_every_json_key() -> None:
    page = (ROOT / "docs" / "debugging.md").read_text()
    section = page[page.index("### What it prints, and the `--json` keys") :]
    section = section[: section.index("\n## ")]
    for key in (*_inspect.DOCUMENT_KEYS, *RANK_KEYS, "extra", "skip", "dataset_size", "item_types"):
        assert f"`{key}`" in section or f" {key}," in section or f"{key}?" in section, key


def test_a_carried_end_state_is_outlined(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = synthetic_state()
    carried = DatasetState(type="pkg.Epochize", fields={"count": 3})
    workers = [state.position.workers[0], WorkerState(worker_id=1, index=2, snapshot_index=0, carried=carried)]
    state = msgspec.structs.replace(state, position=msgspec.structs.replace(state.position, workers=workers))
    path = tmp_path / "c.state"
    save_file(path, state)
    code, text, _ = inspect(path, capsys)
    assert code == 0
    assert (
        "worker 1        consumed 2, snapshot at 0 (skip 2); epoch start from the previous epoch's end state (" in text
    )
    assert "pkg.Epochize (" in text and ".count: int 3" in text
    doc = inspect_json(path, capsys)
    assert doc["ranks"][0]["position"]["workers"][1]["carried_size"] > 0
