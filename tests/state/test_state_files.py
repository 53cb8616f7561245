"""Tests for savable_loader.state.files: atomic writes, checksums, refusals naming the path."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from savable_loader.errors import StateError, StateFileError, StateVersionError
from savable_loader.state import (
    SCHEMA_VERSION,
    DatasetState,
    IndexPosition,
    LoaderConfig,
    PipelinePosition,
    RankState,
    WorkerState,
    encode,
    load_file,
    save_file,
)
from savable_loader.state import files as files_mod

REPO_ROOT = Path(__file__).resolve().parents[2]
HEADER = struct.Struct("<8sIQ32s")


def rank_state(rank: int = 0, consumed: int = 64) -> RankState:
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


def pipeline_state() -> RankState:
    return RankState(
        config=LoaderConfig(
            rank=0,
            world_size=1,
            num_workers=1,
            seed=0,
            batch_size=None,
            shuffle=False,
            drop_last=False,
            dataset_fingerprint="a" * 24,
        ),
        position=PipelinePosition(
            epoch=0,
            next_worker=0,
            workers=[
                WorkerState(
                    worker_id=0,
                    index=3,
                    snapshot_index=2,
                    dataset=DatasetState(type="m.C", fields={"pos": 2, "b": b"\x00\x01"}),
                )
            ],
        ),
    )


def write_raw(
    path: Path,
    payload: bytes,
    *,
    magic: bytes = b"SLSTATE\x00",
    version: int = 1,
    length: int | None = None,
    digest: bytes | None = None,
) -> None:
    length = len(payload) if length is None else length
    digest = hashlib.blake2b(payload, digest_size=32).digest() if digest is None else digest
    path.write_bytes(HEADER.pack(magic, version, length, digest) + payload)


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [rank_state, pipeline_state], ids=["index", "pipeline"])
def test_rank_state_round_trip(tmp_path: Path, make) -> None:
    state = make()
    path = tmp_path / "loader.state"
    save_file(path, state)
    back = load_file(path)
    assert isinstance(back, RankState)
    assert back == state


def test_gathered_list_round_trip(tmp_path: Path) -> None:
    states = [rank_state(rank=0, consumed=10), rank_state(rank=1, consumed=12)]
    path = tmp_path / "global.state"
    save_file(path, states)
    back = load_file(path)
    assert type(back) is list
    assert back == states


def test_str_path_and_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file(str(tmp_path / "a.state"), rank_state())
    assert load_file(str(tmp_path / "a.state")) == rank_state()
    monkeypatch.chdir(tmp_path)
    save_file("b.state", rank_state(consumed=5))
    assert load_file("b.state") == rank_state(consumed=5)
    assert listing(tmp_path) == ["a.state", "b.state"]


def test_file_layout_is_exact(tmp_path: Path) -> None:
    state = rank_state()
    path = tmp_path / "x.state"
    save_file(path, state)
    raw = path.read_bytes()
    payload = encode(state)
    magic, version, length, digest = HEADER.unpack(raw[: HEADER.size])
    assert magic == b"SLSTATE\x00"
    assert version == 1
    assert length == len(payload)
    assert digest == hashlib.blake2b(payload, digest_size=32).digest()
    assert raw[HEADER.size :] == payload
    assert len(raw) == HEADER.size + len(payload) == 52 + len(payload)


# -- atomicity --------------------------------------------------------------------------


def test_no_temp_file_left_after_success(tmp_path: Path) -> None:
    path = tmp_path / "loader.state"
    save_file(path, rank_state(consumed=1))
    assert listing(tmp_path) == ["loader.state"]
    save_file(path, rank_state(consumed=2))  # overwrite
    assert listing(tmp_path) == ["loader.state"]
    assert load_file(path) == rank_state(consumed=2)


@pytest.mark.parametrize(
    "bad", [object(), None, [rank_state(), "x"], {"kind": "rank"}], ids=["object", "None", "list", "dict"]
)
def test_failing_encode_leaves_old_file_and_no_temp(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "loader.state"
    save_file(path, rank_state(consumed=7))
    before = path.read_bytes()
    with pytest.raises(StateError):
        save_file(path, bad)  # type: ignore[arg-type]
    assert listing(tmp_path) == ["loader.state"]
    assert path.read_bytes() == before
    assert load_file(path) == rank_state(consumed=7)


def test_failing_encode_creates_no_file(tmp_path: Path) -> None:
    with pytest.raises(StateError):
        save_file(tmp_path / "new.state", object())  # type: ignore[arg-type]
    assert listing(tmp_path) == []


def test_failing_write_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "loader.state"
    save_file(path, rank_state(consumed=7))
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_mod.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space left"):
        save_file(path, rank_state(consumed=8))
    monkeypatch.undo()
    assert listing(tmp_path) == ["loader.state"]
    assert path.read_bytes() == before


def test_failing_rename_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "loader.state"
    save_file(path, rank_state(consumed=7))
    before = path.read_bytes()

    def broken_replace(src: object, dst: object) -> None:
        raise KeyboardInterrupt  # even a BaseException must clean up

    monkeypatch.setattr(files_mod.os, "replace", broken_replace)
    with pytest.raises(KeyboardInterrupt):
        save_file(path, rank_state(consumed=8))
    monkeypatch.undo()
    assert listing(tmp_path) == ["loader.state"]
    assert path.read_bytes() == before


# -- refusals ---------------------------------------------------------------------------


def _assert_state_error(path: Path, match: str, error: type[StateError] = StateError) -> StateError:
    with pytest.raises(error, match=match) as info:
        load_file(path)
    assert str(path) in str(info.value)
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    _assert_state_error(tmp_path / "nope.state", "cannot read state file")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    (tmp_path / "d.state").mkdir()
    _assert_state_error(tmp_path / "d.state", "cannot read state file")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.state"
    path.write_bytes(b"")
    _assert_state_error(path, "file is 0 bytes, too short")


@pytest.mark.parametrize("keep", [1, 8, 20, 51])
def test_file_truncated_inside_header(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "t.state"
    save_file(path, rank_state())
    path.write_bytes(path.read_bytes()[:keep])
    _assert_state_error(path, f"file is {keep} bytes, too short")


def test_file_truncated_inside_payload(tmp_path: Path) -> None:
    path = tmp_path / "t.state"
    save_file(path, rank_state())
    raw = path.read_bytes()
    payload_len = len(raw) - HEADER.size
    for cut in (1, payload_len // 2, payload_len):
        path.write_bytes(raw[: len(raw) - cut])
        _assert_state_error(
            path, rf"header says {payload_len} payload bytes, file has {payload_len - cut} \(truncated\?\)"
        )


def test_trailing_garbage(tmp_path: Path) -> None:
    path = tmp_path / "t.state"
    save_file(path, rank_state())
    with open(path, "ab") as f:
        f.write(b"junk")
    _assert_state_error(path, "header says .* payload bytes, file has")


@pytest.mark.parametrize("where", [0, 1, -1])
def test_flipped_payload_byte_is_checksum_mismatch(tmp_path: Path, where: int) -> None:
    path = tmp_path / "c.state"
    save_file(path, rank_state())
    raw = bytearray(path.read_bytes())
    index = HEADER.size + where if where >= 0 else len(raw) + where
    raw[index] ^= 0x01
    path.write_bytes(bytes(raw))
    _assert_state_error(path, "checksum mismatch")


def test_flipped_digest_byte_is_checksum_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "c.state"
    save_file(path, rank_state())
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0x80  # first byte of the digest
    path.write_bytes(bytes(raw))
    _assert_state_error(path, "checksum mismatch")


@pytest.mark.parametrize("magic", [b"SLSTATE\x01", b"\x00" * 8, b"PK\x03\x04\x00\x00\x00\x00"])
def test_wrong_magic(tmp_path: Path, magic: bytes) -> None:
    path = tmp_path / "m.state"
    write_raw(path, encode(rank_state()), magic=magic)
    _assert_state_error(path, "not a savable_loader state file")


def test_pickle_file_is_not_a_state_file(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "p.state"
    path.write_bytes(pickle.dumps({"kind": "rank", "payload": list(range(100))}))
    _assert_state_error(path, "not a savable_loader state file")


@pytest.mark.parametrize("version", [0, 2, 2**32 - 1])
def test_wrong_file_format_version(tmp_path: Path, version: int) -> None:
    path = tmp_path / "v.state"
    write_raw(path, encode(rank_state()), version=version)
    _assert_state_error(path, f"file format version {version}, expected 1")


@pytest.mark.parametrize("delta", [-1, 1, 2**40, -10])
def test_header_length_lying(tmp_path: Path, delta: int) -> None:
    payload = encode(rank_state())
    path = tmp_path / "l.state"
    write_raw(path, payload, length=len(payload) + delta)
    _assert_state_error(path, rf"header says {len(payload) + delta} payload bytes, file has {len(payload)}")


def test_valid_envelope_with_foreign_payload(tmp_path: Path) -> None:
    path = tmp_path / "f.state"
    write_raw(path, msgspec.msgpack.encode({"kind": "other"}))
    _assert_state_error(path, "not a savable_loader state")


def test_valid_envelope_with_newer_schema(tmp_path: Path) -> None:
    raw = msgspec.msgpack.decode(encode(rank_state()))
    raw["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "n.state"
    write_raw(path, msgspec.msgpack.encode(raw))
    _assert_state_error(path, "upgrade savable-loader", StateVersionError)


def test_empty_payload(tmp_path: Path) -> None:
    path = tmp_path / "e.state"
    write_raw(path, b"")
    _assert_state_error(path, "not a savable_loader state")


# -- reading without torch --------------------------------------------------------------


def test_state_package_loads_file_without_importing_torch(tmp_path: Path) -> None:
    states = [rank_state(rank=0), rank_state(rank=1, consumed=99)]
    path = tmp_path / "global.state"
    save_file(path, states)
    single = tmp_path / "pipe.state"
    save_file(single, pipeline_state())
    script = textwrap.dedent(
        """
        import sys
        import savable_loader.state as s
        loaded = s.load_file(sys.argv[1])
        single = s.load_file(sys.argv[2])
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "cloudpickle"))
        print("heavy", heavy)
        print("global", s.encode(loaded).hex())
        print("single", s.encode(single).hex())
        print("ranks", [r.config.rank for r in loaded], [r.position.consumed for r in loaded])
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", script, str(path), str(single)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["heavy"] == "[]"
    assert lines["global"] == encode(states).hex()
    assert lines["single"] == encode(pipeline_state()).hex()
    assert lines["ranks"] == "[0, 1] [64, 99]"


