"""What the loader knows of the training frameworks that drive it, without asking who calls.

The loader never reads its caller's stack: a framework that needs more than torch's
``state_dict()`` / ``load_state_dict()`` is given it by an explicit object the user adds
(``savable_loader/integrations/``), which *claims* the loader (:func:`claim`). What is
left here is what holds whoever calls:

* **Rebuilt loaders.** Accelerate's ``prepare()`` and ``skip_first_batches`` (which the
  Hugging Face ``Trainer`` calls when it resumes mid-epoch) build a plain ``DataLoader``
  from a loader's attributes. The loader never iterates its own batch sampler (nor
  ``loader.sampler``): a DataLoader built from them is the only thing that does, and its
  first batch raises :func:`rebuild_error`. A savable pipeline is iterated by the loader
  only inside the loader's worker context (``config._ActiveWorker``):
  :func:`check_not_rebuilt` refuses a pipeline iterated outside it in a worker process of
  a torch DataLoader, or in the main process while a SavableDataLoader owns the
  pipeline's ``WorkerConfig`` (:func:`own`).
* **Batches fetched ahead.** Lightning's training loop fetches one batch ahead of a
  loader without ``len()`` and asks for the state while that batch waits: a state that
  counts it would skip it on resume. The loader cannot see that. What it sees is the
  epoch protocol Lightning's Trainer (and Fabric's loader wrapper) drive every loader
  with: ``loader.sampler.set_epoch(e)`` before each epoch (a loader without ``len()``
  shows a ``PipelineSampler`` there, which records the call: :func:`note_epochs_set`).
  ``state_dict()`` of such a loader mid-epoch, once its epochs were set that way, is
  refused unless a hook claimed the loader (:func:`check_nothing_held`):
  ``SavableLoaderCallback`` leaves the held batch out, ``FabricLoaderState`` and
  ``EveryRankState`` state that nothing is held. DCP, Accelerate and loops of one's own
  do not call it, and are left alone.

Example::

    claim(loader, "SavableLoaderCallback")   # an integration's hook takes the saves
    check_not_rebuilt(worker_config)         # a pipeline's source, outside a loader's worker
"""

from __future__ import annotations

from typing import Any

from savable_loader.errors import LoaderUsageError

__all__ = [
    "HOOKS",
    "check_not_rebuilt",
    "check_nothing_held",
    "claim",
    "claimed_by",
    "note_epochs_set",
    "rebuild_error",
]

#: What each framework's user adds (the docs' table, in the errors' advice).
HOOKS = {
    "Lightning": "Trainer(callbacks=[savable_loader.integrations.lightning.SavableLoaderCallback()])",
    "Fabric": 'state["loader"] = savable_loader.integrations.fabric.FabricLoaderState(loader) for fabric.save/load',
    "Accelerate": "accelerator.register_for_checkpointing(savable_loader.integrations.EveryRankState(loader))",
    "HF Trainer": "savable_loader.integrations.transformers.SavableTrainer in place of Trainer",
}

_CLAIM = "_savable_hook"
_EPOCHS_SET = "_savable_epochs_set"


def claim(loader: Any, hook: str) -> None:
    """Record that ``hook`` (an integration's object) takes ``loader``'s framework saves."""
    loader.__dict__[_CLAIM] = hook


def claimed_by(loader: Any) -> str | None:
    """The hook that claimed ``loader`` (None: none)."""
    hook = loader.__dict__.get(_CLAIM)
    return None if hook is None else str(hook)


def note_epochs_set(loader: Any) -> None:
    """``loader.sampler.set_epoch`` was called (Lightning's Trainer and Fabric's loader
    wrapper do, before every epoch)."""
    loader.__dict__[_EPOCHS_SET] = True


def check_nothing_held(loader: Any, has_length: bool, mid_epoch: bool) -> None:
    """Refuse ``state_dict()`` of a loader without ``len()`` in the middle of an epoch
    whose epochs a framework sets (``loader.sampler.set_epoch``: Lightning's Trainer,
    Fabric) while no hook claimed the loader (see the module doc): Lightning's loop may
    hold a batch fetched ahead that the state would count."""
    if has_length or not mid_epoch or claimed_by(loader) is not None or not loader.__dict__.get(_EPOCHS_SET):
        return
    raise LoaderUsageError(
        "state_dict() of a loader without len() in the middle of an epoch, after loader.sampler.set_epoch() was "
        "called (Lightning's Trainer and Fabric do): Lightning's Trainer fetches one batch ahead of such a loader, "
        "and a state that counted it would skip it on resume (nothing in the state tells). Under Lightning's Trainer "
        f"add {HOOKS['Lightning']}, which leaves that batch out; under Fabric put "
        "savable_loader.integrations.fabric.FabricLoaderState(loader) in the saved state in place of the loader; "
        "elsewhere save through savable_loader.integrations.EveryRankState(loader), or call loader.save_state_rank()"
    )


def check_not_rebuilt(worker_config: Any) -> None:
    """Raise :class:`LoaderUsageError` if a savable pipeline is iterated outside the
    worker context of a SavableDataLoader (``worker_config.rank_worker_id()`` found none)
    in a worker process of a torch DataLoader: each worker would read the same data (a
    DataLoader rebuilt from the loader's attributes by ``accelerator.prepare``). In the
    main process the pipeline may be iterated by hand (it reads worker 0's share); a plain
    DataLoader rebuilt there with ``num_workers=0`` cannot be told from that without
    reading the caller's stack, and is documented as unsupported (docs/accelerate.md)."""
    from torch.utils.data import get_worker_info  # torch is imported by whoever iterates

    if get_worker_info() is not None:
        raise rebuild_error("dataset", worker=True)


def rebuild_error(what: str = "sampler", worker: bool = False) -> LoaderUsageError:
    """The error a SavableDataLoader's batch sampler (or pipeline: ``what="dataset"``)
    raises when something other than the loader iterates it: a plain DataLoader that
    Accelerate's ``prepare()`` or ``skip_first_batches`` built from the loader's
    attributes (the Hugging Face Trainer calls the latter when it resumes mid-epoch)."""
    where = (
        "in a worker process of a torch DataLoader that no SavableDataLoader runs (its workers would all read the "
        "same data)"
        if worker
        else "by something other than the SavableDataLoader that owns it (or after that loader is gone)"
    )
    return LoaderUsageError(
        f"the SavableDataLoader's {what} is used {where}: typically a plain DataLoader that "
        "accelerator.prepare(loader) or skip_first_batches(loader, n) rebuilt from the loader's attributes. That "
        "DataLoader can neither save nor restore the position, and its batches would differ from the loader's "
        "(other augmentations; on several processes, other samples). With Accelerate: do not pass the loader to "
        "accelerator.prepare() nor to skip_first_batches() (it splits the data over the processes itself); register "
        f"it with {HOOKS['Accelerate']} (or accelerator.register_for_checkpointing(loader) for a loader with its own "
        "order or a DistributedSampler) and after load_state() iterate it as it is: it continues where it was "
        f"saved, no batch to skip. With the Hugging Face Trainer (which skips a resumed epoch's first batches "
        f"that way): use {HOOKS['HF Trainer']} and let it build the loader. To iterate a pipeline by hand, iterate "
        "the loader, or build the pipeline with a WorkerConfig of its own"
    )
