"""BatchDataset: batch sizes, the last partial batch (kept / dropped), custom collate_fn."""

from __future__ import annotations

import random
import time

import pytest
import torch

from savable_loader.errors import LoaderUsageError
from savable_loader.state import decode, encode
from savable_loader.wrappers import BatchDataset, MapDataset
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    make_loader,
    make_wc,
    resume_steps,
    round_robin,
    set_snapshot_policy,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 23  # 2 workers: 12 and 11 samples; worker 1 ends on a partial batch of 4 (of 5: worker 0 too)


def ids_and_draw(batch: list[torch.Tensor]) -> dict:
    """A custom collate: the ids as a list and one draw from the global RNG."""
    return {"ids": [int(x[0]) for x in batch], "size": len(batch), "draw": random.random()}


def expected_batches(num_workers: int, batch_size: int, drop_last: bool, n: int = N) -> list[list[int]]:
    """The ids of every batch, computed per worker without the loader."""
    workers = max(num_workers, 1)
    streams = []
    for w in range(workers):
        values = worker_values(n, w, workers)
        batches = [values[i : i + batch_size] for i in range(0, len(values), batch_size)]
        if drop_last and batches and len(batches[-1]) < batch_size:
            batches.pop()
        streams.append(batches)
    return round_robin(streams)


def batch_loader(num_workers: int, batch_size: int = 4, **kw):
    wc = make_wc(num_workers)
    ds = MapDataset(RangeSource(N, wc), lambda x: x * 2 + int(torch.randint(0, 5, ())))
    return make_loader(BatchDataset(ds, batch_size, **kw))


# RESUME_CASES, with and without drop_last in-process; one of each with workers (slow)
CASES = [
    pytest.param(*case.values, drop_last, id=f"{case.id}-{'drop' if drop_last else 'keep'}")
    for case in RESUME_CASES
    for drop_last in (False, True)
    if case.values[0] == 0 or drop_last == (case.values[1] == "every")
]


@pytest.mark.parametrize(("num_workers", "policy", "drop_last"), CASES)
def test_resume_at_every_step(num_workers, policy, drop_last, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    batch_size = 2 if num_workers == 0 else 3
    epoch_len = len(expected_batches(num_workers, batch_size, drop_last))
    steps = resume_steps(num_workers, epoch_len)
    factory = lambda: batch_loader(num_workers, batch_size, drop_last=drop_last)
    assert check_resume_everywhere(factory, 2, steps=steps) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_resumes(num_workers):
    steps = [0, 3, 6] if num_workers else None
    factory = lambda: batch_loader(num_workers, 3, collate_fn=ids_and_draw)
    assert check_resume_everywhere(factory, 2, steps=steps) >= 3


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_batch_sizes_and_contents(num_workers, drop_last):
    wc = make_wc(num_workers)
    loader = make_loader(BatchDataset(RangeSource(N, wc), 4, drop_last=drop_last))
    want = expected_batches(num_workers, 4, drop_last)
    sizes = [len(b) for b in want]
    if num_workers == 0:
        assert sizes == ([4] * 5 if drop_last else [4] * 5 + [3])
    else:
        assert sizes == ([4] * 5 if drop_last else [4, 4, 4, 4, 4, 3])
    for epoch in epochs_of(loader, 2):
        # default_collate stacks the samples: one (batch, 4) tensor per batch
        assert [tuple(b.shape) for b in epoch] == [(s, 4) for s in sizes]
        assert [b[:, 0].tolist() for b in epoch] == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_fn(num_workers):
    wc = make_wc(num_workers)
    loader = make_loader(BatchDataset(RangeSource(N, wc), 5, collate_fn=ids_and_draw))
    a, b = epochs_of(loader, 2)
    want = expected_batches(num_workers, 5, False)
    for epoch in (a, b):
        assert [x["ids"] for x in epoch] == want
        assert [x["size"] for x in epoch] == [len(ids) for ids in want]
    # collate_fn runs under the per-batch seeding: draws differ per batch and per epoch,
    # and repeat across runs
    assert len({x["draw"] for x in a}) == len(a)
    assert [x["draw"] for x in a] != [x["draw"] for x in b]
    assert [x["draw"] for x in a] == [
        x["draw"] for x in list(make_loader(BatchDataset(RangeSource(N, wc), 5, collate_fn=ids_and_draw)))
    ]


def test_batch_larger_than_the_data():
    wc = make_wc(0)
    assert [b[:, 0].tolist() for b in make_loader(BatchDataset(RangeSource(3, wc), 8))] == [[0, 1, 2]]
    assert list(make_loader(BatchDataset(RangeSource(3, wc), 8, drop_last=True))) == []


def test_batch_size_one():
    wc = make_wc(0)
    got = list(make_loader(BatchDataset(RangeSource(4, wc), 1)))
    assert [tuple(b.shape) for b in got] == [(1, 4)] * 4
    assert [int(b[0, 0]) for b in got] == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None])
def test_bad_batch_size(bad):
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match=rf"BatchDataset batch_size must be a positive int, got {bad!r}"):
        BatchDataset(RangeSource(3, wc), bad)


def test_other_arguments():
    wc = make_wc(0)
    with pytest.raises(TypeError, match="BatchDataset collate_fn must be callable, got 'stack'"):
        BatchDataset(RangeSource(3, wc), 2, collate_fn="stack")
    with pytest.raises(LoaderUsageError, match="BatchDataset wraps a SavableDataset, got list"):
        BatchDataset([], 2)
    ds = BatchDataset(RangeSource(3, wc), 2, drop_last=True, collate_fn=ids_and_draw)
    tree = ds.config_tree()
    assert (tree["batch_size"], tree["drop_last"], tree["collate_fn"]) == (2, True, f"{__name__}.ids_and_draw")


class SlowSecondWorker(RangeSource):
    """RangeSource whose worker 1 takes 20 ms a sample: worker 0 runs far ahead."""

    def __iter__(self):
        for x in super().__iter__():
            if self.worker_config.rank_worker_id() == 1:
                time.sleep(0.02)
            yield x


def test_save_after_a_worker_ran_out_ahead_of_the_main_process():
    # Regression: torch retires a worker as soon as it *receives* that worker's end of
    # iteration, which with prefetching comes before the main process has yielded the
    # worker's last batches; a save then asked a process that had exited
    # (WorkerDiedError "exited with code 0"). Workers now hold their end back until the
    # main process has taken their end marker.
    wc = make_wc(2)

    def factory():
        return make_loader(BatchDataset(SlowSecondWorker(24, wc), 2), prefetch_factor=4)

    reference = list(factory())
    loader = factory()
    states = []
    for _ in loader:
        states.append(encode(loader.save_state_rank()))
    assert len(states) == len(reference) == 12
    for k in (5, 8):
        fresh = factory()
        fresh.restore_state_rank(decode(states[k - 1]))
        assert_streams(list(fresh), reference[k:], f"resumed after {k} batches")
