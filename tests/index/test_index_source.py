"""savable_loader.index.source: the per-epoch order, its split across ranks, its cutting
into batches, and the dataset wrapper that builds a batch from a key."""

from __future__ import annotations

import math
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, get_worker_info

from savable_loader.errors import LoaderUsageError
from savable_loader.index.permutation import FeistelPermutation
from savable_loader.index.source import BatchKey, IndexedDataset, IndexPlan, IndexSampler
from savable_loader.rng import counter_seed, derive_seed, item_seed, seed_global
from savable_loader.testing import check_resume
from tests.common import RandomMapDataset, assert_same

pytestmark = pytest.mark.timeout(60)


def plan(n=10, *, seed=0, shuffle=False, rank=0, world_size=1, batch_size=3, drop_last=False) -> IndexPlan:
    return IndexPlan(
        n, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, batch_size=batch_size, drop_last=drop_last
    )


def flat(keys) -> tuple[list[int], list[int]]:
    keys = list(keys)
    return [p for k in keys for p in k.positions], [i for k in keys for i in k.indices]


# -- IndexPlan: order, ranks, padding ---------------------------------------------------


def test_rank_takes_every_world_size_th_position():
    for rank in range(3):
        positions, indices = flat(plan(12, rank=rank, world_size=3, batch_size=2).batches(0, 0))
        assert positions == [rank, rank + 3, rank + 6, rank + 9]
        assert indices == positions  # unshuffled: the order is the identity


@pytest.mark.parametrize(("n", "world_size"), [(10, 3), (7, 4), (5, 2), (3, 5), (9, 3)])
def test_padding_wraps_around_like_distributed_sampler(n, world_size):
    per_rank = math.ceil(n / world_size)
    all_positions: list[int] = []
    all_indices: list[int] = []
    for rank in range(world_size):
        p = plan(n, rank=rank, world_size=world_size, batch_size=None)
        assert p.rank_len() == per_rank
        positions, indices = flat(p.batches(0, 0))
        assert len(indices) == per_rank
        assert positions == list(range(rank, per_rank * world_size, world_size))
        assert indices == [pos % n for pos in positions]
        torch_order = list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False))
        assert indices == torch_order
        all_positions += positions
        all_indices += indices
    assert sorted(all_positions) == list(range(per_rank * world_size))  # every global position once
    padding = per_rank * world_size - n
    assert sorted(all_indices) == sorted(list(range(n)) + list(range(padding)))  # the first ones twice


def test_padding_repeats_the_start_of_the_shuffled_order():
    n, world_size = 10, 4
    order = plan(n, seed=5, shuffle=True).global_order(2)
    got = {}
    for rank in range(world_size):
        for key in plan(n, seed=5, shuffle=True, rank=rank, world_size=world_size).batches(2, 0):
            for position, index in zip(key.positions, key.indices):
                got[position] = index
    assert sorted(got) == list(range(12))
    assert [got[p] for p in range(12)] == [int(order[p % n]) for p in range(12)]


@pytest.mark.parametrize(
    ("n", "world_size", "batch_size", "drop_last", "epoch_len", "num_batches"),
    [
        (10, 1, 3, False, 10, 4),
        (10, 1, 3, True, 9, 3),
        (10, 1, 5, True, 10, 2),
        (10, 1, None, False, 10, 10),
        (10, 1, None, True, 10, 10),
        (10, 3, 3, False, 4, 2),  # 4 per rank after padding
        (10, 3, 3, True, 3, 1),
        (10, 3, 5, True, 0, 0),
        (10, 3, 5, False, 4, 1),
        (0, 2, 3, False, 0, 0),
    ],
)
def test_epoch_len_and_num_batches(n, world_size, batch_size, drop_last, epoch_len, num_batches):
    for rank in range(world_size):
        p = plan(n, rank=rank, world_size=world_size, batch_size=batch_size, drop_last=drop_last)
        assert p.epoch_len() == epoch_len
        assert p.num_batches() == num_batches
        keys = list(p.batches(0, 0))
        assert len(keys) == num_batches
        assert sum(len(k.positions) for k in keys) == epoch_len
        if batch_size is None:
            assert all(len(k.positions) == 1 for k in keys)
        elif keys:
            sizes = [len(k.positions) for k in keys]
            assert sizes[:-1] == [batch_size] * (len(sizes) - 1)
            assert sizes[-1] == (batch_size if drop_last else epoch_len - batch_size * (len(sizes) - 1))


