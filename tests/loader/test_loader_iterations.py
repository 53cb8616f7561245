"""What a state means when iterations end early, fail in one batch, or overlap (both
paths): break, a dropped iterator, an exception in the loop body, a save at an epoch's
last batch, a batch that raises, a peek, ``zip(loader, loader)``, persistent workers,
restores into a loader that already iterated. Counted against torch's DataLoader where
torch defines the behaviour."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import savable_loader as sl
from savable_loader.errors import LoaderUsageError
from savable_loader.state import decode, encode
from tests.common import (
    RandomMapDataset,
    RangeSource,
    assert_streams,
    check_resume_everywhere,
    epochs_of,
)

pytestmark = pytest.mark.timeout(300)

N = 16


def dropin(num_workers: int = 0, persistent: bool = False, n: int = N, **kw) -> sl.SavableDataLoader:
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(
        RandomMapDataset(n),
        batch_size=2,
        shuffle=True,
        seed=3,
        num_workers=num_workers,
        persistent_workers=persistent,
        **kw,
    )


def pipeline(num_workers: int = 0, persistent: bool = False) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(num_workers=num_workers, seed=3)
    ds = sl.wrappers.BatchDataset(RangeSource(N, wc), batch_size=2)
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, persistent_workers=persistent, **kw)


def torch_loader(num_workers: int = 0, persistent: bool = False) -> DataLoader:
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    return DataLoader(
        RandomMapDataset(N), batch_size=2, shuffle=True, num_workers=num_workers, persistent_workers=persistent, **kw
    )


# -- break, dropped iterators, exceptions in the loop body, the last batch ------------------


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
def test_every_save_point_and_way_of_leaving_the_loop(make):
    check_resume_everywhere(make, epochs=2, variants=("live", "break", "raise"))


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
@pytest.mark.parametrize("persistent", [False, True])
def test_break_with_workers(make, persistent):
    check_resume_everywhere(
        lambda: make(num_workers=2, persistent=persistent),
        epochs=2,
        steps=[0, 3, 8, 11],
        variants=("live", "break", "raise"),
    )


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["dropin", "pipeline"])
def test_save_at_the_last_batch_restores_the_empty_rest_then_the_next_epoch(make):
    reference = epochs_of(make(), 2)
    loader = make()
    it = iter(loader)
    batches = [next(it) for _ in range(len(reference[0]))]
    state = decode(encode(loader.save_state_rank()))  # before StopIteration
    assert state.epoch == 0
    fresh = make()
    fresh.restore_state_rank(state)
    assert list(fresh) == []  # the epoch's (empty) rest: a loop counting epochs stays in step
    assert_streams(list(fresh), reference[1], "the next epoch")
    assert_streams(batches, reference[0], "epoch 0")
    assert list(it) == [] and loader.save_state_rank().epoch == 1  # after StopIteration: the next epoch


def test_break_then_the_live_loader_starts_the_next_epoch_like_torch():
    loader, ref = dropin(), torch_loader()
    for a, b in ((loader, "ours"), (ref, "torch")):
        for i, _ in enumerate(a):
            if i == 2:
                break
    assert len(list(loader)) == len(list(ref)) == N // 2  # a whole epoch, as torch
    state = loader.save_state_rank()
    assert state.epoch == 2 and state.position.consumed == 0


def test_an_iterator_never_advanced_consumes_nothing():
    # frameworks call iter() and may drop the result (Lightning does, around a restore)
    reference = epochs_of(dropin(), 2)
    loader = dropin(2, persistent=True)
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    fresh = dropin(2, persistent=True)
    fresh.restore_state_rank(state)
    unused = iter(fresh)
    assert fresh.save_state_rank().position == state.position
    del unused
    iter(fresh)
    assert_streams(list(fresh), reference[0][1:], "the restored epoch, after two unused iterators")
    assert_streams(list(fresh), reference[1], "the next epoch")


def test_explicit_close_and_garbage_collected_iterators_record_their_position():
    loader = dropin()
    it = iter(loader)
    next(it), next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    assert loader.save_state_rank().position.consumed == 4
    it = iter(loader)
    next(it)
    del it
    pos = loader.save_state_rank().position
    assert (pos.epoch, pos.consumed) == (1, 2)


# -- one batch raises ---------------------------------------------------------------------


class FailsAt(RandomMapDataset):
    def __init__(self, n: int, bad: set[int]) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.bad:
            raise KeyError(f"sample {i}")
        return super().__getitem__(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_batch_propagates_and_the_iteration_goes_on_like_torch(num_workers):
    bad = {3, 11}
    kw = {"multiprocessing_context": "fork"} if num_workers else {}

    def count(loader):
        it = iter(loader)
        got, errors = [], 0
        while True:
            try:
                got.append(next(it))
            except KeyError:
                errors += 1
                if isinstance(loader, sl.SavableDataLoader):
                    loader.save_state_rank()  # saving keeps working
            except StopIteration:
                return got, errors

    ours = sl.SavableDataLoader(FailsAt(N, bad), batch_size=2, seed=0, num_workers=num_workers, **kw)
    theirs = DataLoader(FailsAt(N, bad), batch_size=2, num_workers=num_workers, **kw)
    got, errors = count(ours)
    want, torch_errors = count(theirs)
    assert errors == torch_errors == 2
    assert [b[:, 0].tolist() for b in got] == [b[:, 0].tolist() for b in want]


def test_state_after_a_failing_batch_skips_it():
    reference = epochs_of(dropin(), 2)
    flat = [b for e in reference for b in e]
    order = [int(i) for b in reference[0] for i in b[:, 0]]
    bad = {order[4]}  # the third batch of epoch 0
    loader = sl.SavableDataLoader(FailsAt(N, bad), batch_size=2, shuffle=True, seed=3)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(KeyError):
        next(it)
    state = loader.save_state_rank()
    assert state.position.consumed == 6
    fresh = sl.SavableDataLoader(FailsAt(N, set()), batch_size=2, shuffle=True, seed=3)
    fresh.restore_state_rank(state)
    assert_streams(list(fresh) + list(fresh), flat[3:], "continuation after the failed batch")


# -- several iterators ----------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_zip_of_two_iterators_counts_like_torch(num_workers):
    pairs = list(zip(dropin(num_workers), dropin(num_workers)))
    loader = dropin(num_workers)
    ours = list(zip(loader, loader))
    theirs = list(zip(torch_loader(num_workers), torch_loader(num_workers)))
    assert len(ours) == len(theirs) == N // 2 == len(pairs)
    reference = epochs_of(dropin(), 2)
    assert_streams([a for a, _ in ours], reference[0], "first iterator: epoch 0")
    assert_streams([b for _, b in ours], reference[1], "second iterator: epoch 1")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_peek_inside_a_loop_neither_ends_the_loop_nor_skips_an_epoch(num_workers):
    def run(loader):
        seen, peeks = [], []
        for _ in range(2):
            count = 0
            for _batch in loader:
                count += 1
                if count == 3:
                    peeks.append(next(iter(loader)))
            seen.append(count)
        return seen, peeks

    ours, peeks = run(dropin(num_workers))
    theirs, _ = run(torch_loader(num_workers))
    assert ours == theirs == [N // 2, N // 2]
    reference = epochs_of(dropin(), 3)
    assert_streams(peeks, [reference[1][0], reference[2][0]], "each peek is the first batch of the next epoch")
    loader = dropin(num_workers)
    run(loader)
    assert loader.save_state_rank().epoch == 2  # two loops, two epochs: the peeks gave theirs back


def test_save_during_a_peek_loop_describes_the_loop():
    reference = epochs_of(dropin(), 2)
    loader = dropin()
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    next(iter(loader))  # a peek (dropped at once)
    state = loader.save_state_rank()
    assert (state.epoch, state.position.consumed) == (0, 6)
    fresh = dropin()
    fresh.restore_state_rank(state)
    assert_streams(first + list(fresh) + list(fresh), reference[0] + reference[1], "continuation")


def test_two_live_iterators_make_a_save_ambiguous():
    loader = dropin()
    a, b = iter(loader), iter(loader)
    next(a), next(b)
    with pytest.raises(LoaderUsageError, match="2 iterations of this loader are in progress"):
        loader.save_state_rank()
    b.close()  # b was started beside a and gives its epoch back: the save describes a
    assert loader.save_state_rank().position.consumed == 2
    assert [x.epoch for x in (a,)] == [0]
    rest = list(a)
    assert len(rest) == N // 2 - 1
    assert iter(loader).epoch == 1


@pytest.mark.parametrize(
    "make", [lambda: dropin(2, persistent=True), lambda: pipeline(0)], ids=["persistent", "pipeline"]
)
def test_one_pool_a_new_iter_supersedes_the_live_iterator(make):
    loader = make()
    a = iter(loader)
    next(a)
    b = iter(loader)
    next(b)  # b's iteration begins: a's is over
    with pytest.raises(LoaderUsageError, match="superseded by a later iter"):
        next(a)
    assert len(list(b)) == N // 2 - 1
    ref = DataLoader(RandomMapDataset(N), batch_size=2, num_workers=2, persistent_workers=True)
    assert iter(ref) is iter(ref)  # torch: one iterator, reset


def test_persistent_workers_zip_like_torch_gives_a_clear_error():
    loader = dropin(2, persistent=True)
    with pytest.raises(LoaderUsageError, match="persistent workers are one pool"):
        list(zip(loader, loader))


# -- restores -------------------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True])
def test_restore_into_a_loader_that_already_iterated(persistent):
    reference = epochs_of(dropin(), 3)
    source = dropin()
    it = iter(source)
    next(it), next(it), next(it)
    state = source.save_state_rank()
    loader = dropin(2, persistent=persistent)
    list(loader)
    for i, _ in enumerate(loader):  # an abandoned second epoch too
        if i == 1:
            break
    loader.restore_state_rank(state)
    assert_streams(list(loader), reference[0][3:], "the restored epoch")
    assert_streams(list(loader), reference[1], "the next epoch")


def test_restore_twice_the_second_wins():
    reference = epochs_of(dropin(), 2)
    states = []
    loader = dropin()
    it = iter(loader)
    for _ in range(5):
        next(it)
        states.append(loader.save_state_rank())
    fresh = dropin()
    fresh.restore_state_rank(states[4])
    fresh.restore_state_rank(states[1])
    assert fresh.save_state_rank().position == states[1].position
    assert_streams(list(fresh), reference[0][2:], "after the second restore")


def test_len_and_remaining_after_a_restore():
    loader = dropin()
    it = iter(loader)
    next(it), next(it), next(it)
    assert loader.remaining() == N // 2 - 3
    state = loader.save_state_rank()
    fresh = dropin()
    fresh.restore_state_rank(state)
    assert len(fresh) == N // 2  # a whole epoch, as torch
    assert fresh.remaining() == N // 2 - 3
    assert len(list(fresh)) == N // 2 - 3
    assert fresh.remaining() == N // 2


def test_remaining_of_an_endless_stream_is_none():
    """A pipeline has no length: ``remaining()`` says no end is known (``None``, which
    ``tqdm(total=...)`` takes), before, during and after a restore, never a TypeError."""

    class Endless(sl.SavableDataset):
        _savable_fields = ("pos",)

        def __init__(self, wc):
            super().__init__(wc)
            self.reset_state_own()

        def reset_state_own(self):
            self.pos = 0

        def __iter__(self):
            while True:
                self.pos += 1
                yield self.pos

        def config(self):
            return {}

    wc = sl.WorkerConfig(num_workers=0, seed=0)
    loader = sl.SavableDataLoader(Endless(wc), batch_size=None, worker_config=wc)
    assert loader.remaining() is None
    it = iter(loader)
    assert [next(it) for _ in range(3)] == [1, 2, 3]
    assert loader.remaining() is None
    state = loader.save_state_rank()
    it.close()
    assert loader.remaining() is None
    fresh = sl.SavableDataLoader(Endless(wc), batch_size=None, worker_config=wc)
    fresh.restore_state_rank(state)
    assert fresh.remaining() is None
    assert next(iter(fresh)) == 4


def test_set_epoch_after_a_restore():
    loader = dropin()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    fresh = dropin()
    fresh.restore_state_rank(state)
    fresh.set_epoch(0)  # the restored epoch: kept
    with pytest.raises(LoaderUsageError, match="continues epoch 0"):
        fresh.set_epoch(1)
    assert len(list(fresh)) == N // 2 - 1
    fresh.set_epoch(5)
    assert iter(fresh).epoch == 5 and fresh.sampler.epoch == 6
    # at an epoch's empty rest, the following epoch may be set
    done = dropin()
    it = iter(done)
    for _ in range(N // 2):
        next(it)
    last = done.save_state_rank()
    again = dropin()
    again.restore_state_rank(last)
    again.set_epoch(1)
    assert iter(again).epoch == 1


def test_seed_none_follows_torch_manual_seed_and_adopts_a_restored_seed():
    def make(seed=None):
        return sl.SavableDataLoader(RandomMapDataset(N), batch_size=2, shuffle=True, seed=seed)

    torch.manual_seed(1)
    a = make()
    torch.manual_seed(1)
    b = make()
    torch.manual_seed(2)
    c = make()
    assert a.seed == b.seed != c.seed
    assert_streams(list(a), list(b), "same torch seed")
    it = iter(c)
    next(it)
    state = c.save_state_rank()
    torch.manual_seed(9)
    fresh = make()
    fresh.restore_state_rank(state)
    assert fresh.seed == c.seed
    assert_streams(list(fresh), list(it), "continuation with the adopted seed")
    with pytest.raises(sl.ConfigMismatchError) as info:
        make(seed=c.seed + 1).restore_state_rank(state)
    assert info.value.field == "seed"


def test_loader_sampler_set_epoch_chooses_the_next_epochs_order():
    reference = epochs_of(dropin(), 4)
    loader = dropin()
    assert loader.sampler.epoch == 0 and len(loader.sampler) == N
    loader.sampler.set_epoch(3)
    assert loader.sampler.epoch == 3
    assert loader.sampler.indices() == [int(i) for b in reference[3] for i in b[:, 0]]
    assert_streams(list(loader), reference[3], "epoch 3")
    assert loader.save_state_rank().epoch == 4
