"""Tests for savable_loader.dataset.base: SavableDataset save / encode / decode / restore."""

from __future__ import annotations

import contextlib
import hashlib
import io
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from savable_loader.config import WorkerConfig, _ActiveWorker, _Repetition
from savable_loader.dataset.base import SavableDataset, config_fingerprint, plain_config, type_name
from savable_loader.dataset.values import plain_dataset_state
from savable_loader.errors import LoaderUsageError, RestoreKeyError, StateError
from savable_loader.rng import derive_seed, seed_global
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import DatasetState
from tests.common import assert_same


def wc() -> WorkerConfig:
    return WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


class Source(SavableDataset):
    """A source with one field of every supported kind; each step advances all of them."""

    _savable_fields = ("pos", "history", "weights", "table", "rng", "meta")

    def __init__(self, worker_config: WorkerConfig, n: int = 10, scale: float = 1.0) -> None:
        super().__init__(worker_config)
        self.n = n
        self.scale = scale
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = 0
        self.history: list[Any] = []
        self.weights = torch.zeros(3, dtype=torch.bfloat16)
        self.table = np.zeros((2, 2), dtype=np.int64)
        self.rng = random.Random(1234)
        self.meta = {"name": "src", "tags": ["a", "b"], "blob": b"\x00\x01"}

    def step(self) -> Any:
        value = (self.pos, self.rng.random())
        self.pos += 1
        self.history.append([self.pos, self.rng.randrange(100)])
        self.weights += torch.tensor([0.5, 1.0, -2.0], dtype=torch.bfloat16)
        self.table[self.pos % 2, self.pos % 2] += self.pos
        self.meta["name"] += "!"
        return value

    def __iter__(self) -> Iterator[Any]:
        while self.pos < self.n:
            yield self.step()

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "scale": self.scale}


class Wrapper(SavableDataset):
    _savable_fields = ("count",)

    def __init__(self, worker_config: WorkerConfig, *inner: SavableDataset, fn: Any = None) -> None:
        super().__init__(worker_config)
        self.inner = list(inner)
        self.fn = fn
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.count = 0

    def children(self) -> Sequence[SavableDataset]:
        return self.inner

    def __iter__(self) -> Iterator[Any]:
        for item in self.inner[0]:
            self.count += 1
            yield item

    def config(self) -> dict[str, Any]:
        return {"fn": self.fn}


class Holder(SavableDataset):
    """Holds one arbitrary value in a savable field."""

    _savable_fields = ("value",)

    def __init__(self, worker_config: WorkerConfig, value: Any) -> None:
        super().__init__(worker_config)
        self.initial = value
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.value = self.initial

    def __iter__(self) -> Iterator[Any]:
        yield self.value

    def config(self) -> dict[str, Any]:
        return {}


def live_fields(ds: Source) -> dict[str, Any]:
    return {
        "pos": ds.pos,
        "history": [list(h) for h in ds.history],
        "weights": ds.weights.clone(),
        "table": ds.table.copy(),
        "rng": ds.rng.getstate(),
        "meta": {k: list(v) if isinstance(v, list) else v for k, v in ds.meta.items()},
    }


def assert_same_fields(ds: Source, expected: dict[str, Any]) -> None:
    assert ds.pos == expected["pos"] and type(ds.pos) is int
    assert ds.history == expected["history"]
    assert isinstance(ds.weights, torch.Tensor)
    assert ds.weights.dtype == torch.bfloat16 and ds.weights.shape == expected["weights"].shape
    assert torch.equal(ds.weights, expected["weights"])
    assert isinstance(ds.table, np.ndarray)
    assert ds.table.dtype == np.int64 and np.array_equal(ds.table, expected["table"])
    assert isinstance(ds.rng, random.Random)
    assert ds.rng.getstate() == expected["rng"]
    assert ds.meta == expected["meta"]


def encode_decode(state: DatasetState) -> DatasetState:
    return decode_part(encode_part(plain_dataset_state(state)), DatasetState)


# -- save / encode / decode / restore ---------------------------------------------------