def test_batch_contents_in_order():
    keys = list(plan(10, rank=1, world_size=2, batch_size=2).batches(4, 0))
    assert keys == [
        BatchKey(4, (1, 3), (1, 3)),
        BatchKey(4, (5, 7), (5, 7)),
        BatchKey(4, (9,), (9,)),
    ]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [None, 1, 3, 4])
def test_batches_from_mid_epoch_start_are_the_tail(batch_size, drop_last):
    p = plan(23, seed=7, shuffle=True, rank=1, world_size=2, batch_size=batch_size, drop_last=drop_last)
    full = list(p.batches(3, 0))
    step = batch_size or 1
    for b in range(len(full) + 1):
        assert list(p.batches(3, b * step)) == full[b:], f"start {b * step}"
    assert list(p.batches(3, p.epoch_len())) == []


def test_sampler_hands_out_the_keys_it_was_fed():
    p = plan(20, seed=1, shuffle=True, batch_size=4)
    sampler = IndexSampler()
    with pytest.raises(LoaderUsageError, match="only SavableDataLoader"):
        iter(sampler)
    keys = p.batches(2, 8)
    sampler.feed(keys)
    assert iter(sampler) is keys and iter(sampler) is keys  # torch's iterator asks twice
    assert list(sampler) == list(p.batches(2, 0))[2:]


def test_shuffle_is_deterministic_per_seed_and_epoch():
    a = plan(50, seed=3, shuffle=True)
    b = plan(50, seed=3, shuffle=True)
    orders = [a.global_order(e).tolist() for e in range(4)]
    for e in range(4):
        assert sorted(orders[e]) == list(range(50))  # a permutation
        assert b.global_order(e).tolist() == orders[e]  # same (seed, epoch): same order
    assert len({tuple(o) for o in orders}) == 4  # differs across epochs
    assert orders[0] != list(range(50))
    assert plan(50, seed=4, shuffle=True).global_order(0).tolist() != orders[0]  # differs across seeds
    # the cache does not leak one epoch's order into another
    assert a.global_order(0).tolist() == orders[0] and a.global_order(3).tolist() == orders[3]
    # the documented derivation: a Feistel permutation keyed by (seed, "order", epoch)
    perm = FeistelPermutation(50, derive_seed(3, "order", 2))
    assert orders[2] == perm(np.arange(50)).tolist()


def test_batches_are_made_a_chunk_at_a_time_and_match_the_order(monkeypatch):
    monkeypatch.setattr(IndexPlan, "CHUNK", 8)
    for batch_size, drop_last in ((3, False), (3, True), (None, False), (16, False)):
        p = plan(101, seed=2, shuffle=True, rank=1, world_size=3, batch_size=batch_size, drop_last=drop_last)
        order = p.global_order(4)
        keys = list(p.batches(4, 0))
        positions, indices = flat(keys)
        assert positions == list(range(1, 102, 3))[: p.epoch_len()]
        assert indices == [int(order[q % 101]) for q in positions]
        assert [len(k.positions) for k in keys[:-1]] == [batch_size or 1] * (len(keys) - 1)
        step = batch_size or 1
        for b in range(len(keys)):
            assert list(p.batches(4, b * step)) == keys[b:]


def test_a_billion_sample_plan_holds_no_array():
    n = 10**9
    p = plan(n, seed=1, shuffle=True, rank=3, world_size=8, batch_size=64)
    start = p.epoch_len() * 9 // 10 // 64 * 64
    key = next(p.batches(0, start))
    assert key.positions[0] == 3 + 8 * start and len(key.indices) == 64
    assert all(0 <= i < n for i in key.indices) and len(set(key.indices)) == 64
    assert p.key(0, key.positions) == key
    order = p.order(0)
    assert order._perm is not None  # a FeistelPermutation: nothing of size n


