"""What the loader asks of a path: a :class:`Mode` per loader, an :class:`Iteration` per
``iter(loader)``.

:class:`~savable_loader.SavableDataLoader` is wiring and bookkeeping. At construction
it chooses one mode (the loader's own order over a map-style dataset, a sampler of the
user's, or a savable pipeline); for each ``iter()`` the mode starts an iteration, which
books the items torch's iterator delivers and knows its position at any moment. The
loader keeps the iterations' fates (live, abandoned, finished, failed) and decides which
one a save describes (see ``_iterator.py``).

Example (what the loader does for one ``iter()``)::

    iteration = mode.begin(epoch, resume=None, reuse_workers=False)
    for item in torch_iterator:
        payload = iteration.on_item(item)        # SKIP for protocol items
    iteration.end(finished=True, keep_workers=False)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from savable_loader.state.schema import (
    IndexPosition,
    LoaderConfig,
    PipelinePosition,
    RankState,
    RestoreKey,
)

__all__ = ["NO_SCOPE", "SKIP", "Iteration", "Mode", "Position"]

Position = IndexPosition | PipelinePosition

#: Returned by :meth:`Iteration.on_item` for protocol items that are not yielded.
SKIP = object()

#: What :meth:`Iteration.caller_scope` returns where nothing loads in the caller's process.
NO_SCOPE: AbstractContextManager[None] = nullcontext()


class Iteration(ABC):
    """The main-process bookkeeping of one ``iter(loader)``.

    ``epoch`` is the epoch it runs, ``resumed`` whether it continues a restored position.
    """

    epoch: int
    resumed: bool

    @abstractmethod
    def on_item(self, item: Any) -> Any:
        """Book an item torch's iterator delivered; the payload to yield, or ``SKIP``."""

    @abstractmethod
    def on_error(self, error: BaseException) -> bool:
        """Book an exception torch's iterator raised for one item. True: that item counts
        as consumed and the iteration can go on (as torch's does); False: the iteration
        cannot go on and its position is lost."""

    @abstractmethod
    def position(self, held: int = 0) -> Position:
        """Where the iteration is: everything yielded so far counts as consumed, except
        the last ``held`` items, which the caller fetched ahead and still holds (a
        framework's prefetch: see ``integrations/lightning.py``). Never waits
        on a worker. Raises ``StateError`` if the position before the ``held`` items is
        not known."""

    @abstractmethod
    def end(self, finished: bool, keep_workers: bool) -> None:
        """The iteration is over: ``finished`` (StopIteration) or abandoned/failed.
        ``keep_workers``: persistent workers stay for the next iteration."""

    def caller_scope(self) -> AbstractContextManager[Any]:
        """The block each ``next()`` runs torch's iterator in. Where the iteration's items
        are made in the caller's process by code that reaches the global RNGs (a pipeline
        with ``num_workers=0``), it sets the caller's streams aside for the whole batch
        (once per ``next()``, not once per item); elsewhere it does nothing."""
        return NO_SCOPE

    def workers_reusable(self) -> bool:
        """Whether persistent workers may run the next iteration once this one is over
        (False: they are restarted)."""
        return True

    def logical(self, physical: int) -> int:
        """The logical worker physical worker ``physical`` plays (pipelines rotate)."""
        return physical

    @abstractmethod
    def remaining(self) -> int | None:
        """Items still to come in this iteration (None if unknown)."""


class Mode(ABC):
    """One loader's path: its torch-side objects, iterations, states and restore keys."""

    #: The position type this mode saves and restores.
    position_type: type
    #: How messages name the path (``"drop-in"``, ``"pipeline"``).
    path_name: str
    #: Whether a state can move to another world size (``restore_state_global``), and
    #: why not (the hint of the ``ConfigMismatchError``).
    resizable: bool = False
    fixed_world_size: str = ""
    #: Whether the seed was given (a restore then checks it) or drawn (a restore adopts
    #: the state's seed).
    seed_explicit: bool = True
    #: Fingerprint of the dataset configuration (restore keys carry it).
    fingerprint: str
    #: The per-item seed formula (``savable_loader.rng.SEED_FORMULA``).
    seed_formula: int

    def resized(self, states: list[RankState], world_size: int, num_workers: int) -> tuple[RankState, Any]:
        """The state to check and the position to restore when the gathered ``states`` of
        another world size are restored on ``world_size`` ranks (``resizable`` modes)."""
        from savable_loader._elastic import elastic_position

        return states[0], elastic_position(states, world_size)

    @abstractmethod
    def engine_kwargs(self) -> dict[str, Any]:
        """``dataset``, ``sampler``, ``batch_size`` and ``collate_fn`` of the private
        ``torch.utils.data.DataLoader`` that runs the workers."""

    @abstractmethod
    def begin(self, epoch: int, resume: Any, reuse_workers: bool) -> Iteration:
        """Start an iteration of ``epoch``, from ``resume`` (a checked position) or from
        the epoch's start. ``reuse_workers``: persistent workers already run."""

    @abstractmethod
    def start_position(self, epoch: int) -> Position:
        """The position of ``epoch``'s start (a save between epochs)."""

    @abstractmethod
    def loader_config(self, num_workers: int) -> LoaderConfig:
        """The configuration a state records."""

    @abstractmethod
    def check(self, saved: LoaderConfig, position: Any, num_workers: int, elastic: bool = False) -> Any:
        """Raise ``ConfigMismatchError`` for a change this mode cannot honour; the
        position to restore."""

    @abstractmethod
    def restore_key(self, seed: int) -> RestoreKey | None:
        """The key of the item yielded last (None before the first)."""

    @abstractmethod
    def restore_sample(self, key: RestoreKey) -> Any:
        """The item ``key`` names, rebuilt in this process."""

    @abstractmethod
    def restored(self) -> None:
        """A state was restored: forget the item yielded last."""

    def show_restored(self, position: Any) -> None:
        """A state was restored at ``position``: let the objects the caller sees (a
        sampler's ``epoch``) show it before the next ``iter()``."""

    @abstractmethod
    def remaining(self, position: Any) -> int | None:
        """Items an iteration resumed from ``position`` yields (None if unknown)."""

    def adopt(self, seed: int, seed_formula: int) -> None:
        """Take the seed and seed formula of a restored state."""
        self.seed_formula = seed_formula

    def reconcile(self, position: Any, own_epochs: bool) -> tuple[Any, int]:
        """Before the first iteration after a restore: the position to resume (None: start
        the epoch afresh) and the epoch to run, given what the caller set since the
        restore (a sampler of the user's may have been moved to another epoch;
        ``own_epochs``: an integration said that a framework's count of its own did it,
        e.g. Fabric's per-process one)."""
        return position, position.epoch

    def finish_rest(self, position: Any) -> None:
        """The restored ``position``'s remainder, which is empty, is skipped (``set_epoch``
        of the next epoch): bring the order's own state to that epoch's end."""

    def concurrent(self, persistent: bool, num_workers: int) -> bool:
        """Whether two iterations may run side by side (else a new one supersedes the
        live one). Persistent workers are one pool: torch resets its single iterator."""
        return not persistent

    def reuses_epochs(self, persistent: bool) -> bool:
        """Whether an abandoned side iteration may give its epoch number back."""
        return True

    def workers_reusable(self) -> bool:
        """Whether running persistent workers may start the next epoch (else the loader
        starts new ones, which take the next epoch's plan)."""
        return True
