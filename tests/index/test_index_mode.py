"""savable_loader.index.engine: the drop-in path's bookkeeping (epoch and samples yielded),
its state and the configuration checks of a restore."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils.data import default_collate

from savable_loader.dataset.checks import check_dataset_config
from savable_loader.errors import ConfigMismatchError, RestoreKeyError, StateError
from savable_loader.index.engine import OrderMode, map_dataset_config
from savable_loader.rng import SEED_FORMULA
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import ORDER_ALGORITHM, IndexPosition, RankState, RestoreKey
from tests.common import RandomMapDataset

pytestmark = pytest.mark.timeout(60)


def mode(dataset=None, **kw) -> OrderMode:
    kw = {
        "seed": 5,
        "seed_explicit": True,
        "shuffle": True,
        "rank": 0,
        "world_size": 1,
        "batch_size": 4,
        "drop_last": False,
        **kw,
    }
    return OrderMode(RandomMapDataset(10) if dataset is None else dataset, collate_fn=default_collate, **kw)


def pos(epoch: int, consumed: int, dataset_len: int = 10) -> IndexPosition:
    return IndexPosition(epoch=epoch, consumed=consumed, dataset_len=dataset_len)


def drawn(m: OrderMode) -> list:
    """The keys the iteration begun last hands torch's iterator."""
    return list(iter(m.feed_sampler))


# -- iteration and position ---------------------------------------------------------------


def test_position_follows_the_items_up_to_the_epochs_end():
    m = mode()
    assert m.start_position(0) == pos(0, 0)
    it = m.begin(0, None)
    assert it.resumed is False and it.position() == pos(0, 0)
    keys = iter(m.feed_sampler)
    item = object()
    next(keys)
    assert it.on_item(item) is item  # items pass through unchanged
    assert it.position() == pos(0, 4) and it.remaining() == 2
    next(keys), next(keys)  # torch's iterator prefetches: drawn keys are not consumed
    assert it.position() == pos(0, 4)
    it.on_item(None)
    assert it.position() == pos(0, 8)
    it.on_item(None)  # the last, short batch: 10 of 10 yielded
    assert it.position() == pos(0, 10) and it.remaining() == 0  # the epoch's (empty) rest, not the next epoch
    it.end(finished=True, keep_workers=False)
    it1 = m.begin(1, None)
    assert [k.epoch for k in drawn(m)] == [1, 1, 1]
    assert it1.position() == pos(1, 0)


def test_a_batch_that_raised_counts_as_consumed():
    m = mode()
    it = m.begin(0, None)
    keys = iter(m.feed_sampler)
    first, second = next(keys), next(keys)
    assert it.on_error(RuntimeError("in the dataset")) is True
    assert it.position() == pos(0, 4)
    it.on_item(None)
    assert it.position() == pos(0, 8)
    assert m.last is not None and m.last[1] == second and first != second
    assert it.on_error(RuntimeError("nothing was drawn")) is False


def test_drop_last_and_unbatched_epochs():
    m = mode(batch_size=4, drop_last=True)  # 2 batches of 4, 2 samples dropped
    it = m.begin(0, None)
    assert len(drawn(m)) == 2
    it.on_item(None), it.on_item(None)
    assert it.position() == pos(0, 8) and it.remaining() == 0
    u = mode(batch_size=None)
    it = u.begin(0, None)
    assert len(drawn(u)) == 10
    for k in range(1, 11):
        it.on_item(None)
        assert it.position() == pos(0, k)


def test_resume_starts_at_the_position():
    m = mode()
    it = m.begin(3, pos(3, 8))
    assert it.resumed is True and it.position() == pos(3, 8)
    assert drawn(m) == list(m.plan.batches(3, 0))[2:]
    it.on_item(None)
    assert it.position() == pos(3, 10)
    empty = m.begin(2, pos(2, 10))  # saved at the epoch's last batch: its rest is empty
    assert drawn(m) == [] and empty.remaining() == 0 and m.remaining(pos(2, 10)) == 0
    assert m.remaining(pos(2, 4)) == 2


def test_position_round_trips_through_encoding():
    m = mode()
    it = m.begin(0, None)
    iter(m.feed_sampler).__next__()
    it.on_item(None)
    saved = decode_part(encode_part(it.position()), IndexPosition)
    fresh = mode()
    fresh.begin(saved.epoch, fresh.check(m.loader_config(0), saved, 0))
    assert drawn(fresh) == list(m.plan.batches(0, 0))[1:]


