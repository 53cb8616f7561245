"""Lightning Fabric with SavableDataLoader where the DataLoader goes (CPU).

``run(out, run, devices, how)``, called by ``lightning_scenarios.py``. A loop as Fabric's
docs write it: ``fabric.setup_dataloaders(loader)``, the loader in the state given to
``fabric.save`` / ``fabric.load``, the loop counting its own epochs (saved in the state)
and steps. RUN is ``ref`` (saves at steps 6 and 9) or ``resume-<S>``. With 2 devices
Fabric runs DDP (gloo) with its default settings. HOW:

* ``fabric``: the loader's own order, nothing added;
* ``fabric-sampler``: torch's ``DistributedSampler`` of the user's, the loader in the state
  as ``FabricLoaderState(loader)`` (Fabric's wrapper sets the sampler's epoch to its
  per-process count, 0 again after a resume; the loader's count is used instead);
* ``fabric-pipeline``: a savable pipeline, as ``FabricLoaderState(loader)`` (on 2 devices
  every rank's state goes in rank 0's checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import _common as c
import lightning as L
from torch.utils.data import DistributedSampler

import savable_loader as sl
from savable_loader.integrations.fabric import FabricLoaderState

EPOCHS = 3


HOWS = ("fabric", "fabric-sampler", "fabric-pipeline")


def _loader(how: str, world_size: int, rank: int) -> sl.SavableDataLoader:
    if how == "fabric-pipeline":
        from _pipeline import pipeline_loader

        return pipeline_loader(world_size)
    data = c.Augmented(c.dataset_len(world_size))
    if how == "fabric-sampler":
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        return sl.SavableDataLoader(data, batch_size=c.BATCH, sampler=sampler, num_workers=c.WORKERS)
    return sl.SavableDataLoader(data, batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS)


def run(out: Path, run: str, devices: int, how: str = "fabric") -> None:
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    model, opt = c.make_model()
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(_loader(how, fabric.world_size, fabric.global_rank))
    saved = loader if how == "fabric" else FabricLoaderState(loader)
    state = {"model": model, "optimizer": opt, "loader": saved, "step": 0, "epoch": 0}
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
