"""savable_loader.dataset.values: what a dataset state gives back, type by type (issue #21).

Every value a state holds comes back with its type, dtype and value, through both paths
a restore takes: the frozen snapshot itself (a dataset-level ``save_state`` /
``restore_state``) and its encoded form (``to_plain``, MessagePack, ``from_plain``).
Everything that could not come back identical is refused when the state is taken, with
the field's path; an int outside MessagePack's range is refused when it is encoded,
with the path too.
"""

from __future__ import annotations

import array
import collections
import enum
import math
import random
import struct
from typing import Any

import numpy as np
import pytest
import torch

from savable_loader.dataset.values import freeze, from_plain, numpy_dtype_code, to_plain
from savable_loader.errors import StateError
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import ARRAY_TYPECODES, ArrayValue, DatasetState, TupleValue
from tests.common import assert_same

NUMERIC = [
    np.bool_,
    np.int8,
    np.uint8,
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


def round_trips(value: Any) -> list[Any]:
    """``value`` back from a frozen state and from an encoded one."""
    frozen = freeze(value, "T.f")
    encoded = encode_part(DatasetState(type="m.T", fields={"f": to_plain(frozen)}))
    decoded = decode_part(encoded, DatasetState).fields["f"]
    return [from_plain(frozen), from_plain(decoded)]


def check_round_trip(value: Any) -> None:
    for i, back in enumerate(round_trips(value)):
        assert_same(back, value, f"{'encoded' if i else 'frozen'} {value!r}")


# -- NumPy scalars ----------------------------------------------------------------------


def extreme_scalars(kind: type) -> list[Any]:
    if kind is np.bool_:
        return [np.bool_(True), np.bool_(False)]
    if np.issubdtype(kind, np.integer):
        info = np.iinfo(kind)
        return [kind(info.min), kind(info.max), kind(0)]
    if np.issubdtype(kind, np.complexfloating):
        return [kind(complex(1.5, -2.25)), kind(complex(float("nan"), float("-inf")))]
    return [kind(0.1), kind(-0.0), kind(float("inf")), kind(float("nan")), kind(np.finfo(kind).tiny)]


@pytest.mark.parametrize("kind", NUMERIC, ids=lambda k: np.dtype(k).name)
def test_numpy_scalars_keep_type_and_bits(kind: type) -> None:
    for value in extreme_scalars(kind):
        check_round_trip(value)
        check_round_trip([value, {"x": (value,)}])


@pytest.mark.parametrize(
    "value",
    [
        np.str_("héllo ✓"),
        np.str_(""),
        np.str_("a\x00"),
        np.str_("\ud800 lone surrogate"),
        np.bytes_(b"\x00raw\xff"),
        np.bytes_(b""),
        np.datetime64("2020-02-29T12:34:56.789", "ns"),
        np.datetime64("NaT"),
        np.datetime64("1969-12-31", "D"),
        np.timedelta64(-5, "10s"),
        np.timedelta64("NaT"),
        np.timedelta64(3, "W"),
    ],
    ids=repr,
)
def test_numpy_string_and_time_scalars_keep_type_and_value(value: Any) -> None:
    check_round_trip(value)


@pytest.mark.parametrize("kind", NUMERIC, ids=lambda k: np.dtype(k).name)
def test_zero_dimensional_arrays_stay_arrays(kind: type) -> None:
    value = np.array(extreme_scalars(kind)[0])
    assert value.shape == ()
    check_round_trip(value)


def test_scalars_and_zero_dimensional_arrays_are_distinguished() -> None:
    frozen = to_plain(freeze([np.float32(1.5), np.array(1.5, dtype=np.float32)]))
    assert [v.library for v in frozen] == ["numpy-scalar", "numpy"]
    assert frozen[0] == ArrayValue(library="numpy-scalar", dtype="float32", shape=(), data=b"\x00\x00\xc0?")


# -- arrays -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # not contiguous: comes back contiguous
        np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.arange(4, dtype=">i4"),  # big-endian stays big-endian
        np.array([1.5, -2.0], dtype=">f8"),
        np.array(["a", "bcd", ""]),
        np.array(["x"], dtype=">U3"),
        np.array([b"ab", b"\x00c"]),
        np.array(["2020-01-01", "NaT"], dtype="datetime64[D]"),
        np.array([1, -2], dtype="timedelta64[ms]"),
        np.zeros((0, 3), dtype=np.complex64),
        np.zeros((2, 0, 1), dtype=np.uint16),
    ],
    ids=lambda a: f"{a.dtype.str}{a.shape}",
)
def test_arrays_keep_dtype_shape_and_values(value: np.ndarray) -> None:
    check_round_trip(value)
    for back in round_trips(value):
        assert back.flags.c_contiguous and back.flags.writeable and back.flags.owndata


