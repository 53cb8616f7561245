"""Tests for savable_loader.state.codec: exact round trips, refusals, version checks, fuzzing."""

from __future__ import annotations

import array
import math
import struct

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from savable_loader.dataset.values import from_plain, to_plain
from savable_loader.errors import StateError, StateVersionError
from savable_loader.state import (
    SCHEMA_VERSION,
    ArrayValue,
    DatasetState,
    GlobalState,
    IndexPosition,
    LoaderConfig,
    PipelinePosition,
    RankState,
    WorkerState,
    decode,
    encode,
)
from savable_loader.state.codec import decode_part, encode_part

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]


def make_config(**overrides: object) -> LoaderConfig:
    values: dict[str, object] = dict(
        rank=1,
        world_size=4,
        num_workers=2,
        seed=-7,
        batch_size=32,
        shuffle=True,
        drop_last=False,
        dataset_fingerprint="0123456789abcdef01234567",
        dataset_config={"type": "x.Y", "n": 10, "children": [{"type": "x.Z", "p": 0.5}]},
    )
    values.update(overrides)
    return LoaderConfig(**values)  # type: ignore[arg-type]


def torch_value(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]])
    if dtype.is_complex:
        return torch.tensor([[1 + 2j, -3.5 + 0j, 0 - 1j]], dtype=dtype)
    if dtype.is_floating_point:
        return torch.tensor([[0.5, -1.25, 3.0e3], [float("inf"), -0.0, 7.0]], dtype=dtype)
    return torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int64).to(dtype)


def numpy_value(dtype: type) -> np.ndarray:
    if dtype is np.bool_:
        return np.array([True, False, False])
    if np.issubdtype(dtype, np.complexfloating):
        return np.array([1 + 2j, -3.5], dtype=dtype).reshape(2, 1)
    if np.issubdtype(dtype, np.floating):
        return np.array([[0.5, -1.25], [np.inf, -0.0]], dtype=dtype)
    return np.arange(4, dtype=dtype).reshape(2, 2)


def make_tree() -> DatasetState:
    arrays = {f"torch_{str(d).removeprefix('torch.')}": to_plain(torch_value(d)) for d in TORCH_DTYPES}
    arrays.update({f"numpy_{np.dtype(d).name}": to_plain(numpy_value(d)) for d in NUMPY_DTYPES})
    leaf = DatasetState(
        type="pkg.mod.Source",
        fields={
            "pos": 17,
            "big": 2**64 - 1,
            "neg": -(2**63),
            "ratio": 0.1,
            "tiny": 5e-324,
            "inf": float("-inf"),
            "name": "héllo ✓",
            "blob": b"\x00\xff\x80raw",
            "empty_bytes": b"",
            "none": None,
            "flag": True,
            "nested": [1, [2.5, "x", [b"y", None]], {"k": [1, 2, {"deep": {"deeper": [3]}}]}],
            "mapping": {"a": 1, "b": [True, False], "c": {"d": "e"}},
            "scalar_tensor": to_plain(torch.tensor(3.25, dtype=torch.float64)),
            "empty_tensor": to_plain(torch.zeros(0, 3)),
            "arrays_in_list": [to_plain(torch.ones(2, dtype=torch.bfloat16)), to_plain(np.zeros((1, 2)))],
            **arrays,
        },
    )
    return DatasetState(
        type="pkg.wrappers.Batch",
        fields={"buffer": [[1, 2], [3]], "rng": {"kind": "torch", "device": "cpu", "state": bytes(range(256))}},
        children=[leaf, DatasetState(type="pkg.mod.Other")],
    )


def index_state(**overrides: object) -> RankState:
    return RankState(
        config=make_config(**overrides),
        position=IndexPosition(epoch=3, consumed=640, dataset_len=100_000),
        library_version="0.1.0.dev0",
    )


