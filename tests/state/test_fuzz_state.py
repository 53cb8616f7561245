"""Untrusted state input: only StateError, no other exception, no excessive memory.

Complements the byte-level fuzzing in test_state_codec.py with inputs that get further:

* wrong types at every place of real states (saved by loaders on both paths), in
  otherwise valid MessagePack; what still decodes must restore or be refused with a
  ``SavableLoaderError``, and a restored drop-in loader must iterate or refuse;
* length prefixes claiming gigabytes (bin, str, array, map, ext) at every place of a
  real state: refused without allocating them;
* ``load_file`` on mutated headers and on payloads mutated *with* a matching checksum,
  so that the decoder behind the checksum is reached.
"""

from __future__ import annotations

import hashlib
import struct
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import savable_loader as sl
from savable_loader.errors import SavableLoaderError, StateError
from savable_loader.state import RankState, decode, encode, load_file
from savable_loader.wrappers import BatchDataset, MapDataset, ShuffleBufferDataset
from tests.common import RandomMapDataset, RangeSource

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = struct.Struct("<8sIQ32s")
MAX_PEAK = 1 << 20  # bytes a refused decode may allocate (the states here are < 2 kB)


def _double(x: Any) -> Any:
    return x * 2


def dropin() -> sl.SavableDataLoader:
    return sl.SavableDataLoader(RandomMapDataset(20), batch_size=3, shuffle=True, seed=1)


def pipeline() -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=1)
    ds = BatchDataset(MapDataset(ShuffleBufferDataset(RangeSource(20, wc), size=4), _double), batch_size=2)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)


FACTORIES = {"dropin": dropin, "pipeline": pipeline}


def _saved(kind: str, steps: int) -> bytes:
    loader = FACTORIES[kind]()
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return encode(loader.save_state_rank())


VALID = {"dropin": _saved("dropin", 2), "pipeline": _saved("pipeline", 3)}
VALID["global"] = encode([decode(VALID["dropin"]), decode(VALID["dropin"])])


def _tree(data: bytes) -> Any:
    return msgspec.msgpack.decode(data, ext_hook=lambda code, raw: msgspec.msgpack.Ext(code, bytes(raw)))


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, prefix + (i,))
    return out


def _replace(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = dict(node) if isinstance(node, dict) else list(node)
    node[path[0]] = _replace(node[path[0]], path[1:], value)
    return node


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.sampled_from(["rank", "global", "index", "pipeline", "", "x.Y"])
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


def _decode_or_state_error(data: bytes) -> Any:
    try:
        return decode(data)
    except StateError:
        return None


def _restore_or_refuse(kind: str, state: Any) -> None:
    loader = FACTORIES[kind]()
    try:
        loader.restore_state_rank(state)
    except SavableLoaderError:
        return
    if kind == "dropin":  # everything a drop-in restore sets up is the library's own
        try:
            for _ in zip(range(3), loader):
                pass
        except SavableLoaderError:
            pass


@FUZZ
@given(st.sampled_from(sorted(VALID)), st.data())
def test_wrong_types_anywhere_in_a_real_state(kind: str, data: st.DataObject) -> None:
    tree = _tree(VALID[kind])
    path = data.draw(st.sampled_from(_paths(tree)), label="path")
    value = data.draw(_values, label="value")
    result = _decode_or_state_error(msgspec.msgpack.encode(_replace(tree, path, value)))
    if result is None:
        return
    assert isinstance(result, (RankState, list)), type(result)
    encode(result)  # what decodes can be written again
    if kind != "global":
        _restore_or_refuse(kind, result)


@FUZZ
@given(st.sampled_from(["dropin", "pipeline"]), st.data())
def test_removed_entries_anywhere_in_a_real_state(kind: str, data: st.DataObject) -> None:
    tree = _tree(VALID[kind])
    path = data.draw(st.sampled_from([p for p in _paths(tree) if p]), label="path")
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict):
        smaller = {k: v for k, v in parent.items() if k != path[-1]}
    else:
        smaller = [v for i, v in enumerate(parent) if i != path[-1]]
    result = _decode_or_state_error(msgspec.msgpack.encode(_replace(tree, path[:-1], smaller)))
    if result is not None:
        _restore_or_refuse(kind, result)


