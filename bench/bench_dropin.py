"""The drop-in path against plain DataLoader at 0.2 ms samples, 2 workers (issue 30).

Run from the repository root::

    python -m bench.bench_dropin                    # about a minute on 2 quiet cores
    python -m bench.bench_dropin --repeats 9 --samples 8000 --json bench/results/dropin.json

Each repeat runs one whole epoch of a fresh ``torch.utils.data.DataLoader(ds,
batch_size=32, shuffle=True, num_workers=2)`` and of a fresh ``SavableDataLoader(ds,
batch_size=32, shuffle=True, seed=0, num_workers=2)`` over the same dataset, in turn
(the order rotates between repeats), timed from ``iter()`` to the last batch (worker
start-up included for both). A sample (:func:`mid_sample`) is a 3 x 96 x 96 image with a
random crop and flip (Python's ``random``), a brightness (NumPy) and noise (torch): about
0.2 ms of CPU, drawing from the three global RNGs as real augmentations do.

Figures, per loader, median (min-max) over the repeats; ratios paired per repeat:

* **samples/s** (wall clock) and the **wall ratio** (ours over plain);
* with ``--batch-reseed``, a third loader, ``SavableDataLoader(..., reseed="batch")``: the
  same bookkeeping with one re-seed per batch, so that ours minus it is what the
  per-sample re-seeding costs in the running system;
* **CPU µs/sample** of the main process (``getrusage(RUSAGE_SELF)``: every thread of it,
  the queues' feeder threads included), of the workers (``RUSAGE_CHILDREN`` once they
  are reaped) and of both; the **CPU ratio** is plain's total over ours (> 1: ours uses
  less).

On a machine shared with other work the wall ratio moves with the load (the workers and
the main process compete with other processes for the cores); CPU time per sample is far
steadier, so both are printed, with the load average at the start and at the end.

Before the loaders, the per-sample steps of a worker are timed in this process (one torch
thread, CPU time of this thread, the steps alternated sample by sample so that other
load moves them alike): one sample; the re-seed of each global generator; the same
generator's first draw after a re-seed over a draw without one (a Mersenne Twister
seeded anew regenerates its 624 words at its first draw, which an unseeded stream does
once every 624 words).

``main(argv)`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_dropin.py` puts bench/ first
    sys.path.insert(0, str(_REPO))

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bench import measure as M
from bench.workloads import augmented_image
from savable_loader import SavableDataLoader

SIDE = 96
BATCH = 32
WORKERS = 2


def mid_sample(index: int) -> tuple[torch.Tensor, int]:
    """A 3 x SIDE x SIDE image: random crop and flip (Python), brightness (NumPy), noise
    (torch); about 0.2 ms of CPU with one torch thread."""
    x = augmented_image(index, SIDE)
    x = (x - x.mean()) / (x.std() + 1e-6)
    return x.clamp_(-3.0, 3.0), index % 10


class MidDataset(Dataset):
    """``n`` samples of :func:`mid_sample`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return mid_sample(index)


