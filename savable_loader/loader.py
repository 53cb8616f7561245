"""SavableDataLoader: torch's DataLoader whose position can be saved and restored exactly.

The loader takes torch's arguments and shows torch's attributes (``loader.dataset`` is
the user's dataset, ``loader.sampler`` / ``loader.batch_sampler`` are samplers). Loading
runs through a private ``torch.utils.data.DataLoader`` (the *engine*) over an internal
dataset and sampler of the chosen path (a :class:`~savable_loader._mode.Mode`):

* a map-style dataset without a sampler: the loader's own order from ``seed``
  (``_index_mode.OrderMode``); any ``num_workers`` and world size can resume it;
* a map-style dataset with ``sampler=``, ``batch_sampler=`` or ``generator=`` and
  ``shuffle=True``: the user's sampler, made resumable (``_sampler_mode.SamplerMode``);
* a :class:`~savable_loader.SavableDataset` pipeline with ``batch_size=None``: per-worker
  pipeline states captured from snapshots (``_pipeline_mode.PipelineMode``);
* a plain ``torch.utils.data.IterableDataset``: the same protocol over the user's
  dataset, with torch's iterable semantics (``_iterable_mode.IterableMode``).

Iterations, their fates and what a save describes: ``_iterator.py``.
"""

from __future__ import annotations

import io
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from savable_loader._arguments import (
    check_our_arguments,
    check_torch_arguments,
    refused,
    resolve_seed,
    resolve_worker_config,
    torch_keyword_arguments,
)
from savable_loader._failures import terminate_worker, translate_worker_error
from savable_loader._feeder import WorkerInit
from savable_loader._frameworks import check_nothing_held
from savable_loader._global_rngs import global_rngs_setting
from savable_loader._index_mode import OrderMode
from savable_loader._iterable_mode import IterableMode
from savable_loader._iterator import RUNNING, Fate, Record, SavableIterator
from savable_loader._mode import SKIP, Mode
from savable_loader._pipeline_mode import PipelineMode
from savable_loader._rank_zero import derive_state
from savable_loader._sampler_mode import SamplerMode
from savable_loader._seeds import engine_generator_seed
from savable_loader._sigchld import install, loader_call
from savable_loader._torch_internals import (
    ShutdownEventLoader,
    allow_bytes_in_weights_only_loads,
    loader_iterator,
    next_batch,
    set_loader_iterator,
    shutdown_workers,
)
from savable_loader._version import __version__
from savable_loader.config import WorkerConfig
from savable_loader.dataset import SavableDataset
from savable_loader.distributed import (
    DataParallelGroup,
    check_gathered,
    gather_states,
    is_resize,
    scatter_states,
    select_rank_state,
)
from savable_loader.errors import (
    ConfigMismatchError,
    LoaderUsageError,
    RestoreKeyError,
    SavableLoaderError,
    StateError,
    WorkerError,
    WorkerTimeoutError,
)
from savable_loader.rng import SEED_FORMULAS
from savable_loader.sources.samplers import PipelineSampler, order_sampler
from savable_loader.state.codec import decode, encode
from savable_loader.state.schema import PipelinePosition, RankState, RestoreKey

__all__ = ["SavableDataLoader"]

T_co = TypeVar("T_co", covariant=True)

# state_dict() holds bytes: torch.load(weights_only=True) takes them on torch 2.4 too
allow_bytes_in_weights_only_loads()


class _Engine(ShutdownEventLoader):
    """The private DataLoader that runs the workers (each iterator of workers with its
    shutdown Event: ``_feeder.worker_done_event``). torch's worker-count warning is the
    public loader's, given where torch gives it (construction and ``iter()``), not at an
    iteration's first ``next()``, where the engine's iterator is made."""

    def check_worker_number_rationality(self) -> None:
        return None


