"""The checks torch's ``DataLoader.__init__`` makes, with torch's messages, and ours.

``SavableDataLoader`` takes exactly torch's arguments (plus its own keyword-only ones).
Every combination torch refuses is refused here before anything is built, with torch's
message and a short note, as :class:`~savable_loader.errors.LoaderUsageError` (a
``ValueError``, as torch raises). Checks torch makes later, in the objects it builds
(``BatchSampler``'s ``batch_size`` and ``drop_last``, ``RandomSampler``'s
``num_samples``, the ``multiprocessing_context`` setter), run in torch's own code and
are translated by the loader (a wrong ``multiprocessing_context`` type stays torch's
``TypeError``).

The supported torch releases (2.4 to the newest) differ in what their ``DataLoader``
takes: :func:`torch_keyword_arguments` gives torch only what the installed one has, and
refuses, naming the argument and the torch version, what it cannot honour.

Example::

    check_torch_arguments(dataset, batch_size=None, shuffle=None, sampler=None,
                          batch_sampler=None, num_workers=0, drop_last=True, timeout=0,
                          prefetch_factor=None, persistent_workers=False)
    # LoaderUsageError: batch_size=None option disables auto-batching and is mutually
    # exclusive with drop_last (torch's DataLoader refuses this too)
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.datapipes.datapipe import IterDataPipe

from savable_loader.config import WorkerConfig
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.rng.global_rngs import global_rngs_setting
from savable_loader.stats.log import log_path

__all__ = [
    "check_our_arguments",
    "check_torch_arguments",
    "refused",
    "resolve_seed",
    "resolve_worker_config",
    "torch_keyword_arguments",
]

_NOTE = " (torch's DataLoader refuses this too)"


def refused(message: str) -> LoaderUsageError:
    """torch's ``message`` as our error, with the note that torch refuses it too."""
    return LoaderUsageError(message + _NOTE)


#: ``DataLoader`` arguments a supported torch may lack: the value that asks for what such
#: a torch does anyway, and the release that added the argument.
_LATER_ARGUMENTS: dict[str, tuple[Any, str]] = {"in_order": (True, "2.6")}


@functools.cache
def _torch_parameters() -> frozenset[str]:
    """The arguments the installed torch's ``DataLoader`` takes (its public signature)."""
    return frozenset(inspect.signature(DataLoader.__init__).parameters)


@functools.cache
def _device_must_be_a_name() -> bool:
    """Whether the installed torch uses ``pin_memory_device`` as a device name (``len()``
    of it: torch before the argument's deprecation), so that only a ``str`` works; found by
    asking torch for an iterator with ``pin_memory_device=None``."""
    try:
        iter(DataLoader([0], pin_memory_device=None))  # type: ignore[arg-type]
    except TypeError:
        return True
    return False


def torch_keyword_arguments(**arguments: Any) -> dict[str, Any]:
    """``arguments`` (keyword arguments for torch's ``DataLoader``) as the installed torch
    takes them: an argument it lacks is left out where its value asks for what this torch
    does anyway (``in_order=True``), else refused; a ``pin_memory_device`` that is no
    device name is refused where torch would fail on it at ``iter()``.

    Example (torch 2.4)::

        torch_keyword_arguments(in_order=True, pin_memory_device="")   # {"pin_memory_device": ""}
        torch_keyword_arguments(in_order=False)
        # LoaderUsageError: in_order=False: torch 2.4.1's DataLoader has no in_order argument ...
    """
    taken = dict(arguments)
    for name, (plain, added) in _LATER_ARGUMENTS.items():
        if name not in taken or name in _torch_parameters():
            continue
        value = taken.pop(name)
        if value != plain:
            raise LoaderUsageError(
                f"{name}={value!r}: torch {torch.__version__}'s DataLoader has no {name} argument (torch {added} "
                f"added it); pass {name}={plain!r} (what this torch does) or install torch>={added}"
            )
    device = taken.get("pin_memory_device", "")
    if not isinstance(device, str) and _device_must_be_a_name():
        raise LoaderUsageError(
            f"pin_memory_device={device!r}: torch {torch.__version__}'s DataLoader takes a device name (a str, "
            f"'' for CUDA), not a {type(device).__name__}"
        )
    return taken


