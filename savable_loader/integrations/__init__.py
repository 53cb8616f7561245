"""Integrations with training frameworks, one module per framework.

Importing ``savable_loader`` or this package imports no framework: each module imports
its framework when it is itself imported.

* :mod:`savable_loader.integrations.transformers`: ``SavableTrainer``, the Hugging Face
  ``Trainer`` with exact data resume.

Lightning (Trainer and Fabric), Accelerate and ``torch.distributed.checkpoint`` need no
module here: the loader goes where the ``DataLoader`` goes (see ``docs/``).

Example::

    from savable_loader.integrations.transformers import SavableTrainer

    trainer = SavableTrainer(model=model, args=args, train_dataset=train)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)
"""

__all__: list[str] = []
