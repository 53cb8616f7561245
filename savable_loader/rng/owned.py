"""Random generators a map-style dataset owns: found per epoch, re-seeded per sample.

A dataset that makes ``np.random.default_rng(0)``, ``torch.Generator()``,
``random.Random(0)`` or ``np.random.RandomState(0)`` in ``__init__`` and draws its
augmentations from it would not resume exactly: each worker draws from its own copy,
whose state depends on what that worker loaded before, and a resumed run starts from the
copy made at ``__init__``. On the drop-in path the loader therefore treats these
generators as it treats the global RNGs: before loading the sample at ``position`` of
epoch ``e`` it re-seeds each of them **in place** from ``(seed, e, its path, position)``.
A sample's draws then depend on nothing but its position: exact at every step, with any
``num_workers``, persistent or not, and different in every worker (no duplicate
augmentations across workers, torch's classic pitfall). The drop-in state stays two
numbers: no generator state is saved.

Why re-seed rather than save the generators' states: a drop-in state has no per-worker
part (any ``num_workers`` resumes it, batches go to whichever worker torch picks), so a
snapshot of each worker's copy would tie the state to the worker count and to which
worker loaded which batch, and would need the workers to report after every batch;
``restore_sample`` must rebuild one batch from its key alone; and copies of one stream in
several workers are the duplicate-augmentation bug itself. Re-seeding costs a few
microseconds per generator and sample and changes no state format.

**Where generators are found.** :func:`find_generators` walks from the dataset (and from
the collate function, whose generators are re-seeded before each batch is collated)
through attributes (``__dict__`` and ``__slots__``), list and tuple items, dict values,
``functools.partial`` arguments and the object of a bound method, and through what the
code of the user's classes and functions refers to (module globals their methods read,
closure cells, default arguments: ``savable_loader/rng/code_refs.py``), up to
:data:`MAX_DEPTH` steps (``dataset.transforms[0].rng`` is three steps,
``dataset.base.transform.transforms[0].rng`` five, ``dataset<global RNG>`` one). Lists,
tuples and dicts of more than :data:`MAX_ITEMS` entries are data, not walked; modules,
classes, libraries' functions, tensors and arrays are not walked either. Found once per
epoch in each process (after ``worker_init_fn``), not per sample, and looked for again
after the first batch the process builds in the epoch: a generator made on first use (``if self.rng is None:
self.rng = np.random.default_rng(get_worker_info().seed)`` in ``__getitem__``) is found
there, and that batch is built again with it re-seeded (one batch loaded twice per
process and epoch where this happens), so its draws are exact too. Later looks (after
batches 2, 4, 8, ...) find a generator made later still: re-seeded from then on, with an
:class:`~savable_loader.errors.UnsavedRngWarning` (the samples before were not exact).
A generator inside a C extension, a set or an installed library's code cannot be
reached: its draws are not exact, and only comparing a resumed run with an uninterrupted
one finds it (:func:`savable_loader.testing.check_resume`).

Example::

    owned = OwnedRngs(dataset, collate_fn, seed=0, epoch=3)
    owned.paths                      # ['dataset.transform.rng', ...]
    owned.seed_sample(position)      # before dataset[index]
"""

from __future__ import annotations

import functools
import os
import random
import types
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from savable_loader.errors import LoaderUsageError, UnsavedRngWarning
from savable_loader.rng.code_refs import code_children, is_user_function
from savable_loader.rng.formulas import owned_rng_base, pcg_increment
from savable_loader.rng.seeding import counter_seed
from savable_loader.rng.states import C_RANDOM_SEED, NUMPY_GLOBAL, PY_RANDOM

__all__ = ["MAX_DEPTH", "MAX_ITEMS", "MAX_OBJECTS", "OwnedRngs", "find_generators", "warn_overridden_seeds"]

#: Steps (an attribute, an item, a partial's argument) from the dataset to a generator.
MAX_DEPTH = 6
#: Lists, tuples and dicts longer than this hold data, not transforms: not walked.
MAX_ITEMS = 256
#: Objects one walk visits at most (a dataset holding a large object graph).
MAX_OBJECTS = 20_000

_GLOBAL_IDS = frozenset(id(g) for g in (PY_RANDOM, NUMPY_GLOBAL, torch.default_generator))
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    torch.Tensor,
    np.ndarray,
    np.generic,
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    set,
    frozenset,
    range,
    memoryview,
)
_RNG_TYPES = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)
_PCG = (np.random.PCG64, np.random.PCG64DXSM)


