"""Elastic resume: another world size (drop-in), a batch size that divides the saved one.

World-size changes are checked against the uninterrupted W-rank run: every sample no
old rank had consumed is consumed exactly once by the new ranks, none of the consumed
ones again, each with the same content (bit for bit) as at its position in the
uninterrupted run; the next epoch equals an ordinary W'-rank epoch.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import savable_loader as sl
from savable_loader.core.elastic import (
    batch_rescale_factor,
    elastic_position,
    epoch_length,
    rank_share,
    remaining_positions,
    share_length,
)
from savable_loader.state.schema import IndexPosition, IndexStage, LoaderConfig, RankState
from tests.common import RandomMapDataset, RangeSource, assert_same, assert_streams, check_resume_everywhere
from tests.dist_harness import run_ranks, values

pytestmark = pytest.mark.timeout(300)

N = 45
BATCH = 4
SEED = 7


def make(rank: int, world: int, num_workers: int = 0, batch: int = BATCH, drop_last: bool = False):
    wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=num_workers, seed=SEED)
    return sl.SavableDataLoader(
        RandomMapDataset(N),
        batch_size=batch,
        shuffle=True,
        drop_last=drop_last,
        worker_config=wc,
        multiprocessing_context="fork" if num_workers else None,
    )


def saved_states(world: int, steps: list[int], **kw) -> list:
    """The states of ``world`` in-process ranks after ``steps[rank]`` batches each."""
    states = []
    for rank in range(world):
        loader = make(rank, world, **kw)
        it = iter(loader)
        for _ in range(steps[rank]):
            next(it)
        states.append(loader.save_state_rank())
    return states


def consumed_of(states: list, world: int) -> list[int]:
    """Samples each old rank consumed in epoch 0 (a rank that finished its share saved
    "next epoch, nothing consumed")."""
    return [s.position.consumed if s.position.epoch == 0 else math.ceil(N / world) for s in states]


def keyed_epoch(loader) -> list[tuple[list[int], torch.Tensor]]:
    """One epoch as (global positions, batch) pairs."""
    return [(loader.restore_key.sample_positions(), batch) for batch in loader]


def contents(world: int, epoch: int) -> dict[int, torch.Tensor]:
    """Position -> sample content in the uninterrupted ``world``-rank run of ``epoch``."""
    table: dict[int, torch.Tensor] = {}
    for rank in range(world):
        loader = make(rank, world)
        for _ in range(epoch):
            list(loader)
        for positions, batch in keyed_epoch(loader):
            table.update(zip(positions, batch))
    return table


def order(epoch: int) -> np.ndarray:
    return make(0, 1)._mode.plan.global_order(epoch)


def check_remainder(old_world, consumed, new_streams, epoch=0, even=True):
    """New ranks' streams cover exactly the samples the old ranks left, once, same content."""
    ref = contents(old_world, epoch)
    perm = order(epoch)
    taken = {int(perm[p % N]) for r, c in enumerate(consumed) for p in list(range(r, 10**6, old_world))[:c]}
    seen: list[int] = []
    for rank, stream in enumerate(new_streams):
        for positions, batch in stream:
            for p, sample in zip(positions, batch):
                assert p < N, f"rank {rank}: padding position {p} in the remainder"
                assert_same(sample, ref[p], f"rank {rank} position {p}")
                seen.append(int(perm[p]))
    assert len(seen) == len(set(seen)), "a sample was consumed twice after the restore"
    assert not taken & set(seen), "a consumed sample came again"
    assert taken | set(seen) == set(range(N)), "a sample was lost"
    sizes = [sum(len(p) for p, _ in s) for s in new_streams]
    assert not even or max(sizes) - min(sizes) <= 1, f"shares differ by more than one sample: {sizes}"


