"""Nothing is left behind: worker processes, threads, pipes/queues (file descriptors),
shared memory.

50 create/iterate/destroy cycles over both paths (2 fork workers) and every way an
iteration can end: run to the end, ``break``, an exception in the training loop, a
worker error, ``del`` of the loader while its iterator lives, and a reference cycle
freed by the garbage collector. After each cycle no child process and no extra thread
may remain; after all of them the number of open file descriptors and of torch shared
memory files is what it was after the first (warm-up) round.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

import savable_loader as sl
from savable_loader.wrappers import MapDataset
from tests.common import RandomMapDataset, RangeSource

pytestmark = pytest.mark.timeout(240)

CYCLES = 50
GRACE = 5.0  # seconds a finished cycle may take to release everything


class Boom(Exception):
    pass


class _FailingMap(RandomMapDataset):
    def __getitem__(self, i: int) -> Any:
        if i == 7:
            raise Boom("injected")
        return super().__getitem__(i)


def _fail_at_7(x: Any) -> Any:
    if int(x[0]) == 7:
        raise Boom("injected")
    return x


def make(path: str, failing: bool = False, persistent: bool = False) -> sl.SavableDataLoader:
    if path == "dropin":
        ds = _FailingMap(24) if failing else RandomMapDataset(24)
        return sl.SavableDataLoader(
            ds,
            batch_size=2,
            shuffle=True,
            seed=1,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=persistent,
        )
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=1)
    ds = MapDataset(RangeSource(24, wc), _fail_at_7 if failing else (lambda x: x))
    return sl.SavableDataLoader(
        ds, batch_size=None, worker_config=wc, multiprocessing_context="fork", persistent_workers=persistent
    )


def end_normally(path: str) -> None:
    loader = make(path)
    assert len(list(loader)) > 5
    loader.save_state_rank()


def end_with_break(path: str) -> None:
    loader = make(path)
    for i, _ in enumerate(loader):
        if i == 3:
            loader.save_state_rank()
            break


def end_with_exception_in_the_loop(path: str) -> None:
    loader = make(path)
    with pytest.raises(Boom):
        for i, _ in enumerate(loader):
            if i == 2:
                raise Boom("in the training step")


def end_with_worker_error(path: str) -> None:
    loader = make(path, failing=True)
    with pytest.raises(Boom):
        list(loader)


def end_with_del_of_a_persistent_loader(path: str) -> None:
    loader = make(path, persistent=True)
    list(loader)
    it = iter(loader)
    next(it)
    del loader  # the iterator keeps it alive
    next(it)
    del it


def end_in_a_garbage_cycle(path: str) -> None:
    holder: dict[str, Any] = {"loader": make(path)}
    holder["self"] = holder
    holder["it"] = iter(holder["loader"])
    next(holder["it"])
    del holder
    gc.collect()


ENDINGS: list[Callable[[str], None]] = [
    end_normally,
    end_with_break,
    end_with_exception_in_the_loop,
    end_with_worker_error,
    end_with_del_of_a_persistent_loader,
    end_in_a_garbage_cycle,
]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _shm() -> int:
    shm = Path("/dev/shm")
    return sum(1 for p in shm.iterdir() if p.name.startswith("torch_")) if shm.exists() else 0


def _wait_released(children: set[int], threads: set[str], what: str) -> None:
    me = psutil.Process()
    deadline = time.monotonic() + GRACE
    while True:
        left_children = [
            p
            for p in me.children(recursive=True)
            if p.pid not in children and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
        left_threads = [t.name for t in threading.enumerate() if t.name not in threads]
        if not left_children and not left_threads:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: left behind processes {left_children} and threads {left_threads}")
        time.sleep(0.05)


def test_no_processes_threads_fds_or_shared_memory_left() -> None:
    gc.collect()
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    threads = {t.name for t in threading.enumerate()}
    baseline: tuple[int, int] | None = None
    started = time.monotonic()
    for cycle in range(CYCLES):
        path = "dropin" if cycle % 2 == 0 else "pipeline"
        ending = ENDINGS[cycle % len(ENDINGS)]
        ending(path)
        _wait_released(children, threads, f"cycle {cycle} ({path}, {ending.__name__})")
        if cycle == 2 * len(ENDINGS) - 1:  # warm-up done: every ending ran on both paths
            gc.collect()
            baseline = (_fds(), _shm())
    gc.collect()
    assert baseline is not None
    assert (_fds(), _shm()) == baseline, (
        f"fds, shm files: {(_fds(), _shm())} after {CYCLES} cycles, {baseline} after warm-up"
    )
    # each cycle ends promptly (a shutdown that waits for join timeouts would take > 5 s)
    assert time.monotonic() - started < CYCLES * 3.0
