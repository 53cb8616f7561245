"""Restore keys: every yielded batch has one, and restore_sample rebuilds that batch.

Keys are taken from real 2-worker, 2-epoch runs; the rebuilt batch must equal the one
yielded, bit for bit, in a fresh loader too (other num_workers), and after a trip
through str().
"""

from __future__ import annotations

import random

import pytest
import torch

import savable_loader as sl
from savable_loader.wrappers import BatchDataset, FilterDataset, LimitDataset, MapDataset, RepeatDataset
from savable_loader.wrappers import ShuffleBufferDataset
from tests.common import RandomMapDataset, RangeSource, assert_same

pytestmark = pytest.mark.timeout(300)

SEED = 13


def dropin(num_workers: int, batch_size: int | None = 4, collate_fn=None) -> sl.SavableDataLoader:
    return sl.SavableDataLoader(
        RandomMapDataset(30), batch_size=batch_size, shuffle=True, seed=SEED, num_workers=num_workers,
        collate_fn=collate_fn, multiprocessing_context="fork" if num_workers else None,
    )


def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randint(0, 1000, x.shape)


def pipeline(num_workers: int, keyed: bool = True) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=SEED)
    ds = RangeSource(40, wc, keyed=keyed)
    ds = FilterDataset(ds, lambda x: random.random() < 0.8)  # a random predicate
    ds = MapDataset(ds, noisy)  # random augmentation before the buffer
    ds = ShuffleBufferDataset(ds, size=6)
    ds = MapDataset(ds, noisy)  # and after it
    ds = LimitDataset(RepeatDataset(ds, repeats=2), 50)
    ds = BatchDataset(ds, 3)
    return sl.SavableDataLoader(
        ds, batch_size=None, worker_config=wc, multiprocessing_context="fork" if num_workers else None
    )


def keyed_run(loader, epochs=2):
    return [(loader.restore_key, batch) for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["drop-in", "pipeline"])
def test_rebuilt_batches_equal_the_yielded_ones(make):
    run = keyed_run(make(2))
    keys = [k for k, _ in run]
    assert all(isinstance(k, sl.RestoreKey) for k in keys)
    assert len({str(k) for k in keys}) == len(keys), "two batches share a key"
    assert {k.epoch for k in keys} == {0, 1}
    rnd = random.Random(0)
    picks = rnd.sample(range(len(run)), 12)
    same = make(2)
    fresh = make(0) if make is dropin else make(2)  # never iterated (drop-in: other num_workers)
    for i in picks:
        key, batch = run[i]
        assert_same(same.restore_sample(key), batch, f"batch {i} ({key})")
        assert_same(fresh.restore_sample(str(key)), batch, f"batch {i} from str(key)")
        assert sl.RestoreKey.parse(str(key)) == key


def test_restore_sample_leaves_iteration_and_caller_rng_alone():
    loader = dropin(0)
    reference = list(dropin(0))
    got, keys = [], []
    torch.manual_seed(1)
    want = torch.rand(3)
    torch.manual_seed(1)
    for batch in loader:
        got.append(batch)
        keys.append(loader.restore_key)
        loader.restore_sample(keys[0])  # between batches, in the middle of the epoch
    assert torch.equal(torch.rand(3), want), "restore_sample moved the caller's RNG"
    for a, b in zip(got, reference):
        assert_same(a, b)


def test_keys_of_unbatched_and_custom_collate_loaders():
    unbatched = dropin(0, batch_size=None)
    run = keyed_run(unbatched, epochs=1)
    assert all(len(k.sample_positions()) == 1 for k, _ in run)
    for key, sample in run[::7]:
        assert_same(unbatched.restore_sample(key), sample)
    summed = dropin(0, collate_fn=lambda xs: torch.stack(xs).sum(0) + torch.randint(0, 9, ()))
    for key, batch in keyed_run(summed, epochs=1):
        assert_same(summed.restore_sample(key), batch)


def test_an_ordinary_batch_key_is_one_range():
    loader = dropin(0)
    next(iter(loader))
    key = loader.restore_key
    assert key.kind == "index" and key.positions == [(0, 4, 1)] and key.rank == 0
    assert loader.restore_key == key  # reading it twice gives the same


def test_no_key_before_the_first_batch_or_after_a_restore():
    loader = dropin(0)
    assert loader.restore_key is None
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    fresh = dropin(0)
    fresh.restore_state_rank(state)
    assert fresh.restore_key is None


def test_foreign_and_malformed_keys_are_refused():
    loader = dropin(0)
    next(iter(loader))
    key = loader.restore_key
    other_seed = sl.SavableDataLoader(RandomMapDataset(30), batch_size=4, shuffle=True, seed=SEED + 1)
    with pytest.raises(sl.RestoreKeyError, match="key.seed is 13"):
        other_seed.restore_sample(key)
    other_data = sl.SavableDataLoader(RandomMapDataset(31), batch_size=4, shuffle=True, seed=SEED)
    with pytest.raises(sl.RestoreKeyError, match="key.fingerprint"):
        other_data.restore_sample(key)
    with pytest.raises(sl.RestoreKeyError, match="not a restore key"):
        loader.restore_sample("{garbage")
    with pytest.raises(sl.RestoreKeyError, match="RestoreKey or its str"):
        loader.restore_sample(42)
    import msgspec

    far = msgspec.structs.replace(key, positions=[(10**6, 10**6 + 1, 1)])
    with pytest.raises(sl.RestoreKeyError, match="positions below"):
        loader.restore_sample(far)
    with pytest.raises(sl.RestoreKeyError, match="expects 'pipeline'"):
        pipeline(0).restore_sample(msgspec.structs.replace(key, fingerprint=pipeline(0)._mode.fingerprint))


def test_a_pipeline_key_needs_the_same_num_workers():
    loader = pipeline(2)
    run = keyed_run(loader, epochs=1)
    key = next(k for k, _ in run if k.worker == 1)
    with pytest.raises(sl.RestoreKeyError, match="key.worker is 1.*num_workers"):
        pipeline(0).restore_sample(key)


def test_a_pipeline_that_cannot_rebuild_says_why():
    loader = pipeline(0, keyed=False)
    dataset = loader.dataset.dataset
    assert not dataset.can_restore_sample()
    assert "keyed=False" in dataset.restore_sample_blocker()
    batch = next(iter(loader))
    key = loader.restore_key
    assert key.sample is None and batch is not None  # no source key: no batch key
    with pytest.raises(sl.RestoreKeyError, match="cannot rebuild samples: RangeSource"):
        loader.restore_sample(key)


def test_a_source_without_keys_names_itself():
    class Plain(sl.SavableDataset):
        def __iter__(self):
            yield from range(3)

        def config(self):
            return {}

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)
    ds = MapDataset(Plain(wc), lambda x: x)
    assert not ds.can_restore_sample()
    assert "Plain does not implement restore_sample()" in ds.restore_sample_blocker()
    loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)
    assert list(loader) == [0, 1, 2]
    assert loader.restore_key.sample is None
    with pytest.raises(sl.RestoreKeyError, match="Plain does not implement"):
        loader.restore_sample(loader.restore_key)