def test_save_encode_decode_restore_gives_identical_fields() -> None:
    ds = Source(wc())
    for _ in range(3):
        ds.step()
    expected = live_fields(ds)
    state = ds.save_state()
    assert state.type == f"{__name__}.Source"
    assert sorted(state.fields) == sorted(Source._savable_fields)
    decoded = encode_decode(state)
    assert decoded.type == state.type

    restored = Source(wc())
    restored.restore_state(decoded)
    assert_same_fields(restored, expected)
    # and the two continue identically
    assert [ds.step() for _ in range(4)] == [restored.step() for _ in range(4)]
    assert_same_fields(restored, live_fields(ds))


def test_restore_without_encoding_gives_identical_fields() -> None:
    ds = Source(wc())
    ds.step()
    expected = live_fields(ds)
    state = ds.save_state()
    for _ in range(2):
        ds.step()
    ds.restore_state(state)
    assert_same_fields(ds, expected)


def test_iteration_continues_after_restore() -> None:
    ds = Source(wc(), n=8)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = encode_decode(ds.save_state())
    tail = list(it)
    other = Source(wc(), n=8)
    other.restore_state(state)
    assert list(other) == tail
    assert len(head) + len(tail) == 8


def test_saved_state_does_not_change_when_live_fields_mutate() -> None:
    ds = Source(wc())
    ds.step()
    state = ds.save_state()
    before = encode_part(plain_dataset_state(state))
    # mutate every live field in place
    ds.step()
    ds.history[0].append("mutated")
    ds.weights.mul_(3)
    ds.table[:] = 99
    ds.rng.random()
    ds.meta["name"] = "changed"
    ds.meta["blob"] = b"changed"
    assert encode_part(plain_dataset_state(state)) == before


def test_restored_fields_do_not_alias_the_state() -> None:
    ds = Source(wc())
    ds.step()
    state = ds.save_state()
    expected = live_fields(ds)
    for candidate in (state, encode_decode(state)):
        ds.restore_state(candidate)
        ds.weights.add_(1)
        ds.table += 1
        ds.history[0].append("x")
        ds.meta["name"] = "mutated"
        ds.restore_state(candidate)
        assert_same_fields(ds, expected)


def test_restore_none_resets_to_epoch_start() -> None:
    ds = Source(wc())
    fresh = live_fields(ds)
    ds.step()
    ds.restore_state(None)
    assert_same_fields(ds, fresh)


@pytest.mark.parametrize(
    "gen",
    [lambda: np.random.default_rng(3), lambda: np.random.RandomState(3), lambda: torch.Generator().manual_seed(3)],
    ids=["numpy-generator", "numpy-randomstate", "torch"],
)
def test_other_rng_fields_round_trip(gen) -> None:
    class RngHolder(SavableDataset):
        _savable_fields = ("g",)

        def __init__(self) -> None:
            super().__init__(wc())
            self.reset_state_own()

        def reset_state_own(self) -> None:
            self.g = gen()

        def draw(self) -> list[float]:
            if isinstance(self.g, torch.Generator):
                return torch.rand(3, generator=self.g).tolist()
            if isinstance(self.g, np.random.Generator):
                return self.g.random(3).tolist()
            return self.g.random_sample(3).tolist()

        def __iter__(self) -> Iterator[Any]:
            yield self.draw()

        def config(self) -> dict[str, Any]:
            return {}

    ds = RngHolder()
    ds.draw()
    state = encode_decode(ds.save_state())
    expected = ds.draw()
    other = RngHolder()
    other.restore_state(state)
    assert other.draw() == expected


