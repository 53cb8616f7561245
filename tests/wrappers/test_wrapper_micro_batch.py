"""MicroBatchDataset: splitting tensors, dicts and nested batches, the smaller last
micro-batch, clear errors for a micro size larger than the batch; resume and restore keys."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch

from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers import BatchDataset, MapDataset, MicroBatchDataset
from tests.common import RangeSource, assert_same, check_resume_everywhere, epochs_of
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

N = 17
Pair = namedtuple("Pair", ["a", "b"])


def as_dict(samples):
    """A collate that makes a nested batch: a dict of a tensor, an array, a list of
    strings, a nested dict and a scalar."""
    x = torch.stack(samples)
    return {
        "x": x,
        "ids": x[:, 0].numpy().copy(),
        "names": [f"s{int(s[0])}" for s in samples],
        "nested": {"y": x[:, 1:] * 2, "list": [x[:, 2], x[:, 3]]},
        "size": len(samples),
    }


def micro(num_workers: int, batch_size: int = 5, micro_size: int = 2, collate=None):
    wc = make_wc(num_workers)
    return MicroBatchDataset(BatchDataset(RangeSource(N, wc), batch_size, collate_fn=collate), micro_size)


def micro_ids(item) -> list[int]:
    x = item["x"] if isinstance(item, dict) else item
    return [int(v) for v in x[:, 0]]


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES_FAST)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: make_loader(micro(num_workers, collate=as_dict))
    epoch_len = len(list(factory()))
    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, epoch_len)) >= 9


@pytest.mark.parametrize(("batch_size", "micro_size"), [(5, 2), (5, 5), (4, 2), (6, 4), (5, 1)])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_split_order_and_sizes(num_workers, batch_size, micro_size):
    workers = max(num_workers, 1)
    streams = []
    for w in range(workers):
        values = worker_values(N, w, workers)
        batches = [values[i : i + batch_size] for i in range(0, len(values), batch_size)]
        streams.append([b[j : j + micro_size] for b in batches for j in range(0, len(b), micro_size)])
    got = [[micro_ids(x) for x in e] for e in epochs_of(make_loader(micro(num_workers, batch_size, micro_size)), 2)]
    assert got == [round_robin(streams)] * 2


def test_nested_structures_are_split_leaf_by_leaf():
    wc = make_wc(0)
    batch = {
        "t": torch.arange(10).reshape(5, 2),
        "a": np.arange(5),
        "pair": Pair(torch.arange(5), (torch.arange(5) * 2, ["a", "b", "c", "d", "e"])),
        "fields": [torch.ones(5), {"deep": torch.zeros(5, 3)}],
        "scalar": torch.tensor(7),
        "label": "constant",
    }
    ds = MicroBatchDataset(MapDataset(RangeSource(1, wc), lambda x: batch), 2, batch_size=5)
    parts = list(ds)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        a, b = 2 * i, min(2 * i + 2, 5)
        want = {
            "t": batch["t"][a:b],
            "a": batch["a"][a:b],
            "pair": Pair(torch.arange(5)[a:b], (torch.arange(5)[a:b] * 2, ["a", "b", "c", "d", "e"][a:b])),
            "fields": [torch.ones(5)[a:b], {"deep": torch.zeros(5, 3)[a:b]}],
            "scalar": torch.tensor(7),
            "label": "constant",
        }
        assert_same(part, want, f"micro-batch {i}")
        assert type(part["pair"]) is Pair


def test_plain_tensor_batches_and_last_smaller():
    wc = make_wc(0)
    ds = MicroBatchDataset(MapDataset(RangeSource(2, wc), lambda x: torch.arange(7) + 10 * int(x[0])), 3, batch_size=7)
    assert [p.tolist() for p in ds] == [[0, 1, 2], [3, 4, 5], [6], [10, 11, 12], [13, 14, 15], [16]]


def test_micro_larger_than_the_batch_is_a_clear_error():
    wc = make_wc(0)
    with pytest.raises(
        LoaderUsageError,
        match=r"micro_batch_size=8 is larger than the batch size 4: expected a micro-batch size of at most 4",
    ):
        MicroBatchDataset(BatchDataset(RangeSource(10, wc), 4), 8)
    with pytest.raises(LoaderUsageError, match=r"micro_batch_size=8 is larger than the batch size 6"):
        MicroBatchDataset(MapDataset(BatchDataset(RangeSource(10, wc), 4), lambda x: x), 8, batch_size=6)
    # unknown batch size: found at run time
    ds = MicroBatchDataset(MapDataset(BatchDataset(RangeSource(10, wc), 4), lambda x: x), 8)
    with pytest.raises(LoaderUsageError, match=r"micro_batch_size=8 is larger than a batch of 4 samples"):
        list(ds)
    # known batch size: a short last batch is fine
    assert [micro_ids(x) for x in MicroBatchDataset(BatchDataset(RangeSource(10, wc), 4), 3)] == [
        [0, 1, 2],
        [3],
        [4, 5, 6],
        [7],
        [8, 9],
    ]


def test_inconsistent_or_empty_batches():
    wc = make_wc(0)
    bad = MicroBatchDataset(MapDataset(RangeSource(1, wc), lambda x: {"a": torch.zeros(4), "b": torch.zeros(3)}), 2)
    with pytest.raises(LoaderUsageError, match=r"differ in batch size: \{\"batch\['a'\]\": 4, \"batch\['b'\]\": 3\}"):
        list(bad)
    nothing = MicroBatchDataset(MapDataset(RangeSource(1, wc), lambda x: 5), 2)
    with pytest.raises(LoaderUsageError, match="found nothing to split in a batch of type int"):
        list(nothing)


def test_restore_sample():
    assert check_restore_samples(lambda: micro(0, 5, 2, collate=as_dict), epochs=2) == 8
    ds = micro(0, 5, 2)
    for bad in (3, [[0, 1]], [[0, 1], -1], [[0, 1], "0"]):
        with pytest.raises(RestoreKeyError, match=r"MicroBatchDataset key must be \[batch key, micro index\]"):
            ds.restore_sample(bad)
    with pytest.raises(RestoreKeyError, match="micro index 3 is past the end of a batch of 5 samples"):
        ds.restore_sample([[0, 1, 2, 3, 4], 3])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_sizes(bad):
    wc = make_wc(0)
    with pytest.raises(
        LoaderUsageError, match=rf"MicroBatchDataset micro_batch_size must be a positive int, got {bad!r}"
    ):
        MicroBatchDataset(BatchDataset(RangeSource(3, wc), 2), bad)
    if bad is not None:
        with pytest.raises(
            LoaderUsageError, match=rf"MicroBatchDataset batch_size must be a positive int, got {bad!r}"
        ):
            MicroBatchDataset(RangeSource(3, wc), 2, batch_size=bad)


def test_config():
    assert micro(0, 5, 2).config() == {"micro_batch_size": 2, "batch_size": 5}


def test_loader_restore_keys_through_the_new_wrappers(tmp_path):
    """Keys of a 2-worker, 2-epoch run through every new wrapper rebuild the items the
    loader yielded (``loader.restore_sample``), in the same and in a fresh loader."""
    import random

    import savable_loader as sl
    from savable_loader.wrappers import (
        BlendDataset,
        ConcatDataset,
        EpochizeDataset,
        GcDataset,
        GroupBatchDataset,
        LogSampleDataset,
        PackingDataset,
        RepeatDataset,
    )

    def build():
        wc = make_wc(2)

        def docs(n, offset):
            return MapDataset(
                RangeSource(n, wc), lambda x: offset + x[:1].repeat(1 + int(x[0]) % 5) + torch.randint(0, 9, (1,))
            )

        mixed = BlendDataset([docs(12, 0), ConcatDataset([docs(6, 100), docs(8, 200)])], [1.0, 2.0])
        rows = PackingDataset(mixed, 6, strategy="best_fit", buffer_size=3, bos=-1)
        rows = EpochizeDataset(RepeatDataset(GcDataset(rows, 4, generation=0, freeze=False)), 24)
        grouped = GroupBatchDataset(rows, 2, lambda r: int(r[1]) // 100, drop_last=True)
        batches = MicroBatchDataset(BatchDataset(MapDataset(grouped, lambda b: b.float() + torch.rand(())), 2), 1)
        return make_loader(LogSampleDataset(batches, tmp_path))

    loader = build()
    run = [(loader.restore_key, item) for _ in range(2) for item in loader]
    assert {k.epoch for k, _ in run} == {0, 1} and {k.worker for k, _ in run} == {0, 1}
    fresh = build()
    assert len(run) >= 10
    for i in random.Random(0).sample(range(len(run)), 10):
        key, item = run[i]
        assert_same(loader.restore_sample(key), item, f"item {i} ({key})")
        assert_same(fresh.restore_sample(sl.state.RestoreKey.parse(str(key))), item, f"item {i} in a fresh loader")