# -- temporary files of killed writers (30 real kills: test_crash_consistency.py) ---------


def _temps(folder: Path, name: str = "loader.state") -> list[str]:
    return [n for n in listing(folder) if n.startswith(f".{name}.tmp-")]


def test_sweep_removes_only_dead_writers_files_of_this_machine(tmp_path: Path) -> None:
    machine, pid, start = files_mod._writer().split("_")
    assert int(pid) == os.getpid() and int(start) > 0  # Linux: /proc gives the start time
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid is free
    zombie = subprocess.Popen(["true"])  # exits, not reaped yet: a zombie
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while files_mod._start_time(zombie.pid) != -1 and time.monotonic() < deadline:
            time.sleep(0.01)
        live_start = files_mod._start_time(sleeper.pid)
        names = {
            "dead": f"{machine}_{gone.pid}_{start}_00000001",
            "zombie": f"{machine}_{zombie.pid}_{start}_00000002",
            "reused pid": f"{machine}_{sleeper.pid}_{live_start + 1}_00000003",
            "live writer": f"{machine}_{sleeper.pid}_{live_start}_00000004",
            "this process": f"{machine}_{pid}_{start}_00000005",
            "other machine": f"0badcafe_{gone.pid}_{start}_00000006",
            "earlier version": f"{gone.pid}-0123abcd",
        }
        for name in names.values():
            (tmp_path / f".loader.state.tmp-{name}").write_bytes(b"partial")
        (tmp_path / f".other.state.tmp-{names['dead']}").write_bytes(b"another target's")
        save_file(tmp_path / "loader.state", rank_state())
        kept = {n[len(".loader.state.tmp-") :] for n in _temps(tmp_path)}
        assert kept == {names[k] for k in ("live writer", "this process", "other machine", "earlier version")}
        assert (tmp_path / f".other.state.tmp-{names['dead']}").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


