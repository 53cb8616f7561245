"""A sample a worker cannot pickle is an error in the main process, not a hang.

A DataLoader worker puts each result on a ``multiprocessing`` queue, whose background
feeder thread pickles it. When pickling fails, the standard library prints the error in
the worker and drops the item: the main process then waits forever for it (or until
torch's ``timeout=``, with an error that does not say why). In loader workers we replace
the queue's feeder-error hook: the dropped result is replaced by torch's
``ExceptionWrapper`` carrying the pickling error and its traceback, which the main
process re-raises as ``Caught TypeError in DataLoader worker process N ...``.

Installed by the worker init function of :class:`~savable_loader.SavableDataLoader`
(worker processes only; the main process's queues are left alone).

The same function hands each worker the loader's shutdown signal
(:func:`~savable_loader.core.shutdown.worker_done_event`).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
from torch.utils.data import get_worker_info

from savable_loader._torch.internals import (
    ExceptionWrapper,
    queue_push_front,
    replace_worker_info,
    set_queue_feeder_hook,
)
from savable_loader.core.shutdown import keep_done_event
from savable_loader.loader.parent_watch import start_parent_watch

__all__ = ["WorkerInit", "install_feeder_hook"]

_state = {"installed": False}


def _on_feeder_error(queue: Any, error: BaseException, obj: Any) -> None:
    """Called by the queue's feeder thread, inside its ``except`` block."""
    if not (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], int)):
        traceback.print_exc()  # not a DataLoader result: the standard behaviour
        return
    info = get_worker_info()
    worker = info.id if info is not None else "?"
    wrapper = ExceptionWrapper(
        where=f"in DataLoader worker process {worker} while sending its result to the main process "
        f"(the sample cannot be pickled: {type(error).__name__}: {error})"
    )
    if isinstance(obj[1], ExceptionWrapper):  # even the error could not be sent: plain text
        wrapper.exc_type = RuntimeError
    try:
        # Straight into the feeder's buffer, as ``put`` would, but also when the worker is
        # already closing the queue (``put`` refuses then): the feeder sends it next.
        queue_push_front(queue, (obj[0], wrapper))  # in the place of the dropped item
    except Exception:  # noqa: BLE001 - never let the hook end the feeder thread
        traceback.print_exc()


def install_feeder_hook() -> None:
    """Replace the feeder-error hook of multiprocessing queues in this (worker) process."""
    if not _state["installed"]:
        # A plain function on the class: ``Queue._start_thread`` passes the bound method
        # ``self._on_queue_feeder_error``, so the hook gets the queue to send the error on.
        set_queue_feeder_hook(_on_feeder_error)
        _state["installed"] = True


class WorkerInit:
    """The worker init function the loader hands torch: installs the hook, makes
    ``get_worker_info().dataset`` the worker's copy of the user's dataset (torch's info
    holds the loader's internal wrapper), keeps the loader's shutdown Event for
    :func:`~savable_loader.core.shutdown.worker_done_event`, then runs the user's ``worker_init_fn`` (cloudpickled, so
    that lambdas cross ``spawn``).

    Example::

        DataLoader(..., worker_init_fn=WorkerInit(user_fn).with_done(context.Event()))
    """

    def __init__(self, user_fn: Callable[[int], None] | None, done: Any = None) -> None:
        self.user_fn = user_fn
        self.done = done
        self.main_pid: int | None = None  # None: a forked worker, whose parent is the main process

    def with_done(self, done: Any) -> WorkerInit:
        """The same function with shutdown Event ``done`` (one per torch iterator)."""
        return WorkerInit(self.user_fn, done)

    def __getstate__(self) -> dict[str, Any]:
        # cloudpickle carries a lambda or local function to spawn/forkserver workers;
        # pickled in the main process as it starts them (a forkserver worker's parent is
        # the fork server; the Event crosses as multiprocessing passes it to a process it starts)
        return {"user_fn": cloudpickle.dumps(self.user_fn), "done": self.done, "main_pid": os.getpid()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.user_fn = cloudpickle.loads(state["user_fn"])
        self.done = state["done"]
        self.main_pid = state["main_pid"]

    def __call__(self, worker_id: int) -> None:
        install_feeder_hook()
        # the worker ends when the main process is gone (loader/parent_watch.py)
        start_parent_watch(os.getppid() if self.main_pid is None else self.main_pid)
        keep_done_event(self.done)
        info = get_worker_info()
        engine_dataset = info.dataset if info is not None else None
        user_dataset = getattr(engine_dataset, "user_dataset", None)
        if user_dataset is not None:
            replace_worker_info(dataset=user_dataset)
        # A plain IterableDataset's path shows the worker's logical id (pipeline/iterable.py):
        # the id the user's function gets, and get_worker_info().id.
        started = getattr(engine_dataset, "worker_started", None)
        if callable(started):
            worker_id = started(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)
