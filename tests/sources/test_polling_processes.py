"""PollingSource across processes: a producer process writing while the loader reads,
a lazy client that cannot be pickled under spawn and forkserver workers, timeouts in
the main process and in workers (the workers shut down), a training process killed
with SIGKILL and restarted from its last checkpoint, two gloo ranks.

The folder stream and its ``fetch`` are in ``tests/sources/test_polling_source.py``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist

import savable_loader as sl
from savable_loader.errors import SavableLoaderError, StreamTimeoutError
from savable_loader.sources import PollingSource, StreamInfo
from savable_loader.state import decode, encode
from tests.common import assert_streams, check_resume_everywhere, epochs_of
from tests.dist_harness import run_ranks, values
from tests.sources.test_polling_source import FolderFetch, folder_loader, length, loader_of, produce, values_of, wconf

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _helper(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker (or forkserver), which the first spawn (or
    forkserver) worker of the test process starts and which outlives every loader."""
    try:
        cmdline = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def _wait_gone(before: set[int], seconds: float = 15.0) -> list[psutil.Process]:
    """Child processes started since ``before`` still running after ``seconds`` (none: good)."""
    deadline = time.monotonic() + seconds
    while True:
        left = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _helper(p)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# -- a producer process ------------------------------------------------------------------------


@pytest.mark.parametrize(("rank", "world", "num_workers"), [(0, 1, 2), (1, 2, 0)], ids=["r0of1-w2", "r1of2-w0"])
def test_resume_at_every_step_while_a_producer_process_writes(tmp_path, rank, world, num_workers):
    producer = multiprocessing.get_context("spawn").Process(
        target=produce, args=(str(tmp_path), list(range(world)), 2, 0.005)
    )
    producer.start()
    try:
        factory = lambda: folder_loader(tmp_path, wconf(rank, world, num_workers))
        reference = epochs_of(factory(), 2)
        assert values_of(reference[0] + reference[1]) == [
            (rank, e, i) for e in range(2) for i in range(length(rank, e))
        ]
        assert check_resume_everywhere(factory, 2, reference=reference) >= length(rank, 0) + length(rank, 1) + 3
    finally:
        producer.join(30)
    assert producer.exitcode == 0


# -- a lazy client that cannot be pickled ---------------------------------------------------------


class LockedClient:
    """A client that cannot cross a process boundary (it holds a lock, as a Ray or a
    socket client holds what cannot be pickled)."""

    def __init__(self, root: str) -> None:
        self.lock = threading.Lock()
        self.folder = FolderFetch(root)
        self.pid = os.getpid()

    def get(self, info: StreamInfo, index: int) -> Any:
        with self.lock:
            return self.folder(info, index)


class LazyFetch:
    """``fetch`` that creates its client on first use, in the process that reads items."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.client: LockedClient | None = None

    def __call__(self, info: StreamInfo, index: int) -> Any:
        if self.client is None:
            self.client = LockedClient(self.root)
        return self.client.get(info, index)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_lazy_client_that_cannot_be_pickled_works_with_spawn_and_forkserver(tmp_path, context):
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(LockedClient(str(tmp_path)))
    produce(str(tmp_path), [0], 1)
    reference = list(loader_of(PollingSource(LazyFetch(str(tmp_path)), wconf(0, 1, 0))))

    def make() -> tuple[LazyFetch, sl.SavableDataLoader]:
        fetch = LazyFetch(str(tmp_path))
        return fetch, loader_of(PollingSource(fetch, wconf(0, 1, 2)), context=context)

    fetch, loader = make()
    it = iter(loader)
    before = [next(it) for _ in range(3)]
    state = decode(encode(loader.save_state_rank()))
    del it
    assert fetch.client is None, "fetch ran in the main process"
    fetch, fresh = make()
    fresh.restore_state_rank(state)
    assert_streams(before + list(fresh), reference, f"{context} workers, restored after 3 items")
    assert fetch.client is None


# -- timeouts --------------------------------------------------------------------------------------


def stalled(info: StreamInfo, index: int) -> Any:
    """Three items, then nothing ever (the producer is gone)."""
    return index if index < 3 else None


@pytest.mark.parametrize(
    ("num_workers", "context"), [(0, "fork"), (2, "fork"), (2, "spawn")], ids=["w0", "w2-fork", "w2-spawn"]
)
def test_a_timeout_names_rank_index_and_seconds_and_shuts_the_workers_down(num_workers, context):
    before = _children()
    loader = loader_of(
        PollingSource(stalled, wconf(1, 2, num_workers), poll_interval=0.01, timeout=0.5), context=context
    )
    got = []
    started = time.monotonic()
    with pytest.raises(StreamTimeoutError) as caught:
        for x in loader:
            got.append(x)  # noqa: PERF402 - the items before the error
    elapsed = time.monotonic() - started
    assert type(caught.value) is StreamTimeoutError and isinstance(caught.value, SavableLoaderError)
    message = str(caught.value)
    found = re.search(r"rank 1 waited (\d+\.\d\d) s for index (\d+) of its stream", message)
    assert found, message
    assert float(found[1]) >= 0.5 and int(found[2]) in (3, 4), message
    assert "timeout=0.5" in message
    assert sorted(got) == [0, 1, 2]
    if num_workers == 0:
        assert (caught.value.rank, caught.value.position) == (1, 3) and caught.value.waited >= 0.5
    left = _wait_gone(before)
    assert not left, f"worker processes left after the timeout: {left}"
    print(f"timeout raised after {elapsed:.2f} s")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_waiting_for_a_stalled_producer_stop_at_once_when_the_loader_is_done(context):
    """A worker polling an index that never comes (no timeout) notices the loader's
    shutdown between polls instead of being killed after torch's 5 s join timeout."""
    before = _children()
    loader = loader_of(PollingSource(stalled, wconf(0, 1, 2), poll_interval=1.0), context=context)
    it = iter(loader)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.3)  # both workers are waiting in their poll
    started = time.monotonic()
    del it
    left = _wait_gone(before, seconds=15)
    elapsed = time.monotonic() - started
    assert not left, f"worker processes left: {left}"
    assert elapsed < 3.0, f"the workers took {elapsed:.2f} s to stop (torch's join timeout is 5 s a worker)"