def test_len_dataset_is_read_at_every_epoch_start():
    data = RandomMapDataset(10)
    m = mode(data)
    m.begin(0, None)
    assert len(drawn(m)) == 3
    data.n = 13
    assert m.sample_count() == 13 and m.start_position(1) == pos(1, 0, 13)
    m.begin(1, None)
    assert sum(len(k.positions) for k in drawn(m)) == 13
    with pytest.raises(ConfigMismatchError, match="len"):
        m.begin(1, pos(1, 4, 10))  # a position of the old length


def test_loader_config_records_the_configuration():
    m = mode(rank=1, world_size=3, batch_size=2, drop_last=True, seed=9, shuffle=False)
    c = m.loader_config(4)
    assert (c.rank, c.world_size, c.num_workers, c.seed, c.batch_size, c.shuffle, c.drop_last) == (
        1,
        3,
        4,
        9,
        2,
        False,
        True,
    )
    assert (c.seed_formula, c.sampler) == (3, "")
    assert c.dataset_config == {"type": "tests.common.RandomMapDataset", "len": 10}
    assert c.dataset_fingerprint == m.fingerprint
    assert mode().fingerprint == mode(seed=1).fingerprint != mode(RandomMapDataset(11)).fingerprint


def test_loaders_write_the_one_order():
    config = mode().loader_config(0)
    assert config.order_algorithm == ORDER_ALGORITHM == "feistel-1"
    assert config.seed_formula == SEED_FORMULA == 3


def _refused(error: BaseException, field: str, found: object, expected: object) -> None:
    message = str(error)
    assert f"{field} is {found!r}, expected {expected!r}" in message, message
    assert "unreleased version of savable-loader" in message, message


@pytest.mark.parametrize("order", ["numpy-permutation", "feistel-7", ""])
def test_a_state_of_another_order_is_refused_and_nothing_changes(order):
    saved = mode(seed=6)  # a drawn seed would give way to the state's: it must not
    config = msgspec.structs.replace(saved.loader_config(0), order_algorithm=order)
    fresh = mode(seed_explicit=False)
    before = fresh.loader_config(0)
    with pytest.raises(StateError) as info:
        fresh.restore([RankState(config=config, position=pos(0, 4))], 0, 5)
    _refused(info.value, "config.order_algorithm", order, ORDER_ALGORITHM)
    assert fresh.loader_config(0) == before and fresh.seed == 5
    good = RankState(config=saved.loader_config(0), position=pos(0, 4))
    assert fresh.restore([good], 0, 5) == (pos(0, 4), 6)  # the same state of this version's order


def test_a_state_written_before_the_order_was_recorded_is_refused():
    plain = msgspec.to_builtins(RankState(config=mode().loader_config(0), position=pos(0, 4)))
    del plain["config"]["order_algorithm"]  # as the earliest unreleased version wrote states
    state = msgspec.convert(plain, RankState)
    assert state.config.order_algorithm == "numpy-permutation"  # the schema's default
    with pytest.raises(StateError) as info:
        mode().restore([state], 0, 5)
    _refused(info.value, "config.order_algorithm", "numpy-permutation", ORDER_ALGORITHM)


def test_keys_name_the_order_and_a_key_of_another_is_refused():
    m = mode()
    it = m.begin(0, None)
    keys = drawn(m)
    it.on_item(None)
    key = m.restore_key(5)
    assert key.order_algorithm == ORDER_ALGORITHM and '"order_algorithm":"feistel-1"' in str(key)
    batch = m.torch_dataset[keys[0]]
    assert torch.equal(mode().restore_sample(key), batch)
    for order in ("numpy-permutation", "feistel-7"):
        bad = msgspec.structs.replace(key, order_algorithm=order)
        with pytest.raises(RestoreKeyError) as info:
            mode().restore_sample(bad)
        _refused(info.value, "key.order_algorithm", order, ORDER_ALGORITHM)
    # a key that leaves the order out (as an unreleased version wrote keys of its order)
    text = str(key).replace(',"order_algorithm":"feistel-1"', "")
    assert "order_algorithm" not in text
    with pytest.raises(RestoreKeyError) as info:
        mode().restore_sample(RestoreKey.parse(text))
    _refused(info.value, "key.order_algorithm", "numpy-permutation", ORDER_ALGORITHM)


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
    config, position = old.loader_config(2), old.start_position(0)
    with pytest.raises(ConfigMismatchError) as info:
        mode(**changes).check(config, position, 2)
    e = info.value
    assert (e.field, e.saved, e.current) == (field, saved, current)
    assert f"{field} was {saved!r} when the state was saved, but is {current!r} now" in str(e)


