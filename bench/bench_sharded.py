"""Benchmark the sharded-file source: restore time must not grow with the position in the epoch.

Run from the repository root::

    python bench/bench_sharded.py            # full run, about a minute on 2 cores
    python bench/bench_sharded.py --quick    # short run, about 20 s
    python bench/bench_sharded.py --json bench/results/sharded.json

It writes a temporary folder of ``.npy`` shards (float32 rows), builds
``BatchDataset(ShardedFileDataset(folder), 32)`` under a ``SavableDataLoader`` with
``num_workers=2`` and measures:

* epoch throughput (samples/s) of an uninterrupted epoch, and the median time from
  building a fresh loader to its first batch without a restore, for context;
* restore-to-first-batch time for a state saved at 10 %, 50 % and 90 % of an epoch:
  median wall time from building a fresh loader, through ``restore_state_rank``, to its
  first batch (worker start-up included), and the ratio 90 % / 10 % (target: <= 1.5;
  a source that replayed to its position would grow with it). Every restored first batch
  is checked against the uninterrupted stream;
* with ``num_workers=0``, how many samples the source reads from its shards to produce
  the first batch after the restore (``ShardedFileDataset.samples_read``): one batch's
  worth plus the loader's skip replay from its newest snapshot. The skip depends on the
  loader's time-based snapshot policy (on a busy machine it can be many batches), not on
  the position;
* "source seek": the median time for a fresh ``ShardedFileDataset`` to restore a
  position and read its next sample, without the loader (no worker start-up, no skip).

``main(argv)`` returns the results as a dict, so a benchmark suite can call it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_sharded.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import numpy as np
import torch

import savable_loader as sl
from savable_loader.config import _ActiveWorker
from savable_loader.sources import ShardedFileDataset, write_shards
from savable_loader.state import decode, encode
from savable_loader.wrappers import BatchDataset

BATCH = 32
FEATURES = 256
FRACTIONS = (0.1, 0.5, 0.9)
TARGET_RATIO = 1.5


def make_folder(folder: Path, shards: int, rows: int) -> int:
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((rows, FEATURES), dtype=np.float32) for _ in range(shards)]
    for i, a in enumerate(data):
        a[:, 0] = np.arange(i * rows, (i + 1) * rows)  # sample id in column 0
    write_shards(folder, data)
    return shards * rows


def make_loader(folder: Path, num_workers: int) -> tuple[sl.SavableDataLoader, ShardedFileDataset]:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=0)
    source = ShardedFileDataset(folder, wc)
    loader = sl.SavableDataLoader(BatchDataset(source, BATCH), batch_size=None, worker_config=wc)
    return loader, source


def state_at(folder: Path, num_workers: int, step: int) -> bytes:
    loader, _ = make_loader(folder, num_workers)
    it = iter(loader)
    for _ in range(step):
        next(it)
    data = encode(loader.save_state_rank())
    del it, loader
    return data


def time_restore(folder: Path, num_workers: int, data: bytes) -> tuple[float, torch.Tensor, int]:
    t0 = time.perf_counter()
    loader, source = make_loader(folder, num_workers)
    loader.restore_state_rank(decode(data))
    it = iter(loader)
    first = next(it)
    elapsed = time.perf_counter() - t0
    reads = source.samples_read
    del it, loader
    return elapsed, first, reads


def time_source_seek(folder: Path, position: int, runs: int) -> float:
    """Median seconds for a fresh source to restore ``position`` and read its next sample."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)
    times = []
    with _ActiveWorker(0, 0):
        saved = ShardedFileDataset(folder, wc)
        saved.position = position
        state = saved.save_state()
        for _ in range(runs):
            t0 = time.perf_counter()
            fresh = ShardedFileDataset(folder, wc)
            fresh.restore_state(state)
            next(iter(fresh))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (fewer shards and repetitions)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)
    shards, rows, runs = (16, 256, 5) if args.quick else (64, 512, 9)
    results: dict[str, Any] = {"shards": shards, "rows_per_shard": rows, "batch": BATCH, "workers": args.workers}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        total = make_folder(folder, shards, rows)
        print(
            f"{shards} shards x {rows} rows of {FEATURES} float32 ({total} samples) in {folder}",
            file=sys.stderr,
            flush=True,
        )
        loader, _ = make_loader(folder, args.workers)
        t0 = time.perf_counter()
        reference = list(loader)
        epoch_s = time.perf_counter() - t0
        del loader
        results["epoch_samples_per_s"] = total / epoch_s
        cold = []
        for _ in range(runs):
            t0 = time.perf_counter()
            loader, _ = make_loader(folder, args.workers)
            it = iter(loader)
            next(it)
            cold.append(time.perf_counter() - t0)
            del it, loader
        results["cold_first_batch_ms"] = 1e3 * statistics.median(cold)
        steps = [int(len(reference) * f) for f in FRACTIONS]
        states = [state_at(folder, args.workers, step) for step in steps]
        times: list[list[float]] = [[] for _ in FRACTIONS]
        for _ in range(runs):  # interleaved, so that drift in machine load hits every position alike
            for i, step in enumerate(steps):
                elapsed, first, _ = time_restore(folder, args.workers, states[i])
                if not torch.equal(first, reference[step]):
                    raise SystemExit(
                        f"restore at {FRACTIONS[i]:.0%}: the first batch differs from the uninterrupted one"
                    )
                times[i].append(elapsed)
        rows_out = []
        for i, (fraction, step) in enumerate(zip(FRACTIONS, steps, strict=True)):
            _, _, reads = time_restore(folder, 0, state_at(folder, 0, step))
            seek = time_source_seek(folder, step * BATCH, 3 * runs)
            rows_out.append(
                {
                    "fraction": fraction,
                    "step": step,
                    "restore_ms": 1e3 * statistics.median(times[i]),
                    "source_seek_us": 1e6 * seek,
                    "reads_in_process": reads,
                    "state_bytes": len(states[i]),
                }
            )
        results["restores"] = rows_out
        results["ratio_90_10"] = rows_out[-1]["restore_ms"] / rows_out[0]["restore_ms"]
    print(f"epoch throughput: {results['epoch_samples_per_s']:.0f} samples/s ({args.workers} workers)")
    print(f"cold start to first batch (no restore): {results['cold_first_batch_ms']:.1f} ms")
    print(
        f"{'position':>9} {'step':>6} {'restore->1st batch':>19} {'reads (w=0)':>12} {'source seek':>12} {'state':>8}"
    )
    for r in results["restores"]:
        print(
            f"{r['fraction']:>9.0%} {r['step']:>6} {r['restore_ms']:>16.1f} ms {r['reads_in_process']:>12} "
            f"{r['source_seek_us']:>9.0f} us {r['state_bytes']:>6} B"
        )
    verdict = "PASS" if results["ratio_90_10"] <= TARGET_RATIO else "MISS"
    print(f"ratio 90% / 10%: {results['ratio_90_10']:.2f} (target <= {TARGET_RATIO}) {verdict}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
