"""ShuffleBufferDataset: a permutation per epoch, reshuffled every epoch, the buffer in the
state, and a restore that never reads the source again."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import savable_loader as sl
from savable_loader._values import from_plain
from savable_loader.errors import LoaderUsageError
from savable_loader.state import decode, encode
from savable_loader.state.schema import ArrayValue, DatasetState
from savable_loader.wrappers import ShuffleBufferDataset
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    make_loader,
    make_wc,
    resume_steps,
    set_snapshot_policy,
    split_by_worker,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 20
SIZE = 5

# Values each in-process ForwardOnlySource produced, per source id (reads, not draws).
READS: dict[str, list[int]] = {}


class ForwardOnlySource(sl.SavableDataset):
    """A stream that can only go forward: no ``__getitem__``, and every value it produces
    is logged under ``log_id`` (in-process loaders only), so a test can see whether a
    restore reads any value twice."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig, log_id: str) -> None:
        super().__init__(worker_config)
        self.n = n
        self.log_id = log_id
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = 0

    def __iter__(self):
        while self.pos < self.n:
            value = self.pos
            self.pos += 1
            READS.setdefault(self.log_id, []).append(value)
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def shuffled_loader(num_workers: int, size: int = SIZE, n: int = N):
    wc = make_wc(num_workers)
    return make_loader(ShuffleBufferDataset(RangeSource(n, wc), size))


def ids(epoch: list[torch.Tensor]) -> list[int]:
    return [int(x[0]) for x in epoch]


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    steps = resume_steps(num_workers, N)
    assert check_resume_everywhere(lambda: shuffled_loader(num_workers), 2, steps=steps) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_permutation_per_epoch_reshuffled(num_workers):
    workers = max(num_workers, 1)
    a = epochs_of(shuffled_loader(num_workers), 3)
    orders = [ids(e) for e in a]
    for order in orders:
        # each worker yields a permutation of its share of the source
        for w, mine in enumerate(split_by_worker(order, workers)):
            assert sorted(mine) == worker_values(N, w, workers)
            assert mine != worker_values(N, w, workers)  # not the input order
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    b = epochs_of(shuffled_loader(num_workers), 3)
    for e, (x, y) in enumerate(zip(a, b)):
        assert_streams(x, y, f"second run, epoch {e}")


def test_shuffling_is_local_to_the_buffer():
    # the sample at output position i was read at input position <= i + SIZE - 1
    for order in map(ids, epochs_of(shuffled_loader(0), 3)):
        assert all(v <= i + SIZE - 1 for i, v in enumerate(order))
    # a buffer of one keeps the input order
    assert ids(list(shuffled_loader(0, size=1))) == list(range(N))
    # a buffer larger than the data is a full shuffle of it, still a permutation
    order = ids(list(shuffled_loader(0, size=100)))
    assert sorted(order) == list(range(N)) and order != list(range(N))


def _shuffle_node(state: sl.state.RankState, worker: int) -> tuple[DatasetState, int]:
    """The ShuffleBufferDataset node of a worker's state and the number of samples the
    worker had yielded when it was taken."""
    ws = next(w for w in state.position.workers if w.worker_id == worker)
    # every-sample snapshots: a worker process has snapshotted ahead of what the main
    # process yielded; in-process, the snapshot before the next sample is not taken yet
    assert ws.skip <= 1
    node = ws.dataset
    assert isinstance(node, DatasetState)
    assert node.type == "savable_loader.wrappers.shuffle_buffer.ShuffleBufferDataset"
    assert sorted(node.fields) == ["buffer", "draws", "ended", "keys", "seed"]
    assert node.children[0].type == "tests.common.RangeSource"
    return node, ws.snapshot_index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_contains_the_buffer(num_workers, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    workers = max(num_workers, 1)
    loader = shuffled_loader(num_workers)
    it = iter(loader)
    seen = [next(it) for _ in range(3 * workers)]  # 3 from each worker: buffers are full
    state = decode(encode(loader.save_state_rank()))
    for w in range(workers):
        node, yielded_count = _shuffle_node(state, w)
        assert yielded_count >= 2
        buffer = node.fields["buffer"]
        assert len(buffer) == SIZE - 1 and all(isinstance(x, ArrayValue) for x in buffer)
        held = [int(x[0]) for x in from_plain(buffer)]
        yielded = [int(x[0]) for x in seen if int(x[0]) % workers == w][:yielded_count]
        read = node.children[0].fields["pos"]  # RangeSource's next value for this worker
        # what the worker had read is exactly what it had yielded plus what it holds
        assert sorted(held + yielded) == [v for v in worker_values(N, w, workers) if v < read]
        assert node.fields["draws"] == yielded_count
    del it


def test_state_buffer_drains_at_the_end(monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    loader = shuffled_loader(0)
    it = iter(loader)
    next(it), next(it)
    sizes = {}
    for _ in it:
        node, yielded = _shuffle_node(loader.save_state_rank(), 0)
        sizes[yielded] = len(node.fields["buffer"])
    # full (SIZE - 1 after each pick) while the source lasts, then draining to empty; the
    # snapshot after item j is taken before the item is yielded (items 3..N are saved at)
    assert sizes == {j: min(SIZE - 1, N - j) for j in range(3, N + 1)}


@pytest.mark.parametrize("k", [1, 7, 15, 16, 19])
def test_restore_never_reads_the_source_again(k, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    wc = make_wc(0)

    def factory(log_id: str):
        return make_loader(ShuffleBufferDataset(ForwardOnlySource(N, wc, log_id), SIZE))

    reference = list(factory("reference"))
    assert sorted(reference) == list(range(N)) and reference != list(range(N))
    loader = factory(f"before-{k}")
    it = iter(loader)
    got = [next(it) for _ in range(k)]
    state = decode(encode(loader.save_state_rank()))
    del it
    fresh = factory(f"after-{k}")
    fresh.restore_state_rank(state)
    assert got + list(fresh) == reference
    # The restored source goes on from where the snapshotted one had read to: the
    # samples in the buffer come from the state, not from reading the source again.
    snapshot = state.position.workers[0].dataset
    pos = 0 if snapshot is None else snapshot.children[0].fields["pos"]
    # snapshot after k samples: the buffer is full (or the source read out)
    assert pos == min(N, k + SIZE - 1)
    assert READS.get(f"after-{k}", []) == list(range(pos, N))


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "5", None])
def test_bad_size(bad):
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match=rf"ShuffleBufferDataset size must be a positive int, got {bad!r}"):
        ShuffleBufferDataset(RangeSource(3, wc), bad)


def test_other_arguments():
    with pytest.raises(LoaderUsageError, match="ShuffleBufferDataset wraps a SavableDataset, got list"):
        ShuffleBufferDataset([1, 2], 2)
    assert ShuffleBufferDataset(RangeSource(3, make_wc(0)), 7).config() == {"size": 7}
