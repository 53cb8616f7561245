"""SavableTrainer: the Hugging Face ``transformers.Trainer`` with exact data resume.

Change one line, ``Trainer`` to ``SavableTrainer``::

    from savable_loader.integrations.transformers import SavableTrainer

    trainer = SavableTrainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()                                # checkpoints as usual, in checkpoint-N/
    trainer.train(resume_from_checkpoint=True)     # after a crash: the very next batch

What changes:

* the training loader is a :class:`~savable_loader.SavableDataLoader` built from the
  Trainer's own arguments: the per-device batch size, the data collator, the train
  dataset with the columns the model does not take removed (as the Trainer removes
  them), ``dataloader_num_workers``, ``dataloader_drop_last``, ``dataloader_pin_memory``,
  ``dataloader_persistent_workers``, ``dataloader_prefetch_factor``,
  ``dataloader_multiprocessing_context``, ``dataloader_in_order``, and ``data_seed``
  (``seed`` if unset) as the loader's seed. ``train_sampling_strategy`` ``"random"``
  shuffles, ``"sequential"`` does not; the loader splits the data over the
  data-parallel ranks itself (it is not passed to ``accelerator.prepare``);
* every ``checkpoint-N/`` folder gets one file per data-parallel rank,
  ``savable_loader_rank<r>.state`` (atomic, checksummed), written before the Trainer
  writes ``trainer_state.json``;
* ``train(resume_from_checkpoint=...)`` restores each rank's loader from its file
  instead of skipping the epoch's first batches: no batch is replayed, and the
  augmentations drawn in loader workers are those of the uninterrupted run. The loader's
  position is checked against the Trainer's (epoch, batch in the epoch); if they
  disagree (a changed batch size, ``gradient_accumulation_steps`` or world size), a
  :class:`~savable_loader.StateError` says so before the first step.

``TrainingArguments(ignore_data_skip=True)`` keeps its meaning: the loader is not
restored, the resumed epoch's data starts over.

This module imports ``transformers``; ``import savable_loader`` does not. It relies on
these parts of the Trainer, checked when a ``SavableTrainer`` is built (tested with
transformers 5.23): ``Trainer._run_epoch`` (where the resumed epoch starts),
``Trainer._save_checkpoint``, ``Trainer._get_output_dir``,
``Trainer._remove_unused_columns``, ``Trainer._get_collator_with_removed_columns``,
``Trainer._train_batch_size``, and ``transformers.trainer.skip_first_batches``, which
``_run_epoch`` calls to skip the resumed epoch's first batches: it is wrapped so that
it hands back, unchanged, a loader this module restored, and calls Accelerate's
function for anything else.
"""

from __future__ import annotations

import inspect
import math
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
import transformers.trainer as _hf_trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from savable_loader.errors import LoaderUsageError, StateError
from savable_loader.loader.dataloader import SavableDataLoader
from savable_loader.state import load_file, save_file
from savable_loader.state.schema import IndexPosition, RankState

__all__ = ["LOADER_STATE_FILE", "SavableTrainer", "loader_state_path"]

#: File name of a rank's loader state inside a ``checkpoint-N/`` folder.
LOADER_STATE_FILE = "savable_loader_rank{rank}.state"

_TRAINER_PARTS = (
    "_run_epoch",
    "_save_checkpoint",
    "_get_output_dir",
    "_remove_unused_columns",
    "_get_collator_with_removed_columns",
)
_SAMPLING = ("random", "sequential")

#: Loaders restored by a SavableTrainer whose resumed epoch skips its first batches:
#: ``skip_first_batches`` hands them back unchanged (they continue where they were).
_CONTINUING: weakref.WeakKeyDictionary[SavableDataLoader, int] = weakref.WeakKeyDictionary()
_hook_lock = threading.Lock()