def test_temp_file_names_carry_machine_pid_and_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(files_mod.os, "replace", spy)
    save_file(tmp_path / "x.state", rank_state())
    prefix = ".x.state.tmp-"
    assert seen[0].startswith(prefix)
    machine, pid, start, rand = seen[0][len(prefix) :].split("_")
    assert (int(pid), len(machine), len(rand)) == (os.getpid(), 8, 8)
    assert int(start) == files_mod._start_time(os.getpid())


# -- path errors name the target ---------------------------------------------------------


def test_save_into_a_missing_folder(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "loader.state"
    with pytest.raises(StateFileError) as info:
        save_file(target, rank_state())
    assert str(info.value) == f"{target}: cannot save: the folder {tmp_path / 'missing'} does not exist"
    assert isinstance(info.value, StateError) and isinstance(info.value, OSError)
    assert (info.value.path, info.value.errno) == (str(target), errno.ENOENT)
    assert listing(tmp_path) == []


def test_save_onto_a_folder(tmp_path: Path) -> None:
    target = tmp_path / "loader.state"
    target.mkdir()
    (target / "inside").write_bytes(b"keep")
    with pytest.raises(StateFileError, match=re.escape(f"{target}: cannot save a state file there: it is a folder")):
        save_file(target, rank_state())
    assert listing(tmp_path) == ["loader.state"] and listing(target) == ["inside"]


def test_save_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"")
    target = tmp_path / "plain" / "loader.state"
    with pytest.raises(StateFileError, match=re.escape(f"{target}: cannot save: {tmp_path / 'plain'} is not a folder")):
        save_file(target, rank_state())