def pipeline_state() -> RankState:
    return RankState(
        config=make_config(batch_size=None, shuffle=False, rank=0, world_size=1),
        position=PipelinePosition(
            epoch=2,
            next_worker=1,
            workers=[
                WorkerState(worker_id=0, index=12, snapshot_index=9, dataset=make_tree()),
                WorkerState(worker_id=1, index=11, snapshot_index=0, dataset=None),
            ],
        ),
    )


def is_valid_decode(result: object) -> bool:
    if isinstance(result, RankState):
        return True
    return isinstance(result, list) and all(isinstance(r, RankState) for r in result)


# -- round trips ------------------------------------------------------------------------


def test_index_position_round_trip() -> None:
    state = index_state()
    data = encode(state)
    assert isinstance(data, bytes)
    back = decode(data)
    assert isinstance(back, RankState)
    assert back == state
    assert isinstance(back.position, IndexPosition)
    assert (back.position.epoch, back.position.consumed, back.position.dataset_len) == (3, 640, 100_000)
    assert back.config.seed == -7
    assert back.config.dataset_config == {"type": "x.Y", "n": 10, "children": [{"type": "x.Z", "p": 0.5}]}
    assert back.schema_version == SCHEMA_VERSION
    assert back.library_version == "0.1.0.dev0"
    assert back.epoch == 3
    # Encoding is deterministic: re-encoding the decoded state gives the same bytes.
    assert encode(back) == data


def test_pipeline_position_round_trip() -> None:
    state = pipeline_state()
    data = encode(state)
    back = decode(data)
    assert back == state
    assert encode(back) == data
    pos = back.position
    assert isinstance(pos, PipelinePosition)
    assert (pos.epoch, pos.next_worker) == (2, 1)
    w0, w1 = pos.workers
    assert (w0.worker_id, w0.index, w0.snapshot_index, w0.skip) == (0, 12, 9, 3)
    assert (w1.worker_id, w1.index, w1.snapshot_index, w1.skip, w1.dataset) == (1, 11, 0, 11, None)
    assert w0.dataset is not None
    assert [c.type for c in w0.dataset.children] == ["pkg.mod.Source", "pkg.mod.Other"]
    assert w0.dataset.children[1].fields == {} and w0.dataset.children[1].children == []


def test_dataset_tree_values_keep_exact_types_and_bits() -> None:
    back = decode(encode(pipeline_state()))
    tree = back.position.workers[0].dataset
    leaf = tree.children[0].fields
    assert type(leaf["pos"]) is int and leaf["pos"] == 17
    assert leaf["big"] == 2**64 - 1 and leaf["neg"] == -(2**63)
    assert struct.pack("<d", leaf["ratio"]) == struct.pack("<d", 0.1)
    assert leaf["tiny"] == 5e-324
    assert leaf["inf"] == float("-inf")
    assert leaf["name"] == "héllo ✓"
    assert type(leaf["blob"]) is bytes and leaf["blob"] == b"\x00\xff\x80raw"
    assert leaf["empty_bytes"] == b""
    assert leaf["none"] is None and leaf["flag"] is True
    assert leaf["nested"] == [1, [2.5, "x", [b"y", None]], {"k": [1, 2, {"deep": {"deeper": [3]}}]}]
    assert type(leaf["nested"]) is list and type(leaf["nested"][1]) is list
    assert leaf["mapping"] == {"a": 1, "b": [True, False], "c": {"d": "e"}}
    assert tree.fields["rng"]["state"] == bytes(range(256))
    assert tree.fields["buffer"] == [[1, 2], [3]]


