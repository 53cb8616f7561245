"""WorkerConfig: where a piece of data is loaded (rank, worker) and from which seed.

A ``WorkerConfig`` describes one data-parallel rank's loader: the rank, the world size,
the number of worker processes and the base seed. Savable pipelines ask it which worker
they run in (``rank_worker_id()``) and for per-worker seeds.

Example::

    wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
    wc.global_worker_id()   # 0 in the main process, rank * num_workers + id in a worker
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from savable_loader.core.frameworks import check_not_rebuilt
from savable_loader.errors import LoaderUsageError
from savable_loader.rng.formulas import worker_epoch_seed, worker_seed
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES, global_seeder

__all__ = ["WorkerConfig"]

# The logical worker (and epoch) the current thread is loading for. Set by the loader's
# worker runtime around the iteration of a pipeline; thread-local so that a command
# thread or the training thread never sees a worker's context by accident.
_active = threading.local()


def _dist_defaults() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class WorkerConfig:
    """Rank, world size, number of workers and seed of one data-parallel rank's loader.

    ``rank`` and ``world_size`` default to torch.distributed's when it is initialised and
    to ``0`` / ``1`` otherwise. ``data_parallel_group`` is the process group that spans
    the data-parallel ranks (``None``: the default group).

    Example::

        wc = WorkerConfig(rank=1, world_size=4, num_workers=2, seed=0)
        wc.worker_seed()   # differs per (seed, rank, worker)
    """

    # None (the default) is replaced in __post_init__: after construction both are ints.
    rank: int = None  # type: ignore[assignment]
    world_size: int = None  # type: ignore[assignment]
    num_workers: int = 0
    seed: int = 0
    data_parallel_group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.rank is None or self.world_size is None:  # type: ignore[redundant-expr, unused-ignore]
            d_rank, d_world = _dist_defaults()
            if self.data_parallel_group is not None:
                import torch.distributed as dist

                d_rank = dist.get_rank(group=self.data_parallel_group)
                d_world = dist.get_world_size(group=self.data_parallel_group)
            if self.rank is None:
                self.rank = d_rank
            if self.world_size is None:
                self.world_size = d_world
        for name in ("rank", "world_size", "num_workers", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LoaderUsageError(f"WorkerConfig.{name} must be an int, got {value!r}")
        if self.world_size < 1:
            raise LoaderUsageError(f"WorkerConfig.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise LoaderUsageError(f"WorkerConfig.rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.num_workers < 0:
            raise LoaderUsageError(f"WorkerConfig.num_workers must be >= 0, got {self.num_workers}")

    def __getstate__(self) -> dict[str, Any]:
        # Process groups do not cross process boundaries; workers never need them.
        state = dict(self.__dict__)
        state["data_parallel_group"] = None
        return state

    @property
    def workers_per_rank(self) -> int:
        """Number of logical workers per rank: ``num_workers``, or 1 in-process.

        While a loading context hosts a logical worker of a state saved under another
        ``num_workers`` (see ``savable_loader/pipeline/hosting.py``), the number of logical
        workers of that state."""
        view = getattr(_active, "workers", None)
        return max(self.num_workers, 1) if view is None else int(view)

    def rank_worker_id(self) -> int:
        """Logical id of the worker the calling code runs in (0 in the main process).

        Raises :class:`LoaderUsageError` in a worker process of a torch ``DataLoader``
        that no SavableDataLoader runs (one rebuilt from a SavableDataLoader's
        attributes, e.g. by ``accelerator.prepare``): each of its workers would read the
        same data (see ``savable_loader/core/frameworks.py``)."""
        worker_id = getattr(_active, "worker_id", None)
        if worker_id is None:
            check_not_rebuilt(self)
            return 0
        return int(worker_id)

    def global_worker_id(self) -> int:
        """``rank * workers_per_rank + rank_worker_id()``: unique across all ranks."""
        return self.rank * self.workers_per_rank + self.rank_worker_id()

    def active_epoch(self) -> int:
        """The loader epoch the calling worker is loading (0 outside a loader)."""
        return getattr(_active, "epoch", 0)

    def worker_seed(self) -> int:
        """A 64-bit seed derived from ``(seed, rank, rank_worker_id())``."""
        return worker_seed(self.seed, self.rank, self.rank_worker_id())

    def epoch_seed(self) -> int:
        """A 64-bit seed derived from ``(seed, rank, rank_worker_id(), active_epoch())``.

        Sources that reshuffle every epoch seed from this in ``reset_state_own``. Inside
        a ``RepeatDataset`` the repetition counts too, so every pass is shuffled anew.
        """
        return worker_epoch_seed(self.seed, self.rank, self.rank_worker_id(), self.active_epoch(), active_repetitions())

    def fingerprint(self) -> dict[str, int]:
        """The fields a state records to detect a changed configuration."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "seed": self.seed,
        }


def active_repetitions() -> tuple[int, ...]:
    """The ``RepeatDataset`` pass numbers the calling code runs in (outermost first)."""
    return getattr(_active, "repetitions", ())