def _header_offsets(data: bytes) -> list[tuple[int, int]]:
    """(offset, header length) of every bin/str/array/map/ext item with a length."""
    out = []
    dec = msgspec.msgpack.Decoder()
    for i, b in enumerate(data):
        if 0x80 <= b <= 0xBF:  # fixmap, fixarray, fixstr
            n = 1
        elif b in (0xC4, 0xD9, 0xC7):
            n = 2
        elif b in (0xC5, 0xDA, 0xDC, 0xDE, 0xC8):
            n = 3
        elif b in (0xC6, 0xDB, 0xDD, 0xDF, 0xC9):
            n = 5
        else:
            continue
        try:  # keep only offsets where an item really starts (its tail decodes as msgpack)
            dec.decode(data[i:])
        except (msgspec.DecodeError, ValueError) as e:
            if "trailing" not in str(e).lower():
                continue
        out.append((i, n))
    return out


@pytest.mark.parametrize("kind", sorted(VALID))
@pytest.mark.parametrize(
    "prefix", [b"\xc6", b"\xdb", b"\xdd", b"\xdf", b"\xc9"], ids=["bin", "str", "array", "map", "ext"]
)
def test_length_prefix_claiming_gigabytes_allocates_nothing(kind: str, prefix: bytes) -> None:
    valid = VALID[kind]
    offsets = _header_offsets(valid)
    assert len(offsets) > 10
    for offset, n in offsets:
        # a 32-bit length of 4 GiB - 1 in place of the item's real header
        extra = b"\x01" if prefix == b"\xc9" else b""
        data = valid[:offset] + prefix + b"\xff\xff\xff\xff" + extra + valid[offset + n :]
        tracemalloc.start()
        try:
            result = _decode_or_state_error(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert result is None, f"offset {offset}: a 4 GiB length decoded"
        assert peak < MAX_PEAK, f"offset {offset}: decoding allocated {peak} bytes"


def _file(
    payload: bytes,
    *,
    length: int | None = None,
    version: int = 1,
    magic: bytes = b"SLSTATE\x00",
    digest: bytes | None = None,
) -> bytes:
    length = len(payload) if length is None else length
    digest = hashlib.blake2b(payload, digest_size=32).digest() if digest is None else digest
    return HEADER.pack(magic, version, length, digest) + payload


def _load_or_state_error(raw: bytes) -> Any:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "x.state"
        path.write_bytes(raw)
        tracemalloc.start()
        try:
            try:
                return load_file(path)
            except StateError:
                return None
            finally:
                _, peak = tracemalloc.get_traced_memory()
                assert peak < MAX_PEAK + 2 * len(raw), f"load_file allocated {peak} bytes"
        finally:
            tracemalloc.stop()


@FUZZ
@given(st.sampled_from(sorted(VALID)), st.data())
def test_load_file_with_mutated_payload_and_matching_checksum(kind: str, data: st.DataObject) -> None:
    valid = VALID[kind]
    start = data.draw(st.integers(0, len(valid)), label="start")
    stop = data.draw(st.integers(start, min(len(valid), start + 8)), label="stop")
    insert = data.draw(st.binary(max_size=8), label="insert")
    _load_or_state_error(_file(valid[:start] + insert + valid[stop:]))


@FUZZ
@given(
    st.sampled_from(sorted(VALID)),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.integers(0, 2**32 - 1),
    st.sampled_from([b"SLSTATE\x00", b"SLSTATE\x01", b"\x00" * 8]),
    st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
    st.integers(0, 80),
)
def test_load_file_with_mutated_header(
    kind: str, length: int | None, version: int, magic: bytes, digest: bytes | None, cut: int
) -> None:
    raw = _file(VALID[kind], length=length, version=version, magic=magic, digest=digest)
    result = _load_or_state_error(raw[: len(raw) - cut] if cut else raw)
    if result is not None:
        assert encode(result) == VALID[kind]


@FUZZ
@given(st.binary(max_size=200))
def test_load_file_with_random_bytes(raw: bytes) -> None:
    assert _load_or_state_error(raw) is None
    _load_or_state_error(_file(raw))  # a valid header before random bytes: only StateError


def test_load_file_refuses_folders_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="cannot read"):
        load_file(tmp_path)
    with pytest.raises(StateError, match="cannot read"):
        load_file(tmp_path / "missing.state")
