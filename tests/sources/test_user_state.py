"""A dataset's own state_dict() in a savable_loader state (sources/_user_state.py): what
it returned comes back equal and of the same types after encoding; what a state cannot
hold exactly is refused, naming the path."""

from __future__ import annotations

import enum
import random
from typing import Any

import numpy as np
import pytest
import torch

from savable_loader.dataset.values import freeze, from_plain, plain_dataset_state
from savable_loader.errors import StateError
from savable_loader.sources._user_state import TAG, from_state_tree, to_state_tree
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import DatasetState


def round_trip(value: Any) -> Any:
    """``value`` through the conversion, a snapshot's freeze and the MessagePack encoding."""
    frozen = freeze(to_state_tree(value, "state_dict()"), "user_state")
    data = encode_part(plain_dataset_state(DatasetState(type="t", fields={"s": frozen})))
    return from_state_tree(from_plain(decode_part(data, DatasetState).fields["s"]))


def same(a: Any, b: Any) -> None:
    assert type(a) is type(b), f"{type(a)} vs {type(b)}"
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b) and a.tobytes() == b.tobytes()
    else:
        assert a == b or (a != a and b != b)


VALUES = [
    pytest.param({"pos": 3, "name": "x", "done": False, "none": None, "f": 0.1, "b": b"\x00"}, id="scalars"),
    pytest.param(random.Random(7).getstate(), id="random-getstate"),
    pytest.param(np.random.default_rng(3).bit_generator.state, id="pcg64-bigints"),
    pytest.param(np.random.RandomState(2).get_state(), id="randomstate-tuple-with-array"),
    pytest.param({"g": torch.Generator().manual_seed(5).get_state()}, id="torch-generator-state"),
    pytest.param({1: [(), (1, (2, [3]))], "t": torch.arange(6).reshape(2, 3)[:, 1]}, id="nested-int-keys"),
    pytest.param({"s": np.int64(-3), "f": np.float32(1.5), "z": np.asarray(2.0), "c": np.complex64(1j)}, id="numpy"),
    pytest.param({TAG: "tuple", "value": [1]}, id="a-dict-that-looks-tagged"),
    pytest.param({"big": 2**70, "neg": -(2**63), "max": 2**64 - 1, "ba": bytearray(b"ab")}, id="ints-bytearray"),
    pytest.param({"nan": float("nan"), "inf": float("-inf")}, id="floats"),
    pytest.param(None, id="none"),
]


@pytest.mark.parametrize("value", VALUES)
def test_round_trip_keeps_values_and_types(value):
    same(round_trip(value), value)


def test_restored_rng_states_load_into_generators():
    rng = random.Random(1)
    rng.random()
    again = random.Random()
    again.setstate(round_trip(rng.getstate()))
    assert again.random() == rng.random()
    g = np.random.default_rng(9)
    g.random()
    h = np.random.default_rng()
    h.bit_generator.state = round_trip(g.bit_generator.state)
    assert h.random() == g.random()


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("value", "path", "what"),
    [
        ({"a": [1, {"b": object()}]}, r"state_dict\(\)\['a'\]\[1\]\['b'\]", "builtins.object"),
        ({"s": {1, 2}}, r"state_dict\(\)\['s'\]", "builtins.set"),
        ({"e": Color.RED}, r"state_dict\(\)\['e'\]", "Color"),
        ({"g": torch.Generator()}, r"state_dict\(\)\['g'\]", "torch._C.Generator"),
        ({"u": np.str_("x")}, r"state_dict\(\)\['u'\]", "numpy.str_"),
    ],
)
def test_what_a_state_cannot_hold_is_refused_naming_the_path(value, path, what):
    with pytest.raises(StateError, match=rf"^{path} is a \S*{what}, which a savable_loader state cannot hold exactly"):
        to_state_tree(value, "state_dict()")


@pytest.mark.parametrize("key", [(1, 2), 1.5, None, True])
def test_dict_keys_must_be_str_or_int(key):
    with pytest.raises(StateError, match=r"state_dict\(\)\['x'\] has the dict key"):
        to_state_tree({"x": {key: 1}}, "state_dict()")


def test_conversion_copies_live_values():
    live = {"t": torch.zeros(2), "a": np.zeros(2), "l": [1]}
    tree = to_state_tree(live, "s")
    live["t"] += 1
    live["a"] += 1
    live["l"].append(2)
    assert tree["t"].tolist() == [0, 0] and tree["a"].tolist() == [0, 0] and tree["l"] == [1]


def test_malformed_tags_are_state_errors():
    with pytest.raises(StateError, match="malformed tagged value"):
        from_state_tree({TAG: "tuple", "value": 3})
    with pytest.raises(StateError, match="malformed tagged value"):
        from_state_tree({TAG: "pickle", "value": b""})
