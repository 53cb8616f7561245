"""Main side of the worker command protocol: one command and one result pipe per worker.

Requests go out to every worker at once and answers are collected with a deadline. While
waiting, the worker process is checked for liveness every ``POLL_SECONDS``: a dead worker
is a :class:`WorkerDiedError`, an unanswered one a :class:`WorkerTimeoutError`, both
naming the worker. Nothing here ever blocks without a timeout.
"""

from __future__ import annotations

import itertools
import threading
import time
from multiprocessing.connection import wait
from typing import Any

import msgspec

from savable_loader.errors import InternalError, StateError, WorkerDiedError, WorkerTimeoutError
from savable_loader.state.codec import decode_part
from savable_loader.state.schema import WorkerState

__all__ = ["POLL_SECONDS", "WorkerChannels"]

POLL_SECONDS = 0.05

#: Epoch of the ``release`` sent when the channels close: releases every epoch.
_RELEASE_ALL = 2**62


class WorkerChannels:
    """Pipes to ``num_workers`` worker processes, indexed by physical worker id.

    ``worker_ends()`` are handed to the workers (inside the dataset they receive);
    ``close_worker_ends()`` drops the main process's copies once the workers started.
    """

    _ids = itertools.count()

    def __init__(self, context: Any, num_workers: int) -> None:
        self._main: list[tuple[Any, Any]] = []
        self._worker: list[tuple[Any, Any]] | None = []
        for _ in range(num_workers):
            cmd_r, cmd_w = context.Pipe(duplex=False)
            res_r, res_w = context.Pipe(duplex=False)
            self._main.append((cmd_w, res_r))
            self._worker.append((cmd_r, res_w))
        # Commands are sent from the iterating thread (release) and from a saving thread.
        self._send_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._main

    def worker_ends(self) -> list[tuple[Any, Any]]:
        if self._worker is None:
            raise InternalError("worker pipe ends were already closed")
        return self._worker

    def close_worker_ends(self) -> None:
        for ends in self._worker or ():
            for conn in ends:
                try:
                    conn.close()
                except OSError:  # finalised first by the cycle collector
                    pass
        self._worker = None

    def release(self, physical: int, epoch: int) -> None:
        """Tell a worker that its end marker of ``epoch`` was taken: it may end its iteration.

        A worker that cannot be reached any more needs no release; that is not an error here.
        """
        if physical >= len(self._main):
            return
        try:
            with self._send_lock:
                self._main[physical][0].send_bytes(msgspec.msgpack.encode(["release", -1, epoch, 0]))
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self.close_worker_ends()
        for physical in range(len(self._main)):  # an abandoned iteration: let every worker end
            self.release(physical, _RELEASE_ALL)
        for cmd_w, res_r in self._main:
            for conn in (cmd_w, res_r):
                try:
                    conn.close()
                except OSError:  # finalised first by the cycle collector
                    pass
        self._main = []

    def checkpoint(
        self,
        requests: dict[int, tuple[int, int, int]],
        processes: list[Any] | None,
        timeout: float,
    ) -> dict[int, WorkerState]:
        """Ask workers for their state; ``requests`` maps physical id to
        ``(logical id, epoch, samples yielded)``. Returns physical id -> WorkerState."""
        pending: dict[int, int] = {}
        for physical, (logical, epoch, index) in requests.items():
            request_id = next(self._ids)
            cmd_w, _ = self._main[physical]
            try:
                with self._send_lock:
                    cmd_w.send_bytes(msgspec.msgpack.encode(["checkpoint", request_id, epoch, index]))
            except (OSError, ValueError) as e:
                raise WorkerDiedError(
                    f"cannot reach worker {logical} to save its state: {e}", worker_id=logical
                ) from e
            pending[physical] = request_id
        answers: dict[int, WorkerState] = {}
        deadline = time.monotonic() + timeout
        while pending:
            conns = {self._main[physical][1]: physical for physical in pending}
            try:
                ready = wait(list(conns), POLL_SECONDS)
            except (OSError, ValueError) as e:
                raise WorkerDiedError(f"lost the pipe to a worker while saving: {e}") from e
            for conn in ready:
                physical = conns[conn]
                logical = requests[physical][0]
                try:
                    kind, request_id, payload = msgspec.msgpack.decode(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError) as e:
                    raise WorkerDiedError(f"worker {logical} closed its pipe: {e}", worker_id=logical) from e
                if request_id != pending[physical]:
                    continue  # a late answer to an earlier, timed-out request
                del pending[physical]
                if kind != "ok":
                    raise StateError(f"worker {logical} could not save its state: {payload}")
                answers[physical] = decode_part(payload, WorkerState)
            if ready:
                continue
            for physical in pending:
                process = processes[physical] if processes is not None and physical < len(processes) else None
                if process is not None and not process.is_alive():
                    logical = requests[physical][0]
                    raise WorkerDiedError(
                        f"worker {logical} (pid {process.pid}) exited with code {process.exitcode} "
                        "while the loader was saving its state",
                        worker_id=logical,
                    )
            if time.monotonic() > deadline:
                logical = requests[next(iter(pending))][0]
                raise WorkerTimeoutError(
                    f"worker {logical} did not answer a save request within {timeout:g} s",
                    worker_id=logical,
                )
        return answers