def test_shuffle_does_not_depend_on_rank_or_batching():
    base = plan(30, seed=9, shuffle=True).global_order(1).tolist()
    for kw in ({"rank": 1, "world_size": 3}, {"batch_size": None}, {"drop_last": True, "batch_size": 7}):
        assert plan(30, seed=9, shuffle=True, **kw).global_order(1).tolist() == base


def test_no_shuffle_is_identity_every_epoch():
    p = plan(17, seed=3, shuffle=False)
    for e in range(3):
        assert p.global_order(e).tolist() == list(range(17))


# -- IndexedDataset ---------------------------------------------------------------------


def stack(samples):
    return torch.stack(samples)


def test_build_reseeds_per_seed_epoch_position():
    ds = IndexedDataset(RandomMapDataset(20), seed=4, collate_fn=stack, batched=True)
    # position 5 (dataset index 2) in two different batches, at a different place in each
    a = ds.build(BatchKey(1, (5, 8), (2, 7)))
    b = ds.build(BatchKey(1, (0, 3, 5), (11, 6, 2)))
    assert_same(a[0], b[2], "same (epoch, position) in two batches")
    assert int(a[0][0]) == 2 and int(a[1][0]) == 7
    # the exact draws: re-seeded from (seed, "sample", epoch) and the position before the sample
    seed_global(item_seed(counter_seed(derive_seed(4, "sample", 1), 5)))
    assert_same(a[0], RandomMapDataset(20)[2], "documented seeding")
    # another position, epoch or seed: other draws for the same dataset index
    other_position = ds.build(BatchKey(1, (6,), (2,)))[0]
    other_epoch = ds.build(BatchKey(2, (5,), (2,)))[0]
    other_seed = IndexedDataset(RandomMapDataset(20), seed=5, collate_fn=stack, batched=True).build(
        BatchKey(1, (5,), (2,))
    )[0]
    for name, x in (("position", other_position), ("epoch", other_epoch), ("seed", other_seed)):
        assert int(x[0]) == 2
        assert not torch.equal(x, a[0]), f"changing the {name} did not change the draws"


