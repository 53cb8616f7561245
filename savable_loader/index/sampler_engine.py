"""The drop-in path with a sampler of the user's (``sampler=``, ``batch_sampler=``, or
``generator=`` with ``shuffle=True``).

The sampler runs in the main process as in torch; each item it yields (an index, or a
batch of indices from a batch sampler) becomes one batch key. At the start of every
epoch the loader records what decides the sampler's order (``sources/samplers.py``); a
state is that record, the number of items consumed and a digest of their indices. A
resume replays the sampler from the record and skips the consumed items (no data is
loaded), checking the digest.

Per-sample seeds: ``(seed, rank, epoch, position of the sample in the sampler's stream
this epoch)``, so augmentations stay exact and independent of ``num_workers``; unlike the
loader's own order they depend on the rank (the sampler splits the data, not the
loader), and a state cannot move to another world size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from savable_loader.core.checks import check_key_seed_formula, check_key_setting
from savable_loader.dataset.base import type_name
from savable_loader.errors import ConfigMismatchError, LoaderUsageError, RestoreKeyError
from savable_loader.index.engine import MAX_HELD, IndexIteration, IndexMode
from savable_loader.index.samplers import (
    PrivateRng,
    apply,
    capture,
    capture_epochs,
    from_plain_indices,
    index_digest,
    new_digest,
    plain_indices,
    private_regime,
)
from savable_loader.index.source import BatchKey
from savable_loader.rng.formulas import sampler_seed
from savable_loader.state.schema import (
    IndexPosition,
    LoaderConfig,
    RestoreKey,
    SamplerState,
)

__all__ = ["SamplerIteration", "SamplerMode"]


class SamplerIteration(IndexIteration):
    """An iteration over a sampler of the user's: ``consumed`` counts its items."""

    def __init__(
        self, mode: SamplerMode, epoch: int, record: SamplerState, rng: PrivateRng, items: Iterator[Any], resumed: bool
    ) -> None:
        super().__init__(mode, epoch, 0, resumed)
        self.record = record
        self.rng = rng
        self.items = items
        self.auto_collation = mode.auto_collation
        self.drawn = 0  # samples drawn from the sampler (positions of the next key)
        self.digest = new_digest()
        #: digests before the items consumed last (a save may leave out items the caller holds)
        self.digests: deque[Any] = deque(maxlen=MAX_HELD)
        self.length = mode.sampler_length()
        self._first: list[Any] = []

    def prime(self) -> None:
        """Draw the first item now: the draw follows the record at once, before another
        iteration over the same sampler can move its generator."""
        try:
            self._first = [self.rng.call(next, self.items)]
        except StopIteration:
            self.items = iter(())

    def keys(self) -> Iterator[BatchKey]:
        """The batch keys of the items still to come."""
        while True:
            if self._first:
                item = self._first.pop()
            else:
                try:
                    item = self.rng.call(next, self.items)
                except StopIteration:
                    return
            indices = tuple(item) if self.auto_collation else (item,)
            positions = tuple(range(self.drawn, self.drawn + len(indices)))
            self.drawn += len(indices)
            yield BatchKey(self.epoch, positions, indices)

    def skip(self, position: IndexPosition) -> None:
        """Replay the ``position.consumed`` items consumed before the save."""
        keys = self.keys()
        for done in range(position.consumed):
            key = next(keys, None)
            if key is None:
                raise ConfigMismatchError(
                    "position.consumed",
                    position.consumed,
                    f"<= {done} (the sampler's items this epoch)",
                    "the sampler yields fewer items than the state consumed",
                )
            self.advance(key)
        saved = position.sampler.digest if position.sampler is not None else ""
        if self.digest.hexdigest() != saved:
            raise ConfigMismatchError(
                "sampler order",
                saved,
                self.digest.hexdigest(),
                f"replaying {type(self.mode.index_sampler).__qualname__} from the state gave other indices: its "  # type: ignore[attr-defined]
                "order depends on something the loader cannot record (see savable_loader.index.samplers)",
            )

    def advance(self, key: BatchKey) -> None:
        self.consumed += 1
        self.digests.append(self.digest.copy())
        index_digest(self.digest, key.indices)

    def position(self, held: int = 0) -> IndexPosition:
        keys = self.held_keys(held)
        digest = self.digests[-len(keys)] if keys else self.digest
        record = msgspec.structs.replace(self.record, digest=digest.hexdigest())
        return IndexPosition(
            epoch=self.epoch, consumed=self.consumed - len(keys), dataset_len=self.dataset_len, sampler=record
        )

    def remaining(self) -> int | None:
        return None if self.length is None else max(self.length - self.consumed, 0)


