"""The demo's training processes: a tiny model trained on augmented synthetic images.

``python -m savable_loader demo --_child ROLE`` runs one training run (``ROLE`` is
``reference``, ``train`` or ``resume``) on ``--ranks`` data-parallel ranks. With one rank
it trains in its own process; with more it forks one process per rank, which join a
torch.distributed gloo group on 127.0.0.1. Every rank builds its own
:class:`~savable_loader.SavableDataLoader` with ``WorkerConfig(rank, world_size)`` and
worker processes, and logs one fsynced JSON line a step (batch digest, loss as
``float.hex``) to ``ROLE.rank<r>.log``, so that a SIGKILL loses no logged step.

Every ``--save-every`` steps the checkpoint hook gathers the loader states of all ranks
to rank 0 (``save_state_global``), which writes ``ckpt/step-<S>/model.pt`` (model,
optimizer, step) and ``ckpt/step-<S>/loader.state`` (all ranks, atomic, checksummed),
then points ``ckpt/latest`` at that folder with an atomic rename: a kill at any moment
leaves a complete checkpoint behind. ``resume`` loads the model on every rank and the
loader states on rank 0, scatters them (``restore_state_global``) and trains on.

Gradients are averaged by an all-gather summed in rank order rather than by DDP's
bucketed all-reduce, so that the loss curve is bit-identical for any number of ranks.

Imported only when the demo runs (it imports torch).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import savable_loader as sl
from savable_loader.state import IndexPosition

__all__ = ["AugmentedImages", "TinyNet", "child_main", "digest", "steps_of"]

DATASET_LEN = 250
BATCH_SIZE = 16
SIDE = 24
CLASSES = 4
CKPT_DIR = "ckpt"
LATEST = "latest"
STATE_FILE = "loader.state"
MODEL_FILE = "model.pt"
ROLES = ("reference", "train", "resume")


def log_path(out: Path, role: str, rank: int) -> Path:
    """Where rank ``rank`` of a ``role`` run logs its steps."""
    return out / f"{role}.rank{rank}.log"


class AugmentedImages(torch.utils.data.Dataset):
    """A synthetic map-style dataset: ``(3 x side x side image, label)``, nothing to download.

    Random crop and flip (Python ``random``), brightness (NumPy) and noise (torch),
    drawn wherever the sample is loaded (in the loader's worker processes).
    """

    def __init__(self, n: int = DATASET_LEN, side: int = SIDE) -> None:
        self.n = n
        self.side = side

    def __len__(self) -> int:
        return self.n

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "side": self.side}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        s = self.side + 4
        x = torch.arange(3 * s * s, dtype=torch.float32).reshape(3, s, s).mul_(index + 1).remainder_(97).div_(97)
        i, j = random.randint(0, 4), random.randint(0, 4)
        x = x[:, i : i + self.side, j : j + self.side]
        if random.random() < 0.5:
            x = x.flip(-1)
        x = x * float(np.random.uniform(0.8, 1.2))
        x = x + 0.05 * torch.randn(x.shape)
        return x.contiguous(), index % CLASSES


class TinyNet(nn.Module):
    """A convolution, a pooling and a linear layer: a few hundred parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, stride=2)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def digest(batch: Any) -> str:
    """A short hex digest of a batch's bytes (images and labels)."""
    h = hashlib.blake2b(digest_size=8)
    for t in batch:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def make_loader(workers: int, seed: int, rank: int = 0, world: int = 1) -> sl.SavableDataLoader:
    """The demo's loader for one rank."""
    wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=seed)
    return sl.SavableDataLoader(
        AugmentedImages(),
        batch_size=BATCH_SIZE,
        shuffle=True,
        worker_config=wc,
        timeout=60 if workers else 0,  # torch allows a timeout only with worker processes
        persistent_workers=workers > 0,
    )


