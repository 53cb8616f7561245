"""What recording statistics costs: the same loaders with ``record_stats`` on and off (issue 34).

Run from the repository root::

    python -m bench.bench_stats                # about 40 minutes on 2 cores
    python -m bench.bench_stats --quick        # small sizes, 2 repeats: a smoke test, not a result
    python -m bench.bench_stats --cases pack-0w --repeats 20 --json bench/results/stats.json

Issue 34's target: ``loader.stats()`` is cheap enough to leave on, at most 1 % of the
loader's own throughput. Each case runs whole epochs of a fresh loader built with
``record_stats=True`` (the default) and of the same loader with ``record_stats=False``,
timed from ``iter()`` to the last batch (worker start-up included for both); the loop
does nothing with the batches, so the loader's own throughput is what is measured. The
cases:

* ``dropin``: the drop-in path over bench_dropin's 0.2 ms samples (a 3 x 96 x 96
  augmented image), batch 32, 2 workers;
* ``dropin-tiny``: the drop-in path over samples of a few µs (a 4-float tensor), batch
  32, 2 workers: the per-batch costs (a report per batch, the main process's bookkeeping
  per ``next()``) show;
* ``pipe-2w`` and ``pipe-0w``: a savable pipeline of three stages, ``BatchDataset(
  MapDataset(IndexSource(n), small_item), 32)`` of 4-float tensors, with 2 workers and in
  the main process: the worst case, samples of a few µs, where the clocks settle (their
  stages hand over to the datasets' own iterators) after their first items;
* ``pack-0w``: bench_packing's LLM pipeline (a Parquet corpus of 12,000 documents,
  tokenized, best-fit packed into rows of 512 tokens, batches of 32 rows) in the main
  process, as nanochat runs its loader: its samples are the rows.

**Repeats and rounds.** Each repeat is a fresh Python process (``--in-process``, the
default with ``--quick``: all in this one) that runs a warm-up epoch of each loader, then
``--pairs`` rounds of one epoch of each (each round in another order of the three).
Within one process the memory layout (address and hash randomization) gives one loader
a lasting edge of up to a few percent, either way, which pairing the epochs inside that
process does not cancel; over processes it averages out. So the repeat, not the round,
is the unit: a figure is the mean over the repeats of each repeat's mean over its
rounds, with a 95 % confidence interval (Student's t over the repeats).

**The garbage collector.** A collection of the youngest generation falls where the count
of allocated containers crosses a threshold (700). A loader that keeps a few dozen more
objects (the statistics' own) moves every later collection, and one moved collection can
land on a different set of young objects: in ``pack-0w``, on the 1,700 token lists of a
packing buffer, 12 ms, 2.5 % of the epoch, in every run of the same corpus. That is the
collector's phase, not a cost of the statistics (with the phase varied, on and off
collect equally often), and a training loop's own allocations set that phase anyway. So
each timed epoch runs under a threshold drawn from :data:`GC_THRESHOLDS` (600 to 800,
seeded by the repeat), which spreads the collections over their possible phases.

**Batches in turn.** The noise of one whole epoch on 2 shared cores is a few percent
(the machine's speed drifts between two epochs), larger than the 1 % to be resolved. The
cases in the main process (:data:`IN_TURN_CASES`) are therefore also timed batch by
batch: after their rounds, each repeat runs ``--pairs`` epochs of the three loaders at
once, their ``next()`` calls in turn (the order going through every permutation, so
that each loader follows each other as often), each call timed
in this thread's CPU time, the garbage collector off (the whole epochs above count
it). A drift then slows all three alike, and one epoch's figure varies by about 0.2 %.

Each round also runs a second loader with ``record_stats=False`` (``off again``): the
last column, ``CPU, off vs off``, is the same figure between two loaders that do the same
work, the noise floor of the run: its interval should hold 0.

Figures: throughput and CPU per epoch as median (min-max) over all epochs; the
overheads paired per round and given as mean [95 % interval] over the repeats:

* **samples/s** (wall clock) and **CPU µs/sample** of all processes (the main process,
  ``getrusage(RUSAGE_SELF)``, and the reaped workers, ``RUSAGE_CHILDREN``), on and off;
* **wall overhead**: ``1 - on/off`` samples/s; **CPU overhead**: ``1 - off/on`` CPU per
  sample (the throughput lost where the CPUs are the limit), of the whole epochs and
  (main-process cases) of the batches in turn. Each is judged against the
  1 % target by ``measure.ci_verdict`` (bench/README.md, "Method"): PASS when the whole
  interval is at most 1 %, MISS when the whole interval is above it, NOISY when it holds
  1 % (more repeats, or a quieter machine).

Before the loaders, three calls that recording adds are timed in this process (CPU time
of this thread, the rounds interleaved): a timed stage's ``next()`` over a plain one (a
pipeline stage while its item is timed), the main process's work per item (the time the
item was ready taken in, its ``next()`` accounted), and a worker's booking of an item
once its clock has settled (a clock read included). Set against the CPU µs per sample,
they say how far a case is from the target on a machine too busy to measure 1 %; in a
loader they cost more than here, where they stay in the CPU's caches.

``main(argv)`` returns the results as a dict; ``python -m bench`` runs it as the extra
section ``stats`` (its ``--repeats``, 5 in a full run, of 2 rounds).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_stats.py` puts bench/ first
    sys.path.insert(0, str(_REPO))

import torch

import savable_loader as sl
from bench import bench_packing
from bench import measure as M
from bench.bench_dropin import MidDataset
from bench.contenders import IndexSource
from bench.workloads import MapStyle
from savable_loader.stats.clock import StageClock
from savable_loader.stats.recorder import Recorder
from savable_loader.wrappers import BatchDataset, MapDataset

BATCH = 32
WORKERS = 2
TARGET = 0.01

#: case -> (what, samples at full size, samples with --quick)
CASES: dict[str, tuple[str, int, int]] = {
    "dropin": ("drop-in, 0.2 ms samples, 2 workers", 6_000, 480),
    "dropin-tiny": ("drop-in, 4-float samples, 2 workers", 100_000, 4_000),
    "pipe-2w": ("pipeline source -> map -> batch, 4-float items, 2 workers", 200_000, 8_000),
    "pipe-0w": ("pipeline source -> map -> batch, 4-float items, num_workers=0", 200_000, 4_000),
    "pack-0w": (
        "bench_packing's LLM pipeline (Parquet -> tokenize -> best-fit packing, T=512 -> batch 32), num_workers=0",
        12_000,
        1_500,
    ),
}

#: Cases whose size is the documents of a corpus (their samples are the packed rows).
CORPUS_CASES = ("pack-0w",)


def case_sizes(quick: bool, scale: float = 1.0, cases: list[str] | None = None) -> dict[str, int]:
    """Samples per epoch of each case (all by default), at full or ``quick`` size."""
    column = 2 if quick else 1
    return {c: max(2 * BATCH, int(CASES[c][column] * scale)) for c in (cases or list(CASES))}


def small_item(index: int) -> torch.Tensor:
    """Four floats: a sample of a few µs."""
    return torch.full((4,), float(index))


_corpora: dict[int, Path] = {}


def corpus(docs: int) -> Path:
    """bench_packing's Parquet corpus of ``docs`` documents (written once per process,
    removed when it exits)."""
    if docs not in _corpora:
        scratch = tempfile.mkdtemp(prefix="bench-stats-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        folder = Path(scratch) / "corpus"
        bench_packing.write_corpus(folder, docs)
        _corpora[docs] = folder
    return _corpora[docs]


def loader_maker(case: str, n: int, record: bool) -> Callable[[], Any]:
    """A function building the case's loader, with ``record_stats=record``."""
    if case in CORPUS_CASES:
        folder = corpus(n)

        def packing() -> Any:
            ds = bench_packing.pipeline(folder, 512, 0)
            return sl.SavableDataLoader(
                ds, batch_size=None, worker_config=ds.worker_config, global_rngs=(), record_stats=record
            )

        return packing
    if case in ("dropin", "dropin-tiny"):
        ds = MidDataset(n) if case == "dropin" else MapStyle(n, small_item)
        return lambda: sl.SavableDataLoader(
            ds, batch_size=BATCH, shuffle=True, seed=0, num_workers=WORKERS, record_stats=record
        )
    workers = WORKERS if case == "pipe-2w" else 0

    def make() -> Any:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=0)
        pipeline = BatchDataset(MapDataset(IndexSource(n, wc), small_item), BATCH)
        return sl.SavableDataLoader(pipeline, batch_size=None, worker_config=wc, record_stats=record)

    return make


