"""The engine interface: a :class:`Mode` per loader, an :class:`Iteration` per
``iter(loader)``, both typed on the engine's position.

:class:`~savable_loader.SavableDataLoader` is wiring and bookkeeping. At construction it
chooses one engine (``loader/construction.py``): the loader's own order or a sampler of
the user's over a map-style dataset (``index/``, positions :class:`IndexPosition`), or a
savable pipeline or a plain iterable (``pipeline/``, positions
:class:`PipelinePosition`). For each ``iter()`` the engine begins an iteration, which
books the items torch's iterator delivers and knows its position at any moment; the
loader keeps the iterations' fates and decides which one a save describes
(``loader/iterations.py``). The loader reaches an engine only through the members of
:class:`Mode` listed under "The interface", never by its class or name.

Example (what the loader does for one ``iter()`` and a restore)::

    iteration = mode.begin(epoch, resume=None, reuse_workers=False)
    for item in torch_iterator:
        payload = iteration.on_item(item)        # SKIP for protocol items
    iteration.end(finished=True, keep_workers=False)
    position, seed = mode.restore([state], num_workers, seed)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, NamedTuple, TypeVar

from savable_loader.core.checks import check_state_formulas
from savable_loader.core.elastic import elastic_position
from savable_loader.errors import ConfigMismatchError, RestoreKeyError, StateError
from savable_loader.state.schema import (
    IndexPosition,
    LoaderConfig,
    PipelinePosition,
    RankState,
    RestoreKey,
)

__all__ = ["NO_SCOPE", "SKIP", "Iteration", "Mode", "Policy", "Position"]

Position = IndexPosition | PipelinePosition
P = TypeVar("P", IndexPosition, PipelinePosition)

#: Returned by :meth:`Iteration.on_item` for protocol items that are not yielded.
SKIP = object()

#: What :meth:`Iteration.caller_scope` returns where nothing loads in the caller's process.
NO_SCOPE: AbstractContextManager[None] = nullcontext()


class Policy(NamedTuple):
    """How an engine's iterations share the loader's workers (:meth:`Mode.policy`)."""

    #: two iterations may run side by side (else a new one supersedes the live one)
    concurrent: bool
    #: an abandoned side iteration (a peek) may give its epoch number back
    reuses_epochs: bool
    #: running persistent workers may start the next epoch (else new ones are started)
    workers_reusable: bool


class Iteration(ABC, Generic[P]):
    """The main-process bookkeeping of one ``iter(loader)``.

    ``epoch`` is the epoch it runs, ``resumed`` whether it continues a restored position.
    """

    epoch: int
    resumed: bool
    #: Where :meth:`on_item` hands the workers' reports that come with items (a
    #: ``stats.recorder.Recorder``, set by the loader when it records statistics).
    recorder: Any = None

    @abstractmethod
    def on_item(self, item: Any) -> Any:
        """Book an item torch's iterator delivered; the payload to yield, or ``SKIP``."""

    @abstractmethod
    def on_error(self, error: BaseException) -> bool:
        """Book an exception torch's iterator raised for one item. True: that item counts
        as consumed and the iteration can go on (as torch's does); False: the iteration
        cannot go on and its position is lost."""

    @abstractmethod
    def position(self, held: int = 0) -> P:
        """Where the iteration is: everything yielded so far counts as consumed, except
        the last ``held`` items, which the caller fetched ahead and still holds (a
        framework's prefetch: see ``integrations/lightning.py``). Never waits
        on a worker. Raises ``StateError`` if the position before the ``held`` items is
        not known."""

    @abstractmethod
    def end(self, finished: bool, keep_workers: bool) -> None:
        """The iteration is over: ``finished`` (StopIteration) or abandoned/failed.
        ``keep_workers``: persistent workers stay for the next iteration."""

    @abstractmethod
    def remaining(self) -> int | None:
        """Items still to come in this iteration (None if unknown)."""

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


