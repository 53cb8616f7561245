"""Bookkeeping of the drop-in path: which epoch, how much of it was yielded.

:class:`IndexMode` is what both drop-in orders share: the user's map-style dataset behind
an :class:`~savable_loader.index.source.IndexedDataset`, the sampler torch's iterator
draws batch keys from, ``len(dataset)`` re-read at every epoch start, and restore keys.
:class:`OrderMode` is the loader's own order (``shuffle`` without a sampler: an
:class:`~savable_loader.index.source.IndexPlan`); ``index.sampler_engine.SamplerMode`` follows
a sampler of the user's.

An iteration books the keys its torch iterator drew (a queue: prefetching runs ahead)
and, per delivered batch (or per batch that raised), counts it consumed. Saving reads
that count (microseconds, no worker involved); a restored iteration starts its keys at
the saved count.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from savable_loader.core.checks import (
    check_batch_size,
    check_global_rngs,
    check_key_global_rngs,
    check_key_int,
    check_key_order,
    check_key_seed_formula,
    check_key_setting,
)
from savable_loader.core.engine import Iteration, Mode
from savable_loader.dataset.base import config_fingerprint, plain_config, type_name
from savable_loader.dataset.checks import check_dataset_config
from savable_loader.errors import ConfigMismatchError, InternalError, RestoreKeyError, StateError
from savable_loader.index.source import (
    BatchKey,
    IndexedDataset,
    IndexPlan,
    IndexSampler,
    own_getitems,
)
from savable_loader.rng.owned import warn_overridden_seeds
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES, SEED_FORMULA
from savable_loader.state.schema import (
    ORDER_ALGORITHM,
    IndexPosition,
    IndexStage,
    LoaderConfig,
    RestoreKey,
)

__all__ = [
    "MAX_HELD",
    "IndexIteration",
    "IndexMode",
    "OrderMode",
    "map_dataset_config",
]


def map_dataset_config(dataset: Any) -> dict[str, Any]:
    """What identifies a map-style dataset: type, length and its ``config()`` if any."""
    config: dict[str, Any] = {"type": type_name(dataset), "len": len(dataset)}
    own = getattr(dataset, "config", None)
    if callable(own):
        config["config"] = plain_config(own())
    return config


def _identity(batch: Any) -> Any:
    return batch


#: Items yielded last that a save can leave out (``Iteration.position(held=...)``).
MAX_HELD = 4


class IndexIteration(Iteration[IndexPosition]):
    """One iteration of the drop-in path: the keys drawn, the items consumed."""

    def __init__(self, mode: IndexMode, epoch: int, consumed: int, resumed: bool) -> None:
        self.mode = mode
        self.epoch = epoch
        self.consumed = consumed
        self.resumed = resumed
        self.dataset_len = mode.dataset_len
        self.fingerprint = mode.fingerprint
        self.issued: deque[BatchKey] = deque()
        #: The keys consumed last, newest last (a save may leave out items the caller holds).
        self.recent: deque[BatchKey] = deque(maxlen=MAX_HELD)
        #: The keys' source raised (a sampler of the user's): the position is lost.
        self.source_failed = False

    def feed(self, keys: Iterator[BatchKey]) -> Iterator[BatchKey]:
        """``keys``, each booked as drawn (torch's iterator prefetches ahead)."""
        issued = self.issued
        try:
            for key in keys:
                issued.append(key)
                yield key
        except Exception:
            self.source_failed = True
            raise

    def on_item(self, item: Any) -> Any:
        if self.mode.timing:  # (batch, report): a loader recording statistics
            item, report = item
            if self.recorder is not None:
                self.recorder.report(report)  # (a list after pin_memory: read by position)
        self._consume(self.issued.popleft())
        return item

    def on_error(self, error: BaseException) -> bool:
        if self.source_failed or not self.issued:
            return False
        self._consume(self.issued.popleft())  # the batch that raised counts as consumed
        return True

    def _consume(self, key: BatchKey) -> None:
        self.advance(key)
        self.recent.append(key)
        self.mode.last = (self, key)

    def held_keys(self, held: int) -> list[BatchKey]:
        """The last ``held`` keys consumed (``StateError`` if not known)."""
        if held == 0:
            return []
        if held > len(self.recent):
            raise StateError(
                f"cannot leave the last {held} items out of the state: this iteration yielded "
                f"{len(self.recent)} that a save can leave out (at most {MAX_HELD})"
            )
        return list(self.recent)[-held:]

    def advance(self, key: BatchKey) -> None:
        """Count ``key`` as consumed."""
        self.consumed += len(key.positions)

    def end(self, finished: bool, keep_workers: bool) -> None:
        self.issued.clear()


class IndexMode(Mode[IndexPosition]):
    """What the drop-in orders share (see the module docstring)."""

    position_type = IndexPosition
    path_name = "drop-in"

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        seed_explicit: bool,
        rank: int,
        world_size: int,
        batch_size: int | None,
        drop_last: bool,
        shuffle: bool,
        collate_fn: Callable[[Any], Any],
        salt: tuple[int | str, ...],
        batched: bool | None = None,
        reseed: str = "sample",
        global_rngs: tuple[str, ...] = GLOBAL_RNG_NAMES,
        timing: bool = False,
    ) -> None:
        self.dataset = dataset
        #: each batch arrives as ``(batch, report)`` (``IndexedDataset(timing=True)``)
        self.timing = timing
        self.reseed = reseed
        self.global_rngs = global_rngs
        self.seed = seed
        self.seed_explicit = seed_explicit
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.feed_sampler = IndexSampler()
        self.torch_dataset = IndexedDataset(
            dataset,
            seed,
            collate_fn,
            batched=batch_size is not None if batched is None else batched,
            salt=salt,
            reseed=reseed,
            global_rngs=global_rngs,
            timing=timing,
        )
        warn_overridden_seeds(dataset, collate_fn)  # once per process, class and path
        #: (iteration, key) of the batch yielded last
        self.last: tuple[IndexIteration, BatchKey] | None = None
        self.dataset_len = -1
        self.refresh()

    def refresh(self) -> None:
        """Re-read ``len(dataset)`` (and the dataset's configuration), as torch's samplers
        do at every epoch start."""
        self.dataset_config = map_dataset_config(self.dataset)
        self.fingerprint = config_fingerprint(self.dataset_config)
        self.dataset_len = self.dataset_config["len"]

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "dataset": self.torch_dataset,
            "sampler": self.feed_sampler,
            "batch_size": None,
            "collate_fn": _identity,
        }

    def adopt(self, seed: int) -> None:
        self.seed = seed
        self.torch_dataset.seed = seed

    def restored(self) -> None:
        self.last = None

    def sampler_name(self) -> str:
        """``LoaderConfig.sampler``: empty for the loader's own order."""
        return ""

    def loader_config(self, num_workers: int) -> LoaderConfig:
        return LoaderConfig(
            rank=self.rank,
            world_size=self.world_size,
            num_workers=num_workers,
            seed=self.seed,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            dataset_fingerprint=self.fingerprint,
            dataset_config=self.dataset_config,
            seed_formula=SEED_FORMULA,
            sampler=self.sampler_name(),
            order_algorithm=ORDER_ALGORITHM,
            reseed=self.reseed,
            global_rngs=list(self.global_rngs),
        )

    def check_common(self, saved: LoaderConfig, position: IndexPosition, num_workers: int) -> LoaderConfig:
        """The checks both orders make; the current configuration."""
        self.refresh()
        current = self.loader_config(num_workers)
        if position.dataset_len != self.dataset_len:
            raise ConfigMismatchError("len(dataset)", position.dataset_len, self.dataset_len)
        check_dataset_config(saved, current)
        if saved.sampler != current.sampler:
            raise ConfigMismatchError(
                "sampler",
                saved.sampler or "<the loader's own order>",
                current.sampler or "<the loader's own order>",
                "the state follows another order (sampler=, batch_sampler=, generator= or shuffle)",
            )
        names = ("seed", "shuffle", "drop_last") if self.seed_explicit else ("shuffle", "drop_last")
        for name in names:
            if getattr(saved, name) != getattr(current, name):
                raise ConfigMismatchError(name, getattr(saved, name), getattr(current, name))
        if saved.reseed != current.reseed:
            raise ConfigMismatchError(
                "reseed", saved.reseed, current.reseed, "re-seeding per sample or per batch draws other values"
            )
        check_global_rngs(saved, current)
        if current.reseed == "batch" and saved.batch_size != current.batch_size:
            raise ConfigMismatchError(
                "batch_size",
                saved.batch_size,
                current.batch_size,
                'with reseed="batch" a sample\'s random draws depend on its batch: restore with the same batch size',
            )
        if saved.batch_size != current.batch_size and self.torch_dataset.batched and own_getitems(self.dataset):
            raise ConfigMismatchError(
                "batch_size",
                saved.batch_size,
                current.batch_size,
                f"{type(self.dataset).__qualname__} loads a batch in one __getitems__ call (a Hugging Face dataset "
                'with a transform), re-seeded once per batch as with reseed="batch": a sample\'s random draws '
                "depend on its batch: restore with the same batch size",
            )
        return current

    def check_resume_length(self, position: IndexPosition) -> None:
        """A restored position continues only over a dataset of the length it was saved with."""
        self.refresh()
        if position.dataset_len != self.dataset_len:
            raise ConfigMismatchError(
                "len(dataset)",
                position.dataset_len,
                self.dataset_len,
                "the dataset's length changed between the restore and iter()",
            )

    def restore_key(self, seed: int) -> RestoreKey | None:
        if self.last is None:
            return None
        iteration, key = self.last
        made = RestoreKey(
            kind="index",
            seed=seed,
            fingerprint=iteration.fingerprint,
            epoch=iteration.epoch,
            rank=self.rank,
            positions=_ranges([int(p) for p in key.positions]),
            sample=self.key_sample(key),
            shuffle=self.shuffle,
            batched=self.torch_dataset.batched,
            world_size=self.world_size,
            seed_formula=SEED_FORMULA,
        )
        if self.global_rngs != GLOBAL_RNG_NAMES:  # the defaults are left out of str(key)
            made = msgspec.structs.replace(made, global_rngs=self.global_rngs)
        return made if self.reseed == "sample" else msgspec.structs.replace(made, reseed=self.reseed)

    def check_key_global_rngs(self, key: RestoreKey) -> None:
        """RestoreKeyError if ``key`` was made by a loader re-seeding other global RNGs."""
        check_key_global_rngs(key, self.global_rngs)

    def key_sample(self, key: BatchKey) -> Any:
        """What a restore key carries besides positions (the loader's own order: nothing)."""
        return None


