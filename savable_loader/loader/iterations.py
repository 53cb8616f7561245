"""A loader's iterations and restored position: what ``next()``, a save and a restore do.

``SavableDataLoader`` holds one :class:`Iterations`. Each ``iter(loader)`` returns a
:class:`~savable_loader.loader.iterator.SavableIterator` whose first ``next()`` begins an
iteration here (a :class:`~savable_loader.loader.iterator.Record`); the record keeps the
engine's :class:`~savable_loader.core.engine.Iteration`, torch's iterator and the
iteration's fate. A save describes the most recent iteration (:meth:`Iterations.describe`);
a restore leaves a position that the next iteration continues
(:meth:`Iterations.restore`). One lock orders saves against the booking of items, so a
checkpoint thread may save while the training thread iterates.

Example (what the loader's methods call)::

    called = time.perf_counter()
    record = iterations.begin(called)    # the first next() of an iterator
    batch = iterations.next(record, called)
    position = iterations.describe()     # a save
"""

from __future__ import annotations

import threading
import weakref
from time import perf_counter
from typing import Any

from savable_loader._torch.internals import loader_iterator, next_batch, set_loader_iterator, shutdown_workers
from savable_loader.core.engine import SKIP, Mode
from savable_loader.errors import LoaderUsageError, SavableLoaderError, WorkerError, WorkerTimeoutError
from savable_loader.loader.failures import terminate_worker, translate_worker_error
from savable_loader.loader.iterator import RUNNING, Fate, Record
from savable_loader.loader.sigchld import install, loader_call
from savable_loader.rng.formulas import engine_generator_seed
from savable_loader.state.schema import RankState
from savable_loader.stats.recorder import Recorder

__all__ = ["Iterations"]


