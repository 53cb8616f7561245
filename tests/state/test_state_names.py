"""Stable state names: a class may declare the name its state is saved under
(``__savable_name__``) and the names earlier versions saved it under
(``__savable_aliases__``); states made under an earlier name restore exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import savable_loader as sl
from savable_loader.dataset.base import config_fingerprint, type_name
from savable_loader.errors import ConfigMismatchError, LoaderUsageError, StateError
from savable_loader.state import decode, encode
from tests.common import RandomMapDataset, RangeSource, assert_streams


def _wc(num_workers: int = 0) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=5)


class OldMap(RandomMapDataset):
    """The map-style dataset as an earlier version named it."""


class NewMap(RandomMapDataset):
    """The same dataset, moved and renamed, knowing its earlier name."""

    __savable_aliases__ = (f"{__name__}.OldMap",)


class Unaware(RandomMapDataset):
    """Renamed without declaring the earlier name."""


def _drop_in(cls: type, num_workers: int = 0) -> sl.SavableDataLoader[Any]:
    return sl.SavableDataLoader(cls(11), batch_size=2, shuffle=True, seed=3, num_workers=num_workers)


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_a_drop_in_state_saved_under_an_earlier_name_restores_exactly(k: int) -> None:
    uninterrupted = _drop_in(OldMap)
    reference = [x for _ in range(2) for x in uninterrupted]
    loader = _drop_in(OldMap)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    state = decode(encode(loader.save_state_rank()))
    assert state.config.dataset_config["type"] == f"{__name__}.OldMap"
    fresh = _drop_in(NewMap, num_workers=2 if k == 3 else 0)
    fresh.restore_state_rank(state)
    rest = [x for _ in range(2) for x in fresh]
    assert_streams(head + rest[: len(reference) - k], reference, f"k={k}")
    with pytest.raises(ConfigMismatchError, match=r"dataset_config.type .*OldMap.*Unaware"):
        _drop_in(Unaware).restore_state_rank(state)


class OldRange(RangeSource):
    pass


class NewRange(RangeSource):
    __savable_aliases__ = (f"{__name__}.OldRange",)


class StableRange(RangeSource):
    __savable_name__ = "tests/stable-range"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pipeline_state_saved_under_an_earlier_name_restores_exactly(workers: int) -> None:
    wc = _wc(workers)

    def loader(cls: type) -> sl.SavableDataLoader[Any]:
        return sl.SavableDataLoader(
            sl.wrappers.MapDataset(cls(9, wc), lambda x: x * 2), batch_size=None, worker_config=wc
        )

    reference = list(loader(OldRange))
    old = loader(OldRange)
    it = iter(old)
    head = [next(it) for _ in range(4)]
    state = decode(encode(old.save_state_rank()))
    del it
    fresh = loader(NewRange)
    fresh.restore_state_rank(state)
    assert_streams(head + list(fresh), reference, f"workers={workers}")
    with pytest.raises(ConfigMismatchError, match="OldRange"):
        loader(StableRange).restore_state_rank(state)


def test_a_declared_name_is_what_the_state_and_the_fingerprint_hold() -> None:
    ds = StableRange(3, _wc())
    assert type_name(ds) == "tests/stable-range"
    assert ds.save_state().type == "tests/stable-range"
    moved = type("StableRange", (RangeSource,), {"__savable_name__": "tests/stable-range", "__module__": "elsewhere"})
    assert config_fingerprint(moved(3, _wc()).config_tree()) == config_fingerprint(ds.config_tree())
    # not inherited: a subclass is another class, saved under its own name
    sub = type("Sub", (StableRange,), {"__module__": "somewhere"})
    assert type_name(sub(3, _wc())) == "somewhere.Sub"
    with pytest.raises(StateError, match="saved by tests/stable-range, but the pipeline has somewhere.Sub"):
        sub(3, _wc()).restore_state(ds.save_state())


def test_the_fixtures_keep_their_module_names() -> None:
    # no declaration: the name stays module.QualName, as every earlier state holds it
    assert type_name(RangeSource(3, _wc())) == "tests.common.RangeSource"


def test_malformed_declarations_are_refused() -> None:
    for attrs, match in [
        ({"__savable_name__": ""}, "__savable_name__ must be a non-empty str"),
        ({"__savable_name__": 3}, "__savable_name__ must be a non-empty str"),
        ({"__savable_aliases__": "old.Name"}, "__savable_aliases__ must be a tuple of str"),
        ({"__savable_aliases__": (f"{__name__}.OldRange",)}, "which .*NewRange' lists too"),
    ]:
        cls = type("Bad", (RangeSource,), attrs)
        with pytest.raises(LoaderUsageError, match=match):
            type_name(cls(3, _wc()))


def _lines_class(module: str, **extra: Any) -> type:
    """A user's map-style ``TextLines``, as defined in ``module``."""

    def getitem(self: Any, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.randint(0, 1000, ()).item()])

    namespace = {"__module__": module, "__len__": lambda self: 20, "__getitem__": getitem, **extra}
    return type("TextLines", (torch.utils.data.Dataset,), namespace)


def test_a_moved_class_is_refused_naming_the_way_out_which_then_restores_exactly() -> None:
    """``__main__.TextLines`` moved to ``lines_train.TextLines``: the refusal names
    ``__savable_aliases__`` with the old name; declaring it resumes exactly."""
    make = lambda cls: sl.SavableDataLoader(cls(), batch_size=4, shuffle=True, seed=0)
    old = make(_lines_class("__main__"))
    reference = [b.tolist() for b in make(_lines_class("__main__"))]
    it = iter(old)
    next(it)
    state = decode(encode(old.save_state_rank()))
    moved = make(_lines_class("lines_train_moved"))
    with pytest.raises(sl.errors.ConfigMismatchError) as info:
        moved.restore_state_rank(state)
    message = str(info.value)
    assert "'__main__.TextLines'" in message and "'lines_train_moved.TextLines'" in message
    assert "declare __savable_aliases__ = ('__main__.TextLines',) in class TextLines" in message
    fixed = make(_lines_class("lines_train_fixed", __savable_aliases__=("__main__.TextLines",)))
    fixed.restore_state_rank(state)
    assert [b.tolist() for b in fixed] == reference[1:]
