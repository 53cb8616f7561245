"""``SavableDataLoader(reseed="batch")``: the global RNGs re-seeded once per batch on the
drop-in path, end to end: exact resume at every step with 0 and 2 workers, the stream
independent of ``num_workers``, what it refuses (another ``reseed`` or batch size on
restore, keys of the other setting, pipelines), elastic resume, restore keys."""

from __future__ import annotations

import pytest
import torch

import savable_loader as sl
from savable_loader.rng import counter_seed, derive_seed, item_seed, seed_global
from tests.common import RandomMapDataset, RangeSource, assert_streams, check_resume_everywhere

pytestmark = pytest.mark.timeout(300)

N = 23


def make(num_workers=0, batch_size=4, reseed="batch", rank=0, world_size=1, **kw) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers, seed=3)
    return sl.SavableDataLoader(
        RandomMapDataset(N),
        batch_size=batch_size,
        shuffle=True,
        worker_config=wc,
        reseed=reseed,
        multiprocessing_context="fork" if num_workers else None,
        **kw,
    )


@pytest.mark.parametrize(("num_workers", "drop_last"), [(0, False), (0, True), (2, False)])
def test_resume_at_every_step(num_workers, drop_last):
    steps = None if num_workers == 0 else [0, 1, 3, 5, 6, 8, 11, 12]
    assert check_resume_everywhere(lambda: make(num_workers, drop_last=drop_last), 2, steps=steps) >= 8


def test_stream_does_not_depend_on_num_workers_and_keeps_the_order():
    per_batch = [list(make(w)) for w in (0, 1, 3)]
    assert_streams(per_batch[1], per_batch[0], "1 worker")
    assert_streams(per_batch[2], per_batch[0], "3 workers")
    per_sample = list(make(reseed="sample"))
    assert [b[:, 0].tolist() for b in per_batch[0]] == [b[:, 0].tolist() for b in per_sample]  # same order
    assert any(not torch.equal(a, b) for a, b in zip(per_batch[0], per_sample))  # other draws


def test_the_documented_draws():
    # one re-seed from the batch's first position, then the samples draw in turn
    loader = make()
    batch = next(iter(loader))
    positions = loader.restore_key.sample_positions()
    indices = batch[:, 0].tolist()
    seed_global(item_seed(counter_seed(derive_seed(3, "sample", 0), positions[0])))
    expected = torch.stack([RandomMapDataset(N)[i] for i in indices])
    assert torch.equal(batch, expected)


def test_a_change_of_reseed_or_batch_size_is_refused():
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    assert state.config.reseed == "batch"
    with pytest.raises(sl.ConfigMismatchError) as info:
        make(reseed="sample").restore_state_rank(state)
    assert (info.value.field, info.value.saved, info.value.current) == ("reseed", "batch", "sample")
    with pytest.raises(sl.ConfigMismatchError, match="same batch size") as info:
        make(batch_size=2).restore_state_rank(state)  # divides, but the draws depend on the batch
    assert (info.value.field, info.value.saved, info.value.current) == ("batch_size", 4, 2)
    make(num_workers=2).restore_state_rank(state)  # num_workers may change
    per_sample = make(reseed="sample").save_state_rank()
    assert per_sample.config.reseed == "sample"
    with pytest.raises(sl.ConfigMismatchError, match="reseed"):
        make().restore_state_rank(per_sample)


def test_restore_keys_carry_the_setting():
    loader = make()
    batches = [(loader.restore_key, b) for b in loader]
    key, batch = batches[2]
    assert key.reseed == "batch" and '"reseed":"batch"' in str(key)
    assert torch.equal(make().restore_sample(str(key)), batch)
    assert torch.equal(make(num_workers=2).restore_sample(key), batch)
    with pytest.raises(sl.errors.RestoreKeyError, match="reseed"):
        make(reseed="sample").restore_sample(key)
    plain = make(reseed="sample")
    plain_key = [plain.restore_key for _ in plain][0]
    assert "reseed" not in str(plain_key)  # the default is left out, as earlier versions wrote keys
    with pytest.raises(sl.errors.RestoreKeyError, match="reseed"):
        make().restore_sample(plain_key)


def test_elastic_resume_consumes_every_remaining_sample_once():
    states = []
    for rank in range(2):
        loader = make(rank=rank, world_size=2)
        it = iter(loader)
        for _ in range(rank + 1):
            next(it)
        states.append(loader.save_state_rank())
    seen_before = {
        int(x) for rank in range(2) for b in list(make(rank=rank, world_size=2))[: rank + 1] for x in b[:, 0]
    }
    after = []
    for rank in range(3):
        loader = make(rank=rank, world_size=3)
        loader.restore_state_global(states)
        after += [int(x) for b in loader for x in b[:, 0]]
    assert len(after) == len(set(after)) and not seen_before & set(after)
    assert seen_before | set(after) == set(range(N))


def test_arguments_are_checked():
    with pytest.raises(sl.LoaderUsageError, match="reseed must be 'sample' or 'batch', got 'epoch'"):
        make(reseed="epoch")
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    with pytest.raises(sl.LoaderUsageError, match="once per item"):
        sl.SavableDataLoader(RangeSource(5, wc), batch_size=None, worker_config=wc, reseed="batch")
