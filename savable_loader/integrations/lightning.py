"""SavableLoaderCallback: Lightning's Trainer with exact resume of every loader.

Lightning's Trainer needs nothing for a map-style loader with its own order or torch's
``DistributedSampler``: it checkpoints ``loader.state_dict()`` from rank 0 and every
rank derives its position from that entry. For a savable pipeline, a sampler of the
user's or any loader without ``len()``, add one callback::

    from savable_loader.integrations.lightning import SavableLoaderCallback

    trainer = L.Trainer(..., callbacks=[SavableLoaderCallback()])
    trainer.fit(model, ckpt_path=...)          # as usual

What it does, in ``on_save_checkpoint`` (which Lightning calls on every rank while it
builds a checkpoint, after it stored the loaders' ``state_dict()``): it replaces the
entry of each SavableDataLoader of the fit loop by one that

* leaves out the batches Lightning's training loop fetched ahead and has not trained on
  (it fetches one ahead of a loader without ``len()``, in its ``_PrefetchDataFetcher``);
* holds every rank's entry in rank 0's checkpoint where another rank's position cannot
  be derived from rank 0's (a gather over the data-parallel group: a collective, safe
  here since every rank runs the hook).

It reads these parts of the Trainer, checked when the fit starts (tested with Lightning
2.6): ``trainer.fit_loop._combined_loader`` (its ``flattened`` loaders, in the order of
the checkpoint's ``loops.fit_loop.state_dict.combined_loader`` entries) and
``trainer.fit_loop._data_fetcher`` (its ``batches`` fetched ahead). A release without
them raises :class:`~savable_loader.LoaderUsageError` naming them. Checkpoints written
with ``save_weights_only=True`` skip callbacks: they hold the loaders' plain entries.

This module imports Lightning (``lightning.pytorch``, else ``pytorch_lightning``);
``import savable_loader`` does not.
"""

from __future__ import annotations

from typing import Any

from savable_loader.core.frameworks import claim
from savable_loader.errors import LoaderUsageError
from savable_loader.index.rank_zero import entries_of_every_rank
from savable_loader.loader.dataloader import SavableDataLoader

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _Stateful
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from lightning_fabric.utilities.types import _Stateful

__all__ = ["SavableLoaderCallback"]

_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")


def _fit_loop_parts(trainer: Any) -> tuple[Any, Any]:
    """``(combined loader, data fetcher)`` of the trainer's fit loop; loud when missing."""
    loop = trainer.fit_loop
    missing = [f"Trainer.fit_loop.{name}" for name in ("_combined_loader", "_data_fetcher") if not hasattr(loop, name)]
    if missing:
        raise LoaderUsageError(
            f"SavableLoaderCallback reads {', '.join(missing)}, which Lightning {pl.__version__} does not have; "
            "it is tested with Lightning 2.6"
        )
    return loop._combined_loader, loop._data_fetcher


def _savable(combined: Any) -> list[tuple[int, SavableDataLoader]]:
    """``(index among the stateful loaders, loader)`` of the SavableDataLoaders."""
    stateful = [
        loader for loader in (combined.flattened if combined is not None else ()) if isinstance(loader, _Stateful)
    ]
    return [(i, loader) for i, loader in enumerate(stateful) if isinstance(loader, SavableDataLoader)]


class SavableLoaderCallback(pl.Callback):
    """Exact resume of the Trainer's SavableDataLoaders: see the module docstring.

    Example::

        trainer = L.Trainer(max_steps=1000, callbacks=[SavableLoaderCallback()])
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._claim(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._claim(trainer)  # reload_dataloaders_every_n_epochs may have built new loaders

    def _claim(self, trainer: Any) -> None:
        combined, _ = _fit_loop_parts(trainer)
        for _, loader in _savable(combined):
            claim(loader, "SavableLoaderCallback")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Replace the SavableDataLoaders' entries (every rank runs it; see the module doc)."""
        combined, fetcher = _fit_loop_parts(trainer)
        loaders = _savable(combined)
        if not loaders:
            return
        entries: Any = checkpoint
        for key in _PATH:
            entries = entries.get(key) if isinstance(entries, dict) else None
        if not isinstance(entries, list):
            raise LoaderUsageError(
                f"SavableLoaderCallback found no list of loader states at checkpoint[{']['.join(map(repr, _PATH))}] "
                f"(Lightning {pl.__version__}); it is tested with Lightning 2.6"
            )
        held = len(getattr(fetcher, "batches", None) or ())
        flattened = list(combined.flattened)
        if held and len(flattened) != 1:
            raise LoaderUsageError(
                f"cannot save exactly: Lightning's training loop holds {held} batch(es) fetched ahead from "
                f"{len(flattened)} combined loaders, and the state of each loader cannot leave its own out; give the "
                "loaders a length (Lightning then fetches nothing ahead) or train from one loader"
            )
        for index, loader in loaders:
            with loader._iterations.lock:
                state = loader._save(held)
            entries[index] = entries_of_every_rank(loader, state)
