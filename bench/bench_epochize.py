"""Benchmark EpochizeDataset with fresh worker processes every epoch: epoch-start time.

Run from the repository root::

    python -m bench.bench_epochize             # about 2 minutes on 2 cores
    python -m bench.bench_epochize --quick     # 3 repeats, 10 epochs
    python -m bench.bench_epochize --json bench/results/epochize.json

``BatchDataset(MapDataset(EpochizeDataset(ShuffleBufferDataset(RepeatDataset(source),
1000), 4000), fn), 64)`` with 2 workers and ``persistent_workers=False`` (torch's
default): every epoch starts new worker processes, and each must continue the stream
where the previous epoch's worker stopped. Per epoch, the time from ``iter(loader)`` to
its first batch (worker start-up included). Each repeat runs a fresh loader through
``--epochs`` epochs; the figure is the paired ratio epoch ``--epochs - 1`` / epoch 1 of
the same repeat (median, min-max over the repeats; target <= 1.5). Epoch 0 fills the
shuffle buffer from scratch and is shown apart.

For contrast, the same pipeline with the carried end state switched off
(``carries_across_epochs = False``: what earlier versions did) rebuilds each epoch's
start by replaying all earlier epochs, so its epoch-start time grows with the epoch.

``main(argv)`` returns the results as a dict (``python -m bench`` includes them).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_epochize.py` puts bench/ first
    sys.path.insert(0, str(_REPO))

import numpy as np
import torch

import savable_loader as sl
from bench import measure as M
from bench.contenders import IndexSource
from savable_loader.wrappers import (
    BatchDataset,
    EpochizeDataset,
    EpochizeReplayWarning,
    MapDataset,
    RepeatDataset,
    ShuffleBufferDataset,
)

WORKERS = 2
LENGTH = 4000
BUFFER = 1000
BATCH = 64
TARGET = 1.5


class ReplayingEpochize(EpochizeDataset):
    """EpochizeDataset as earlier versions ran it in fresh workers: no carried end state."""

    carries_across_epochs = False


def sample(value: int) -> torch.Tensor:
    """A cheap sample with draws from the three global RNGs."""
    return torch.tensor([float(value), random.random(), float(np.random.rand()), float(torch.rand(()))])


def make(replaying: bool = False) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=WORKERS, seed=0)
    cls = ReplayingEpochize if replaying else EpochizeDataset
    inner = ShuffleBufferDataset(RepeatDataset(IndexSource(50_000, wc)), BUFFER)
    ds = BatchDataset(MapDataset(cls(inner, LENGTH), sample), BATCH)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)


def epoch_starts(epochs: int, replaying: bool = False) -> list[float]:
    """Seconds from ``iter()`` to the first batch, per epoch, of one fresh loader."""
    loader = make(replaying)
    starts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EpochizeReplayWarning)
        for _ in range(epochs):
            t0 = time.perf_counter()
            it = iter(loader)
            next(it)
            starts.append(time.perf_counter() - t0)
            for _ in it:
                pass
    return starts


def run(repeats: int, epochs: int, replay_repeats: int = 1) -> dict[str, Any]:
    M.log(f"epochize: {repeats} fresh loaders x {epochs} epochs, fresh workers every epoch")
    runs = [epoch_starts(epochs) for _ in range(repeats)]
    last = epochs - 1
    out: dict[str, Any] = {
        "epochs": epochs,
        "repeats": repeats,
        "length": LENGTH,
        "buffer": BUFFER,
        "workers": WORKERS,
        "start_ms": {str(e): M.spread([r[e] * 1e3 for r in runs]) for e in range(epochs)},
        "ratio": M.paired([r[last] for r in runs], [r[1] for r in runs]),
    }
    M.log(f"epochize: the replaying version (earlier releases), {replay_repeats} loader(s)")
    replays = [epoch_starts(epochs, replaying=True) for _ in range(replay_repeats)]
    out["replaying_start_ms"] = {str(e): M.spread([r[e] * 1e3 for r in replays]) for e in range(epochs)}
    out["replaying_ratio"] = M.paired([r[last] for r in replays], [r[1] for r in replays])
    out["target"] = {
        "figure": f"epochize: epoch-start time epoch {last} / epoch 1 (fresh workers)",
        "value": out["ratio"],
        "target": f"<= {TARGET:g}",
        "result": M.verdict(out["ratio"], TARGET, higher_is_better=False),
    }
    return out


def render(out: dict[str, Any]) -> str:
    last = out["epochs"] - 1
    shown = sorted({0, 1, 2, 5, 10, last} & set(range(out["epochs"])))
    rows = [["epoch", "start ms (carried end state)", "start ms (replaying, earlier versions)"]]
    for e in shown:
        rows.append([str(e), M.fmt_spread(out["start_ms"][str(e)]), M.fmt_spread(out["replaying_start_ms"][str(e)])])
    rows.append([f"{last} / 1", M.fmt_spread(out["ratio"]), M.fmt_spread(out["replaying_ratio"])])
    return M.table(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="EpochizeDataset epoch-start time with fresh workers")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 10 epochs")
    parser.add_argument("--repeats", type=int, default=None, help="fresh loaders (default 5)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per loader (default 21: epochs 0..20)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    out = run(args.repeats or (3 if args.quick else 5), args.epochs or (10 if args.quick else 21))
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
