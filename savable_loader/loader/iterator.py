"""The iterators ``iter(SavableDataLoader)`` returns, and the fates of the iterations.

Each ``iter(loader)`` gets a :class:`SavableIterator` and the loader keeps a
:class:`Record` of its iteration: ``LIVE`` while it can still yield, then ``FINISHED``
(it raised StopIteration), ``ABANDONED`` (closed, dropped, garbage-collected, or
superseded by a later ``iter()``), ``FAILED`` (a worker died or hung, or the path cannot
go on after an error), or ``FORGOTTEN`` (an abandoned side iteration that gave its epoch
number back, see below).

The rules (docs/concepts.md, "What a state means"; torch's behaviour where users know it):

* Every iteration starts the next epoch, except the first one after a restore, which
  continues the restored position. An iteration begins at its iterator's first
  ``next()``: an iterator that was never advanced consumes nothing (frameworks call
  ``iter()`` and may drop the result).
* Iterations are independent where torch's are (a non-persistent loader: ``zip(loader,
  loader)``, a peek ``next(iter(loader))`` inside a loop). Persistent workers are one
  pool and torch resets its single iterator: a new iteration supersedes the live one,
  whose next ``next()`` raises :class:`~savable_loader.errors.LoaderUsageError` (a
  savable pipeline loading in the main process works the same way).
* An iteration started while another was live, and abandoned before its end while no
  later iteration started (a peek), gives its epoch number back: the next loop does not
  skip an epoch, and saves ignore it.
* A save describes the most recent iteration: its live position, the position where it
  was abandoned (a restored loader's first ``iter()`` continues it, while this loader's
  next ``iter()`` starts the next epoch, as torch's does), or the start of the next
  epoch after it finished. If another iteration is still live the choice would be
  ambiguous: the save raises ``LoaderUsageError``. After an iteration failed, the save
  raises too (until the next ``iter()``).
* An exception the dataset or the collate function raised for one batch propagates as
  torch's does; the batch counts as consumed and the iterator goes on with the next
  batch if called again. Dead and hung workers end the iteration (``FAILED``).
"""

from __future__ import annotations

import atexit
import enum
import weakref
from collections.abc import Iterator
from time import perf_counter
from typing import Any, Generic, Protocol, TypeVar

from savable_loader._torch.internals import worker_processes
from savable_loader.core.engine import Iteration

__all__ = ["Fate", "Record", "SavableIterator"]

T_co = TypeVar("T_co", covariant=True)

#: torch iterators of live iterations. Keeping them reachable from here means that an
#: iteration abandoned inside a reference cycle does not take torch's worker queues into
#: the cycle collector, which could finalise them before our iterator's ``__del__`` sends
#: the workers their stop signal (then each worker is killed after a 5 s timeout).
RUNNING: dict[int, Any] = {}

#: Iterators whose iteration has begun, closed at interpreter exit (:func:`_close_at_exit`).
_BEGUN: weakref.WeakSet[SavableIterator[Any]] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Abandon every live iteration while the interpreter is whole (``atexit`` runs
    before modules are torn down).

    An iterator still referenced at exit (a module global, as nanochat keeps its loader)
    holds its iteration: in process, the pipeline's generators and the tensors in their
    frames and buffers, reachable from :data:`RUNNING`. Left alone, all of it goes to the
    interpreter's last cycle collection together with the modules, which clears objects
    in no particular order; torch aborts the process (``THPVariable_clear``: ``INTERNAL
    ASSERT FAILED``, exit code 134) when it clears a tensor whose C++ side another object
    still shares. Closed here (worker processes are stopped as on any abandon) and let go
    of (the torch iterator, which holds the in-process generators), the iteration is
    freed by reference counting, in order, its generators' ``finally`` clauses running
    while the modules they use are still there.
    """
    for it in list(_BEGUN):
        try:
            it.close()
        except Exception:  # noqa: BLE001, S112 - never raise at exit; close the others
            continue
        finally:
            record = it._record
            if record is not None:
                record.torch_iter = None


class Fate(enum.Enum):
    """What became of an iteration."""

    LIVE = "live"
    FINISHED = "finished"
    ABANDONED = "abandoned"
    FAILED = "failed"
    FORGOTTEN = "forgotten"


class Record:
    """One ``iter(loader)``: its iteration, fate and (once abandoned) position."""

    __slots__ = ("beside", "error", "failure", "fate", "iteration", "position", "serial", "stale", "torch_iter")

    def __init__(self, iteration: Iteration, serial: int, beside: bool) -> None:
        self.iteration = iteration
        self.serial = serial  # the n-th iter() of the loader
        self.beside = beside  # another iteration was live when it started
        self.fate = Fate.LIVE
        self.stale = False  # superseded by a later iter()
        self.position: Any = None  # where it was abandoned
        self.error: Exception | None = None  # why that position could not be taken
        self.failure: str | None = None  # why it failed
        self.torch_iter: Any = None


class Driver(Protocol):
    """What an iterator asks of its loader's bookkeeping (``loader/iterations.py``)."""

    def begin(self, called_at: float) -> Record: ...

    def next(self, record: Record, called_at: float) -> Any: ...

    def end(self, record: Record, fate: Fate) -> None: ...

    def __len__(self) -> int: ...


class SavableIterator(Iterator[T_co], Generic[T_co]):
    """What ``iter(SavableDataLoader)`` returns: the batches of one epoch.

    The iteration begins at the first ``next()`` (an iterator never advanced takes no
    epoch and starts no workers, and a save ignores it). ``close()`` abandons the
    iteration (as dropping the iterator does); ``epoch`` is the epoch it runs. Example::

        it = iter(loader)
        first = next(it)
        it.close()                      # a save now records the position after `first`
    """

    def __init__(self, driver: Driver, owner: Any) -> None:
        self._driver = driver
        self._owner = owner  # the SavableDataLoader, kept alive while its iterator is
        self._record: Record | None = None
        self._closed = False

    def __iter__(self) -> SavableIterator[T_co]:
        return self

    def _started(self, called_at: float | None = None) -> Record:
        if self._record is None:
            if self._closed:
                raise StopIteration
            self._record = self._driver.begin(perf_counter() if called_at is None else called_at)
            _BEGUN.add(self)
        return self._record

    def __next__(self) -> T_co:
        called = perf_counter()  # (the loop waits from here: loader.stats())
        return self._driver.next(self._started(called), called)

    def close(self) -> None:
        """Abandon the iteration: later ``next()`` calls raise StopIteration. Closing
        again does nothing (a generator wrapping the iterator may close it at exit,
        after :func:`_close_at_exit` did)."""
        if self._closed:
            return
        self._closed = True
        if self._record is not None:
            self._driver.end(self._record, Fate.ABANDONED)

    @property
    def epoch(self) -> int:
        """The epoch this iteration runs (begins the iteration if needed)."""
        return self._started().iteration.epoch

    @property
    def _workers(self) -> list[Any]:
        """The worker processes of this iteration (torch's iterator attribute; begins the
        iteration if needed, as torch's iterator has its workers from the start)."""
        return worker_processes(self._started().torch_iter)

    def __len__(self) -> int:
        return len(self._driver)

    def __del__(self) -> None:
        try:
            record = self._record
            if record is not None and record.fate is Fate.LIVE:
                self.close()
        except Exception:  # noqa: BLE001, S110 - never raise from a finaliser (or at shutdown)
            pass


atexit.register(_close_at_exit)
