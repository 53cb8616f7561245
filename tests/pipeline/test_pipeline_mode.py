"""savable_loader.pipeline.engine: the savable-pipeline path's bookkeeping in the main
process (per-worker counts, next worker, rotation), its state and its restore checks.

In-process (``num_workers=0``) the mode is driven by iterating its torch dataset by hand;
with workers, items (and the snapshots attached to them) are fed to ``on_item`` directly
(no worker processes are started).
"""

from __future__ import annotations

import random

import pytest
import torch

import savable_loader as sl
from savable_loader.errors import ConfigMismatchError, StateError
from savable_loader.pipeline.engine import SKIP, PipelineMode
from savable_loader.pipeline.worker import End, Item
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import DatasetState, PipelinePosition, WorkerState
from savable_loader.wrappers import MapDataset, ShuffleBufferDataset
from tests.common import RangeSource, assert_streams

pytestmark = pytest.mark.timeout(60)

N = 11


def pipeline(num_workers=0, *, rank=0, world_size=1, seed=3, size=4) -> sl.SavableDataset:
    wc = sl.WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers, seed=seed)
    ds = ShuffleBufferDataset(RangeSource(N, wc), size=size)
    return MapDataset(ds, lambda x: x * 2 + random.randint(0, 3) + int(torch.randint(0, 5, ())))


def make(num_workers=0, **kw) -> PipelineMode:
    ds = pipeline(num_workers, **kw)
    return PipelineMode(ds, ds.worker_config, prefetch_factor=2)


def fresh(w: int) -> WorkerState:
    return WorkerState(worker_id=w, index=0, snapshot_index=0)


class Driver:
    """Drives an in-process iteration as the loader does: begin, items through on_item."""

    def __init__(self, mode: PipelineMode, epoch: int = 0, resume=None) -> None:
        self.mode = mode
        self.iteration = mode.begin(epoch, resume, reuse_workers=False)
        self.resumed = self.iteration.resumed
        self.it = iter(mode.torch_dataset)

    def next_payload(self):
        """The next payload yielded to the user (end markers are consumed), or StopIteration."""
        while True:
            payload = self.iteration.on_item(next(self.it))
            if payload is not SKIP:
                return payload

    def rest(self) -> list:
        out = []
        for item in self.it:
            payload = self.iteration.on_item(item)
            if payload is not SKIP:
                out.append(payload)
        return out


def reference() -> list:
    d = Driver(make())
    return d.rest()


# -- in-process bookkeeping -------------------------------------------------------------


def test_save_before_and_after_items():
    m = make()
    assert m.torch_dataset.max_in_flight == 1  # in-process: nothing is prefetched
    assert m.start_position(0) == PipelinePosition(epoch=0, next_worker=0, workers=[fresh(0)])
    d = Driver(m)
    assert d.resumed is False
    assert d.iteration.position() == PipelinePosition(epoch=0, next_worker=0, workers=[fresh(0)])
    for k in range(1, N + 1):
        d.next_payload()
        position = d.iteration.position()
        assert position.epoch == 0 and position.next_worker == 0 and len(position.workers) == 1
        ws = position.workers[0]
        assert (ws.worker_id, ws.index, ws.exhausted) == (0, k, False)
        assert ws.snapshot_index <= k
        assert d.iteration.position() is position  # saving again without iterating: the same state


def test_end_marker_marks_the_worker_exhausted():
    m = make()
    d = Driver(m)
    payloads = [d.next_payload() for _ in range(N)]
    assert len(payloads) == N
    end_item = next(d.it)
    assert end_item == End(0, N)
    assert d.iteration.on_item(end_item) is SKIP
    assert d.iteration.position() == PipelinePosition(
        epoch=0, next_worker=0, workers=[WorkerState(worker_id=0, index=N, snapshot_index=N, exhausted=True)]
    )
    with pytest.raises(StopIteration):
        next(d.it)
    d.iteration.end(finished=True, keep_workers=False)
    assert m.last_item is not None and m.last_item[0] == 0
    d2 = Driver(m, epoch=1)
    assert d2.resumed is False and m.torch_dataset.epoch == 1
    assert len(d2.rest()) == N


@pytest.mark.parametrize("k", range(N + 2))  # k = N + 1: after the end marker
def test_save_restore_continues_exactly(k):
    ref = reference()
    m = make()
    d = Driver(m)
    taken = []
    for _ in range(min(k, N)):
        taken.append(d.next_payload())
    if k == N + 1:
        assert d.iteration.on_item(next(d.it)) is SKIP
    assert_streams(taken, ref[: len(taken)], "prefix")
    position = decode_part(encode_part(d.iteration.position()), PipelinePosition)
    restored = make()
    position = restored.check(m.loader_config(0), position, 0)
    d2 = Driver(restored, epoch=position.epoch, resume=position)
    assert d2.resumed is True
    assert d2.iteration.position() == position  # before iterating: the restored position
    assert_streams(d2.rest(), ref[len(taken) :], f"k={k} continuation")


