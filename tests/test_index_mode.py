"""savable_loader._index_mode: the drop-in path's bookkeeping (epoch and samples yielded),
its state and the configuration checks of a restore."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils.data import default_collate

from savable_loader._index_mode import IndexMode, check_dataset_config, map_dataset_config
from savable_loader._permutation import ORDER_FEISTEL, ORDER_LEGACY
from savable_loader.errors import ConfigMismatchError, RestoreKeyError
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import IndexPosition
from tests.common import RandomMapDataset

pytestmark = pytest.mark.timeout(60)


def mode(dataset=None, **kw) -> IndexMode:
    kw = {"seed": 5, "shuffle": True, "rank": 0, "world_size": 1, "batch_size": 4, "drop_last": False, **kw}
    return IndexMode(RandomMapDataset(10) if dataset is None else dataset, collate_fn=default_collate, **kw)


def pos(epoch: int, consumed: int, dataset_len: int = 10) -> IndexPosition:
    return IndexPosition(epoch=epoch, consumed=consumed, dataset_len=dataset_len)


# -- iteration and save -------------------------------------------------------------------


def test_save_follows_the_items_and_normalizes_a_finished_epoch():
    m = mode()
    assert m.save() == pos(0, 0)
    assert m.begin() is False
    assert (m.sampler.epoch, m.sampler.start) == (0, 0)
    assert m.save() == pos(0, 0)
    item = object()
    assert m.on_item(item) is item  # items pass through unchanged
    assert m.save() == pos(0, 4)
    m.on_item(None)
    assert m.save() == pos(0, 8)
    m.on_item(None)  # the last, short batch: 10 of 10 yielded
    assert m.save() == pos(1, 0)  # a finished epoch saves as the start of the next
    m.end()
    assert m.epoch == 1 and m.current is None
    assert m.save() == pos(1, 0)
    assert m.begin() is False
    assert (m.sampler.epoch, m.sampler.start) == (1, 0)
    m.on_item(None)
    assert m.save() == pos(1, 4)


def test_finished_epoch_with_drop_last_and_unbatched():
    m = mode(batch_size=4, drop_last=True)  # 2 batches of 4, 2 samples dropped
    m.begin()
    m.on_item(None)
    assert m.save() == pos(0, 4)
    m.on_item(None)
    assert m.save() == pos(1, 0)
    u = mode(batch_size=None)
    u.begin()
    for k in range(1, 10):
        u.on_item(None)
        assert u.save() == pos(0, k)
    u.on_item(None)
    assert u.save() == pos(1, 0)


def test_abandoned_epoch_counts_as_ended():
    m = mode()
    m.begin()
    m.on_item(None)
    m.end()  # the iteration was abandoned mid-epoch
    assert m.save() == pos(1, 0)
    assert m.begin() is False and m.sampler.epoch == 1


def test_restore_sets_the_next_iteration():
    m = mode()
    m.restore(pos(3, 8))
    assert m.save() == pos(3, 8)  # before iterating: the restored position
    assert m.save() == pos(3, 8)
    assert m.begin() is True
    assert (m.sampler.epoch, m.sampler.start) == (3, 8)
    assert list(m.sampler) == list(m.plan.batches(3, 0))[2:]
    assert m.save() == pos(3, 8)
    m.on_item(None)
    assert m.save() == pos(4, 0)
    m.end()
    assert m.begin() is False  # resumed only once
    assert (m.sampler.epoch, m.sampler.start) == (4, 0)


def test_restore_at_epoch_end_saves_as_next_epoch():
    m = mode()
    m.restore(pos(2, 10))
    assert m.save() == pos(3, 0)
    assert m.begin() is True and len(list(m.sampler)) == len(m.sampler) > 0  # epoch 3, whole
    assert m.sampler.epoch == 3
    m.end()
    assert m.epoch == 4


def test_position_round_trips_through_encoding():
    m = mode()
    m.begin()
    m.on_item(None)
    saved = m.save()
    fresh = mode()
    fresh.restore(decode_part(encode_part(saved), IndexPosition))
    fresh.begin()
    assert (fresh.sampler.epoch, fresh.sampler.start) == (0, 4)


def test_loader_config_records_the_configuration():
    m = mode(rank=1, world_size=3, batch_size=2, drop_last=True, seed=9, shuffle=False)
    c = m.loader_config(4)
    assert (c.rank, c.world_size, c.num_workers, c.seed, c.batch_size, c.shuffle, c.drop_last) == (
        1, 3, 4, 9, 2, False, True)
    assert c.dataset_config == {"type": "tests.common.RandomMapDataset", "len": 10}
    assert c.dataset_fingerprint == m.fingerprint
    assert mode().fingerprint == mode(seed=1).fingerprint != mode(RandomMapDataset(11)).fingerprint


def test_new_loaders_write_the_feistel_order_and_adopt_a_saved_one():
    m = mode()
    assert m.loader_config(0).order_algorithm == ORDER_FEISTEL
    old = mode()
    old.plan.order_algorithm = ORDER_LEGACY  # as a state of an earlier version says
    legacy_config = old.loader_config(0)
    fresh = mode()
    fresh.check(legacy_config, pos(0, 4), 0)
    assert fresh.plan.order_algorithm == ORDER_LEGACY and fresh.loader_config(0).order_algorithm == ORDER_LEGACY
    fresh.check(m.loader_config(0), pos(0, 4), 0)  # and back, for a state of this version
    assert fresh.plan.order_algorithm == ORDER_FEISTEL


def test_an_unknown_order_is_refused_and_nothing_changes():
    future = msgspec.structs.replace(mode().loader_config(0), order_algorithm="feistel-7")
    fresh = mode()
    with pytest.raises(ConfigMismatchError, match="newer savable_loader") as info:
        fresh.check(future, pos(0, 4), 0)
    assert (info.value.field, info.value.saved, info.value.current) == ("order_algorithm", "feistel-7", ORDER_FEISTEL)
    assert fresh.plan.order_algorithm == ORDER_FEISTEL
    # a failed check later in the list leaves the order alone too
    old = mode()
    old.plan.order_algorithm = ORDER_LEGACY
    with pytest.raises(ConfigMismatchError):
        mode(seed=6).check(old.loader_config(0), pos(0, 4), 0)


def test_keys_name_their_order_and_rebuild_with_it():
    legacy = mode()
    legacy.plan.order_algorithm = ORDER_LEGACY
    legacy.begin()
    new = mode()
    new.begin()
    batches = {}
    for name, m in (("legacy", legacy), ("new", new)):
        keys = list(m.sampler)
        m.on_item(None)
        key = m.restore_key(5)
        assert key.order_algorithm == m.plan.order_algorithm
        batches[name] = (key, m.torch_dataset[keys[0]])
    assert "order_algorithm" not in str(batches["legacy"][0])  # the default, as in keys of earlier versions
    assert '"order_algorithm":"feistel-1"' in str(batches["new"][0])
    assert not torch.equal(batches["legacy"][1], batches["new"][1])  # two different orders
    for key, batch in batches.values():  # a loader of either order rebuilds either key
        for m in (mode(), legacy):
            assert torch.equal(m.restore_sample(key), batch)
    bad = msgspec.structs.replace(batches["new"][0], order_algorithm="feistel-7")
    with pytest.raises(RestoreKeyError, match="order_algorithm"):
        new.restore_sample(bad)


# -- check ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "changes", "saved", "current"),
    [
        ("seed", {"seed": 6}, 5, 6),
        ("shuffle", {"shuffle": False}, True, False),
        ("rank", {"rank": 1, "world_size": 2}, 0, 1),
        ("world_size", {"world_size": 2}, 1, 2),
        ("batch_size", {"batch_size": 5}, 4, 5),
        ("batch_size", {"batch_size": None}, 4, None),
        ("drop_last", {"drop_last": True}, False, True),
    ],
)
def test_check_names_each_changed_field(field, changes, saved, current):
    base = {"rank": 0, "world_size": 2} if field == "rank" else {}
    old = mode(**base)
    config, position = old.loader_config(2), old.save()
    with pytest.raises(ConfigMismatchError) as info:
        mode(**changes).check(config, position, 2)
    e = info.value
    assert (e.field, e.saved, e.current) == (field, saved, current)
    assert f"{field} was {saved!r} when the state was saved, but is {current!r} now" in str(e)


def test_check_accepts_same_config_and_changed_num_workers():
    old = mode()
    old.begin()
    old.on_item(None)
    config, position = old.loader_config(3), old.save()
    for workers in (0, 1, 3, 8):
        mode().check(config, position, workers)


def test_check_changed_dataset_length():
    old = mode()
    with pytest.raises(ConfigMismatchError) as info:
        mode(RandomMapDataset(11)).check(old.loader_config(0), old.save(), 0)
    assert (info.value.field, info.value.saved, info.value.current) == ("len(dataset)", 10, 11)


def test_check_consumed_beyond_the_epoch():
    old = mode()
    with pytest.raises(ConfigMismatchError) as info:
        mode().check(old.loader_config(0), pos(0, 11), 0)
    assert (info.value.field, info.value.saved, info.value.current) == ("position.consumed", 11, "<= 10")
    mode().check(old.loader_config(0), pos(0, 10), 0)  # exactly at the end is fine


class Configured(RandomMapDataset):
    def __init__(self, n: int, config: dict) -> None:
        super().__init__(n)
        self._config = config

    def config(self) -> dict:
        return self._config


class OtherType(Configured):
    pass


def test_map_dataset_config():
    assert map_dataset_config(RandomMapDataset(7)) == {"type": "tests.common.RandomMapDataset", "len": 7}
    cfg = map_dataset_config(Configured(3, {"root": "/data", "fn": len, "raw": b"\x01"}))
    assert cfg == {
        "type": "tests.test_index_mode.Configured",
        "len": 3,
        "config": {"root": "/data", "fn": "builtins.len", "raw": "01"},
    }


@pytest.mark.parametrize(
    ("old", "new", "path", "saved", "current"),
    [
        ({"aug": {"flip": True, "sizes": [32, 64]}}, {"aug": {"flip": True, "sizes": [32, 48]}},
         "dataset_config.config.aug.sizes[1]", 64, 48),
        ({"aug": {"flip": True, "sizes": [32, 64]}}, {"aug": {"flip": False, "sizes": [32, 48]}},
         "dataset_config.config.aug.flip", True, False),  # the first differing key, in sorted order
        ({"aug": {"sizes": [32, 64]}}, {"aug": {"sizes": [32]}},
         "dataset_config.config.aug.sizes", [32, 64], [32]),  # lists of another length: whole list
        ({"root": "/a"}, {"root": "/a", "new": 1}, "dataset_config.config.new", "<missing>", 1),
        ({"root": "/a", "old": 1}, {"root": "/a"}, "dataset_config.config.old", 1, "<missing>"),
        ({"items": [{"a": 1}, {"a": 2}]}, {"items": [{"a": 1}, {"a": 3}]}, "dataset_config.config.items[1].a", 2, 3),
    ],
)
def test_dataset_config_diff_names_the_first_differing_path(old, new, path, saved, current):
    before = mode(Configured(10, old))
    with pytest.raises(ConfigMismatchError) as info:
        mode(Configured(10, new)).check(before.loader_config(0), before.save(), 0)
    e = info.value
    assert (e.field, e.saved, e.current) == (path, saved, current)
    assert "the dataset changed since the state was saved" in str(e)


def test_dataset_type_change_is_named():
    before = mode(Configured(10, {"a": 1}))
    with pytest.raises(ConfigMismatchError) as info:
        mode(OtherType(10, {"a": 1})).check(before.loader_config(0), before.save(), 0)
    assert (info.value.field, info.value.saved, info.value.current) == (
        "dataset_config.type", "tests.test_index_mode.Configured", "tests.test_index_mode.OtherType")


def test_check_dataset_config_passes_on_equal_fingerprints():
    a = mode(Configured(10, {"a": [1, 2]}))
    b = mode(Configured(10, {"a": [1, 2]}))
    check_dataset_config(a.loader_config(0), b.loader_config(5))
