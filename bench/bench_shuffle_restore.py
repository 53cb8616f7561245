"""Benchmark restore time at every save point of an epoch through a 100k shuffle buffer.

Run from the repository root::

    python -m bench.bench_shuffle_restore            # about 3 minutes on 2 cores
    python -m bench.bench_shuffle_restore --quick    # 10k buffer, 3 repeats
    python -m bench.bench_shuffle_restore --json bench/results/shuffle_restore.json

The ``shuffle`` workload of the suite (``bench/workloads.py``): integers through a
``ShuffleBufferDataset`` of 100,000 samples per worker, a cheap random map, batches of
64, 2 worker processes. One uninterrupted run saves a state at ``--points`` evenly
spaced batches of the epoch (each a different distance from the worker's last snapshot,
so the restore replays a different number of items). Then, for each save point, the
time from building a fresh loader through ``restore_state_rank`` to its first batch,
and the time from building a fresh loader to its first batch without a restore (cold),
interleaved (cold, restore, cold, restore, ...) ``--repeats`` times; every restored
first batch is checked against the uninterrupted run.

Figures: per save point the paired ratio restore / cold, median (min-max); the target is
<= 1.5 at *every* save point, so the verdict is that of the worst point's ratio. Also the
share of worker time spent on snapshots, since a snapshot policy trades one for the
other: worker 0's whole epoch run in this process exactly as in a worker process (each
snapshot encoded; the policy's cold start set to the median cold first batch measured
here, process start included), as the snapshots' thread CPU time over the loop's, with
the cost of one snapshot and the items between two. And the cost of one snapshot of a
1,000,000-entry buffer, held as a list of ints and packed (``array.array``), CPU time.
The throughput cost against plain torch is the suite's ``shuffle`` workload
(``python -m bench --workloads shuffle``).

``main(argv)`` returns the results as a dict (``python -m bench`` includes them).
"""

from __future__ import annotations

