"""The private parts of torch and CPython that savable_loader relies on, in one place.

torch offers no public way to do what is done here: keep persistent workers' iterator,
stop an iterator's workers now, know its worker processes and the task it waits for,
tell a dead or hung worker from torch's error text, make ``get_worker_info()`` show the
user's dataset, and send a worker's unpicklable result back as an error. CPython keeps
the multiprocessing queue internals private too. Nothing here reads or writes another
library's memory: the global random generators are reached through their public APIs
(``savable_loader/_rng_states.py``).

Every access goes through this module and **fails loudly**: a missing attribute raises
``AttributeError`` naming it and the installed torch version (never a silent
``getattr(..., None) or []``). ``tests/test_torch_internals.py`` checks every attribute
and every error-text pattern against the installed torch, so a torch upgrade that moves
something fails there first. ``pyproject.toml`` declares the torch range CI tests.

Example::

    for process in worker_processes(torch_iter):   # [] for an in-process iterator
        print(process.pid)
"""

from __future__ import annotations

import dataclasses
import multiprocessing.queues
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader
from torch.utils.data._utils import worker as _torch_worker
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from savable_loader.errors import InternalError

__all__ = [
    "DIED_TEXTS",
    "TIMEOUT_TEXT",
    "WORKER_PROCESS_TEXT",
    "ExceptionWrapper",
    "died_pids",
    "loader_iterator",
    "next_batch",
    "pending_worker",
    "queue_push_front",
    "replace_worker_info",
    "set_loader_iterator",
    "set_queue_feeder_hook",
    "shutdown_workers",
    "torch_worker_id",
    "worker_done_event",
    "worker_processes",
    "worker_seed_setter",
]

#: (pid, id torch gave the worker process), recorded before the first replacement.
_original: list[tuple[int, int]] = []

#: torch's RuntimeError texts (``torch/utils/data/dataloader.py``, ``_utils/signal_handling.py``
#: and torch's C++ SIGCHLD handler) that say a worker died or hung.
TIMEOUT_TEXT = "timed out"
DIED_TEXTS = ("exited unexpectedly", "killed by signal", "is killed")
#: The prefix of the ``where`` of an ExceptionWrapper a worker sends (``reraise`` shows it).
WORKER_PROCESS_TEXT = "DataLoader worker process"
_PIDS = re.compile(r"pid(?:\(s\))?\s+([\d, ]+)")


def _missing(what: str) -> AttributeError:
    return AttributeError(f"savable_loader needs {what}, which torch {torch.__version__} does not have")


