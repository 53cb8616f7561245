"""Lightning Fabric with SavableDataLoader where the DataLoader goes (CPU).

    python fabric_loop.py OUT RUN DEVICES

A loop as Fabric's docs write it: ``fabric.setup_dataloaders(loader)``, the loader in the
state given to ``fabric.save`` / ``fabric.load``, the loop counting its own epochs (saved
in the state) and steps. RUN is ``ref`` (saves at steps 6 and 9) or ``resume-<S>``.
With DEVICES=2 Fabric runs DDP (gloo) with its default settings.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
import lightning as L

import savable_loader as sl

OUT, RUN, DEVICES = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
EPOCHS = 3

fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy="ddp" if DEVICES > 1 else "auto")
fabric.launch()
fabric.seed_everything(0, verbose=False)
model, opt = c.make_model()
model, opt = fabric.setup(model, opt)
loader = sl.SavableDataLoader(
    c.Augmented(c.dataset_len(fabric.world_size)), batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS
)
loader = fabric.setup_dataloaders(loader)
state = {"model": model, "optimizer": opt, "loader": loader, "step": 0, "epoch": 0}
if RUN.startswith("resume-"):
    fabric.load(OUT / "ckpt" / f"step-{RUN.split('-')[1]}.ckpt", state)

for epoch in range(state["epoch"], EPOCHS):
    state["epoch"] = epoch
    for batch in loader:
        state["step"] += 1
        loss = c.loss_of(model, batch)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        c.log_step(OUT, RUN, fabric.global_rank, state["step"], epoch, batch, loss)
        if RUN == "ref" and state["step"] in c.SAVE_STEPS:
            fabric.save(OUT / "ckpt" / f"step-{state['step']}.ckpt", state)
        if state["step"] == c.TOTAL_STEPS:
            break
    if state["step"] == c.TOTAL_STEPS:
        break
