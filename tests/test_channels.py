"""savable_loader._channels: the main side of the worker command protocol, against worker
processes that serve the pipe protocol (the real ``WorkerRuntime.serve`` or a fake)."""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import msgspec
import pytest
import torch

import savable_loader as sl
from savable_loader._channels import WorkerChannels
from savable_loader._worker import END, WorkerRuntime
from savable_loader.errors import StateError, WorkerDiedError, WorkerTimeoutError
from savable_loader.state.codec import encode_part
from savable_loader.state.schema import WorkerState
from savable_loader.wrappers import MapDataset, ShuffleBufferDataset
from tests.common import RangeSource, assert_streams

pytestmark = pytest.mark.timeout(60)

CTX = multiprocessing.get_context("fork")
EPOCH = 2
N = 12


def pipeline() -> sl.SavableDataset:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
    ds = ShuffleBufferDataset(RangeSource(N, wc), size=3)
    return MapDataset(ds, lambda x: x * 2 + int(torch.randint(0, 100, ())))


def reference(logical: int) -> list:
    ds = pipeline()
    return list(WorkerRuntime(ds, ds.worker_config, 1, in_process=True).run(EPOCH, logical, None))


# -- worker process bodies (fork: run in the child) ----------------------------------------


def runtime_worker(cmd: Any, res: Any, logical: int, produce: int, ready: Any, stop: Any) -> None:
    """The real worker side: the command thread serves while the pipeline has produced
    ``produce`` samples and is suspended, as a worker blocked on a full queue would be."""
    ds = pipeline()
    rt = WorkerRuntime(ds, ds.worker_config, max_in_flight=100, in_process=False)
    rt.serve(cmd, res)
    run = rt.run(EPOCH, logical, None)
    for _ in range(produce):
        next(run)
    ready.set()
    stop.wait(30)


def fake_worker(cmd: Any, res: Any, mode: str, delay: float = 0.0) -> None:
    """``silent``: reads requests, never answers. ``slow``: answers each request after
    ``delay`` seconds. ``stale``: answers each request twice, first under another id.
    ``exit``: exits with code 7 without reading anything."""
    if mode == "exit":
        os._exit(7)
    while True:
        try:
            kind, request_id, _epoch, index = msgspec.msgpack.decode(cmd.recv_bytes())
        except (EOFError, OSError):
            return
        if kind != "checkpoint" or mode == "silent":
            continue
        if mode == "slow":
            time.sleep(delay)
        if mode == "stale":
            wrong = WorkerState(worker_id=0, index=999, snapshot_index=0)
            res.send_bytes(msgspec.msgpack.encode(["ok", request_id - 1000, encode_part(wrong)]))
        ws = WorkerState(worker_id=0, index=index, snapshot_index=max(index - 1, 0))
        res.send_bytes(msgspec.msgpack.encode(["ok", request_id, encode_part(ws)]))


class Workers:
    """Channels plus the worker processes started on them (cleaned up by the fixture)."""

    def __init__(self, n: int) -> None:
        self.channels = WorkerChannels(CTX, n)
        self.processes: list[Any] = []
        self.stop = CTX.Event()

    def start(self, physical: int, target: Any, *args: Any) -> Any:
        cmd, res = self.channels.worker_ends()[physical]
        p = CTX.Process(target=target, args=(cmd, res, *args), daemon=True)
        p.start()
        self.processes.append(p)
        return p

    def start_runtime(self, physical: int, logical: int, produce: int) -> None:
        ready = CTX.Event()
        self.start(physical, runtime_worker, logical, produce, ready, self.stop)
        assert ready.wait(20), "the worker did not get ready"

    def close(self) -> None:
        self.stop.set()
        for p in self.processes:
            p.join(0.1)
            if p.is_alive():  # a fake worker blocked on its pipe
                p.terminate()
                p.join(2)
        self.channels.close()


@pytest.fixture
def workers():
    made: list[Workers] = []

    def make(n: int) -> Workers:
        w = Workers(n)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def restored(logical: int, state: WorkerState) -> list:
    ds = pipeline()
    return list(WorkerRuntime(ds, ds.worker_config, 1, in_process=True).run(EPOCH, logical, state))


# -- tests ------------------------------------------------------------------------------


def test_answers_are_worker_states_that_resume_exactly(workers):
    w = workers(2)
    # rotated: physical 0 plays logical 1, physical 1 plays logical 0
    w.start_runtime(0, logical=1, produce=4)
    w.start_runtime(1, logical=0, produce=5)
    w.channels.close_worker_ends()
    answers = w.channels.checkpoint({0: (1, EPOCH, 3), 1: (0, EPOCH, 5)}, w.processes, timeout=10)
    assert sorted(answers) == [0, 1]
    a, b = answers[0], answers[1]
    assert isinstance(a, WorkerState) and isinstance(b, WorkerState)
    assert (a.worker_id, a.index, b.worker_id, b.index) == (1, 3, 0, 5)
    assert a.snapshot_index <= 3 and b.snapshot_index <= 5 and not a.exhausted
    ref1, ref0 = reference(1), reference(0)
    assert ref1[-1] == (1, END, None, 6) and ref0[-1] == (0, END, None, 6)
    assert_streams(restored(1, a), ref1[3:], "logical 1 from 3")
    assert_streams(restored(0, b), ref0[5:], "logical 0 from 5")
    # a second round on the same pipes
    again = w.channels.checkpoint({0: (1, EPOCH, 4)}, w.processes, timeout=10)
    assert list(again) == [0] and again[0].index == 4
    assert_streams(restored(1, again[0]), ref1[4:], "logical 1 from 4")