def _attr(obj: Any, name: str, what: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(what) from None


# -- torch's DataLoader and its iterators ---------------------------------------------


def loader_iterator(engine: DataLoader[Any]) -> Any:
    """``DataLoader._iterator``: torch's iterator of persistent workers (None if none)."""
    return _attr(engine, "_iterator", "DataLoader._iterator")


def set_loader_iterator(engine: DataLoader[Any], value: Any) -> None:
    """Set ``DataLoader._iterator`` (None: persistent workers start anew next time)."""
    _attr(engine, "_iterator", "DataLoader._iterator")
    engine._iterator = value


#: True while torch's profiler records (``torch.profiler.profile``, the autograd profiler).
_PROFILING: Callable[[], bool] = _attr(torch._C._autograd, "_profiler_enabled", "torch._C._autograd._profiler_enabled")


def next_batch(torch_iter: Any) -> Any:
    """``next(torch_iter)``. torch's single-process iterator is stepped as its
    ``__next__`` steps it (``_next_data``, ``_num_yielded``) but without the
    ``record_function`` span around it while no profiler records: that span costs about
    4 µs a batch even unrecorded, which a loader reading in the main process pays on
    every item. With a profiler on, with a length reported to torch (its warning when
    more items come) or before torch's first ``_reset``, it is ``next(torch_iter)``.
    (An execution-trace observer alone does not see the span on this path.)"""
    if type(torch_iter) is not _SingleProcessDataLoaderIter or _PROFILING():
        return next(torch_iter)
    try:
        plain = torch_iter._sampler_iter is not None and torch_iter._IterableDataset_len_called is None
    except AttributeError:
        raise _missing("_SingleProcessDataLoaderIter._sampler_iter and _IterableDataset_len_called") from None
    if not plain:
        return next(torch_iter)
    data = torch_iter._next_data()
    torch_iter._num_yielded += 1
    return data


def _multiprocess(torch_iter: Any) -> bool:
    return isinstance(torch_iter, _MultiProcessingDataLoaderIter)


def worker_processes(torch_iter: Any) -> list[Any]:
    """The worker processes of torch's iterator, by physical id ([] in-process or None)."""
    if not _multiprocess(torch_iter):
        return []
    return list(_attr(torch_iter, "_workers", "_MultiProcessingDataLoaderIter._workers"))


def shutdown_workers(torch_iter: Any) -> None:
    """Stop the workers of torch's iterator now (nothing for an in-process one)."""
    if _multiprocess(torch_iter):
        _attr(torch_iter, "_shutdown_workers", "_MultiProcessingDataLoaderIter._shutdown_workers")()


def pending_worker(torch_iter: Any) -> int | None:
    """The physical worker whose result torch's iterator waits for (None if unknown)."""
    if not _multiprocess(torch_iter):
        return None
    tasks = _attr(torch_iter, "_task_info", "_MultiProcessingDataLoaderIter._task_info")
    info = tasks.get(_attr(torch_iter, "_rcvd_idx", "_MultiProcessingDataLoaderIter._rcvd_idx"))
    return None if not info else int(info[0])


def died_pids(text: str) -> set[int]:
    """The pids a torch "worker exited unexpectedly" error names."""
    match = _PIDS.search(text)
    return {int(p) for p in re.findall(r"\d+", match.group(1))} if match else set()


def replace_worker_info(**changes: Any) -> None:
    """In a DataLoader worker, make ``get_worker_info()`` return its info with ``changes``
    (e.g. ``dataset=`` the user's dataset, ``id=`` a logical worker id).

    Example::

        replace_worker_info(dataset=user_dataset)   # get_worker_info().dataset is now it
    """
    if not hasattr(_torch_worker, "_worker_info"):
        raise _missing("torch.utils.data._utils.worker._worker_info")
    info = _torch_worker._worker_info
    if info is None:
        raise InternalError("replace_worker_info called outside a DataLoader worker")
    if not _original or _original[0][0] != os.getpid():
        _original[:] = [(os.getpid(), info.id)]
    _torch_worker._worker_info = dataclasses.replace(info, **changes)


def worker_seed_setter() -> Callable[[int], None] | None:
    """In a DataLoader worker: a function that sets what ``get_worker_info().seed`` says
    (the info object is frozen: its field is set in place, ~0.1 µs); None outside one.

    The drop-in path sets it to each sample's seed, the value ``torch.initial_seed()``
    gives while the sample loads (torch's invariant: the two are equal in a worker), so
    that a dataset seeding from it (``np.random.default_rng(get_worker_info().seed + i)``)
    draws what the sample's position decides, not what the worker that loads it does.

    Example::

        set_seed = worker_seed_setter()
        if set_seed is not None:
            set_seed(s)          # get_worker_info().seed == s
    """
    info = _torch_worker._worker_info if hasattr(_torch_worker, "_worker_info") else None
    if info is None or not hasattr(info, "seed"):
        return None
    setter = object.__setattr__

    def set_seed(seed: int) -> None:
        setter(info, "seed", seed)

    return set_seed


_DONE_EVENT: tuple[int, Any] | None = None


def worker_done_event() -> Any:
    """In a DataLoader worker process: the ``done_event`` of torch's worker loop, which the
    main process sets when it shuts the workers down; None outside a worker.

    A source that waits inside one item (a stream waiting for its producers) checks it
    between bounded waits and ends, instead of being killed after torch's 5 s join timeout
    per worker. torch passes it only as an argument of ``_worker_loop``: it is read from
    that function's frame (the caller's stack) once per process.

    Example::

        done = worker_done_event()
        if done is not None and done.is_set():
            return   # the loader is shutting its workers down
    """
    global _DONE_EVENT
    if _torch_worker._worker_info is None:
        return None
    pid = os.getpid()
    if _DONE_EVENT is not None and _DONE_EVENT[0] == pid:
        return _DONE_EVENT[1]
    if threading.current_thread() is not threading.main_thread():
        return None  # (a thread of the user's inside the worker: torch's loop is not on its stack)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_worker_loop" and frame.f_globals.get("__name__") == _torch_worker.__name__:
            if "done_event" not in frame.f_locals:
                break
            _DONE_EVENT = (pid, frame.f_locals["done_event"])
            return _DONE_EVENT[1]
        frame = frame.f_back  # type: ignore[assignment]
    raise _missing("torch.utils.data._utils.worker._worker_loop's done_event argument on a worker's stack")


def torch_worker_id() -> int | None:
    """The id torch gave this worker process (its place in torch's round robin), also
    after :func:`replace_worker_info` changed what ``get_worker_info().id`` says; None
    outside a DataLoader worker.

    Example::

        replace_worker_info(id=3)
        torch_worker_id()          # still the id torch started the worker with
    """
    info = _torch_worker._worker_info
    if info is None:
        return None
    if _original and _original[0][0] == os.getpid():
        return _original[0][1]
    return info.id


# -- CPython's multiprocessing queues ------------------------------------------------


def set_queue_feeder_hook(hook: Callable[..., None]) -> None:
    """Make ``hook(queue, error, obj)`` the feeder-error hook of multiprocessing queues
    (CPython calls ``self._on_queue_feeder_error(e, obj)`` when ``obj`` cannot be sent)."""
    _attr(multiprocessing.queues.Queue, "_on_queue_feeder_error", "multiprocessing.queues.Queue._on_queue_feeder_error")
    multiprocessing.queues.Queue._on_queue_feeder_error = hook  # type: ignore[attr-defined]


def queue_push_front(queue: Any, item: Any) -> None:
    """Put ``item`` first in a multiprocessing queue's feeder buffer, as ``put`` would,
    also while the queue is closing (``put`` refuses then)."""
    _attr(queue, "_sem", "multiprocessing.queues.Queue._sem").acquire(False)  # the receiving get releases it
    with _attr(queue, "_notempty", "multiprocessing.queues.Queue._notempty"):
        _attr(queue, "_buffer", "multiprocessing.queues.Queue._buffer").appendleft(item)
        queue._notempty.notify()