def test_nan_float_round_trips_bit_exact() -> None:
    nan = struct.unpack("<d", bytes.fromhex("010000000000f87f"))[0]  # a NaN with payload
    state = DatasetState(type="t", fields={"x": nan})
    back = decode_part(encode_part(state), DatasetState)
    assert math.isnan(back.fields["x"])
    assert struct.pack("<d", back.fields["x"]) == struct.pack("<d", nan)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_array_values_round_trip(dtype: torch.dtype) -> None:
    original = torch_value(dtype)
    back = decode(encode(pipeline_state()))
    key = f"torch_{str(dtype).removeprefix('torch.')}"
    value = back.position.workers[0].dataset.children[0].fields[key]
    assert isinstance(value, ArrayValue)
    assert value == to_plain(original)
    assert value.library == "torch"
    assert value.shape == tuple(original.shape)
    assert len(value.data) == original.numel() * original.element_size()
    restored = from_plain(value)
    assert restored.dtype == dtype
    assert restored.shape == original.shape
    # bit-exact (handles -0.0 and inf; bfloat16 included)
    assert restored.reshape(-1).view(torch.uint8).tolist() == original.reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_array_values_round_trip(dtype: type) -> None:
    original = numpy_value(dtype)
    back = decode(encode(pipeline_state()))
    value = back.position.workers[0].dataset.children[0].fields[f"numpy_{np.dtype(dtype).name}"]
    assert isinstance(value, ArrayValue)
    assert (value.library, value.dtype, value.shape) == ("numpy", np.dtype(dtype).name, original.shape)
    restored = from_plain(value)
    assert restored.dtype == original.dtype
    assert restored.tobytes() == original.tobytes()


def test_scalar_and_empty_tensors_round_trip() -> None:
    back = decode(encode(pipeline_state()))
    leaf = back.position.workers[0].dataset.children[0].fields
    scalar = from_plain(leaf["scalar_tensor"])
    assert scalar.shape == () and scalar.dtype == torch.float64 and scalar.item() == 3.25
    empty = from_plain(leaf["empty_tensor"])
    assert empty.shape == (0, 3) and empty.dtype == torch.float32
    bf, npz = leaf["arrays_in_list"]
    assert torch.equal(from_plain(bf), torch.ones(2, dtype=torch.bfloat16))
    assert np.array_equal(from_plain(npz), np.zeros((1, 2)))


def test_zero_dimensional_numpy_array_keeps_its_shape() -> None:
    value = to_plain(np.asarray(np.float32(1.5)))
    assert value.shape == ()
    back = from_plain(decode_part(encode_part(DatasetState(type="t", fields={"a": value})), DatasetState).fields["a"])
    assert back.shape == () and back.dtype == np.float32 and back[()] == np.float32(1.5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16])
def test_size_one_tensor_with_odd_stride_round_trips(dtype: torch.dtype) -> None:
    # x[:1, 2] of a (2, 4) tensor: one element with stride 4, which contiguous() keeps
    t = torch.arange(8).reshape(2, 4).to(dtype)[:1, 2]
    assert t.stride() == (4,) and t.is_contiguous()
    back = from_plain(to_plain(t))
    assert back.dtype == dtype and torch.equal(back, torch.tensor([2]).to(dtype))


def test_hand_made_array_value_round_trip() -> None:
    value = ArrayValue(library="numpy", dtype="int16", shape=(2, 2), data=b"\x01\x00\x02\x00\x03\x00\xff\xff")
    back = decode_part(encode_part(DatasetState(type="t", fields={"a": value})), DatasetState)
    assert back.fields["a"] == value
    assert from_plain(back.fields["a"]).tolist() == [[1, 2], [3, -1]]


@pytest.mark.parametrize("make", [lambda: [index_state(), pipeline_state()], lambda: (index_state(),)])
def test_gathered_list_round_trip(make) -> None:
    states = make()
    data = encode(states)
    back = decode(data)
    assert type(back) is list
    assert back == list(states)
    assert all(isinstance(s, RankState) for s in back)
    raw = msgspec.msgpack.decode(data)
    assert raw["kind"] == "global" and raw["schema_version"] == SCHEMA_VERSION


def test_empty_gathered_list_round_trip() -> None:
    assert decode(encode([])) == []


