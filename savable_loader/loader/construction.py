"""What ``SavableDataLoader(...)`` decides once: the arguments checked, rank, workers and
seed resolved, the engine chosen for the dataset, the private torch DataLoader built.

The kind of dataset (and sampler) decides the engine here and nowhere else:

* a :class:`~savable_loader.SavableDataset`: ``PipelineMode`` (``batch_size=None``);
* a plain ``torch.utils.data.IterableDataset``: ``IterableMode``;
* a map-style dataset without ``sampler=`` / ``batch_sampler=`` (nor ``generator=``
  with ``shuffle=True``): the loader's own order, ``OrderMode``;
* a map-style dataset with them: the user's sampler made resumable, ``SamplerMode``.

Example (what the loader's constructor does)::

    wc, seed_explicit = resolve_configuration(dataset, None, 2, None, None, **rest)
    public, make_mode = choose_engine(loader, dataset, wc, seed_explicit=seed_explicit, ...)
    DataLoader.__init__(loader, dataset, **public, ...)   # torch's public attributes
    mode = make_mode()
    engine = make_engine(loader, mode, worker_init_fn, ...)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from savable_loader._torch.internals import ShutdownEventLoader
from savable_loader.config import WorkerConfig
from savable_loader.core.engine import Mode
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.index.engine import OrderMode
from savable_loader.index.sampler_engine import SamplerMode
from savable_loader.index.samplers import order_sampler
from savable_loader.loader.arguments import (
    check_our_arguments,
    check_torch_arguments,
    refused,
    resolve_seed,
    resolve_worker_config,
    torch_keyword_arguments,
)
from savable_loader.loader.feeder import WorkerInit
from savable_loader.pipeline.engine import PipelineMode
from savable_loader.pipeline.iterable import IterableMode
from savable_loader.stats.log import StatsLog, log_path
from savable_loader.stats.recorder import Recorder

__all__ = ["choose_engine", "make_engine", "resolve_configuration"]

#: The loader's own arguments, checked by ``check_our_arguments`` (the rest are torch's).
_OURS = (
    "in_order",
    "save_timeout",
    "snapshot_every_n_steps",
    "reseed",
    "global_rngs",
    "record_stats",
    "stats_log",
    "stats_log_every",
)


class _Engine(ShutdownEventLoader):
    """The private DataLoader that runs the workers (each iterator of workers with its
    shutdown Event: ``core.shutdown.worker_done_event``). torch's worker-count warning is the
    public loader's, given where torch gives it (construction and ``iter()``), not at an
    iteration's first ``next()``, where the engine's iterator is made."""

    def check_worker_number_rationality(self) -> None:
        return None


def resolve_configuration(
    dataset: Any,
    worker_config: WorkerConfig | None,
    num_workers: int,
    seed: int | None,
    generator: Any,
    **arguments: Any,
) -> tuple[WorkerConfig, bool]:
    """torch's checks and ours on the arguments (``arguments``: the rest of the
    constructor's, by name); the loader's worker configuration and whether its seed
    was given (else drawn: a restore adopts the state's)."""
    if num_workers < 0:  # before the WorkerConfig check, with torch's message
        raise refused("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    wc = resolve_worker_config(dataset, worker_config, num_workers, seed)
    workers = wc.num_workers if wc is not None else num_workers
    ours = {name: arguments.pop(name) for name in _OURS}
    check_torch_arguments(dataset, num_workers=workers, **arguments)
    check_our_arguments(
        num_workers=workers,
        prefetch_factor=arguments["prefetch_factor"],
        pipeline=isinstance(dataset, SavableDataset),
        stacklevel=4,
        **ours,  # a warning points at the caller of SavableDataLoader(...)
    )
    if wc is not None:
        return wc, True
    probe = WorkerConfig(num_workers=workers)  # rank and world size (torch.distributed)
    value, seed_explicit = resolve_seed(seed, generator, probe.world_size or 1)
    wc = WorkerConfig(
        rank=probe.rank,
        world_size=probe.world_size,
        num_workers=workers,
        seed=value,
        data_parallel_group=probe.data_parallel_group,
    )
    return wc, seed_explicit


def choose_engine(
    loader: Any,
    dataset: Any,
    wc: WorkerConfig,
    *,
    seed_explicit: bool,
    batch_size: int | None,
    shuffle: Any,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    generator: Any,
    prefetch_factor: int | None,
    reseed: str,
    global_rngs: tuple[str, ...],
    timing: bool = True,
) -> tuple[dict[str, Any], Callable[[], Mode[Any]]]:
    """The arguments torch's ``__init__`` gets for the public attributes of ``loader``,
    and the engine, built once those exist (it reads them: ``collate_fn``, samplers)."""
    prefetch = 2 if prefetch_factor is None else prefetch_factor
    if isinstance(dataset, SavableDataset):
        if batch_size is not None:
            raise LoaderUsageError(
                f"a savable pipeline batches inside the pipeline (BatchDataset): pass batch_size=None, got {batch_size!r}"
            )
        if dataset.worker_config != wc:
            raise LoaderUsageError(
                f"the pipeline's worker_config {dataset.worker_config} differs from the loader's {wc}"
            )
        return {"batch_size": None}, lambda: PipelineMode(
            dataset, wc, prefetch, loader.collate_fn, global_rngs=global_rngs, timing=timing
        )
    if isinstance(dataset, IterableDataset):  # a plain torch IterableDataset
        owner = weakref.ref(loader)

        def iterable() -> Mode[Any]:
            return IterableMode(
                loader.dataset,
                wc,
                prefetch,
                loader.collate_fn,
                batch_size=loader.batch_size,
                drop_last=loader.drop_last,
                seed_explicit=seed_explicit,
                reported_length=lambda: getattr(owner(), "_IterableDataset_len_called", None),
                global_rngs=global_rngs,
                timing=timing,
            )

        return {"batch_size": batch_size, "shuffle": shuffle}, iterable  # torch shuffles an IterDataPipe
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise LoaderUsageError(
            f"dataset must be map-style (__getitem__ and __len__) or a SavableDataset, got {type(dataset).__qualname__}"
        )
    common = {
        "seed": wc.seed,
        "seed_explicit": seed_explicit,
        "rank": wc.rank,
        "world_size": wc.world_size,
        "drop_last": drop_last,
        "shuffle": bool(shuffle),
        "reseed": reseed,
        "global_rngs": global_rngs,
        "timing": timing,
    }
    if sampler is None and batch_sampler is None and not (generator is not None and shuffle):
        # an instance of torch's sampler for these arguments (frameworks inspect it)
        face = order_sampler(loader, bool(shuffle), wc.world_size or 1)

        def own_order() -> Mode[Any]:
            return OrderMode(dataset, batch_size=batch_size, collate_fn=loader.collate_fn, **common)

        return {"batch_size": batch_size, "sampler": face}, own_order
    if sampler is None and batch_sampler is None:
        try:  # generator= with shuffle=True: torch's own sampler, as torch builds it
            sampler = RandomSampler(dataset, generator=generator)
        except ValueError as e:
            raise refused(str(e)) from None

    def user_sampler() -> Mode[Any]:
        batching = loader.batch_sampler is not None  # torch's auto-collation: batches from the batch sampler
        return SamplerMode(
            dataset,
            index_sampler=loader.batch_sampler if batching else loader.sampler,
            auto_collation=batching,
            generator=generator,
            persistent=bool(loader.persistent_workers and loader.num_workers > 0),
            batch_size=loader.batch_size,
            collate_fn=loader.collate_fn,
            samplers=_distinct(loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)),
            **common,
        )

    return {"batch_size": batch_size, "sampler": sampler, "batch_sampler": batch_sampler}, user_sampler


def _distinct(*candidates: Any) -> list[Any]:
    found: list[Any] = []
    for candidate in candidates:
        if candidate is not None and all(candidate is not f for f in found):
            found.append(candidate)
    return found


def make_recorder(loader: Any, record_stats: bool, stats_log: Any, stats_log_every: float) -> Recorder | None:
    """The loader's statistics (``loader.stats()``, the stats log); None without
    ``record_stats``."""
    if not record_stats:
        return None
    workers = loader.num_workers
    ahead = (2 if loader.prefetch_factor is None else loader.prefetch_factor) * workers  # (0: no queue)
    rank = loader.worker_config.rank or 0
    log = None if stats_log is None else StatsLog(log_path(stats_log, rank))
    return Recorder(rank, ahead, log, stats_log_every)


def make_engine(
    loader: Any,
    mode: Mode[Any],
    worker_init_fn: Any,
    pin_memory: bool,
    timeout: float,
    prefetch_factor: int | None,
    pin_memory_device: str,
) -> DataLoader[Any]:
    """The private torch DataLoader that runs the workers over the engine's dataset."""
    workers = loader.num_workers
    return _Engine(  # no worker-count warning: the public loader gives it
        num_workers=workers,
        pin_memory=pin_memory,
        timeout=timeout,
        # in workers: an unpicklable sample becomes an error, not a hang (loader/feeder.py),
        # and get_worker_info().dataset is the user's dataset
        worker_init_fn=WorkerInit(worker_init_fn) if workers > 0 else None,
        multiprocessing_context=loader.multiprocessing_context,
        generator=torch.Generator(),
        prefetch_factor=prefetch_factor,
        persistent_workers=loader.persistent_workers,
        **torch_keyword_arguments(pin_memory_device=pin_memory_device),
        **mode.engine_kwargs(),
    )
