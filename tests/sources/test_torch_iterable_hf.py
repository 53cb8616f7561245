"""A real Hugging Face ``datasets.IterableDataset`` (local data, 4 shards) in
SavableDataLoader: the batches torch's DataLoader gives, and resume at every step through
its own ``state_dict()`` (no replay), random augmentation inside its ``map`` included."""

from __future__ import annotations

import multiprocessing
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import savable_loader as sl
from savable_loader.state import decode, encode
from tests.common import check_resume_everywhere, epochs_of
from tests.wrapper_common import set_snapshot_policy

datasets = pytest.importorskip("datasets")

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("error::savable_loader.sources.ReplayWarning")]

N = 26
CALLS: list[Any] = [None]  # a fork-shared counter of augment() calls, set by a test


def augment(example: dict[str, Any]) -> dict[str, Any]:
    """Random draws from the three global RNGs inside the dataset's own pipeline."""
    if CALLS[0] is not None:
        with CALLS[0].get_lock():
            CALLS[0].value += 1
    return {"noise": [random.random(), float(np.random.rand()), float(torch.rand(()))]}


def hf(n: int = N) -> Any:
    table = {"x": list(range(n)), "text": [f"t{i}" for i in range(n)]}
    return datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=4).map(augment)


def loader(num_workers: int, context: str = "fork", **kw: Any) -> sl.SavableDataLoader:
    kw.setdefault("batch_size", 4)
    if num_workers:
        kw["multiprocessing_context"] = context
    return sl.SavableDataLoader(hf(), num_workers=num_workers, seed=2, **kw)


def xs(stream: list[dict[str, Any]]) -> list[list[int]]:
    return [b["x"].tolist() for b in stream]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_torch(num_workers):
    ours = epochs_of(loader(num_workers), 2)
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    theirs = epochs_of(DataLoader(hf(), batch_size=4, num_workers=num_workers, **kw), 2)
    assert [xs(e) for e in ours] == [xs(e) for e in theirs]
    assert sorted(x for b in xs(ours[0]) for x in b) == list(range(N))
    first = ours[0][0]
    assert set(first) == {"x", "text", "noise"} and first["text"] == [f"t{i}" for i in first["x"].tolist()]


@pytest.mark.parametrize(("num_workers", "steps"), [(0, None), (2, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 13, 14])])
def test_resume_everywhere_without_replay(num_workers, steps):
    factory = lambda: loader(num_workers)
    epochs = epochs_of(factory(), 2)
    assert not torch.equal(epochs[0][0]["noise"][0], epochs[1][0]["noise"][0]), "the augmentation drew the same numbers"
    assert check_resume_everywhere(factory, 2, steps=steps, variants=("live", "break", "raise")) >= 30


def test_restore_reads_no_example_twice(monkeypatch):
    """With a snapshot before every batch, the resumed run runs ``map`` exactly for the
    examples left (2 workers, fork: a shared counter)."""
    set_snapshot_policy(monkeypatch, "every")
    CALLS[0] = multiprocessing.get_context("fork").Value("i", 0)
    try:
        for k in (1, 2, 5):
            ld = loader(2)
            it = iter(ld)
            seen = [next(it) for _ in range(k)]
            state = ld.save_state_rank()
            it.close()
            fresh = loader(2, prefetch_factor=1)
            fresh.restore_state_rank(decode(encode(state)))
            CALLS[0].value = 0
            rest = list(fresh)
            left = N - sum(len(b["x"]) for b in seen)
            assert sum(len(b["x"]) for b in rest) == left
            assert CALLS[0].value == left, f"k={k}: map ran {CALLS[0].value} times for {left} examples left"
    finally:
        CALLS[0] = None


def test_unbatched_restored_into_spawn_workers():
    # the stream does not depend on the start method: fork for the reference and the
    # saves, spawn (each worker imports torch and datasets: slow) for one restore
    fork = lambda: loader(2, batch_size=None)
    spawn = lambda: loader(2, context="spawn", batch_size=None)
    assert check_resume_everywhere(fork, 1, restore_factory=spawn, steps=[5]) == 1


