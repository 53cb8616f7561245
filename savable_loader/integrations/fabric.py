"""FabricLoaderState: a SavableDataLoader in the state given to Lightning Fabric's
``save`` / ``load``.

Fabric needs nothing for a loader with its own order (``shuffle=True`` without a
sampler): ``fabric.setup_dataloaders(loader)`` and the loader in the state resume every
rank exactly. For a savable pipeline or a sampler of the user's, change one line::

    from savable_loader.integrations.fabric import FabricLoaderState

    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": opt, "loader": FabricLoaderState(loader)}
    fabric.save(path, state)      # every rank's loader entry, in rank 0's file
    fabric.load(path, state)      # each rank continues where it was

What it does (see :class:`~savable_loader.integrations.EveryRankState`): its
``state_dict()``, which Fabric calls on every rank, gathers every rank's entry into rank
0's answer where another rank's position cannot be derived from rank 0's; and the
loader's epochs follow the loader's own count, not the count Fabric's loader wrapper
passes to the samplers' ``set_epoch`` before each ``iter()`` (its iterations in this
process: 0 again in a resumed one).

This module imports no framework: it takes the loader Fabric's ``setup_dataloaders``
returned (its ``_dataloader``, checked) or the SavableDataLoader itself.
"""

from __future__ import annotations

from typing import Any

from savable_loader.errors import LoaderUsageError
from savable_loader.integrations.every_rank import EveryRankState
from savable_loader.loader.dataloader import SavableDataLoader

__all__ = ["FabricLoaderState"]


def _unwrap(loader: Any) -> Any:
    """The SavableDataLoader inside Fabric's ``_FabricDataLoader`` (or ``loader`` itself)."""
    if isinstance(loader, SavableDataLoader):
        return loader
    inner = getattr(loader, "_dataloader", None)  # lightning.fabric.wrappers._FabricDataLoader
    if isinstance(inner, SavableDataLoader):
        return inner
    raise LoaderUsageError(
        f"FabricLoaderState needs a SavableDataLoader or the loader fabric.setup_dataloaders() made of one, got "
        f"{type(loader).__qualname__}"
        + (
            " (no _dataloader attribute: is this Lightning release's _FabricDataLoader another shape?)"
            if inner is None
            else ""
        )
    )


class FabricLoaderState(EveryRankState):
    """A SavableDataLoader (or Fabric's wrapper of one) as it goes in Fabric's checkpoint
    state. See the module docstring. Example::

        state = {"model": model, "optimizer": opt, "loader": FabricLoaderState(loader)}
    """

    hook = "FabricLoaderState"

    def __init__(self, loader: Any) -> None:
        super().__init__(_unwrap(loader))
        self.loader._iterations.own_epochs = True