def test_error_answer_is_a_state_error_with_the_workers_message(workers):
    w = workers(1)
    w.start_runtime(0, logical=1, produce=2)
    with pytest.raises(StateError) as info:
        w.channels.checkpoint({0: (1, EPOCH + 3, 2)}, w.processes, timeout=10)
    text = str(info.value)
    assert text.startswith("worker 1 could not save its state: StateError: ")
    assert f"worker 1 is in epoch {EPOCH}, asked for epoch {EPOCH + 3}" in text
    # the worker survives its error and answers the next request
    assert w.channels.checkpoint({0: (1, EPOCH, 2)}, w.processes, timeout=10)[0].index == 2


def test_unanswered_request_times_out_naming_the_logical_worker(workers):
    w = workers(2)
    w.start(0, fake_worker, "slow", 0.0)
    w.start(1, fake_worker, "silent")
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        w.channels.checkpoint({0: (2, EPOCH, 1), 1: (3, EPOCH, 1)}, w.processes, timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 3.0, elapsed
    assert info.value.worker_id == 3
    assert str(info.value) == "worker 3 did not answer a save request within 0.5 s"
    assert all(p.is_alive() for p in w.processes)


def test_unanswered_request_times_out_without_process_list(workers):
    w = workers(1)
    w.start(0, fake_worker, "silent")
    with pytest.raises(WorkerTimeoutError, match="worker 0 did not answer"):
        w.channels.checkpoint({0: (0, EPOCH, 1)}, None, timeout=0.3)


def test_dead_process_is_worker_died_error_with_exit_code(workers):
    w = workers(2)
    w.start(0, fake_worker, "slow", 0.0)
    dead = w.start(1, fake_worker, "exit")
    dead.join(10)
    assert dead.exitcode == 7
    # the pipe ends stay open in this process (as when other workers hold copies of them):
    # only the liveness check can tell the worker is gone
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        w.channels.checkpoint({0: (1, EPOCH, 1), 1: (0, EPOCH, 1)}, w.processes, timeout=10)
    assert time.monotonic() - t0 < 2.0  # found dead long before the timeout
    assert info.value.worker_id == 0
    text = str(info.value)
    assert text.startswith(f"worker 0 (pid {dead.pid}) exited with code 7")


def test_dead_process_with_closed_pipes_is_worker_died_error(workers):
    w = workers(1)
    dead = w.start(0, fake_worker, "exit")
    dead.join(10)
    w.channels.close_worker_ends()  # nothing holds the worker's ends any more
    with pytest.raises(WorkerDiedError) as info:
        w.channels.checkpoint({0: (1, EPOCH, 1)}, w.processes, timeout=10)
    assert info.value.worker_id == 1 and "worker 1" in str(info.value)


def test_late_answer_to_an_earlier_request_is_ignored(workers):
    w = workers(1)
    w.start(0, fake_worker, "slow", 0.3)
    w.channels.close_worker_ends()
    with pytest.raises(WorkerTimeoutError):
        w.channels.checkpoint({0: (0, EPOCH, 3)}, w.processes, timeout=0.1)
    # the answer to the timed-out request (index 3) arrives first and must be skipped
    answers = w.channels.checkpoint({0: (0, EPOCH, 7)}, w.processes, timeout=10)
    assert answers[0].index == 7 and answers[0].snapshot_index == 6


def test_answer_under_a_foreign_request_id_is_ignored(workers):
    w = workers(1)
    w.start(0, fake_worker, "stale")
    w.channels.close_worker_ends()
    for index in (4, 9):
        answers = w.channels.checkpoint({0: (0, EPOCH, index)}, w.processes, timeout=10)
        assert answers[0].index == index


def test_release_message_and_release_to_a_gone_worker(workers):
    w = workers(2)
    cmd0, _ = w.channels.worker_ends()[0]
    cmd1, _ = w.channels.worker_ends()[1]
    w.channels.release(1, 5)
    assert not cmd0.poll(0)
    assert msgspec.msgpack.decode(cmd1.recv_bytes()) == ["release", -1, 5, 0]
    w.channels.release(7, 5)  # no such worker: nothing to do
    # the worker's end is gone (process exited, its ends closed): still no error
    w.channels.close_worker_ends()
    w.channels.release(0, 6)
    w.channels.release(1, 6)
    w.channels.close()
    w.channels.release(0, 7)  # after close: nothing to do


def test_release_lets_a_runtime_worker_end(workers):
    """A worker that produced its end marker holds its iteration back until released."""
    w = workers(1)
    done = CTX.Event()

    def worker(cmd: Any, res: Any) -> None:
        ds = pipeline()
        rt = WorkerRuntime(ds, ds.worker_config, max_in_flight=100, in_process=False)
        rt.serve(cmd, res)
        items = list(rt.run(EPOCH, 0, None))  # returns only after the release
        if items[-1] == (0, END, None, 6):
            done.set()

    p = w.start(0, worker)
    w.channels.close_worker_ends()
    time.sleep(0.5)
    assert p.is_alive() and not done.is_set()
    # it still answers for its last samples while it waits
    assert w.channels.checkpoint({0: (0, EPOCH, 6)}, w.processes, timeout=10)[0].index == 6
    w.channels.release(0, EPOCH)
    assert done.wait(5)
    p.join(5)
    assert p.exitcode == 0
