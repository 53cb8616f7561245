"""What the loader recognises of the training frameworks that drive it: the one place that
knows their private parts.

Frameworks call the loader from their own internals; three of those calls need the
loader to know who is calling, and this module answers by looking at the caller's stack
frames (module and function names; no framework is imported):

* **Fabric's per-process epoch count.** Lightning Fabric's loader wrapper
  (``_FabricDataLoader.__iter__``) calls ``sampler.set_epoch(n)`` before every
  ``iter()``, ``n`` counting the wrapper's iterations from 0 in each process. After a
  resume that count starts again at 0 while the data continues in a later epoch:
  :func:`fabric_iterating` tells the loader that the call or the iteration comes from
  that wrapper, and the loader keeps its own (restored) epoch count instead.
* **Checkpoints written from rank 0.** Lightning's Trainer and Fabric (DDP) and
  Accelerate's ``save_state`` ask every rank for ``state_dict()`` and write rank 0's
  answer: :func:`saving_framework` recognises those calls, so that the loader can gather
  every rank's state into rank 0's answer where another rank's position cannot be
  derived from rank 0's (``_rank_zero.py``). Lightning's training loop also fetches one
  batch ahead of a loader without ``len()`` (``_PrefetchDataFetcher``) and asks for the
  state while that batch waits: the answer counts it, so that the state leaves it out.
* **Rebuilds that bypass the loader.** Accelerate's ``prepare()`` and
  ``skip_first_batches`` build a plain ``DataLoader`` from the loader's attributes, which
  iterates the loader's sampler: :func:`rebuilt_by` names the framework (and whether the
  Hugging Face ``Trainer`` drove it) so that the loader can raise a clear error.

Each check is tested against the installed frameworks (``tests/test_frameworks.py``,
``tests/test_frameworks_detect.py``); a framework release that renames these parts makes
those tests fail rather than the loader silently misbehave.

Example::

    if fabric_iterating():          # inside OrderSampler.set_epoch
        return                      # the loader counts its epochs itself
    saving_framework(loader)        # inside state_dict: FrameworkSave("Lightning", held=1)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

from savable_loader.errors import LoaderUsageError

__all__ = [
    "FABRIC_WRAPPERS",
    "FrameworkSave",
    "check_not_rebuilt",
    "fabric_iterating",
    "rebuild_error",
    "rebuilt_by",
    "saving_framework",
]

#: Modules of Fabric's ``_FabricDataLoader`` (``lightning`` and the standalone package).
FABRIC_WRAPPERS = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")
#: How many frames up a check looks (the framework's frame is a few calls away; a
#: rebuilt loader's, below torch's iterator and a pipeline's wrappers, more).
_DEPTH = 12
_REBUILD_DEPTH = 40


def _frames(skip: int, depth: int = _DEPTH) -> list[FrameType]:
    """The ``depth`` frames above the caller of the caller of this function."""
    frames: list[FrameType] = []
    try:
        frame: FrameType | None = sys._getframe(skip + 1)
    except ValueError:  # pragma: no cover - a stack shallower than skip
        return frames
    while frame is not None and len(frames) < depth:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def fabric_iterating() -> bool:
    """Whether Fabric's loader wrapper (``_FabricDataLoader.__iter__``) is on the stack:
    the caller is its ``set_epoch`` call or its ``iter()`` of the loader."""
    return any(_module(f) in FABRIC_WRAPPERS and f.f_code.co_name == "__iter__" for f in _frames(2))


@dataclass(frozen=True)
class FrameworkSave:
    """A framework asking for the loader's state while it writes a checkpoint.

    ``name``: which one; ``held``: batches the loader yielded that the training loop
    fetched ahead and has not trained on yet (Lightning's prefetch of a loader without
    ``len()``); ``every_rank``: the framework asks every data-parallel rank at this point
    (so a collective is safe there) and writes the answer of global rank 0 only.
    """

    name: str
    held: int = 0
    every_rank: bool = True


#: Framework functions that ask every rank for ``state_dict()`` and write rank 0's answer:
#: ``(module, function) -> framework``.
_SAVES = {
    ("lightning.pytorch.loops.fit_loop", "on_save_checkpoint"): "Lightning",
    ("pytorch_lightning.loops.fit_loop", "on_save_checkpoint"): "Lightning",
    ("lightning.fabric.strategies.strategy", "_convert_stateful_objects_in_state"): "Fabric",
    ("lightning_fabric.strategies.strategy", "_convert_stateful_objects_in_state"): "Fabric",
    ("accelerate.checkpointing", "save_custom_state"): "Accelerate",
}


def saving_framework(loader: Any) -> FrameworkSave | None:
    """The framework whose checkpoint asks for ``loader``'s state, if one is recognised.

    Raises ``LookupError`` when Lightning's loop holds batches fetched ahead from a
    combination of loaders (a ``CombinedLoader`` of several), which cannot be told apart."""
    for frame in _frames(2):
        name = _SAVES.get((_module(frame), frame.f_code.co_name))
        if name is None:
            continue
        if name != "Lightning":
            return FrameworkSave(name)
        loop = frame.f_locals.get("self")
        held = len(getattr(getattr(loop, "_data_fetcher", None), "batches", None) or ())
        if held:
            flattened = list(getattr(getattr(loop, "_combined_loader", None), "flattened", None) or ())
            if not (len(flattened) == 1 and flattened[0] is loader):
                raise LookupError(
                    f"Lightning's training loop holds {held} batch(es) fetched ahead from {len(flattened)} combined "
                    "loaders"
                )
        return FrameworkSave(name, held)
    return None


def rebuilt_by() -> tuple[str, bool] | None:
    """``(framework, under_hf_trainer)`` if a loader that a framework rebuilt from a
    SavableDataLoader's attributes is iterating (Accelerate's ``prepare()`` or
    ``skip_first_batches``), else None. ``under_hf_trainer``: the Hugging Face
    ``Trainer`` drove it (its resume skips batches with ``skip_first_batches``)."""
    frames = _frames(1, _REBUILD_DEPTH)
    if not any(_module(f) == "accelerate.data_loader" for f in frames):
        return None
    frame: FrameType | None = frames[0]
    while frame is not None:  # the Trainer's frame may be anywhere further up
        if _module(frame) == "transformers.trainer":
            return "Accelerate", True
        frame = frame.f_back
    return "Accelerate", False


def check_not_rebuilt() -> None:
    """Raise :class:`LoaderUsageError` if a savable pipeline is iterated by a loader a
    framework rebuilt (in its worker processes, or in the main process by Accelerate):
    called where a pipeline asks which worker it runs in, outside a SavableDataLoader."""
    rebuilt = rebuilt_by()
    if rebuilt is not None:
        raise rebuild_error(*rebuilt, what="dataset")
    from torch.utils.data import (
        get_worker_info,  # torch is imported by whoever iterates
    )

    if get_worker_info() is not None:
        raise LoaderUsageError(
            "a SavableDataset is iterated in a worker process of a torch DataLoader that no SavableDataLoader runs "
            "(for example one that accelerator.prepare(loader) or skip_first_batches(loader, n) rebuilt from a "
            "SavableDataLoader's attributes): its workers would all read the same data, and no position can be "
            "saved. Iterate the pipeline with a SavableDataLoader (with Accelerate: "
            "accelerator.register_for_checkpointing(loader) in place of prepare())"
        )


def rebuild_error(framework: str, hf_trainer: bool, what: str = "sampler") -> LoaderUsageError:
    """The error a SavableDataLoader's sampler (or pipeline: ``what="dataset"``) raises
    when a loader ``framework`` rebuilt from the SavableDataLoader's attributes uses it
    (see :func:`rebuilt_by`)."""
    if hf_trainer:
        advice = (
            "the Hugging Face Trainer skips the resumed epoch's first batches that way. Use "
            "savable_loader.integrations.transformers.SavableTrainer in place of Trainer (and let it build the "
            "loader): it restores the loader instead of skipping batches"
        )
    else:
        advice = (
            "Do not pass the loader to accelerator.prepare() nor to skip_first_batches(): it splits the data over "
            "the processes itself. Register it with accelerator.register_for_checkpointing(loader) so that "
            "save_state()/load_state() carry its position; after load_state() iterate it as it is (it continues "
            "where it was saved, no batch to skip)"
        )
    return LoaderUsageError(
        f"a DataLoader that {framework} rebuilt from a SavableDataLoader's attributes (accelerator.prepare(loader) "
        f"or skip_first_batches(loader, n)) is using the SavableDataLoader's {what}: that plain DataLoader can "
        "neither save nor restore the position, and its batches would differ from the SavableDataLoader's (other "
        f"augmentations; on several processes, other samples). {advice}"
    )
