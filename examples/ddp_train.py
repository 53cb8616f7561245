"""Data-parallel training with exact data resume: torchrun + gloo on CPU.

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 40 --ckpt ckpt/
    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 40 --ckpt ckpt/ --resume

Every ``--ckpt-every`` steps the checkpoint hook writes the model (rank 0) and the
loader states of all ranks gathered to rank 0 (``save_state_global(0)``) into one file.
``--resume`` restores both: rank 0 reads the file and the states are scattered, so every
rank continues with exactly the batch it would have loaded next. ``--stop-after N``
simulates a crash (the process exits after step N without a final checkpoint);
``--step-log DIR`` writes one line per step and rank (step, batch digest, loss) for comparing
runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import savable_loader as sl


class NoisyRegression(torch.utils.data.Dataset):
    """y = x @ w + noise, with random feature dropout and scaling as augmentation."""

    def __init__(self, n: int = 512, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, dim) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i].clone()
        if random.random() < 0.3:  # Python RNG
            x[random.randrange(len(x))] = 0.0
        x = x * float(np.random.uniform(0.9, 1.1))  # NumPy RNG
        x = x + 0.01 * torch.randn_like(x)  # torch RNG
        return x, self.y[i]


def digest(batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in batch:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(ckpt: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    loader: sl.SavableDataLoader) -> None:
    states = loader.save_state_global(global_dst_rank=0)  # a collective: every rank calls it
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
        tmp = ckpt / "model.pt.tmp"
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
        sl.state.save_file(ckpt / "loader.state", states)  # atomic, checksummed
        os.replace(tmp, ckpt / "model.pt")  # the model file last: it names the step
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt", type=Path, default=Path("ckpt"))
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-log", type=Path, default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets rank, world size and the address
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # rank and world size come from torch.distributed; each rank gets its share of an epoch
    loader = sl.SavableDataLoader(NoisyRegression(), batch_size=16, shuffle=True, seed=0,
                                  num_workers=args.workers)

    step = 0
    if args.resume:
        ckpt = torch.load(args.ckpt / "model.pt", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        states = sl.state.load_file(args.ckpt / "loader.state") if rank == 0 else None
        loader.restore_state_global(states, src_rank=0)
        if rank == 0:
            print(f"resumed at step {step}")

    log = None
    if args.step_log is not None:
        args.step_log.mkdir(parents=True, exist_ok=True)
        log = open(args.step_log / f"rank{rank}.log", "a")
    while step < args.steps:
        for x, y in loader:  # the first iter() after a restore continues the saved epoch
            step += 1
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log is not None:
                log.write(f"{step} {digest((x, y))} {loss.item():.10g}\n")
                log.flush()
            if step % args.ckpt_every == 0:
                save_checkpoint(args.ckpt, step, model, opt, loader)
            if step == args.stop_after:
                os._exit(1)  # a crash: no cleanup, no final checkpoint
            if step >= args.steps:
                break
    if rank == 0:
        print(f"trained {step} steps, last loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
