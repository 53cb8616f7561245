"""The benchmark workloads: the same samples for every contender.

Every sample draws from the worker's global RNGs (Python ``random``, NumPy and torch, or
torch's alone for the ``-torch`` workloads: ``Workload.rngs``), so a resume is only
bit-identical if a loader makes those draws resumable.

=========  =================================================================================
tiny       a 4-float tensor per sample: the loader's own per-sample cost dominates
cpu        a 3 x 128 x 128 image with a random crop, flip, brightness and noise (~0.5 ms)
tiny-torch tiny, every draw from torch's global RNG (as torchvision's transforms draw)
cpu-torch  cpu, every draw from torch's global RNG
io         a tiny sample after a 10 ms sleep (I/O-like: the workers mostly wait)
shuffle    integers through a 100k-sample shuffle buffer per worker (large dataset state);
           iterable style only
=========  =================================================================================

Map-style workloads come as a ``Dataset`` (for the drop-in loaders) and as an iterable
pipeline (for the pipeline loaders); each pipeline is built for every contender from the
same ``Workload.sample`` function, sharded round robin over the workers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "WORKLOADS",
    "Workload",
    "augmented_image",
    "cpu_sample",
    "cpu_torch_sample",
    "io_sample",
    "make_workloads",
    "tiny_sample",
    "tiny_torch_sample",
]

SIDE = 128
SLEEP_S = 0.010


def tiny_sample(index: int) -> torch.Tensor:
    """Four floats: the index and one draw from each global RNG."""
    return torch.tensor([float(index), random.random(), float(np.random.rand()), float(torch.rand(()))])


def augmented_image(index: int, side: int = SIDE) -> torch.Tensor:
    """A 3 x side x side image: random crop, flip (random), brightness (NumPy), noise (torch)."""
    x = torch.full((3, side + 4, side + 4), (index % 251) / 251.0)
    i, j = random.randint(0, 4), random.randint(0, 4)
    x = x[:, i : i + side, j : j + side]
    if random.random() < 0.5:
        x = x.flip(-1)
    x = x * float(np.random.uniform(0.8, 1.2))
    return x + 0.05 * torch.randn(3, side, side)


def cpu_sample(index: int) -> tuple[torch.Tensor, int]:
    """:func:`augmented_image` of SIDE x SIDE, and a label."""
    return augmented_image(index), index % 10


def tiny_torch_sample(index: int) -> torch.Tensor:
    """Four floats: the index and three draws from torch's global RNG."""
    return torch.cat((torch.tensor([float(index)]), torch.rand(3)))


def cpu_torch_sample(index: int) -> tuple[torch.Tensor, int]:
    """:func:`cpu_sample` with every draw from torch's global RNG."""
    x = torch.full((3, SIDE + 4, SIDE + 4), (index % 251) / 251.0)
    i, j = (int(v) for v in torch.randint(0, 5, (2,)))
    x = x[:, i : i + SIDE, j : j + SIDE]
    if float(torch.rand(())) < 0.5:
        x = x.flip(-1)
    x = x * float(torch.empty(()).uniform_(0.8, 1.2))
    x = x + 0.05 * torch.randn(3, SIDE, SIDE)
    return x, index % 10


def io_sample(index: int) -> torch.Tensor:
    """A tiny sample that first waits 10 ms, like a read from remote storage."""
    time.sleep(SLEEP_S)
    return tiny_sample(index)


def shuffle_map(value: int) -> torch.Tensor:
    """The per-sample step after the shuffle buffer: cheap, with RNG draws."""
    return torch.tensor([float(value), random.random(), float(np.random.rand())])


class MapStyle(Dataset):
    """``n`` samples of ``fn`` as a map-style dataset."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = n
        self.fn = fn

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.fn(index)

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "fn": self.fn.__name__}


@dataclass
class Workload:
    """One workload: its samples, sizes and which loader styles it runs in."""

    name: str
    what: str
    n: int
    batch_size: int
    sample: Callable[[int], Any]
    #: "map" (drop-in loaders, plus pipeline loaders over the same samples) or "stream"
    #: (pipeline loaders only: a shuffle buffer)
    style: str = "map"
    buffer: int = 0
    save_steps: int = 100
    extra: dict[str, Any] = field(default_factory=dict)
    #: The global RNGs its samples draw from (what ``SavableDataLoader(global_rngs=...)`` declares).
    rngs: tuple[str, ...] = ("numpy", "random", "torch")

    def map_dataset(self) -> MapStyle:
        return MapStyle(self.n, self.sample)

    @property
    def epoch_samples(self) -> int:
        return self.n

    @property
    def num_batches(self) -> int:
        return -(-self.n // self.batch_size)


def sharded(n: int, worker: int, workers: int) -> Iterator[int]:
    """This worker's share of ``range(n)``, round robin (the same split for everyone)."""
    return iter(range(worker, n, workers))


def make_workloads(quick: bool, num_workers: int, buffer: int | None = None, scale: float = 1.0) -> dict[str, Workload]:
    """The workloads at full or ``quick`` size; ``scale`` multiplies the map-style sizes."""
    buf = buffer if buffer is not None else (10_000 if quick else 100_000)
    # each worker must see more than its buffer, or the buffer only ever drains
    stream_n = num_workers * (buf + max(2_000, buf // 5))
    ws = {
        "tiny": Workload(
            "tiny",
            "4 floats a sample, batch 64 (dispatch-bound)",
            3_000 if quick else 20_000,
            64,
            tiny_sample,
            save_steps=60 if quick else 200,
        ),
        "cpu": Workload(
            "cpu",
            "3x128x128 augmented image (~0.5 ms), batch 32",
            600 if quick else 3_000,
            32,
            cpu_sample,
            save_steps=15 if quick else 100,
        ),
        "io": Workload(
            "io", "10 ms sleep + 4 floats, batch 8", 160 if quick else 600, 8, io_sample, save_steps=15 if quick else 80
        ),
        "shuffle": Workload(
            "shuffle",
            f"ints through a {buf:,}-sample shuffle buffer per worker, batch 64",
            stream_n,
            64,
            shuffle_map,
            style="stream",
            buffer=buf,
            save_steps=30 if quick else 150,
        ),
    }
    for name, fn in (("tiny", tiny_torch_sample), ("cpu", cpu_torch_sample)):
        base = ws[name]
        ws[f"{name}-torch"] = Workload(
            f"{name}-torch",
            f"{base.what}, every draw from torch",
            base.n,
            base.batch_size,
            fn,
            save_steps=base.save_steps,
            rngs=("torch",),
        )
    for w in ws.values():
        if w.style == "map":
            w.n = max(2 * w.batch_size, int(w.n * scale))
    return ws


WORKLOADS = ("tiny", "cpu", "io", "shuffle", "tiny-torch", "cpu-torch")