def test_check_accepts_same_config_and_changed_num_workers():
    old = mode()
    it = old.begin(0, None)
    iter(old.feed_sampler).__next__()
    it.on_item(None)
    config, position = old.loader_config(3), it.position()
    for workers in (0, 1, 3, 8):
        mode().check(config, position, workers)


def test_check_changed_dataset_length():
    old = mode()
    with pytest.raises(ConfigMismatchError) as info:
        mode(RandomMapDataset(11)).check(old.loader_config(0), old.start_position(0), 0)
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
        "type": "tests.index.test_index_mode.Configured",
        "len": 3,
        "config": {"root": "/data", "fn": "builtins.len", "raw": "01"},
    }


@pytest.mark.parametrize(
    ("old", "new", "path", "saved", "current"),
    [
        (
            {"aug": {"flip": True, "sizes": [32, 64]}},
            {"aug": {"flip": True, "sizes": [32, 48]}},
            "dataset_config.config.aug.sizes[1]",
            64,
            48,
        ),
        (
            {"aug": {"flip": True, "sizes": [32, 64]}},
            {"aug": {"flip": False, "sizes": [32, 48]}},
            "dataset_config.config.aug.flip",
            True,
            False,
        ),  # the first differing key, in sorted order
        (
            {"aug": {"sizes": [32, 64]}},
            {"aug": {"sizes": [32]}},
            "dataset_config.config.aug.sizes",
            [32, 64],
            [32],
        ),  # lists of another length: whole list
        ({"root": "/a"}, {"root": "/a", "new": 1}, "dataset_config.config.new", "<missing>", 1),
        ({"root": "/a", "old": 1}, {"root": "/a"}, "dataset_config.config.old", 1, "<missing>"),
        ({"items": [{"a": 1}, {"a": 2}]}, {"items": [{"a": 1}, {"a": 3}]}, "dataset_config.config.items[1].a", 2, 3),
    ],
)
def test_dataset_config_diff_names_the_first_differing_path(old, new, path, saved, current):
    before = mode(Configured(10, old))
    with pytest.raises(ConfigMismatchError) as info:
        mode(Configured(10, new)).check(before.loader_config(0), before.start_position(0), 0)
    e = info.value
    assert (e.field, e.saved, e.current) == (path, saved, current)
    assert "the dataset changed since the state was saved" in str(e)


def test_dataset_type_change_is_named():
    before = mode(Configured(10, {"a": 1}))
    with pytest.raises(ConfigMismatchError) as info:
        mode(OtherType(10, {"a": 1})).check(before.loader_config(0), before.start_position(0), 0)
    assert (info.value.field, info.value.saved, info.value.current) == (
        "dataset_config.type",
        "tests.index.test_index_mode.Configured",
        "tests.index.test_index_mode.OtherType",
    )


def test_check_dataset_config_passes_on_equal_fingerprints():
    a = mode(Configured(10, {"a": [1, 2]}))
    b = mode(Configured(10, {"a": [1, 2]}))
    check_dataset_config(a.loader_config(0), b.loader_config(5))


# -- a dataset loading a batch in one __getitems__ call (issue 31, item 3) -------------------


def _augmented_hf(batch_size: int) -> object:
    """A Hugging Face dataset with a transform that draws, as users write it."""
    import savable_loader as sl

    datasets = pytest.importorskip("datasets")

    def augment(batch: dict) -> dict:
        noise = torch.rand(len(batch["x"]))
        return {"x": torch.tensor(batch["x"], dtype=torch.float32) + noise}

    ds = datasets.Dataset.from_dict({"x": list(range(16))}).with_transform(augment)
    return sl.SavableDataLoader(ds, batch_size=batch_size, shuffle=True, seed=3)


def test_a_batched_getitems_dataset_refuses_a_divided_batch_size_and_resumes_the_same_one() -> None:
    reference = torch.cat([b["x"] for b in _augmented_hf(4)])
    live = _augmented_hf(4)
    it = iter(live)
    head = [next(it)["x"] for _ in range(2)]
    state = decode_part(encode_part(live.save_state_rank()), type(live.save_state_rank()))
    del it
    smaller = _augmented_hf(2)
    with pytest.raises(ConfigMismatchError, match=r"batch_size.*__getitems__.*same batch size"):
        smaller.restore_state_rank(state)
    same = _augmented_hf(4)
    same.restore_state_rank(state)
    got = torch.cat(head + [b["x"] for b in same])
    assert torch.equal(got, reference)