# -- the arithmetic -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_remaining_positions_leave_each_unconsumed_sample_once(seed):
    rnd = random.Random(seed)
    n = rnd.randint(1, 60)
    stages = []
    world = rnd.randint(1, 5)
    taken: set[int] = set()
    for _ in range(rnd.randint(1, 3)):
        shares = [rank_share(n, world, r, stages) for r in range(world)]
        counts = [rnd.randint(0, len(s)) for s in shares]
        for s, c in zip(shares, counts):
            taken |= {int(p) % n for p in s[:c]}
        stages.append(IndexStage(world_size=world, consumed=counts))
        world = rnd.randint(1, 5)
    left = remaining_positions(n, stages)
    assert list(left) == sorted(set(left)) and all(p < n for p in left)
    assert set(left) == set(range(n)) - taken


# -- the arithmetic against the O(N) arrays it replaced (hypothesis) ----------------------


def old_remaining_positions(n: int, stages) -> list[int]:
    """The array implementation of earlier versions (boolean masks over every position),
    extended to padding that wraps more than once (it failed when ceil(n / W) * W > 2n)."""
    first = stages[0]
    w0 = first.world_size
    total = math.ceil(n / w0) * w0 if n else 0
    consumed = np.zeros(total, dtype=bool)
    for rank, count in enumerate(first.consumed):
        consumed[rank : rank + count * w0 : w0] = True
    keep = ~consumed[:n]
    for start in range(n, total, max(n, 1)):  # padding copies of position p: p + n, p + 2n, ...
        copies = consumed[start : min(start + n, total)]
        keep[: len(copies)] &= ~copies
    left = np.flatnonzero(keep)
    for stage in stages[1:]:
        mask = np.ones(len(left), dtype=bool)
        for rank, count in enumerate(stage.consumed):
            mask[rank : rank + count * stage.world_size : stage.world_size] = False
        left = left[mask]
    return left.tolist()