class Mode(ABC, Generic[P]):
    """One loader's engine: its torch-side objects, iterations, states and restore keys.

    **The interface** (what the loader reads and calls; nothing else):
    :attr:`indexed`, :attr:`samplers`, :attr:`resizable`, :meth:`engine_kwargs`, :meth:`policy`,
    :meth:`begin`, :meth:`start_position`, :meth:`remaining`, :meth:`reconcile`,
    :meth:`finish_rest`, :meth:`loader_config`, :meth:`restore`, :meth:`restore_key`,
    :meth:`rebuild`.

    **What an engine provides besides** (called by :meth:`restore` and :meth:`rebuild`):
    the class attributes below, :meth:`check`, :meth:`adopt`, :meth:`show_restored`,
    :meth:`restored`, :meth:`resized` and :meth:`restore_sample`.
    """

    #: Map-style datasets read by index (``loader.sampler`` is a sampler of indices and
    #: ``len(loader)`` is known); False for pipelines and iterables.
    indexed: bool = True
    #: The user's samplers whose ``set_epoch`` the loader calls with its own.
    samplers: tuple[Any, ...] | list[Any] = ()
    #: The position type this engine saves and restores.
    position_type: type
    #: How messages name the engine (``"drop-in"``, ``"pipeline"``).
    path_name: str
    #: Whether a state can move to another world size (``restore_state_global``), and
    #: why not (the hint of the ``ConfigMismatchError``).
    resizable: bool = False
    fixed_world_size: str = ""
    #: Whether the seed was given (a restore then checks it) or drawn (a restore adopts
    #: the state's).
    seed_explicit: bool = True
    #: Fingerprint of the dataset configuration (restore keys carry it).
    fingerprint: str

    # -- the interface ------------------------------------------------------------------

    @abstractmethod
    def engine_kwargs(self) -> dict[str, Any]:
        """``dataset``, ``sampler``, ``batch_size`` and ``collate_fn`` of the private
        ``torch.utils.data.DataLoader`` that runs the workers."""

    def policy(self, persistent: bool, num_workers: int) -> Policy:
        """How iterations share the workers: persistent workers are one pool (torch resets
        its single iterator), so a new iteration supersedes the live one."""
        return Policy(concurrent=not persistent, reuses_epochs=True, workers_reusable=True)

    @abstractmethod
    def begin(self, epoch: int, resume: P | None, reuse_workers: bool) -> Iteration[P]:
        """Start an iteration of ``epoch``, from ``resume`` (a checked position) or from
        the epoch's start. ``reuse_workers``: persistent workers already run."""

    @abstractmethod
    def start_position(self, epoch: int) -> P:
        """The position of ``epoch``'s start (a save between epochs)."""

    @abstractmethod
    def remaining(self, position: P) -> int | None:
        """Items an iteration resumed from ``position`` yields (None if unknown)."""

    def reconcile(self, position: P, own_epochs: bool) -> tuple[P | None, int]:
        """Before the first iteration after a restore: the position to resume (None: start
        the epoch afresh) and the epoch to run, given what the caller set since the
        restore (a sampler of the user's may have been moved to another epoch;
        ``own_epochs``: an integration said that a framework's count of its own did it,
        e.g. Fabric's per-process one)."""
        return position, position.epoch

    def finish_rest(self, position: P) -> None:
        """The restored ``position``'s remainder, which is empty, is skipped (``set_epoch``
        of the next epoch): bring the order's own state to that epoch's end."""

    @abstractmethod
    def loader_config(self, num_workers: int) -> LoaderConfig:
        """The configuration a state records."""

    def restore(
        self, states: list[RankState], num_workers: int, seed: int, world_size: int | None = None
    ) -> tuple[P, int]:
        """Check and take a state: ``[state]`` of this rank, or (``world_size`` given)
        the states of every rank of another world size. The position the next iteration
        continues, and the seed the loader runs with (a drawn seed gives way to the
        state's). Raises ``StateError`` or ``ConfigMismatchError`` naming what differs."""
        for saved in states:  # (before a resize replays any of them)
            check_state_formulas(saved.config)
        if world_size is None:
            state, position = states[0], states[0].position
        elif not self.resizable:
            raise ConfigMismatchError("world_size", len(states), world_size, self.fixed_world_size)
        else:
            state, position = self.resized(states, world_size, num_workers)
        if not isinstance(position, self.position_type):
            saved_path = "pipeline" if isinstance(position, PipelinePosition) else "drop-in"
            raise StateError(f"the state was saved by a {saved_path} loader, this loader is a {self.path_name} loader")
        position = self.check(state.config, position, num_workers, elastic=world_size is not None)
        if not self.seed_explicit:
            seed = state.config.seed
        self.adopt(seed)
        self.show_restored(position)
        self.restored()
        return position, seed

    @abstractmethod
    def restore_key(self, seed: int) -> RestoreKey | None:
        """The key of the item yielded last (None before the first)."""

    def rebuild(self, key: RestoreKey, seed: int) -> Any:
        """The item ``key`` names, rebuilt in this process by a loader of seed ``seed``;
        ``RestoreKeyError`` naming the field if the key is another loader's."""
        if key.seed != seed:
            raise RestoreKeyError(f"key.seed is {key.seed}, this loader's seed is {seed}")
        if key.fingerprint != self.fingerprint:
            raise RestoreKeyError(
                f"key.fingerprint is {key.fingerprint!r}, this loader's dataset is {self.fingerprint!r}: "
                "the key was made by a loader over another dataset or configuration"
            )
        return self.restore_sample(key)

    # -- what an engine provides to the interface ---------------------------------------

    @abstractmethod
    def check(self, saved: LoaderConfig, position: Any, num_workers: int, elastic: bool = False) -> P:
        """Raise ``ConfigMismatchError`` for a change this engine cannot honour; the
        position to restore."""

    def adopt(self, seed: int) -> None:
        """Take the seed of a restored state (a drawn seed gives way to it)."""

    def show_restored(self, position: P) -> None:
        """A state was restored at ``position``: let the objects the caller sees (a
        sampler's ``epoch``) show it before the next ``iter()``."""

    @abstractmethod
    def restored(self) -> None:
        """A state was restored: forget the item yielded last."""

    def resized(self, states: list[RankState], world_size: int, num_workers: int) -> tuple[RankState, Any]:
        """The state to check and the position to restore when the gathered ``states`` of
        another world size are restored on ``world_size`` ranks (``resizable`` engines)."""
        return states[0], elastic_position(states, world_size)

    @abstractmethod
    def restore_sample(self, key: RestoreKey) -> Any:
        """The item ``key`` names, rebuilt in this process (its seed and fingerprint
        checked by :meth:`rebuild`)."""
