"""SavableDataset: the base of every source and wrapper in a savable pipeline.

A subclass lists its state attributes in ``_savable_fields``, sets them in
``reset_state_own()``, reads and advances them in ``__iter__``, and describes itself in
``config()``. ``save_state()`` and ``restore_state()`` then work with no more code: at
every point where the iterator yields, the fields must describe where it is, so that
``restore_state(s)`` followed by ``iter()`` continues from there.

The class docstring of :class:`SavableDataset` has a complete example.

Restore keys: a dataset that can rebuild one sample alone gives every sample a key.
Sources call ``self.mark_sample(key)`` before building each sample (it records
``self.sample_key`` and re-seeds the global RNGs from the key, so the sample's own
random draws follow from it too) and implement ``restore_sample(key)``, which calls
``mark_sample(key)`` and builds the same sample. Wrappers derive their key from
``self.dataset.sample_key`` and rebuild through ``self.dataset.restore_sample``. The
loader sends the outermost key with every item, so any batch can be rebuilt in the main
process (``loader.restore_sample``). Keys are plain data (ints, strings, lists); they
may come back as lists after a trip through JSON. For the class docstring's example::

    def __iter__(self):
        ...
            self.mark_sample(value)
            yield value   # or a sample built from value, random draws included

    def restore_sample(self, key):
        self.mark_sample(key)
        return key
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import msgspec
from torch.utils.data import IterableDataset

from savable_loader.config import WorkerConfig, active_repetitions, active_seeder, request_snapshot
from savable_loader.dataset.guards import check_first_save
from savable_loader.dataset.values import freeze, from_plain
from savable_loader.errors import DatasetContractError, LoaderUsageError, RestoreKeyError, StateError
from savable_loader.rng.formulas import key_prefix, key_seed_of
from savable_loader.rng.seeding import capture_kind, restore_generator
from savable_loader.state.schema import DatasetState
from savable_loader.stats.timed import timed_iter

__all__ = ["SavableDataset", "config_fingerprint", "current_names", "plain_config", "type_name", "wrap_key"]


def wrap_key(head: Any, inner: Any) -> list[Any] | None:
    """``[head, inner]``, the key of a wrapper that adds one level; None if ``inner`` is
    None (a sample without a key stays without one, so the loader reports it plainly)."""
    return None if inner is None else [head, inner]


#: Earlier state names of the classes seen so far -> their current name (see type_name).
_RENAMED: dict[str, str] = {}


def type_name(obj: Any) -> str:
    """The name an object's class is saved under: its ``__savable_name__`` if the class
    declares one (its own, not inherited), else ``module.QualName``.

    A class may also list the names earlier versions saved it under in
    ``__savable_aliases__``: states (and configuration fingerprints) made under those
    names restore exactly. Example::

        class Toy(sl.SavableDataset):
            __savable_name__ = "toy"                       # stable across moves and renames
            __savable_aliases__ = ("__main__.Toy",)        # what earlier checkpoints hold

    List the oldest name first: sample keys are seeded from it (:func:`seed_name`).
    """
    cls = type(obj)
    own = cls.__dict__
    name = own.get("__savable_name__")
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    elif not isinstance(name, str) or not name:
        raise LoaderUsageError(f"{cls.__qualname__}.__savable_name__ must be a non-empty str, got {name!r}")
    aliases = own.get("__savable_aliases__", ())
    if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
        raise LoaderUsageError(f"{cls.__qualname__}.__savable_aliases__ must be a tuple of str, got {aliases!r}")
    for alias in aliases:
        if _RENAMED.setdefault(alias, name) != name:
            raise LoaderUsageError(
                f"{cls.__qualname__}.__savable_aliases__ lists {alias!r}, which {_RENAMED[alias]!r} lists too"
            )
    return name


def seed_name(cls: type) -> str:
    """The class name a sample's key seed hashes (``mark_sample``): the original one, so
    that a moved or renamed class draws the same numbers. ``__name__`` by default; the
    last part of the first (oldest) ``__savable_aliases__`` entry if the class lists
    earlier names; else its ``__savable_name__`` if it declares one."""
    own = cls.__dict__
    aliases = own.get("__savable_aliases__", ())
    if aliases and not isinstance(aliases, str):
        return str(aliases[0]).rsplit(".", 1)[-1]
    declared = own.get("__savable_name__")
    return declared if isinstance(declared, str) and declared else cls.__name__


def current_names(config: Any) -> Any:
    """A saved configuration tree with every earlier class name (an alias some class
    declared in ``__savable_aliases__``) replaced by that class's current name."""
    if isinstance(config, dict):
        out = {k: current_names(v) for k, v in config.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _RENAMED.get(out["type"], out["type"])
        return out
    if isinstance(config, list):
        return [current_names(v) for v in config]
    return config


def plain_config(value: Any) -> Any:
    """A configuration value as plain, deterministic data.

    Functions become their qualified name (lambdas included), other objects their type.
    """
    if isinstance(value, (type(None), bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [plain_config(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_config(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


_json_encode = msgspec.json.Encoder().encode
#: ``key_prefix`` by (seed, epoch, repetitions, dataset class): what ``mark_sample``
#: hashes before a key's JSON, made once per class, epoch and pass (bounded: cleared
#: when it grows past ``_MAX_PREFIXES``, which only a long run of many passes reaches).
_KEY_PREFIXES: dict[tuple[int, int, tuple[int, ...], type], bytes] = {}
_MAX_PREFIXES = 256


def _key_prefix(where: tuple[int, int, tuple[int, ...], type]) -> bytes:
    seed, epoch, repetitions, cls = where
    prefix = key_prefix(seed, epoch, repetitions, seed_name(cls))
    if len(_KEY_PREFIXES) >= _MAX_PREFIXES:
        _KEY_PREFIXES.clear()
    _KEY_PREFIXES[where] = prefix
    return prefix


def config_fingerprint(config: Any) -> str:
    """A short hex digest of a configuration (stable across processes and runs)."""
    data = msgspec.msgpack.Encoder(order="sorted").encode(plain_config(config))
    return hashlib.blake2b(data, digest_size=12).hexdigest()


class SavableDataset(IterableDataset):
    """Base class of sources and wrappers whose iteration state can be saved.

    Subclasses set ``_savable_fields``, implement ``__iter__``, ``reset_state_own`` and
    ``config``; wrappers also return the datasets they wrap from ``children``. See the
    module docstring and docs/custom_dataset.md.

    The RNG rule: random draws from the global RNGs (``random``, NumPy's, torch's) follow
    from where a sample is in the stream, never from how the pipeline got there, so that
    a resumed pipeline draws the same numbers.

    1. The loader re-seeds the global RNGs before every item a worker produces, from
       ``(seed, rank, worker, epoch, item index)``.
    2. A source with restore keys calls ``mark_sample(key)`` before building each
       sample: the RNGs are re-seeded from the key, so the sample's draws, and those of
       the wrappers above that pass it on, follow from the key (``restore_sample(key)``
       calls it too). A source without keys draws from rule 1's seeding.
    3. A wrapper that yields a sample it held, that is anything not pulled from the
       wrapped dataset in the same step (shuffle buffers, group buckets, packed rows,
       micro-batch rests), calls ``mark_sample(key)`` right before the yield with the
       sample's key, whether or not the pipeline can restore samples (it keeps the keys
       of the samples it holds whenever they have one), or with None for a sample
       without a key (None re-seeds nothing).
    4. A wrapper that yields what it pulled in the same step passes the wrapped
       dataset's ``sample_key`` on and does not re-seed.
    5. The end-of-stream rule: a wrapper that goes on yielding after the dataset it
       wraps has ended (a buffer draining, a short last batch) records that end in a
       savable field, and a restored iterator with that field set does not iterate the
       wrapped dataset again.

    Why: a restored pipeline is a new iterator over restored fields, so whatever the
    uninterrupted iterator had done and kept only in its frame is done again. Without
    rule 5 a restored buffer would run its source's end of stream a second time (an
    ``IterableSource`` calls ``mark_sample`` for the position past its end before it
    learns there is none; without ``seek`` it replays its whole stream), which re-seeds
    in the middle of an item and shifts the draws of what follows in that item (a map
    above, a source without keys beside it in a blend). With rule 5 a restored iterator
    makes the calls the uninterrupted one makes, item for item, so rule 1 suffices for
    samples without keys; with rule 3 the draws after a held sample follow from its key,
    as they do when ``restore_sample`` rebuilds it. A field added to ``_savable_fields``
    later can be listed in ``_savable_optional``, so that states written before it
    still restore.

    Example::

        class Range(SavableDataset):
            _savable_fields = ("pos",)

            def __init__(self, n, worker_config):
                super().__init__(worker_config)
                self.n = n
                self.reset_state_own()

            def reset_state_own(self):
                self.pos = self.worker_config.rank_worker_id()

            def __iter__(self):
                while self.pos < self.n:
                    value, self.pos = self.pos, self.pos + self.worker_config.workers_per_rank
                    yield value

            def config(self):
                return {"n": self.n}

        wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
        loader = SavableDataLoader(Range(100, worker_config=wc), batch_size=None, worker_config=wc)
    """

    _savable_fields: ClassVar[tuple[str, ...]] = ()
    #: Fields of ``_savable_fields`` that a state may lack (added after states were first
    #: written): restoring such a state keeps the value ``reset_state_own()`` gives them.
    _savable_optional: ClassVar[frozenset[str]] = frozenset()

    #: True for a dataset whose position goes on from one epoch into the next
    #: (``EpochizeDataset``): worker processes then send their state at each epoch's end,
    #: and a fresh worker starts the next epoch from it (``WorkerState.carried``).
    carries_across_epochs: ClassVar[bool] = False

    #: The restore key of the sample this dataset yielded last (None: it gives no keys).
    sample_key: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a loader recording statistics times each stage's iterator (stats/clock.py):
        # outside one, iter() returns the subclass's own iterator, unwrapped
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__iter__")
        if own is not None:
            cls.__iter__ = timed_iter(own)  # type: ignore[method-assign]

    def __init__(self, worker_config: WorkerConfig) -> None:
        if not isinstance(worker_config, WorkerConfig):
            raise LoaderUsageError(
                f"{type(self).__name__} needs worker_config=WorkerConfig(...), got {worker_config!r}"
            )
        self.worker_config = worker_config

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - abstract
        raise DatasetContractError(f"{type(self).__name__} must implement __iter__")

    def reset_state_own(self) -> None:
        """Set this dataset's own ``_savable_fields`` to the start of an epoch."""

    def request_snapshot(self, force: bool = False) -> None:
        """Ask for a snapshot of the pipeline right after the sample about to be yielded.

        The snapshot is taken when the item that carries this sample leaves the pipeline
        (after a whole batch, when a ``BatchDataset`` sits above). A source calls it
        before yielding the last sample of a unit it reads whole (a shard, a row group),
        so that a restore past that point starts from a snapshot taken there and never
        reads the finished unit again (no download of a consumed shard). The loading
        context takes the snapshot unless it would cost more than
        ``HINTED_SNAPSHOT_SHARE`` of the work since the previous one (``pipeline/worker.py``).
        ``force=True`` takes it whatever it costs: a source whose consumed samples may be
        gone (a producer's stream) asks so for every sample, and a restore then never
        reads a consumed sample again. Never while replaying after a restore. Outside a
        loader nothing takes it (the request stays pending in the thread and may make
        the next in-process loader snapshot once more, which never changes data).
        """
        request_snapshot(force)

    # -- restore keys -----------------------------------------------------------------

    def mark_sample(self, key: Any) -> None:
        """Record ``key`` as the key of the sample about to be yielded, and re-seed.

        Python ``random``, NumPy's and torch's global RNGs are re-seeded from
        ``(seed, epoch, repetition, dataset type, key)``, so whatever runs downstream of
        this yield (a random map, say) draws the same numbers when ``restore_sample``
        rebuilds the sample and calls ``mark_sample(key)`` at the same point. ``key``
        None records that the sample has no key and leaves the RNGs as they are: its
        draws follow the loader's per-item seeding. A key must be a JSON value (None,
        bool, int, float, str, lists, tuples, str-keyed dicts); anything else (a NumPy
        integer, say) is a :class:`RestoreKeyError` naming the dataset and the key.
        Under a loader's ``global_rngs=`` only the generators it lists are re-seeded
        (none for ``global_rngs=()``), with the same seeds.

        Sources call it for every sample; wrappers that yield samples they held (buffers,
        buckets, packed rows, micro-batch rests) call it before every such yield, with the
        sample's key or None: see the RNG rule in the class docstring.
        """
        self.sample_key = key
        if key is None:
            return
        try:
            text = _json_encode(key)
        except (TypeError, ValueError) as e:  # a UnicodeEncodeError is a ValueError
            raise RestoreKeyError(
                f"{type(self).__name__}.mark_sample: restore key {key!r} of type {type_name(key)} "
                f"is not a JSON value ({e}); keys are None, bool, int, float, str, and lists, tuples and "
                "str-keyed dicts of these (convert NumPy scalars with int() / float())"
            ) from e
        seed = active_seeder()
        if seed is None:  # the loader's global_rngs=(): no global RNG re-seeded (guarded per item)
            return
        wc = self.worker_config
        where = (wc.seed, wc.active_epoch(), active_repetitions(), type(self))
        prefix = _KEY_PREFIXES.get(where)
        if prefix is None:
            prefix = _key_prefix(where)
        seed(key_seed_of(prefix, text))

    def restore_sample(self, key: Any) -> Any:
        """The sample ``key`` names, built alone in the calling process.

        Must not change the iteration state. The default refuses with the reason.
        """
        raise RestoreKeyError(self.restore_sample_blocker() or f"{type(self).__name__} cannot restore samples")

    def restore_sample_blocker(self) -> str | None:
        """Why ``restore_sample`` cannot work here (this dataset or one it wraps), or None."""
        if type(self).restore_sample is SavableDataset.restore_sample:
            return (
                f"{type(self).__name__} does not implement restore_sample() "
                "(give samples keys with mark_sample() and implement restore_sample())"
            )
        for child in self.children():
            reason = child.restore_sample_blocker()
            if reason is not None:
                return reason
        return None

    def can_restore_sample(self) -> bool:
        """True if every dataset of this pipeline can rebuild a sample from its key.

        ``restore_sample_blocker()`` says why not.
        """
        return self.restore_sample_blocker() is None

    def config(self) -> dict[str, Any]:
        """A dict that describes this dataset; a changed config refuses a restore."""
        raise DatasetContractError(f"{type(self).__name__} must implement config()")

    def children(self) -> Sequence[SavableDataset]:
        """The savable datasets this one wraps (none for a source)."""
        return ()

    def reset_state_deep(self) -> None:
        """Reset this dataset and every dataset it wraps to the start of an epoch."""
        for child in self.children():
            child.reset_state_deep()
        self.reset_state_own()

    def config_tree(self) -> dict[str, Any]:
        """``config()`` of this dataset with the config trees of its children."""
        tree: dict[str, Any] = {"type": type_name(self), **plain_config(self.config())}
        kids = self.children()
        if kids:
            tree["children"] = [c.config_tree() for c in kids]
        return tree

    def save_state(self) -> DatasetState:
        """The state of this dataset and its children, copied from the live fields."""
        check_first_save(self, SavableDataset)
        fields = {}
        for name in self._savable_fields:
            try:
                value = getattr(self, name)
            except AttributeError:
                raise StateError(
                    f"{type(self).__name__}.{name} is listed in _savable_fields but not set; "
                    "set it in reset_state_own()"
                ) from None
            fields[name] = freeze(value, f"{type(self).__name__}.{name}")
        return DatasetState(type=type_name(self), fields=fields, children=[c.save_state() for c in self.children()])

    def restore_state(self, state: DatasetState | None) -> None:
        """Put back a state from ``save_state`` (None: the start of an epoch)."""
        if state is None:
            self.reset_state_deep()
            return
        if not isinstance(state, DatasetState):
            raise StateError(f"{type(self).__name__}.restore_state needs a DatasetState, got {type(state).__name__}")
        expected = type_name(self)
        if state.type != expected and _RENAMED.get(state.type) != expected:
            raise StateError(f"state node was saved by {state.type}, but the pipeline has {expected} here")
        kids = self.children()
        if len(state.children) != len(kids):
            raise StateError(f"{expected}: state has {len(state.children)} child states, the pipeline has {len(kids)}")
        missing = set(self._savable_fields) - set(state.fields) - self._savable_optional
        extra = set(state.fields) - set(self._savable_fields)
        if missing or extra:
            raise StateError(
                f"{expected}: state fields {sorted(state.fields)} do not match _savable_fields "
                f"{sorted(self._savable_fields)}"
            )
        for child, child_state in zip(kids, state.children):
            child.restore_state(child_state)
        self.reset_state_own()
        for name in self._savable_fields:
            if name not in state.fields:
                continue  # an optional field that an older state lacks
            value = state.fields[name]
            current = getattr(self, name, None)
            if capture_kind(current) is not None:
                restore_generator(current, value)
            else:
                setattr(self, name, from_plain(value))
