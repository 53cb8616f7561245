"""SavableDataLoader: torch's DataLoader whose position can be saved and restored exactly.

Two ways in (see DESIGN.md):

* a map-style dataset (``__getitem__`` + ``__len__``): the drop-in path. The loader
  builds the per-epoch order itself from ``seed``; the state is the epoch and the number
  of samples yielded, and any ``num_workers`` can resume it.
* a :class:`~savable_loader.SavableDataset` pipeline with ``batch_size=None``: per-worker
  pipeline states are captured from snapshots through a command thread in each worker.

Each ``iter(loader)`` starts the next epoch, except the first one after
``restore_state_rank``, which continues the saved epoch.
"""

from __future__ import annotations

import io
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, default_convert

from savable_loader._elastic import elastic_position
from savable_loader._failures import terminate_worker, translate_worker_error
from savable_loader._feeder import WorkerInit
from savable_loader._index_mode import IndexMode
from savable_loader._pipeline_mode import SKIP, PipelineMode
from savable_loader._sigchld import install, loader_call
from savable_loader._version import __version__
from savable_loader._worker import END
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
    WorkerTimeoutError,
)
from savable_loader.sources.torch_iterable import loader_source, warn_replays
from savable_loader.state.codec import decode, encode
from savable_loader.state.schema import IndexPosition, PipelinePosition, RankState, RestoreKey

__all__ = ["SavableDataLoader"]

_UNSUPPORTED = {
    "sampler": "the loader builds its own per-epoch order from `seed`; use shuffle=True/False",
    "batch_sampler": "the loader cuts batches itself; use batch_size and drop_last",
    "generator": "randomness comes from `seed` so that it can be resumed",
    "in_order": "out-of-order delivery cannot be resumed exactly",
}
_DEFAULT_SAVE_TIMEOUT = 60.0
#: torch iterators of running iterations. Keeping them reachable from here means that an
#: iteration abandoned inside a reference cycle does not take torch's worker queues into
#: the cycle collector, which would finalise them before the iteration's ``finally`` could
#: send the workers their stop signal (then each worker is killed after a 5 s timeout).
_RUNNING: dict[int, Any] = {}