READ_ONLY_CHILD = r"""
import os, sys
from savable_loader.errors import StateFileError
from savable_loader.state import save_file, load_file
from tests.state.test_state_files import rank_state
folder = sys.argv[1]
if os.getuid() == 0:
    os.setgid(65534)
    os.setuid(65534)   # nobody: permissions apply again
if os.access(folder, os.W_OK):
    print("writable")
    sys.exit(0)
try:
    save_file(os.path.join(folder, "loader.state"), rank_state())
except StateFileError as e:
    print("StateFileError", e.errno, e)
"""


def test_save_into_a_read_only_folder() -> None:
    # As root the folder would stay writable: the save runs in a child that drops to
    # nobody (or as the current user when not root).
    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o755)
        folder = base / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        result = subprocess.run(
            [sys.executable, "-c", READ_ONLY_CHILD, str(folder)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        if result.returncode != 0 and "Operation not permitted" in result.stderr:
            pytest.skip("running as root without the right to drop privileges: a read-only folder stays writable")
        assert result.returncode == 0, result.stderr
        if result.stdout.strip() == "writable":
            pytest.skip("the read-only folder is writable for this user (root-like privileges)")
        target = folder / "loader.state"
        assert result.stdout.strip() == (
            f"StateFileError {errno.EACCES} {target}: cannot save: cannot write in the folder {folder} "
            "(Permission denied)"
        )
        assert os.listdir(folder) == []
    finally:
        (base / "read-only").chmod(0o755)
        shutil.rmtree(base)


def test_load_errors_are_state_file_errors(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="nope.state: cannot read state file") as info:
        load_file(tmp_path / "nope.state")
    assert info.value.errno == errno.ENOENT and info.value.path == str(tmp_path / "nope.state")