def active_repetition_limits() -> tuple[int | None, ...]:
    """The ``repeats`` of the ``RepeatDataset`` passes the calling code runs in (outermost
    first; None: endless, or not known): what a source predicting its next pass needs."""
    limits = getattr(_active, "repetition_limits", ())
    return limits if len(limits) == len(active_repetitions()) else (None,) * len(active_repetitions())


#: What :func:`take_snapshot_request` returns: no request, a request (taken when cheap),
#: a forced request (always taken).
NO_SNAPSHOT, SNAPSHOT_HINT, SNAPSHOT_FORCED = 0, 1, 2


def request_snapshot(force: bool = False) -> None:
    """Ask the calling thread's loading context for a snapshot right after the sample
    about to be yielded (see :meth:`SavableDataset.request_snapshot`)."""
    wanted = SNAPSHOT_FORCED if force else SNAPSHOT_HINT
    _active.snapshot_requested = max(wanted, getattr(_active, "snapshot_requested", NO_SNAPSHOT))


def take_snapshot_request() -> int:
    """The snapshot request since the last call (``NO_SNAPSHOT``, ``SNAPSHOT_HINT`` or
    ``SNAPSHOT_FORCED``), and clear it."""
    wanted: int = getattr(_active, "snapshot_requested", NO_SNAPSHOT)
    if wanted:
        _active.snapshot_requested = NO_SNAPSHOT
    return wanted


class _Repetition:
    """Context manager: datasets reset inside it draw seeds for repetition ``n`` (of
    ``limit`` passes, None: endless or not known)."""

    def __init__(self, n: int, limit: int | None = None) -> None:
        self.n = n
        self.limit = limit

    def __enter__(self) -> None:
        _active.repetitions = (*getattr(_active, "repetitions", ()), self.n)
        _active.repetition_limits = (*getattr(_active, "repetition_limits", ()), self.limit)

    def __exit__(self, *exc: object) -> None:
        _active.repetitions = _active.repetitions[:-1]
        _active.repetition_limits = _active.repetition_limits[:-1]


class _LogicalWorkers:
    """Context manager: the current thread loads for one of ``workers`` logical workers
    (``WorkerConfig.workers_per_rank`` says so), whatever the loader's ``num_workers``."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._saved: Any = None

    def __enter__(self) -> None:
        self._saved = getattr(_active, "workers", None)
        _active.workers = self.workers

    def __exit__(self, *exc: object) -> None:
        _active.workers = self._saved


class _ActiveWorker:
    """Context manager: the current thread loads for logical ``worker_id`` in ``epoch``,
    re-seeding the global generators ``global_rngs`` per sample (the loader's
    ``global_rngs=``; None: the enclosing context's, or all three; :func:`active_seeder`)."""

    def __init__(self, worker_id: int, epoch: int, global_rngs: tuple[str, ...] | None = None) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.global_rngs = global_rngs
        self._saved: tuple[Any, ...] = ()
        #: the seeder of ``global_rngs``: looked up once, not at every entry (the runtime
        #: enters one per item)
        self._seeder = None if global_rngs is None else (_seeder_for(global_rngs),)

    def __enter__(self) -> _ActiveWorker:  # noqa: PYI034 - typing.Self needs Python 3.11
        d = _active.__dict__
        self._saved = (d.get("worker_id"), d.get("epoch"), d.get("global_rngs"), d.get("seeder"))
        _active.worker_id = self.worker_id
        _active.epoch = self.epoch
        if self.global_rngs is not None:
            _active.global_rngs = self.global_rngs
            _active.seeder = self._seeder
        return self

    def __exit__(self, *exc: object) -> None:
        worker_id, epoch, names, seeder = self._saved
        if worker_id is None:
            del _active.worker_id
            del _active.epoch
        else:
            _active.worker_id = worker_id
            _active.epoch = epoch
        for name, value in (("global_rngs", names), ("seeder", seeder)):
            if value is None:
                _active.__dict__.pop(name, None)
            else:
                setattr(_active, name, value)


def active_global_rngs() -> tuple[str, ...]:
    """The global generators the current thread re-seeds per sample (the loader's
    ``global_rngs=``, set by its loading contexts); all three outside a loader."""
    names: tuple[str, ...] = getattr(_active, "global_rngs", GLOBAL_RNG_NAMES)
    return names


#: ``global_seeder(names)`` by ``names`` (None: no names): per sample.
_SEEDERS: dict[tuple[str, ...], Callable[[int], None] | None] = {}


def active_seeder() -> Callable[[int], None] | None:
    """The function re-seeding, from one seed, the global generators the current thread
    re-seeds per sample (:func:`active_global_rngs`); None when the loader's
    ``global_rngs=()`` re-seeds none.

    Example::

        seed = active_seeder()
        if seed is not None:
            seed(key_seed)      # rng.seed_global(key_seed) outside a loader
    """
    held = _active.__dict__.get("seeder")  # (the seeder,), set by the loading context
    if held is not None:
        return held[0]
    return _seeder_for(GLOBAL_RNG_NAMES)


def _seeder_for(names: tuple[str, ...]) -> Callable[[int], None] | None:
    try:
        return _SEEDERS[names]
    except KeyError:
        seeder = global_seeder(names) if names else None
        _SEEDERS[names] = seeder
        return seeder
