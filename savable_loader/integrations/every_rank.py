"""EveryRankState: a loader's state for frameworks that ask every rank and keep rank 0's.

Accelerate's ``save_state`` and Lightning Fabric's ``save`` call ``state_dict()`` of the
objects they checkpoint on every process and write the main process's answer. The
loader's own ``state_dict()`` answers with this rank's entry only (never a collective):
another rank then derives its position from rank 0's where it can (the loader's own
order, torch's ``DistributedSampler``: see ``savable_loader/index/rank_zero.py``). Where it
cannot (a savable pipeline, a sampler of the user's), put this object where the loader's
state goes: its ``state_dict()`` gathers every rank's entry into rank 0's answer (a
collective, run where the framework asks every rank), and its ``load_state_dict()``
gives each rank its own.

With Accelerate, one line in place of ``accelerator.register_for_checkpointing(loader)``::

    from savable_loader.integrations import EveryRankState

    accelerator.register_for_checkpointing(EveryRankState(loader))
    accelerator.save_state(folder)        # every process, as usual
    accelerator.load_state(folder)        # the loader continues where it was saved

It also states that nothing holds batches fetched ahead of the loader (a loader without
``len()`` whose epochs a framework sets refuses ``state_dict()`` mid-epoch unless a hook
says so: see ``savable_loader/core/frameworks.py``).
Call its ``state_dict()`` on every rank of the data-parallel group, or on none.
"""

from __future__ import annotations

from typing import Any

from savable_loader.core.frameworks import claim
from savable_loader.errors import UsageTypeError
from savable_loader.index.rank_zero import entries_of_every_rank
from savable_loader.loader.dataloader import SavableDataLoader

__all__ = ["EveryRankState"]


class EveryRankState:
    """The state of ``loader`` with every data-parallel rank's entry, for checkpoints that
    keep rank 0's answer. See the module docstring. Example::

        accelerator.register_for_checkpointing(EveryRankState(loader))
    """

    #: How the loader's messages name the hook that claimed it.
    hook = "EveryRankState"

    def __init__(self, loader: SavableDataLoader) -> None:
        if not isinstance(loader, SavableDataLoader):
            raise UsageTypeError(f"{type(self).__name__} needs a SavableDataLoader, got {type(loader).__qualname__}")
        self.loader = loader
        claim(loader, self.hook)

    def state_dict(self) -> dict[str, bytes]:
        """On global rank 0, every rank's entry where another rank's position cannot be
        derived from rank 0's (a collective: call it on every rank); else this rank's."""
        loader = self.loader
        with loader._iterations.lock:
            state = loader._save(0)
        return entries_of_every_rank(loader, state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loader from this rank's entry (or derive it from rank 0's)."""
        self.loader.load_state_dict(state_dict)