class _TaggedCollate:
    """Applies the per-item collate function to a pipeline item, keeping its tag."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, item: tuple[Any, ...]) -> tuple[Any, ...]:
        # (worker_id, index, key, payload) or, from worker processes, (..., snapshot)
        if item[1] == END:
            return item
        return (item[0], item[1], item[2], self.collate(item[3]), *item[4:])


def _identity(batch: Any) -> Any:
    return batch


class SavableDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` whose position can be saved and restored exactly.

    Example, drop-in path (map-style dataset)::

        loader = SavableDataLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=4)
        for batch in loader:
            ...
            state = loader.save_state_rank()        # microseconds
        fresh = SavableDataLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=2)
        fresh.restore_state_rank(state)              # continues with the next batch

    Savable pipelines (``SavableDataset``, batching inside the pipeline)::

        wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=3)
        loader = SavableDataLoader(BatchDataset(MySource(worker_config=wc), 32), batch_size=None)

    Accepts torch's ``batch_size``, ``shuffle``, ``collate_fn``, ``drop_last``,
    ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``timeout``,
    ``worker_init_fn``, ``multiprocessing_context`` and ``persistent_workers``, plus
    ``seed``, ``worker_config`` and ``save_timeout`` (seconds a save may wait for a
    worker). ``sampler``, ``batch_sampler``, ``generator`` and ``in_order=False`` are
    refused: they cannot be resumed exactly.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        *,
        seed: int | None = None,
        worker_config: WorkerConfig | None = None,
        num_workers: int | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
        drop_last: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        persistent_workers: bool = False,
        save_timeout: float = _DEFAULT_SAVE_TIMEOUT,
        **unsupported: Any,
    ) -> None:
        for name, value in unsupported.items():
            if name in _UNSUPPORTED:
                if name == "in_order" and value is True:
                    continue
                raise LoaderUsageError(f"SavableDataLoader does not accept {name}={value!r}: {_UNSUPPORTED[name]}")
            raise LoaderUsageError(f"SavableDataLoader got an unexpected keyword argument {name!r}")
        wc = self._resolve_worker_config(worker_config, num_workers, seed)
        if timeout < 0:
            raise LoaderUsageError(f"timeout must be >= 0, got {timeout}")
        if save_timeout <= 0:
            raise LoaderUsageError(f"save_timeout must be > 0, got {save_timeout}")
        if prefetch_factor is not None and wc.num_workers == 0:
            raise LoaderUsageError("prefetch_factor needs num_workers > 0 (as in torch's DataLoader)")
        if persistent_workers and wc.num_workers == 0:
            raise LoaderUsageError("persistent_workers=True needs num_workers > 0 (as in torch's DataLoader)")
        if timeout and wc.num_workers == 0:
            raise LoaderUsageError(f"timeout={timeout} needs num_workers > 0 (as in torch's DataLoader)")
        prefetch = 2 if prefetch_factor is None else prefetch_factor

        # A plain torch IterableDataset runs as a savable pipeline (sources/torch_iterable.py).
        self._iterable = loader_source(dataset, wc, batch_size, shuffle, drop_last)
        if self._iterable is not None:
            dataset, batch_size, shuffle, drop_last = self._iterable, None, None, False
            if collate_fn is None and self._iterable.batch_size is not None:
                collate_fn = default_collate

        if isinstance(dataset, SavableDataset):
            if batch_size is not None:
                raise LoaderUsageError(
                    f"a savable pipeline batches inside the pipeline (BatchDataset): pass batch_size=None, got {batch_size!r}"
                )
            if shuffle:
                raise LoaderUsageError(
                    "a savable pipeline shuffles inside the pipeline (ShuffleBufferDataset): shuffle must be False"
                )
            if drop_last:
                raise LoaderUsageError(
                    "a savable pipeline drops inside the pipeline (BatchDataset(drop_last=True)): drop_last must be False"
                )
            if dataset.worker_config != wc:
                raise LoaderUsageError(
                    f"the pipeline's worker_config {dataset.worker_config} differs from the loader's {wc}"
                )
            mode: IndexMode | PipelineMode = PipelineMode(dataset, wc, prefetch)
            torch_kwargs: dict[str, Any] = {
                "batch_size": None,
                "collate_fn": _TaggedCollate(default_convert if collate_fn is None else collate_fn),
            }
        else:
            if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
                raise LoaderUsageError(
                    f"dataset must be map-style (__getitem__ and __len__) or a SavableDataset, got {type(dataset).__qualname__}"
                )
            if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
                raise LoaderUsageError(f"batch_size must be a positive int or None, got {batch_size!r}")
            if collate_fn is None:
                collate_fn = default_collate if batch_size is not None else default_convert
            mode = IndexMode(
                dataset, seed=wc.seed, shuffle=bool(shuffle), rank=wc.rank, world_size=wc.world_size,
                batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn,
            )
            torch_kwargs = {"batch_size": None, "sampler": mode.sampler, "collate_fn": _identity}

        super().__init__(
            mode.torch_dataset,
            num_workers=wc.num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            # in workers: an unpicklable sample becomes an error, not a hang (_feeder.py)
            worker_init_fn=WorkerInit(worker_init_fn) if wc.num_workers > 0 else worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=torch.Generator().manual_seed(wc.seed & 0x7FFF_FFFF_FFFF_FFFF),
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            **torch_kwargs,
        )
        # torch's DataLoader guards these after __init__; ours describe the user's view.
        if self._iterable is not None:
            batch_size, drop_last = self._iterable.batch_size, self._iterable.drop_last
        object.__setattr__(self, "batch_size", batch_size if mode.kind == "index" or self._iterable is not None else None)
        object.__setattr__(self, "drop_last", drop_last)
        self.worker_config = wc
        self.seed = wc.seed
        self.save_timeout = save_timeout
        self._mode = mode
        self._prefetch = prefetch
        self._torch_iter: Any = None
        self._live: weakref.ref[Iterator[Any]] | None = None
        # Held by a save for its whole duration and by the iterating thread while it books
        # an item, so that a save from another thread sees one consistent position.
        self._state_lock = threading.RLock()
        # Why the last iteration failed (a save cannot know its position any more).
        self._failed: str | None = None
        # Persistent workers of a plain IterableDataset restored with rotated worker roles
        # are restarted after that epoch: the dataset copies (sharded in worker_init_fn or
        # at their first __iter__) belong to the roles they started with.
        self._roles_change = False

    @staticmethod
    def _resolve_worker_config(wc: WorkerConfig | None, num_workers: int | None, seed: int | None) -> WorkerConfig:
        if wc is None:
            return WorkerConfig(num_workers=0 if num_workers is None else num_workers, seed=0 if seed is None else seed)
        if not isinstance(wc, WorkerConfig):
            raise LoaderUsageError(f"worker_config must be a WorkerConfig, got {type(wc).__qualname__}")
        if num_workers is not None and num_workers != wc.num_workers:
            raise LoaderUsageError(f"num_workers={num_workers} differs from worker_config.num_workers={wc.num_workers}")
        if seed is not None and seed != wc.seed:
            raise LoaderUsageError(f"seed={seed} differs from worker_config.seed={wc.seed}")
        return wc

    # -- iteration --------------------------------------------------------------------

    def __len__(self) -> int:
        if self._mode.kind == "index":
            return len(self._mode.sampler)  # type: ignore[union-attr]
        if self._iterable is not None:
            return len(self._iterable)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        previous = self._live() if self._live is not None else None
        if previous is not None:
            previous.close()  # a new iteration abandons the previous one (next epoch)
        live = self._iterate()
        # A weak reference: the generator's frame refers to the loader, and a cycle would
        # keep an abandoned iteration's workers alive until the cyclic garbage collector.
        self._live = weakref.ref(live)
        return live

    def _iterate(self) -> Iterator[Any]:
        mode = self._mode
        owner = weakref.ref(self)  # cleared first when a garbage cycle holds the loader
        persistent = self.persistent_workers and self.num_workers > 0
        while True:
            with self._state_lock:
                resumed = mode.begin(self._mp_context(), reuse_workers=persistent and self._iterator is not None)
                self._failed = None
            produced = 0
            finished = False
            torch_iter = None
            try:
                with loader_call():
                    torch_iter = super().__iter__()
                if self.num_workers > 0:
                    install()
                self._torch_iter = torch_iter
                _RUNNING[id(torch_iter)] = torch_iter
                mode.workers_started()
                while True:
                    try:
                        with loader_call():
                            item = next(torch_iter)
                    except StopIteration:
                        break
                    except Exception as e:
                        self._failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        translated = self._translate(e, torch_iter)
                        if isinstance(translated, WorkerTimeoutError):
                            terminate_worker(torch_iter, self._logical, translated.worker_id)
                        if translated is e:
                            raise
                        raise translated from e
                    with self._state_lock:
                        payload = mode.on_item(item)
                    if payload is not SKIP:
                        produced += 1
                        if self._iterable is not None:
                            self._iterable.warn_if_longer(produced, self.num_workers)
                        yield payload
                finished = True
            finally:
                failed = self._failed is not None
                with self._state_lock:
                    self._torch_iter = None
                    mode.end(keep_channels=persistent and not failed)
                _RUNNING.pop(id(torch_iter), None)
                # Stop the workers of a failed or abandoned iteration now (persistent ones
                # stay for the next epoch unless the loader itself is being collected).
                if failed or (not finished and (not persistent or owner() is None)) or (resumed and self._roles_change):
                    self._shutdown(torch_iter)
                self._roles_change = False
            # A restored pipeline epoch that had nothing left (all its workers had yielded
            # their last item, unknown to the saving side): go on with the next epoch, as
            # the uninterrupted run would have. (A drop-in state is never saved at an
            # epoch's end, and an empty share after a world-size change must stay an empty
            # epoch, or that rank would run one epoch ahead of the others.)
            if not (finished and resumed and produced == 0 and mode.kind == "pipeline"):
                return

    def _shutdown(self, torch_iter: Any) -> None:
        """Stop the workers of a failed or abandoned iteration now, rather than when the
        torch iterator is freed: an error's traceback holds it in a reference cycle, and
        when the cycle collector frees it, its queues may be finalised first, so that its
        workers never get the stop signal and are killed after a 5 s join timeout each."""
        shutdown = getattr(torch_iter, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        if self._iterator is torch_iter:
            self._iterator = None  # persistent workers: start new ones next time

    def _mp_context(self) -> Any:
        ctx = self.multiprocessing_context
        if ctx is None:
            return torch.multiprocessing.get_context()
        return ctx

    def _translate(self, error: Exception, torch_iter: Any) -> Exception:
        return translate_worker_error(error, torch_iter, self._logical, self.timeout)

    def _logical(self, physical: int) -> int:
        return self._mode.logical(physical)

    # -- state ------------------------------------------------------------------------

    def save_state_rank(self) -> RankState:
        """This rank's loader state: valid at any moment, cheap, never blocks on a busy worker.

        Before the first batch, mid-epoch, after the last batch of an epoch, between
        epochs and right after a restore. Saving twice without iterating gives equal
        states.

        Thread-safe: a checkpoint thread may save while the training thread iterates. The
        state is the position between two yielded items (all items yielded before the
        save started, possibly some yielded while it ran); while a save runs, the
        iterating thread waits before booking its next item. Example::

            threading.Thread(target=lambda: save_file(path, loader.save_state_rank())).start()

        After an iteration failed (a worker died, hung or raised), its position is lost
        with it: saving raises :class:`LoaderUsageError` until the next ``iter()``; restore
        a new loader from a state saved before the failure.
        """
        with self._state_lock:
            if self._failed is not None:
                raise LoaderUsageError(
                    f"cannot save: the loader's last iteration failed ({self._failed}) and its position was "
                    "lost with it; restore a new loader from a state saved before the failure "
                    "(or call iter() to start the next epoch)"
                )
            return self._save_state_rank()

    def _save_state_rank(self) -> RankState:
        mode = self._mode
        position: IndexPosition | PipelinePosition
        if mode.kind == "pipeline":  # asks workers: deliver worker-death signals here
            torch_iter = self._torch_iter
            try:
                with loader_call():
                    position = mode.save(getattr(torch_iter, "_workers", None), self.save_timeout)
            except RuntimeError as e:
                if isinstance(e, SavableLoaderError):
                    raise
                raise self._translate(e, torch_iter) from e
        else:  # main-process bookkeeping only: microseconds
            position = mode.save()
        return RankState(
            config=mode.loader_config(self.num_workers), position=position, library_version=__version__
        )

    def restore_state_rank(self, state: RankState) -> None:
        """Restore a state from :meth:`save_state_rank` before iterating.

        The next ``iter()`` continues the saved epoch; later ones start the next epochs.
        A changed ``num_workers`` is honoured on the drop-in path; other changes the
        loader cannot honour raise :class:`ConfigMismatchError` naming the field.
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
        if self._torch_iter is not None:
            raise LoaderUsageError("cannot restore a loader while it is iterating; restore before iter()")
        self._failed = None
        if self.persistent_workers and self._iterator is not None:
            raise LoaderUsageError("cannot restore a loader whose persistent workers already run; build a new loader")
        mode = self._mode
        expected = IndexPosition if mode.kind == "index" else PipelinePosition
        if not isinstance(position, expected):
            raise StateError(
                f"the state was saved by a {'pipeline' if isinstance(position, PipelinePosition) else 'drop-in'} "
                f"loader, this loader is a {'drop-in' if mode.kind == 'index' else 'pipeline'} loader"
            )
        if elastic:
            position = mode.check(state.config, position, self.num_workers, elastic=True)  # type: ignore[call-arg, arg-type]
        else:
            position = mode.check(state.config, position, self.num_workers)  # type: ignore[arg-type]
        mode.restore(position)  # type: ignore[arg-type]
        if mode.kind == "pipeline":
            warn_replays(mode.torch_dataset.dataset, position)  # type: ignore[union-attr, arg-type]
            self._roles_change = self._iterable is not None and position.next_worker != 0  # type: ignore[union-attr]

    def _restore_resized(self, states: list[RankState], world_size: int) -> None:
        if self._mode.kind != "index":
            raise ConfigMismatchError(
                "world_size", len(states), world_size,
                "a savable pipeline's state is split per rank and worker: restore it on the same world size",
            )
        self._restore(states[0], elastic_position(states, world_size), elastic=True)

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

        Drop-in path: states saved on ``W`` ranks restore on any other world size
        ``W'``. The rest of the interrupted epoch — every sample no old rank had
        consumed — is shared among the new ranks, each exactly once (shares differ by at
        most one sample), and later epochs are ordinary ``W'``-rank epochs. A savable
        pipeline refuses another world size with :class:`ConfigMismatchError`, as does a
        list that does not hold one state per old rank.
        """
        group = DataParallelGroup(self.worker_config)
        resize_ok = self._mode.kind == "index"
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
        dataset and seed (drop-in path: ``num_workers``, rank and world size may differ;
        savable pipelines: the same rank, world size and ``num_workers``, since sources
        split the data by them). Savable pipelines rebuild when every dataset of the
        pipeline supports it (``dataset.can_restore_sample()``;
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
        sample = self._mode.restore_sample(key)
        if self._mode.kind == "pipeline":
            sample = self.collate_fn.collate(sample)
        return sample

    def _state_key(self) -> str:
        return f"dp_rank_{self.worker_config.rank}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's state under torch's name, as ``{"dp_rank_<r>": <MessagePack bytes>}``.

        Keyed by data-parallel rank so that ``torch.distributed.checkpoint`` stores each
        rank's entry (values under one key would be de-duplicated as replicated); safe with
        ``torch.load(weights_only=True)``. Makes the loader a DCP ``Stateful``.
        """
        return {self._state_key(): encode(self.save_state_rank())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (this rank's entry)."""
        key = self._state_key()
        if not isinstance(state_dict, dict) or key not in state_dict:
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__qualname__
            raise StateError(f"load_state_dict needs the entry {key!r} made by state_dict(), found {found}")
        data = state_dict[key]
        if isinstance(data, torch.Tensor):
            data = data.numpy().tobytes()
        if isinstance(data, io.BytesIO):
            data = data.getvalue()
        state = decode(data)
        if isinstance(state, list):
            raise StateError("load_state_dict got a gathered state of several ranks")
        self.restore_state_rank(state)
