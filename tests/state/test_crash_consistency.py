"""Crash consistency of state files: SIGKILL while ``save_file`` writes.

A forked child process writes states ``0, 1, 2, ...`` to one path in a tight loop (each state
carries its sequence number and a ~256 kB payload so a write takes a while); the test
kills it with SIGKILL at a seeded random moment, then loads the file. Every kill must
leave a complete, checksummed state of the sequence (the last one written or the one
being written), never a torn or unloadable file; and the temporary files of killed writes
do not pile up: the next successful save removes them.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from savable_loader.state import (
    DatasetState,
    LoaderConfig,
    PipelinePosition,
    RankState,
    WorkerState,
    load_file,
    save_file,
)

pytestmark = pytest.mark.timeout(120)

KILLS = 20

BLOB = 1 << 18


def _state(i: int) -> RankState:
    return RankState(
        config=LoaderConfig(
            rank=0,
            world_size=1,
            num_workers=1,
            seed=i,
            batch_size=None,
            shuffle=False,
            drop_last=False,
            dataset_fingerprint=f"{i:024d}",
        ),
        position=PipelinePosition(
            epoch=0,
            next_worker=0,
            workers=[
                WorkerState(
                    worker_id=0,
                    index=i,
                    snapshot_index=i,
                    dataset=DatasetState(type="t", fields={"i": i, "blob": bytes([i % 251]) * BLOB}),
                )
            ],
        ),
    )


def _writer(path: str, ready: Any) -> None:
    save_file(path, _state(0))
    ready.set()
    i = 1
    while True:
        save_file(path, _state(i))
        i += 1


def _check(path: Path) -> int:
    state = load_file(path)
    ws = state.position.workers[0]
    i = ws.index
    assert state.config.seed == i and state.config.dataset_fingerprint == f"{i:024d}", f"mixed fields at {i}"
    assert ws.dataset.fields["i"] == i and ws.dataset.fields["blob"] == bytes([i % 251]) * BLOB
    return i


def _kill_writers(path: Path, kills: int, rng: random.Random, max_sleep: float) -> Iterator[None]:
    """``kills`` times: start a writer of ``path``, SIGKILL it at a random moment up to
    ``max_sleep`` seconds after its first save, reap it, then yield."""
    context = multiprocessing.get_context("fork")  # a real process, without interpreter start-up
    for _ in range(kills):
        ready = context.Event()
        child = context.Process(target=_writer, args=(str(path), ready), daemon=True)
        child.start()
        try:
            assert ready.wait(30), "the writer did not start"
            time.sleep(rng.uniform(0.0, max_sleep))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        assert child.exitcode == -signal.SIGKILL
        yield


def _temp_files(folder: Path, path: Path) -> list[Path]:
    leftovers = [p for p in folder.iterdir() if p.name != path.name]
    assert all(p.name.startswith(f".{path.name}.tmp-") for p in leftovers), leftovers
    return leftovers


def test_sigkill_during_save_file_never_leaves_a_torn_file(tmp_path: Path) -> None:
    path = tmp_path / "loader.state"
    last = -1
    progressed = 0
    for _ in _kill_writers(path, KILLS, random.Random("crash-consistency"), 0.15):
        i = _check(path)  # loadable, complete, and one of the states written
        progressed += i > 0
        last = i
    assert last >= 0
    assert progressed > KILLS // 2, f"only {progressed} of {KILLS} kills happened after a rewrite started"
    # a killed write leaves its temporary file (never loaded, never renamed over the
    # target) until the next writer's first successful save removes it
    assert len(_temp_files(tmp_path, path)) <= 1


def test_thirty_kills_then_one_save_leave_at_most_one_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "loader.state"
    most = 0
    for _ in _kill_writers(path, 30, random.Random("temp-files"), 0.05):
        most = max(most, len(_temp_files(tmp_path, path)))
    assert most >= 1, "no kill landed inside a write: the test shows nothing"
    save_file(path, _state(12345))
    assert len(_temp_files(tmp_path, path)) <= 1
    assert _check(path) == 12345