def test_global_state_object_encodes_like_a_list() -> None:
    states = [index_state(rank=r) for r in range(4)]
    back = decode(encode(GlobalState(ranks=states)))
    assert back == states
    assert [s.config.rank for s in back] == [0, 1, 2, 3]


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = encode(index_state())
    assert decode(bytearray(data)) == index_state()
    assert decode(memoryview(data)) == index_state()


def test_part_round_trip_for_worker_state() -> None:
    worker = pipeline_state().position.workers[0]
    back = decode_part(encode_part(worker), WorkerState)
    assert back == worker


# -- refusals on encode -----------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [None, 5, "state", b"bytes", {"kind": "rank"}, make_config(), IndexPosition(epoch=0, consumed=0, dataset_len=0)],
    ids=lambda o: type(o).__name__,
)
def test_encode_wrong_object_raises_state_error(obj: object) -> None:
    with pytest.raises(StateError, match="can only encode a RankState"):
        encode(obj)  # type: ignore[arg-type]


def test_encode_list_with_foreign_items_raises_state_error() -> None:
    with pytest.raises(StateError, match=r"list of RankState.*\['RankState', 'int'\]"):
        encode([index_state(), 3])  # type: ignore[list-item]
    with pytest.raises(StateError, match="list of RankState"):
        encode([{"kind": "rank"}])  # type: ignore[list-item]


def test_encode_unencodable_field_raises_state_error() -> None:
    bad = RankState(
        config=make_config(),
        position=PipelinePosition(
            epoch=0,
            next_worker=0,
            workers=[
                WorkerState(
                    worker_id=0, index=0, snapshot_index=0, dataset=DatasetState(type="t", fields={"f": object()})
                )
            ],
        ),
    )
    with pytest.raises(StateError, match="cannot be encoded.*object"):
        encode(bad)
    with pytest.raises(StateError, match="cannot be encoded"):
        encode_part({"x": object()})


# -- versions ---------------------------------------------------------------------------


def _with_version(data: bytes, version: int) -> bytes:
    raw = msgspec.msgpack.decode(data)  # extensions come back as msgspec.msgpack.Ext
    raw["schema_version"] = version
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("make", [index_state, pipeline_state, lambda: [index_state(), index_state(rank=2)]])
def test_newer_schema_version_raises_version_error(make) -> None:
    data = encode(make())
    # sanity: the rewrite itself is lossless
    assert decode(_with_version(data, SCHEMA_VERSION)) == decode(data)
    newer = _with_version(data, SCHEMA_VERSION + 1)
    with pytest.raises(StateVersionError, match="upgrade savable-loader") as info:
        decode(newer)
    assert isinstance(info.value, StateError)
    assert f"schema version {SCHEMA_VERSION + 1}" in str(info.value)


def test_newer_schema_version_wins_over_unknown_fields() -> None:
    # A newer writer may add fields this version does not know: still a version error.
    raw = msgspec.msgpack.decode(encode(index_state()))
    raw["schema_version"] = SCHEMA_VERSION + 5
    raw["position"] = {"type": "future-position", "whatever": [1, 2, 3]}
    raw["new_field"] = {"x": 1}
    with pytest.raises(StateVersionError, match="upgrade savable-loader"):
        decode(msgspec.msgpack.encode(raw))


def test_schema_version_zero_is_malformed_not_newer() -> None:
    data = _with_version(encode(index_state()), 0)
    with pytest.raises(StateError) as info:
        decode(data)
    assert not isinstance(info.value, StateVersionError)


