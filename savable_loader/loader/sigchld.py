"""Worker-death signals surface only inside loader calls, never at random points.

torch's DataLoader installs a SIGCHLD handler that raises ``RuntimeError`` in the main
thread wherever it happens to be when a worker dies: in the training step, in a
checkpoint write, in ``time.sleep``. We wrap that handler: while the main thread is
inside a loader call (``next``, ``save_state_rank``) the signal is handled at once, and
the loader turns torch's error into a :class:`~savable_loader.errors.WorkerDiedError`;
outside, it is remembered and handled at the start of the next loader call.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["install", "loader_call"]

_state: dict[str, Any] = {"depth": 0, "pending": False, "wrapped": None, "running": False}


def _handler(signum: int, frame: Any) -> None:
    if _state["running"]:
        return  # a handler installed after ours chains back to us: break the loop
    if _state["depth"] == 0:
        _state["pending"] = True
        return
    _call_wrapped(signum, frame)


def _call_wrapped(signum: int, frame: Any) -> None:
    wrapped = _state["wrapped"]
    if not callable(wrapped):
        return
    _state["running"] = True
    try:
        wrapped(signum, frame)
    finally:
        _state["running"] = False


def install() -> None:
    """Wrap the current SIGCHLD handler (torch's, set when a DataLoader first starts
    workers in this process); main thread only."""
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGCHLD)
    if current is _handler:
        return
    _state["wrapped"] = current
    signal.signal(signal.SIGCHLD, _handler)


class loader_call:  # (lower case: a context manager used as a function)
    """Mark the main thread as inside a loader call; deliver a remembered signal first.
    A class rather than a generator function: the loader enters one per batch."""

    __slots__ = ("_main",)

    def __enter__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        if not self._main:
            return
        _state["depth"] += 1
        if _state["pending"]:
            _state["pending"] = False
            try:
                _call_wrapped(signal.SIGCHLD, None)
            except BaseException:
                _state["depth"] -= 1
                raise

    def __exit__(self, *exc: object) -> None:
        if self._main:
            _state["depth"] -= 1