def find_generators(root: Any, name: str, skip: frozenset[int] = frozenset()) -> list[tuple[str, Any]]:
    """``(path, generator)`` of every RNG object reachable from ``root``, in a fixed order.

    Breadth first, so each generator is named by its shortest path (``name.attr[0]...``);
    the order and the paths are the same in every process holding a copy of ``root``.
    The global RNGs (``random``'s, NumPy's and torch's default generators) and the ids
    in ``skip`` are left out.

    Example::

        class Flip:
            def __init__(self):
                self.rng = np.random.default_rng(0)

        ds.transforms = [Flip()]
        find_generators(ds, "dataset")   # [("dataset.transforms[0].rng", <Generator>)]
    """
    found: list[tuple[str, Any]] = []
    seen = {id(root)}
    queue: deque[tuple[str, Any, int]] = deque([(name, root, 0)])
    classes: dict[type, _ClassInfo] = {}
    visited = 0
    while queue:
        path, obj, depth = queue.popleft()
        if _is_rng(obj) or _is_bit_generator(obj):
            if id(obj) not in _GLOBAL_IDS and id(obj) not in skip:
                found.append((path, obj))
            continue
        function = is_user_function(obj)
        if depth >= MAX_DEPTH or (isinstance(obj, _OPAQUE) and not function):
            continue
        visited += 1
        if visited > MAX_OBJECTS:
            warnings.warn(
                f"savable_loader looked for random generators in {visited - 1} objects reachable from {name} and "
                f"stopped at {path}: generators held further on are not re-seeded, their draws are not resumed "
                "exactly",
                RuntimeWarning,
                stacklevel=2,
            )
            break
        try:
            kids = code_children(path, obj) if function else _all_children(path, obj, classes)
            for sub, child in kids:
                if id(child) not in seen and (_walkable(child) or is_user_function(child)):
                    seen.add(id(child))
                    queue.append((sub, child, depth + 1))
        except Exception:  # noqa: BLE001, S112 - an object that fails to be inspected (a container
            continue  # whose items() raises) is skipped: looking must never break loading
    return found


def _all_children(path: str, obj: Any, classes: dict[type, _ClassInfo]) -> Iterator[tuple[str, Any]]:
    """What ``obj`` holds (:func:`_children`), then what its methods' code reads."""
    yield from _children(path, obj, classes)
    if not isinstance(obj, (list, tuple, dict)):
        yield from code_children(path, obj)


class _ClassInfo:
    """What a class adds to its instances' children: generators held as class attributes
    (not walked further) and slot descriptors. Computed once per class and walk."""

    def __init__(self, cls: type) -> None:
        self.generators = [
            (k, v) for c in cls.__mro__[:-1] for k, v in list(vars(c).items()) if isinstance(v, _RNG_TYPES)
        ]
        self.slots: list[tuple[str, Any]] = []
        for c in cls.__mro__:
            names = vars(c).get("__slots__", ())
            for slot in (names,) if isinstance(names, str) else names:
                descriptor = vars(c).get(slot)
                if isinstance(descriptor, types.MemberDescriptorType):
                    self.slots.append((slot, descriptor))


def _is_rng(obj: Any) -> bool:
    try:
        return isinstance(obj, _RNG_TYPES)
    except ReferenceError:  # a dead weak proxy
        return False


def _is_bit_generator(obj: Any) -> bool:
    """A NumPy bit generator held alone (``Generator(self.bits)`` made per sample)."""
    try:
        return isinstance(obj, np.random.BitGenerator)
    except ReferenceError:
        return False


def _walkable(obj: Any) -> bool:
    try:
        return not isinstance(obj, _OPAQUE)
    except ReferenceError:
        return False