# -- foreign input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        {"kind": "other"},
        {"kind": "other", "schema_version": 1},
        {},
        {"schema_version": 1},
        {"kind": 1},
        {"kind": "rank"},
        {"kind": "rank", "schema_version": "1"},
        {"kind": "rank", "schema_version": 1, "config": {}, "position": {}},
        {"kind": "global", "ranks": [1, 2]},
        {"kind": "global", "ranks": [{"kind": "other"}]},
        5,
        -1,
        "rank",
        b"rank",
        [1, 2, 3],
        ["rank", 1],
        None,
        1.5,
    ],
    ids=repr,
)
def test_foreign_msgpack_raises_state_error(payload: object) -> None:
    with pytest.raises(StateError):
        decode(msgspec.msgpack.encode(payload))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x81", b"not msgpack at all", b"\x00" * 10])
def test_garbage_bytes_raise_state_error(data: bytes) -> None:
    with pytest.raises(StateError):
        decode(data)


@pytest.mark.parametrize("obj", ["text", 5, None, [1, 2]], ids=repr)
def test_decode_non_bytes_raises_state_error(obj: object) -> None:
    with pytest.raises(StateError, match="decode needs bytes"):
        decode(obj)  # type: ignore[arg-type]


def test_wrong_field_type_inside_valid_envelope_raises_state_error() -> None:
    raw = msgspec.msgpack.decode(encode(index_state()))
    raw["position"]["consumed"] = -1  # NonNeg
    with pytest.raises(StateError, match="malformed"):
        decode(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(encode(index_state()))
    raw["config"]["world_size"] = 0  # Positive
    with pytest.raises(StateError, match="malformed"):
        decode(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(encode(index_state()))
    raw["position"]["type"] = "unknown-position"
    with pytest.raises(StateError, match="malformed"):
        decode(msgspec.msgpack.encode(raw))


# -- ArrayValue extensions --------------------------------------------------------------


def _state_with_ext(ext: msgspec.msgpack.Ext) -> bytes:
    state = RankState(
        config=make_config(),
        position=PipelinePosition(
            epoch=0,
            next_worker=0,
            workers=[
                WorkerState(worker_id=0, index=1, snapshot_index=0, dataset=DatasetState(type="t", fields={"a": ext}))
            ],
        ),
    )
    return msgspec.msgpack.encode(state)


def _array_ext(library: object, dtype: object, shape: object, data: object) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(1, msgspec.msgpack.encode((library, dtype, shape, data)))


def test_valid_hand_made_extension_decodes() -> None:
    back = decode(_state_with_ext(_array_ext("torch", "bfloat16", [2, 1], b"\x80\x3f\x00\x40")))
    value = back.position.workers[0].dataset.fields["a"]
    assert value == ArrayValue(library="torch", dtype="bfloat16", shape=(2, 1), data=b"\x80\x3f\x00\x40")
    assert from_plain(value).reshape(-1).tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "ext, message",
    [
        (_array_ext("torch", "object", [1], b"\x00" * 8), "dtype 'object'"),
        (_array_ext("numpy", "float128", [1], b"\x00" * 16), "dtype 'float128'"),
        (_array_ext("numpy", "<i4", [1], b"\x00" * 4), "dtype '<i4'"),
        (_array_ext("torch", "float32", [2], b"\x00" * 7), "needs 8 bytes, got 7"),
        (_array_ext("numpy", "int64", [2, 3], b"\x00" * 40), "needs 48 bytes, got 40"),
        (_array_ext("torch", "uint8", [], b""), "needs 1 bytes, got 0"),
        (_array_ext("pickle", "float32", [1], b"\x00" * 4), "library must be one of"),
        (_array_ext("jax", "float32", [1], b"\x00" * 4), "library must be one of"),
        (_array_ext("numpy", "bfloat16", [1], b"\x00" * 2), "dtype 'bfloat16' is not valid for library 'numpy'"),
        (_array_ext("torch", "U2", [1], b"\x00" * 8), "dtype 'U2' is not valid for library 'torch'"),
        (_array_ext("torch", ">int32", [1], b"\x00" * 4), "dtype '>int32'"),
        (_array_ext("numpy", ">uint8", [1], b"\x00"), "cannot be big-endian"),
        (_array_ext("numpy", ">S2", [1], b"\x00" * 2), "cannot be big-endian"),
        (_array_ext("numpy", "U0", [1], b""), "dtype 'U0'"),
        (_array_ext("numpy", "U99999999999", [0], b""), "dtype 'U99999999999'"),
        (_array_ext("numpy", "U536870912", [0], b""), "dtype 'U536870912'"),
        (_array_ext("numpy", "timedelta64[2147483648s]", [0], b""), "dtype 'timedelta64"),
        (_array_ext("numpy", "U3", [2], b"\x00" * 12), "needs 24 bytes, got 12"),
        (_array_ext("numpy", "datetime64[xs]", [1], b"\x00" * 8), "dtype 'datetime64\\[xs\\]'"),
        (_array_ext("numpy", "datetime64[ns", [1], b"\x00" * 8), "dtype 'datetime64\\[ns'"),
        (_array_ext("numpy", "object", [1], b"\x00" * 8), "dtype 'object'"),
        (_array_ext("numpy", "str", [], b"a"), "dtype 'str' is not valid for library 'numpy'"),
        (_array_ext("numpy-scalar", "float32", [1], b"\x00" * 4), "invalid array shape"),
        (_array_ext("numpy-scalar", "float32", [], b"\x00" * 3), "needs 4 bytes, got 3"),
        (_array_ext("numpy-scalar", "U2", [], b"\x00" * 8), "dtype 'U2' is not valid for library 'numpy-scalar'"),
        (_array_ext("numpy-scalar", ">int32", [], b"\x00" * 4), "cannot be big-endian"),
        (_array_ext("numpy-scalar", "str", [], b"\xff"), "can't decode"),
        (_array_ext("numpy-scalar", "bfloat16", [], b"\x00" * 2), "dtype 'bfloat16'"),
        (_array_ext("numpy", "float32", [-1], b""), "invalid array shape"),
        (_array_ext("numpy", "uint8", [1] * 33, b"\x00"), "invalid array shape"),
        (_array_ext("numpy", "float32", ["2"], b"\x00" * 8), None),
        (_array_ext("numpy", "float32", [1], "text"), None),
        (_array_ext("numpy", "float32", [1], None), None),
        (_array_ext("numpy", 4, [1], b"\x00" * 4), None),
        (_array_ext(b"numpy", "float32", [1], b"\x00" * 4), None),
        (msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("numpy", "float32", [1]))), None),
        (msgspec.msgpack.Ext(1, msgspec.msgpack.encode({"library": "numpy"})), None),
        (msgspec.msgpack.Ext(1, b""), None),
        (msgspec.msgpack.Ext(1, b"\xc1garbage"), None),
        (msgspec.msgpack.Ext(3, msgspec.msgpack.encode(("numpy", "float32", [1], b"\x00" * 4))), "extension code 3"),
        (msgspec.msgpack.Ext(2, msgspec.msgpack.encode({"a": 1})), "Expected `array`"),
        (msgspec.msgpack.Ext(2, b""), None),
        (msgspec.msgpack.Ext(2, b"\x91\xc1"), None),
        (msgspec.msgpack.Ext(2, msgspec.msgpack.encode([msgspec.msgpack.Ext(7, b"")])), "extension code 7"),
        (msgspec.msgpack.Ext(7, b"\x00"), "extension code 7"),
        (_array_ext("array", "q", [2], b"\x00" * 15), "needs 16 bytes, got 15"),
        (_array_ext("array", "d", [], b"\x00" * 8), "invalid array shape"),
        (_array_ext("array", "q", [1, 1], b"\x00" * 8), "invalid array shape"),
        (_array_ext("array", "l", [1], b"\x00" * 8), "typecode must be one of bBhHiIqQfd, got 'l'"),
        (_array_ext("array", "u", [1], b"\x00" * 4), "typecode"),
        (_array_ext("array", "int64", [1], b"\x00" * 8), "typecode"),
        (_array_ext("array", ">q", [1], b"\x00" * 8), "typecode"),
    ],
)
def test_bad_array_extension_raises_state_error(ext: msgspec.msgpack.Ext, message: str | None) -> None:
    with pytest.raises(StateError, match=message):
        decode(_state_with_ext(ext))
    with pytest.raises(StateError, match=message):
        decode_part(msgspec.msgpack.encode(DatasetState(type="t", fields={"a": ext})), DatasetState)


