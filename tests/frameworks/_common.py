"""What the framework scripts share: the data, the model, the schedule and the step log.

Every script trains the same tiny regression with random augmentation drawn from torch's,
Python's and NumPy's global RNGs (in two loader worker processes), 6 steps per epoch and
rank, for 15 steps. The reference run checkpoints after step 6 (the last batch of epoch 0)
and step 9 (the middle of epoch 1) and runs on to the end; a resumed run starts from one
of those checkpoints in a fresh process. Each run writes one JSON line per step and rank
to ``OUT/<run>.rank<r>.jsonl``: step, epoch as the framework counts it, the sample indices,
a digest of the batch's tensors and the loss (as a hex float, bit-exact).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

BATCH = 4
STEPS_PER_EPOCH = 6
TOTAL_STEPS = 15
EPOCH_END_STEP = 6  # the last batch of epoch 0
MID_EPOCH_STEP = 9  # the middle of epoch 1
SAVE_STEPS = (EPOCH_END_STEP, MID_EPOCH_STEP)
WORKERS = 2


def dataset_len(world_size: int) -> int:
    """Samples for ``STEPS_PER_EPOCH`` batches per rank."""
    return STEPS_PER_EPOCH * BATCH * world_size


class Augmented(torch.utils.data.Dataset):
    """``(x, y, index)``: x is a fixed vector plus augmentation from three global RNGs."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(8)  # torch's RNG
        if random.random() < 0.3:  # Python's
            x[0] = 0.0
        x = x * float(np.random.uniform(0.9, 1.1))  # NumPy's
        return x, self.y[i], torch.tensor(i)


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    return model, make_model_optimizer(model)


def make_model_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return nn.functional.mse_loss(model(x), y)


def digest(tensors: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def log_step(
    out: Path,
    run: str,
    rank: int,
    step: int,
    epoch: int,
    batch: Any,
    loss: torch.Tensor | float,
    index: torch.Tensor | None = None,
) -> None:
    """Append one step's line to ``OUT/<run>.rank<r>.jsonl``."""
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    if index is None:
        index = tensors[2]
    line = {
        "step": step,
        "epoch": epoch,
        "index": index.tolist(),
        "digest": digest(tensors),
        "loss": float(loss.detach() if isinstance(loss, torch.Tensor) else loss).hex(),
    }
    with open(out / f"{run}.rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())