@st.composite
def epochs_with_stages(draw):
    n = draw(st.integers(0, 120))
    world = draw(st.integers(1, 9))
    size = math.ceil(n / world) * world if n else 0
    stages: list[IndexStage] = []
    for _ in range(draw(st.integers(1, 4))):
        shares = [len(range(r, size, world)) for r in range(world)]
        counts = [draw(st.sampled_from([0, s, s // 2]) | st.integers(0, s)) for s in shares]
        stages.append(IndexStage(world_size=world, consumed=counts))
        size = len(old_remaining_positions(n, stages))
        world = draw(st.integers(1, 9))
    return n, stages, world


@settings(max_examples=400, deadline=None)
@given(epochs_with_stages())
def test_arithmetic_equals_the_old_arrays(case):
    n, stages, new_world = case
    old = old_remaining_positions(n, stages)
    left = remaining_positions(n, stages)
    assert len(left) == len(old)
    assert list(left) == old
    assert [left[k] for k in range(len(old))] == old and left[-1:] == old[-1:]
    for p in range(n + 2):
        assert left.count_below(p) == sum(1 for x in old if x < p)
    for rank in range(new_world):
        share = rank_share(n, new_world, rank, stages)
        assert list(share) == old[rank::new_world]
        assert len(share) == share_length(n, new_world, rank, stages) == len(old[rank::new_world])
        assert share[1:5] == old[rank::new_world][1:5]
        for batch, drop_last in ((3, False), (3, True), (None, True)):
            smallest = len(old[new_world - 1 :: new_world])
            want = min(len(share), smallest) // (batch or 1) * (batch or 1) if drop_last else len(share)
            assert epoch_length(n, new_world, rank, stages, batch, drop_last) == want


def test_stage_arithmetic_at_ten_billion_samples_and_many_ranks():
    n, world = 10**10, 4096
    per = math.ceil(n / world)
    rnd = random.Random(0)
    first = IndexStage(world_size=world, consumed=[rnd.randint(per // 2, per) for _ in range(world)])
    size = len(remaining_positions(n, [first]))
    second = IndexStage(world_size=1000, consumed=[rnd.randint(0, size // 1000) for _ in range(1000)])
    left = remaining_positions(n, [first, second])
    share = rank_share(n, 7, 3, [first, second])
    picks = [0, 1, len(share) // 2, len(share) - 1]
    values = [share[k] for k in picks]
    assert values == sorted(values) and all(0 <= v < n for v in values)
    for k, v in zip(picks, values):
        assert left.count_below(v) == 3 + 7 * k  # the k-th of rank 3 of 7
        assert left.count_below(v + 1) == 4 + 7 * k
    assert share[len(share) // 2 : len(share) // 2 + 3] == [share[len(share) // 2 + i] for i in range(3)]


def test_malformed_stage_counts_are_a_state_error():
    with pytest.raises(sl.StateError, match="consumed 6 samples of a share of 5"):
        remaining_positions(10, [IndexStage(world_size=2, consumed=[6, 0])])
    with pytest.raises(sl.StateError, match="2 consumed counts, expected 3"):
        remaining_positions(10, [IndexStage(world_size=3, consumed=[1, 1])])
    with pytest.raises(sl.StateError, match="share of"):
        remaining_positions(10, [IndexStage(world_size=2, consumed=[1, 1]), IndexStage(world_size=1, consumed=[9])])


def _state(rank, world, epoch, consumed, stages=(), batch=BATCH):
    config = LoaderConfig(
        rank=rank,
        world_size=world,
        num_workers=0,
        seed=SEED,
        batch_size=batch,
        shuffle=True,
        drop_last=False,
        dataset_fingerprint="f",
        seed_formula=3,
        order_algorithm="feistel-1",
    )
    return RankState(
        config=config, position=IndexPosition(epoch=epoch, consumed=consumed, dataset_len=N, stages=list(stages))
    )


def test_a_rank_that_finished_the_epoch_counts_its_whole_share():
    # 2 ranks of 23 samples; rank 1 finished (saved as the next epoch), rank 0 at 20
    pos = elastic_position([_state(0, 2, 3, 20), _state(1, 2, 4, 0)], 3)
    assert pos.epoch == 3 and pos.stages == [IndexStage(world_size=2, consumed=[20, 23])]
    assert len(remaining_positions(N, pos.stages)) == 3  # positions 40, 42, 44
    done = elastic_position([_state(0, 2, 4, 0), _state(1, 2, 4, 0)], 3)
    assert (done.epoch, done.consumed, done.stages) == (4, 0, [])


def test_states_too_far_apart_or_inconsistent_are_refused():
    with pytest.raises(sl.StateError, match="more than one epoch apart"):
        elastic_position([_state(0, 2, 3, 20), _state(1, 2, 5, 0)], 3)
    with pytest.raises(sl.StateError, match="batch_size"):
        elastic_position([_state(0, 2, 3, 20), _state(1, 2, 3, 8, batch=8)], 3)


# -- world size, in one process (explicit ranks) ---------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "steps"), [(2, 3, [2, 4]), (3, 2, [1, 1, 3]), (2, 1, [5, 0]), (4, 3, [3, 3, 2, 2])]
)
def test_world_size_change_in_process(old, new, steps):
    states = saved_states(old, steps)
    consumed = consumed_of(states, old)
    restored = []
    for rank in range(new):
        loader = make(rank, new)
        loader.restore_state_global(states)
        restored.append(keyed_epoch(loader))
        # the next epoch is an ordinary new-world epoch
        reference = make(rank, new)
        list(reference)
        assert_streams(list(loader), list(reference), f"rank {rank} epoch 1")
    check_remainder(old, consumed, restored)


def test_two_world_size_changes_in_one_epoch():
    states = saved_states(2, [1, 2])
    first = [s.position.consumed for s in states]
    middle, streams = [], []
    for rank in range(3):
        loader = make(rank, 3)
        loader.restore_state_global(states)
        it = iter(loader)
        batch = next(it)
        streams.append([(loader.restore_key.sample_positions(), batch)])
        middle.append(loader.save_state_rank())
    assert all(len(s.position.stages) == 1 for s in middle)
    for rank in range(2):
        loader = make(rank, 2)
        loader.restore_state_global(middle)
        streams.append(keyed_epoch(loader))
    check_remainder(2, first, streams, even=False)  # (streams of two stages)


def test_restore_state_rank_refuses_another_world_size_with_a_hint():
    loader = make(0, 2)
    state = loader.save_state_rank()
    with pytest.raises(sl.ConfigMismatchError, match="restore_state_global") as e:
        make(0, 3).restore_state_rank(state)
    assert (e.value.field, e.value.saved, e.value.current) == ("world_size", 2, 3)


def test_pipeline_refuses_another_world_size_with_a_reason_and_honours_num_workers():
    def pipeline(rank, world, workers=0):
        wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=SEED)
        return sl.SavableDataLoader(RangeSource(20, wc), batch_size=None, worker_config=wc)

    states = [pipeline(r, 2).save_state_rank() for r in range(2)]
    with pytest.raises(sl.ConfigMismatchError, match="split per rank and worker") as e:
        pipeline(0, 3).restore_state_global(states)
    assert (e.value.field, e.value.saved, e.value.current) == ("world_size", 2, 3)
    # (refused before hosting, see test_hosting.py) another num_workers is honoured
    resumed = pipeline(0, 2, workers=2)
    resumed.restore_state_rank(states[0])
    assert sorted(int(x[0]) for x in resumed) == list(range(20))  # (RangeSource splits by worker only)


# -- world size with gloo processes --------------------------------------------------------


def _save(rank, world, out, steps):
    loader = make(rank, world, num_workers=2 if world == 2 else 0)
    it = iter(loader)
    for _ in range(steps[rank]):
        next(it)
    states = loader.save_state_global(global_dst_rank=0)
    if rank == 0:
        sl.state.save_file(Path(out) / f"w{world}.state", states)


def _restore(rank, world, out, old):
    results = {}
    path = Path(out) / f"w{old}.state"
    for num_workers, form in ((0, "full"), (2, "scatter")):
        loader = make(rank, world, num_workers=num_workers)
        if form == "full":
            loader.restore_state_global(sl.state.load_file(path))
        else:
            loader.restore_state_global(sl.state.load_file(path) if rank == 0 else None, src_rank=0)
        results[num_workers] = (keyed_epoch(loader), list(loader))
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    steps = {2: [3, 5], 3: [2, 2, 4]}
    for world in (2, 3):
        values(run_ranks(_save, world, str(out), steps[world]))
    return out, steps


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (2, 1)])
def test_world_size_change_with_gloo(saved, old, new):
    out, steps = saved
    results = values(run_ranks(_restore, new, str(out), old))
    consumed = [min(s * BATCH, math.ceil(N / old)) for s in steps[old]]
    for num_workers in (0, 2):
        check_remainder(old, consumed, [results[rank][num_workers][0] for rank in range(new)])
        for rank in range(new):
            reference = make(rank, new)
            list(reference)
            assert_streams(results[rank][num_workers][1], list(reference), f"rank {rank} of {new}, next epoch")


# -- batch size ------------------------------------------------------------------------


def test_drop_in_batch_8_to_4_to_2_continues_the_flattened_stream():
    def loader(batch, workers=2):
        return make(0, 1, num_workers=workers, batch=batch)

    uninterrupted = loader(8, 0)
    reference = [s for _ in range(2) for b in uninterrupted for s in b]
    got = []
    first = loader(8)
    it = iter(first)
    for _ in range(2):
        got.extend(next(it))
    state = first.save_state_rank()
    second = loader(4)
    second.restore_state_rank(state)
    it = iter(second)
    for _ in range(3):
        got.extend(next(it))
    state = second.save_state_rank()
    assert state.config.batch_size == 4 and state.position.consumed == 28
    third = loader(2)
    third.restore_state_rank(state)
    got.extend(s for b in third for s in b)
    got.extend(s for b in third for s in b)
    assert_streams(got, reference, "flattened stream after 8 -> 4 -> 2")


@pytest.mark.parametrize("new", [3, 16])
def test_drop_in_batch_size_that_does_not_divide_is_refused(new):
    state = make(0, 1, batch=8).save_state_rank()
    with pytest.raises(sl.ConfigMismatchError, match="divides") as e:
        make(0, 1, batch=new).restore_state_rank(state)
    assert (e.value.field, e.value.saved, e.value.current) == ("batch_size", 8, new)


def pipeline_loader(batch: int, workers: int = 2, n: int = 70):
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=SEED)
    ds = sl.wrappers.MapDataset(sl.wrappers.BatchDataset(RangeSource(n, wc), batch), lambda b: b[:, 0])
    return sl.SavableDataLoader(
        ds, batch_size=None, worker_config=wc, multiprocessing_context="fork" if workers else None
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_pipeline_batch_8_to_4_to_2_loses_and_repeats_nothing(workers):
    n = 70
    got: list[int] = []
    first = pipeline_loader(8, workers)
    it = iter(first)
    for _ in range(3):
        got.extend(next(it).tolist())
    state = first.save_state_rank()
    second = pipeline_loader(4, workers)
    second.restore_state_rank(state)
    it = iter(second)
    for _ in range(3):
        batch = next(it)
        assert len(batch) <= 4
        got.extend(batch.tolist())
    state = second.save_state_rank()
    third = pipeline_loader(2, workers)
    third.restore_state_rank(state)
    rest = list(third)
    assert all(len(b) <= 2 for b in rest)
    got.extend(v for b in rest for v in b.tolist())
    assert sorted(got) == list(range(n)), "a sample was lost or repeated"
    assert sorted(v for b in third for v in b.tolist()) == list(range(n))  # next epoch: whole


def test_pipeline_batch_size_that_does_not_divide_is_refused():
    state = pipeline_loader(8, 0).save_state_rank()
    with pytest.raises(sl.ConfigMismatchError, match="divide") as e:
        pipeline_loader(3, 0).restore_state_rank(state)
    assert (e.value.saved, e.value.current) == (8, 3)


def test_batch_rescale_factor_needs_a_batch_with_only_maps_above():
    batch = "savable_loader.wrappers.batch.BatchDataset"
    src = {"type": "S", "n": 1}
    saved = {
        "type": "savable_loader.wrappers.map.MapDataset",
        "fn": "f",
        "children": [{"type": batch, "batch_size": 8, "children": [src]}],
    }
    current = {**saved, "children": [{"type": batch, "batch_size": 2, "children": [src]}]}
    assert batch_rescale_factor(saved, current) == 4
    filtered = {"type": "F", "children": [{"type": batch, "batch_size": 8, "children": [src]}]}
    assert (
        batch_rescale_factor(filtered, {**filtered, "children": [{"type": batch, "batch_size": 4, "children": [src]}]})
        is None
    )
    assert batch_rescale_factor(saved, {**saved, "fn": "g"}) is None


def test_an_empty_share_is_an_empty_epoch_not_the_next_one():
    # N=10 on 2 ranks, 2 batches of 2 each consumed: 2 samples left for 4 new ranks
    def small(rank, world, drop_last=False):
        wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=0, seed=SEED)
        return sl.SavableDataLoader(
            RandomMapDataset(10), batch_size=2, shuffle=True, drop_last=drop_last, worker_config=wc
        )

    states = []
    for rank in range(2):
        loader = small(rank, 2)
        it = iter(loader)
        next(it), next(it)
        states.append(loader.save_state_rank())
    for rank in range(4):
        loader = small(rank, 4)
        loader.restore_state_global(states)
        first = [(loader.restore_key.epoch, b) for b in loader]
        assert len(first) == (1 if rank < 2 else 0), f"rank {rank}: {first}"
        assert all(epoch == 0 for epoch, _ in first)
        assert loader.save_state_rank().position.epoch == 1  # everyone in step
        reference = small(rank, 4)
        list(reference)
        assert_streams(list(loader), list(reference), f"rank {rank} epoch 1")


def test_drop_last_gives_every_new_rank_the_same_number_of_batches():
    states = saved_states(2, [1, 2], drop_last=True)  # uneven counts at the save point
    counts = []
    for rank in range(3):
        loader = make(rank, 3, drop_last=True)
        loader.restore_state_global(states)
        counts.append(len(list(loader)))
    # 45 samples, 2 ranks of 23 (padded); 4 + 8 consumed -> 33 left -> shares 11, 11, 11
    assert counts == [2, 2, 2], counts


def test_saving_an_empty_loader_is_idempotent():
    empty = sl.SavableDataLoader(RandomMapDataset(0), batch_size=2, seed=SEED)
    state = empty.save_state_rank()
    assert state.position.epoch == 0
    again = sl.SavableDataLoader(RandomMapDataset(0), batch_size=2, seed=SEED)
    again.restore_state_rank(state)
    assert again.save_state_rank() == state
    assert list(again) == [] and again.save_state_rank().position.epoch == 1


# -- resume at every step with the Feistel order -----------------------------------------


@pytest.mark.parametrize(
    ("world", "batch", "drop_last", "num_workers"),
    [(1, BATCH, False, 0), (2, BATCH, False, 0), (4, 3, True, 0), (3, None, False, 0), (2, BATCH, True, 2)],
)
def test_resume_at_every_step_on_every_rank(world, batch, drop_last, num_workers):
    # N = 45 pads on 2, 3 (no), 4 ranks; every rank's stream resumes at every step
    for rank in range(world):
        checked = check_resume_everywhere(
            lambda rank=rank: make(rank, world, num_workers=num_workers, batch=batch, drop_last=drop_last), epochs=2
        )
        assert checked > 2


@pytest.mark.parametrize(
    ("old", "new", "steps", "drop_last", "num_workers"),
    [(2, 3, [3, 5], False, 0), (3, 2, [1, 3, 2], True, 0), (4, 3, [2, 2, 1, 3], False, 2)],
)
def test_resume_at_every_step_of_a_resized_remainder(old, new, steps, drop_last, num_workers):
    states = saved_states(old, steps, drop_last=drop_last)

    for rank in range(new):

        def resized(rank=rank):
            loader = make(rank, new, num_workers=num_workers, drop_last=drop_last)
            loader.restore_state_global(states)
            return loader

        assert resized().save_state_rank().position.stages  # the remainder is a stage
        check_resume_everywhere(
            resized,
            epochs=2,
            restore_factory=lambda rank=rank: make(rank, new, num_workers=num_workers, drop_last=drop_last),
        )


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 5)])
def test_every_old_save_step_leaves_each_sample_once(old, new):
    per_rank = [list(make(rank, old)) for rank in range(old)]
    for step in range(len(per_rank[0]) + 1):
        counts = [min(step + (rank % 2), len(per_rank[rank])) for rank in range(old)]  # uneven ranks
        states = saved_states(old, counts)
        consumed = consumed_of(states, old)
        streams = []
        for rank in range(new):
            loader = make(rank, new)
            loader.restore_state_global(states)
            streams.append(keyed_epoch(loader) if loader.save_state_rank().position.epoch == 0 else [])
        check_remainder(old, consumed, streams)


@pytest.mark.parametrize("new", [2, 3, 1])
def test_a_save_after_the_last_batch_resumes_with_the_empty_rest_on_any_world_size(new):
    """A loop that counts its epochs (``for epoch in range(start, E): for batch in loader``)
    runs as many epochs after a resize as at the same world size: the first ``iter()``
    after a restore is the saved epoch's (empty) rest, the next one the next epoch."""

    def small(rank, world):
        wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=0, seed=SEED)
        return sl.SavableDataLoader(RandomMapDataset(12), batch_size=2, shuffle=True, worker_config=wc)

    states = []
    for rank in range(2):
        loader = small(rank, 2)
        it = iter(loader)
        for _ in range(3):  # each rank's 6 samples: its last batch
            next(it)
        states.append(loader.save_state_rank())
    for rank in range(new):
        loader = small(rank, new)
        if new == 2:
            loader.restore_state_rank(states[rank])
        else:
            loader.restore_state_global(states)
        assert list(loader) == [], f"rank {rank} of {new}: the rest of epoch 0 is empty"
        reference = small(rank, new)
        list(reference)
        assert_streams(list(loader), list(reference), f"rank {rank} of {new}: epoch 1")