class SamplerMode(IndexMode):
    """Epochs over the user's sampler (``index_sampler``: the batch sampler when the
    loader batches, else the sampler; torch's ``DataLoader._index_sampler``)."""

    fixed_world_size = (
        "a sampler of the user's splits the data across ranks itself: its state resumes only on the same world size"
    )

    def __init__(
        self,
        dataset: Any,
        *,
        index_sampler: Any,
        auto_collation: bool,
        generator: torch.Generator | None,
        persistent: bool = False,
        samplers: tuple[Any, ...] | list[Any] = (),
        **kwargs: Any,
    ) -> None:
        self.index_sampler = index_sampler
        #: the user's samplers whose ``set_epoch`` the loader calls (``Mode.samplers``)
        self.samplers = samplers
        self.auto_collation = auto_collation
        self.generator = generator
        #: persistent workers: torch draws the workers' base seed from ``generator`` once
        #: per iterator (at its first epoch), not at every epoch
        self.persistent = persistent
        #: the persistent iterator of this run has drawn its base seed (see :meth:`begin`)
        self.base_seed_drawn = False
        #: the samplers' ``epoch`` attributes when a state was restored last
        self.epochs_at_restore: dict[str, int] = {}
        super().__init__(dataset, salt=("sampler-sample", kwargs["rank"]), batched=auto_collation, **kwargs)

    def sampler_name(self) -> str:
        return type_name(self.index_sampler)

    def sampler_length(self) -> int | None:
        """``len(index_sampler)``, or None if it has no length."""
        try:
            return len(self.index_sampler)
        except TypeError:
            return None

    def begin(self, epoch: int, resume: Any, reuse_workers: bool = False) -> IndexIteration:
        sampler = self.index_sampler
        if resume is not None:
            # the run that saved had iterated (and drawn its persistent iterator's base
            # seed) unless the state is the start of its first epoch
            at_start = resume.sampler is None or resume.sampler.at_start
            self.base_seed_drawn = not at_start or resume.epoch > 0
        if resume is not None and resume.sampler is not None and resume.sampler.at_start:
            apply(sampler, resume.sampler)  # saved between epochs: start this one as usual
            resume = None
        if resume is not None and resume.sampler is None:
            resume = None  # saved before the loader ever iterated
        if resume is None:
            self.refresh()
            if self.generator is not None and not (self.persistent and self.base_seed_drawn):
                # torch's iterator draws its base seed from `generator=` before the sampler
                # draws (once per iterator: at every epoch, or at the first with persistent
                # workers): the same batches as torch's DataLoader for the same generator
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            self.base_seed_drawn = True
            record = capture(sampler, private_regime(sampler))
        else:
            self.check_resume_length(resume)
            record = resume.sampler
            apply(sampler, record)
        rng = PrivateRng(record.private_rng, sampler_seed(self.seed, self.rank, epoch))
        items = rng.call(iter, sampler)
        iteration = SamplerIteration(self, epoch, record, rng, items, resumed=resume is not None)
        if resume is not None:
            iteration.skip(resume)
        iteration.prime()
        self.feed_sampler.feed(iteration.feed(iteration.keys()))
        return iteration

    def restored(self) -> None:
        super().restored()
        self.epochs_at_restore = capture_epochs(self.index_sampler)

    def show_restored(self, position: Any) -> None:
        """The sampler's ``epoch`` attributes show the restored ones at once, so that a
        ``set_epoch`` to another value before the next ``iter()`` is seen (Fabric's
        per-process count sets 0 in a resumed process: :meth:`reconcile`)."""
        record = position.sampler if isinstance(position, IndexPosition) else None
        if record is not None and record.epochs:
            apply(self.index_sampler, SamplerState(epochs=dict(record.epochs)))

    def reconcile(self, position: Any, own_epochs: bool) -> tuple[Any, int]:
        """A restored position meets a sampler whose ``epoch`` the caller changed since the
        restore (``sampler.set_epoch(e)``, which the loader does not see), or set before
        the restore to a value other than the state's and other than 0 (a new sampler's
        epoch: the value of a program that does not call ``set_epoch`` before the restore):

        * at an epoch's start, or after an epoch's last batch (nothing left of it): the
          caller starts the next epoch its way, as in an uninterrupted run (Lightning's
          Trainer does this after a save at an epoch's last batch); the rest of the
          restored epoch is played through first, so that the sampler's generators are
          where the uninterrupted run had them;
        * in the middle of an epoch: the caller would get another order than the saved
          one: :class:`LoaderUsageError`, as ``loader.set_epoch`` gives. A framework's own
          count (``own_epochs``, set by an integration: Lightning Fabric's, which starts
          again at 0 in a resumed process) is overridden by the restored epoch instead.
        """
        record = position.sampler if isinstance(position, IndexPosition) else None
        if record is None or own_epochs:
            return position, position.epoch
        now = capture_epochs(self.index_sampler)
        changed = {  # moved since the restore (or set before it), to another value than the state's
            path: value
            for path, value in now.items()
            if record.epochs.get(path) != value and (self.epochs_at_restore.get(path) != value or value != 0)
        }
        if not changed:
            return position, position.epoch
        if record.at_start:
            apply(self.index_sampler, record)
            apply(self.index_sampler, SamplerState(epochs=changed))
            return None, position.epoch
        left = self.remaining(position)
        if left == 0:
            self.finish_rest(position)
            apply(self.index_sampler, SamplerState(epochs=changed))
            return None, position.epoch + 1
        raise LoaderUsageError(
            f"the sampler's epoch was set to {changed} after the restore, but the restored state continues epoch "
            f"{position.epoch} of the sampler at {dict(record.epochs)} "
            f"({'an unknown number of' if left is None else left} items left): set it back (or do not set it) to "
            "continue, or build a new loader to start another epoch. Under Lightning Fabric, whose loader wrapper "
            "sets its per-process count (0 again in a resumed process), save and load the loader through "
            "savable_loader.integrations.fabric.FabricLoaderState(loader): the loader's count is used then"
        )

    def finish_rest(self, position: Any) -> None:
        record = position.sampler if isinstance(position, IndexPosition) else None
        if record is None or record.at_start:
            return
        sampler = self.index_sampler
        apply(sampler, record)
        rng = PrivateRng(record.private_rng, sampler_seed(self.seed, self.rank, position.epoch))
        iteration = SamplerIteration(self, position.epoch, record, rng, rng.call(iter, sampler), resumed=True)
        iteration.skip(position)  # checks the order against the state's digest
        iteration.prime()  # the sampler's end: its generators where the uninterrupted run had them
        if iteration._first:
            raise ConfigMismatchError(
                "position.consumed",
                position.consumed,
                f"< {position.consumed} (the sampler's items this epoch)",
                "the sampler yields more items than its len() says",
            )

    def start_position(self, epoch: int) -> IndexPosition:
        """The start of ``epoch``, with what decides the sampler's order from there."""
        self.refresh()
        record = msgspec.structs.replace(capture(self.index_sampler, private_regime(self.index_sampler)), at_start=True)
        return IndexPosition(epoch=epoch, consumed=0, dataset_len=self.dataset_len, sampler=record)

    def remaining(self, position: IndexPosition) -> int | None:
        length = self.sampler_length()
        return None if length is None else max(length - position.consumed, 0)

    def check(
        self, saved: LoaderConfig, position: IndexPosition, num_workers: int, elastic: bool = False
    ) -> IndexPosition:
        """Raise ConfigMismatchError for a change a sampler of the user's cannot follow."""
        current = self.check_common(saved, position, num_workers)
        for name in ("world_size", "rank"):
            if getattr(saved, name) != getattr(current, name):
                raise ConfigMismatchError(
                    name,
                    getattr(saved, name),
                    getattr(current, name),
                    "the sampler splits the data across ranks itself: its state resumes only on the same "
                    "rank and world size",
                )
        if saved.batch_size != current.batch_size:
            raise ConfigMismatchError(
                "batch_size",
                saved.batch_size,
                current.batch_size,
                "a sampler's state counts its items: restore with the same batch size",
            )
        if position.stages:
            raise ConfigMismatchError("position.stages", len(position.stages), 0, "a sampler's state has no stages")
        if position.sampler is not None:
            apply(self.index_sampler, position.sampler, check_only=True)
        if position.sampler is None and (position.consumed or position.epoch):
            raise ConfigMismatchError(
                "position.sampler",
                None,
                self.sampler_name(),
                "a state of a sampler's loader records the sampler's order",
            )
        return position

    def key_sample(self, key: BatchKey) -> Any:
        try:
            return plain_indices(list(key.indices))
        except TypeError as e:
            raise RestoreKeyError(f"no restore key for this batch: {e}") from None

    def restore_sample(self, key: RestoreKey) -> Any:
        """The batch ``key`` names (its positions and the dataset indices it carries)."""
        if key.kind != "index":
            raise RestoreKeyError(f"key.kind is {key.kind!r}, this drop-in loader expects 'index'")
        if not isinstance(key.sample, list):
            raise RestoreKeyError(
                "key.sample must list the batch's dataset indices (made by a loader over a sampler of the user's), "
                f"got {key.sample!r}"
            )
        positions = key.sample_positions()
        if len(positions) != len(key.sample) or not positions:
            raise RestoreKeyError(
                f"key.positions names {len(positions)} samples and key.sample {len(key.sample)} indices: "
                "expected the same number, at least one"
            )
        if key.rank != self.rank:
            raise RestoreKeyError(
                f"key.rank is {key.rank}, this loader is rank {self.rank}: a sampler's keys are "
                "rebuilt on the rank that made them"
            )
        check_key_setting("reseed", key.reseed, self.reseed, "re-seeding per sample or per batch draws other values")
        self.check_key_global_rngs(key)
        check_key_seed_formula(key)
        indices = tuple(from_plain_indices(key.sample))  # tuple indices come back as tuples
        return self.torch_dataset.rebuild(BatchKey(key.epoch, tuple(positions), indices))
