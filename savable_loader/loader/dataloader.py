"""SavableDataLoader: torch's DataLoader whose position can be saved and restored exactly.

The loader takes torch's arguments and shows torch's attributes (``loader.dataset`` is
the user's dataset, ``loader.sampler`` / ``loader.batch_sampler`` are samplers). Loading
runs through a private ``torch.utils.data.DataLoader`` (the *engine*) over an internal
dataset and sampler of the engine chosen at construction (``construction.py``: an
``index/`` engine for map-style datasets, a ``pipeline/`` engine for savable pipelines
and plain iterables), reached only through :class:`~savable_loader.core.engine.Mode`.
Iterations, their fates, saves and restores: ``iterations.py``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader

from savable_loader._torch.internals import allow_bytes_in_weights_only_loads, loader_iterator, set_loader_iterator
from savable_loader._version import __version__
from savable_loader.config import WorkerConfig
from savable_loader.core.engine import Mode
from savable_loader.core.frameworks import check_nothing_held
from savable_loader.distributed import (
    DataParallelGroup,
    check_gathered,
    gather_states,
    is_resize,
    scatter_states,
    select_rank_state,
)
from savable_loader.errors import LoaderUsageError, RestoreKeyError, StateError
from savable_loader.index.rank_zero import derive_state
from savable_loader.index.samplers import PipelineSampler
from savable_loader.loader.arguments import refused, torch_keyword_arguments
from savable_loader.loader.construction import choose_engine, make_engine, make_recorder, resolve_configuration
from savable_loader.loader.iterations import Iterations
from savable_loader.loader.iterator import SavableIterator
from savable_loader.rng.global_rngs import global_rngs_setting
from savable_loader.state.codec import decode, encode
from savable_loader.state.schema import RankState, RestoreKey
from savable_loader.stats.record import LoaderStats

__all__ = ["SavableDataLoader"]

T_co = TypeVar("T_co", covariant=True)

# state_dict() holds bytes: torch.load(weights_only=True) takes them on torch 2.4 too
allow_bytes_in_weights_only_loads()


class SavableDataLoader(DataLoader[T_co]):
    """A ``torch.utils.data.DataLoader`` whose position can be saved and restored exactly.

    Takes torch's arguments, in torch's order and with torch's defaults, plus ``seed``
    (None: drawn from torch's global RNG at construction, from ``generator.initial_seed()``
    with ``generator=``, or 0 on several ranks; a restore adopts the state's),
    ``worker_config`` (a :class:`~savable_loader.WorkerConfig`), ``reseed`` (map-style
    datasets: ``"sample"`` re-seeds the global RNGs before every sample, ``"batch"`` once
    per batch), ``global_rngs`` (the global generators the data draws from; None: all
    three; a batch drawing from one left out raises ``UndeclaredRngError``),
    ``snapshot_every_n_steps`` (torchdata's, accepted and ignored), ``save_timeout``
    (deprecated, without effect), ``record_stats`` (True: :meth:`stats` reports where
    the step time goes), ``stats_log`` (a JSON-lines file of those statistics,
    ``{rank}`` replaced by the rank) and ``stats_log_every`` (seconds between its
    lines). docs/usage.md describes each. Example::

        loader = SavableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)
        for batch in loader:
            ...
            state = loader.save_state_rank()        # microseconds
        fresh = SavableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)
        fresh.restore_state_rank(state)              # continues with the next batch

    A :class:`~savable_loader.SavableDataset` pipeline batches inside the pipeline
    (``batch_size=None``); a plain ``IterableDataset`` runs as in torch and resumes from
    its ``state_dict()``, or by a counted replay. Without a sampler the loader draws each
    epoch's order from ``(seed, epoch)`` and splits it across ranks; ``sampler=``,
    ``batch_sampler=`` and ``generator=`` run as in torch and resume exactly when their
    order is decided by generators, ``epoch`` or ``state_dict()`` they hold.

    Each ``iter()`` starts the next epoch, except the first after a restore, which
    continues the saved position. A save describes the most recent iteration: where it
    is, where it was abandoned, or the next epoch's start after it ended.
    ``len(loader)`` is a whole epoch's batches, as in torch; :meth:`remaining` counts
    what is left.
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
        record_stats: bool = True,
        stats_log: str | os.PathLike[str] | None = None,
        stats_log_every: float = 10.0,
    ) -> None:
        wc, seed_explicit = resolve_configuration(
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
            record_stats=record_stats,
            stats_log=stats_log,
            stats_log_every=stats_log_every,
        )
        # what the installed torch's DataLoader takes of these (refused: LoaderUsageError)
        versioned = torch_keyword_arguments(pin_memory_device=pin_memory_device, in_order=in_order)
        public, make_mode = choose_engine(
            self,
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
            timing=record_stats,
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
        self._mode: Mode[Any] = make_mode()
        self._engine = make_engine(
            self, self._mode, worker_init_fn, pin_memory, timeout, prefetch_factor, pin_memory_device
        )
        #: ``record_stats``, ``stats_log`` and ``stats_log_every`` as given (frameworks that
        #: rebuild a DataLoader from its instance attributes pass them on)
        self.record_stats = record_stats
        self.stats_log = stats_log
        self.stats_log_every = stats_log_every
        self._iterations = Iterations(
            self, self._mode, self._engine, make_recorder(self, record_stats, stats_log, stats_log_every)
        )
        if not self._mode.indexed:  # torch's attribute is read-only after __init__
            object.__setattr__(self, "sampler", PipelineSampler(self))

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

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> SavableIterator[T_co]:  # type: ignore[override]
        """An iterator over the next epoch (or the rest of a restored one). The iteration
        begins at its first ``next()``: an iterator never advanced consumes nothing, as a
        torch iterator over a random sampler draws nothing before its first batch."""
        persistent = self.persistent_workers and self.num_workers > 0
        if self.num_workers > 0 and not (persistent and loader_iterator(self._engine) is not None):
            self.check_worker_number_rationality()  # torch's warning, when torch's iter() gives it
        return SavableIterator(self._iterations, self)

    def stats(self) -> LoaderStats:
        """Where the step time went since the last ``stats()`` call or the start of the
        epoch, whichever is later: the share of wall time the training loop waited in
        ``next()``, steps and samples per second, each worker's items and busy share, the
        items ready when the loop asked, and the time of each stage (a savable pipeline's
        datasets, the collate function), the slowest named. Cheap: call it every step if
        you like. ``LoaderUsageError`` with ``record_stats=False``. Example::

            for step, batch in enumerate(loader):
                ...
                if step % 100 == 0:
                    print(loader.stats().summary())   # or bar.set_postfix(loader.stats().postfix())

        docs/debugging.md reads a report.
        """
        recorder = self._iterations.recorder
        if recorder is None:
            raise LoaderUsageError(
                "loader.stats() needs record_stats=True (the default); this loader was built with record_stats=False"
            )
        return recorder.take()

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
        self._iterations.set_epoch(epoch)

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
        return self._iterations.remaining()

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
        with self._iterations.lock:
            position = self._iterations.describe(held)
            config = self._mode.loader_config(self.num_workers)
        return RankState(config=config, position=position, library_version=__version__)

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
        self._seed = self._iterations.restore([state])

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
        if src_rank is None:
            if is_resize(states, group.size):
                self._seed = self._iterations.restore(check_gathered(states), group.size)
                return
            state = select_rank_state(states, group.rank, group.size)
        else:
            got = scatter_states(group, states, src_rank, allow_resize=self._mode.resizable)
            if isinstance(got, list):
                self._seed = self._iterations.restore(got, group.size)
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
        return self._mode.rebuild(key, self.seed)

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
        see ``savable_loader/core/frameworks.py``).
        """
        with self._iterations.lock:
            check_nothing_held(self, self._has_length(), bool(self._iterations.live()))
            state = self._save(0)
        return {self._state_key(): encode(state)}

    def _has_length(self) -> bool:
        """Whether ``len(loader)`` answers (Lightning fetches ahead of a loader where it
        does not), asked of the dataset: torch's ``len(loader)`` of an iterable dataset
        records the length it reported, which a later iteration checks."""
        if self._mode.indexed:
            return True
        try:
            len(self.dataset)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return False
        return True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (this rank's entry).

        Checkpoints written by rank 0 only (Lightning, Fabric, Accelerate's
        ``register_for_checkpointing``) hold ``dp_rank_0`` alone: another rank then
        derives its own position from it where that is exact (the loader's own order, or
        torch's ``DistributedSampler``; ranks stepping in lockstep, see
        ``savable_loader/index/rank_zero.py``) and raises :class:`StateError` naming the
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
