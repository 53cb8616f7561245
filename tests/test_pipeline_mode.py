"""savable_loader._pipeline_mode: the savable-pipeline path's bookkeeping in the main
process (per-worker counts, next worker, rotation), its state and its restore checks.

In-process (``num_workers=0``) the mode is driven by iterating its torch dataset by hand;
with workers, items are fed to ``on_item`` directly and the release messages are read
from the worker ends of the channels (no worker processes are started).
"""

from __future__ import annotations

import multiprocessing
import random

import msgspec
import pytest
import torch

import savable_loader as sl
from savable_loader._pipeline_mode import SKIP, PipelineMode
from savable_loader._worker import END
from savable_loader.errors import ConfigMismatchError, StateError
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import PipelinePosition, WorkerState
from savable_loader.wrappers import MapDataset, ShuffleBufferDataset
from tests.common import RangeSource, assert_streams

pytestmark = pytest.mark.timeout(60)

N = 11
CTX = multiprocessing.get_context("fork")


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
    """Drives an in-process mode as the loader does: begin, items through on_item, end."""

    def __init__(self, mode: PipelineMode) -> None:
        self.mode = mode
        self.resumed = mode.begin(None, reuse_workers=False)
        self.it = iter(mode.torch_dataset)

    def next_payload(self):
        """The next payload yielded to the user (end markers are consumed), or StopIteration."""
        while True:
            payload = self.mode.on_item(next(self.it))
            if payload is not SKIP:
                return payload

    def rest(self) -> list:
        out = []
        for item in self.it:
            payload = self.mode.on_item(item)
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
    assert m.save(None, 1.0) == PipelinePosition(epoch=0, next_worker=0, workers=[fresh(0)])
    d = Driver(m)
    assert d.resumed is False
    assert m.save(None, 1.0) == PipelinePosition(epoch=0, next_worker=0, workers=[fresh(0)])
    for k in range(1, N + 1):
        d.next_payload()
        position = m.save(None, 1.0)
        assert position.epoch == 0 and position.next_worker == 0 and len(position.workers) == 1
        ws = position.workers[0]
        assert (ws.worker_id, ws.index, ws.exhausted) == (0, k, False)
        assert ws.snapshot_index <= k
        assert m.save(None, 1.0) is position  # saving again without iterating: the same state


def test_end_marker_marks_the_worker_exhausted():
    m = make()
    d = Driver(m)
    payloads = [d.next_payload() for _ in range(N)]
    assert len(payloads) == N
    end_item = next(d.it)
    assert end_item == (0, END, None, N)
    assert m.on_item(end_item) is SKIP
    assert m.save(None, 1.0) == PipelinePosition(
        epoch=0, next_worker=0, workers=[WorkerState(worker_id=0, index=N, snapshot_index=N, exhausted=True)]
    )
    with pytest.raises(StopIteration):
        next(d.it)
    m.end(keep_channels=False)
    assert m.epoch == 1 and m.current is None
    assert m.save(None, 1.0) == PipelinePosition(epoch=1, next_worker=0, workers=[fresh(0)])
    d2 = Driver(m)
    assert d2.resumed is False and m.torch_dataset.epoch == 1
    assert len(d2.rest()) == N


def test_abandoned_iteration_moves_to_the_next_epoch():
    m = make()
    d = Driver(m)
    d.next_payload()
    m.end(keep_channels=False)
    assert m.save(None, 1.0) == PipelinePosition(epoch=1, next_worker=0, workers=[fresh(0)])


@pytest.mark.parametrize("k", range(N + 2))  # k = N + 1: after the end marker
def test_save_restore_continues_exactly(k):
    ref = reference()
    m = make()
    d = Driver(m)
    taken = []
    for _ in range(min(k, N)):
        taken.append(d.next_payload())
    if k == N + 1:
        assert m.on_item(next(d.it)) is SKIP
    assert_streams(taken, ref[: len(taken)], "prefix")
    position = decode_part(encode_part(m.save(None, 1.0)), PipelinePosition)
    restored = make()
    restored.check(m.loader_config(0), position, 0)
    restored.restore(position)
    assert restored.save(None, 1.0) is position  # before iterating: the restored position
    d2 = Driver(restored)
    assert d2.resumed is True
    assert_streams(d2.rest(), ref[len(taken):], f"k={k} continuation")
    restored.end(keep_channels=False)
    assert restored.epoch == 1


