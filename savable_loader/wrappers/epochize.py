"""EpochizeDataset: fixed-length epochs cut from one long stream."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from savable_loader.config import _ActiveWorker, active_repetitions
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["EpochizeDataset", "EpochizeReplayWarning"]


_END = object()


class EpochizeReplayWarning(UserWarning):
    """An ``EpochizeDataset`` replayed inner samples to rebuild an epoch's start.

    Example::

        warnings.filterwarnings("ignore", category=EpochizeReplayWarning)
    """


class EpochizeDataset(BaseWrapperDataset):
    """Yields ``length`` samples per rank and epoch, continuing the same inner stream.

    Unlike ``LimitDataset``, which starts its dataset over every epoch, epoch ``e + 1``
    goes on where epoch ``e`` stopped: over an endless stream (``RepeatDataset``, a
    long shard stream), epoch ``e`` is samples ``e * length`` to ``(e + 1) * length`` of
    it. ``length`` is split across the rank's workers like ``LimitDataset``'s (worker
    ``w`` of ``W`` takes ``length // W``, plus one if ``w < length % W``).

    How the inner position crosses an epoch boundary: the loader resets the whole
    pipeline at the start of every epoch (``reset_state_deep()``); this wrapper resets
    only its own counter there and keeps the inner dataset as it was at the end of the
    previous epoch. The same object goes on with its live iterator when it ran that epoch
    for the same logical worker (in-process loading, persistent workers). A fresh worker
    process (``persistent_workers=False``, or a restore) goes on from the worker's state
    at the previous epoch's end: each worker sends that state with its end of epoch
    (``carries_across_epochs``), the main process keeps it (also in the states it saves
    between epochs and early in the next one, as ``WorkerState.carried``) and hands it to
    the next epoch's worker, which restores it before the epoch starts. (Persistent
    workers that a restore started rotated, so that they play other logical workers than
    the next epoch's, are replaced by new ones for that epoch.) Nothing is replayed,
    whatever the number of epochs.

    Only when no such state exists — an abandoned (``break``) epoch, a state saved
    between epochs by an earlier version — it rebuilds the inner position deterministically: it resets the inner
    dataset as in epoch 0 and replays ``e`` epochs' worth of inner samples before
    yielding (``replayed`` counts them; an ``EpochizeReplayWarning`` says so). The replay
    is exact when the inner pipeline's state does not depend on global random draws other
    than those re-seeded by restore keys (keyed sources, the library's wrappers).
    Mid-epoch states hold the inner state itself and need no replay.

    If the inner stream ends, the epoch ends early and the next epoch starts the inner
    dataset over (a new pass); an inner stream that ends exactly at an epoch
    boundary is started over at once, so an epoch is empty only if the inner dataset is.

    The inner stream lives in its own epochs: it runs (and is reset, and rebuilds samples)
    with the *pass number* as its active epoch (0, then 1 after it ended and started
    over, ...), not the loader's epoch, because buffered samples of one stream cross
    loader epochs. Sources seeded from ``epoch_seed()`` are thus shuffled anew per pass.
    Restore keys are ``[inner pass, inner key]``.

    Example::

        ds = EpochizeDataset(RepeatDataset(source), length=10_000)   # 10k-sample epochs
    """

    _savable_fields = ("count", "ended", "passes")
    carries_across_epochs = True

    def __init__(self, dataset: SavableDataset, length: int) -> None:
        super().__init__(dataset)
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise LoaderUsageError(f"EpochizeDataset length must be a non-negative int, got {length!r}")
        self.length = length
        self._inner_it: Iterator[Any] | None = None
        # (logical worker, epoch, enclosing repetitions) whose start the live inner state
        # is at, if any. The repetitions count: inside a RepeatDataset the inner state was
        # built under the pass's seeds, which a rebuild at the loader's epoch start (no
        # pass) would not reproduce, so the carry only serves a reset in the same context.
        self._carry: tuple[int, int, tuple[int, ...]] | None = None
        #: Inner samples this object replayed to rebuild epoch starts (not state).
        self.replayed = 0
        self.passes = 0
        self.reset_state_own()

    def reset_state_own(self) -> None:
        # ``passes`` is not reset here: it goes on across epochs (set in reset_state_deep)
        self.count = 0
        self.ended = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_inner_it"] = None  # a live generator does not cross processes
        state["_carry"] = None
        return state

    def worker_length(self) -> int:
        """The number of samples the calling worker yields per epoch."""
        workers = self.worker_config.workers_per_rank
        worker = self.worker_config.rank_worker_id()
        return self.length // workers + (1 if worker < self.length % workers else 0)

    def _inner_context(self, passes: int | None = None) -> _ActiveWorker:
        """The inner stream runs in its own epochs: its pass numbers, not the loader's."""
        return _ActiveWorker(self.worker_config.rank_worker_id(), self.passes if passes is None else passes)

    # -- epoch boundaries ---------------------------------------------------------------

    def reset_state_deep(self) -> None:
        """Start the active epoch: keep the inner position if it is this epoch's start,
        otherwise rebuild it (see the class docstring)."""
        wc = self.worker_config
        worker, epoch = wc.rank_worker_id(), wc.active_epoch()
        if self._carry == (worker, epoch, active_repetitions()):
            self._carry = None
            self._begin_epoch()
            return
        self._carry = None
        self._inner_it = None
        self.passes = 0
        with self._inner_context():
            self.dataset.reset_state_deep()
        self.reset_state_own()
        replayed = 0
        for past in range(epoch):
            with _ActiveWorker(worker, past):
                self._begin_epoch()
                for _ in self._run():
                    replayed += 1
        self._carry = None
        self._begin_epoch()
        self.replayed += replayed
        if replayed:
            warnings.warn(
                f"EpochizeDataset replayed {replayed} inner samples to rebuild the start of epoch {epoch} "
                f"for worker {worker}: no end state of epoch {epoch - 1} was at hand (an abandoned epoch, "
                "or a state saved between epochs by an earlier version)",
                EpochizeReplayWarning,
                stacklevel=2,
            )

    def restore_state(self, state: Any) -> None:
        self._inner_it = None
        self._carry = None
        super().restore_state(state)
        if state is not None and (self.ended or self.count >= self.worker_length()):
            # the state of a finished epoch (a carried end state): the next epoch goes on
            # from it, as after running that epoch here
            self._set_carry()

    def _restart_inner(self) -> None:
        self._inner_it = None
        self.passes += 1
        with self._inner_context():
            self.dataset.reset_state_deep()

    def _begin_epoch(self) -> None:
        if self.ended:  # the inner stream ended last epoch: start it over in this one
            self._restart_inner()
        self.reset_state_own()

    # -- iteration ----------------------------------------------------------------------

    def _run(self) -> Iterator[Any]:
        limit = self.worker_length()
        inner = self.dataset
        restarted = False
        while self.count < limit and not self.ended:
            with self._inner_context():
                if self._inner_it is None:
                    self._inner_it = iter(inner)
                try:
                    sample = next(self._inner_it)
                except StopIteration:
                    sample = _END
            if sample is _END:
                self._inner_it = None
                if self.count == 0 and not restarted:
                    restarted = True  # ended right at the boundary: start over now
                    self._restart_inner()
                    continue
                self.ended = True
                break
            self.count += 1
            key = inner.sample_key
            self.sample_key = None if key is None else [self.passes, key]
            if self.count >= limit:  # valid even if nobody pulls again after this sample
                self._set_carry()
            yield sample
        self._set_carry()

    def _set_carry(self) -> None:
        wc = self.worker_config
        self._carry = (wc.rank_worker_id(), wc.active_epoch() + 1, active_repetitions())

    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def restore_sample(self, key: Any) -> Any:
        """The sample of inner pass ``key[0]`` whose inner key is ``key[1]``."""
        if not isinstance(key, (list, tuple)) or len(key) != 2 or not isinstance(key[0], int) or key[0] < 0:
            raise RestoreKeyError(f"EpochizeDataset key must be [inner pass, inner key], got {key!r}")
        with self._inner_context(key[0]):
            return self.dataset.restore_sample(key[1])

    def config(self) -> dict[str, Any]:
        return {"length": self.length}