class Iterations:
    """The iterations of one loader (``loader``: its ``SavableDataLoader``; ``mode``: its
    engine; ``engine``: the private torch DataLoader running the workers)."""

    def __init__(self, loader: Any, mode: Mode[Any], engine: Any, recorder: Recorder | None = None) -> None:
        # weak: the loader holds this object, and a loader in a reference cycle would take
        # its persistent workers' queues to the cycle collector (see ``iterator.RUNNING``);
        # its iterators hold it strongly. What ending an iteration needs is kept here, so
        # that an iteration ended by the cycle collector stops its workers all the same.
        self._loader = weakref.ref(loader)
        self.num_workers: int = loader.num_workers
        self.persistent = bool(loader.persistent_workers and loader.num_workers > 0)
        self.timeout: float = loader.timeout
        self.seed: int = loader.seed  # the loader's (a restore may adopt the state's)
        self.mode = mode
        self.engine = engine
        # Held by a save for its whole duration and by the iterating thread while it books
        # an item, so that a save from another thread sees one consistent position.
        self.lock = threading.RLock()
        self.records: list[Record] = []
        self.started = 0  # iter() calls
        self.next_epoch = 0
        self.pending: Any = None  # a restored position the next iteration continues
        self.restored = False  # a state was restored
        #: Set by an integration whose framework calls the samplers' ``set_epoch`` with a
        #: count of its own (Fabric's per-process one): the loader's count is used instead.
        self.own_epochs = False
        #: The loader's statistics (``loader.stats()``; None with ``record_stats=False``).
        self.recorder = recorder

    @property
    def loader(self) -> Any:
        """The loader (alive while it or one of its iterators is referenced)."""
        return self._loader()

    # -- what an iterator asks (loader.iterator.Driver) ---------------------------------

    def __len__(self) -> int:
        return len(self.loader)

    def live(self) -> list[Record]:
        return [r for r in self.records if r.fate is Fate.LIVE]

    def begin(self, called_at: float) -> Record:
        """Begin an iteration (the first ``next()`` of a SavableIterator, called at
        ``called_at``: ``time.perf_counter()``)."""
        with self.lock:
            mode, persistent, workers = self.mode, self.persistent, self.num_workers
            live = self.live()
            if live and not mode.policy(persistent, workers).concurrent:
                for record in live:  # torch resets its single iterator: the old one is stale
                    record.stale = True
                    self.end(record, Fate.ABANDONED)
                live = self.live()
            resume = self.pending
            if resume is not None:
                resume, epoch = mode.reconcile(resume, self.own_epochs)
            else:
                epoch = self.next_epoch
            if resume is None and mode.samplers and self.own_epochs:
                # the framework set its own count (Fabric's, 0 again after a resume): use the
                # epoch an uninterrupted run has here, as the loader's own order does
                self.set_sampler_epochs(epoch)
            reuse = persistent and loader_iterator(self.engine) is not None
            if reuse and not mode.policy(persistent, workers).workers_reusable:  # (see PipelineMode.policy)
                self.shutdown(loader_iterator(self.engine))
                reuse = False
            iteration = mode.begin(epoch, resume, reuse)
            if self.recorder is not None:
                iteration.recorder = self.recorder
                if not live:  # (a peek or a zip() beside a live iteration keeps the window)
                    self.recorder.begin(epoch, called_at)
            self.pending = None
            self.next_epoch = epoch + 1
            self.started += 1
            record = Record(iteration, self.started, beside=bool(live))
            self.records = [*self.live(), record]
            self.engine.generator.manual_seed(engine_generator_seed(self.seed, epoch))
            try:
                with loader_call():
                    torch_iter = iter(self.engine)
            except Exception as e:
                record.failure = f"{type(e).__name__}: {e}"
                self.end(record, Fate.FAILED)
                raise
            record.torch_iter = torch_iter
            RUNNING[id(record)] = torch_iter
            if self.num_workers > 0:
                install()
        return record

    def next(self, record: Record, called_at: float) -> Any:
        """The next payload of ``record``'s iteration (called by its SavableIterator at
        ``called_at``: ``time.perf_counter()``, the start of the loop's wait)."""
        if record.fate is not Fate.LIVE:
            if record.stale:
                raise LoaderUsageError(
                    f"this iterator (epoch {record.iteration.epoch}) was superseded by a later iter(loader): "
                    + (
                        "persistent workers are one pool, and torch resets its single iterator"
                        if self.persistent
                        else "a savable pipeline in the main process runs one iteration at a time"
                    )
                    + "; use the newest iterator"
                )
            raise StopIteration
        torch_iter = record.torch_iter
        iteration = record.iteration
        recorder = self.recorder
        while True:
            try:
                with loader_call(), iteration.caller_scope():
                    item = next_batch(torch_iter)
            except StopIteration:
                if recorder is not None:
                    recorder.waited(called_at)
                self.end(record, Fate.FINISHED)
                raise
            except Exception as e:  # noqa: BLE001 - one batch's error or the iteration's end: _on_error raises
                self._on_error(record, e)
            with self.lock:
                payload = iteration.on_item(item)
            if payload is not SKIP:
                if recorder is not None:
                    if recorder.plain:  # (Recorder.yielded then, sparing a call per item)
                        recorder.wait_sum += perf_counter() - called_at
                        recorder.step_count += 1
                    else:
                        recorder.yielded(called_at)
                return payload

    def _on_error(self, record: Record, error: Exception) -> None:
        """An exception from torch's iterator: one batch's (the iteration goes on), or
        the end of the iteration (a worker died or hung; an engine that cannot go on)."""
        torch_iter = record.torch_iter
        translated = translate_worker_error(error, torch_iter, record.iteration.logical, self.timeout)
        with self.lock:
            goes_on = not isinstance(translated, WorkerError) and record.iteration.on_error(error)
        if goes_on:
            raise error
        record.failure = f"{type(translated).__name__}: {str(translated).splitlines()[0] if str(translated) else ''}"
        if isinstance(translated, WorkerTimeoutError):
            terminate_worker(torch_iter, record.iteration.logical, translated.worker_id)
        self.end(record, Fate.FAILED)
        if translated is error:
            raise error
        raise translated from error

    def end(self, record: Record, fate: Fate) -> None:
        """``record``'s iteration is over; stop its workers unless they persist."""
        failure: Exception | None = None
        persistent = self.persistent
        with self.lock:
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
            keep = persistent and fate is not Fate.FAILED and iteration.workers_reusable()
            try:
                iteration.end(finished=fate is Fate.FINISHED, keep_workers=keep)
            except Exception as e:  # noqa: BLE001 - after the workers are stopped
                failure = e
            if (
                fate is Fate.ABANDONED
                and record.beside
                and record.serial == self.started
                and not iteration.resumed
                and self.next_epoch == iteration.epoch + 1
                and self.mode.policy(persistent, self.num_workers).reuses_epochs
            ):
                record.fate = Fate.FORGOTTEN  # a peek: the next loop runs this epoch
                self.next_epoch = iteration.epoch
                self.records.remove(record)
        RUNNING.pop(id(record), None)
        if self.recorder is not None:
            self.recorder.end()
        if fate is Fate.FAILED or (fate is Fate.ABANDONED and not persistent) or (persistent and not keep):
            self.shutdown(record.torch_iter)
        # An iteration abandoned inside a garbage cycle may find its pipes finalised
        # first: nothing to report then, its workers are stopped all the same.
        if failure is not None and fate is not Fate.ABANDONED:
            raise failure

    def shutdown(self, torch_iter: Any) -> None:
        """Stop the workers of a failed or abandoned iteration now, rather than when the
        torch iterator is freed: an error's traceback holds it in a reference cycle, and
        when the cycle collector frees it, its queues may be finalised first, so that its
        workers never get the stop signal and are killed after a 5 s join timeout each."""
        shutdown_workers(torch_iter)
        if torch_iter is not None and loader_iterator(self.engine) is torch_iter:
            set_loader_iterator(self.engine, None)  # persistent workers: start new ones next time

    # -- epochs -----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration starts (see ``SavableDataLoader.set_epoch``)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise LoaderUsageError(f"set_epoch needs an int >= 0, got {epoch!r}")
        with self.lock:
            pending = self.pending
            if pending is not None and epoch != pending.epoch:
                left = self.mode.remaining(pending)
                if not (left == 0 and epoch == pending.epoch + 1):
                    raise LoaderUsageError(
                        f"set_epoch({epoch}): the restored state continues epoch {pending.epoch} "
                        f"({'an unknown number of' if left is None else left} batches left); set_epoch({pending.epoch}) "
                        "keeps it, or build a new loader to start another epoch"
                    )
                self.mode.finish_rest(pending)  # a sampler's generators: where the epoch's end left them
                self.pending = None
            if self.pending is None:
                self.next_epoch = epoch
        self.set_sampler_epochs(epoch)

    def set_sampler_epochs(self, epoch: int) -> None:
        """``set_epoch(epoch)`` of the user's samplers that have one."""
        for sampler in self.mode.samplers:
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def upcoming_epoch(self) -> int:
        """The epoch the next iteration starts or continues."""
        pending = self.pending
        return pending.epoch if pending is not None else self.next_epoch

    def remaining(self) -> int | None:
        """Items still to come (see ``SavableDataLoader.remaining``): in the most recent
        live iteration, or else in the restored position, or else a whole epoch."""
        with self.lock:
            live = self.live()
            if live:
                return live[-1].iteration.remaining()
            if self.pending is not None:
                return self.mode.remaining(self.pending)
        try:
            return len(self.loader)
        except TypeError:  # torch's: an IterableDataset without __len__
            return None

    # -- states -------------------------------------------------------------------------

    def describe(self, held: int = 0) -> Any:
        """The position a save records, leaving out the last ``held`` items of a live
        iteration (a framework fetched them ahead)."""
        mode = self.mode
        records = self.records
        if not records:
            return self.pending if self.pending is not None else mode.start_position(self.next_epoch)
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
        return mode.start_position(self.next_epoch)

    def restore(self, states: list[RankState], world_size: int | None = None) -> int:
        """Continue the position of ``[state]`` (or of the ``states`` of every rank of
        another world size, restored on ``world_size`` ranks) at the next iteration; the
        seed the loader runs with from now on (a drawn seed gives way to the state's)."""
        with self.lock:
            live = self.live()
            if live:
                raise LoaderUsageError(
                    f"cannot restore while an iteration of epoch {live[-1].iteration.epoch} is in progress: finish "
                    "it or close it (it.close(), del it) first"
                )
            position, self.seed = self.mode.restore(states, self.num_workers, self.seed, world_size)
            self.records = []
            self.pending = position
            self.restored = True  # its epoch count is the loader's from then on
            self.next_epoch = position.epoch + 1
            if loader_iterator(self.engine) is not None:  # persistent workers start anew
                self.shutdown(loader_iterator(self.engine))
        return self.seed
