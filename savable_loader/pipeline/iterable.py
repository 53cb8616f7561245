"""The path of a plain ``torch.utils.data.IterableDataset``: a savable pipeline over
:class:`~savable_loader.sources.TorchIterableSource`, with torch's iterable semantics.

``SavableDataLoader(iterable_dataset, batch_size=32, num_workers=4)`` chooses
:class:`IterableMode`. It runs the savable-pipeline protocol (``pipeline/engine.py``,
``pipeline/worker.py``) over a ``TorchIterableSource`` of the user's dataset, and adds what torch
does for an IterableDataset and a pipeline does not:

* in a worker, ``get_worker_info().id`` and the id ``worker_init_fn`` receives are the
  *logical* worker (after a restore physical worker ``p`` plays ``(p + rotation) %
  num_workers``), ``get_worker_info().dataset`` is the worker's copy of the user's
  dataset (:class:`IterableWorkerDataset`);
* an exception the dataset or ``collate_fn`` raises for one batch counts as that batch:
  the loader raises it, and the next ``next()`` goes on with the next batch (of the
  other workers, and of the failed worker if its iterator can go on), as torch does.
  A save after it records the position after that batch. An exception from the
  dataset's ``__iter__`` itself, or a replay that finds other data, ends the iteration;
* torch's warning when an epoch yields more batches than ``len(dataset)`` reported by
  the last ``len(loader)``;
* one :class:`~savable_loader.sources.ReplayWarning` at restore when a dataset without
  ``state_dict()`` will be replayed, with the count per worker;
* persistent workers that played rotated roles in a restored epoch are restarted after
  it: their dataset copies were sharded for those roles (in ``worker_init_fn`` or in
  ``__iter__``), and later epochs give every worker its own role again;
* a loader built with ``seed=None`` takes a restored state's seed;
* a position in the middle of an epoch resumes only with the saved ``num_workers``: the
  dataset splits itself by ``get_worker_info()`` and ``worker_init_fn``, which torch
  gives each worker process once, so the saved workers cannot be hosted by other ones
  as a savable pipeline's are (``pipeline/hosting.py``; ``PipelineMode.fixed_workers``).

Example (what the loader builds)::

    mode = IterableMode(dataset, wc, prefetch_factor=2, collate_fn=default_collate,
                        batch_size=32, drop_last=False, seed_explicit=True,
                        reported_length=lambda: None)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import msgspec
from torch.utils.data import IterableDataset, get_worker_info

from savable_loader._torch.internals import replace_worker_info
from savable_loader.config import WorkerConfig
from savable_loader.core.engine import SKIP
from savable_loader.pipeline.engine import (
    PipelineIteration,
    PipelineMode,
    _TaggedCollate,
)
from savable_loader.pipeline.worker import End, Item, ItemError, PipelineWorkerDataset
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES
from savable_loader.sources.torch_iterable import (
    TorchIterableSource,
    torch_worker_seed,
    warn_replays,
)
from savable_loader.state.schema import LoaderConfig, PipelinePosition

__all__ = ["IterableIteration", "IterableMode", "IterableWorkerDataset"]


class IterableWorkerDataset(PipelineWorkerDataset):
    """The engine's dataset: a pipeline worker whose ``get_worker_info()`` shows the
    user's view (the logical id, the worker's copy of the user's dataset) and whose
    per-batch exceptions do not end the iteration."""

    def __init__(self, dataset: TorchIterableSource, max_in_flight: int) -> None:
        super().__init__(dataset, max_in_flight)
        self.errors_go_on = True

    @property
    def user_dataset(self) -> IterableDataset:  # type: ignore[override]
        """The worker's copy of the user's IterableDataset."""
        return self.dataset.dataset  # type: ignore[attr-defined]

    def worker_started(self, physical: int) -> int:
        """In a new worker process, before the user's ``worker_init_fn``: make
        ``get_worker_info()`` report the logical worker of the worker's first iteration;
        returns that id (what ``worker_init_fn`` gets)."""
        wc = self.worker_config
        logical = (physical + self.rotation) % wc.workers_per_rank
        replace_worker_info(id=logical, seed=torch_worker_seed(wc, logical, self.epoch))
        return logical


class _IterableCollate(_TaggedCollate):
    """The loader's ``collate_fn`` per batch; an exception it raises is sent in the
    batch's place (the batch counts as consumed, as the dataset's own exceptions do)."""

    def __call__(self, item: Item | End) -> Item | End:
        if isinstance(item, End) or isinstance(item.payload, ItemError):
            return item
        try:
            return super().__call__(item)
        except Exception as e:  # noqa: BLE001 - raised in the main process by IterableIteration
            return item._replace(payload=ItemError.capture(e, get_worker_info() is None, worker=item.worker))


class IterableIteration(PipelineIteration):
    """A pipeline iteration that raises a batch's exception and goes on, warns as torch
    does when the epoch is longer than reported, and restarts persistent workers after a
    restored epoch with rotated roles."""

    def __init__(self, mode: PipelineMode, *args: Any, **kwargs: Any) -> None:
        super().__init__(mode, *args, **kwargs)
        # len(dataset) as the last len(loader) reported it when this iteration began
        self.reported: int | None = mode.reported_length()  # type: ignore[attr-defined]
        # batches of this epoch so far (those before a restore included, as the
        # uninterrupted run counts them)
        self.yielded = sum(self.consumed)

    def on_item(self, item: Any) -> Any:
        previous = self.mode.last_item
        payload = super().on_item(item)
        if isinstance(payload, ItemError):
            self.mode.last_item = previous  # no batch was yielded
            payload.reraise()
        if payload is not SKIP:
            self.yielded += 1
            if self.reported is not None and self.yielded > self.reported:
                self._warn_longer()
        return payload

    def _warn_longer(self) -> None:
        """torch's warning (``_BaseDataLoaderIter.__next__``), with torch's text."""
        source: TorchIterableSource = self.mode.source  # type: ignore[attr-defined]
        text = (
            f"Length of IterableDataset {source.dataset} was reported to be {self.reported}"
            f"(when accessing len(dataloader)), but {self.yielded} samples have been fetched. "
        )
        if self.mode.worker_config.num_workers > 0:
            text += (
                "For multiprocessing data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
            )
        warnings.warn(text, stacklevel=5)  # the caller of next(iterator)

    def workers_reusable(self) -> bool:
        """Not after a restored epoch whose workers played rotated roles."""
        return not (self.resumed and self.rotation)


class IterableMode(PipelineMode):
    """The loader's mode for a plain IterableDataset (see the module docstring)."""

    path_name = "IterableDataset"
    fixed_world_size = "a torch IterableDataset's state is split per rank and worker: restore it on the same world size"
    worker_dataset_type = IterableWorkerDataset
    collate_type = _IterableCollate
    iteration_type = IterableIteration

    def __init__(
        self,
        dataset: IterableDataset,
        worker_config: WorkerConfig,
        prefetch_factor: int,
        collate_fn: Callable[[Any], Any],
        *,
        batch_size: int | None,
        drop_last: bool,
        seed_explicit: bool,
        reported_length: Callable[[], int | None],
        global_rngs: tuple[str, ...] = GLOBAL_RNG_NAMES,
        timing: bool = False,
    ) -> None:
        self.source = TorchIterableSource(dataset, worker_config, batch_size=batch_size, drop_last=drop_last)
        super().__init__(self.source, worker_config, prefetch_factor, collate_fn, global_rngs, timing)
        self.seed_explicit = seed_explicit
        #: ``len(dataset)`` reported by the loader's last ``len(loader)`` (torch's
        #: ``_IterableDataset_len_called``), None before.
        self.reported_length = reported_length

    def check(
        self, saved: LoaderConfig, position: PipelinePosition, num_workers: int, elastic: bool = False
    ) -> PipelinePosition:
        """The pipeline's checks (a drawn seed gives way to the state's); then the
        :class:`ReplayWarning` if workers will replay."""
        if not self.seed_explicit:
            saved = msgspec.structs.replace(saved, seed=self.worker_config.seed)
        position = super().check(saved, position, num_workers, elastic)
        warn_replays(self.source, position)
        return position

    def adopt(self, seed: int) -> None:
        # the loader's own WorkerConfig (seed=None: built by the loader), shared by the
        # source and the engine's dataset, which carry it to the workers
        self.worker_config.seed = seed
        super().adopt(seed)
