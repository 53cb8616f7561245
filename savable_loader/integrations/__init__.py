"""Integrations with training frameworks: explicit objects a user adds, one module per
framework.

Importing ``savable_loader`` or this package imports no framework: each module imports
its framework when it is itself imported, and the loader never looks at who calls it.
What a user adds, per framework (docs/lightning.md, docs/accelerate.md,
docs/transformers.md):

* :mod:`savable_loader.integrations.lightning`: ``SavableLoaderCallback``, for Lightning's
  Trainer with a savable pipeline, a sampler of the user's or a loader without ``len()``;
* :mod:`savable_loader.integrations.fabric`: ``FabricLoaderState``, the loader in
  Fabric's checkpoint state, for the same loaders;
* :class:`EveryRankState` (:mod:`savable_loader.integrations.every_rank`), for
  Accelerate's ``register_for_checkpointing``, for the same loaders;
* :mod:`savable_loader.integrations.transformers`: ``SavableTrainer``, the Hugging Face
  ``Trainer`` with exact data resume.

A loader with its own order (or torch's ``DistributedSampler``) needs none of them under
Lightning, Fabric and Accelerate; ``torch.distributed.checkpoint`` needs none for any.

May import: ``loader``, ``index``, ``core``, ``state``, ``errors`` (frameworks only inside their own module, imported lazily).

Example::

    from savable_loader.integrations.transformers import SavableTrainer

    trainer = SavableTrainer(model=model, args=args, train_dataset=train)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)
"""

from __future__ import annotations

from typing import Any

__all__ = ["EveryRankState"]


def __getattr__(name: str) -> Any:
    if name == "EveryRankState":
        from savable_loader.integrations.every_rank import EveryRankState

        return EveryRankState
    raise AttributeError(f"module 'savable_loader.integrations' has no attribute {name!r}")