@pytest.mark.parametrize(
    "value",
    [
        np.float64(1.5),
        np.int32(-4),
        np.bool_(True),
        np.str_("txt"),
        {"mean": np.float64(0.25), "n": [np.int64(3)]},
        (1, (2, 3)),
        {1: "int keys", "s": None},
        np.array(["a", "bc"]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
    ],
    ids=repr,
)
def test_values_come_back_with_their_types(value: Any) -> None:
    # issue #21: NumPy scalars used to come back as Python scalars, tuples as lists
    ds = Holder(wc(), value)
    for state in (ds.save_state(), encode_decode(ds.save_state())):
        other = Holder(wc(), None)
        other.restore_state(state)
        assert_same(other.value, value)


def test_tree_with_children_round_trips() -> None:
    a, b = Source(wc(), n=5), Source(wc(), n=6)
    top = Wrapper(wc(), a, b)
    a.step()
    b.step()
    b.step()
    top.count = 7
    expected_a, expected_b = live_fields(a), live_fields(b)
    state = encode_decode(top.save_state())
    assert state.type == f"{__name__}.Wrapper"
    assert [c.type for c in state.children] == [f"{__name__}.Source"] * 2
    assert state.fields == {"count": 7}

    a2, b2 = Source(wc(), n=5), Source(wc(), n=6)
    top2 = Wrapper(wc(), a2, b2)
    top2.restore_state(state)
    assert top2.count == 7
    assert_same_fields(a2, expected_a)
    assert_same_fields(b2, expected_b)


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, where",
    [
        (io.BytesIO(b"x"), "Holder.value"),
        (lambda x: x, "Holder.value"),
        (object(), "Holder.value"),
        ({1, 2}, "Holder.value"),
        ([1, [2, object()]], "Holder.value[1][1]"),
        ({"ok": 1, "bad": len}, "Holder.value['bad']"),
        ({(1, 2): "tuple key"}, "Holder.value"),
        ({True: "bool key"}, "Holder.value"),
        (np.array([None, 1], dtype=object), "Holder.value"),
        (np.array([1.0], dtype=np.longdouble), "Holder.value"),
        (bytearray(b"ab"), "Holder.value"),
        (torch.zeros(2, dtype=torch.float8_e4m3fn), "Holder.value"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_unsupported_field_value_raises_state_error_naming_the_field(value: Any, where: str) -> None:
    ds = Holder(wc(), value)
    with pytest.raises(StateError) as info:
        ds.save_state()
    assert where in str(info.value)


def test_open_file_field_raises_state_error(tmp_path: Path) -> None:
    with open(tmp_path / "f.txt", "w") as f:
        ds = Holder(wc(), f)
        with pytest.raises(StateError, match=r"state field Holder\.value holds a value of type TextIOWrapper"):
            ds.save_state()


def test_field_not_set_raises_state_error() -> None:
    class Forgetful(Holder):
        _savable_fields = ("value", "never_set")

    with pytest.raises(StateError, match=r"Forgetful\.never_set is listed in _savable_fields but not set"):
        Forgetful(wc(), 1).save_state()


def test_restore_wrong_type_name_raises_state_error() -> None:
    state = encode_decode(Source(wc()).save_state())
    wrong = DatasetState(type="other.module.Source", fields=state.fields, children=state.children)
    with pytest.raises(StateError, match=f"saved by other.module.Source, but the pipeline has {__name__}.Source"):
        Source(wc()).restore_state(wrong)
    with pytest.raises(StateError, match="saved by"):
        Holder(wc(), 1).restore_state(state)


@pytest.mark.parametrize(
    "fields",
    [
        {"pos": 1},
        {},
        {"pos": 1, "history": [], "weights": None, "table": None, "rng": None, "meta": {}, "extra": 1},
        {"pos": 1, "history": [], "weights": None, "table": None, "rng": None, "metadata": {}},
    ],
    ids=["missing", "empty", "extra", "renamed"],
)
def test_restore_wrong_field_set_raises_state_error(fields: dict[str, Any]) -> None:
    ds = Source(wc())
    ds.step()
    before = live_fields(ds)
    state = DatasetState(type=type_name(ds), fields=fields)
    with pytest.raises(StateError, match=r"state fields .* do not match _savable_fields"):
        ds.restore_state(state)
    assert_same_fields(ds, before)  # nothing was half-restored


def test_restore_wrong_child_count_raises_state_error() -> None:
    top = Wrapper(wc(), Source(wc()), Source(wc()))
    state = top.save_state()
    one_child = DatasetState(type=state.type, fields=state.fields, children=state.children[:1])
    with pytest.raises(StateError, match="state has 1 child states, the pipeline has 2"):
        top.restore_state(one_child)
    three = DatasetState(type=state.type, fields=state.fields, children=[*state.children, state.children[0]])
    with pytest.raises(StateError, match="state has 3 child states, the pipeline has 2"):
        top.restore_state(three)
    leaf_state = Source(wc()).save_state()
    with_child = DatasetState(type=leaf_state.type, fields=leaf_state.fields, children=[leaf_state])
    with pytest.raises(StateError, match="state has 1 child states, the pipeline has 0"):
        Source(wc()).restore_state(with_child)


def test_restore_wrong_child_type_raises_state_error() -> None:
    top = Wrapper(wc(), Source(wc()))
    state = Wrapper(wc(), Holder(wc(), 1)).save_state()
    with pytest.raises(StateError, match=f"saved by {__name__}.Holder, but the pipeline has {__name__}.Source"):
        top.restore_state(state)


@pytest.mark.parametrize("bad", [{"type": "x"}, "state", 3, [1]], ids=repr)
def test_restore_non_state_raises_state_error(bad: Any) -> None:
    with pytest.raises(StateError, match="restore_state needs a DatasetState"):
        Source(wc()).restore_state(bad)


def test_restore_bad_rng_value_raises_state_error() -> None:
    state = Source(wc()).save_state()
    fields = dict(state.fields)
    fields["rng"] = {"kind": "torch", "device": "cpu", "state": b"\x00"}
    with pytest.raises(StateError, match="RNG state kind is 'torch'"):
        Source(wc()).restore_state(DatasetState(type=state.type, fields=fields))


# -- configuration ----------------------------------------------------------------------


def test_config_tree() -> None:
    top = Wrapper(wc(), Source(wc(), n=3, scale=0.5), Source(wc(), n=4), fn=len)
    assert top.config_tree() == {
        "type": f"{__name__}.Wrapper",
        "fn": "builtins.len",
        "children": [
            {"type": f"{__name__}.Source", "n": 3, "scale": 0.5},
            {"type": f"{__name__}.Source", "n": 4, "scale": 1.0},
        ],
    }
    assert Source(wc()).config_tree() == {"type": f"{__name__}.Source", "n": 10, "scale": 1.0}


def test_plain_config_values() -> None:
    def local_fn() -> None: ...

    assert plain_config({"b": b"\x01\xff", "t": (1, [2]), 3: None, "f": local_fn, "l": lambda: 0, "o": object()}) == {
        "b": "01ff",
        "t": [1, [2]],
        "3": None,
        "f": f"{__name__}.test_plain_config_values.<locals>.local_fn",
        "l": f"{__name__}.test_plain_config_values.<locals>.<lambda>",
        "o": "<builtins.object>",
    }


def test_config_fingerprint_is_stable_and_order_independent() -> None:
    a = Wrapper(wc(), Source(wc(), n=3), fn=len).config_tree()
    b = Wrapper(wc(), Source(wc(), n=3), fn=len).config_tree()
    assert config_fingerprint(a) == config_fingerprint(b)
    fp = config_fingerprint(a)
    assert isinstance(fp, str) and len(fp) == 24 and int(fp, 16) >= 0
    assert config_fingerprint({"x": 1, "y": 2}) == config_fingerprint({"y": 2, "x": 1})


@pytest.mark.parametrize(
    "other",
    [
        lambda: Wrapper(wc(), Source(wc(), n=4), fn=len),
        lambda: Wrapper(wc(), Source(wc(), n=3, scale=2.0), fn=len),
        lambda: Wrapper(wc(), Source(wc(), n=3), fn=max),
        lambda: Wrapper(wc(), Source(wc(), n=3), Source(wc(), n=3), fn=len),
        lambda: Wrapper(wc(), Holder(wc(), 1), fn=len),
        lambda: Source(wc(), n=3),
    ],
)
def test_config_fingerprint_changes_with_config(other) -> None:
    base = config_fingerprint(Wrapper(wc(), Source(wc(), n=3), fn=len).config_tree())
    assert config_fingerprint(other().config_tree()) != base


def test_config_fingerprint_is_pinned() -> None:
    """The digest of the sorted MessagePack of the plain config: the same in every process and run."""
    config = {"n": 3, "names": ["a", "b"], "nested": {"z": 1.5, "a": None}, "blob": b"\x00"}
    sorted_plain = {"blob": "00", "n": 3, "names": ["a", "b"], "nested": {"a": None, "z": 1.5}}
    expected = hashlib.blake2b(msgspec.msgpack.encode(sorted_plain), digest_size=12).hexdigest()
    assert config_fingerprint(config) == expected == "77f4e60c3650b7213b2a7e00"


# -- construction -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, 0, {"rank": 0}, "wc"], ids=repr)
def test_worker_config_must_be_a_worker_config(bad: Any) -> None:
    with pytest.raises(LoaderUsageError, match=r"Source needs worker_config=WorkerConfig\(...\), got"):
        Source(bad)


def test_type_name() -> None:
    assert type_name(Source(wc())) == f"{__name__}.Source"
    assert type_name(3) == "builtins.int"


class Grown(Holder):
    """A Holder that gained an optional field after its states were first written."""

    _savable_fields = ("value", "added")
    _savable_optional = frozenset({"added"})

    def reset_state_own(self) -> None:
        super().reset_state_own()
        self.added = "default"


def test_optional_field_missing_from_an_older_state_keeps_its_reset_value() -> None:
    old = encode_decode(Holder(wc(), 5).save_state())
    old = DatasetState(type=f"{__name__}.Grown", fields=old.fields)
    ds = Grown(wc(), 0)
    ds.added = "changed"
    ds.restore_state(old)
    assert (ds.value, ds.added) == (5, "default")
    new = encode_decode(Grown(wc(), 7).save_state())
    assert new.fields == {"value": 7, "added": "default"}


def test_a_missing_field_that_is_not_optional_is_still_refused() -> None:
    state = DatasetState(type=f"{__name__}.Grown", fields={"added": "x"})
    with pytest.raises(StateError, match=r"state fields \['added'\] do not match _savable_fields"):
        Grown(wc(), 0).restore_state(state)


# -- restore keys ---------------------------------------------------------------------------


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_mark_sample_seeds_from_the_key_value() -> None:
    # a tuple key comes back from a state as a tuple, a list key as a list: both seed alike
    ds = Source(wc())
    ds.mark_sample((3, "a"))
    first = draws()
    ds.mark_sample([3, "a"])
    assert draws() == first
    ds.mark_sample([3, "b"])
    assert draws() != first
    seed_all(5)
    expected = draws()
    seed_all(5)
    ds.mark_sample(None)  # no key: the RNGs are left as they are
    assert ds.sample_key is None and draws() == expected


@pytest.mark.parametrize(
    "key", [7, -3, [3, 12345, 0], (1, "a"), ["été", [1, 2.5], {"k": None}], True, "x", 1.5, {"b": [2]}]
)
def test_mark_sample_seed_is_the_key_formula_in_every_epoch_and_pass(key: Any) -> None:
    # the prefix mark_sample keeps per class, epoch and pass gives the documented seed:
    # derive_seed(seed, "key", epoch, *passes, class name, JSON text of the key)
    ds = Source(WorkerConfig(rank=0, world_size=1, num_workers=0, seed=11))
    text = msgspec.json.encode(key).decode()
    for epoch, passes in ((0, ()), (3, ()), (3, (2,)), (0, ()), (3, (2, 1))):
        with _ActiveWorker(0, epoch), contextlib.ExitStack() as stack:
            for n in passes:
                stack.enter_context(_Repetition(n))
            ds.mark_sample(key)
            got = draws()
        seed_global(derive_seed(11, "key", epoch, *passes, "Source", text))
        assert got == draws(), (epoch, passes)


def test_mark_sample_prefixes_stay_bounded_and_right_over_many_epochs() -> None:
    from savable_loader.dataset import base as D

    ds = Source(WorkerConfig(rank=0, world_size=1, num_workers=0, seed=2))
    for epoch in [*range(D._MAX_PREFIXES + 40), 3]:
        with _ActiveWorker(0, epoch):
            ds.mark_sample([epoch])
            got = draws()
        seed_global(derive_seed(2, "key", epoch, "Source", f"[{epoch}]"))
        assert got == draws(), epoch
        assert len(D._KEY_PREFIXES) <= D._MAX_PREFIXES


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize(
    "key, shown",
    [
        (np.int64(3), "numpy.int64"),
        ([1, np.int32(2)], "builtins.list"),
        ({None: 1}, "builtins.dict"),
        ("\ud800", "builtins.str"),
        (torch.tensor(1), "torch.Tensor"),
    ],
    ids=["numpy-int", "numpy-inside", "none-dict-key", "lone-surrogate", "tensor"],
)
def test_mark_sample_refuses_a_key_that_is_not_a_json_value(key: Any, shown: str) -> None:
    ds = Source(wc())
    with pytest.raises(RestoreKeyError) as info:
        ds.mark_sample(key)
    message = str(info.value)
    assert message.startswith(f"Source.mark_sample: restore key {key!r} of type {shown} is not a JSON value")
    assert "int() / float()" in message