# -- SIGKILL mid-stream, restart from the last checkpoint -----------------------------------------------

TRAIN = """
import json, sys, time
from pathlib import Path
import savable_loader as sl
from savable_loader.sources import PollingSource
from tests.sources.test_polling_source import FolderFetch, wconf, write_atomic

root, ckpt = sys.argv[1], Path(sys.argv[2])
wc = wconf(0, 1, 2)
loader = sl.SavableDataLoader(
    PollingSource(FolderFetch(root), wc, poll_interval=0.002, timeout=60),
    batch_size=None, worker_config=wc, multiprocessing_context="fork",
)
consumed = []
latest = ckpt / "latest"
if latest.exists():  # restart: the loader state and what the loop had consumed at that step
    step = int(latest.read_text())
    loader.restore_state_rank(sl.state.load_file(ckpt / f"{step}.state"))
    consumed = json.loads((ckpt / f"{step}.json").read_text())
for x in loader:
    consumed.append([int(v) for v in x])
    time.sleep(0.01)  # a training step
    step = len(consumed)
    sl.state.save_file(ckpt / f"{step}.state", loader.save_state_rank())
    write_atomic(ckpt / f"{step}.json", json.dumps(consumed))
    write_atomic(latest, str(step))
write_atomic(ckpt / "done", "")
"""

COUNT = 40


def _step(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def test_a_training_process_killed_mid_stream_consumes_every_item_exactly_once(tmp_path):
    stream, ckpt = tmp_path / "stream", tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    producer = multiprocessing.get_context("spawn").Process(target=produce, args=(str(stream), [0], 1, 0.01, COUNT))
    producer.start()
    kills = []
    try:
        for kill_at in (8, 22, None):
            proc = subprocess.Popen(
                [sys.executable, str(tmp_path / "train.py"), str(stream), str(ckpt)],
                env=env,
                cwd=ROOT,
                start_new_session=True,  # the trainer and its workers: one process group
            )
            try:
                deadline = time.monotonic() + 60
                while kill_at is not None and _step(ckpt) < kill_at and proc.poll() is None:
                    assert time.monotonic() < deadline, "the trainer made no progress"
                    time.sleep(0.005)
                if kill_at is not None:
                    assert proc.poll() is None, "the trainer finished before it could be killed"
                    os.killpg(proc.pid, signal.SIGKILL)  # the job dies: trainer and workers
                    kills.append(_step(ckpt))
                assert proc.wait(60) in (0, -signal.SIGKILL)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        producer.join(30)
    assert (ckpt / "done").exists()
    assert all(k < COUNT for k in kills) and len(kills) == 2, kills
    consumed = json.loads((ckpt / f"{_step(ckpt)}.json").read_text())
    # an uninterrupted run (its items: rank, epoch, index, value, the random draw in fetch)
    reference = [[int(v) for v in x] for x in loader_of(PollingSource(FolderFetch(stream), wconf(0, 1, 2)))]
    assert [c[2] for c in consumed] == list(range(COUNT))
    assert consumed == reference


# -- two gloo ranks --------------------------------------------------------------------------------


def _gloo_rank(rank: int, world: int, root: str, k: int) -> tuple[list[Any], list[Any]]:
    wc = sl.WorkerConfig(num_workers=2, seed=7)  # rank and world size from torch.distributed
    make = lambda: loader_of(PollingSource(FolderFetch(root), wc, poll_interval=0.002, timeout=60))
    reference = [x for e in epochs_of(make(), 2) for x in e]
    loader = make()
    it = iter(loader)
    seen = [next(it) for _ in range(k)]
    states = loader.save_state_global(global_dst_rank=0)
    del it
    path = Path(root, "loader.state")
    if rank == 0:
        sl.state.save_file(path, states)
    dist.barrier()
    fresh = make()
    fresh.restore_state_global(sl.state.load_file(path) if rank == 0 else None, src_rank=0)
    return reference, seen + [x for e in epochs_of(fresh, 2) for x in e]


def test_two_gloo_ranks_save_global_and_restore_exactly(tmp_path):
    produce(str(tmp_path), [0, 1], 2)
    for rank, (reference, got) in enumerate(values(run_ranks(_gloo_rank, 2, str(tmp_path), 3, timeout=100))):
        assert values_of(reference) == [(rank, e, i) for e in range(2) for i in range(length(rank, e))]
        assert_streams(got, reference, f"rank {rank}: 3 items, save_state_global, restore_state_global, the rest")