def loader_state_path(checkpoint: str | os.PathLike[str], rank: int) -> Path:
    """Where :class:`SavableTrainer` keeps data-parallel rank ``rank``'s loader state.

    Example::

        state = sl.state.load_file(loader_state_path("out/checkpoint-500", 0))
    """
    return Path(checkpoint) / LOADER_STATE_FILE.format(rank=rank)


@dataclass
class _Restored:
    """A loader restored from a checkpoint, and where it continues."""

    loader: SavableDataLoader
    checkpoint: str
    epoch: int | None  # None: a position not counted in batches (pipelines)
    batches: int
    at_epoch_end: bool  # nothing left of the saved epoch: its (empty) rest comes first


def _check_transformers() -> None:
    missing = [f"Trainer.{name}" for name in _TRAINER_PARTS if not callable(getattr(transformers.Trainer, name, None))]
    if not callable(getattr(_hf_trainer, "skip_first_batches", None)):
        missing.append("transformers.trainer.skip_first_batches")
    if missing:
        raise LoaderUsageError(
            f"SavableTrainer needs {', '.join(missing)}, which transformers {transformers.__version__} does not "
            "have; it is tested with transformers 5.23"
        )


def _install_skip_hook() -> None:
    """Wrap ``transformers.trainer.skip_first_batches`` once per process (see module doc)."""
    with _hook_lock:
        original = _hf_trainer.skip_first_batches
        if getattr(original, "__savable_loader_hook__", False):
            return

        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            expected = _CONTINUING.pop(dataloader, None) if isinstance(dataloader, SavableDataLoader) else None
            if expected is None:
                return original(dataloader, num_batches)
            if num_batches != expected:
                raise StateError(
                    f"the Trainer skips {num_batches} batches of the resumed epoch, the restored loader has "
                    f"consumed {expected}"
                )
            return dataloader

        skip_first_batches.__savable_loader_hook__ = True  # type: ignore[attr-defined]
        skip_first_batches.__wrapped__ = original  # type: ignore[attr-defined]
        _hf_trainer.skip_first_batches = skip_first_batches


def _rank(loader: SavableDataLoader) -> int:
    """The loader's data-parallel rank (resolved when its WorkerConfig was built)."""
    return loader.worker_config.rank or 0


def _is_hf_dataset(dataset: Any) -> bool:
    if not transformers.utils.is_datasets_available():
        return False
    import datasets  # type: ignore[import-untyped]

    return isinstance(dataset, datasets.Dataset)


class SavableTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose training data resumes exactly from its checkpoints.

    Takes the Trainer's arguments, unchanged. See the module docstring for what it
    changes. Example::

        trainer = SavableTrainer(model=model, args=TrainingArguments("out", save_steps=500),
                                 train_dataset=train)
        trainer.train(resume_from_checkpoint=True)
    """

    _savable_loader: SavableDataLoader | None = None
    _savable_resume: str | None = None
    _savable_restored: _Restored | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_transformers()
        super().__init__(*args, **kwargs)
        _install_skip_hook()

    # -- the loader -------------------------------------------------------------------

    def get_train_dataloader(self) -> SavableDataLoader:
        """The training loader: a SavableDataLoader built from the Trainer's arguments,
        restored from the checkpoint ``train()`` resumes from, if any."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        loader = self.build_train_loader(self.train_dataset)
        self._savable_loader = loader
        self._savable_restored = None
        if self._savable_resume is not None and not self.args.ignore_data_skip:
            self._savable_restored = self._restore(loader, self._savable_resume)
        return loader

    def build_train_loader(self, train_dataset: Any) -> SavableDataLoader:
        """A new SavableDataLoader over ``train_dataset`` with the Trainer's arguments.

        Override it to change an argument; keep the loader a SavableDataLoader.
        """
        args = self.args
        dataset, collator = train_dataset, self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        strategy = args.train_sampling_strategy
        if strategy not in _SAMPLING and not iterable:
            raise LoaderUsageError(
                f"SavableTrainer supports train_sampling_strategy {' or '.join(map(repr, _SAMPLING))}, got {strategy!r}"
            )
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != args.world_size:
            raise LoaderUsageError(
                f"SavableTrainer splits the data over torch.distributed's {world} processes, but "
                f"TrainingArguments.world_size is {args.world_size}: model parallelism (tensor, sequence, "
                "context) is not supported"
            )
        return SavableDataLoader(
            dataset,
            batch_size=self._train_batch_size,
            shuffle=strategy == "random" and not iterable,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            drop_last=args.dataloader_drop_last,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            in_order=args.dataloader_in_order,
        )

    # -- checkpoints ------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; a resume restores the training loader of every rank."""
        checkpoint: str | None = None
        if resume_from_checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        elif not isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint is not None:
            checkpoint = os.fspath(resume_from_checkpoint)
        self._savable_resume = checkpoint
        try:
            return super().train(
                resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        finally:
            self._savable_resume = None
            self._savable_restored = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        loader = self._savable_loader
        if loader is not None:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            save_file(loader_state_path(folder, _rank(loader)), loader.save_state_rank())
            if self.args.world_size > 1:
                self.accelerator.wait_for_everyone()  # every rank's file exists before trainer_state.json
        super()._save_checkpoint(model, trial)

    def _restore(self, loader: SavableDataLoader, checkpoint: str) -> _Restored:
        rank = _rank(loader)
        path = loader_state_path(checkpoint, rank)
        if not path.is_file():
            raise StateError(
                f"{path} does not exist: {checkpoint} was not written by SavableTrainer (or not by rank {rank}), so "
                "this rank's data position cannot be restored exactly. Resume from a checkpoint SavableTrainer "
                "wrote, or pass TrainingArguments(ignore_data_skip=True) to start the resumed epoch's data over"
            )
        state = load_file(path)
        if not isinstance(state, RankState):
            raise StateError(f"{path} holds {type(state).__qualname__}, expected one rank's RankState")
        loader.restore_state_rank(state)
        position = loader.save_state_rank().position
        if not isinstance(position, IndexPosition):
            return _Restored(loader, checkpoint, None, 0, False)
        per_batch = loader.batch_size or 1
        batches = math.ceil(position.consumed / per_batch)
        at_end = position.consumed > 0 and batches >= len(loader)
        return _Restored(loader, checkpoint, position.epoch, batches, at_end)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        restored, self._savable_restored = self._savable_restored, None
        if restored is not None:
            bound = inspect.signature(transformers.Trainer._run_epoch).bind(self, *args, **kwargs).arguments
            self._continue(restored, bound["train_dataloader"], bound["epoch"], bound["steps_trained_in_current_epoch"])
        return super()._run_epoch(*args, **kwargs)

    def _continue(self, restored: _Restored, dataloader: Any, epoch: int, skipped: int) -> None:
        """Check the restored loader against the Trainer's resume point; let it continue."""
        loader = restored.loader
        if dataloader is not loader:
            raise LoaderUsageError(
                "the Trainer iterates another loader than the one SavableTrainer built and restored "
                f"({type(dataloader).__qualname__}); keep get_train_dataloader() returning build_train_loader()'s loader"
            )
        if restored.epoch is not None:
            at = (restored.epoch + 1, 0) if restored.at_epoch_end else (restored.epoch, restored.batches)
            if at != (epoch, skipped):
                raise StateError(
                    f"the loader state in {restored.checkpoint} is at epoch {at[0]}, batch {at[1]} of {len(loader)}; "
                    f"the Trainer's state resumes at epoch {epoch}, batch {skipped}: were the batch size, "
                    "gradient_accumulation_steps or the number of processes changed since the checkpoint?"
                )
            if restored.at_epoch_end:
                for _ in loader:  # the saved epoch's empty rest
                    raise StateError(f"the loader state in {restored.checkpoint} has batches left in a finished epoch")
        if skipped:
            _CONTINUING[loader] = skipped