class SavableDataLoader(DataLoader[T_co]):
    """A ``torch.utils.data.DataLoader`` whose position can be saved and restored exactly.

    Takes torch's arguments, in torch's order and with torch's defaults, plus
    ``seed`` (default None: drawn from torch's global RNG, see below), ``worker_config``
    (a :class:`~savable_loader.WorkerConfig`: rank, world size, workers, seed),
    ``snapshot_every_n_steps`` (accepted for torchdata's ``StatefulDataLoader``
    programs and ignored: every step can be saved here at no cost), ``save_timeout``
    (deprecated and without effect: a save never waits on a worker; passing it warns)
    and ``reseed`` (map-style datasets:
    ``"sample"``, the default, re-seeds the global RNGs before every sample; ``"batch"``
    once per batch, for samples of a few microseconds: see docs/performance.md for what
    each keeps) and ``global_rngs`` (the global generators the dataset, pipeline or
    collate function draws from, of ``"random"``, ``"numpy"`` and ``"torch"``; None, the
    default, re-seeds all three before every sample; with, say, ``("torch",)`` only
    torch's is re-seeded, with ``()`` none, and a batch or item that draws from another
    raises ``UndeclaredRngError``: see docs/concepts.md). Example::

        loader = SavableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)
        for batch in loader:
            ...
            state = loader.save_state_rank()        # microseconds
        fresh = SavableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)
        fresh.restore_state_rank(state)              # continues with the next batch

    Savable pipelines (``SavableDataset``, batching inside the pipeline)::

        wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
        loader = SavableDataLoader(BatchDataset(MySource(worker_config=wc), 32), batch_size=None)

    A plain ``torch.utils.data.IterableDataset`` runs as in torch (each worker iterates
    its own copy; ``batch_size`` batches per worker) and resumes from its
    ``state_dict()`` when it has one, by a counted replay otherwise (see
    ``sources/torch_iterable.py``)::

        loader = SavableDataLoader(my_iterable_dataset, batch_size=32, num_workers=4)

    **Order.** Without a sampler the loader draws each epoch's order from ``(seed,
    epoch)`` and splits it across data-parallel ranks. ``seed=None`` takes a seed from
    torch's global RNG at construction (so ``torch.manual_seed`` controls the shuffle),
    from ``generator.initial_seed()`` with ``generator=``, or 0 on several ranks (as
    ``DistributedSampler``); restoring a state adopts its seed. ``sampler=``,
    ``batch_sampler=`` and ``generator=`` with ``shuffle=True`` (torch's
    ``RandomSampler(generator=g)``) run as in torch and resume exactly when their order
    is decided by generators, ``epoch`` or ``state_dict()`` they hold (see
    ``savable_loader.sources.samplers``). ``loader.set_epoch(e)`` or
    ``loader.sampler.set_epoch(e)`` choose the next epoch.

    **Iterations and states** (see ``_iterator.py``): each ``iter()`` starts the next
    epoch, except the first after a restore, which continues the saved position. A save
    describes the most recent iteration: where it is, where it was abandoned (``break``,
    a dropped iterator, an exception in the loop body), or the next epoch's start after
    it ended. ``len(loader)`` is the number of batches of a whole epoch, as in torch,
    also after a restore; :meth:`remaining` counts what is left.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        worker_config: WorkerConfig | None = None,
        snapshot_every_n_steps: int | None = None,
        save_timeout: float | None = None,
        reseed: str = "sample",
        global_rngs: Collection[str] | None = None,
    ) -> None:
        # the steps: check the arguments and resolve rank, workers and seed; choose the
        # path; torch's constructor (the public attributes); the mode and the engine
        wc, seed_explicit = self._resolve_configuration(
            dataset,
            worker_config,
            num_workers,
            seed,
            generator,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            timeout=timeout,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            in_order=in_order,
            save_timeout=save_timeout,
            snapshot_every_n_steps=snapshot_every_n_steps,
            reseed=reseed,
            global_rngs=global_rngs,
        )
        # what the installed torch's DataLoader takes of these (refused: LoaderUsageError)
        versioned = torch_keyword_arguments(pin_memory_device=pin_memory_device, in_order=in_order)
        public, make_mode = self._choose_path(
            dataset,
            wc,
            seed_explicit=seed_explicit,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            generator=generator,
            prefetch_factor=prefetch_factor,
            reseed=reseed,
            global_rngs=global_rngs_setting(global_rngs),
        )
        try:
            super().__init__(
                dataset,
                num_workers=wc.num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                drop_last=drop_last,
                timeout=timeout,
                worker_init_fn=worker_init_fn,
                multiprocessing_context=multiprocessing_context,
                generator=generator,
                prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers,
                **public,
                **versioned,
            )
        except ValueError as e:  # BatchSampler, RandomSampler, multiprocessing_context
            raise refused(str(e)) from None
        self.in_order = in_order  # (set by torch where it has the argument: torch 2.6 and later)
        # properties, not instance attributes: frameworks that rebuild a DataLoader from
        # its instance attributes (Lightning, Fabric) then pass the user's own arguments
        self._worker_config = wc
        self._seed = wc.seed
        self.snapshot_every_n_steps = snapshot_every_n_steps
        #: Deprecated, without effect (see ``check_our_arguments``); kept for frameworks
        #: that rebuild a DataLoader from its instance attributes.
        self.save_timeout = save_timeout
        self._mode: Mode = make_mode()
        self._engine = self._make_engine(worker_init_fn, pin_memory, timeout, prefetch_factor, pin_memory_device)
        self._start_bookkeeping()
        if isinstance(self._mode, (PipelineMode, IterableMode)):  # torch's attribute is read-only after __init__
            object.__setattr__(self, "sampler", PipelineSampler(self))

    # -- construction -------------------------------------------------------------------

    @staticmethod
    def _resolve_configuration(
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
        names = ("in_order", "save_timeout", "snapshot_every_n_steps", "reseed", "global_rngs")
        ours = {name: arguments.pop(name) for name in names}
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

    def _start_bookkeeping(self) -> None:
        """No iteration yet, nothing restored."""
        # Held by a save for its whole duration and by the iterating thread while it books
        # an item, so that a save from another thread sees one consistent position.
        self._state_lock = threading.RLock()
        self._records: list[Record] = []
        self._started = 0  # iter() calls
        self._next_epoch = 0
        self._pending: Any = None  # a restored position the next iter() continues
        self._restored = False  # a state was restored: its epoch count is the loader's from then on
        #: Set by an integration whose framework calls the samplers' ``set_epoch`` with a
        #: count of its own (Fabric's per-process one): the loader's count is used instead.
        self._own_epochs = False

    def _choose_path(
        self,
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
    ) -> tuple[dict[str, Any], Callable[[], Mode]]:
        """The one place where the kind of dataset (and sampler) decides the path: the
        arguments torch's ``__init__`` gets for the public attributes, and the mode,
        built once those exist."""
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
                dataset, wc, prefetch, self.collate_fn, global_rngs=global_rngs
            )
        if isinstance(dataset, IterableDataset):  # a plain torch IterableDataset: _iterable_mode.py
            owner = weakref.ref(self)

            def iterable() -> Mode:
                return IterableMode(
                    self.dataset,  # type: ignore[arg-type]
                    wc,
                    prefetch,
                    self.collate_fn,
                    batch_size=self.batch_size,
                    drop_last=self.drop_last,
                    seed_explicit=seed_explicit,
                    reported_length=lambda: getattr(owner(), "_IterableDataset_len_called", None),
                    global_rngs=global_rngs,
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
        }
        if sampler is None and batch_sampler is None and not (generator is not None and shuffle):
            # an instance of torch's sampler for these arguments (frameworks inspect it)
            face = order_sampler(self, bool(shuffle), wc.world_size or 1)

            def own_order() -> Mode:
                return OrderMode(dataset, batch_size=batch_size, collate_fn=self.collate_fn, **common)

            return {"batch_size": batch_size, "sampler": face}, own_order
        if sampler is None and batch_sampler is None:
            try:  # generator= with shuffle=True: torch's own sampler, as torch builds it
                sampler = RandomSampler(dataset, generator=generator)
            except ValueError as e:
                raise refused(str(e)) from None

        def user_sampler() -> Mode:
            batching = self.batch_sampler is not None  # torch's auto-collation: batches from the batch sampler
            return SamplerMode(
                dataset,
                index_sampler=self.batch_sampler if batching else self.sampler,
                auto_collation=batching,
                generator=generator,
                persistent=self._persistent,
                batch_size=self.batch_size,
                collate_fn=self.collate_fn,
                **common,
            )

        return {"batch_size": batch_size, "sampler": sampler, "batch_sampler": batch_sampler}, user_sampler

    def _make_engine(
        self, worker_init_fn: Any, pin_memory: bool, timeout: float, prefetch_factor: int | None, pin_memory_device: str
    ) -> DataLoader[Any]:
        """The private torch DataLoader that runs the workers over the mode's dataset."""
        workers = self.num_workers
        return _Engine(  # no worker-count warning: the public loader gives it
            num_workers=workers,
            pin_memory=pin_memory,
            timeout=timeout,
            # in workers: an unpicklable sample becomes an error, not a hang (_feeder.py),
            # and get_worker_info().dataset is the user's dataset
            worker_init_fn=WorkerInit(worker_init_fn) if workers > 0 else None,
            multiprocessing_context=self.multiprocessing_context,
            generator=torch.Generator(),
            prefetch_factor=prefetch_factor,
            persistent_workers=self.persistent_workers,
            **torch_keyword_arguments(pin_memory_device=pin_memory_device),
            **self._mode.engine_kwargs(),
        )

    @property
    def worker_config(self) -> WorkerConfig:
        """Rank, world size, workers and seed of this loader (from ``worker_config=``, or
        resolved at construction from the arguments and ``torch.distributed``)."""
        return self._worker_config

    @property
    def seed(self) -> int:
        """The seed of the order and the per-sample RNG streams (a restore into a loader
        built with ``seed=None`` adopts the state's)."""
        return self._seed

    @property
    def _iterator(self) -> Any:
        """torch's iterator of the persistent workers (torch's attribute; frameworks reset it)."""
        engine = self.__dict__.get("_engine")
        return None if engine is None else loader_iterator(engine)

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        engine = self.__dict__.get("_engine")
        if engine is not None:
            set_loader_iterator(engine, value)

    @property
    def _persistent(self) -> bool:
        return bool(self.persistent_workers and self.num_workers > 0)

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> SavableIterator[T_co]:  # type: ignore[override]
        """An iterator over the next epoch (or the rest of a restored one). The iteration
        begins at its first ``next()``: an iterator never advanced consumes nothing, as a
        torch iterator over a random sampler draws nothing before its first batch."""
        if self.num_workers > 0 and not (self._persistent and loader_iterator(self._engine) is not None):
            self.check_worker_number_rationality()  # torch's warning, when torch's iter() gives it
        return SavableIterator(self)

    def _begin(self) -> Record:
        """Begin an iteration (the first ``next()`` of a SavableIterator)."""
        with self._state_lock:
            mode = self._mode
            live = [r for r in self._records if r.fate is Fate.LIVE]
            if live and not mode.concurrent(self._persistent, self.num_workers):
                for record in live:  # torch resets its single iterator: the old one is stale
                    record.stale = True
                    self._end(record, Fate.ABANDONED)
                live = [r for r in self._records if r.fate is Fate.LIVE]
            resume = self._pending
            if resume is not None:
                resume, epoch = mode.reconcile(resume, self._own_epochs)
            else:
                epoch = self._next_epoch
            if resume is None and self._user_samplers() and self._own_epochs:
                # the framework set its own count (Fabric's, 0 again after a resume): use the
                # epoch an uninterrupted run has here, as the loader's own order does
                self._set_sampler_epochs(epoch)
            reuse = self._persistent and loader_iterator(self._engine) is not None
            if reuse and not mode.workers_reusable():  # (see PipelineMode.workers_reusable)
                self._shutdown(loader_iterator(self._engine))
                reuse = False
            iteration = mode.begin(epoch, resume, reuse)
            self._pending = None
            self._next_epoch = epoch + 1
            self._started += 1
            record = Record(iteration, self._started, beside=bool(live))
            self._records = [r for r in self._records if r.fate is Fate.LIVE] + [record]
            self._engine.generator.manual_seed(engine_generator_seed(self.seed, epoch))
            try:
                with loader_call():
                    torch_iter = iter(self._engine)
            except Exception as e:
                record.failure = f"{type(e).__name__}: {e}"
                self._end(record, Fate.FAILED)
                raise
            record.torch_iter = torch_iter
            RUNNING[id(record)] = torch_iter
            if self.num_workers > 0:
                install()
        return record

    def _next(self, record: Record) -> Any:
        """The next payload of ``record``'s iteration (called by its SavableIterator)."""
        if record.fate is not Fate.LIVE:
            if record.stale:
                raise LoaderUsageError(
                    f"this iterator (epoch {record.iteration.epoch}) was superseded by a later iter(loader): "
                    + (
                        "persistent workers are one pool, and torch resets its single iterator"
                        if self._persistent
                        else "a savable pipeline in the main process runs one iteration at a time"
                    )
                    + "; use the newest iterator"
                )
            raise StopIteration
        torch_iter = record.torch_iter
        iteration = record.iteration
        while True:
            try:
                with loader_call(), iteration.caller_scope():
                    item = next_batch(torch_iter)
            except StopIteration:
                self._end(record, Fate.FINISHED)
                raise
            except Exception as e:  # noqa: BLE001 - one batch's error or the iteration's end: _on_error raises
                self._on_error(record, e)
            with self._state_lock:
                payload = iteration.on_item(item)
            if payload is not SKIP:
                return payload

    def _on_error(self, record: Record, error: Exception) -> None:
        """An exception from torch's iterator: one batch's (the iteration goes on), or
        the end of the iteration (a worker died or hung; a path that cannot go on)."""
        torch_iter = record.torch_iter
        translated = translate_worker_error(error, torch_iter, record.iteration.logical, self.timeout)
        with self._state_lock:
            goes_on = not isinstance(translated, WorkerError) and record.iteration.on_error(error)
        if goes_on:
            raise error
        record.failure = f"{type(translated).__name__}: {str(translated).splitlines()[0] if str(translated) else ''}"
        if isinstance(translated, WorkerTimeoutError):
            terminate_worker(torch_iter, record.iteration.logical, translated.worker_id)
        self._end(record, Fate.FAILED)
        if translated is error:
            raise error
        raise translated from error

    def _end(self, record: Record, fate: Fate) -> None:
        """``record``'s iteration is over; stop its workers unless they persist."""
        failure: Exception | None = None
        with self._state_lock:
            if record.fate is not Fate.LIVE:
                return
            iteration = record.iteration
            if fate is Fate.ABANDONED:
                try:  # taken now: the iteration's bookkeeping is about to go
                    record.position = iteration.position()
                except Exception as e:  # noqa: BLE001 - raised by a later save
                    record.error = e
            record.fate = fate
            # persistent workers stay for the next iteration, unless this one says they cannot
            keep = self._persistent and fate is not Fate.FAILED and iteration.workers_reusable()
            try:
                iteration.end(finished=fate is Fate.FINISHED, keep_workers=keep)
            except Exception as e:  # noqa: BLE001 - after the workers are stopped
                failure = e
            if (
                fate is Fate.ABANDONED
                and record.beside
                and record.serial == self._started
                and not iteration.resumed
                and self._next_epoch == iteration.epoch + 1
                and self._mode.reuses_epochs(self._persistent)
            ):
                record.fate = Fate.FORGOTTEN  # a peek: the next loop runs this epoch
                self._next_epoch = iteration.epoch
                self._records.remove(record)
        RUNNING.pop(id(record), None)
        if fate is Fate.FAILED or (fate is Fate.ABANDONED and not self._persistent) or (self._persistent and not keep):
            self._shutdown(record.torch_iter)
        # An iteration abandoned inside a garbage cycle may find its pipes finalised
        # first: nothing to report then, its workers are stopped all the same.
        if failure is not None and fate is not Fate.ABANDONED:
            raise failure

    def _shutdown(self, torch_iter: Any) -> None:
        """Stop the workers of a failed or abandoned iteration now, rather than when the
        torch iterator is freed: an error's traceback holds it in a reference cycle, and
        when the cycle collector frees it, its queues may be finalised first, so that its
        workers never get the stop signal and are killed after a 5 s join timeout each."""
        shutdown_workers(torch_iter)
        if torch_iter is not None and loader_iterator(self._engine) is torch_iter:
            set_loader_iterator(self._engine, None)  # persistent workers: start new ones next time

    @property
    def _torch_iter(self) -> Any:
        """torch's iterator of the most recent live iteration (None if none)."""
        live = [r for r in self._records if r.fate is Fate.LIVE]
        return live[-1].torch_iter if live else None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` starts, as ``DistributedSampler.set_epoch`` (and
        the ``set_epoch`` of the user's samplers, which it calls too).

        After a restore the next ``iter()`` continues the restored epoch: ``set_epoch``
        with that epoch keeps it, with the following one skips its remainder only if
        nothing is left, and otherwise raises :class:`LoaderUsageError` (it would drop or
        repeat data). Example::

            for epoch in range(start, epochs):
                loader.set_epoch(epoch)
                for batch in loader:
                    ...
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise LoaderUsageError(f"set_epoch needs an int >= 0, got {epoch!r}")
        with self._state_lock:
            pending = self._pending
            if pending is not None and epoch != pending.epoch:
                left = self._mode.remaining(pending)
                if not (left == 0 and epoch == pending.epoch + 1):
                    raise LoaderUsageError(
                        f"set_epoch({epoch}): the restored state continues epoch {pending.epoch} "
                        f"({'an unknown number of' if left is None else left} batches left); set_epoch({pending.epoch}) "
                        "keeps it, or build a new loader to start another epoch"
                    )
                self._mode.finish_rest(pending)  # a sampler's generators: where the epoch's end left them
                self._pending = None
            if self._pending is None:
                self._next_epoch = epoch
        self._set_sampler_epochs(epoch)

    def _set_sampler_epochs(self, epoch: int) -> None:
        for sampler in self._user_samplers():
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def _user_samplers(self) -> list[Any]:
        if not isinstance(self._mode, SamplerMode):
            return []
        found: list[Any] = []
        for candidate in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if candidate is not None and all(candidate is not f for f in found):
                found.append(candidate)
        return found

    def _upcoming_epoch(self) -> int:
        """The epoch the next ``iter()`` starts or continues."""
        pending = self._pending
        return pending.epoch if pending is not None else self._next_epoch

    def remaining(self) -> int | None:
        """Batches still to come: in the most recent live iteration, or else in the one
        the next ``iter()`` starts (the rest of a restored epoch, or a whole epoch);
        ``None`` where no end is known: a savable pipeline or an IterableDataset without
        a length (an endless stream, such as an LLM pretraining pipeline).

        Use it where ``len(loader)`` would count a whole epoch, e.g. a progress bar after
        a mid-epoch restore, which shows the batches done of the epoch's length (8/13, not
        0/5): ``tqdm(loader, total=len(loader), initial=len(loader) - loader.remaining())``
        (a stream: ``tqdm(loader)``, no total).
        """
        with self._state_lock:
            live = [r for r in self._records if r.fate is Fate.LIVE]
            if live:
                return live[-1].iteration.remaining()
            if self._pending is not None:
                return self._mode.remaining(self._pending)
        try:
            return len(self)
        except TypeError:  # torch's: an IterableDataset without __len__
            return None

    # -- state ------------------------------------------------------------------------

    def save_state_rank(self) -> RankState:
        """This rank's loader state: valid at any moment, cheap, never blocks on a busy worker.

        Before the first batch, mid-epoch, at an epoch's last batch (a restore yields the
        empty rest of that epoch, then the next one), after the epoch ended (the next
        epoch's start), after ``break`` or an exception in the loop body (the abandoned
        position; this loader's own next ``iter()`` starts the next epoch, as torch's
        does), right after a restore. Saving twice without iterating gives equal states.
        With two live iterations (``zip(loader, loader)``) a state would be ambiguous:
        :class:`LoaderUsageError`.

        Thread-safe: a checkpoint thread may save while the training thread iterates. The
        state is the position between two yielded items; while a save runs, the iterating
        thread waits before booking its next item. Example::

            threading.Thread(target=lambda: save_file(path, loader.save_state_rank())).start()

        After an iteration failed (a worker died or hung), its position is lost with it:
        saving raises :class:`LoaderUsageError` until the next ``iter()``; restore a new
        loader from a state saved before the failure.
        """
        return self._save(held=0)

    def _save(self, held: int) -> RankState:
        with self._state_lock:
            position = self._describe(held)
            return RankState(
                config=self._mode.loader_config(self.num_workers), position=position, library_version=__version__
            )

    def _describe(self, held: int = 0) -> Any:
        """The position a save records (see ``_iterator.py``), leaving out the last
        ``held`` items of a live iteration (a framework fetched them ahead)."""
        mode = self._mode
        records = self._records
        if not records:
            return self._pending if self._pending is not None else mode.start_position(self._next_epoch)
        record = max(records, key=lambda r: r.serial)
        others = [r for r in records if r is not record and r.fate is Fate.LIVE]
        if others:
            epochs = sorted(r.iteration.epoch for r in [*others, record])
            raise LoaderUsageError(
                f"cannot save: {len(others) + 1} iterations of this loader are in progress (epochs {epochs}), and a "
                "state describes one; finish or close the others (it.close(), del it) first"
            )
        if held and record.fate is not Fate.LIVE:
            raise LoaderUsageError(
                f"cannot save: the caller holds {held} batch(es) fetched ahead, but the loader's last iteration "
                f"(epoch {record.iteration.epoch}) is {record.fate.value}"
            )
        if record.fate is Fate.LIVE:
            try:
                with loader_call():  # a worker death signalled before the save is delivered here
                    return record.iteration.position(held)
            except RuntimeError as e:
                if isinstance(e, SavableLoaderError):
                    raise
                raise translate_worker_error(e, record.torch_iter, record.iteration.logical, self.timeout) from e
        if record.fate is Fate.ABANDONED:
            if record.error is not None:
                raise LoaderUsageError(
                    f"cannot save: the position of the abandoned iteration of epoch {record.iteration.epoch} could "
                    f"not be taken ({type(record.error).__name__}: {record.error})"
                ) from record.error
            return record.position
        if record.fate is Fate.FAILED:
            raise LoaderUsageError(
                f"cannot save: the loader's last iteration failed ({record.failure}) and its position was "
                "lost with it; restore a new loader from a state saved before the failure "
                "(or call iter() to start the next epoch)"
            )
        return mode.start_position(self._next_epoch)

    def restore_state_rank(self, state: RankState) -> None:
        """Restore a state from :meth:`save_state_rank`.

        The next ``iter()`` continues the saved position; later ones start the next
        epochs. The loader may have iterated before (persistent workers are restarted),
        but no iteration may be in progress. A changed ``num_workers`` is honoured (a
        savable pipeline's saved logical workers are hosted by this loader's workers for
        the rest of their epoch; a plain IterableDataset only at an epoch's start); other
        changes the loader cannot honour raise
        :class:`ConfigMismatchError` naming the field. A loader built with ``seed=None``
        takes the state's seed.
        """
        if isinstance(state, list):
            raise StateError(
                f"restore_state_rank needs one rank's RankState, got a list of {len(state)} "
                "(a gathered state: pick this rank's entry)"
            )
        if not isinstance(state, RankState):
            raise StateError(f"restore_state_rank needs a RankState, got {type(state).__qualname__}")
        self._restore(state, state.position, elastic=False)

    def _restore(self, state: RankState, position: Any, elastic: bool) -> None:
        mode = self._mode
        with self._state_lock:
            live = [r for r in self._records if r.fate is Fate.LIVE]
            if live:
                raise LoaderUsageError(
                    f"cannot restore while an iteration of epoch {live[-1].iteration.epoch} is in progress: finish "
                    "it or close it (it.close(), del it) first"
                )
            if not isinstance(position, mode.position_type):
                saved_path = "pipeline" if isinstance(position, PipelinePosition) else "drop-in"
                raise StateError(
                    f"the state was saved by a {saved_path} loader, this loader is a {mode.path_name} loader"
                )
            formula = state.config.seed_formula
            if formula not in SEED_FORMULAS:
                raise StateError(
                    f"the state uses seed formula {formula}, this savable-loader knows formulas "
                    f"{', '.join(map(str, SEED_FORMULAS))}: upgrade savable-loader"
                )
            position = mode.check(state.config, position, self.num_workers, elastic=elastic)
            if not mode.seed_explicit:
                self._seed = state.config.seed
            mode.adopt(self.seed, formula)
            self._records = []
            self._pending = position
            self._restored = True
            self._next_epoch = position.epoch + 1
            mode.show_restored(position)
            mode.restored()
            if loader_iterator(self._engine) is not None:  # persistent workers start anew
                self._shutdown(loader_iterator(self._engine))

    def _restore_resized(self, states: list[RankState], world_size: int) -> None:
        if not self._mode.resizable:
            raise ConfigMismatchError("world_size", len(states), world_size, self._mode.fixed_world_size)
        state, position = self._mode.resized(states, world_size, self.num_workers)
        self._restore(state, position, elastic=True)

    def save_state_global(self, global_dst_rank: int) -> list[RankState] | None:
        """Gather every data-parallel rank's state to ``global_dst_rank``.

        A collective: every rank of the data-parallel group calls it. The destination gets
        the list ordered by data-parallel rank, the others None. Without torch.distributed
        it returns ``[self.save_state_rank()]``.
        """
        group = DataParallelGroup(self.worker_config)
        return gather_states(group, self.save_state_rank(), global_dst_rank)

    def restore_state_global(self, states: list[RankState] | None, *, src_rank: int | None = None) -> None:
        """Restore from a gathered list: every rank passes it (``src_rank=None``), or only
        global rank ``src_rank`` does and it is scattered (a collective then).

        Drop-in path with the loader's own order: states saved on ``W`` ranks restore on
        any other world size ``W'``. The rest of the interrupted epoch — every sample no
        old rank had consumed — is shared among the new ranks, each exactly once (shares
        differ by at most one sample), and later epochs are ordinary ``W'``-rank epochs.
        A savable pipeline or a sampler of the user's refuses another world size with
        :class:`ConfigMismatchError`, as does a list that does not hold one state per old
        rank.
        """
        group = DataParallelGroup(self.worker_config)
        resize_ok = self._mode.resizable
        if src_rank is None:
            if is_resize(states, group.size):
                self._restore_resized(check_gathered(states), group.size)
                return
            state = select_rank_state(states, group.rank, group.size)
        else:
            got = scatter_states(group, states, src_rank, allow_resize=resize_ok)
            if isinstance(got, list):
                self._restore_resized(got, group.size)
                return
            state = got
        self.restore_state_rank(state)

    # -- restore keys -----------------------------------------------------------------

    @property
    def restore_key(self) -> RestoreKey | None:
        """The :class:`~savable_loader.state.RestoreKey` of the batch yielded last.

        None before the first batch (and right after a restore). Keep it, for example
        beside a loss spike, and rebuild that batch later with :meth:`restore_sample`::

            for batch in loader:
                loss = step(batch)
                if loss > threshold:
                    print("spike at", loader.restore_key)   # one line of JSON
        """
        return self._mode.restore_key(self.seed)

    def restore_sample(self, key: RestoreKey | str) -> Any:
        """The batch ``key`` names, rebuilt bit for bit in this process, without iterating.

        ``key`` is a :class:`~savable_loader.state.RestoreKey` from :attr:`restore_key`
        or its ``str()``. The loader must be built like the one that made the key: same
        dataset and seed (drop-in path with the loader's own order: ``num_workers``, rank
        and world size may differ; with a sampler of the user's: the same rank, as the
        key carries the dataset indices; savable pipelines: the same rank and world size,
        since sources split the data by them, and any ``num_workers``). Savable pipelines rebuild
        when every dataset of the pipeline supports it (``dataset.can_restore_sample()``;
        ``restore_sample_blocker()`` says why not). Raises :class:`RestoreKeyError`
        otherwise. Example::

            key = str(loader.restore_key)
            again = loader.restore_sample(key)
        """
        if isinstance(key, (str, bytes)):
            key = RestoreKey.parse(key)
        if not isinstance(key, RestoreKey):
            raise RestoreKeyError(f"restore_sample needs a RestoreKey or its str(), got {type(key).__qualname__}")
        if key.seed != self.seed:
            raise RestoreKeyError(f"key.seed is {key.seed}, this loader's seed is {self.seed}")
        if key.fingerprint != self._mode.fingerprint:
            raise RestoreKeyError(
                f"key.fingerprint is {key.fingerprint!r}, this loader's dataset is {self._mode.fingerprint!r}: "
                "the key was made by a loader over another dataset or configuration"
            )
        return self._mode.restore_sample(key)

    def _state_key(self) -> str:
        return f"dp_rank_{self.worker_config.rank}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's state under torch's name, as ``{"dp_rank_<r>": <MessagePack bytes>}``.

        Keyed by data-parallel rank so that ``torch.distributed.checkpoint`` stores each
        rank's entry (values under one key would be de-duplicated as replicated); safe with
        ``torch.load(weights_only=True)``. Makes the loader a DCP ``Stateful``. Never a
        collective, whoever calls it.

        Frameworks that write rank 0's answer only (Lightning's Trainer and Fabric,
        Accelerate's ``save_state``) resume the other ranks where their position derives
        from rank 0's (see :meth:`load_state_dict`); elsewhere an integration's hook
        stores every rank's entry (``savable_loader/integrations/``). A loader without
        ``len()`` whose epochs a framework sets (``loader.sampler.set_epoch``: Lightning's
        Trainer, Fabric) refuses this call in the middle of an epoch unless a hook claimed
        it (Lightning's loop may hold a batch fetched ahead, which the state would count:
        see ``savable_loader/_frameworks.py``).
        """
        with self._state_lock:
            check_nothing_held(self, self._has_length(), self._mid_epoch())
            state = self._save(0)
        return {self._state_key(): encode(state)}

    def _has_length(self) -> bool:
        """Whether ``len(loader)`` answers (Lightning fetches ahead of a loader where it
        does not), asked of the dataset: torch's ``len(loader)`` of an iterable dataset
        records the length it reported, which a later iteration checks."""
        if not isinstance(self._mode, (PipelineMode, IterableMode)):
            return True
        try:
            len(self.dataset)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return False
        return True

    def _mid_epoch(self) -> bool:
        """Whether an iteration is live (a framework may hold a batch it fetched ahead)."""
        return any(r.fate is Fate.LIVE for r in self._records)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (this rank's entry).

        Checkpoints written by rank 0 only (Lightning, Fabric, Accelerate's
        ``register_for_checkpointing``) hold ``dp_rank_0`` alone: another rank then
        derives its own position from it where that is exact (the loader's own order, or
        torch's ``DistributedSampler``; ranks stepping in lockstep, see
        ``savable_loader/_rank_zero.py``) and raises :class:`StateError` naming the
        recipe otherwise.
        """
        key = self._state_key()
        others = [k for k in state_dict if str(k).startswith("dp_rank_")] if isinstance(state_dict, dict) else []
        if key not in others and len(others) != 1:
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__qualname__
            raise StateError(f"load_state_dict needs the entry {key!r} made by state_dict(), found {found}")
        data = state_dict[key if key in others else others[0]]
        if isinstance(data, torch.Tensor):
            data = data.numpy().tobytes()
        if isinstance(data, io.BytesIO):
            data = data.getvalue()
        state = decode(data)
        if isinstance(state, list):
            raise StateError("load_state_dict got a gathered state of several ranks")
        if key not in others and isinstance(state, RankState):
            state = derive_state(self, state)  # another rank's state (a checkpoint of rank 0's)
        self.restore_state_rank(state)