def test_a_malformed_extension_is_named_by_its_field() -> None:
    bad = _array_ext("array", "q", [2], b"\x00" * 15)
    with pytest.raises(StateError, match=r"needs 16 bytes, got 15 at position\.workers\[0\]\.dataset: t\.a$"):
        decode(_state_with_ext(bad))
    inner = DatasetState(type="m.Inner", fields={"buf": {"x": [1, bad]}})
    part = msgspec.msgpack.encode(DatasetState(type="m.Outer", fields={"ok": 1}, children=[inner]))
    with pytest.raises(StateError, match=r"at Inner\.buf\['x'\]\[1\]$"):
        decode_part(part, DatasetState)
    # inside a tuple: the tuple is named
    part = msgspec.msgpack.encode(
        DatasetState(type="m.T", fields={"t": msgspec.msgpack.Ext(2, msgspec.msgpack.encode([bad]))})
    )
    with pytest.raises(StateError, match=r"at T\.t$"):
        decode_part(part, DatasetState)


def test_decode_part_wrong_type_raises_state_error() -> None:
    with pytest.raises(StateError, match="malformed state part"):
        decode_part(encode_part(DatasetState(type="t")), WorkerState)
    with pytest.raises(StateError, match="malformed state part"):
        decode_part(b"\xc1", DatasetState)