class OrderIteration(IndexIteration):
    """An iteration of the loader's own order: ``consumed`` counts this rank's samples."""

    def __init__(
        self, mode: OrderMode, plan: IndexPlan, epoch: int, consumed: int, stages: tuple[IndexStage, ...], resumed: bool
    ) -> None:
        super().__init__(mode, epoch, consumed, resumed)
        self.plan = plan
        self.stages = stages

    def position(self, held: int = 0) -> IndexPosition:
        consumed = self.consumed - sum(len(k.positions) for k in self.held_keys(held))
        return IndexPosition(
            epoch=self.epoch, consumed=consumed, dataset_len=self.plan.dataset_len, stages=list(self.stages)
        )

    def remaining(self) -> int | None:
        return math.ceil(max(self.plan.epoch_len(self.stages) - self.consumed, 0) / self.plan.step)


class OrderMode(IndexMode):
    """The loader's own order: a seeded per-epoch permutation (or the identity), split
    across ranks (any world size on resume), cut into batches."""

    resizable = True

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        self.plan: IndexPlan | None = None
        super().__init__(dataset, salt=("sample",), **kwargs)

    def refresh(self) -> None:
        super().refresh()
        p = self.plan
        if p is None or p.dataset_len != self.dataset_len or p.seed != self.seed:
            self.plan = IndexPlan(
                self.dataset_len,
                seed=self.seed,
                shuffle=self.shuffle,
                rank=self.rank,
                world_size=self.world_size,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
            )

    def adopt(self, seed: int) -> None:
        super().adopt(seed)
        self.refresh()

    def restore_key(self, seed: int) -> RestoreKey | None:
        made = super().restore_key(seed)  # and the order its positions refer to
        return None if made is None else msgspec.structs.replace(made, order_algorithm=ORDER_ALGORITHM)

    @property
    def current_plan(self) -> IndexPlan:
        """The plan of the current ``len(dataset)``."""
        if self.plan is None:  # pragma: no cover - set by refresh() in __init__
            raise InternalError("IndexMode has no plan: refresh() sets one in __init__")
        return self.plan

    def begin(self, epoch: int, resume: Any, reuse_workers: bool = False) -> IndexIteration:
        if resume is None:
            self.refresh()
            start, stages = 0, ()
        else:
            self.check_resume_length(resume)
            start, stages = resume.consumed, tuple(resume.stages)
        plan = self.current_plan
        iteration = OrderIteration(self, plan, epoch, start, stages, resumed=resume is not None)
        self.feed_sampler.feed(iteration.feed(plan.batches(epoch, start, stages)))
        return iteration

    def start_position(self, epoch: int) -> IndexPosition:
        self.refresh()
        return IndexPosition(epoch=epoch, consumed=0, dataset_len=self.dataset_len)

    def sample_count(self) -> int:
        """Samples of this rank's share of a whole epoch (``len(loader.sampler)``)."""
        self.refresh()
        return self.current_plan.rank_len()

    def epoch_indices(self, epoch: int) -> list[int]:
        """The dataset indices of this rank's share of ``epoch`` (``iter(loader.sampler)``)."""
        self.refresh()
        plan = self.current_plan
        return [i for key in plan.batches(epoch, 0) for i in key.indices]

    def remaining(self, position: IndexPosition) -> int | None:
        stages = tuple(position.stages)
        plan = self.current_plan
        return math.ceil(max(plan.epoch_len(stages) - position.consumed, 0) / plan.step)

    def check(
        self, saved: LoaderConfig, position: IndexPosition, num_workers: int, elastic: bool = False
    ) -> IndexPosition:
        """Raise ConfigMismatchError for a change the drop-in path cannot honour; the
        position to restore.

        ``elastic``: the position was made for this world size from all old ranks'
        states (rank and world size are not compared).
        """
        if position.sampler is not None:
            raise ConfigMismatchError(
                "sampler",
                "<a sampler of the user's>",
                "<the loader's own order>",
                "the state follows a sampler: build the loader with it",
            )
        current = self.check_common(saved, position, num_workers)
        plan = self.current_plan
        if not elastic and saved.world_size != current.world_size:
            raise ConfigMismatchError(
                "world_size",
                saved.world_size,
                current.world_size,
                "a drop-in state can move to another world size: pass every old rank's state to "
                "restore_state_global(states)",
            )
        if not elastic and saved.rank != current.rank:
            raise ConfigMismatchError("rank", saved.rank, current.rank)
        check_batch_size(saved.batch_size, current.batch_size)
        stages = tuple(position.stages)
        for stage in stages:
            if len(stage.consumed) != stage.world_size:
                raise ConfigMismatchError(
                    "position.stages.consumed", len(stage.consumed), stage.world_size, "one count per rank of the stage"
                )
        if position.consumed > plan.epoch_len(stages):
            raise ConfigMismatchError("position.consumed", position.consumed, f"<= {plan.epoch_len(stages)}")
        if current.batch_size and position.consumed % current.batch_size and position.consumed != plan.rank_len(stages):
            raise ConfigMismatchError(
                "position.consumed", position.consumed, f"a multiple of batch_size={current.batch_size}"
            )
        return position

    def restore_sample(self, key: RestoreKey) -> Any:
        """The batch ``key`` names, rebuilt in this process.

        The key is checked whole before anything is built or expanded: its settings
        against the loader's, its ranges against the dataset (constant memory for any key).
        """
        p = self.current_plan
        if key.kind != "index":
            raise RestoreKeyError(f"key.kind is {key.kind!r}, this drop-in loader expects 'index'")
        if key.sample is not None:
            raise RestoreKeyError(
                "the key was made by a loader that follows a sampler of the user's (it carries dataset indices); "
                "this loader builds its own order"
            )
        if key.shuffle is None:
            raise RestoreKeyError(
                f"key.shuffle is missing (the key was made by an earlier savable-loader), this loader has "
                f"shuffle={p.shuffle}: a key cannot be rebuilt without knowing which order it names; add "
                '"shuffle": true or false (the setting of the loader that made it) to the key'
            )
        check_key_setting("shuffle", key.shuffle, p.shuffle)
        check_key_setting(
            "batched", key.batched, p.batch_size is not None, f"batch_size is {p.batch_size}; None means unbatched"
        )
        check_key_setting("reseed", key.reseed, self.reseed, "re-seeding per sample or per batch draws other values")
        self.check_key_global_rngs(key)
        check_key_seed_formula(key)
        check_key_order(key)
        check_key_int("epoch", key.epoch)
        if key.world_size is None:  # an earlier version's key: the bound it was checked against
            limit = p.dataset_len + p.world_size
        else:
            check_key_int("world_size", key.world_size, 1)
            limit = math.ceil(p.dataset_len / key.world_size) * key.world_size  # the padded order
        # a batch holds at most one rank's share of an epoch: at most len(dataset) samples
        positions = _key_positions(key.positions, limit, p.dataset_len)
        if not p.batch_size and len(positions) != 1:
            raise RestoreKeyError(f"key.positions names {len(positions)} samples, this loader is unbatched (one)")
        return self.torch_dataset.rebuild(p.key(key.epoch, positions))


