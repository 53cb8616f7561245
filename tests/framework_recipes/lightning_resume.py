"""The Lightning recipe of docs/recipes.md under a real Trainer (CPU).

    python lightning_resume.py ref|crash|resume OUT DEVICES

Logs ``step digest loss`` per step and rank to ``OUT/MODE.rank<r>.log``; ``crash`` dies
after step 10 (checkpoints every 4 steps), ``resume`` continues from step 8.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes_ns import recipe_namespace

ns = recipe_namespace("class PointsData")
MODE, OUT, DEVICES = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 1)

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.lin(x), y)
        digest = hashlib.blake2b(x.numpy().tobytes() + y.numpy().tobytes(), digest_size=8).hexdigest()
        with open(OUT / f"{MODE}.rank{self.global_rank}.log", "a") as f:
            f.write(f"{self.global_step + 1} {digest} {loss.item().hex()}\n")
        if MODE == "crash" and self.global_step + 1 == 10:
            os._exit(1)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


checkpoints = L.pytorch.callbacks.ModelCheckpoint(
    dirpath=OUT / f"ckpt_{MODE}", every_n_train_steps=4, save_top_k=-1, filename="{step}")
trainer = L.Trainer(max_steps=20, accelerator="cpu", devices=DEVICES, strategy="ddp" if DEVICES > 1 else "auto",
                    callbacks=[checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(), datamodule=ns["PointsData"](),
            ckpt_path=str(OUT / "ckpt_crash" / "step=8.ckpt") if MODE == "resume" else None)
