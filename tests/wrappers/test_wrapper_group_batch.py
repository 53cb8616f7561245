"""GroupBatchDataset: a batch per full bucket, partial buckets at the end (or dropped),
the buckets in the state; resume and restore keys."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.state import decode, encode
from savable_loader.wrappers import GroupBatchDataset
from tests.common import RangeSource, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES_FAST,
    check_restore_samples,
    make_loader,
    make_wc,
    resume_steps,
    round_robin,
    set_snapshot_policy,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 23


def group_of(v: int):
    """Buckets of unequal rates, with tuple keys (kept as tuples in a state)."""
    return (v % 3 == 0, "a" if v % 2 else "b")


def grouped(num_workers: int, batch_size: int = 3, **kw) -> GroupBatchDataset:
    wc = make_wc(num_workers)
    return GroupBatchDataset(RangeSource(N, wc), batch_size, lambda x: group_of(int(x[0])), **kw)


def expected(values: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    buckets: dict = {}
    out = []
    for v in values:
        bucket = buckets.setdefault(group_of(v), [])
        bucket.append(v)
        if len(bucket) == batch_size:
            out.append(bucket)
            del buckets[group_of(v)]
    if not drop_last:
        out += list(buckets.values())
    return out


def batch_ids(batch) -> list[int]:
    return [int(v) for v in batch[:, 0]]


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES_FAST)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: make_loader(grouped(num_workers))
    epoch_len = len(list(factory()))
    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, epoch_len)) >= 9


def test_resume_drop_last():
    assert check_resume_everywhere(lambda: make_loader(grouped(0, drop_last=True)), 2) >= 9


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_per_bucket(num_workers, drop_last):
    workers = max(num_workers, 1)
    want = round_robin([expected(worker_values(N, w, workers), 3, drop_last) for w in range(workers)])
    got = [[batch_ids(b) for b in e] for e in epochs_of(make_loader(grouped(num_workers, drop_last=drop_last)), 2)]
    assert got == [want, want]
    for batch in want:
        assert len({group_of(v) for v in batch}) == 1
        if drop_last:
            assert len(batch) == 3


def test_state_holds_the_buckets(monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    loader = make_loader(grouped(0))
    it = iter(loader)
    assert [batch_ids(next(it)) for _ in range(2)] == [[1, 5, 7], [2, 4, 8]]
    state = decode(encode(loader.save_state_rank()))
    ws = state.position.workers[0]
    assert (ws.snapshot_index, ws.index) == (2, 2)  # the snapshot taken as the second batch left
    buckets = ws.dataset.fields["buckets"]
    # after 0..8 (two full buckets yielded): (True, "b") holds 0 and 6, (True, "a") 3
    assert [decode_sample(b[0]) for b in buckets] == [(True, "b"), (True, "a")]  # tuples stay tuples
    assert [[int(decode_sample(s)[0]) for s in b[1]] for b in buckets] == [[0, 6], [3]]
    assert [b[2] for b in buckets] == [[0, 6], [3]]  # the samples' restore keys
    del it


def decode_sample(value):
    from savable_loader.dataset.values import from_plain

    return from_plain(value)


def test_restore_sample():
    assert check_restore_samples(lambda: grouped(0), epochs=2) == 8
    with pytest.raises(RestoreKeyError, match="GroupBatchDataset key must be a non-empty list of sample keys"):
        grouped(0).restore_sample([])


def test_bad_group_key_and_arguments():
    wc = make_wc(0)
    with pytest.raises(
        LoaderUsageError, match=r"key_fn must return None, bool, int, float, str or a tuple of them, got \[1\]"
    ):
        list(GroupBatchDataset(RangeSource(3, wc), 2, lambda x: [1]))
    with pytest.raises(LoaderUsageError, match="batch_size must be a positive int, got 0"):
        GroupBatchDataset(RangeSource(3, wc), 0, len)
    with pytest.raises(LoaderUsageError, match="key_fn must be callable, got 3"):
        GroupBatchDataset(RangeSource(3, wc), 2, 3)
    with pytest.raises(LoaderUsageError, match="collate_fn must be callable, got 'x'"):
        GroupBatchDataset(RangeSource(3, wc), 2, len, collate_fn="x")


def test_custom_collate():
    wc = make_wc(0)
    ds = GroupBatchDataset(
        RangeSource(6, wc), 2, lambda x: int(x[0]) % 2, collate_fn=lambda s: torch.stack(s)[:, 0].tolist()
    )
    assert list(ds) == [[0, 2], [1, 3], [4], [5]]


class Parity(enum.IntEnum):
    EVEN = 0
    ODD = 1


@pytest.mark.parametrize(
    "key_fn",
    [
        lambda x: x[: 1 + int(x[0]) % 2].shape,  # torch.Size, the docstring's example
        lambda x: Parity(int(x[0]) % 2),
        lambda x: (np.int64(int(x[0]) % 3), np.float32(0.5), np.bool_(True)),
    ],
    ids=["torch-size", "int-enum", "numpy-scalars"],
)
def test_group_keys_of_subclasses_and_numpy_scalars_resume_exactly(key_fn, monkeypatch):
    # a state refuses tuple / int subclasses: the buckets hold the plain value the key
    # equals (same buckets), so that a snapshot can be taken while a bucket is partial
    set_snapshot_policy(monkeypatch, "every")
    factory = lambda: make_loader(GroupBatchDataset(RangeSource(N, make_wc(0)), 3, key_fn))
    assert check_resume_everywhere(factory, 2) >= 2 * 8
    loader = factory()
    it = iter(loader)
    next(it)
    buckets = decode(encode(loader.save_state_rank())).position.workers[0].dataset.fields["buckets"]
    assert all(type(decode_sample(b[0])) in (tuple, int) for b in buckets)
    del it


def test_group_keys_are_bucketed_by_value():
    wc = make_wc(0)
    ids = lambda b: [int(x[0]) for x in b]
    plain = GroupBatchDataset(RangeSource(12, wc), 2, lambda x: int(x[0]) % 3, collate_fn=ids)
    numpy = GroupBatchDataset(RangeSource(12, wc), 2, lambda x: np.int8(int(x[0]) % 3), collate_fn=ids)
    assert list(numpy) == list(plain) == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