def _usage() -> tuple[float, float]:
    """CPU seconds of this process (all threads) and of its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def epoch(make: Any, n: int) -> dict[str, float]:
    """One whole epoch of a fresh loader: wall samples/s and CPU µs a sample (main, workers)."""
    gc.collect()
    loader = make()
    main0, kids0 = _usage()
    t0 = time.perf_counter()
    it = iter(loader)
    count = 0
    for x, _ in it:
        count += int(x.shape[0])
    wall = time.perf_counter() - t0
    main1, _ = _usage()
    M.close(it)  # the workers are joined (reaped): their CPU time shows in RUSAGE_CHILDREN
    del loader
    gc.collect()
    _, kids1 = _usage()
    if count != n:
        raise RuntimeError(f"an epoch yielded {count} samples, expected {n}")
    main_us, kids_us = (main1 - main0) / n * 1e6, (kids1 - kids0) / n * 1e6
    return {"samples_per_s": n / wall, "main_us": main_us, "workers_us": kids_us, "cpu_us": main_us + kids_us}


def one_sample_us(repeats: int = 2000) -> float:
    """µs of one :func:`mid_sample` in this process with one torch thread (median of 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rounds = []
        for _ in range(5):
            t0 = time.process_time()
            for i in range(repeats // 5):
                mid_sample(i)
            rounds.append((time.process_time() - t0) / (repeats // 5) * 1e6)
    finally:
        torch.set_num_threads(threads)
    return M.median(rounds)


def step_costs(rounds: int = 400) -> dict[str, float]:
    """Median µs of each per-sample step of a worker, in this thread (see the module
    docstring): the steps alternate within every round, so load moves them alike."""
    from savable_loader import rng

    seeds = [rng.item_seed(rng.counter_seed(rng.derive_seed(0, "sample", 0), i)) for i in range(rounds)]
    # each generator seeded as the loader seeds it (rng.global_seeder: the C paths it takes)
    py_seed, np_seed, torch_seed = (rng.global_seeder((name,)) for name in ("random", "numpy", "torch"))
    py_draw, np_draw, torch_draw = (lambda: random.random(), lambda: np.random.rand(), lambda: torch.rand(()))
    clock = time.thread_time_ns
    got: dict[str, list[float]] = {}

    def timed(name: str, call: Any, *args: Any) -> None:
        t0 = clock()
        call(*args)
        got.setdefault(name, []).append((clock() - t0) / 1e3)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, s in enumerate(seeds):
            timed("sample", mid_sample, i)
            timed("re-seed all three", rng.seed_global, s)
            timed("sample after a re-seed", mid_sample, i)
            for name, seed, draw in (
                ("random", py_seed, py_draw),
                ("numpy", np_seed, np_draw),
                ("torch", torch_seed, torch_draw),
            ):
                timed(f"re-seed {name}", seed, s)
                timed(f"first draw {name}", draw)
                timed(f"draw {name}", draw)
    finally:
        torch.set_num_threads(threads)
    out = {name: M.median(values) for name, values in got.items()}
    for name in ("random", "numpy", "torch"):
        out[f"twist {name}"] = out.pop(f"first draw {name}") - out.pop(f"draw {name}")
    return out


def run(
    samples: int, repeats: int, workers: int = WORKERS, batch_reseed: bool = False, step_rounds: int = 400
) -> dict[str, Any]:
    ds = MidDataset(samples)
    makers = {
        "torch": lambda: DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers),
        "savable": lambda: SavableDataLoader(ds, batch_size=BATCH, shuffle=True, seed=0, num_workers=workers),
    }
    if batch_reseed:
        makers["savable-batch"] = lambda: SavableDataLoader(
            ds, batch_size=BATCH, shuffle=True, seed=0, num_workers=workers, reseed="batch"
        )
    load0 = os.getloadavg()[0]
    sample_us = one_sample_us(max(50, 5 * step_rounds))
    steps = step_costs(step_rounds)
    for make in makers.values():  # warm-up: imports, first fork, page faults
        epoch(make, samples)
    runs = M.interleaved({name: (lambda r, mk=mk: epoch(mk, samples)) for name, mk in makers.items()}, repeats)
    out: dict[str, Any] = {
        "samples": samples,
        "batch_size": BATCH,
        "workers": workers,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "load_start": load0,
        "load_end": os.getloadavg()[0],
        "sample_us": sample_us,
        "steps_us": steps,
        "loaders": {},
    }
    for name, got in runs.items():
        out["loaders"][name] = {fig: M.spread([g[fig] for g in got]) for fig in got[0]}
    plain, ours = runs["torch"], runs["savable"]
    out["wall_ratio"] = M.paired([o["samples_per_s"] for o in ours], [p["samples_per_s"] for p in plain])
    out["cpu_ratio"] = M.paired([p["cpu_us"] for p in plain], [o["cpu_us"] for o in ours])
    out["extra_main_us"] = M.spread([o["main_us"] - p["main_us"] for o, p in zip(ours, plain)])
    out["extra_workers_us"] = M.spread([o["workers_us"] - p["workers_us"] for o, p in zip(ours, plain)])
    if batch_reseed:
        per_batch = runs["savable-batch"]
        out["per_sample_reseed_us"] = M.spread([o["cpu_us"] - b["cpu_us"] for o, b in zip(ours, per_batch)])
        out["cpu_ratio_batch"] = M.paired([p["cpu_us"] for p in plain], [b["cpu_us"] for b in per_batch])
        out["wall_ratio_batch"] = M.paired([b["samples_per_s"] for b in per_batch], [p["samples_per_s"] for p in plain])
    out["targets"] = [
        {"figure": "wall ratio", "value": out["wall_ratio"], "target": ">= 0.97"},
        {"figure": "CPU ratio", "value": out["cpu_ratio"], "target": ">= 0.97"},
    ]
    for t in out["targets"]:
        t["result"] = M.verdict(t["value"], 0.97, higher_is_better=True)
    return out


def render(out: dict[str, Any]) -> str:
    rows = [["loader", "samples/s", "CPU µs/sample (all)", "main process", "workers"]]
    for name, figs in out["loaders"].items():
        rows.append(
            [
                name,
                M.fmt_spread(figs["samples_per_s"]),
                M.fmt_spread(figs["cpu_us"]),
                M.fmt_spread(figs["main_us"]),
                M.fmt_spread(figs["workers_us"]),
            ]
        )
    head = (
        f"{out['samples']} samples of ~{out['sample_us']:.0f} µs (one in-process call), batch {out['batch_size']}, "
        f"{out['workers']} workers, {out['repeats']} interleaved repeats, {out['cpu_count']} cores; "
        f"load average {out['load_start']:.1f} at the start, {out['load_end']:.1f} at the end"
    )
    extra = (
        f"ours minus plain, µs a sample: main process {M.fmt_spread(out['extra_main_us'])}, "
        f"workers {M.fmt_spread(out['extra_workers_us'])}"
    )
    lines = [head, "", M.table(rows), "", extra]
    if "per_sample_reseed_us" in out:
        lines.append(
            f'reseed="batch": wall ratio {M.fmt_spread(out["wall_ratio_batch"])}, CPU ratio '
            f"{M.fmt_spread(out['cpu_ratio_batch'])}; the default minus it (the per-sample re-seeding in the "
            f"running system), CPU µs a sample: {M.fmt_spread(out['per_sample_reseed_us'])}"
        )
    steps = [["step (this process, CPU of this thread)", "µs"]]
    steps += [[name, f"{value:.2f}"] for name, value in out["steps_us"].items()]
    lines += ["", M.table(steps)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="drop-in path vs plain DataLoader, 0.2 ms samples, 2 workers")
    parser.add_argument("--samples", type=int, default=6000, help="samples per epoch (default 6000)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats (default 7)")
    parser.add_argument("--workers", type=int, default=WORKERS, help="workers per loader (default 2)")
    parser.add_argument("--batch-reseed", action="store_true", help='also run SavableDataLoader(..., reseed="batch")')
    parser.add_argument(
        "--step-rounds", type=int, default=400, help="samples the per-sample steps are timed over (default 400)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    out = run(args.samples, args.repeats, args.workers, args.batch_reseed, args.step_rounds)
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