# -- fuzzing ----------------------------------------------------------------------------

VALID_INDEX = encode(index_state())
VALID_PIPELINE = encode(pipeline_state())
VALID_GLOBAL = encode([index_state(), index_state(rank=3)])
VALID_ENCODINGS = [VALID_INDEX, VALID_PIPELINE, VALID_GLOBAL]


def _decode_or_state_error(data: bytes) -> None:
    try:
        result = decode(data)
    except StateError:
        return
    assert is_valid_decode(result), type(result)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_state_error(data)


@FUZZ
@given(st.binary(max_size=64).map(lambda b: b"\x84\xa4kind\xa4rank" + b))
def test_fuzz_random_bytes_after_a_plausible_prefix(data: bytes) -> None:
    _decode_or_state_error(data)


@pytest.mark.parametrize("valid", VALID_ENCODINGS, ids=["index", "pipeline", "global"])
def test_every_truncation_raises_state_error(valid: bytes) -> None:
    for n in range(len(valid)):
        with pytest.raises(StateError):
            decode(valid[:n])
    assert is_valid_decode(decode(valid))


@pytest.mark.parametrize("valid", VALID_ENCODINGS, ids=["index", "pipeline", "global"])
def test_every_single_byte_xor_mutation(valid: bytes) -> None:
    for i in range(len(valid)):
        for flip in (0x01, 0xFF):
            mutated = bytearray(valid)
            mutated[i] ^= flip
            _decode_or_state_error(bytes(mutated))


@FUZZ
@given(st.sampled_from(VALID_ENCODINGS), st.data())
def test_fuzz_single_byte_mutations(valid: bytes, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(valid) - 1), label="position")
    value = data.draw(st.integers(0, 255), label="value")
    mutated = bytearray(valid)
    mutated[i] = value
    _decode_or_state_error(bytes(mutated))