def _children(path: str, obj: Any, classes: dict[type, _ClassInfo]) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        if len(obj) <= MAX_ITEMS:
            yield from ((f"{path}[{i}]", v) for i, v in enumerate(obj))
        return
    if isinstance(obj, dict):
        if len(obj) <= MAX_ITEMS:
            for i, (k, v) in enumerate(list(obj.items())):
                yield (f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[#{i}]"), v
        return
    if isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        yield from ((f"{path}.args[{i}]", v) for i, v in enumerate(obj.args))
        yield from ((f"{path}.keywords[{k!r}]", v) for k, v in obj.keywords.items())
        return
    if isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
        return
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        attrs = None
    if not isinstance(attrs, dict):
        attrs = {}
    if len(attrs) <= MAX_ITEMS:
        yield from ((f"{path}.{k}", v) for k, v in list(attrs.items()) if isinstance(k, str))
    info = classes.get(type(obj))
    if info is None:
        info = classes[type(obj)] = _ClassInfo(type(obj))
    for k, v in info.generators:
        if k not in attrs:
            yield f"{path}.{k}", v
    for slot, descriptor in info.slots:
        try:
            yield f"{path}.{slot}", descriptor.__get__(obj, type(obj))
        except AttributeError:  # an empty slot
            pass


def _reseeder(path: str, gen: Any, base: int) -> Callable[[int], object]:
    """A function re-seeding ``gen`` in place from a 64-bit seed (chosen per kind, fast)."""
    if isinstance(gen, random.SystemRandom):
        raise LoaderUsageError(
            f"{path} is a random.SystemRandom: its draws come from the operating system and cannot be "
            "resumed; use random.Random (the loader re-seeds it for every sample)"
        )
    if isinstance(gen, random.Random):
        if type(gen).seed is random.Random.seed:
            c_seed = C_RANDOM_SEED  # skips Random.seed's Python-level checks

            def seed_python(s: int) -> None:
                c_seed(gen, s)
                gen.gauss_next = None  # type: ignore[attr-defined]

            return seed_python
        return gen.seed
    if isinstance(gen, torch.Generator):
        return gen.manual_seed
    if isinstance(gen, np.random.RandomState):
        kind = gen.get_state(legacy=False)["bit_generator"]
        if kind == "MT19937":
            return lambda s: gen.seed(s & 0xFFFFFFFF)
        bit_type = _bit_generator_type(path, getattr(np.random, kind, None))
        return lambda s: gen.set_state(bit_type(s).state)
    bit = gen if isinstance(gen, np.random.BitGenerator) else gen.bit_generator
    if type(bit) in _PCG:
        # A PCG state set directly (the stream's increment fixed per generator and epoch):
        # about 2-3 µs in all, where building a new PCG64 through a SeedSequence takes about 7 µs.
        name = type(bit).__name__
        inc = pcg_increment(base)

        def seed_pcg(s: int) -> None:
            bit.state = {
                "bit_generator": name,
                "state": {"state": s << 64 | counter_seed(s, 0), "inc": inc},
                "has_uint32": 0,
                "uinteger": 0,
            }

        return seed_pcg
    bit_type = _bit_generator_type(path, type(bit))
    return lambda s: setattr(bit, "state", bit_type(s).state)


def _bit_generator_type(path: str, bit_type: Any) -> Any:
    try:
        bit_type(0)
    except (TypeError, ValueError, OverflowError) as e:  # a user-defined bit generator
        raise LoaderUsageError(
            f"{path} uses the bit generator {getattr(bit_type, '__name__', bit_type)!r}, which the loader "
            f"cannot re-seed ({type(e).__name__}: {e}); use PCG64, PCG64DXSM, MT19937, Philox or SFC64"
        ) from None
    return bit_type


class OwnedRngs:
    """The generators ``dataset`` and ``collate_fn`` own, ready to be re-seeded.

    Found once, with a seed base per generator derived from ``(seed, epoch, path)``.
    :meth:`seed_sample` re-seeds the dataset's generators before the sample at a global
    position is loaded, :meth:`seed_collate` the collate function's before a batch
    (named by its first position) is collated.

    Example::

        owned = OwnedRngs(dataset, collate_fn, seed=0, epoch=0)
        owned.seed_sample(17)
        sample = dataset[order[17]]     # its own generators drew from position 17's seeds
    """

    def __init__(self, dataset: Any, collate_fn: Any, seed: int, epoch: int) -> None:
        self._adopt(*_find_all(dataset, collate_fn), seed, epoch)
        #: batches built with these generators (see :meth:`look_again`)
        self.built = 0

    def _adopt(
        self, in_dataset: list[tuple[str, Any]], in_collate: list[tuple[str, Any]], seed: int, epoch: int
    ) -> None:
        self.paths = [path for path, _ in in_dataset + in_collate]
        self.ids = [id(g) for _, g in in_dataset + in_collate]
        self.seed = seed
        self.epoch = epoch
        self._sample = self._prepare(in_dataset, seed, epoch)
        self._collate = self._prepare(in_collate, seed, epoch)

    @staticmethod
    def _prepare(found: list[tuple[str, Any]], seed: int, epoch: int) -> list[tuple[Callable[[int], object], int]]:
        prepared = []
        for path, gen in found:
            base = owned_rng_base(seed, epoch, path)
            prepared.append((_reseeder(path, gen, base), base))
        return prepared

    @property
    def has_sample_generators(self) -> bool:
        """True if the dataset owns generators (:meth:`seed_sample` re-seeds something)."""
        return bool(self._sample)

    def seed_sample(self, position: int) -> None:
        """Re-seed the dataset's generators for the sample at global ``position``."""
        for reseed, base in self._sample:
            reseed(counter_seed(base, position))

    def seed_collate(self, position: int) -> None:
        """Re-seed the collate function's generators for the batch starting at ``position``."""
        for reseed, base in self._collate:
            reseed(counter_seed(base, position))

    def look_again(self, dataset: Any, collate_fn: Any) -> OwnedRngs | None:
        """After a batch was built with these generators: the generators found now, if the
        dataset or the collate function made or replaced one while loading (a generator
        made on first use: ``if self.rng is None: self.rng = np.random.default_rng(...)``
        in ``__getitem__``); None if nothing changed or no look is due.

        The first batch a process builds in an epoch is always looked at (the caller then
        builds it again, so that its draws come from the re-seeded generators, as every
        later batch's do); after that, batches 2, 4, 8, ... only (a walk costs tens of
        microseconds, more for a large object graph), and a generator that appears there
        is re-seeded from then on, but the batches before it were not exact:
        :class:`~savable_loader.errors.UnsavedRngWarning`, once per process and path.
        """
        self.built += 1
        if self.built & (self.built - 1):  # not a power of two: no look
            return None
        in_dataset, in_collate = _find_all(dataset, collate_fn)
        if [id(g) for _, g in in_dataset + in_collate] == self.ids:
            return None
        fresh = OwnedRngs.__new__(OwnedRngs)
        fresh._adopt(in_dataset, in_collate, self.seed, self.epoch)
        fresh.built = self.built
        if self.built > 1:
            new = sorted(set(fresh.paths) - set(self.paths)) or fresh.paths
            key = (os.getpid(), tuple(new))
            if key not in _LATE_WARNED:
                _LATE_WARNED.add(key)
                warnings.warn(
                    f"{', '.join(new)} appeared (or was replaced) while batch {self.built} of epoch {self.epoch} was "
                    "loaded in this process, after its first batch: the loader re-seeds it from now on, but the "
                    "samples drawn from it before were not, and a resumed run draws other values there. Make the "
                    "generator in __init__, in worker_init_fn or on the dataset's first use",
                    UnsavedRngWarning,
                    stacklevel=4,
                )
        return fresh

    @classmethod
    def cached(cls, cache: dict[str, Any], dataset: Any, collate_fn: Any, seed: int, epoch: int) -> OwnedRngs:
        """The generators for ``epoch``, found again only when the epoch or the process
        changes (``cache`` is the holder's ``__dict__``: a forked worker finds its own
        copies, after ``worker_init_fn``)."""
        key = (epoch, os.getpid(), seed)  # a restore may adopt another seed
        entry = cache.get("_owned_rngs")
        if entry is None or entry[0] != key:
            entry = (key, cls(dataset, collate_fn, seed, epoch))
            cache["_owned_rngs"] = entry
        return entry[1]

    @staticmethod
    def replace_cached(cache: dict[str, Any], fresh: OwnedRngs) -> None:
        """Keep ``fresh`` (from :meth:`look_again`) for the rest of its epoch in this process."""
        entry = cache.get("_owned_rngs")
        if entry is not None:
            cache["_owned_rngs"] = (entry[0], fresh)


def warn_overridden_seeds(dataset: Any, collate_fn: Any) -> list[str]:
    """Say once per process and place (the dataset's class and the generator's path) that
    the loader re-seeds the generators ``dataset`` and ``collate_fn`` hold: the seed (or
    state) each was made with does not reach the data, so two datasets that differ only
    in it give the same data (torch's ``DataLoader`` would give other data). The paths
    found. Called in the main process when a drop-in loader is built.

    Why the user's seed is not kept in the seed derivation: ``random.Random`` and
    ``np.random.RandomState`` do not tell their seed, and a generator made without one
    (``np.random.default_rng()``, ``random.Random()``) holds fresh operating-system
    entropy in every run, so a derivation from their state would make every resume draw
    other values; and a generator replaced in ``worker_init_fn`` is seeded per worker.
    """
    in_dataset, in_collate = _find_all(dataset, collate_fn)
    for path, gen in in_dataset + in_collate:
        key = (os.getpid(), type(dataset).__qualname__, path)
        if key in _SEED_WARNED:
            continue
        _SEED_WARNED.add(key)
        warnings.warn(
            f"{path} ({type(gen).__module__}.{type(gen).__qualname__}) is re-seeded by savable_loader before every "
            f"{'sample' if path.startswith('dataset') else 'batch'} from the loader's seed, the epoch and the "
            "position, so that a resume draws the same values: the seed or state it was made with is not used, and "
            "datasets that differ only in it give the same data. Pass another seed= to SavableDataLoader to draw "
            "other values",
            UnsavedRngWarning,
            stacklevel=6,
        )
    return [path for path, _ in in_dataset + in_collate]


#: (process, dataset class, path) of generators whose overridden seed was said.
_SEED_WARNED: set[tuple[int, str, str]] = set()
#: (process, paths) of generators that appeared late, already warned about.
_LATE_WARNED: set[tuple[int, tuple[str, ...]]] = set()


def _find_all(dataset: Any, collate_fn: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The generators of ``dataset`` and those ``collate_fn`` holds besides them."""
    in_dataset = find_generators(dataset, "dataset")
    in_collate = find_generators(collate_fn, "collate_fn", frozenset(id(g) for _, g in in_dataset))
    return in_dataset, in_collate