def _usage() -> tuple[float, float]:
    """CPU seconds of this process (all threads) and of its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def epoch(make: Callable[[], Any], n: int | None, threshold: int | None = None) -> dict[str, Any]:
    """One whole epoch of a fresh loader (of ``n`` samples; None: not known), under the
    garbage collector's first-generation ``threshold`` (None: as it is): wall samples/s,
    CPU µs a sample (main, workers, both), the samples and, with statistics on, the
    stages ``stats()`` named (a check that they ran)."""
    gc.collect()
    loader = make()
    kept = gc.get_threshold()
    if threshold is not None:
        gc.set_threshold(threshold, *kept[1:])
    try:
        main0, kids0 = _usage()
        t0 = time.perf_counter()
        it = iter(loader)
        count = 0
        for batch in it:
            count += M.batch_len(batch)
        wall = time.perf_counter() - t0
        main1, _ = _usage()
    finally:
        gc.set_threshold(*kept)
    stages = [s.name for s in loader.stats().stages] if loader.record_stats else []
    M.close(it)  # the workers are joined (reaped): their CPU time shows in RUSAGE_CHILDREN
    del loader
    gc.collect()
    _, kids1 = _usage()
    if n is not None and count != n:
        raise RuntimeError(f"an epoch yielded {count} samples, expected {n}")
    n = count
    main_us, kids_us = (main1 - main0) / n * 1e6, (kids1 - kids0) / n * 1e6
    return {
        "samples": n,
        "samples_per_s": n / wall,
        "main_us": main_us,
        "workers_us": kids_us,
        "cpu_us": main_us + kids_us,
        "stages": stages,
    }


# -- the calls recording adds, in this process ------------------------------------------


class _Stage:
    """A dataset as the clock sees one: no children (a source)."""

    def children(self) -> list[Any]:
        return []


def _count(n: int) -> Iterator[int]:
    yield from range(n)


def call_costs(calls: int, repeats: int) -> dict[str, dict[str, Any]]:
    """µs per call of what recording adds, median (min-max) over ``repeats`` rounds of
    ``calls`` calls (see the module docstring)."""
    stage = _Stage()

    def plain_next(k: int) -> None:
        for _ in _count(k):
            pass

    def timed_next(k: int) -> None:
        for _ in StageClock().wrap(stage, _count(k)):
            pass

    recorder = Recorder(rank=0, ahead=4)

    def main_item(k: int) -> None:
        for _ in range(k):
            called = time.perf_counter()
            recorder.report(called - 1e-4)  # (a worker's item: the time it was ready)
            recorder.yielded(called)

    clock = StageClock(worker=0)
    clock.settled = True  # (a settled worker's per-item booking, as WorkerRuntime.run does it)

    def worker_item(k: int) -> None:
        for _ in range(k):
            now = time.perf_counter()
            clock.busy += now - now
            clock.sent += 1
            _ = clock.report(now) if now >= clock.due else now if clock.stamp else None

    rounds = {
        "plain next()": plain_next,
        "timed next()": timed_next,
        "main process": main_item,
        "worker": worker_item,
    }
    clock_ns = time.thread_time_ns

    def timed(fn: Callable[[int], None]) -> float:
        t0 = clock_ns()
        fn(calls)
        return (clock_ns() - t0) / 1e3 / calls

    for fn in rounds.values():  # warm-up
        fn(calls // 10)
    got = M.interleaved({name: (lambda r, fn=fn: timed(fn)) for name, fn in rounds.items()}, repeats)
    recorder.take()
    return {
        "a timed stage's next() over a plain one": M.spread(
            [t - p for t, p in zip(got["timed next()"], got["plain next()"])]
        ),
        "main process: an item's ready time taken in, its next() accounted": M.spread(got["main process"]),
        "a worker: an item booked (settled clock)": M.spread(got["worker"]),
    }


# -- the run ----------------------------------------------------------------------------


#: The loaders of a repeat: statistics on, off, and off again (the A/A control).
SIDES = ("on", "off", "off again")

#: Cases in the main process: their batches are also timed in turn (:func:`batches_in_turn`).
IN_TURN_CASES = ("pipe-0w", "pack-0w")

#: Each timed epoch runs under a first-generation garbage collector threshold drawn from
#: this range (Python's default, 700, in its middle): see the module docstring.
GC_THRESHOLDS = (600, 800)


def makers_of(case: str, n: int) -> dict[str, Callable[[], Any]]:
    """The case's loader builders, by side (see :data:`SIDES`)."""
    return {side: loader_maker(case, n, side == "on") for side in SIDES}


