"""Samplers on the drop-in path: the user's, made resumable, and the loader's own face.

**A sampler of the user's** (``sampler=``, ``batch_sampler=``, or ``generator=`` with
``shuffle=True``, for which the loader builds torch's ``RandomSampler(generator=g)`` as
torch does) decides the order in the main process. At every ``iter(loader)`` that starts
an epoch the loader records what decides that order (:func:`capture`):

* the states of the random generators the sampler holds: ``torch.Generator``, NumPy
  ``Generator`` / ``RandomState``, ``random.Random``, found as attributes of the sampler
  and of the objects it holds, down to ``MAX_DEPTH`` levels (a batch sampler's
  ``sampler.generator`` is two), in lists, tuples and dicts of up to ``MAX_ITEMS``
  entries; datasets, tensors and arrays are not searched;
* ``epoch`` attributes (``DistributedSampler.set_epoch``);
* ``state_dict()`` of the objects that have ``state_dict`` and ``load_state_dict``
  (except torchdata's stateful samplers, whose state is a position inside an iteration:
  their generator and epoch decide their order and are captured as above);
* samplers that draw from the *global* RNGs (torch's random samplers without a
  ``generator``, and any sampler class the loader does not know) draw, around every
  step, from a private stream seeded from ``(seed, rank, epoch)`` instead
  (:class:`PrivateRng`): their order is then a function of the state, and the caller's
  global RNG streams are left as they were.

A resume puts these back, iterates the sampler anew and skips the items consumed before
the save: O(consumed indices) in the main process, no data is loaded. A digest of the
consumed indices is saved and compared after the skip, so a sampler whose order depends
on anything else (time, a generator the search cannot reach) is refused with
``ConfigMismatchError`` instead of resuming with other data.

**The loader's own order** shows as ``loader.sampler``: :class:`OrderSampler`
(``len``, ``set_epoch``, ``indices()`` of an epoch; iterating it is refused, since only a
DataLoader rebuilt from the loader's attributes does that).

Example::

    state = capture(sampler, private_rng=private_regime(sampler))   # at iter()
    apply(sampler, state)                                            # at a resume
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from savable_loader.core.frameworks import note_epochs_set, rebuild_error
from savable_loader.dataset.values import freeze, from_plain, to_plain
from savable_loader.errors import ConfigMismatchError, StateError, UsageTypeError
from savable_loader.rng.seeding import (
    capture_generator,
    capture_global,
    capture_kind,
    item_seed,
    restore_generator,
    restore_global,
    seed_global,
)
from savable_loader.state.schema import SamplerState

__all__ = [
    "MAX_DEPTH",
    "MAX_ITEMS",
    "DistributedOrderSampler",
    "OrderSampler",
    "PipelineSampler",
    "PrivateRng",
    "RandomOrderSampler",
    "SequentialOrderSampler",
    "apply",
    "capture",
    "capture_epochs",
    "index_digest",
    "new_digest",
    "order_sampler",
    "plain_indices",
    "private_regime",
]

#: Attribute levels searched below the sampler for generators, epochs and state_dicts.
MAX_DEPTH = 4
#: Longest list, tuple or dict searched.
MAX_ITEMS = 64

# torch's samplers that draw from torch's global RNG when their generator is None
_TORCH_GLOBAL = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
# samplers (and plain iterables) whose order depends on nothing global
_NO_GLOBAL = (SequentialSampler, DistributedSampler, range, list, tuple)


def _walk(root: Any) -> Iterator[tuple[str, Any]]:
    """``(path, object)`` of the root and every object below it worth searching."""
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [("", root, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        yield path, obj
        if depth >= MAX_DEPTH or capture_kind(obj) is not None:
            continue
        children: list[tuple[str, Any]] = []
        if isinstance(obj, (list, tuple)):
            if len(obj) <= MAX_ITEMS:
                children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, dict):
            if len(obj) <= MAX_ITEMS:
                children = [(f"{path}[{k!r}]", v) for k, v in obj.items() if isinstance(k, (str, int))]
        elif _searchable(obj):
            children = [(f"{path}.{k}" if path else k, v) for k, v in vars(obj).items()]
        stack.extend((p, v, depth + 1) for p, v in reversed(children))


def _searchable(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray, Dataset, type)) or not hasattr(obj, "__dict__"):
        return False
    if callable(obj) and not hasattr(obj, "__iter__"):
        return False  # functions, methods
    # a dataset that is not a torch Dataset (indexable with a length): not searched
    return not (hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, Sampler))


def _is_torchdata_sampler(obj: Any) -> bool:
    return type(obj).__module__.startswith("torchdata.")


def _has_state_dict(obj: Any) -> bool:
    return (
        not isinstance(obj, type)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
        and not _is_torchdata_sampler(obj)
    )


def private_regime(sampler: Any) -> str:
    """Which global RNGs ``sampler`` may draw from: ``""`` (none), ``"torch"`` (torch's
    random samplers without a generator) or ``"all"`` (a class the loader does not know)."""
    regime = ""
    for _, obj in _walk(sampler):
        if isinstance(obj, _TORCH_GLOBAL) and type(obj).__module__.startswith("torch.utils.data"):
            if getattr(obj, "generator", None) is None:
                regime = regime or "torch"
        elif (
            isinstance(obj, BatchSampler)
            and type(obj).__module__.startswith("torch.utils.data")
            or isinstance(obj, _NO_GLOBAL)
            or _is_torchdata_sampler(obj)
        ):
            continue
        elif obj is sampler or isinstance(obj, Sampler):
            return "all"
    return regime


def capture(sampler: Any, private_rng: str) -> SamplerState:
    """What decides ``sampler``'s next order (see the module docstring), as plain values.

    A ``state_dict()`` that a state cannot hold raises :class:`StateError` naming it.
    """
    rngs: dict[str, Any] = {}
    epochs: dict[str, int] = {}
    states: dict[str, Any] = {}
    for path, obj in _walk(sampler):
        if capture_kind(obj) is not None:
            rngs[path or "."] = capture_generator(obj)
            continue
        if obj is not sampler and not _searchable(obj):
            continue  # a dataset the sampler refers to: not part of its order
        epoch = vars(obj).get("epoch") if hasattr(obj, "__dict__") else None
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            epochs[path or "."] = epoch
        if _has_state_dict(obj):
            try:
                states[path or "."] = to_plain(freeze(obj.state_dict(), f"{path or type(obj).__name__}.state_dict()"))
            except StateError as e:
                raise StateError(f"cannot record the order of {type(obj).__qualname__}: {e}") from None
    return SamplerState(rngs=rngs, epochs=epochs, state=states or None, private_rng=private_rng)


def capture_epochs(sampler: Any) -> dict[str, int]:
    """The ``epoch`` attributes of ``sampler`` and the objects it holds, by path (as
    :func:`capture` records them)."""
    epochs: dict[str, int] = {}
    for path, obj in _walk(sampler):
        if capture_kind(obj) is not None or (obj is not sampler and not _searchable(obj)):
            continue
        epoch = vars(obj).get("epoch") if hasattr(obj, "__dict__") else None
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            epochs[path or "."] = epoch
    return epochs


def apply(sampler: Any, state: SamplerState, check_only: bool = False) -> None:
    """Put the captured order back into ``sampler`` (and the objects it holds).

    ``check_only``: only check that every recorded part has a matching place in
    ``sampler`` (:class:`ConfigMismatchError` naming it otherwise), changing nothing."""
    found = dict(_walk(sampler))
    found["."] = sampler

    def target(path: str, what: str) -> Any:
        if path not in found:
            raise ConfigMismatchError(
                f"sampler {what} at {path!r}",
                "present",
                "missing",
                "the sampler is not built like the one the state was saved with",
            )
        return found[path]

    for path, plain in (state.state or {}).items():
        obj = target(path, "state_dict")
        if not _has_state_dict(obj):
            raise ConfigMismatchError(f"sampler state_dict at {path!r}", "present", "missing")
        if not check_only:
            obj.load_state_dict(from_plain(plain))
    for path, plain in state.rngs.items():
        obj = target(path, "generator")
        kind = plain.get("kind") if isinstance(plain, dict) else None
        if capture_kind(obj) is None or (check_only and kind != capture_kind(obj)):
            raise ConfigMismatchError(
                f"sampler generator at {path!r}",
                kind or "a generator",
                capture_kind(obj) or type(obj).__qualname__,
                "the sampler is not built like the one the state was saved with",
            )
        if not check_only:
            restore_generator(obj, plain)
    for path, epoch in state.epochs.items():
        obj = target(path, "epoch")
        held = vars(obj).get("epoch") if hasattr(obj, "__dict__") else None
        if not isinstance(held, int) or isinstance(held, bool):
            raise ConfigMismatchError(
                f"sampler epoch at {path!r}",
                f"an epoch ({epoch})",
                f"a {type(obj).__qualname__} without one",
                "the state was saved with a sampler that has an epoch (DistributedSampler.set_epoch): build the "
                "loader with the sampler the state was saved with",
            )
        if not check_only:
            obj.epoch = epoch


class PrivateRng:
    """A private stream for samplers that draw from the global RNGs: ``call`` runs a step
    of the sampler with the stream swapped in and the caller's global state put back.

    ``regime``: ``""`` (no swap), ``"torch"`` (torch's CPU RNG) or ``"all"`` (also Python's
    ``random`` and NumPy's global RNG, seeded as ``rng.seed_global`` seeds them).

    Example::

        rng = PrivateRng("torch", seed=derive_seed(0, "sampler", rank, epoch))
        it = rng.call(iter, sampler)
        first = rng.call(next, it)
    """

    def __init__(self, regime: str, seed: int) -> None:
        self.regime = regime
        self._state: Any = None
        if regime == "torch":
            self._state = torch.Generator().manual_seed(item_seed(seed)).get_state()
        elif regime == "all":
            saved = capture_global()
            try:
                seed_global(seed)
                self._state = capture_global()
            finally:
                restore_global(saved)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` drawing from the private stream."""
        if self.regime == "torch":
            saved = torch.get_rng_state()
            torch.set_rng_state(self._state)
            try:
                return fn(*args)
            finally:
                self._state = torch.get_rng_state()
                torch.set_rng_state(saved)
        if self.regime == "all":
            saved_all = capture_global()
            restore_global(self._state)
            try:
                return fn(*args)
            finally:
                self._state = capture_global()
                restore_global(saved_all)
        return fn(*args)


def _plain_hook(obj: Any) -> Any:
    if isinstance(obj, (np.generic, np.ndarray, torch.Tensor)):
        return obj.tolist()
    if hasattr(obj, "__index__"):
        return obj.__index__()
    raise NotImplementedError(type(obj).__qualname__)


_index_encoder = msgspec.msgpack.Encoder(enc_hook=_plain_hook)


#: how a restore key writes a tuple index (JSON has no tuples: ``table[(r, c)]`` is not ``table[[r, c]]``)
TUPLE_TAG = "__tuple__"


def _tag_tuples(value: Any) -> Any:
    if isinstance(value, tuple):
        if type(value) is not tuple:  # a namedtuple would come back as a plain tuple
            raise TypeError(f"{type(value).__qualname__} (a tuple subclass) has no plain form that gives it back")
        return {TUPLE_TAG: [_tag_tuples(v) for v in value]}
    if isinstance(value, list):
        return [_tag_tuples(v) for v in value]
    if isinstance(value, dict):
        if TUPLE_TAG in value:
            raise TypeError(f"a dict index with the key {TUPLE_TAG!r} is ambiguous in a restore key")
        return {k: _tag_tuples(v) for k, v in value.items()}
    return value


def plain_indices(indices: Any) -> Any:
    """Dataset indices as plain values (ints, strings, lists, ``{"__tuple__": [...]}`` for
    a tuple) for a restore key; :func:`from_plain_indices` gives them back.

    Raises ``TypeError`` for an index that has no plain form."""
    try:
        return msgspec.to_builtins(_tag_tuples(indices), enc_hook=_plain_hook)
    except (NotImplementedError, TypeError) as e:
        raise UsageTypeError(f"the sampler yielded an index with no plain form: {e}") from None


def from_plain_indices(value: Any) -> Any:
    """The indices :func:`plain_indices` was given (tuples as tuples).

    Example::

        from_plain_indices(plain_indices([(0, 1), (2, 3)]))   # [(0, 1), (2, 3)]
    """
    if isinstance(value, list):
        return [from_plain_indices(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {TUPLE_TAG} and isinstance(value[TUPLE_TAG], list):
            return tuple(from_plain_indices(v) for v in value[TUPLE_TAG])
        return {k: from_plain_indices(v) for k, v in value.items()}
    return value


def index_digest(digest: Any, indices: Any) -> None:
    """Add the indices of one consumed item to ``digest`` (a hashlib object)."""
    try:
        data = _index_encoder.encode(indices)
    except (NotImplementedError, TypeError):
        data = repr(indices).encode()
    digest.update(len(data).to_bytes(4, "little"))
    digest.update(data)


def new_digest() -> Any:
    """The digest of an iteration that consumed nothing."""
    return hashlib.blake2b(digest_size=16)


class OrderSampler(Sampler[int]):
    """``loader.sampler`` of a loader that builds its own order (shuffle without a sampler).

    ``len(sampler)`` is this rank's number of samples per epoch (read from
    ``len(dataset)`` when asked), ``set_epoch(e)`` is ``loader.set_epoch(e)`` (except
    after a restore, see :meth:`set_epoch`), ``epoch`` the epoch the next ``iter(loader)``
    starts, and ``indices()`` the dataset indices of that epoch for this rank. The loader
    never iterates it (nor ``loader.batch_sampler``): ``iter(sampler)`` is what a plain
    DataLoader rebuilt from the loader's attributes does (Accelerate's ``prepare()`` and
    ``skip_first_batches``), and raises :class:`LoaderUsageError` saying what to do.

    The loader shows one of its subclasses, each an instance of the torch sampler a
    ``DataLoader`` with the same arguments would have, so that frameworks that inspect
    ``loader.sampler`` treat the loader as they treat torch's:
    :class:`RandomOrderSampler` (``shuffle=True``, a ``RandomSampler``),
    :class:`SequentialOrderSampler` (a ``SequentialSampler``) and, split over several
    data-parallel ranks, :class:`DistributedOrderSampler` (a ``DistributedSampler``).

    Example::

        loader.sampler.set_epoch(3)      # as with DistributedSampler
        len(loader.sampler)              # samples of this rank per epoch
        loader.sampler.indices()         # the dataset indices of that epoch, this rank's
    """

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)

    def _owner(self) -> Any:
        loader = self._loader()
        if loader is None:  # a sampler that outlives its loader: one rebuilt from its attributes uses it
            raise rebuild_error("sampler")
        return loader

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter(loader)`` starts (see ``SavableDataLoader.set_epoch``).

        After a restore the loader's epoch count is the restored one: an ``epoch`` below
        the epoch the loader runs next is ignored. Lightning Fabric's loader wrapper calls
        it before every ``iter()`` with its count of iterations in this process, which
        starts again at 0 in a resumed process; an uninterrupted run numbers them as the
        loader does, and a resumed one continues the loader's numbering. A count of one's
        own that goes back after a restore: ``loader.set_epoch(e)``."""
        owner = self._owner()
        if owner._iterations.own_epochs or (owner._iterations.restored and epoch < owner._iterations.upcoming_epoch()):
            return
        owner.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter(loader)`` starts."""
        return int(self._owner()._iterations.upcoming_epoch())

    def __len__(self) -> int:
        return int(self._owner()._mode.sample_count())

    def indices(self) -> list[int]:
        """The dataset indices of the epoch the next ``iter(loader)`` starts, this rank's
        share, in the order the loader loads them."""
        owner = self._owner()
        return [int(i) for i in owner._mode.epoch_indices(owner._iterations.upcoming_epoch())]

    def __iter__(self) -> Iterator[int]:
        raise rebuild_error("sampler")


class RandomOrderSampler(OrderSampler, RandomSampler):
    """``loader.sampler`` of a shuffling loader on one rank: a ``RandomSampler``, as
    torch's ``DataLoader(shuffle=True)`` has. Lightning and Fabric, distributing such a
    loader, rebuild it with the user's arguments and a ``DistributedSampler`` over the
    dataset, as they do a ``DataLoader``.

    Its ``RandomSampler`` attributes: ``data_source`` (the dataset), ``replacement``
    (False), ``num_samples`` (``len(sampler)``), ``generator`` (None: the order comes from
    the loader's seed).

    Example::

        isinstance(SavableDataLoader(ds, shuffle=True).sampler, RandomSampler)   # True
    """

    replacement = False
    _num_samples = None
    generator = None

    def __init__(self, loader: Any) -> None:  # RandomSampler's attributes are properties here
        OrderSampler.__init__(self, loader)

    @property
    def data_source(self) -> Any:  # type: ignore[override]
        return self._owner().dataset

    @property
    def num_samples(self) -> int:
        return len(self)


class SequentialOrderSampler(OrderSampler, SequentialSampler):
    """``loader.sampler`` of a loader without shuffle on one rank: a ``SequentialSampler``,
    as torch's ``DataLoader`` has (``data_source`` is the dataset).

    Example::

        isinstance(SavableDataLoader(ds).sampler, SequentialSampler)   # True
    """

    def __init__(self, loader: Any) -> None:
        OrderSampler.__init__(self, loader)

    @property
    def data_source(self) -> Any:  # type: ignore[override]
        return self._owner().dataset


class PipelineSampler(Sampler[None]):
    """``loader.sampler`` of a loader over a savable pipeline or a plain IterableDataset:
    the pipeline decides the order, there is nothing to sample.

    ``set_epoch(e)`` leaves the loader's epochs alone (it counts them itself) and records
    that something sets them this way: Lightning's Trainer and Fabric's loader wrapper call
    it before every epoch, and Lightning's Trainer fetches a batch ahead of a loader without
    ``len()``, so that ``state_dict()`` mid-epoch then needs a hook (see
    ``savable_loader/core/frameworks.py``). Iterating it raises :class:`LoaderUsageError`
    (only a DataLoader rebuilt from the loader's attributes would).

    Example::

        loader.sampler.set_epoch(2)     # what Lightning does; the loader's epochs are its own
    """

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is None:
            raise rebuild_error("sampler")
        note_epochs_set(loader)

    def __iter__(self) -> Iterator[None]:
        raise rebuild_error("sampler")


def order_sampler(loader: Any, shuffle: bool, world_size: int) -> OrderSampler:
    """The face of a loader's own order: see :class:`OrderSampler`."""
    if world_size > 1:
        return DistributedOrderSampler(loader)
    return RandomOrderSampler(loader) if shuffle else SequentialOrderSampler(loader)


class DistributedOrderSampler(OrderSampler, DistributedSampler):  # type: ignore[override]
    """``loader.sampler`` of a loader that builds its own order over several data-parallel
    ranks: a ``torch.utils.data.DistributedSampler``, so that frameworks that split a
    loader's data over ranks (Lightning's Trainer and Fabric) see that it is split already
    and use it as it is, instead of rebuilding it around a sampler of their own.

    Its attributes are those of ``DistributedSampler``, read from the loader:
    ``num_replicas`` and ``rank`` (the loader's data-parallel world), ``shuffle``,
    ``seed``, ``epoch``, ``num_samples`` (``len(sampler)``, this rank's padded share),
    ``total_size`` and ``drop_last`` (False: the split pads the order to equal shares, as
    ``DistributedSampler(drop_last=False)``; the loader's ``drop_last`` drops a last
    incomplete batch). A loader built before ``torch.distributed`` was initialised (one
    rank) shows a :class:`RandomOrderSampler` or :class:`SequentialOrderSampler`, which
    those frameworks rebuild as they rebuild a ``DataLoader``.

    Example::

        loader = SavableDataLoader(ds, batch_size=8, shuffle=True)   # after init_process_group
        isinstance(loader.sampler, DistributedSampler)               # True on 2 ranks
    """

    def __init__(self, loader: Any) -> None:  # DistributedSampler's attributes are properties here
        OrderSampler.__init__(self, loader)

    @property
    def dataset(self) -> Any:  # type: ignore[override]
        return self._owner().dataset

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return int(self._owner().worker_config.world_size)

    @property
    def rank(self) -> int:  # type: ignore[override]
        return int(self._owner().worker_config.rank)

    @property
    def shuffle(self) -> bool:  # type: ignore[override]
        return bool(self._owner()._mode.shuffle)

    @property
    def seed(self) -> int:  # type: ignore[override]
        return int(self._owner().seed)

    @property
    def drop_last(self) -> bool:  # type: ignore[override]
        return False

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return len(self)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return len(self) * self.num_replicas
