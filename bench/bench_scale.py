"""Benchmark the drop-in order at scale: N = 10^3 ... 10^10 samples in constant memory.

Run from the repository root::

    python -m bench.bench_scale              # about a minute on 2 cores
    python -m bench.bench_scale --quick      # 3 repeats, smaller sizes
    python -m bench.bench_scale --json bench/results/scale.json

A ``SavableDataLoader`` over a synthetic map-style dataset of ``N`` samples (a few
floats from the index and the global RNGs; nothing stored), rank 3 of 8, shuffled,
batch 64, ``num_workers=0`` (the main process does everything whose cost could grow with
``N``). Per size, each timed from building a fresh loader:

* **first batch**: ``iter()`` and the first batch of epoch 0;
* **restore at 90 %**: ``restore_state_rank`` of a state at 90 % of the rank's epoch
  (made directly, not by iterating 10^10 samples), then the first batch;
* **restore_sample**: rebuild the batch at 90 % from its restore key;
* **resized restore at 90 %**: the 8 ranks' states at 90 % restored on rank 1 of 6
  (``restore_state_global``: the remaining samples by arithmetic), then the first batch.

The sizes run interleaved (10^3, 10^6, 10^9, 10^10, 10^3, ...; the order rotates every
repeat), ``--repeats`` times (at least 5 for a full run), and every figure is the
*paired* ratio against N = 10^3 in the same repeat: median (min-max). Target: <= 2 at
10^9 and 10^10; a ratio whose min-max reaches past 2 while its median meets it is
reported as NOISY, not met.

**Peak RSS** of the main process: each size runs all four operations in a fresh
subprocess (``--probe N``) that reports the peak resident set size while they ran over
the RSS before them (Linux: the peak is reset through ``/proc/self/clear_refs`` after the
imports, so that it measures the operations, not the import of torch); the growth over
N = 10^3 (paired, interleaved the same way) must stay below 64 MiB.

``main(argv)`` returns the results as a dict (``python -m bench`` includes them).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_scale.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import numpy as np
import torch

import savable_loader as sl
from bench import measure as M
from savable_loader.state import IndexPosition, RankState

BATCH = 64
RANK, WORLD, NEW_RANK, NEW_WORLD = 3, 8, 1, 6
SEED = 0
SIZES = (10**3, 10**6, 10**9, 10**10)
TIME_TARGET = 2.0
RSS_TARGET_MIB = 64.0
OPERATIONS = ("first_batch", "restore_90", "restore_sample", "resized_restore_90")


class Synthetic:
    """``n`` samples, none stored: sample ``i`` is ``[i, random(), np.random.rand(), torch.rand()]``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.random(), float(np.random.rand()), float(torch.rand(()))])

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def make(n: int, rank: int = RANK, world: int = WORLD) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=0, seed=SEED)
    return sl.SavableDataLoader(Synthetic(n), batch_size=BATCH, shuffle=True, worker_config=wc)


def state_at_90(n: int, rank: int = RANK) -> RankState:
    """The state of ``rank`` of ``WORLD`` after 90 % of its epoch (whole batches)."""
    loader = make(n, rank)
    epoch_len = loader._mode.plan.epoch_len()
    consumed = epoch_len * 9 // 10 // BATCH * BATCH
    config = loader.save_state_rank().config
    return RankState(config=config, position=IndexPosition(epoch=0, consumed=consumed, dataset_len=n))


def operations(n: int) -> dict[str, Any]:
    """The four operations at size ``n``: one callable each, returning seconds."""
    state = state_at_90(n)
    states = [state_at_90(n, r) for r in range(WORLD)]
    probe = make(n)
    probe.restore_state_rank(state)
    expected = next(iter(probe))
    key = str(probe.restore_key)

    def first_batch() -> tuple[float, float]:
        with M.Timer() as t:
            next(iter(make(n)))
        return t.wall, t.cpu

    def restore_90() -> tuple[float, float]:
        with M.Timer() as t:
            loader = make(n)
            loader.restore_state_rank(state)
            batch = next(iter(loader))
        if not torch.equal(batch, expected):
            raise RuntimeError(f"N={n}: the restored batch differs")
        return t.wall, t.cpu

    def restore_sample() -> tuple[float, float]:
        with M.Timer() as t:
            batch = make(n).restore_sample(key)
        if not torch.equal(batch, expected):
            raise RuntimeError(f"N={n}: restore_sample rebuilt another batch")
        return t.wall, t.cpu

    def resized_restore_90() -> tuple[float, float]:
        with M.Timer() as t:
            loader = make(n, NEW_RANK, NEW_WORLD)
            loader.restore_state_global(states)
            next(iter(loader))
        return t.wall, t.cpu

    return {
        "first_batch": first_batch,
        "restore_90": restore_90,
        "restore_sample": restore_sample,
        "resized_restore_90": resized_restore_90,
    }


