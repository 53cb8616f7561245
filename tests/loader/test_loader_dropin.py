"""SavableDataLoader over map-style datasets (the drop-in path)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.errors import ConfigMismatchError, LoaderUsageError, StateError
from savable_loader.state import decode, encode
from tests.common import (
    RandomMapDataset,
    assert_streams,
    check_resume_everywhere,
    epochs_of,
)

pytestmark = pytest.mark.timeout(120)


def make(n=23, batch_size=4, num_workers=0, **kw):
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 5)
    return sl.SavableDataLoader(RandomMapDataset(n), batch_size=batch_size, num_workers=num_workers, **kw)


# 300 s: torch 2.4 starts a worker process in about 0.4 s (its own DataLoader too, 2.8 and
# later in about 0.03 s), and this test starts 3 at every resume point
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_resume_at_every_step(num_workers):
    checked = check_resume_everywhere(lambda: make(num_workers=num_workers), epochs=2)
    assert checked == 2 * 6 + 1 + 2  # 12 batches, k = 0..12, plus two "between epochs" points


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_drop_last_and_unshuffled(drop_last):
    check_resume_everywhere(lambda: make(n=14, batch_size=4, shuffle=False, drop_last=drop_last), epochs=2)


def test_unbatched_resume():
    check_resume_everywhere(lambda: make(n=7, batch_size=None), epochs=2)


def test_stream_does_not_depend_on_num_workers():
    ref = epochs_of(make(num_workers=0), 2)
    three = epochs_of(make(num_workers=3), 2)
    for a, b in zip(ref, three):
        assert_streams(b, a, "num_workers=3 vs 0")
    # epochs differ from each other (reshuffled) and draws differ between samples
    assert not torch.equal(torch.cat(ref[0]), torch.cat(ref[1]))


def test_resume_saved_with_3_workers_into_1_worker():
    check_resume_everywhere(
        lambda: make(num_workers=3), epochs=2, restore_factory=lambda: make(num_workers=1), steps=[0, 1, 4, 6, 9]
    )


def test_persistent_workers_need_workers():
    with pytest.raises(sl.LoaderUsageError, match="persistent_workers option needs num_workers > 0"):
        make(num_workers=0, persistent_workers=True)


def test_persistent_workers_resume():
    check_resume_everywhere(lambda: make(num_workers=2, persistent_workers=True), epochs=2, steps=[0, 3, 6, 8])


def test_every_sample_once_per_epoch():
    loader = make(n=23, batch_size=4)
    for epoch in epochs_of(loader, 2):
        ids = torch.cat(epoch)[:, 0].tolist()
        assert sorted(ids) == list(range(23))


def test_main_process_rng_untouched():
    def draws():
        return (random.random(), float(np.random.rand()), float(torch.rand(())))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = [draws() for _ in range(20)]
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    loader = make(n=80, num_workers=0)
    got = []
    for batch in loader:
        got.append(draws())
        got.append(draws())
        if len(got) >= 20:
            break
    assert got[:20] == expected


def test_save_twice_and_before_first_batch():
    loader = make()
    s0 = loader.save_state_rank()
    assert s0.position.epoch == 0 and s0.position.consumed == 0
    it = iter(loader)
    next(it)
    assert encode(loader.save_state_rank()) == encode(loader.save_state_rank())
    assert loader.save_state_rank().position.consumed == 4


def test_state_at_the_last_batch_is_the_epochs_empty_rest():
    loader = make(n=8, batch_size=4)
    it = iter(loader)
    next(it), next(it)
    pos = loader.save_state_rank().position
    assert (pos.epoch, pos.consumed) == (0, 8)  # before StopIteration: epoch 0, all of it consumed
    assert list(it) == []
    pos = loader.save_state_rank().position
    assert (pos.epoch, pos.consumed) == (1, 0)  # after StopIteration: the next epoch


@pytest.mark.parametrize("kwargs", [{"in_order": False, "num_workers": 2}, {"no_such_argument": 1}])
def test_rejected_arguments(kwargs):
    with pytest.raises((LoaderUsageError, TypeError), match=next(iter(kwargs))):
        sl.SavableDataLoader(RandomMapDataset(4), batch_size=2, **kwargs)


def test_rejected_datasets_and_values():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(LoaderUsageError, match="IterableDataset: expected unspecified shuffle"):
        sl.SavableDataLoader(Stream(), batch_size=2, shuffle=True)  # accepted without shuffle
    with pytest.raises(LoaderUsageError, match="map-style"):
        sl.SavableDataLoader(object(), batch_size=2)
    with pytest.raises(LoaderUsageError, match="batch_size should be a positive integer value"):
        sl.SavableDataLoader(RandomMapDataset(4), batch_size=0)
    with pytest.raises(LoaderUsageError, match="num_workers"):
        sl.SavableDataLoader(RandomMapDataset(4), worker_config=sl.WorkerConfig(num_workers=2), num_workers=1)


@pytest.mark.parametrize(
    "field, change",
    [
        ("seed", {"seed": 6}),
        ("shuffle", {"shuffle": False}),
        ("batch_size", {"batch_size": 3}),
        ("len(dataset)", {"n": 24}),
        ("drop_last", {"drop_last": True}),
    ],
)
def test_config_mismatch_names_field(field, change):
    state = make().save_state_rank()
    loader = make(**change)
    with pytest.raises(ConfigMismatchError) as info:
        loader.restore_state_rank(state)
    assert info.value.field == field
    assert field in str(info.value)


def test_changed_dataset_config_is_refused():
    class Configured(RandomMapDataset):
        def __init__(self, n, scale):
            super().__init__(n)
            self.scale = scale

        def config(self):
            return {"scale": self.scale}

    state = sl.SavableDataLoader(Configured(8, 1.0), batch_size=2).save_state_rank()
    with pytest.raises(ConfigMismatchError, match="scale"):
        sl.SavableDataLoader(Configured(8, 2.0), batch_size=2).restore_state_rank(state)


def test_restore_while_iterating_is_an_error():
    loader = make()
    state = loader.save_state_rank()
    it = iter(loader)
    next(it)
    with pytest.raises(LoaderUsageError, match="in progress"):
        loader.restore_state_rank(state)
    it.close()
    loader.restore_state_rank(state)  # once the iteration is closed
    assert_streams(list(loader), epochs_of(make(), 1)[0], "after the restore")


def test_restore_wrong_objects():
    loader = make()
    with pytest.raises(StateError):
        loader.restore_state_rank({"epoch": 1})
    with pytest.raises(StateError, match="list"):
        loader.restore_state_rank([loader.save_state_rank()])


def test_state_dict_round_trip_through_torch_save():
    loader = make(num_workers=0)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    rest_ref = list(it)
    buf.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert_streams(list(fresh), rest_ref, "after load_state_dict")
    assert first


def test_torch_like_attributes():
    ds = RandomMapDataset(23)
    loader = sl.SavableDataLoader(ds, batch_size=4, drop_last=True)
    assert loader.batch_size == 4 and loader.drop_last is True
    assert len(loader) == 5
    assert loader.dataset is ds and loader.dataset[3][0] == 3
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert len(loader.sampler) == 23 and loader.batch_sampler.sampler is loader.sampler
    assert len(loader.batch_sampler) == 5


def test_save_file_round_trip(tmp_path):
    loader = make()
    it = iter(loader)
    next(it)
    sl.state.save_file(tmp_path / "s.state", loader.save_state_rank())
    state = sl.state.load_file(tmp_path / "s.state")
    assert state == decode(encode(loader.save_state_rank()))


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed_formula", 1), ("seed_formula", 2), ("seed_formula", 4), ("order_algorithm", "numpy-permutation")],
)
def test_a_state_of_another_seed_formula_or_order_is_refused(field, value):
    import msgspec

    loader = make()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    other = msgspec.structs.replace(state, config=msgspec.structs.replace(state.config, **{field: value}))
    fresh = make()
    with pytest.raises(StateError) as info:
        fresh.restore_state_rank(decode(encode(other)))
    message = str(info.value)
    expected = {"seed_formula": 3, "order_algorithm": "feistel-1"}[field]
    assert f"config.{field} is {value!r}, expected {expected!r}" in message
    assert "written by an unreleased version of savable-loader" in message
    fresh.restore_state_rank(state)  # the loader is left as it was: this version's state restores
    assert fresh.save_state_rank() == state