import argparse
import array
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_shuffle_restore.py` puts bench/ first
    sys.path.insert(0, str(_REPO))

import savable_loader as sl
from bench import measure as M
from bench.contenders import CONTENDERS, savable_pipeline
from bench.workloads import Workload, make_workloads
from savable_loader.dataset.values import freeze, plain_dataset_state
from savable_loader.pipeline.worker import WorkerRuntime
from savable_loader.state.codec import encode_part
from savable_loader.state.schema import DatasetState

TARGET = 1.5


def run(buffer: int, points: int, repeats: int, workers: int = 2) -> dict[str, Any]:
    w = make_workloads(False, workers, buffer=buffer)["shuffle"]
    c = CONTENDERS["savable-pipe"]
    n_batches = w.num_batches
    steps = sorted({max(1, n_batches * (i + 1) // (points + 1)) for i in range(points)})
    M.log(f"shuffle restore: {buffer:,}-sample buffer, {n_batches} batches; saving at {len(steps)} points")
    loader = c.make(w, workers)
    it = iter(loader)
    saved: dict[int, tuple[bytes, Any]] = {}
    done = 0
    for step in steps:
        while done < step:
            next(it)
            done += 1
        data = c.encode(c.save(loader))
        saved[step] = (data, None)
    # the batch that follows each save point, for the exactness check
    wanted = set(steps)
    while done < n_batches:
        batch = next(it)
        if done in wanted:
            saved[done] = (saved[done][0], batch)
        done += 1
    M.close(it)
    out: dict[str, Any] = {"buffer": buffer, "batches": n_batches, "repeats": repeats, "points": {}}
    for step in steps:
        data, expected = saved[step]

        def restored(r: int, data: bytes = data, expected: Any = expected, step: int = step) -> float:
            seconds, batch = M.first_batch(lambda: c.make(w, workers), lambda ld: c.restore(ld, data))
            if expected is not None and not M.batches_equal(batch, expected):
                raise RuntimeError(f"the batch restored at step {step} differs from the uninterrupted run")
            return seconds

        def cold(r: int) -> float:
            return M.first_batch(lambda: c.make(w, workers), None)[0]

        got = M.interleaved({"cold": cold, "restore": restored}, repeats)
        out["points"][str(step)] = {
            "fraction": step / n_batches,
            "restore_ms": M.spread([x * 1e3 for x in got["restore"]]),
            "cold_ms": M.spread([x * 1e3 for x in got["cold"]]),
            "ratio": M.paired(got["restore"], got["cold"]),
            "skip": _skips(data),
        }
        M.log(f"  step {step}: restore/cold {M.fmt_spread(out['points'][str(step)]['ratio'])}")
    cold_s = M.median([p["cold_ms"]["median"] for p in out["points"].values()]) / 1e3
    out["snapshots"] = snapshot_share(w, workers, cold_s)
    M.log(f"  snapshots: {_fmt_share(out['snapshots'])}")
    out["million"] = million_entry_snapshot()
    worst = max(out["points"].values(), key=lambda p: p["ratio"]["median"])
    out["worst"] = worst
    out["target"] = {
        "figure": f"shuffle restore/cold at every save point ({buffer:,} buffer, worst point)",
        "value": worst["ratio"],
        "target": f"<= {TARGET:g}",
        "result": M.verdict(worst["ratio"], TARGET, higher_is_better=False),
    }
    return out


def snapshot_share(w: Workload, workers: int, cold_seconds: float) -> dict[str, Any]:
    """Worker 0's epoch run here as in a worker process: the share of its thread CPU time
    spent on snapshots (taken and encoded), their cost and the items between two."""
    ds = savable_pipeline(w, workers)
    runtime = WorkerRuntime(ds, ds.worker_config, max_in_flight=2 * workers, in_process=False)
    runtime.cold_seconds = cold_seconds  # a worker's cold start, process start included
    taken: list[tuple[int, float]] = []
    snapshot = runtime._snapshot

    def timed(index: int) -> float:
        cost = snapshot(index)
        taken.append((index, cost))
        return cost

    runtime._snapshot = timed  # type: ignore[method-assign]
    c0 = time.thread_time()
    for _ in runtime.run(0, 0, None):
        runtime.outbox = None  # (a worker process sends it with the item)
    cpu = time.thread_time() - c0
    costs = [c for _, c in taken]
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(taken)] or [0]
    return {
        "cold_ms": cold_seconds * 1e3,
        "snapshots": len(taken),
        "cpu_share": sum(costs) / cpu,
        "cost_ms": {"median": statistics.median(costs) * 1e3, "max": max(costs) * 1e3},
        "items_between": {"median": statistics.median(gaps), "max": max(gaps)},
    }


def million_entry_snapshot(n: int = 1_000_000, repeats: int = 5) -> dict[str, float]:
    """CPU milliseconds of one snapshot (copy, convert, encode) of an ``n``-entry buffer
    of ints, as a list and as an ``array.array("q")`` (median of ``repeats``)."""
    out = {}
    for name, value in (("list_ms", list(range(n))), ("packed_ms", array.array("q", range(n)))):
        times = []
        for _ in range(repeats):
            c0 = time.thread_time()
            state = DatasetState(type="b.B", fields={"buffer": freeze(value, "B.buffer")})
            encode_part(plain_dataset_state(state))
            times.append((time.thread_time() - c0) * 1e3)
        out[name] = statistics.median(times)
    return out


def _fmt_share(s: dict[str, Any]) -> str:
    return (
        f"{s['cpu_share'] * 100:.1f}% of worker CPU time ({s['snapshots']} snapshots, "
        f"{s['cost_ms']['median']:.2f} ms median / {s['cost_ms']['max']:.2f} ms max CPU each, "
        f"{s['items_between']['median']:g} items between two (max {s['items_between']['max']:g}); "
        f"cold start {s['cold_ms']:.0f} ms)"
    )


def _skips(data: bytes) -> list[int]:
    """Items each worker replays after restoring this state."""
    state = sl.state.decode(data)
    return [ws.skip for ws in state.position.workers]


def render(out: dict[str, Any]) -> str:
    rows = [["save point (batch)", "of epoch", "items replayed per worker", "restore ms", "cold ms", "restore/cold"]]
    for step, p in out["points"].items():
        rows.append(
            [
                step,
                f"{p['fraction'] * 100:.0f}%",
                ", ".join(map(str, p["skip"])),
                M.fmt_spread(p["restore_ms"]),
                M.fmt_spread(p["cold_ms"]),
                M.fmt_spread(p["ratio"]),
            ]
        )
    m = out["million"]
    return (
        M.table(rows)
        + f"\n\nsnapshots (worker 0's epoch): {_fmt_share(out['snapshots'])}"
        + f"\none snapshot of a 1,000,000-int buffer: {m['list_ms']:.1f} ms CPU as a list, "
        + f"{m['packed_ms']:.1f} ms packed (array.array)"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="restore time at every save point through a shuffle buffer")
    parser.add_argument("--quick", action="store_true", help="10k buffer, 3 repeats, 6 points")
    parser.add_argument("--buffer", type=int, default=None, help="samples per worker's buffer (default 100,000)")
    parser.add_argument("--points", type=int, default=None, help="save points (default 12)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    buffer = args.buffer or (10_000 if args.quick else 100_000)
    out = run(buffer, args.points or (6 if args.quick else 12), args.repeats or (3 if args.quick else 5))
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