def test_save_before_the_in_process_runtime_started_is_an_error():
    m = make()
    it = m.begin(0, None, reuse_workers=False)
    it.on_item(Item(0, 0, None, "x"))  # an item the runtime never produced
    with pytest.raises(StateError, match="in-process pipeline has not started"):
        it.position()


def test_a_pipeline_error_ends_the_iteration():
    it = make().begin(0, None, reuse_workers=False)
    assert it.on_error(RuntimeError("boom")) is False
    assert it.remaining() is None


# -- several workers: rotation, exhausted workers ---------------------------------------


def test_next_worker_follows_the_rotation():
    m = make(num_workers=3)
    start0 = WorkerState(worker_id=0, index=3, snapshot_index=1, dataset=None)
    resume = PipelinePosition(epoch=4, next_worker=1, workers=[start0, fresh(1), fresh(2)])
    it = m.begin(4, resume, reuse_workers=False)
    assert it.resumed is True
    try:
        pwd = m.torch_dataset
        assert (pwd.epoch, pwd.rotation, pwd.starts) == (4, 1, [start0, fresh(1), fresh(2)])
        # physical p plays logical (p + 1) % 3
        assert [it.logical(p) for p in (0, 1, 2)] == [1, 2, 0]
        assert it.on_item(Item(1, 0, None, "a")) == "a"
        assert it.next_worker == 2 and it.consumed == [3, 1, 0]
        assert it.on_item(Item(2, 0, None, "b")) == "b"
        assert it.next_worker == 0 and it.consumed == [3, 1, 1]
        # logical 1 ends (it is physical 0)
        assert it.on_item(End(1, 1)) is SKIP
        assert it.next_worker == 2
        # logical 2 ends (physical 1)
        assert it.on_item(End(2, 1)) is SKIP
        # worker 0 has yielded nothing since its start, 1 and 2 are done: no worker is asked
        position = it.position()
        assert position == PipelinePosition(
            epoch=4,
            next_worker=0,
            workers=[
                start0,
                WorkerState(worker_id=1, index=1, snapshot_index=1, exhausted=True),
                WorkerState(worker_id=2, index=1, snapshot_index=1, exhausted=True),
            ],
        )
        # logical 0 ends (physical 2)
        assert it.on_item(End(0, 3)) is SKIP
        assert it.position().workers[0] == WorkerState(worker_id=0, index=3, snapshot_index=3, exhausted=True)
        assert it.position().next_worker == 1
    finally:
        it.end(finished=False, keep_workers=False)


def test_exhausted_start_stays_exhausted():
    m = make(num_workers=2)
    done = WorkerState(worker_id=1, index=5, snapshot_index=5, exhausted=True)
    it = m.begin(0, PipelinePosition(epoch=0, next_worker=0, workers=[fresh(0), done]), reuse_workers=False)
    try:
        assert it.exhausted == [False, True] and it.consumed == [0, 5]
        assert it.position().workers == [fresh(0), done]
    finally:
        it.end(finished=False, keep_workers=False)


# -- check ------------------------------------------------------------------------------


def saved_state(num_workers=0):
    m = make(num_workers)
    return m.loader_config(num_workers), m.start_position(0)


def test_check_accepts_the_same_configuration():
    config, position = saved_state()
    make().check(config, position, 0)
    config2, position2 = saved_state(2)
    make(2).check(config2, position2, 2)


def test_check_honours_changed_num_workers():
    """(It was refused before hosting, ``pipeline/hosting.py``.) A started position keeps its
    logical workers; an epoch's start takes the loader's own split."""
    config, _ = saved_state(2)
    started = PipelinePosition(
        epoch=0, next_worker=1, workers=[WorkerState(worker_id=0, index=1, snapshot_index=0), fresh(1)]
    )
    assert make(3).check(config, started, 3) == started
    assert make(0).check(config, started, 0) == started
    start = make(2).start_position(0)
    assert make(3).check(config, start, 3) == make(3).start_position(0)


@pytest.mark.parametrize(
    ("field", "kw", "saved", "current"),
    [
        ("rank", {"rank": 1, "world_size": 2}, 0, 1),
        ("world_size", {"world_size": 2}, 1, 2),
        ("seed", {"seed": 4}, 3, 4),
    ],
)
def test_check_rejects_changed_rank_world_size_seed(field, kw, saved, current):
    base = {"world_size": 2} if field == "rank" else {}
    m = make(**base)
    config, position = m.loader_config(0), m.start_position(0)
    with pytest.raises(ConfigMismatchError) as info:
        make(**kw).check(config, position, 0)
    assert (info.value.field, info.value.saved, info.value.current) == (field, saved, current)


