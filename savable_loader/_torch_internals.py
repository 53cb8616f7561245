"""The private parts of torch and CPython that savable_loader relies on, in one place.

torch offers no public way to do what is done here: keep persistent workers' iterator,
stop an iterator's workers now (and know when it stops them), know its worker processes
and the task it waits for, tell a dead or hung worker from torch's error text, make
``get_worker_info()`` show the user's dataset, and send a worker's unpicklable result
back as an error. CPython and NumPy keep the global generators and the multiprocessing
queue internals private too.

Supported: torch 2.4 through the newest release (``pyproject.toml`` declares no cap).
Where torch changed the shape of a part between those releases, one small adapter per
shape is chosen by what the installed torch has, never by its version number:
``WorkerInfo`` is a plain class before torch 2.13 and a frozen dataclass since
(:func:`replace_worker_info`). The iterator attributes, the error texts and the SIGCHLD
handling used here kept one shape from 2.4 to 2.15.

Every access goes through this module and **fails loudly**: a missing attribute raises
``AttributeError`` naming it and the installed torch version (never a silent
``getattr(..., None) or []``). ``tests/test_torch_internals.py`` checks every attribute,
every adapter and every error-text pattern against the installed torch, so a torch
release that moves something fails there first; CI runs it on the oldest supported torch
and the newest release (``scripts/torch_matrix.sh``).

Example::

    for process in worker_processes(torch_iter):   # [] for an in-process iterator
        print(process.pid)
"""

from __future__ import annotations

import _codecs
import _random
import ctypes
import dataclasses
import io
import multiprocessing.queues
import os
import pickle
import random
import re
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader
from torch.utils.data import _utils as _torch_data_utils
from torch.utils.data._utils import worker as _torch_worker
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from savable_loader.errors import InternalError

