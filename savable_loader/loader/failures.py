"""torch's worker failures as savable_loader errors that name the (logical) worker.

torch reports a dead worker as a ``RuntimeError`` whose text holds pids, a timeout as a
``RuntimeError`` "timed out", and a worker killed after it queued a tensor as a bare
``EOFError`` / ``ConnectionResetError`` from the shared-memory handshake. These helpers
turn them into :class:`WorkerDiedError` / :class:`WorkerTimeoutError` naming the logical
worker (after a pipeline restore, physical worker ``p`` plays another logical id).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from savable_loader._torch.internals import (
    DIED_TEXTS,
    TIMEOUT_TEXT,
    WORKER_PROCESS_TEXT,
    died_pids,
    pending_worker,
    worker_processes,
)
from savable_loader.errors import WorkerDiedError, WorkerTimeoutError

__all__ = ["terminate_worker", "translate_worker_error"]

#: Seconds to wait for a worker that broke a pipe to be seen dead.
DEATH_GRACE = 1.0


def translate_worker_error(
    error: Exception, torch_iter: Any, logical: Callable[[int], int], timeout: float
) -> Exception:
    """Our error for ``error`` raised by torch's iterator, or ``error`` itself."""
    text = str(error)
    workers = worker_processes(torch_iter)
    if isinstance(error, (EOFError, OSError)) and workers and WORKER_PROCESS_TEXT not in text:
        # A worker killed after queueing a tensor: receiving the tensor's shared memory
        # from the dead worker fails with a bare EOFError / ConnectionResetError.
        return _dead_worker_error(error, workers, logical)
    if not isinstance(error, RuntimeError):
        return error
    if TIMEOUT_TEXT in text:
        physical = pending_worker(torch_iter)
        worker = None if physical is None else logical(physical)
        return WorkerTimeoutError(
            f"worker {worker} produced nothing within timeout={timeout:g} s ({text})", worker_id=worker
        )
    if any(died in text for died in DIED_TEXTS):
        pids = died_pids(text)
        ids = [logical(i) for i, w in enumerate(workers) if w.pid in pids]
        name = f"worker {ids[0]}" if len(ids) == 1 else f"workers {ids}"
        return WorkerDiedError(f"{name} exited unexpectedly ({text})", worker_id=ids[0] if ids else None)
    return error


def _dead_worker_error(error: Exception, workers: list[Any], logical: Callable[[int], int]) -> Exception:
    deadline = time.monotonic() + DEATH_GRACE
    while True:
        dead = [(i, w) for i, w in enumerate(workers) if not w.is_alive()]
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not dead:
        return error
    ids = [logical(i) for i, _ in dead]
    name = f"worker {ids[0]}" if len(ids) == 1 else f"workers {ids}"
    codes = ", ".join(f"pid {w.pid} exit code {w.exitcode}" for _, w in dead)
    return WorkerDiedError(
        f"{name} exited unexpectedly ({codes}; {type(error).__name__} while receiving a sample it had sent)",
        worker_id=ids[0],
    )


def terminate_worker(torch_iter: Any, logical: Callable[[int], int], worker_id: int | None) -> None:
    """End a hung worker (SIGTERM): it would not stop on request, and a shutdown would
    wait for it."""
    for physical, process in enumerate(worker_processes(torch_iter)):
        if logical(physical) == worker_id and process.is_alive():
            process.terminate()
