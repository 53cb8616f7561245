"""torch.distributed.checkpoint under torchrun (gloo, CPU) with the loader in the state.

    torchrun --nproc-per-node N dcp_loop.py OUT RUN

A plain training loop over DDP that puts the loader, with the model and the optimizer,
in the dict given to ``dcp.save`` / ``dcp.load`` on every rank. RUN is ``ref`` (saves at
steps 6 and 9) or ``resume-<S>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import savable_loader as sl

OUT, RUN = Path(sys.argv[1]), sys.argv[2]
EPOCHS = 3


class TrainState(Stateful):
    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt
        self.step = self.epoch = 0

    def state_dict(self):
        model_sd, opt_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "opt": opt_sd, "step": self.step, "epoch": self.epoch}

    def load_state_dict(self, sd) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["opt"])
        self.step, self.epoch = sd["step"], sd["epoch"]


dist.init_process_group("gloo")
lin, _ = c.make_model()
model = torch.nn.parallel.DistributedDataParallel(lin)
opt = c.make_model_optimizer(model)
loader = sl.SavableDataLoader(
    c.Augmented(c.dataset_len(dist.get_world_size())), batch_size=c.BATCH, shuffle=True, num_workers=c.WORKERS
)
train = TrainState(model, opt)
if RUN.startswith("resume-"):
    dcp.load({"train": train, "loader": loader}, checkpoint_id=str(OUT / "dcp" / f"step-{RUN.split('-')[1]}"))

for epoch in range(train.epoch, EPOCHS):
    train.epoch = epoch
    for batch in loader:
        train.step += 1
        loss = c.loss_of(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        c.log_step(OUT, RUN, dist.get_rank(), train.step, epoch, batch, loss)
        if RUN == "ref" and train.step in c.SAVE_STEPS:
            dcp.save({"train": train, "loader": loader}, checkpoint_id=str(OUT / "dcp" / f"step-{train.step}"))
        if train.step == c.TOTAL_STEPS:
            break
    if train.step == c.TOTAL_STEPS:
        break
dist.destroy_process_group()