def probe(n: int) -> dict[str, Any]:
    """Run the four operations once in this (fresh) process: the peak RSS while they ran,
    over the RSS before (imports done)."""
    Synthetic(1)[0], make(1000)  # first-use allocations of torch and the library, not of N
    before = M.rss_mib()
    fresh_peak = M.reset_peak_rss()
    ops = operations(n)
    seconds = {name: fn()[0] for name, fn in ops.items()}
    peak = M.peak_rss_mib()
    return {
        "n": n,
        "rss_before_mib": before,
        "peak_rss_mib": peak,
        "peak_over_start_mib": peak - before if fresh_peak else None,
        "seconds": seconds,
    }


def run_probe(n: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_scale", "--probe", str(n)],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"probe N={n} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run(repeats: int, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Interleaved timings and RSS probes; figures against the smallest size."""
    base = sizes[0]
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        M.log(f"scale: operations at N = {', '.join(f'{n:.0e}' for n in sizes)}; {repeats} interleaved repeats")
        ops = {n: operations(n) for n in sizes}
        for n in sizes:  # warm-up (imports, first numpy calls), not measured
            for fn in ops[n].values():
                fn()
        times: dict[str, dict[int, list[tuple[float, float]]]] = {}
        for name in OPERATIONS:
            got = M.interleaved({str(n): (lambda r, n=n, name=name: ops[n][name]()) for n in sizes}, repeats)
            times[name] = {n: got[str(n)] for n in sizes}
    finally:
        torch.set_num_threads(torch_threads)
    M.log("scale: peak RSS, one fresh process per size and repeat")

    def peak(n: int) -> float:
        got = run_probe(n)
        over = got["peak_over_start_mib"]
        return got["peak_rss_mib"] if over is None else over

    rss = M.interleaved({str(n): (lambda r, n=n: peak(n)) for n in sizes}, max(3, repeats))
    out: dict[str, Any] = {
        "repeats": repeats,
        "batch_size": BATCH,
        "rank": RANK,
        "world_size": WORLD,
        "resized_to": [NEW_RANK, NEW_WORLD],
        "sizes": {},
    }
    for n in sizes:
        row: dict[str, Any] = {}
        for name in OPERATIONS:
            wall = [w for w, _ in times[name][n]]
            cpu = [c for _, c in times[name][n]]
            row[f"{name}_ms"] = M.spread([w * 1e3 for w in wall])
            row[f"{name}_cpu_ms"] = M.spread([c * 1e3 for c in cpu])
            row[f"{name}_ratio"] = M.paired(wall, [w for w, _ in times[name][base]])
            row[f"{name}_cpu_ratio"] = M.paired(cpu, [c for _, c in times[name][base]])
        row["peak_rss_mib"] = M.spread(rss[str(n)])
        row["rss_growth_mib"] = M.spread([a - b for a, b in zip(rss[str(n)], rss[str(base)])])
        out["sizes"][str(n)] = row
    out["targets"] = targets(out)
    return out


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n, row in out["sizes"].items():
        if int(n) < 10**9:
            continue
        for name in OPERATIONS:
            for kind in ("cpu_ratio", "ratio"):
                fig = row[f"{name}_{kind}"]
                what = "CPU" if kind == "cpu_ratio" else "wall"
                rows.append(
                    {
                        "figure": f"scale N={int(n):.0e}: {name} / N=1e3 ({what})",
                        "value": fig,
                        "target": f"<= {TIME_TARGET:g}",
                        "result": M.verdict(fig, TIME_TARGET, higher_is_better=False),
                    }
                )
        fig = row["rss_growth_mib"]
        rows.append(
            {
                "figure": f"scale N={int(n):.0e}: peak RSS growth over N=1e3 (MiB)",
                "value": fig,
                "target": f"< {RSS_TARGET_MIB:g}",
                "result": M.verdict(fig, RSS_TARGET_MIB, higher_is_better=False),
            }
        )
    return rows


def render(out: dict[str, Any]) -> str:
    """Two tables: CPU ms (ratio to N=1e3) per operation and size, and wall ms likewise;
    peak RSS in the first."""
    parts = []
    for kind, label in (("cpu_", "CPU"), ("", "wall")):
        head = ["N"] + [f"{name} {label} ms (ratio)" for name in OPERATIONS]
        if kind:
            head += ["peak RSS over start MiB", "growth MiB"]
        rows = [head]
        for n, r in out["sizes"].items():
            row = [f"{int(n):.0e}"] + [
                f"{M.fmt_spread(r[f'{name}_{kind}ms'])} ({M.fmt_spread(r[f'{name}_{kind}ratio'])})"
                for name in OPERATIONS
            ]
            if kind:
                row += [M.fmt_spread(r["peak_rss_mib"]), M.fmt_spread(r["rss_growth_mib"])]
            rows.append(row)
        parts.append(M.table(rows))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="the drop-in order at N = 10^3 ... 10^10")
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 7; --quick 3)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--probe", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        result = probe(args.probe)
        print(json.dumps(result))
        return result
    repeats = args.repeats or (3 if args.quick else 7)
    out = run(repeats)
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