def test_save_before_the_in_process_runtime_started_is_an_error():
    m = make()
    m.begin(None, reuse_workers=False)
    m.on_item((0, 0, None, "x"))  # an item the runtime never produced
    with pytest.raises(StateError, match="in-process pipeline has not started"):
        m.save(None, 1.0)


def test_item_outside_an_iteration_is_an_error():
    with pytest.raises(RuntimeError, match="outside an iteration"):
        make().on_item((0, 0, None, "x"))


# -- several workers: rotation, releases, exhausted workers -------------------------------


def read_release(mode: PipelineMode, physical: int):
    cmd_r, _ = mode.channels.worker_ends()[physical]
    if not cmd_r.poll(1.0):
        return None
    return msgspec.msgpack.decode(cmd_r.recv_bytes())


def test_next_worker_and_release_follow_the_rotation():
    m = make(num_workers=3)
    start0 = WorkerState(worker_id=0, index=3, snapshot_index=1, dataset=None)
    m.restore(PipelinePosition(epoch=4, next_worker=1, workers=[start0, fresh(1), fresh(2)]))
    assert m.begin(CTX, reuse_workers=False) is True
    try:
        pwd = m.torch_dataset
        assert (pwd.epoch, pwd.rotation, pwd.starts) == (4, 1, [start0, fresh(1), fresh(2)])
        assert pwd.pipes is m.channels.worker_ends()
        # physical p plays logical (p + 1) % 3
        assert [m.logical(p) for p in (0, 1, 2)] == [1, 2, 0]
        assert [m.physical(w) for w in (0, 1, 2)] == [2, 0, 1]
        assert m.on_item((1, 0, None, "a")) == "a"
        assert m.current.next_worker == 2 and m.current.consumed == [3, 1, 0]
        assert m.on_item((2, 0, None, "b")) == "b"
        assert m.current.next_worker == 0 and m.current.consumed == [3, 1, 1]
        # logical 1 ends (it is physical 0): its release goes to physical 0 only
        assert m.on_item((1, END, None, 1)) is SKIP
        assert m.current.next_worker == 2
        assert read_release(m, 0) == ["release", -1, 4, 0]
        assert not any(m.channels.worker_ends()[p][0].poll(0.05) for p in (1, 2))
        # logical 2 ends (physical 1)
        assert m.on_item((2, END, None, 1)) is SKIP
        assert read_release(m, 1) == ["release", -1, 4, 0]
        # worker 0 has yielded nothing since its start, 1 and 2 are done: no worker is asked
        position = m.save(None, 1.0)
        assert position == PipelinePosition(
            epoch=4, next_worker=0,
            workers=[
                start0,
                WorkerState(worker_id=1, index=1, snapshot_index=1, exhausted=True),
                WorkerState(worker_id=2, index=1, snapshot_index=1, exhausted=True),
            ],
        )
        # logical 0 ends (physical 2)
        assert m.on_item((0, END, None, 3)) is SKIP
        assert read_release(m, 2) == ["release", -1, 4, 0]
        assert m.save(None, 1.0).workers[0] == WorkerState(worker_id=0, index=3, snapshot_index=3, exhausted=True)
        assert m.save(None, 1.0).next_worker == 1
        # ending the iteration releases every worker (an abandoned one would be waiting)
        m.end(keep_channels=True)
        assert [read_release(m, p) for p in (0, 1, 2)] == [["release", -1, 4, 0]] * 3
        assert m.channels is not None and m.epoch == 5
        assert m.save(None, 1.0) == PipelinePosition(epoch=5, next_worker=0, workers=[fresh(w) for w in range(3)])
    finally:
        m.close_channels()
    assert m.channels is None


def test_save_with_closed_channels_is_an_error():
    m = make(num_workers=2)
    m.begin(CTX, reuse_workers=False)
    m.on_item((0, 0, None, "a"))
    m.close_channels()
    with pytest.raises(StateError, match="worker channels are closed"):
        m.save(None, 1.0)
    m.end(keep_channels=False)