def test_read_only_arrays_come_back_writeable_copies() -> None:
    value = np.arange(3)
    value.flags.writeable = False
    for back in round_trips(value):
        assert back.flags.writeable and np.array_equal(back, value)


@pytest.mark.parametrize(
    "dtype, code",
    [
        ("float32", "float32"),
        (">i2", ">int16"),
        ("<U3", "U3"),
        (">U2", ">U2"),
        ("S5", "S5"),
        ("?", "bool"),
        ("datetime64[ns]", "datetime64[ns]"),
        ("m8[25s]", "timedelta64[25s]"),
        ("M8", "datetime64"),
        ("f16", None),
        ("c32", None),
        ("O", None),
        ("V4", None),
        ([("a", "i4")], None),
    ],
)
def test_numpy_dtype_codes(dtype: Any, code: str | None) -> None:
    assert numpy_dtype_code(np.dtype(dtype)) == code


# -- tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(3.25, dtype=torch.float64),
        torch.tensor([[1, 2], [3, 4]], dtype=torch.int16).t(),  # strided: comes back contiguous
        torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64).conj(),  # conjugation resolved
        torch.tensor([0.5, float("nan")], dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.zeros(0, 2, dtype=torch.uint32),
        torch.tensor([2**63 + 5], dtype=torch.uint64),
    ],
    ids=lambda t: f"{t.dtype}{tuple(t.shape)}",
)
def test_tensors_keep_dtype_shape_and_values(value: torch.Tensor) -> None:
    check_round_trip(value)
    for back in round_trips(value):
        assert back.is_contiguous() and not back.is_conj()


# -- containers and scalars ----------------------------------------------------------------


def test_tuples_stay_tuples_at_every_depth() -> None:
    value = (1, (2, [3, (4.5, "s")]), {"k": ((), (None,))}, [(b"x", np.int16(7), torch.ones(1))], ())
    check_round_trip(value)
    plain = to_plain(freeze(value))
    assert isinstance(plain, TupleValue) and isinstance(plain.items[1], TupleValue)


def test_python_scalars_and_dicts_come_back_exact() -> None:
    value = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -(2**63), 2**64 - 1],
        "float": -0.0,
        "nan": float("nan"),
        "inf": -math.inf,
        "str": "ünïcode",
        "bytes": b"\x00\xff",
        7: "int key",
        "nested": {"a": [{"b": ()}]},
    }
    check_round_trip(value)


def test_fast_path_lists_and_tuples_are_copies() -> None:
    live = [1, 2.5, "x", None]
    frozen = freeze(live)
    live.append(3)
    assert frozen == [1, 2.5, "x", None]
    assert from_plain(frozen) is not frozen


def test_dict_key_order_is_kept() -> None:
    value = {"b": 1, "a": 2, 3: 3, "c": {"z": 0, "y": 1}}
    for back in round_trips(value):
        assert list(back) == ["b", "a", 3, "c"] and list(back["c"]) == ["z", "y"]


def test_aliasing_is_not_kept() -> None:
    shared = [1, 2]
    tensor = torch.zeros(3)
    for back in round_trips([shared, shared, tensor, tensor[1:]]):
        assert back[0] == back[1] and back[0] is not back[1]
        back[2][1] = 5.0
        assert back[3][0] == 0.0  # views become independent tensors


def test_random_nested_values_round_trip() -> None:
    rng = random.Random(0)
    leaves = [
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: rng.random(),
        lambda: str(rng.random()),
        lambda: np.float32(rng.random()),
        lambda: np.uint8(rng.randrange(256)),
        lambda: np.str_("s"),
        lambda: torch.randn(2, generator=torch.Generator().manual_seed(rng.randrange(99))),
        lambda: np.arange(rng.randrange(4), dtype=np.int16),
        lambda: None,
        lambda: b"b",
    ]

    def build(depth: int) -> Any:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(leaves)()
        kind = rng.randrange(3)
        items = [build(depth - 1) for _ in range(rng.randrange(4))]
        if kind == 0:
            return items
        if kind == 1:
            return tuple(items)
        return {f"k{i}": v for i, v in enumerate(items)}

    for _ in range(200):
        check_round_trip(build(4))