def steps_of(loader: Any, first: int, last: int) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` for steps ``first..last`` (1-based), over as many epochs as needed."""
    step = first - 1
    while step < last:
        it = iter(loader)
        produced = False
        try:
            for batch in it:
                produced = True
                step += 1
                yield step, batch
                if step >= last:
                    return
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        if not produced:
            raise RuntimeError(f"the loader yielded nothing at step {step}")


class _Log:
    """One JSON object a line, flushed and fsynced, so a SIGKILL loses no logged step."""

    def __init__(self, path: Path) -> None:
        self.file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run (each record fsynced), closed at exit

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def _average_gradients(model: nn.Module, world: int) -> None:
    """Average gradients over ranks, summed in rank order (bit-reproducible)."""
    if world == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    total /= world
    offset = 0
    for g in grads:
        g.copy_(total[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _save_checkpoint(
    ckpt: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, loader: sl.SavableDataLoader
) -> dict[str, float]:
    """The checkpoint hook, on every rank. Rank 0 writes; returns timings (ms)."""
    t0 = time.perf_counter()
    states = loader.save_state_global(global_dst_rank=0)  # a collective: every rank calls it
    t1 = time.perf_counter()
    if states is None:  # not rank 0
        return {}
    folder = ckpt / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, folder / MODEL_FILE)
    sl.state.save_file(folder / STATE_FILE, states)  # atomic, fsynced, checksummed
    tmp = ckpt / f".{LATEST}.tmp"
    tmp.write_text(folder.name)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / LATEST)  # the checkpoint is complete: point at it
    t2 = time.perf_counter()
    for old in sorted(ckpt.glob("step-*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
    position = states[0].position
    if not isinstance(position, IndexPosition):
        raise TypeError(f"the demo uses the drop-in path, got a {type(position).__name__}")
    return {
        "state_ms": (t1 - t0) * 1e3,
        "ckpt_ms": (t2 - t0) * 1e3,
        "epoch": position.epoch,
        "consumed": position.consumed,
    }


def train_rank(args: argparse.Namespace, rank: int, world: int) -> None:
    """One rank of one training run (``args._child`` is the role)."""
    role = args._child
    out = Path(args.out)
    ckpt = out / CKPT_DIR
    log = _Log(log_path(out, role, rank))
    t_start = time.perf_counter()
    torch.set_num_threads(1)  # bit-reproducible CPU math, and polite on small machines
    loader = make_loader(args.workers, args.seed, rank, world)
    torch.manual_seed(args.seed)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if role == "resume":
        t0 = time.perf_counter()
        folder = ckpt / (ckpt / LATEST).read_text().strip()
        saved = torch.load(folder / MODEL_FILE, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = int(saved["step"])
        if world > 1:
            dist.barrier()  # time the restore, not the wait for the slowest rank to get here
        t1 = time.perf_counter()
        states = sl.state.load_file(folder / STATE_FILE) if rank == 0 else None
        loader.restore_state_global(states, src_rank=0 if world > 1 else None)  # type: ignore[arg-type]
        t2 = time.perf_counter()
        position = loader.save_state_rank().position
        if not isinstance(position, IndexPosition):
            raise TypeError(f"the demo uses the drop-in path, got a {type(position).__name__}")
        log.write(
            event="restored",
            step=step,
            epoch=position.epoch,
            consumed=position.consumed,
            checkpoint=folder.name,
            model_ms=(t1 - t0) * 1e3,
            loader_ms=(t2 - t1) * 1e3,
        )
    elif role == "train":
        log.write(event="save", step=0, initial=True, **_save_checkpoint(ckpt, 0, model, opt, loader))
    t_first = time.perf_counter()
    first = step + 1
    for step, (x, y) in steps_of(loader, first, args.steps):
        if step == first:
            log.write(
                event="first_batch",
                ms=(time.perf_counter() - t_first) * 1e3,
                since_start_ms=(time.perf_counter() - t_start) * 1e3,
            )
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        _average_gradients(model, world)
        opt.step()
        log.write(step=step, digest=digest((x, y)), loss=float(loss.item()).hex())
        if args.step_ms:
            time.sleep(args.step_ms / 1e3)  # the rest of a real training step
        if role == "train" and step % args.save_every == 0:
            log.write(event="save", step=step, **_save_checkpoint(ckpt, step, model, opt, loader))
    log.write(event="done")
    if role == "train":  # the parent kills this run at --kill-at < --steps: wait for it
        time.sleep(args.timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(args: argparse.Namespace, rank: int, world: int, port: int) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=max(30.0, args.timeout)),
        )
        try:
            train_rank(args, rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the rank process reports any failure, then exits
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def child_main(args: argparse.Namespace) -> int:
    """One training run: in this process (one rank) or in ``--ranks`` forked processes."""
    if args.ranks == 1:
        train_rank(args, 0, 1)
        return 0
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_rank_entry, args=(args, r, args.ranks, port)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:  # the others would wait for it in a collective: stop them
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]})", file=sys.stderr)
        return 1
    return 0


def batches_per_epoch(ranks: int) -> int:
    """Batches each rank trains on per epoch."""
    return math.ceil(math.ceil(DATASET_LEN / ranks) / BATCH_SIZE)
