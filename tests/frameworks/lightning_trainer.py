"""A Lightning Trainer with SavableDataLoader where the DataLoader goes (CPU).

    python lightning_trainer.py OUT RUN DEVICES [--pipeline | --before-fit]

RUN is ``ref`` (15 steps, ``ModelCheckpoint(every_n_train_steps=3)``) or ``resume-<S>``
(``trainer.fit(ckpt_path=<ref's step=S.ckpt>)``). With DEVICES=2 the Trainer runs DDP
(gloo) with its default settings. ``--pipeline``: a savable pipeline (no ``len()``) in
place of the map-style dataset. ``--before-fit``: the loader is built before
``trainer.fit(model, loader)`` (before the process group exists, so on 2 devices
Lightning rebuilds it with a ``DistributedSampler``), not in ``train_dataloader()``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
import lightning as L

import savable_loader as sl

OUT, RUN, DEVICES = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
PIPELINE = "--pipeline" in sys.argv
BEFORE_FIT = "--before-fit" in sys.argv


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin, _ = c.make_model()

    def training_step(self, batch, batch_idx):
        loss = c.loss_of(self.lin, batch)
        c.log_step(OUT, RUN, self.global_rank, self.global_step + 1, self.current_epoch, batch, loss)
        return loss

    def configure_optimizers(self):
        return c.make_model_optimizer(self.lin)


class ModelWithData(Model):
    def train_dataloader(self):
        if PIPELINE:
            from _pipeline import pipeline_loader

            return pipeline_loader(self.trainer.world_size)
        return sl.SavableDataLoader(
            c.Augmented(c.dataset_len(self.trainer.world_size)), batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS
        )


L.seed_everything(0, verbose=False)
checkpoints = L.pytorch.callbacks.ModelCheckpoint(
    dirpath=OUT / f"ckpt_{RUN}", every_n_train_steps=3, save_top_k=-1, filename="{step}"
)
trainer = L.Trainer(
    max_steps=c.TOTAL_STEPS,
    accelerator="cpu",
    devices=DEVICES,
    strategy="ddp" if DEVICES > 1 else "auto",
    callbacks=[checkpoints],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
ckpt = None
if RUN.startswith("resume-"):
    ckpt = str(OUT / "ckpt_ref" / f"step={RUN.split('-')[1]}.ckpt")
if BEFORE_FIT:
    loader = sl.SavableDataLoader(
        c.Augmented(c.dataset_len(DEVICES)), batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS
    )
    trainer.fit(Model(), train_dataloaders=loader, ckpt_path=ckpt)
else:
    trainer.fit(ModelWithData(), ckpt_path=ckpt)