# -- refusals ----------------------------------------------------------------------------


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "value, message",
    [
        (Point(1, 2), "Point.*namedtuple"),
        (collections.OrderedDict(a=1), "OrderedDict.*subclass of dict"),
        (collections.defaultdict(list), "defaultdict.*subclass of dict"),
        (Colour.RED, "Colour.*subclass of int"),
        (Name("x"), "Name.*subclass of str"),
        (bytearray(b"ab"), "bytearray.*store bytes"),
        ({1, 2}, "set"),
        (frozenset(), "frozenset"),
        (1 + 2j, "complex"),
        (np.longdouble(1), "longdouble"),
        (np.clongdouble(1), "clongdouble"),
        (np.void(b"ab"), "void"),
        (np.array([1.0], dtype=np.longdouble), "array of dtype float128"),
        (np.array([object()]), "array of dtype object"),
        (np.zeros(2, dtype=[("a", "i4")]), "array of dtype"),
        (np.ma.masked_array([1, 2]), "MaskedArray.*subclass of numpy.ndarray"),
        (torch.nn.Parameter(torch.zeros(2)), "Parameter.*subclass of torch.Tensor"),
        (torch.zeros(2, requires_grad=True), "requires grad"),
        (torch.zeros(2).to_sparse(), "layout torch.sparse_coo"),
        (torch.zeros(2, device="meta"), "tensor on meta"),
        (torch.zeros(2, dtype=torch.float8_e4m3fn), "dtype torch.float8_e4m3fn"),
        ({Name("k"): 1}, "dict key 'k' of type Name"),
        ({np.str_("k"): 1}, "dict key"),
        ({True: 1}, "dict key True of type bool"),
        ({(1, 2): 1}, "dict key"),
        ([random.Random(0)], "RNG object inside a container"),
        (lambda: 0, "function"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__qualname__,
)
def test_values_that_would_change_are_refused_naming_the_field(value: Any, message: str) -> None:
    with pytest.raises(StateError, match=message) as info:
        freeze({"ok": [1, (2, value)]}, "Holder.field")
    assert "Holder.field['ok'][1][1]" in str(info.value)


def test_rng_object_as_a_whole_field_is_captured() -> None:
    frozen = freeze(np.random.default_rng(3), "H.rng")
    assert frozen["kind"] == "numpy-generator"


@pytest.mark.parametrize("big", [2**64, -(2**63) - 1, 10**30])
def test_int_out_of_range_is_refused_when_encoded_naming_the_field(big: int) -> None:
    frozen = freeze({"buffer": [0, [1, big]]}, "ShuffleBufferDataset.buffer")
    assert from_plain(frozen) == {"buffer": [0, [1, big]]}  # in memory it is exact
    node = DatasetState(
        type="savable_loader.wrappers.shuffle_buffer.ShuffleBufferDataset", fields={"buffer": to_plain(frozen)}
    )
    with pytest.raises(StateError, match=r"at ShuffleBufferDataset\.buffer\['buffer'\]\[1\]\[1\] \(integers"):
        encode_part(node)


def test_lone_surrogate_in_a_str_is_refused_when_encoded_naming_the_field() -> None:
    node = DatasetState(type="m.Outer", children=[DatasetState(type="m.Inner", fields={"f": ["ok", "\ud800"]})])
    with pytest.raises(StateError, match=r"surrogates not allowed at Inner\.f\[1\]"):
        encode_part(node)


def test_encode_error_of_a_rank_state_names_the_worker_and_the_field() -> None:
    from savable_loader.state import LoaderConfig, PipelinePosition, RankState, WorkerState, encode

    inner = DatasetState(type="m.Source", fields={"pos": 2**70})
    outer = DatasetState(type="m.ShuffleBufferDataset", fields={"buffer": [1]}, children=[inner])
    state = RankState(
        config=LoaderConfig(
            rank=0,
            world_size=1,
            num_workers=2,
            seed=0,
            batch_size=None,
            shuffle=False,
            drop_last=False,
            dataset_fingerprint="f",
        ),
        position=PipelinePosition(
            epoch=0,
            next_worker=0,
            workers=[
                WorkerState(worker_id=0, index=1, snapshot_index=1, dataset=DatasetState(type="m.Other")),
                WorkerState(worker_id=1, index=1, snapshot_index=1, dataset=outer),
            ],
        ),
    )
    with pytest.raises(StateError, match=r"at position\.workers\[1\]\.dataset: Source\.pos \(integers"):
        encode(state)


# -- big lists of scalars (checked once per snapshot) and array.array ---------------------


class Level(enum.IntEnum):
    LOW = 1


BIG = 1000  # longer than the lists checked by a sample and a count


def bits(values: list[Any]) -> list[tuple[type, Any]]:
    return [(type(v), struct.pack("<d", v) if type(v) is float else v) for v in values]


@pytest.mark.parametrize(
    "values",
    [
        [True, False] * (BIG // 2),
        list(range(BIG)) + [True] + list(range(BIG)),  # one bool among ints, not in the sample
        [True] + list(range(BIG)),
        [2**63 - 1, -(2**63), 2**63, 2**64 - 1, 0] * (BIG // 5),
        [math.nan, -0.0, 0.0, math.inf, -math.inf, struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]] * BIG,
        [None, 1, 1.0, "1", b"1", False] * BIG,
        [],
        [[]] * BIG,
        [list(range(BIG)), [1.5] * BIG, []],
    ],
    ids=["bools", "int-bool-int", "bool-first", "int64-bounds", "float-bits", "mixed", "empty", "empties", "nested"],
)
def test_big_lists_of_scalars_keep_types_and_bits(values: list[Any]) -> None:
    for back in round_trips(values):
        assert type(back) is list and len(back) == len(values)
        if values and type(values[0]) is list:
            assert [bits(x) for x in back] == [bits(x) for x in values]
            assert all(type(x) is list for x in back)
        else:
            assert bits(back) == bits(values)


@pytest.mark.parametrize("where", [0, 1, 500, BIG - 1])
def test_an_int_subclass_anywhere_in_a_big_list_is_refused(where: int) -> None:
    values: list[Any] = list(range(BIG))
    values[where] = Level.LOW
    with pytest.raises(StateError, match=rf"ShuffleBufferDataset\.buffer\[{where}\] holds a value of type Level"):
        freeze(values, "ShuffleBufferDataset.buffer")


@pytest.mark.parametrize("big", [2**64, -(2**63) - 1])
def test_an_int_beyond_64_bits_in_a_big_list_is_refused_when_encoded(big: int) -> None:
    values = [*range(BIG), big]
    node = DatasetState(type="m.ShuffleBufferDataset", fields={"buffer": to_plain(freeze(values, "b"))})
    with pytest.raises(StateError, match=rf"at ShuffleBufferDataset\.buffer\[{BIG}\] \(integers"):
        encode_part(node)


def test_a_big_list_mutated_after_the_snapshot_does_not_change_it() -> None:
    live = list(range(BIG))
    frozen = freeze(live, "T.f")
    live[0], live[-1] = live[-1], live[0]
    live.pop()
    live.append(Level.LOW)
    for back in (from_plain(frozen), from_plain(to_plain(frozen))):
        assert back == list(range(BIG)) and type(back) is list
    assert type(to_plain(frozen)) is list and to_plain(frozen) is not to_plain(frozen)


@pytest.mark.parametrize("typecode", sorted(ARRAY_TYPECODES))
def test_array_array_keeps_typecode_and_bits(typecode: str) -> None:
    if typecode in "fd":
        items: list[Any] = [0.5, -0.0, math.inf, -math.inf, math.nan, 1e-30]
    else:
        size = ARRAY_TYPECODES[typecode] * 8
        low, high = (
            (0, 2**size - 1) if typecode.isupper() or typecode == "B" else (-(2 ** (size - 1)), 2 ** (size - 1) - 1)
        )
        items = [low, high, 0, 1, low + 1]
    for value in (array.array(typecode, items), array.array(typecode)):
        for back in round_trips(value):
            assert type(back) is array.array and back.typecode == typecode
            assert back.tobytes() == value.tobytes() and back is not value
    live = array.array(typecode, items)
    frozen = freeze(live, "T.f")
    live[0] = live[1]
    assert from_plain(frozen).tobytes() == array.array(typecode, items).tobytes()


class Row(array.array):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (array.array("l", [1]), "typecode 'l'"),
        (array.array("u", "ab"), "typecode 'u'"),
        (Row("q", [1]), "type Row.*typecode 'q'"),
    ],
    ids=["l", "u", "subclass"],
)
def test_array_array_of_other_typecodes_is_refused_naming_the_field(value: Any, message: str) -> None:
    with pytest.raises(StateError, match=rf"state field T\.f\[0\] holds .*{message}"):
        freeze([value], "T.f")


def test_a_million_ints_round_trip() -> None:  # (the time is in bench/bench_shuffle_restore.py)
    values = list(range(-500_000, 500_000))
    back = round_trips(values)
    assert back[0] == values and back[1] == values
    packed = array.array("q", values)
    assert round_trips(packed)[1].tobytes() == packed.tobytes()
