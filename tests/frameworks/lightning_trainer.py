"""A Lightning Trainer with SavableDataLoader where the DataLoader goes (CPU).

``run(out, run, devices, how)``, called by ``lightning_scenarios.py``. RUN is ``ref``
(15 steps, ``ModelCheckpoint(every_n_train_steps=3)``) or ``resume-<S>``
(``trainer.fit(ckpt_path=<ref's step=S.ckpt>)``). With 2 devices the Trainer runs DDP
(gloo) with its default settings. HOW is where the loader comes from:

* ``module``: the map-style loader from ``train_dataloader()``;
* ``pipeline``: a savable pipeline (no ``len()``) from ``train_dataloader()``, with the
  ``SavableLoaderCallback`` it needs (Lightning fetches a batch ahead of it; on 2 devices
  every rank's state goes in rank 0's checkpoint);
* ``before-fit``: the loader is built before ``trainer.fit(model, loader)`` (before the
  process group exists, so on 2 devices Lightning rebuilds it with a ``DistributedSampler``).
"""

from __future__ import annotations

from pathlib import Path

import _common as c
import lightning as L

import savable_loader as sl
from savable_loader.integrations.lightning import SavableLoaderCallback

HOWS = ("module", "pipeline", "before-fit")


def run(out: Path, run: str, devices: int, how: str) -> None:
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin, _ = c.make_model()

        def training_step(self, batch, batch_idx):
            loss = c.loss_of(self.lin, batch)
            c.log_step(out, run, self.global_rank, self.global_step + 1, self.current_epoch, batch, loss)
            return loss

        def configure_optimizers(self):
            return c.make_model_optimizer(self.lin)

    class ModelWithData(Model):
        def train_dataloader(self):
            if how == "pipeline":
                from _pipeline import pipeline_loader

                return pipeline_loader(self.trainer.world_size)
            return sl.SavableDataLoader(
                c.Augmented(c.dataset_len(self.trainer.world_size)),
                batch_size=c.BATCH,
                shuffle=True,
                num_workers=c.WORKERS,
            )

    L.seed_everything(0, verbose=False)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / f"ckpt_{run}", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        max_steps=c.TOTAL_STEPS,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        callbacks=[checkpoints, SavableLoaderCallback()] if how == "pipeline" else [checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    ckpt = str(out / "ckpt_ref" / f"step={run.split('-')[1]}.ckpt") if run.startswith("resume-") else None
    if how == "before-fit":
        loader = sl.SavableDataLoader(
            c.Augmented(c.dataset_len(devices)), batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS
        )
        trainer.fit(Model(), train_dataloaders=loader, ckpt_path=ckpt)
    else:
        trainer.fit(ModelWithData(), ckpt_path=ckpt)
