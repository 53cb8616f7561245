"""Lightning Fabric with SavableDataLoader where the DataLoader goes (CPU).

``run(out, run, devices)``, called by ``lightning_scenarios.py``. A loop as Fabric's docs
write it: ``fabric.setup_dataloaders(loader)``, the loader in the state given to
``fabric.save`` / ``fabric.load``, the loop counting its own epochs (saved in the state)
and steps. RUN is ``ref`` (saves at steps 6 and 9) or ``resume-<S>``. With 2 devices
Fabric runs DDP (gloo) with its default settings.
"""

from __future__ import annotations

from pathlib import Path

import _common as c
import lightning as L

import savable_loader as sl

EPOCHS = 3


def run(out: Path, run: str, devices: int) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    model, opt = c.make_model()
    model, opt = fabric.setup(model, opt)
    loader = sl.SavableDataLoader(
        c.Augmented(c.dataset_len(fabric.world_size)), batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS
    )
    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0, "epoch": 0}
    if run.startswith("resume-"):
        fabric.load(out / "ckpt" / f"step-{run.split('-')[1]}.ckpt", state)

    for epoch in range(state["epoch"], EPOCHS):
        state["epoch"] = epoch
        for batch in loader:
            state["step"] += 1
            loss = c.loss_of(model, batch)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            c.log_step(out, run, fabric.global_rank, state["step"], epoch, batch, loss)
            if run == "ref" and state["step"] in c.SAVE_STEPS:
                fabric.save(out / "ckpt" / f"step-{state['step']}.ckpt", state)
            if state["step"] == c.TOTAL_STEPS:
                return
