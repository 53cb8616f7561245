"""The benchmark suite: one entry point, every contender, every workload, one run.

Run from the repository root::

    python -m bench                    # full run (about 30 minutes on 2 cores)
    python -m bench --quick            # short run (a few minutes; 2 repeats: not a result)
    python -m bench --json bench/results/run.json --plot bench/results/run.png
    python -m bench --quick --workloads tiny --contenders savable --no-scaling --no-extras   # seconds

Every ratio comes from interleaved repeats (baseline and contenders in turn, the order
rotating every repeat; at least 5 in a full run), paired within each repeat and reported
as median (min-max); a figure whose min-max reaches past its target while the median
meets it is NOISY, not met. See bench/README.md for each figure and docs/performance.md
for the numbers of one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/run.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import torch

import savable_loader as sl
from bench import bench_costs, bench_epochize, bench_packing, bench_scale, bench_shuffle_restore, bench_stats
from bench import measure as M
from bench.contenders import CONTENDERS, Contender, available_contenders, savable_pipeline
from bench.workloads import WORKLOADS, Workload, make_workloads

EXTRAS = ("scale", "epochize", "shuffle-restore", "costs", "packing", "stats")

OURS = ("savable", "savable-batch", "savable-declared", "savable-pipe")


log = M.log


def per_call_us(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


# -- per workload ----------------------------------------------------------------------


def run_workload(w: Workload, contenders: list[Contender], args: argparse.Namespace) -> dict[str, Any]:
    active = [c for c in contenders if w.style in c.styles and c.applies(w)]
    out: dict[str, Any] = {"what": w.what, "samples": w.n, "batch_size": w.batch_size, "contenders": {}}
    res = out["contenders"]
    for c in active:
        res[c.name] = {"label": c.label, "baseline": c.baseline}
    nw = args.workers
    # throughput: whole epochs of fresh loaders, every loader once per repeat (A B C A B C
    # ..., the order rotating), after one warm-up round
    log(
        f"{w.name}: throughput of {len(active)} loaders, {args.repeats} interleaved repeats"
        f"{' + warm-up' if args.warmup else ''}"
    )
    if args.warmup:
        for c in active:
            M.epoch_run(lambda c=c: c.make(w, nw), w.epoch_samples)
    runs = M.interleaved(
        {c.name: (lambda r, c=c: M.epoch_run(lambda: c.make(w, nw), w.epoch_samples)) for c in active}, args.repeats
    )
    for c in active:
        d = res[c.name]
        d["rates"] = [rate for rate, _ in runs[c.name]]
        d["cpu_us"] = [cpu for _, cpu in runs[c.name]]
        d["samples_per_s"] = M.spread(d["rates"])
        d["cpu_us_per_sample"] = M.spread(d["cpu_us"])
    for c in active:
        d = res[c.name]
        if c.baseline and c.baseline in res:
            base = res[c.baseline]
            d["throughput_ratio"] = M.paired(d["rates"], base["rates"])  # ours / baseline's samples/s
            d["cpu_ratio"] = M.paired(base["cpu_us"], d["cpu_us"])  # baseline's CPU per sample / ours
    # save latency, state size, exact resume, restore-to-first-batch
    interrupt_at = max(1, w.num_batches // 2)
    for c in active:
        if not c.savable:
            continue
        d = res[c.name]
        steps = min(w.save_steps, w.num_batches - 1)  # within one epoch (Energon does not restart)
        log(f"{w.name}: {c.name}: save latency ({steps} steps)")
        latencies, state = M.save_latencies(lambda c=c: c.make(w, nw), c.save, steps)
        d["save_ms"] = M.percentiles_ms(latencies)
        d["save_series_ms"] = [round(x * 1e3, 4) for x in latencies]
        size = len(c.encode(state))
        log(f"{w.name}: {c.name}: resume check (interrupt after {interrupt_at} of {w.num_batches} batches)")
        check = M.resume_check(lambda c=c: c.make(w, nw), lambda ld, c=c: c.encode(c.save(ld)), c.restore, interrupt_at)
        d["bit_identical"] = check["identical"]
        d["resume_detail"] = check["detail"]
        d["state_bytes"] = max(size, len(check["state"]))
        if not check["state"]:
            continue
        log(f"{w.name}: {c.name}: restore-to-first-batch vs cold first batch ({args.repeats} interleaved repeats)")
        data = check["state"]

        def first(
            r: int, c: Contender = c, data: bytes | None = None, d: dict[str, Any] = d, check: dict[str, Any] = check
        ) -> float:
            restore = None if data is None else (lambda ld: c.restore(ld, data))
            seconds, batch = M.first_batch(lambda: c.make(w, nw), restore)
            if data is not None and check["identical"] and not M.batches_equal(batch, check["first"]):
                d["bit_identical"] = False
                d["resume_detail"] = "a restored first batch differs from the saved position's next batch"
            return seconds

        got = M.interleaved({"cold": first, "restore": lambda r, c=c, data=data: first(r, c, data)}, args.repeats)
        d["restore_ms"] = M.spread([x * 1e3 for x in got["restore"]])
        d["cold_ms"] = M.spread([x * 1e3 for x in got["cold"]])
        d["restore_ratio"] = M.paired(got["restore"], got["cold"])
    return out


# -- scaling (savable_loader) ------------------------------------------------------------


def restore_first_ms(c: Contender, w: Workload, nw: int, at: int, runs: int) -> dict[str, Any]:
    """Restore-to-first-batch after saving at batch ``at`` (ms, median (min-max) of ``runs``)."""
    loader = c.make(w, nw)
    it = iter(loader)
    for _ in range(at):
        next(it)
    data = c.encode(c.save(loader))
    M.close(it)
    times = [M.first_batch(lambda: c.make(w, nw), lambda ld: c.restore(ld, data))[0] * 1e3 for _ in range(runs)]
    return M.spread(times)


def run_scaling(ws: dict[str, Workload], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    w = ws["cpu"]
    torch_map, ours = CONTENDERS["torch-map"], [CONTENDERS["savable"], CONTENDERS["savable-pipe"]]
    workers: dict[str, Any] = {}
    for nw in args.scaling_workers:
        log(f"scaling: {nw} worker(s), {args.repeats} interleaved repeats")
        row: dict[str, Any] = {}
        runs = M.interleaved(
            {
                name: (lambda r, c=c, nw=nw: M.epoch_run(lambda: c.make(w, nw), w.n))
                for name, c in (("torch", torch_map), ("ours", ours[0]))
            },
            args.repeats,
        )
        row["dropin_throughput_ratio"] = M.paired([x for x, _ in runs["ours"]], [x for x, _ in runs["torch"]])
        row["dropin_cpu_ratio"] = M.paired([x for _, x in runs["torch"]], [x for _, x in runs["ours"]])
        for c in ours:
            latencies, _ = M.save_latencies(lambda c=c, nw=nw: c.make(w, nw), c.save, min(w.save_steps, 60))
            row[f"{c.name}_save_ms"] = M.percentiles_ms(latencies)
            row[f"{c.name}_restore_ms"] = restore_first_ms(c, w, nw, w.num_batches // 2, 1)["median"]
        workers[str(nw)] = row
    out["workers"] = workers
    positions: dict[str, Any] = {}
    for c in ours:
        log(f"scaling: {c.name}: restore time at 10/50/90% of an epoch")
        positions[c.name] = {
            str(p): restore_first_ms(c, w, args.workers, max(1, w.num_batches * p // 100), args.repeats)
            for p in (10, 50, 90)
        }
    out["restore_ms_vs_position"] = {"workload": w.name, **positions}
    sizes: dict[str, Any] = {}
    sw = ws["shuffle"]
    for buf in args.buffers:
        log(f"scaling: state size with a {buf:,}-sample shuffle buffer")
        n = args.workers * (buf + 1000)
        wl = Workload("shuffle", "", n, sw.batch_size, sw.sample, style="stream", buffer=buf)
        ds = savable_pipeline(wl, args.workers)
        loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config)
        it = iter(loader)
        for _ in range(4):
            next(it)
        size = len(sl.state.encode(loader.save_state_rank()))
        M.close(it)
        sizes[str(buf)] = {"state_bytes": size, "bytes_per_buffered_sample": size / (buf * args.workers)}
    out["state_bytes_vs_buffer"] = sizes
    return out


def snapshot_share(w: Workload, num_workers: int) -> dict[str, Any]:
    """Fraction of a worker's time spent taking (and encoding) snapshots: worker 0's loop
    run in this process exactly as a worker process runs it (attached snapshots)."""
    from savable_loader.pipeline.worker import WorkerRuntime

    ds = savable_pipeline(w, num_workers)
    rt = WorkerRuntime(ds, ds.worker_config, max_in_flight=2 * num_workers + 2, in_process=False)
    items = 0
    t0 = time.perf_counter()
    for _ in rt.run(0, 0, None):
        rt.outbox = None
        items += 1
    total = time.perf_counter() - t0
    return {
        "buffer": w.buffer,
        "items": items,
        "snapshots": rt.snapshots_taken,
        "snapshot_s": rt.snapshot_seconds,
        "worker_s": total,
        "share": rt.snapshot_seconds / total,
    }


# -- report ----------------------------------------------------------------------------


#: Targets of the CPU ratio (baseline's CPU per sample / ours) of the drop-in path (issue 17).
CPU_TARGETS = {"tiny": 0.90, "cpu": 0.97, "tiny-torch": 0.90, "cpu-torch": 0.97}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target: the figure, its value (median (min-max) for repeated figures), the
    target and PASS / MISS / NOISY (see ``measure.verdict``)."""
    rows: list[dict[str, Any]] = []

    def add(figure: str, value: Any, target: float | bool, higher: bool = True, text: str | None = None) -> None:
        if isinstance(value, dict):
            result = M.verdict(value, float(target), higher_is_better=higher)
        elif isinstance(target, bool):
            result = "PASS" if value is target else "MISS"
        else:
            result = "PASS" if (value >= target if higher else value <= target) else "MISS"
        wanted = text or (f"{'>=' if higher else '<='} {target:g}" if not isinstance(target, bool) else str(target))
        rows.append({"figure": figure, "value": value, "target": wanted, "result": result})

    for wname, wres in results["workloads"].items():
        for cname in OURS:
            d = wres["contenders"].get(cname)
            if d is None:
                continue
            tag = f"{wname} / {cname}"
            if "throughput_ratio" in d:
                add(f"{tag}: throughput ratio (wall)", d["throughput_ratio"], 0.97)
            if cname in ("savable", "savable-batch", "savable-declared") and wname in CPU_TARGETS and "cpu_ratio" in d:
                add(f"{tag}: CPU ratio (all processes)", d["cpu_ratio"], CPU_TARGETS[wname])
            if "save_ms" in d:
                add(f"{tag}: save p50 (ms)", round(d["save_ms"]["p50"], 3), 1.0, higher=False)
                add(f"{tag}: save p99 (ms)", round(d["save_ms"]["p99"], 3), 5.0, higher=False)
            if "restore_ratio" in d:
                add(f"{tag}: restore/cold first batch", d["restore_ratio"], 1.5, higher=False)
            if "bit_identical" in d:
                add(f"{tag}: resume bit-identical", d["bit_identical"], True)
    snap = results.get("snapshot_cost")
    if snap:
        add(f"snapshot share of worker time ({snap['buffer']:,} buffer)", round(snap["share"], 4), 0.02, higher=False)
    for section in ("scale", "epochize", "shuffle_restore", "packing", "stats"):
        got = results.get(section)
        if got:
            rows.extend(got["targets"] if section in ("scale", "packing", "stats") else [got["target"]])
    return rows


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict) and "median" in v:
        return M.fmt_spread(v, digits)
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