__all__ = [
    "C_RANDOM_SEED",
    "DIED_TEXTS",
    "PY_RANDOM",
    "TIMEOUT_TEXT",
    "WORKER_PROCESS_TEXT",
    "ExceptionWrapper",
    "ShutdownEventLoader",
    "allow_bytes_in_weights_only_loads",
    "died_pids",
    "global_rng_state_io",
    "loader_iterator",
    "next_batch",
    "numpy_gauss_fingerprint",
    "numpy_global_randomstate",
    "numpy_mt_fingerprint",
    "pending_worker",
    "python_random_fingerprint",
    "queue_push_front",
    "replace_worker_info",
    "set_loader_iterator",
    "set_queue_feeder_hook",
    "shutdown_workers",
    "torch_rng_fingerprint",
    "torch_worker_id",
    "worker_processes",
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

#: The hidden ``random.Random`` behind Python's module-level random functions.
PY_RANDOM: random.Random = random.seed.__self__  # type: ignore[attr-defined]
#: The C ``seed`` of ``random.Random`` (skips the Python-level argument checks, ~0.5 µs).
C_RANDOM_SEED: Callable[..., None] = _random.Random.seed


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


class _SignallingIterator(_MultiProcessingDataLoaderIter):
    """torch's iterator of worker processes that calls ``on_shutdown()`` first whenever
    it shuts its workers down: at the end of an epoch without persistent workers, on
    an error, on ``_shutdown_workers()`` and when it is collected (torch's ``__del__``)."""

    def __init__(self, loader: DataLoader[Any], on_shutdown: Callable[[], None]) -> None:
        self._on_shutdown = on_shutdown  # first: a failing __init__ shuts down too (__del__)
        super().__init__(loader)

    def _shutdown_workers(self) -> None:
        utils = _torch_data_utils  # (None when the interpreter tears this module down)
        if utils is not None and utils.python_exit_status is False:  # torch does nothing while Python exits
            self._on_shutdown()
        super()._shutdown_workers()


for _name in ("_get_iterator", "check_worker_number_rationality"):
    _attr(DataLoader, _name, f"DataLoader.{_name}")
_attr(_MultiProcessingDataLoaderIter, "_shutdown_workers", "_MultiProcessingDataLoaderIter._shutdown_workers")
_attr(_torch_data_utils, "python_exit_status", "torch.utils.data._utils.python_exit_status")


class ShutdownEventLoader(DataLoader[Any]):
    """torch's DataLoader that makes a ``multiprocessing`` Event (of its
    ``multiprocessing_context``) for each iterator of worker processes, hands it to those
    workers as ``worker_init_fn.with_done(event)`` (``_feeder.WorkerInit``) and sets it
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


# -- CPython and NumPy ----------------------------------------------------------------


def numpy_global_randomstate() -> np.random.RandomState:
    """NumPy's global ``RandomState`` (behind ``np.random.seed`` and ``np.random.rand``)."""
    state = _attr(np.random.mtrand, "_rand", "numpy.random.mtrand._rand")
    if not isinstance(state, np.random.RandomState):
        raise _missing("numpy.random.mtrand._rand to be a RandomState")
    return state


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


#: CPython's ``RandomObject`` after the object head: ``int index; uint32_t state[624]``.
_PY_MT_BYTES = 4 + 4 * 624
#: NumPy's ``mt19937_state``: ``uint32_t key[624]; int pos``.
_NP_MT_BYTES = 4 * 624 + 4


def _python_layout_ok() -> bool:
    head = object.__basicsize__
    if _random.Random.__basicsize__ < head + _PY_MT_BYTES:
        return False
    probe = random.Random(20240601)
    for _ in range(2):
        _, words, _ = probe.getstate()
        expected = struct.pack(f"=i{len(words) - 1}I", words[-1], *words[:-1])
        if ctypes.string_at(id(probe) + head, _PY_MT_BYTES) != expected:
            return False
        probe.random()  # a second state (another index and words)
    return True


def _numpy_layout_ok() -> bool:
    probe = np.random.MT19937(20240601)
    for _ in range(2):
        state = probe.state["state"]
        expected = np.asarray(state["key"], dtype=np.uint32).tobytes() + struct.pack("=i", state["pos"])
        if ctypes.string_at(probe.ctypes.state_address, _NP_MT_BYTES) != expected:
            return False
        probe.random_raw()
    return True


def _numpy_gauss_offset() -> int | None:
    """Where a legacy ``RandomState`` keeps its cached Gaussian in the object (NumPy's
    ``aug_bitgen_t``: ``int has_gauss; double gauss``): the offset of ``has_gauss``, found
    and checked on private probes against ``get_state()``; None when no offset explains
    every probe (then callers read ``get_state()``)."""
    size = np.random.RandomState.__basicsize__
    probes = [np.random.RandomState(seed) for seed in (20240601, 7, 123456789)]
    for probe in probes:
        probe.standard_normal()  # two normals made, the second cached: has_gauss = 1
    found: int | None = None
    for probe in probes:
        whole = probe.get_state(legacy=False)
        has_gauss, gauss = whole["has_gauss"], whole["gauss"]
        raw = ctypes.string_at(id(probe), size)
        needle = struct.pack("=d", gauss)
        at = raw.find(needle, object.__basicsize__)
        offset = None if at < 8 else at - 8  # ``int has_gauss`` and its padding before the double
        if offset is None or has_gauss != 1 or struct.unpack_from("=i", raw, offset)[0] != 1:
            return None
        if found is not None and offset != found:
            return None
        found = offset
    if found is None:
        return None
    for probe in probes:  # taken: has_gauss back to 0, at the same place
        probe.standard_normal()
        cached = probe.get_state(legacy=False)["has_gauss"]
        if cached != 0 or struct.unpack_from("=i", ctypes.string_at(id(probe), size), found)[0] != 0:
            return None
    return found


_NP_GAUSS_OFFSET = _numpy_gauss_offset()


def numpy_gauss_fingerprint(state: np.random.RandomState) -> Callable[[], Any]:
    """A cheap function of a legacy ``RandomState``'s cached Gaussian (``has_gauss`` and
    the value): read in the object (about 0.2 µs) where the layout checks out, else from
    ``get_state()`` (about 25 µs). A ``np.random.normal()`` that takes a cached value
    moves no Mersenne Twister words (:func:`numpy_mt_fingerprint`); this shows it.
    ``state`` must outlive the function. Example::

        look = numpy_gauss_fingerprint(numpy_global_randomstate())
        np.random.seed(0); np.random.randn(); before = look(); np.random.randn(); look() != before   # True
    """
    offset = _NP_GAUSS_OFFSET
    if offset is None or type(state) is not np.random.RandomState:

        def slow() -> Any:
            whole = state.get_state(legacy=False)
            return whole["has_gauss"], whole["gauss"]

        return slow
    address = id(state) + offset
    string_at = ctypes.string_at

    def fast() -> bytes:
        if state is None:  # pragma: no cover - keeps ``state`` (the memory read) alive
            raise InternalError("numpy_gauss_fingerprint lost its RandomState")
        return string_at(address, 16)

    return fast


def python_random_fingerprint(gen: random.Random) -> Callable[[], Any]:
    """A cheap function of ``gen``'s whole state: two results are equal exactly when the
    states are (its Mersenne Twister words and position, and the cached ``gauss_next``).

    Reads CPython's ``RandomObject`` (``int index; uint32_t state[624]`` after the object
    head, about 0.2 µs) when that layout checks out against ``getstate()`` in this
    interpreter, else calls ``getstate()`` (about 5 µs). ``gen`` must outlive the function.

    Example::

        look = python_random_fingerprint(PY_RANDOM)
        before = look(); random.random(); look() != before   # True
    """
    if not _python_layout_ok():
        return gen.getstate
    address = id(gen) + object.__basicsize__
    string_at = ctypes.string_at
    return lambda: (string_at(address, _PY_MT_BYTES), gen.gauss_next)  # type: ignore[attr-defined]


def numpy_mt_fingerprint(state: np.random.RandomState) -> Callable[[], Any]:
    """A cheap function of a legacy ``RandomState``'s Mersenne Twister words and position
    (through the bit generator's public ``ctypes.state_address``, about 0.2 µs), or of its
    whole ``get_state()`` where the bit generator is not an MT19937 of the known layout.

    The cached Gaussian (``has_gauss``) is not part of the fast form: a caller that needs
    it seeds the generator first (``seed`` clears it), so that a Gaussian draw must move
    the words. Example::

        look = numpy_mt_fingerprint(numpy_global_randomstate())
        before = look(); np.random.rand(); look() != before   # True
    """
    bit = _attr(state, "_bit_generator", "numpy.random.RandomState._bit_generator")

    def whole() -> Any:
        # the generator the RandomState has now (np.random.set_bit_generator() swaps it),
        # compared by identity and whole state: draws from a swapped-in one show too
        current = state._bit_generator
        return id(current), current is bit, _comparable(current.state)

    if isinstance(bit, np.random.MT19937) and _numpy_layout_ok():
        address = bit.ctypes.state_address
        string_at = ctypes.string_at

        def fast() -> Any:
            if state._bit_generator is bit:
                return string_at(address, _NP_MT_BYTES)
            return whole()

        return fast
    return whole


def _comparable(value: Any) -> Any:
    """A bit generator's state (dicts, arrays, ints) in a form ``==`` compares whole."""
    if isinstance(value, dict):
        return tuple((k, _comparable(v)) for k, v in value.items())
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.tobytes()
    return value


# -- saving and putting back the global generators' states, fast ------------------------


def _python_state_io() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Get and put Python's global ``random`` state: the ``RandomObject`` words and index
    copied as bytes (about 0.3 µs each way) where the layout checks out, else
    ``getstate``/``setstate`` (about 5 µs)."""
    gen = PY_RANDOM
    if not _python_layout_ok():
        return gen.getstate, gen.setstate
    address = id(gen) + object.__basicsize__
    string_at, memmove = ctypes.string_at, ctypes.memmove

    def get() -> Any:
        return string_at(address, _PY_MT_BYTES), gen.gauss_next  # type: ignore[attr-defined]

    def put(saved: Any) -> None:
        memmove(address, saved[0], _PY_MT_BYTES)
        gen.gauss_next = saved[1]  # type: ignore[attr-defined]

    return get, put


def _numpy_state_io() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Get and put NumPy's global RNG state: the MT19937 words and position and the cached
    Gaussian copied as bytes (about 0.4 µs each way) while the global ``RandomState`` runs
    on its own MT19937 of the known layout, else ``get_state``/``set_state`` (about 25 µs)."""
    state = numpy_global_randomstate()
    bit = state._bit_generator
    offset = _NP_GAUSS_OFFSET
    if not (
        isinstance(bit, np.random.MT19937)
        and _numpy_layout_ok()
        and offset is not None
        and type(state) is np.random.RandomState
    ):
        return lambda: np.random.get_state(legacy=False), np.random.set_state
    words, gauss = bit.ctypes.state_address, id(state) + offset
    string_at, memmove = ctypes.string_at, ctypes.memmove

    def get() -> Any:
        if state._bit_generator is not bit or numpy_global_randomstate() is not state:
            return None, np.random.get_state(legacy=False)  # another bit generator swapped in
        return string_at(words, _NP_MT_BYTES), string_at(gauss, 16)

    def put(saved: Any) -> None:
        if saved[0] is None:
            np.random.set_state(saved[1])
            return
        if state._bit_generator is not bit:
            np.random.set_bit_generator(bit)  # type: ignore[attr-defined]
        memmove(words, saved[0], _NP_MT_BYTES)
        memmove(gauss, saved[1], 16)

    return get, put


# torch's CPU generator (``CPUGeneratorImpl``) from its engine on: ``at::mt19937``'s
# ``mt19937_data_pod`` (``uint64 seed_; int left_; bool seeded_; uint32 next_;
# uint32 state_[624]``), then the cached normals ``optional<float>`` and
# ``optional<double>`` (value, then the engaged flag). Offsets from the engine's start:
_T_BYTES = 2544  # the span copied: the engine and both cached normals
_T_WORDS = 20  # state_
_T_FLOAT, _T_DOUBLE = 2520, 2528  # the cached normals' values (each flag follows it)
_T_SCAN = 2688  # bytes of the generator object searched for the engine
#: The legacy layout of ``get_state()``: ``uint64 seed; int left; int seeded; uint64 next;
#: uint64 state[624]; double normal_x, normal_y, normal_rho; int normal_is_valid; ...``.
_T_LEGACY_BYTES, _T_LEGACY_NORMAL_Y, _T_LEGACY_NORMAL_VALID = 5056, 5024, 5040
#: ... then ``float next_float_normal_sample; bool is_next_float_normal_sample_valid``.
_T_LEGACY_FLOAT = 5048


def _torch_engine(gen: torch.Generator) -> int | None:
    """The address of CPU generator ``gen``'s engine, where its memory holds what its
    ``get_state()`` says (words, seed, position); None where it does not."""
    impl = ctypes.c_void_p.from_address(id(gen) + object.__basicsize__).value  # at::Generator's impl
    state = gen.get_state().numpy().tobytes()
    if not impl or gen.device.type != "cpu" or len(state) != _T_LEGACY_BYTES:
        return None
    seed, left, seeded, position = struct.unpack_from("=QiiQ", state)
    words = np.frombuffer(state, dtype=np.uint64, count=624, offset=24).astype(np.uint32).tobytes()
    raw = ctypes.string_at(impl, _T_SCAN)
    engine = raw.find(words) - _T_WORDS
    if engine < 0 or engine % 8 or engine + _T_BYTES > _T_SCAN:
        return None
    if struct.unpack_from("=QiB", raw, engine) != (seed, left, seeded):
        return None
    if struct.unpack_from("=I", raw, engine + 16)[0] != position:
        return None
    return impl + engine


def _torch_layout_ok() -> bool:
    """True when a private probe generator's engine, found by :func:`_torch_engine`,
    behaves as the layout says: bytes copied out and back give exactly the states
    ``get_state()`` gave (cached normal included), a draw that caches a normal sets the
    flag where it is expected, and so does a float normal put in by ``set_state``."""
    probe = torch.Generator()
    probe.manual_seed(20240601)
    torch.rand(7, generator=probe)
    address = _torch_engine(probe)
    if address is None:
        return False
    plain = probe.get_state().clone(), ctypes.string_at(address, _T_BYTES)
    torch.randn((), generator=probe)  # two normals made, one cached
    cached = probe.get_state().clone(), ctypes.string_at(address, _T_BYTES)
    legacy = cached[0].numpy().tobytes()
    if struct.unpack_from("=i", legacy, _T_LEGACY_NORMAL_VALID)[0] != 1 or cached[1][_T_DOUBLE + 8] != 1:
        return False
    if cached[1][_T_DOUBLE : _T_DOUBLE + 8] != legacy[_T_LEGACY_NORMAL_Y : _T_LEGACY_NORMAL_Y + 8]:
        return False
    for whole, raw in (plain, cached):
        ctypes.memmove(address, raw, _T_BYTES)
        if not torch.equal(probe.get_state(), whole):
            return False
    torch.randn((), generator=probe)  # the cached one taken
    if ctypes.string_at(address, _T_BYTES)[_T_DOUBLE + 8] != 0 or _torch_engine(probe) != address:
        return False
    # the float cache (no CPU op here fills it; set_state does): where expected too
    with_float = bytearray(probe.get_state().numpy().tobytes())
    struct.pack_into("=fB", with_float, _T_LEGACY_FLOAT, 1.25, 1)
    probe.set_state(torch.frombuffer(with_float, dtype=torch.uint8).clone())
    raw = ctypes.string_at(address, _T_BYTES)
    return struct.unpack_from("=fB", raw, _T_FLOAT) == (1.25, 1)


#: The engine of ``torch.default_generator`` where the layout checks out (None: not yet
#: looked, or ``get_state``/``set_state`` are used), per process.
_TORCH_ENGINE: list[int | None] = []


def _torch_default_engine() -> int | None:
    if not _TORCH_ENGINE:
        _TORCH_ENGINE.append(_torch_engine(torch.default_generator) if _torch_layout_ok() else None)
    return _TORCH_ENGINE[0]


def torch_rng_fingerprint() -> Callable[[], Any]:
    """A cheap function of ``torch.default_generator``'s whole state: two results are
    equal exactly when the states are (seed, words, position and the cached normals; not
    the padding or a stale value behind an empty cache, which ``set_state`` may leave
    differently). Read in the generator's memory (about 0.3 µs) where the layout checks
    out (:func:`_torch_layout_ok`), else from ``get_state()`` (about 1.3 µs). Example::

        look = torch_rng_fingerprint()
        before = look(); torch.rand(1); look() != before   # True
    """
    address = _torch_default_engine()
    if address is None:
        return lambda: bytes(torch.default_generator.get_state().numpy())
    string_at = ctypes.string_at

    def fast() -> Any:
        raw = string_at(address, _T_BYTES)
        return (
            raw[:13],  # seed_, left_, seeded_
            raw[16 : _T_WORDS + 2496],  # next_, state_
            raw[_T_FLOAT + 4] and raw[_T_FLOAT : _T_FLOAT + 4],
            raw[_T_DOUBLE + 8] and raw[_T_DOUBLE : _T_DOUBLE + 8],
        )

    return fast


def _torch_state_io() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Get and put ``torch.default_generator``'s state: its engine and cached normals
    copied as bytes (about 0.3 µs each way) where the layout checks out, else
    ``get_rng_state``/``set_rng_state`` (about 1.5 µs). The copy takes no lock: as
    with the setters, a draw from another thread while a state is put back is lost."""
    address = _torch_default_engine()
    if address is None:
        return torch.get_rng_state, torch.set_rng_state
    string_at, memmove = ctypes.string_at, ctypes.memmove

    def get() -> bytes:
        return string_at(address, _T_BYTES)

    def put(saved: bytes) -> None:
        memmove(address, saved, _T_BYTES)

    return get, put


def global_rng_state_io(names: tuple[str, ...]) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """A function taking the whole states of the global generators in ``names`` (of
    ``"numpy"``, ``"random"``, ``"torch"``) and one putting such states back, in this
    process: about 2 µs for all three, where ``getstate``/``get_state``/``get_rng_state``
    and their setters take about 60 µs. The states are process-local values (bytes of the
    generators' memory), not for saving. Example::

        get, put = global_rng_state_io(("numpy", "random", "torch"))
        saved = get(); np.random.rand(); put(saved)      # as if nothing had been drawn
    """
    io = {
        "numpy": _numpy_state_io,
        "random": _python_state_io,
        "torch": _torch_state_io,
    }
    pairs = [io[name]() for name in names]
    gets, puts = [g for g, _ in pairs], [p for _, p in pairs]

    def get() -> list[Any]:
        return [g() for g in gets]

    def put(saved: list[Any]) -> None:
        for p, value in zip(puts, saved):
            p(value)

    return get, put