def test_check_rejects_changed_pipeline_config():
    config, position = saved_state()
    with pytest.raises(ConfigMismatchError) as info:
        make(size=5).check(config, position, 0)
    e = info.value
    assert (e.field, e.saved, e.current) == ("dataset_config.children[0].size", 4, 5)
    assert "the dataset changed" in str(e)


@pytest.mark.parametrize(
    ("workers", "next_worker", "match"),
    [
        ([], 0, r"worker ids \[\] and next worker 0, expected ids 0..-1"),
        ([fresh(0)], 1, r"worker ids \[0\] and next worker 1, expected ids 0..0"),
        ([fresh(0), fresh(0)], 0, r"worker ids \[0, 0\]"),
        ([fresh(1), fresh(2)], 0, r"worker ids \[1, 2\]"),
        ([fresh(0), fresh(1), fresh(3)], 0, r"worker ids \[0, 1, 3\]"),
        ([fresh(0), fresh(1)], 2, r"next worker 2"),
        (
            [fresh(0), WorkerState(worker_id=1, index=2, snapshot_index=3)],
            0,
            "worker 1: snapshot index 3 is after index 2",
        ),
    ],
)
def test_check_rejects_malformed_worker_states(workers, next_worker, match):
    config, _ = saved_state(2)
    position = PipelinePosition(epoch=0, next_worker=next_worker, workers=workers)
    with pytest.raises(StateError, match=match):
        make(2).check(config, position, 2)


def test_attached_snapshots_answer_a_save_without_the_workers():
    m = make(num_workers=2)
    it = m.begin(0, None, reuse_workers=False)
    snap = DatasetState(type="x", fields={"pos": 5})
    try:
        assert it.on_item(Item(0, 0, None, "a")) == "a"
        assert it.on_item(Item(1, 0, None, "b", (1, encode_part(snap)))) == "b"
        assert it.on_item(Item(0, 1, None, "c", (2, encode_part(snap)))) == "c"
        assert it.on_item(Item(1, 1, None, "d")) == "d"
        position = it.position()  # no worker process exists: the main process answers alone
        assert position.workers == [
            WorkerState(worker_id=0, index=2, snapshot_index=2, dataset=snap),
            WorkerState(worker_id=1, index=2, snapshot_index=1, dataset=snap),
        ]
        assert it.position() is position
        # leaving out the item yielded last (worker 1's second, no snapshot attached)
        assert it.position(held=1).workers[1] == WorkerState(worker_id=1, index=1, snapshot_index=1, dataset=snap)
        # the item yielded last carried the newest snapshot: a save that leaves it out
        # takes the one before it
        newer = DatasetState(type="x", fields={"pos": 7})
        assert it.on_item(Item(0, 2, None, "e", (3, encode_part(newer)))) == "e"
        assert it.position().workers[0] == WorkerState(worker_id=0, index=3, snapshot_index=3, dataset=newer)
        assert it.position(held=1).workers[0] == WorkerState(worker_id=0, index=2, snapshot_index=2, dataset=snap)
        # (worker 1: the snapshot its first item carried)
        assert it.on_item(Item(1, 2, None, "f")) == "f"
        assert it.on_item(Item(0, 3, None, "g")) == "g"
        assert it.on_item(Item(1, 3, None, "h", (4, encode_part(newer)))) == "h"
        assert it.position(held=1).workers[1] == WorkerState(worker_id=1, index=3, snapshot_index=1, dataset=snap)
    finally:
        it.end(finished=False, keep_workers=False)


def test_attached_snapshot_before_any_yield_uses_the_start_state():
    m = make(num_workers=2)
    start = WorkerState(worker_id=0, index=4, snapshot_index=2, dataset=None)
    it = m.begin(0, PipelinePosition(epoch=0, next_worker=0, workers=[start, fresh(1)]), reuse_workers=False)
    try:
        it.on_item(Item(0, 4, None, "a"))
        ws = it.position().workers[0]
        assert ws == WorkerState(worker_id=0, index=5, snapshot_index=2, dataset=None)
        assert ws.skip == 3
        # the worker's first snapshot rides on the item yielded last: a save that leaves
        # that item out goes back to the start state
        snap = DatasetState(type="x", fields={"pos": 6})
        it.on_item(Item(0, 5, None, "b", (6, encode_part(snap))))
        assert it.position(held=1).workers[0] == ws
    finally:
        it.end(finished=False, keep_workers=False)