table = M.table


def render(results: dict[str, Any]) -> str:
    parts = []
    info = results.get("info") or {}
    if info:
        costs = ", ".join(f"{k.removesuffix('_us').replace('_', ' ')} {v:,.1f} µs" for k, v in info.items())
        parts.append(f"One-call costs in the main process (1 torch thread) at the start of the run: {costs}.")
    for wname, wres in results["workloads"].items():
        rows = [
            [
                "loader",
                "samples/s",
                "ratio",
                "CPU µs/sample",
                "CPU ratio",
                "save p50/p99/max ms",
                "state",
                "restore / cold ms",
                "ratio",
                "bit-identical",
            ]
        ]
        for d in wres["contenders"].values():
            save = d.get("save_ms")
            rows.append(
                [
                    d["label"] + ("" if d.get("baseline") else " [baseline]"),
                    fmt(d["samples_per_s"]["median"]) if "samples_per_s" in d else "-",
                    fmt(d.get("throughput_ratio")),
                    fmt(d["cpu_us_per_sample"]["median"]) if "cpu_us_per_sample" in d else "-",
                    fmt(d.get("cpu_ratio")),
                    "/".join(fmt(save[k], 2) for k in ("p50", "p99", "max")) if save else "-",
                    f"{d['state_bytes'] / 1024:,.1f} KiB" if "state_bytes" in d else "-",
                    f"{fmt(d['restore_ms']['median'])} / {fmt(d['cold_ms']['median'])}" if "restore_ms" in d else "-",
                    fmt(d.get("restore_ratio")),
                    fmt(d.get("bit_identical")),
                ]
            )
        parts.append(f"### {wname}: {wres['what']} ({wres['samples']:,} samples)\n\n{table(rows)}")
    sc = results.get("scaling")
    if sc:
        rows = [
            [
                "workers",
                "drop-in throughput ratio",
                "drop-in CPU ratio",
                "drop-in save p50/p99 ms",
                "pipeline save p50/p99 ms",
                "drop-in restore ms",
                "pipeline restore ms",
            ]
        ]
        for nw, r in sc["workers"].items():
            rows.append(
                [
                    nw,
                    fmt(r["dropin_throughput_ratio"]),
                    fmt(r.get("dropin_cpu_ratio")),
                    f"{fmt(r['savable_save_ms']['p50'], 2)}/{fmt(r['savable_save_ms']['p99'], 2)}",
                    f"{fmt(r['savable-pipe_save_ms']['p50'], 2)}/{fmt(r['savable-pipe_save_ms']['p99'], 2)}",
                    fmt(r["savable_restore_ms"]),
                    fmt(r["savable-pipe_restore_ms"]),
                ]
            )
        parts.append(f"### scaling with the number of workers (cpu workload)\n\n{table(rows)}")
        pos = sc["restore_ms_vs_position"]
        rows = [["loader", "restore at 10% (ms)", "50%", "90%"]]
        for name in OURS:
            if name in pos:
                rows.append([CONTENDERS[name].label] + [fmt(pos[name][p]) for p in ("10", "50", "90")])
        parts.append(
            f"### restore-to-first-batch against position in the epoch ({pos['workload']} workload)\n\n{table(rows)}"
        )
        rows = [["shuffle buffer", "state size", "bytes per buffered sample"]]
        for buf, r in sc["state_bytes_vs_buffer"].items():
            rows.append([f"{int(buf):,}", f"{r['state_bytes'] / 1024:,.1f} KiB", fmt(r["bytes_per_buffered_sample"])])
        parts.append(
            f"### state size against shuffle-buffer size (pipeline, {results['parameters']['workers']} workers)\n\n{table(rows)}"
        )
    snap = results.get("snapshot_cost")
    if snap:
        parts.append(
            f"Snapshot cost in a worker with a {snap['buffer']:,}-sample buffer: {snap['snapshots']} snapshots over "
            f"{snap['items']} items, {snap['snapshot_s'] * 1e3:.1f} ms of {snap['worker_s'] * 1e3:,.0f} ms "
            f"({snap['share'] * 100:.2f} % of worker time)."
        )
    if results.get("costs"):
        parts.append(
            "### per-sample cost of the drop-in path, step by step (µs per sample, batch 64, "
            f"{results['costs']['repeats']} interleaved rounds)\n\n{bench_costs.render(results['costs'])}"
        )
    if results.get("scale"):
        sc2 = results["scale"]
        parts.append(
            f"### the drop-in order at N = 10^3 ... 10^10 (rank {sc2['rank']} of {sc2['world_size']}, "
            f"batch {sc2['batch_size']}, num_workers=0, {sc2['repeats']} interleaved repeats; ratio to "
            f"N = 10^3 in the same repeat)\n\n{bench_scale.render(sc2)}"
        )
    if results.get("epochize"):
        ep = results["epochize"]
        parts.append(
            f"### EpochizeDataset with fresh workers every epoch ({ep['repeats']} loaders x {ep['epochs']} "
            f"epochs of {ep['length']:,} samples, {ep['buffer']:,}-sample buffer inside, "
            f"{ep['workers']} workers)\n\n{bench_epochize.render(ep)}"
        )
    if results.get("shuffle_restore"):
        sr = results["shuffle_restore"]
        parts.append(
            f"### restore / cold start at every save point ({sr['buffer']:,}-sample shuffle buffer, "
            f"{sr['repeats']} interleaved repeats)\n\n{bench_shuffle_restore.render(sr)}"
        )
    if results.get("packing"):
        pk = results["packing"]
        parts.append(
            f"### best-fit packing against a nanochat-shaped loop ({pk['docs']:,} documents, buffer "
            f"{pk['buffer']:,}, refill {pk['chunk']}, batches of {pk['batch']}, {pk['repeats']} interleaved "
            f"repeats)\n\n```text\n{bench_packing.render(pk)}\n```"
        )
    if results.get("stats"):
        st = results["stats"]
        parts.append(
            f"### the cost of record_stats: the same loaders with it on and off ({st['repeats']} repeats of "
            f"{st['pairs']} interleaved rounds)\n\n```text\n{bench_stats.render(st)}\n```"
        )
    rows = [["target", "value", "wanted", "result"]]
    for t in results["targets"]:
        rows.append([t["figure"], fmt(t["value"]), t["target"], t["result"]])
    parts.append(
        f"### targets (savable_loader)\n\nPASS: every repeat meets the target. NOISY: the median "
        f"meets it, but the spread reaches past it. MISS: the median misses it.\n\n{table(rows)}"
    )
    if results["skipped"]:
        parts.append("Skipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items()))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="savable_loader benchmark suite")
    parser.add_argument("--quick", action="store_true", help="small sizes, one run each")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {WORKLOADS}")
    parser.add_argument("--contenders", default="", help=f"comma list of {list(CONTENDERS)} (baselines added)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per loader (default 2)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the map-style workloads' sizes")
    parser.add_argument("--no-scaling", action="store_true", help="skip the scaling figures")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats per ratio (default 5; --quick 2, which is not a result)",
    )
    parser.add_argument(
        "--extras", default=None, help=f"comma list of extra sections {list(EXTRAS)} (default all; --quick: costs)"
    )
    parser.add_argument("--no-extras", action="store_true", help="run no extra section")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    parser.add_argument("--docs", metavar="MD", help="replace the generated section of this docs page")
    parser.add_argument("--from-json", metavar="PATH", help="render (--docs, --markdown, --plot) a saved run")
    parser.add_argument("--plot", metavar="PNG", help="write a PNG of save latency and restore time (matplotlib)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.warmup = not args.quick
    extras = ("costs",) if args.quick else EXTRAS
    args.extras = [] if args.no_extras else [x for x in (args.extras.split(",") if args.extras else extras) if x]
    for name in args.extras:
        if name not in EXTRAS:
            parser.error(f"unknown extra section {name!r}; choose from {list(EXTRAS)}")
    args.scaling_workers = [1, 2] if args.quick else [1, 2, 4, 8]
    args.buffers = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    started = time.perf_counter()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        return report(results, args)

    ws = make_workloads(args.quick, args.workers, scale=args.scale)
    chosen = [s for s in args.workloads.split(",") if s]
    for name in chosen:
        if name not in ws:
            parser.error(f"unknown workload {name!r}; choose from {WORKLOADS}")
    names = [s for s in args.contenders.split(",") if s] or None
    for name in names or ():
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r}; choose from {list(CONTENDERS)}")
    contenders, skipped = available_contenders(names)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)

    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": _cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "savable_loader": sl.__version__,
            "start_method": torch.multiprocessing.get_start_method(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "parameters": {"workers": args.workers, "repeats": args.repeats, "scale": args.scale, "extras": args.extras},
        "skipped": skipped,
        "info": {},
        "workloads": {},
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in chosen:
            results["info"][f"{name}_sample_us"] = per_call_us(ws[name].sample, 200 if name == "io" else 2_000)
    finally:
        torch.set_num_threads(threads)
    if "costs" in args.extras:
        log("per-sample costs of the drop-in path")
        results["costs"] = bench_costs.run(max(args.repeats, 5))
    for name in chosen:
        results["workloads"][name] = run_workload(ws[name], contenders, args)
    if "shuffle" in chosen and any(c.name == "savable-pipe" for c in contenders):
        log("snapshot cost in a worker (shuffle buffer)")
        results["snapshot_cost"] = snapshot_share(ws["shuffle"], args.workers)
    if not args.no_scaling:
        results["scaling"] = run_scaling(ws, args)
    if "scale" in args.extras:
        results["scale"] = bench_scale.run(max(args.repeats, 5))
    if "epochize" in args.extras:
        results["epochize"] = bench_epochize.run(args.repeats, 10 if args.quick else 21)
    if "shuffle-restore" in args.extras:
        buffer = ws["shuffle"].buffer
        results["shuffle_restore"] = bench_shuffle_restore.run(
            buffer, 6 if args.quick else 12, args.repeats, args.workers
        )
    if "packing" in args.extras:
        results["packing"] = bench_packing.run(3000 if args.quick else 12000, args.repeats)
    if "stats" in args.extras:
        results["stats"] = bench_stats.run(
            bench_stats.case_sizes(args.quick), max(args.repeats, 2), fresh=not args.quick, pairs=1 if args.quick else 2
        )
    results["targets"] = targets(results)
    results["elapsed_s"] = time.perf_counter() - started
    results["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        log(f"wrote {path}")
    return report(results, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the tables; write Markdown, the docs section and the plot if asked."""
    text = render(results)
    print(text)
    counts = {r: sum(t["result"] == r for t in results["targets"]) for r in ("PASS", "NOISY", "MISS")}
    print(
        f"\n{len(results['targets'])} targets: {counts['PASS']} met, {counts['NOISY']} noisy, {counts['MISS']} "
        f"missed; run took {results['elapsed_s']:.0f} s ({results['mode']}, {results['parameters']['repeats']} "
        "repeats)"
    )
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    if args.docs:
        write_docs(Path(args.docs), results, text)
        log(f"wrote {args.docs}")
    if args.plot:
        from bench.plot import plot

        reason = plot(results, Path(args.plot))
        log(reason)
    return 0


BEGIN, END = "<!-- bench:begin (generated by python -m bench --docs) -->", "<!-- bench:end -->"


def write_docs(path: Path, results: dict[str, Any], text: str) -> None:
    """Put the run's tables between the markers of ``path`` (the rest is hand-written)."""
    m = results["machine"]
    load = m.get("load_average")
    head = (
        f"Run of {results['date']} ({results['mode']}, {results['elapsed_s'] / 60:.0f} min): "
        f"{m['processor']}, {m['cpu_count']} cores, {m['platform']}; Python {m['python']}, torch {m['torch']}, "
        f"savable_loader {m['savable_loader']}, start method {m['start_method']}, "
        f"{results['parameters']['workers']} workers per loader."
    )
    if load:
        head += (
            f" Load average at the start {load[0]:.1f}, at the end {m['load_average_end'][0]:.1f} "
            f"(other work on the machine)."
            if m.get("load_average_end")
            else ""
        )
    block = f"{BEGIN}\n\n{head}\n\n{text}\n\n{END}"
    old = path.read_text() if path.exists() else f"# Performance\n\n{BEGIN}\n{END}\n"
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + block + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
