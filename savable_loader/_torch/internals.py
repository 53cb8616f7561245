"""The private parts of torch and CPython that savable_loader relies on, in one place.

torch offers no public way to do what is done here: keep persistent workers' iterator,
stop an iterator's workers now (and know when it stops them), know its worker processes
and the task it waits for, tell a dead or hung worker from torch's error text, make
``get_worker_info()`` show the user's dataset, and send a worker's unpicklable result
back as an error. CPython keeps the multiprocessing queue internals private too. Nothing
here reads or writes another library's memory, nor the caller's stack: the global random
generators are reached through their public APIs (``savable_loader/rng/states.py``).

Supported: torch 2.4 through the newest release (``pyproject.toml`` declares no cap).
Where torch changed the shape of a part between those releases, one small adapter per
shape is chosen by what the installed torch has, never by its version number:
``WorkerInfo`` is a plain class before torch 2.13 and a frozen dataclass since
(:func:`replace_worker_info`). The iterator attributes, the error texts and the SIGCHLD
handling used here kept one shape from 2.4 to 2.15.

Every access goes through this module and **fails loudly**: a missing attribute raises
``AttributeError`` naming it and the installed torch version (never a silent
``getattr(..., None) or []``). ``tests/torch_internals/test_torch_internals.py`` checks every attribute,
every adapter and every error-text pattern against the installed torch, so a torch
release that moves something fails there first; CI runs it on the oldest supported torch
and the newest release (``scripts/torch_matrix.sh``).

Example::

    for process in worker_processes(torch_iter):   # [] for an in-process iterator
        print(process.pid)
"""

from __future__ import annotations

import _codecs
import dataclasses
import io
import multiprocessing.queues
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader
from torch.utils.data import _utils as _torch_data_utils
from torch.utils.data._utils import collate as _torch_collate
from torch.utils.data._utils import worker as _torch_worker
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from savable_loader.errors import InternalError