def check_torch_arguments(
    dataset: Any,
    *,
    batch_size: int | None,
    shuffle: Any,
    sampler: Any,
    batch_sampler: Any,
    num_workers: int,
    drop_last: Any,
    timeout: float,
    prefetch_factor: int | None,
    persistent_workers: bool,
) -> None:
    """torch's argument checks, in torch's order (``num_workers`` is the effective count)."""
    if num_workers < 0:
        raise refused("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    if timeout < 0:
        raise refused("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise refused(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if prefetch_factor is not None and prefetch_factor < 0:
        raise refused("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise refused("persistent_workers option needs num_workers > 0")
    if isinstance(dataset, IterableDataset):
        if shuffle not in {False, None} and not isinstance(dataset, IterDataPipe):  # torch shuffles datapipes
            raise refused(
                f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise refused(
                f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
            )
        if batch_sampler is not None:
            raise refused(
                "DataLoader with IterableDataset: expected unspecified "
                f"batch_sampler option, but got batch_sampler={batch_sampler}"
            )
    else:
        shuffle = bool(shuffle)
    if sampler is not None and shuffle:
        raise refused("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise refused("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    elif batch_size is None and drop_last:
        raise refused("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    if shuffle and sampler is None and batch_sampler is None and not isinstance(dataset, IterableDataset):
        # torch builds RandomSampler(dataset) here, which refuses an empty dataset
        try:
            size = len(dataset)
        except TypeError:
            size = None
        if size == 0:
            raise refused(f"num_samples should be a positive integer value, but got num_samples={size}")


def check_our_arguments(
    *,
    num_workers: int,
    in_order: bool,
    prefetch_factor: int | None,
    save_timeout: float | None,
    snapshot_every_n_steps: Any,
    reseed: Any = "sample",
    global_rngs: Any = None,
    record_stats: Any = True,
    stats_log: Any = None,
    stats_log_every: Any = 10.0,
    pipeline: bool = False,
    stacklevel: int = 3,
) -> None:
    """What torch accepts but a resumable loader cannot honour, and our own arguments."""
    if not isinstance(record_stats, bool):
        raise LoaderUsageError(f"record_stats must be True or False, got {record_stats!r}")
    if stats_log is not None:
        if not record_stats:
            raise LoaderUsageError(f"stats_log={stats_log!r} needs record_stats=True, got record_stats=False")
        log_path(stats_log, 0)  # LoaderUsageError for what is not a path
    if (
        isinstance(stats_log_every, bool)
        or not isinstance(stats_log_every, (int, float))
        or not 0 < stats_log_every < float("inf")
    ):
        raise LoaderUsageError(f"stats_log_every must be a number of seconds > 0, got {stats_log_every!r}")
    if reseed not in ("sample", "batch"):
        raise LoaderUsageError(f"reseed must be 'sample' or 'batch', got {reseed!r}")
    if reseed != "sample" and pipeline:
        raise LoaderUsageError(
            f"reseed={reseed!r} is for map-style datasets: a savable pipeline re-seeds once per item it yields"
        )
    if global_rngs is not None:
        global_rngs_setting(global_rngs)  # LoaderUsageError for a malformed setting
    if not in_order and num_workers > 0:
        raise LoaderUsageError(
            "in_order=False delivers batches in the order the workers finish them, which a state cannot "
            "record: SavableDataLoader needs in_order=True with num_workers > 0"
        )
    if prefetch_factor == 0 and num_workers > 0:
        raise LoaderUsageError("prefetch_factor must be > 0 with num_workers > 0 (torch's iterator asserts it), got 0")
    if save_timeout is not None:
        if not save_timeout > 0:
            raise LoaderUsageError(f"save_timeout must be > 0, got {save_timeout}")
        warnings.warn(
            "save_timeout has no effect and is deprecated: a save never waits on a worker (pipeline workers "
            "attach their snapshots to the items they send); drop the argument",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    if snapshot_every_n_steps is not None and (
        not isinstance(snapshot_every_n_steps, int)
        or isinstance(snapshot_every_n_steps, bool)
        or snapshot_every_n_steps < 1
    ):
        raise LoaderUsageError(
            f"snapshot_every_n_steps must be a positive int or None, got {snapshot_every_n_steps!r} (it is accepted "
            "for torchdata's StatefulDataLoader programs; every step can be saved here at no cost)"
        )


def resolve_worker_config(
    dataset: Any, worker_config: WorkerConfig | None, num_workers: int, seed: int | None
) -> WorkerConfig | None:
    """The loader's WorkerConfig: the one given (or a savable pipeline's own), checked
    against ``num_workers`` and ``seed``; None when the loader makes one itself."""
    if worker_config is None and isinstance(dataset, SavableDataset):
        worker_config = dataset.worker_config
    if worker_config is None:
        return None
    if not isinstance(worker_config, WorkerConfig):
        raise LoaderUsageError(f"worker_config must be a WorkerConfig, got {type(worker_config).__qualname__}")
    if num_workers not in (0, worker_config.num_workers):
        raise LoaderUsageError(
            f"num_workers={num_workers} differs from worker_config.num_workers={worker_config.num_workers} "
            "(pass one of them, or the same value)"
        )
    if seed is not None and seed != worker_config.seed:
        raise LoaderUsageError(f"seed={seed} differs from worker_config.seed={worker_config.seed}")
    return worker_config


def resolve_seed(seed: int | None, generator: torch.Generator | None, world_size: int) -> tuple[int, bool]:
    """The loader's seed and whether it was given explicitly.

    ``seed=None``: with ``generator=``, the generator's initial seed (without drawing
    from it); on more than one rank, 0 (``DistributedSampler``'s default: every rank must
    draw the same order); otherwise a draw from torch's global RNG, as torch's
    ``RandomSampler`` draws its seed, so that ``torch.manual_seed`` controls the shuffle.
    A restore into a loader built with ``seed=None`` adopts the state's seed.
    """
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise LoaderUsageError(f"seed must be an int or None, got {seed!r}")
        return seed, True
    if generator is not None:
        return int(generator.initial_seed()) & ((1 << 63) - 1), False
    if world_size > 1:
        return 0, False
    return int(torch.empty((), dtype=torch.int64).random_().item()), False