def _key_positions(runs: Any, limit: int, most: int) -> list[int]:
    """The positions of a key's ``(start, stop, step)`` runs, each checked to lie below
    ``limit`` and counted (at most ``most``) before any is expanded: constant memory for
    any key."""
    if not isinstance(runs, (list, tuple)) or not runs:
        raise RestoreKeyError(f"key.positions is {runs!r}, expected at least one [start, stop, step] range")
    if len(runs) > most:
        raise RestoreKeyError(
            f"key.positions has {len(runs)} ranges, a batch of this dataset has at most {most} samples"
        )
    total = 0
    for i, run in enumerate(runs):
        if not (isinstance(run, (list, tuple)) and len(run) == 3):
            raise RestoreKeyError(f"key.positions[{i}] is {run!r}, expected [start, stop, step]")
        start, stop, step = run
        for name, value, low in (("start", start, 0), ("stop", stop, 0), ("step", step, 1)):
            check_key_int(f"positions[{i}].{name}", value, low)
        count = (stop - start + step - 1) // step  # len(range(...)) overflows beyond 2**63
        if count <= 0:
            raise RestoreKeyError(f"key.positions[{i}] is {list(run)}: stop {stop} is not after start {start}")
        last = start + (count - 1) * step
        if last >= limit:
            raise RestoreKeyError(f"key.positions[{i}] reaches position {last}, expected positions below {limit}")
        total += count
        if total > most:
            raise RestoreKeyError(
                f"key.positions name more than {most} samples, a batch of this dataset has at most {most}"
            )
    positions = [x for start, stop, step in runs for x in range(start, stop, step)]
    if len(set(positions)) != len(positions):
        raise RestoreKeyError("key.positions names a position twice; a batch holds each position once")
    return positions


def _ranges(positions: list[int]) -> list[tuple[int, int, int]]:
    """Positions as few ``(start, stop, step)`` runs (one for an ordinary batch)."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(positions):
        start = positions[i]
        if i + 1 == len(positions):
            runs.append((start, start + 1, 1))
            break
        step = positions[i + 1] - start
        if step <= 0:
            runs.append((start, start + 1, 1))
            i += 1
            continue
        j = i + 1
        while j + 1 < len(positions) and positions[j + 1] - positions[j] == step:
            j += 1
        runs.append((start, positions[j] + 1, step))
        i = j + 1
    return runs