def test_build_reseeds_collate_from_first_position():
    def collate(samples):
        return (torch.stack(samples), random.random(), float(np.random.rand()), float(torch.rand(())))

    ds = IndexedDataset(RandomMapDataset(20), seed=4, collate_fn=collate, batched=True)
    batch = ds.build(BatchKey(0, (3, 9), (4, 5)))
    seed_global(item_seed(derive_seed(4, "collate", 0, 3)))
    assert batch[1:] == (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert ds.build(BatchKey(0, (3, 9), (4, 5)))[1:] == batch[1:]


def test_unbatched_build_passes_the_single_sample():
    seen = []

    def collate(sample):
        seen.append(sample)
        return sample

    ds = IndexedDataset(RandomMapDataset(5), seed=0, collate_fn=collate, batched=False)
    out = ds.build(BatchKey(0, (3,), (1,)))
    assert isinstance(out, torch.Tensor) and out.shape == (4,) and int(out[0]) == 1
    assert len(seen) == 1 and seen[0] is out


class Labelled(RandomMapDataset):
    classes = ("cat", "dog")

    def describe(self) -> str:
        return f"{self.n} samples"


def test_user_dataset_is_the_wrapped_object():
    user = Labelled(6)
    ds = IndexedDataset(user, seed=0, collate_fn=stack, batched=True)
    assert ds.user_dataset is user and len(ds) == 6
    assert not hasattr(ds, "classes")  # no forwarding: the loader shows the user's dataset itself


class Seeds(RandomMapDataset):
    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


def test_per_sample_seeds_fit_in_int64():
    keys = [BatchKey(e, tuple(range(32)), tuple(range(32))) for e in range(4)]
    new = IndexedDataset(Seeds(32), seed=3, collate_fn=list, batched=True)
    new_seeds = [s for k in keys for s in new.build(k)]
    assert all(0 <= s < 2**63 for s in new_seeds)
    # the documented seeds: counter_seed of the epoch's base and the position, top bit cleared
    assert new_seeds[:32] == [counter_seed(derive_seed(3, "sample", 0), p) & (2**63 - 1) for p in range(32)]
    torch.utils.data.default_collate(new_seeds)  # fits a LongTensor


class Bulk(RandomMapDataset):
    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        first = random.randint(0, 10**6)
        return [torch.tensor([i, first]) for i in indices]


def test_own_getitems_loads_a_batch_in_one_call_after_one_reseed():
    ds = IndexedDataset(Bulk(10), seed=1, collate_fn=stack, batched=True)
    batch = ds.build(BatchKey(0, (4, 5, 6), (7, 8, 9)))
    assert batch[:, 0].tolist() == [7, 8, 9] and len(set(batch[:, 1].tolist())) == 1
    seed_global(item_seed(counter_seed(derive_seed(1, "sample", 0), 4)))
    assert int(batch[0, 1]) == random.randint(0, 10**6)
    # torch's Subset forwards __getitems__ per sample: the per-sample seeds stay
    sub = IndexedDataset(
        torch.utils.data.Subset(RandomMapDataset(10), range(10)), seed=1, collate_fn=stack, batched=True
    )
    plain = IndexedDataset(RandomMapDataset(10), seed=1, collate_fn=stack, batched=True)
    key = BatchKey(0, (4, 5), (7, 8))
    assert_same(sub.build(key), plain.build(key), "Subset vs its dataset")


def test_main_process_getitem_leaves_global_rngs_untouched():
    ds = IndexedDataset(RandomMapDataset(20), seed=4, collate_fn=stack, batched=True)
    key = BatchKey(0, (1, 2, 3), (7, 8, 9))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    got = ds[key]
    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert after[0] == before[0]
    assert all(np.array_equal(x, y) for x, y in zip(after[1], before[1]))
    assert torch.equal(after[2], before[2])
    assert_same(got, ds.build(key), "__getitem__ vs build")
    # build itself (the worker path) does re-seed the global RNGs
    assert random.getstate() != before[0]


def test_pickle_with_lambda_collate_fn():
    offset = 100
    ds = IndexedDataset(Labelled(8), seed=2, collate_fn=lambda s: torch.stack(s) + offset, batched=True)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(ds.collate_fn)
    loaded = pickle.loads(pickle.dumps(ds))
    assert loaded.seed == 2 and loaded.batched is True and len(loaded) == 8
    assert loaded.user_dataset.classes == ("cat", "dog")
    key = BatchKey(3, (0, 4), (5, 6))
    got = loaded.build(key)
    assert_same(got, ds.build(key), "unpickled build")
    assert got[:, 0].tolist() == [105, 106]


# -- get_worker_info().seed in a worker follows the sample (issue 31, "next ones") ------------


class WorkerSeeded:
    """Seeds its augmentation from ``get_worker_info().seed`` and the index, as torch's docs
    suggest; also reports whether ``info.seed == torch.initial_seed()`` (torch's invariant)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        seed = info.seed if info is not None else 0
        draw = int(np.random.default_rng(seed + i).integers(0, 2**30))
        return torch.tensor([i, draw, int(seed == torch.initial_seed())])


def _worker_seeded(num_workers: int, persistent: bool = False) -> Any:
    from savable_loader import SavableDataLoader

    return SavableDataLoader(
        WorkerSeeded(), batch_size=2, shuffle=True, seed=5, num_workers=num_workers, persistent_workers=persistent
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent"])
def test_a_dataset_seeding_from_get_worker_info_seed_resumes_at_every_step(persistent: bool) -> None:
    check_resume(lambda: _worker_seeded(2, persistent), 2, steps=[0, 1, 2, 3, 7, 9])


@pytest.mark.timeout(600)
def test_get_worker_info_seed_is_the_sample_s_and_not_the_worker_s() -> None:
    two, three = (torch.cat(list(_worker_seeded(n))) for n in (2, 3))
    assert torch.equal(two, three)  # which worker loaded a sample does not matter
    assert two[:, 2].tolist() == [1] * 12  # info.seed == torch.initial_seed(), as under torch