__all__ = [
    "DIED_TEXTS",
    "TIMEOUT_TEXT",
    "WORKER_PROCESS_TEXT",
    "ExceptionWrapper",
    "RESULT_PIPE_BYTES",
    "ShutdownEventLoader",
    "allow_bytes_in_weights_only_loads",
    "collate_with_tensor_rule",
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
    "worker_processes",
    "widen_pipe",
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
    """``next(torch_iter)``. torch's iterators are stepped as their ``__next__`` steps
    them (``_next_data``, ``_num_yielded``) but without the ``record_function`` span
    around it while no profiler records: that span costs about 4 µs a batch even
    unrecorded, which a loader reading in the main process pays on every item, and with
    worker processes its exit waits for the GIL behind the queues' feeder threads (up to
    a switch interval, on few cores). With a profiler on, with a length reported to torch
    (its warning when more items come) or before torch's first ``_reset``, it is
    ``next(torch_iter)``. (An execution-trace observer alone does not see the span on
    this path.)"""
    if type(torch_iter) not in _STEPPED or _PROFILING():
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


def _weights_only_loads_bytes() -> bool:
    """Whether ``torch.load(weights_only=True)`` takes a pickled ``bytes`` (torch's
    allowlist has ``_codecs.encode`` in 2.8 and later; 2.4 refuses it)."""
    buffer = io.BytesIO()
    torch.save({"probe": b"\x00\xff"}, buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True) == {"probe": b"\x00\xff"}
    except pickle.UnpicklingError:
        return False


def allow_bytes_in_weights_only_loads() -> None:
    """Make ``torch.load(weights_only=True)`` take ``bytes`` (a loader's
    ``state_dict()`` holds MessagePack bytes) where the installed torch refuses them, as
    later releases do: ``_codecs.encode`` (how pickle writes bytes) joins torch's safe
    globals through the public ``torch.serialization.add_safe_globals``. Nothing
    where torch takes bytes already.

    Example::

        allow_bytes_in_weights_only_loads()
        torch.load(file, weights_only=True)   # {"dp_rank_0": b"..."} on torch 2.4 too
    """
    if not _weights_only_loads_bytes():
        add = _attr(torch.serialization, "add_safe_globals", "torch.serialization.add_safe_globals")
        add([_codecs.encode])


def died_pids(text: str) -> set[int]:
    """The pids a torch "worker exited unexpectedly" error names."""
    match = _PIDS.search(text)
    return {int(p) for p in re.findall(r"\d+", match.group(1))} if match else set()


def _replace_dataclass(info: Any, changes: dict[str, Any]) -> Any:
    """torch 2.13 and later: ``WorkerInfo`` is a frozen dataclass."""
    return dataclasses.replace(info, **changes)


def _replace_plain(info: Any, changes: dict[str, Any]) -> Any:
    """torch before 2.13: ``WorkerInfo(**fields)`` is a plain class that refuses
    assignments after ``__init__`` and keeps its field names in ``__keys``."""
    keys = _attr(info, "_WorkerInfo__keys", "WorkerInfo's field names (WorkerInfo._WorkerInfo__keys)")
    fields = {key: getattr(info, key) for key in keys}
    return type(info)(**{**fields, **changes})


def _worker_info_fields(info: Any) -> tuple[str, ...]:
    if dataclasses.is_dataclass(info):
        return tuple(field.name for field in dataclasses.fields(info))
    return tuple(_attr(info, "_WorkerInfo__keys", "WorkerInfo's field names (WorkerInfo._WorkerInfo__keys)"))


#: How a ``WorkerInfo`` with other values is made, by the shape the installed torch has.
_REPLACE_INFO: Callable[[Any, dict[str, Any]], Any] = (
    _replace_dataclass if dataclasses.is_dataclass(_attr(_torch_worker, "WorkerInfo", "WorkerInfo")) else _replace_plain
)


def replace_worker_info(**changes: Any) -> None:
    """In a DataLoader worker, make ``get_worker_info()`` return its info with ``changes``
    (e.g. ``dataset=`` the user's dataset, ``id=`` a logical worker id).

    torch's ``WorkerInfo`` is a frozen dataclass from torch 2.13 on and a plain class
    that refuses assignments before: a new one is made either way (one adapter per shape).

    Example::

        replace_worker_info(dataset=user_dataset)   # get_worker_info().dataset is now it
    """
    if not hasattr(_torch_worker, "_worker_info"):
        raise _missing("torch.utils.data._utils.worker._worker_info")
    info = _torch_worker._worker_info
    if info is None:
        raise InternalError("replace_worker_info called outside a DataLoader worker")
    unknown = sorted(set(changes) - set(_worker_info_fields(info)))
    if unknown:
        raise _missing(f"WorkerInfo fields {unknown}")
    if not _original or _original[0][0] != os.getpid():
        _original[:] = [(os.getpid(), info.id)]
    _torch_worker._worker_info = _REPLACE_INFO(info, changes)


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


class _SignallingIterator(_MultiProcessingDataLoaderIter):
    """torch's iterator of worker processes that calls ``on_shutdown()`` first whenever
    it shuts its workers down: at the end of an epoch without persistent workers, on
    an error, on ``_shutdown_workers()`` and when it is collected (torch's ``__del__``)."""

    def __init__(self, loader: DataLoader[Any], on_shutdown: Callable[[], None]) -> None:
        self._on_shutdown = on_shutdown  # first: a failing __init__ shuts down too (__del__)
        super().__init__(loader)
        widen_pipe(_attr(self, "_worker_result_queue", "_MultiProcessingDataLoaderIter._worker_result_queue"))

    def _shutdown_workers(self) -> None:
        utils = _torch_data_utils  # (None when the interpreter tears this module down)
        if utils is not None and utils.python_exit_status is False:  # torch does nothing while Python exits
            self._on_shutdown()
        super()._shutdown_workers()


#: torch's iterators that ``next_batch`` steps itself (exactly these types: a subclass may
#: change ``__next__``).
_STEPPED = frozenset({_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter, _SignallingIterator})


def collate_with_tensor_rule(rule: Callable[..., Any]) -> Callable[[Any], Any]:
    """torch's ``default_collate`` with its rule for a batch of tensors replaced by
    ``rule(batch, torch_rule, collate_fn_map=...)`` (``torch_rule``: torch's own,
    ``collate_tensor_fn``); every other rule (NumPy arrays, numbers, strings, mappings,
    sequences, and what libraries register, as tensordict does) stays torch's, read from
    ``default_collate_fn_map`` at each call (``_utils.collate.collate``)."""
    collate = _attr(_torch_collate, "collate", "torch.utils.data._utils.collate.collate")
    fn_map = _attr(_torch_collate, "default_collate_fn_map", "torch.utils.data._utils.collate.default_collate_fn_map")
    torch_rule = _attr(_torch_collate, "collate_tensor_fn", "torch.utils.data._utils.collate.collate_tensor_fn")

    def tensor_rule(batch: Any, *, collate_fn_map: Any = None) -> Any:
        return rule(batch, torch_rule, collate_fn_map=collate_fn_map)

    def collate_batch(batch: Any) -> Any:
        return collate(batch, collate_fn_map={**fn_map, torch.Tensor: tensor_rule})

    return collate_batch


for _name in ("_get_iterator", "check_worker_number_rationality"):
    _attr(DataLoader, _name, f"DataLoader.{_name}")
_attr(_MultiProcessingDataLoaderIter, "_shutdown_workers", "_MultiProcessingDataLoaderIter._shutdown_workers")
_attr(_torch_data_utils, "python_exit_status", "torch.utils.data._utils.python_exit_status")


class ShutdownEventLoader(DataLoader[Any]):
    """torch's DataLoader that makes a ``multiprocessing`` Event (of its
    ``multiprocessing_context``) for each iterator of worker processes, hands it to those
    workers as ``worker_init_fn.with_done(event)`` (``loader.feeder.WorkerInit``) and sets it
    whenever that iterator stops them, however it stops them. A worker waiting inside
    one item can so end at once, as torch's own loop does between items.

    Example::

        class Engine(ShutdownEventLoader): ...
        Engine(dataset, num_workers=2, worker_init_fn=WorkerInit(None))
    """

    def _get_iterator(self) -> Any:
        init = self.worker_init_fn
        if self.num_workers == 0 or not hasattr(init, "with_done"):
            return super()._get_iterator()  # (no worker init function to hand an Event)
        self.check_worker_number_rationality()
        done = (self.multiprocessing_context or torch.multiprocessing).Event()
        self.worker_init_fn = init.with_done(done)  # type: ignore[union-attr]
        try:  # torch's iterator takes loader.worker_init_fn when it starts the workers
            return _SignallingIterator(self, done.set)
        finally:
            self.worker_init_fn = init


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


#: The pipe buffer asked for the workers' results: a message of up to about 1 MiB (a batch
#: that goes inline, ``dataset/inline.py``) is written whole, not 64 KiB at a time with the worker
#: waiting for the main process to read each part. Linux's default cap for one pipe
#: (``/proc/sys/fs/pipe-max-size``); it counts towards an unprivileged user's pipe quota
#: (``pipe-user-pages-soft``, 64 MiB by default: 64 live loader iterators with workers),
#: and once that is used up the pipe keeps its 64 KiB (the request is refused, not forced).
RESULT_PIPE_BYTES = 1 << 20


def widen_pipe(queue: Any, size: int = RESULT_PIPE_BYTES) -> int | None:
    """Grow the pipe under a multiprocessing queue (``Queue._reader``) to ``size`` bytes
    where the system allows it (Linux ``F_SETPIPE_SZ``); returns the size it has then,
    None where it cannot be changed (another system, a cap, the user's pipe quota: the
    queue works as before, only with smaller writes)."""
    reader = _attr(queue, "_reader", "multiprocessing.queues.Queue._reader")
    try:
        import fcntl  # (not on Windows)

        return int(fcntl.fcntl(reader.fileno(), fcntl.F_SETPIPE_SZ, size))  # (Linux only)
    except (ImportError, AttributeError):
        return None
    except OSError:  # EPERM above /proc/sys/fs/pipe-max-size or the quota; EBUSY
        return None


def queue_push_front(queue: Any, item: Any) -> None:
    """Put ``item`` first in a multiprocessing queue's feeder buffer, as ``put`` would,
    also while the queue is closing (``put`` refuses then)."""
    _attr(queue, "_sem", "multiprocessing.queues.Queue._sem").acquire(False)  # the receiving get releases it
    with _attr(queue, "_notempty", "multiprocessing.queues.Queue._notempty"):
        _attr(queue, "_buffer", "multiprocessing.queues.Queue._buffer").appendleft(item)
        queue._notempty.notify()