def test_no_replay_warning_and_state_is_plain():
    ld = loader(0)
    it = iter(ld)
    next(it)
    state = ld.save_state_rank()
    it.close()
    node = state.position.workers[0].dataset
    assert node.fields["user_state"]["state_dict"]["epoch"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader(0).restore_state_rank(decode(encode(state)))


def test_two_ranks_split_by_node():
    """Each rank reads its part (``split_dataset_by_node``) and resumes its own state."""
    from datasets.distributed import split_dataset_by_node

    def rank_loader(rank: int) -> sl.SavableDataLoader:
        wc = sl.WorkerConfig(rank=rank, world_size=2, num_workers=2, seed=2)
        part = split_dataset_by_node(hf(), rank=rank, world_size=2)
        return sl.SavableDataLoader(part, batch_size=3, worker_config=wc, multiprocessing_context="fork")

    seen = []
    for rank in range(2):
        whole = list(rank_loader(rank))
        ld = rank_loader(rank)
        it = iter(ld)
        head = [next(it) for _ in range(2)]
        state = decode(encode(ld.save_state_rank()))
        it.close()
        assert state.config.rank == rank and state.config.world_size == 2
        again = rank_loader(rank)
        again.restore_state_rank(state)
        rest = list(again)
        assert xs(head + rest) == xs(whole)
        assert [b["noise"][0].tolist() for b in head + rest] == [b["noise"][0].tolist() for b in whole]
        seen += [x for b in xs(whole) for x in b]
    assert sorted(seen) == list(range(N))


def shuffled(seed: int | None = 1) -> Any:
    """The common way to stream: shards, a shuffle buffer, a random augmentation."""
    table = {"x": list(range(N)), "text": [f"t{i}" for i in range(N)]}
    iterable = datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=4)
    return iterable.shuffle(seed=seed, buffer_size=5).map(augment)


@pytest.mark.parametrize(("num_workers", "steps"), [(0, None), (2, [0, 1, 2, 3, 5, 6, 7])])
def test_a_shuffle_buffer_resumes_exactly_by_replay(num_workers, steps):
    """``.shuffle(buffer_size=...)``: its own load_state_dict() refills the buffer with
    other examples, so the loader replays the epoch from its start under the same seed:
    every save point resumes with the batches (and draws) of the uninterrupted run."""
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    factory = lambda: sl.SavableDataLoader(shuffled(), batch_size=4, num_workers=num_workers, seed=2, **kw)
    first = [b["x"].tolist() for b in epochs_of(factory(), 1)[0]]
    assert sorted(x for b in first for x in b) == list(range(N)) and first != sorted(first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sl.sources.ReplayWarning)  # said and checked below
        assert check_resume_everywhere(factory, 2, steps=steps, variants=("live", "break")) >= 10


def test_a_shuffle_buffer_restore_says_it_replays_and_what_it_costs():
    """No "yields other examples" warning at construction (the resume is exact now); the
    restore says it replays, how much, and the way to avoid it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ld = sl.SavableDataLoader(shuffled(), batch_size=4, seed=2)
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = decode(encode(ld.save_state_rank()))
    rest = list(it)
    again = sl.SavableDataLoader(shuffled(), batch_size=4, seed=2)
    with pytest.warns(sl.sources.ReplayWarning) as record:
        again.restore_state_rank(state)
    (message,) = [str(w.message) for w in record]
    assert "shuffles with a buffer (.shuffle(buffer_size=...)), which its load_state_dict() does not restore" in message
    assert "exactly, by iterating it again from the epoch's start under the same shuffle seed" in message
    assert "(worker 0: 12 items)" in message and "costs as long as producing them did" in message
    assert "ds.shuffle(seed=...) before to_iterable_dataset()" in message
    assert [b["x"].tolist() for b in again] == [b["x"].tolist() for b in rest]


def test_a_shuffle_buffer_without_a_seed_is_refused_by_a_later_job():
    """``.shuffle(buffer_size=...)`` without ``seed=`` draws a seed per job: a replay
    would give other examples, so the restore is refused and names the setting."""
    ld = sl.SavableDataLoader(shuffled(seed=None), batch_size=4, seed=2)
    it = iter(ld)
    next(it)
    state = ld.save_state_rank()
    again = sl.SavableDataLoader(shuffled(seed=None), batch_size=4, seed=2)
    with pytest.raises(sl.errors.ConfigMismatchError, match="shuffle_buffers"):
        again.restore_state_rank(state)