@FUZZ
@given(st.sampled_from(VALID_ENCODINGS), st.data())
def test_fuzz_splices(valid: bytes, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(valid)), label="start")
    stop = data.draw(st.integers(start, len(valid)), label="stop")
    insert = data.draw(st.binary(max_size=16), label="insert")
    _decode_or_state_error(valid[:start] + insert + valid[stop:])


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["rank", "global", "index", "pipeline", "kind", "type"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "kind",
                    "type",
                    "schema_version",
                    "config",
                    "position",
                    "ranks",
                    "workers",
                    "epoch",
                    "consumed",
                    "dataset_len",
                    "fields",
                    "children",
                    "x",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_msgpack_values)
def test_fuzz_structured_msgpack(value: object) -> None:
    _decode_or_state_error(msgspec.msgpack.encode(value))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["torch", "numpy", "numpy-scalar", "array", "pickle", ""]),
    st.sampled_from(
        [
            "float32",
            "bfloat16",
            "int64",
            "bool",
            "object",
            "complex128",
            "S3",
            "U2",
            ">int32",
            "datetime64[ns]",
            "timedelta64",
            "str",
            "bytes",
            "float128",
            "U536870911",
            "S2147483647",
            "timedelta64[2147483647as]",
            ">datetime64[D]",
            ">float16",
            "q",
            "d",
            "B",
            "l",
        ]
    ),
    st.lists(st.integers(-2, 5), max_size=4),
    st.binary(max_size=48),
)
def test_fuzz_array_extensions(library: str, dtype: str, shape: list[int], raw: bytes) -> None:
    data = _state_with_ext(_array_ext(library, dtype, shape, raw))
    try:
        result = decode(data)
    except StateError:
        return
    value = result.position.workers[0].dataset.fields["a"]
    assert isinstance(value, ArrayValue)
    assert value.library in ("torch", "numpy", "numpy-scalar", "array")
    restored = from_plain(value)  # whatever decodes also converts
    if value.library == "array":
        assert type(restored) is array.array and (len(restored),) == value.shape
        assert restored.tobytes() == value.data
    elif value.library == "torch":
        assert isinstance(restored, torch.Tensor) and tuple(restored.shape) == value.shape
    elif value.library == "numpy":
        assert isinstance(restored, np.ndarray) and restored.shape == value.shape
        assert restored.nbytes == len(value.data)
    else:
        assert isinstance(restored, np.generic) and value.shape == ()


def test_newer_schema_inside_a_gathered_state_is_refused():
    import msgspec

    from savable_loader.errors import StateVersionError
    from savable_loader.state import GlobalState, IndexPosition, LoaderConfig, RankState, encode

    config = LoaderConfig(
        rank=0,
        world_size=1,
        num_workers=0,
        seed=0,
        batch_size=2,
        shuffle=False,
        drop_last=False,
        dataset_fingerprint="x",
    )
    rank = RankState(config=config, position=IndexPosition(epoch=0, consumed=0, dataset_len=4))
    plain = msgspec.to_builtins(GlobalState(ranks=[rank]))
    plain["ranks"][0]["schema_version"] = 99
    with pytest.raises(StateVersionError, match="upgrade savable-loader"):
        decode(msgspec.msgpack.encode(plain))
    assert decode(encode([rank])) == [rank]


def test_scalar_lists_take_the_fast_path_and_are_still_copies():
    import numpy as np

    from savable_loader.dataset.values import freeze, from_plain, to_plain

    live = list(range(1000)) + [None, True, 1.5, "s", b"b"]
    frozen = freeze(live)
    assert frozen == live and frozen is not live
    live.append(7)
    assert len(frozen) == 1005  # later mutation of the live list does not reach the copy
    assert to_plain(frozen) == frozen and to_plain(frozen) is not frozen
    assert from_plain(frozen) == frozen and from_plain(frozen) is not frozen
    # subclasses of scalars (NumPy scalars) go through the element-wise path and keep their types
    mixed = freeze([1, np.int64(2), np.float32(0.5)])
    assert mixed == [1, 2, 0.5] and [type(x) for x in mixed] == [int, np.int64, np.float32]