def batches_in_turn(makers: dict[str, Callable[[], Any]], turn: int) -> dict[str, float]:
    """One epoch of each side's loader (loaders of the main process), their batches in
    turn, the garbage collector off: this thread's CPU µs a sample in each loader's
    ``next()``. The order goes through every permutation of the loaders, one a round
    (from ``turn``), so that each runs after each other as often (a loader runs a little
    slower after one that touched more memory); the loaders are built in the order of
    the first round."""
    gc.collect()
    orders = list(itertools.permutations(SIDES))
    first = orders[turn % len(orders)]
    iterators = {side: iter(makers[side]()) for side in first}
    spent = dict.fromkeys(SIDES, 0)
    samples = dict.fromkeys(SIDES, 0)
    live = list(SIDES)
    clock = time.thread_time_ns
    collecting = gc.isenabled()
    gc.disable()
    try:
        while live:
            orders = list(itertools.permutations(live))
            order = orders[turn % len(orders)]
            turn += 1
            for side in order:
                t0 = clock()
                try:
                    batch = next(iterators[side])
                except StopIteration:
                    live.remove(side)
                else:
                    samples[side] += M.batch_len(batch)
                spent[side] += clock() - t0
    finally:
        if collecting:
            gc.enable()
        for it in iterators.values():
            M.close(it)
    return {side: spent[side] / 1e3 / samples[side] for side in SIDES}