def test_exhausted_start_stays_exhausted():
    m = make(num_workers=2)
    done = WorkerState(worker_id=1, index=5, snapshot_index=5, exhausted=True)
    m.restore(PipelinePosition(epoch=0, next_worker=0, workers=[fresh(0), done]))
    m.begin(CTX, reuse_workers=False)
    try:
        assert m.current.exhausted == [False, True] and m.current.consumed == [0, 5]
        assert m.save(None, 1.0).workers == [fresh(0), done]
    finally:
        m.end(keep_channels=False)


# -- check ------------------------------------------------------------------------------


def saved_state(num_workers=0):
    m = make(num_workers)
    return m.loader_config(num_workers), m.save(None, 1.0)


def test_check_accepts_the_same_configuration():
    config, position = saved_state()
    make().check(config, position, 0)
    config2, position2 = saved_state(2)
    make(2).check(config2, position2, 2)


def test_check_rejects_changed_num_workers():
    config, position = saved_state(2)
    with pytest.raises(ConfigMismatchError) as info:
        make(2).check(config, position, 3)
    e = info.value
    assert (e.field, e.saved, e.current) == ("num_workers", 2, 3)
    assert "per worker" in str(e) and "same num_workers" in str(e)


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
    config, position = m.loader_config(0), m.save(None, 1.0)
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
        ([fresh(0)], 0, r"worker ids \[0\] and next worker 0, expected ids 0..1"),
        ([fresh(0), fresh(0)], 0, r"worker ids \[0, 0\]"),
        ([fresh(1), fresh(2)], 0, r"worker ids \[1, 2\]"),
        ([fresh(0), fresh(1), fresh(2)], 0, r"worker ids \[0, 1, 2\]"),
        ([fresh(0), fresh(1)], 2, r"next worker 2"),
        ([fresh(0), WorkerState(worker_id=1, index=2, snapshot_index=3)], 0,
         "worker 1: snapshot index 3 is after index 2"),
    ],
)
def test_check_rejects_malformed_worker_states(workers, next_worker, match):
    config, _ = saved_state(2)
    position = PipelinePosition(epoch=0, next_worker=next_worker, workers=workers)
    with pytest.raises(StateError, match=match):
        make(2).check(config, position, 2)


def test_attached_snapshots_answer_a_save_without_the_workers():
    from savable_loader.state.schema import DatasetState

    m = make(num_workers=2)
    m.begin(CTX, reuse_workers=False)
    snap = DatasetState(type="x", fields={"pos": 5})
    try:
        assert m.on_item((0, 0, None, "a", None)) == "a"
        assert m.on_item((1, 0, None, "b", (1, encode_part(snap)))) == "b"
        assert m.on_item((0, 1, None, "c", (2, encode_part(snap)))) == "c"
        assert m.on_item((1, 1, None, "d", None)) == "d"
        m.close_channels()  # nobody to ask: the main process answers alone
        position = m.save(None, 1.0)
        assert position.workers == [
            WorkerState(worker_id=0, index=2, snapshot_index=2, dataset=snap),
            WorkerState(worker_id=1, index=2, snapshot_index=1, dataset=snap),
        ]
        assert m.save(None, 1.0) is position
        # a worker whose items carry no snapshot slot is asked (here: channels closed)
        m.on_item((0, 2, None, "e"))
        m.current.attaching[0] = False
        with pytest.raises(StateError, match="worker channels are closed"):
            m.save(None, 1.0)
    finally:
        m.end(keep_channels=False)


def test_attached_snapshot_before_any_yield_uses_the_start_state():
    m = make(num_workers=2)
    start = WorkerState(worker_id=0, index=4, snapshot_index=2, dataset=None)
    m.restore(PipelinePosition(epoch=0, next_worker=0, workers=[start, fresh(1)]))
    m.begin(CTX, reuse_workers=False)
    try:
        m.on_item((0, 4, None, "a", None))
        m.close_channels()
        ws = m.save(None, 1.0).workers[0]
        assert ws == WorkerState(worker_id=0, index=5, snapshot_index=2, dataset=None)
        assert ws.skip == 3
    finally:
        m.end(keep_channels=False)