def one_round(case: str, n: int, samples: int | None, pairs: int, seed: int) -> dict[str, list[Any]]:
    """One repeat in this process: a warm-up epoch of each side, then ``pairs`` rounds of
    an epoch of each side (in every order in turn, from ``seed``), each under a threshold of
    :data:`GC_THRESHOLDS` drawn from ``seed``; for a case of :data:`IN_TURN_CASES`, then
    ``pairs`` epochs of :func:`batches_in_turn` (``in turn``)."""
    makers = makers_of(case, n)
    for side in SIDES:  # warm-up: imports, first fork, page faults
        samples = epoch(makers[side], samples)["samples"]
    draw = random.Random(seed)
    out: dict[str, list[Any]] = {side: [] for side in SIDES}
    orders = list(itertools.permutations(SIDES))
    for p in range(pairs):
        for side in orders[(seed + p) % len(orders)]:
            out[side].append(epoch(makers[side], samples, draw.randrange(*GC_THRESHOLDS)))
    if case in IN_TURN_CASES:
        out["in turn"] = [batches_in_turn(makers, seed + p) for p in range(pairs)]
    return out


def fresh_round(case: str, n: int, samples: int | None, pairs: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """:func:`one_round` in a fresh Python process (``python -m bench.bench_stats --child``)."""
    spec = {"case": case, "n": n, "samples": samples, "pairs": pairs, "seed": seed}
    if case in CORPUS_CASES:
        spec["corpus"] = str(corpus(n))  # (written once, by this process)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_stats", "--child", json.dumps(spec)],
        cwd=_REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"a repeat of {case} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    got: dict[str, list[dict[str, Any]]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def child(spec_json: str) -> None:
    """``--child SPEC``: one repeat (:func:`one_round`), its figures printed as a JSON line."""
    spec = json.loads(spec_json)
    if spec.get("corpus"):
        _corpora[spec["n"]] = Path(spec["corpus"])
    got = one_round(spec["case"], spec["n"], spec["samples"], spec["pairs"], spec["seed"])
    print(json.dumps(got))


def _overhead(repeats: list[dict[str, list[dict[str, Any]]]], side: str, fn: Callable[[Any, Any], float]) -> Any:
    """``fn(side's epoch, off's epoch)`` per pair, averaged per repeat: the repeats' mean
    with its confidence interval (:func:`measure.mean_ci`)."""
    per_repeat = [statistics.fmean(fn(a, b) for a, b in zip(got[side], got["off"])) for got in repeats]
    return M.mean_ci(per_repeat)


def run(
    sizes: dict[str, int], repeats: int, call_rounds: int = 200_000, fresh: bool = True, pairs: int = 1
) -> dict[str, Any]:
    """Every case of ``sizes`` (case -> samples), ``repeats`` repeats of ``pairs`` rounds
    each (``fresh``: each repeat in a fresh process, see the module docstring)."""
    if repeats < 2 or pairs < 1:
        raise ValueError(f"the stats bench needs 2 repeats or more and 1 pair or more, got {repeats} and {pairs}")
    load0 = os.getloadavg()[0]
    out: dict[str, Any] = {
        "batch_size": BATCH,
        "workers": WORKERS,
        "repeats": repeats,
        "pairs": pairs,
        "fresh_processes": fresh,
        "gc_thresholds": list(GC_THRESHOLDS),
        "cpu_count": os.cpu_count(),
        "load_start": load0,
        "calls_us": call_costs(call_rounds, max(repeats, 5)),
        "cases": {},
        "targets": [],
    }
    for case, n in sizes.items():
        M.log(
            f"stats overhead: {case} ({n:,} samples, {repeats} repeats of {pairs} rounds"
            f"{', fresh processes' if fresh else ''})"
        )
        samples = None if case in CORPUS_CASES else n
        got = [(fresh_round if fresh else one_round)(case, n, samples, pairs, r) for r in range(repeats)]
        on = [e for g in got for e in g["on"]]
        res: dict[str, Any] = {"what": CASES[case][0], "samples": on[0]["samples"], "stages": on[-1]["stages"]}
        for side in SIDES:
            epochs = [e for g in got for e in g[side]]
            res[side] = {
                fig: M.spread([e[fig] for e in epochs]) for fig in ("samples_per_s", "cpu_us", "main_us", "workers_us")
            }
        res["wall_overhead"] = _overhead(got, "on", lambda a, b: 1 - a["samples_per_s"] / b["samples_per_s"])
        res["cpu_overhead"] = _overhead(got, "on", lambda a, b: 1 - b["cpu_us"] / a["cpu_us"])
        res["cpu_control"] = _overhead(got, "off again", lambda a, b: 1 - b["cpu_us"] / a["cpu_us"])
        res["extra_main_us"] = _overhead(got, "on", lambda a, b: a["main_us"] - b["main_us"])
        res["extra_workers_us"] = _overhead(got, "on", lambda a, b: a["workers_us"] - b["workers_us"])
        if case in IN_TURN_CASES:
            turns = [g["in turn"] for g in got]
            res["cpu_overhead_in_turn"] = M.mean_ci(
                [statistics.fmean(1 - t["off"] / t["on"] for t in r) for r in turns]
            )
            res["cpu_control_in_turn"] = M.mean_ci(
                [statistics.fmean(1 - t["off"] / t["off again"] for t in r) for r in turns]
            )
        out["cases"][case] = res
        for figure in ("wall_overhead", "cpu_overhead", "cpu_overhead_in_turn"):
            if figure not in res:
                continue
            value = res[figure]
            what = {"wall_overhead": "wall", "cpu_overhead": "CPU", "cpu_overhead_in_turn": "CPU, batches in turn,"}
            out["targets"].append(
                {
                    "figure": f"record_stats, {case}: {what[figure]} overhead",
                    "value": value,
                    "target": f"<= {TARGET:g}",
                    "result": M.ci_verdict(value, TARGET, higher_is_better=False),
                }
            )
    out["load_end"] = os.getloadavg()[0]
    return out


def _pct(figure: dict[str, Any]) -> str:
    return f"{100 * figure['mean']:.2f} % [{100 * figure['low']:.2f} to {100 * figure['high']:.2f}]"


def render(out: dict[str, Any]) -> str:
    head = (
        f"record_stats on and off: batch {out['batch_size']}, {out['repeats']} repeats of {out['pairs']} "
        f"interleaved rounds{' (each repeat a fresh process)' if out['fresh_processes'] else ''}, "
        f"{out['cpu_count']} cores; load average {out['load_start']:.1f} at the start, "
        f"{out['load_end']:.1f} at the end"
    )
    rows = [
        ["case", "samples/s on", "off", "CPU µs/sample on", "off", "wall overhead", "CPU overhead", "CPU, off vs off"]
    ]
    for case, res in out["cases"].items():
        rows.append(
            [
                case,
                M.fmt_spread(res["on"]["samples_per_s"]),
                M.fmt_spread(res["off"]["samples_per_s"]),
                M.fmt_spread(res["on"]["cpu_us"]),
                M.fmt_spread(res["off"]["cpu_us"]),
                _pct(res["wall_overhead"]),
                _pct(res["cpu_overhead"]),
                _pct(res["cpu_control"]),
            ]
        )
    lines = [head, "", M.table(rows), ""]
    for case, res in out["cases"].items():
        lines.append(
            f"{case}: {res['what']}, {res['samples']:,} samples; on minus off, CPU µs a sample: main process "
            f"{M.fmt_spread(res['extra_main_us'])}, workers {M.fmt_spread(res['extra_workers_us'])}; "
            f"stages named: {', '.join(res['stages']) or '-'}"
        )
    turns = [["case (main process)", "CPU overhead, batches in turn, no GC", "CPU, off vs off"]]
    turns += [
        [case, _pct(res["cpu_overhead_in_turn"]), _pct(res["cpu_control_in_turn"])]
        for case, res in out["cases"].items()
        if "cpu_overhead_in_turn" in res
    ]
    if len(turns) > 1:
        lines += ["", M.table(turns)]
    calls = [["call recording adds (this process, CPU of this thread)", "µs"]]
    calls += [[name, M.fmt_spread(fig)] for name, fig in out["calls_us"].items()]
    lines += ["", M.table(calls)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="the cost of record_stats: the same loaders with it on and off")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats: a smoke test, not a result")
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats, each a fresh process (default 12; --quick 2)"
    )
    parser.add_argument(
        "--pairs", type=int, default=None, help="rounds of on, off, off again per repeat (default 4; --quick 1)"
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)} (default all)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the samples of every case")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every repeat in this process (faster; the default with --quick): its memory layout "
        "then biases the overheads, by up to a few percent",
    )
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)  # (one repeat: fresh_round)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return {}
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        if case not in CASES:
            parser.error(f"unknown case {case!r}; choose from {list(CASES)}")
    repeats = args.repeats or (2 if args.quick else 12)
    pairs = args.pairs or (1 if args.quick else 4)
    if repeats < 2 or pairs < 1:
        parser.error(f"--repeats must be 2 or more and --pairs 1 or more, got {repeats} and {pairs}")
    out = run(
        case_sizes(args.quick, args.scale, cases),
        repeats,
        call_rounds=20_000 if args.quick else 200_000,
        fresh=not (args.in_process or args.quick),
        pairs=pairs,
    )
    out["mode"] = "quick" if args.quick else "full"
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
