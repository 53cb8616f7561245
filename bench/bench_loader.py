"""Benchmark savable_loader against plain ``torch.utils.data.DataLoader``.

Run from the repository root::

    python bench/bench_loader.py            # full run, about 2-3 minutes on 2 cores
    python bench/bench_loader.py --quick    # short run, under about 40 s
    python bench/bench_loader.py --json bench/results/run.json

Every workload draws from the worker's global RNGs (Python ``random``, NumPy and torch)
while it builds a sample, so the figures include the cost of making those draws
resumable. One process run measures:

a) drop-in throughput: ``SavableDataLoader`` vs ``DataLoader`` over the same map-style
   dataset (batch_size=32, shuffle=True, num_workers=2), runs interleaved, medians;
b) ``save_state_rank()`` latency while iterating (p50 / p99 / max), drop-in and savable
   pipeline, with cheap samples and with samples that sleep 10 ms;
c) encoded state size with 2 workers, both paths;
d) restore-to-first-batch time over cold-start-to-first-batch time, both paths;
e) whether a resumed stream is bit-identical to an uninterrupted one, both paths;
f) pipeline throughput vs ``DataLoader`` over an equivalent torch ``IterableDataset``.

See bench/README.md for what each figure means and why the targets are what they are.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_loader.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info  # noqa: E402

import savable_loader as sl  # noqa: E402
from savable_loader.rng import derive_seed, seed_global  # noqa: E402
from savable_loader.wrappers import BatchDataset, MapDataset  # noqa: E402

NUM_WORKERS = 2
SEED = 0
SIDE = 128  # samples are 3 x SIDE x SIDE float32 images (cropped from SIDE + 4); --side
SLEEP_S = 0.010  # the "slow sample" variant of (b)
KIB = 1024

# ---------------------------------------------------------------------------------------
# Workload: the same augmentation for every loader
# ---------------------------------------------------------------------------------------


def augment(index: int, side: int = SIDE, sleep_s: float = 0.0) -> tuple[torch.Tensor, int]:
    """A small image with a random crop, flip, brightness and noise.

    Draws from Python ``random`` (crop offsets, flip), NumPy's global RNG (brightness) and
    torch's global RNG (noise): all three must be restored for a resume to be exact.
    """
    if sleep_s:
        time.sleep(sleep_s)
    x = torch.full((3, side + 4, side + 4), (index % 251) / 251.0)
    i, j = random.randint(0, 4), random.randint(0, 4)
    x = x[:, i : i + side, j : j + side]
    if random.random() < 0.5:
        x = x.flip(-1)
    x = x * float(np.random.uniform(0.8, 1.2))
    x = x + 0.05 * torch.randn(3, side, side)
    return x, index % 10


class AugmentedDataset(Dataset):
    """Map-style dataset of ``n`` augmented samples (the drop-in path's workload)."""

    def __init__(self, n: int, side: int = SIDE, sleep_s: float = 0.0) -> None:
        self.n = n
        self.side = side
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return augment(index, self.side, self.sleep_s)

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "side": self.side, "sleep_s": self.sleep_s}


class IndexSource(sl.SavableDataset):
    """Savable source of the indices ``0..n-1``, split round robin over the workers."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self) -> Iterator[int]:
        step = self.worker_config.workers_per_rank
        while self.pos < self.n:
            value = self.pos
            self.pos += step
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


class TorchIterableAugmented(IterableDataset):
    """The plain-torch equivalent of the savable pipeline: shard by worker id, augment,
    batch and collate inside the worker."""

    def __init__(self, n: int, batch_size: int, side: int = SIDE, sleep_s: float = 0.0) -> None:
        self.n = n
        self.batch_size = batch_size
        self.side = side
        self.sleep_s = sleep_s

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        batch: list[Any] = []
        for index in range(worker, self.n, workers):
            batch.append(augment(index, self.side, self.sleep_s))
            if len(batch) == self.batch_size:
                yield default_collate(batch)
                batch = []
        if batch:
            yield default_collate(batch)


def make_pipeline(n: int, batch_size: int, side: int = SIDE, sleep_s: float = 0.0) -> sl.SavableDataset:
    """Savable pipeline: IndexSource -> MapDataset(augment) -> BatchDataset."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=NUM_WORKERS, seed=SEED)
    return BatchDataset(MapDataset(IndexSource(n, wc), lambda i: augment(i, side, sleep_s)), batch_size)


class Factories:
    """Builds the four loaders of one workload (datasets are built once and shared)."""

    def __init__(self, n: int, batch_size: int, side: int = SIDE, sleep_s: float = 0.0) -> None:
        self.n = n
        self.batch_size = batch_size
        self.map_dataset = AugmentedDataset(n, side=side, sleep_s=sleep_s)
        self.pipeline = make_pipeline(n, batch_size, side=side, sleep_s=sleep_s)
        self.iterable = TorchIterableAugmented(n, batch_size, side=side, sleep_s=sleep_s)

    def dropin(self) -> sl.SavableDataLoader:
        return sl.SavableDataLoader(
            self.map_dataset, batch_size=self.batch_size, shuffle=True, seed=SEED, num_workers=NUM_WORKERS
        )

    def torch_map(self) -> DataLoader:
        return DataLoader(self.map_dataset, batch_size=self.batch_size, shuffle=True, num_workers=NUM_WORKERS)

    def pipe(self) -> sl.SavableDataLoader:
        return sl.SavableDataLoader(self.pipeline, batch_size=None, worker_config=self.pipeline.worker_config)

    def torch_iterable(self) -> DataLoader:
        return DataLoader(self.iterable, batch_size=None, num_workers=NUM_WORKERS)


# ---------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------


def close(it: Any) -> None:
    """Stop an iterator and its worker processes now (not at garbage collection)."""
    if hasattr(it, "close"):  # SavableDataLoader iterators are generators
        it.close()
    elif hasattr(it, "_shutdown_workers"):  # torch's multiprocessing iterator
        it._shutdown_workers()
    del it
    gc.collect()


def batch_len(batch: Any) -> int:
    return int(batch[1].shape[0])


def batches_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(batches_equal, a, b))
    return bool(a == b)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its reaped children (the workers)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@dataclass
class EpochRun:
    samples_per_s: float
    cpu_us_per_sample: float


def epoch_throughput(make: Callable[[], Any], expected: int) -> EpochRun:
    """One whole epoch of a fresh loader (worker start and shutdown included): samples
    per second of wall time, and CPU microseconds per sample over all processes."""
    gc.collect()
    loader = make()
    count = 0
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    for batch in loader:
        count += batch_len(batch)
    seconds = time.perf_counter() - t0
    del loader
    gc.collect()  # workers are joined (and so counted in RUSAGE_CHILDREN) by now
    cpu = cpu_seconds() - cpu0
    if count != expected:
        raise RuntimeError(f"an epoch yielded {count} samples, expected {expected}")
    return EpochRun(count / seconds, cpu / count * 1e6)


@dataclass
class Comparison:
    ours: list[EpochRun]
    theirs: list[EpochRun]

    @property
    def ours_rate(self) -> float:
        return statistics.median(r.samples_per_s for r in self.ours)

    @property
    def theirs_rate(self) -> float:
        return statistics.median(r.samples_per_s for r in self.theirs)

    @property
    def ratio(self) -> float:
        return self.ours_rate / self.theirs_rate

    @property
    def cpu_ratio(self) -> float:
        """torch's CPU per sample over ours: like ``ratio``, but blind to other load."""
        return statistics.median(r.cpu_us_per_sample for r in self.theirs) / statistics.median(
            r.cpu_us_per_sample for r in self.ours
        )


def interleaved_throughput(
    make_ours: Callable[[], Any], make_torch: Callable[[], Any], expected: int, runs: int
) -> Comparison:
    """``runs`` epochs of each loader, alternating (ABBA order), after one warm-up each."""
    epoch_throughput(make_torch, expected)
    epoch_throughput(make_ours, expected)
    result = Comparison([], [])
    for r in range(runs):
        order = [(make_ours, result.ours), (make_torch, result.theirs)]
        if r % 2:
            order.reverse()
        for make, out in order:
            out.append(epoch_throughput(make, expected))
    return result


def save_latencies(make: Callable[[], Any], steps: int) -> tuple[list[float], bytes]:
    """``save_state_rank()`` after each of ``steps`` batches: seconds per call, last state."""
    loader = make()
    it = iter(loader)
    latencies: list[float] = []
    state = None
    try:
        for _ in range(steps):
            try:
                next(it)
            except StopIteration:  # the epoch ended: go on with the next one
                close(it)
                it = iter(loader)
                next(it)
            t0 = time.perf_counter()
            state = loader.save_state_rank()
            latencies.append(time.perf_counter() - t0)
    finally:
        close(it)
    return latencies, sl.state.encode(state)


def time_to_first_batch(make: Callable[[], Any], state: bytes | None) -> tuple[float, Any]:
    """Seconds from building a loader (and restoring ``state``) to its first batch."""
    gc.collect()
    t0 = time.perf_counter()
    loader = make()
    if state is not None:
        loader.restore_state_rank(sl.state.decode(state))
    it = iter(loader)
    batch = next(it)
    seconds = time.perf_counter() - t0
    close(it)
    return seconds, batch


def restore_ratio(make: Callable[[], Any], state: bytes, expected_first: Any, runs: int) -> tuple[float, float, float]:
    """Median restore-to-first-batch, median cold-start-to-first-batch, and their ratio."""
    time_to_first_batch(make, None)
    time_to_first_batch(make, state)
    cold: list[float] = []
    warm: list[float] = []
    for r in range(runs):
        order = [(None, cold), (state, warm)]
        if r % 2:
            order.reverse()
        for st, out in order:
            seconds, batch = time_to_first_batch(make, st)
            if st is not None and not batches_equal(batch, expected_first):
                raise RuntimeError("the restored loader's first batch is not the saved position's next batch")
            out.append(seconds)
    c, w = statistics.median(cold), statistics.median(warm)
    return w, c, w / c


def resume_check(make: Callable[[], Any], interrupt_at: int) -> tuple[bool, str, bytes, Any]:
    """Interrupt a run after ``interrupt_at`` batches, resume a fresh loader from its state
    and compare the rest of the epoch with an uninterrupted reference, batch by batch.

    Returns (identical, detail, encoded state, the first batch after the interruption).
    """
    reference = iter(make())
    interrupted_loader = make()
    interrupted = iter(interrupted_loader)
    try:
        for i in range(interrupt_at):
            if not batches_equal(next(interrupted), next(reference)):
                return False, f"two fresh loaders differ at batch {i}", b"", None
        state = sl.state.encode(interrupted_loader.save_state_rank())
        next(interrupted)  # the workers are mid-flight when the run "dies"
        close(interrupted)
        resumed_loader = make()
        resumed_loader.restore_state_rank(sl.state.decode(state))
        resumed = iter(resumed_loader)
        compared = 0
        first = None
        try:
            for ref, res in itertools.zip_longest(reference, resumed):
                if ref is None or res is None:
                    which = "resumed" if res is None else "reference"
                    return False, f"the {which} stream ended early after {compared} batches", state, first
                if first is None:
                    first = res
                if not batches_equal(ref, res):
                    return False, f"batch {interrupt_at + compared} differs", state, first
                compared += 1
        finally:
            close(resumed)
        return True, f"{compared} batches after batch {interrupt_at} equal", state, first
    finally:
        close(reference)


def reseed_cost_us(n: int = 20000) -> float:
    """Microseconds of the per-sample re-seeding the drop-in path does in each worker."""
    t0 = time.perf_counter()
    for i in range(n):
        seed_global(derive_seed(SEED, "sample", 0, i))
    return (time.perf_counter() - t0) / n * 1e6


def sample_cost_us(side: int, n: int = 500) -> float:
    """Microseconds to build one sample in this process (one torch thread, like a worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            augment(i, side)
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


@dataclass
class Figure:
    key: str
    label: str
    value: float | str
    unit: str = ""
    target: str = ""
    passed: bool | None = None  # None: informational


class Report:
    def __init__(self) -> None:
        self.figures: list[Figure] = []

    def add(self, key: str, label: str, value: float | str, unit: str = "", target: str = "", passed: bool | None = None) -> None:
        self.figures.append(Figure(key, label, value, unit, target, passed))

    def ordered(self) -> list[Figure]:
        """Informational figures first, then a) to f) (measured in another order)."""
        return sorted(self.figures, key=lambda f: (f.key.split(".")[0] != "info", f.key.split(".")[0]))

    def table(self) -> str:
        rows = [("figure", "value", "target", "result")]
        for f in self.ordered():
            if isinstance(f.value, float):
                value = f"{f.value:,.0f}" if abs(f.value) >= 1000 else f"{f.value:.3g}"
            else:
                value = str(f.value)
            value = f"{value} {f.unit}".strip()
            result = "" if f.passed is None else ("PASS" if f.passed else "MISS")
            rows.append((f.label, value, f.target, result))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for n, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def add_latency(report: Report, key: str, name: str, latencies: list[float]) -> None:
    p50, p99, worst = percentile_ms(latencies, 50), percentile_ms(latencies, 99), max(latencies) * 1e3
    report.add(f"{key}.p50_ms", f"{name} p50", p50, "ms", "<= 1 ms", p50 <= 1.0)
    report.add(f"{key}.p99_ms", f"{name} p99", p99, "ms")
    report.add(f"{key}.max_ms", f"{name} max", worst, "ms", "<= 5 ms", worst <= 5.0)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (fewer samples and repetitions)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--side", type=int, default=SIDE,
        help=f"image side: {SIDE} (default) costs about 0.5 ms a sample on one core; 24 about 60 us, "
        "where the fixed per-sample re-seed (~12 us) of the drop-in path shows",
    )
    args = parser.parse_args(argv)

    scale = max(1, (args.side // 24) ** 2)
    if args.quick:
        n, runs, cheap_steps, slow_steps, first_runs = max(1000, 5000 // scale), 3, 100, 60, 3
    else:
        n, runs, cheap_steps, slow_steps, first_runs = max(4000, 20000 // scale), 5, 200, 200, 7
    batch_size, slow_batch_size = 32, 4
    started = time.perf_counter()

    cheap = Factories(n, batch_size, side=args.side)
    slow = Factories(n, slow_batch_size, side=args.side, sleep_s=SLEEP_S)
    report = Report()
    num_batches = -(-n // batch_size)

    log(f"savable_loader {sl.__version__}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"start method {torch.multiprocessing.get_start_method()}; "
        f"{n} samples of 3x{args.side}x{args.side}, batch {batch_size}, {NUM_WORKERS} workers, {runs} runs")

    report.add("info.sample_us", "sample cost (one process, 1 thread)", sample_cost_us(args.side), "us")
    report.add("info.reseed_us", "per-sample reseed cost (derive + seed_global)", reseed_cost_us(), "us")

    # a) and f): throughput
    comparisons: dict[str, Comparison] = {}
    for key, name, make_ours, make_torch, torch_name in (
        ("a", "drop-in", cheap.dropin, cheap.torch_map, "map-style"),
        ("f", "pipeline", cheap.pipe, cheap.torch_iterable, "IterableDataset"),
    ):
        log(f"{key}) {name} throughput ({runs} interleaved runs each)")
        c = comparisons[key] = interleaved_throughput(make_ours, make_torch, n, runs)
        report.add(f"{key}.savable_samples_per_s", f"{key}) {name} SavableDataLoader", c.ours_rate, "samples/s")
        report.add(f"{key}.torch_samples_per_s", f"{key}) torch DataLoader ({torch_name})", c.theirs_rate, "samples/s")
        report.add(f"{key}.ratio", f"{key}) {name} throughput ratio", c.ratio, "", ">= 0.97", c.ratio >= 0.97)
        report.add(f"{key}.cpu_ratio", f"{key}) {name} CPU-per-sample ratio (torch/ours)", c.cpu_ratio)

    # b) + c) save latency and state size
    sizes: dict[str, int] = {}
    for key, name, make, steps in (
        ("b.dropin_cheap", "b) save, drop-in, cheap", cheap.dropin, cheap_steps),
        ("b.pipeline_cheap", "b) save, pipeline, cheap", cheap.pipe, cheap_steps),
        ("b.dropin_sleep", "b) save, drop-in, 10 ms/sample", slow.dropin, slow_steps),
        ("b.pipeline_sleep", "b) save, pipeline, 10 ms/sample", slow.pipe, slow_steps),
    ):
        log(f"{name} ({steps} steps)")
        latencies, state = save_latencies(make, steps)
        add_latency(report, key, name, latencies)
        path = key.split(".")[1].split("_")[0]
        sizes[path] = max(sizes.get(path, 0), len(state))

    # e) bit-identical resume (its mid-epoch states also feed c and d)
    interrupt_at = num_batches // 2
    resume_states: dict[str, tuple[bytes, Any]] = {}
    for path, make in (("dropin", cheap.dropin), ("pipeline", cheap.pipe)):
        log(f"e) resume check, {path} (interrupt after {interrupt_at} of {num_batches} batches)")
        identical, detail, state, first = resume_check(make, interrupt_at)
        report.add(f"e.{path}_identical", f"e) {path} resume bit-identical", "yes" if identical else "no",
                   "", "yes", identical)
        if not identical:
            log(f"   {path}: {detail}")
        if state:
            resume_states[path] = (state, first)
            sizes[path] = max(sizes.get(path, 0), len(state))

    for path in ("dropin", "pipeline"):
        size = sizes[path]
        report.add(f"c.{path}_state_bytes", f"c) {path} state size ({NUM_WORKERS} workers)", float(size), "bytes",
                   "<= 12 KiB", size <= 12 * KIB)

    # d) restore to first batch
    for path, make in (("dropin", cheap.dropin), ("pipeline", cheap.pipe)):
        if path not in resume_states or resume_states[path][1] is None:
            report.add(f"d.{path}_ratio", f"d) {path} restore/cold first batch", "n/a", "", "<= 1.5", False)
            continue
        log(f"d) restore to first batch, {path}")
        state, first = resume_states[path]
        warm, cold, ratio = restore_ratio(make, state, first, first_runs)
        report.add(f"d.{path}_restore_ms", f"d) {path} restore -> first batch", warm * 1e3, "ms")
        report.add(f"d.{path}_cold_ms", f"d) {path} cold start -> first batch", cold * 1e3, "ms")
        report.add(f"d.{path}_ratio", f"d) {path} restore/cold first batch", ratio, "", "<= 1.5", ratio <= 1.5)

    elapsed = time.perf_counter() - started
    print(report.table())
    misses = [f.label for f in report.figures if f.passed is False]
    print(f"\n{len(misses)} of {sum(f.passed is not None for f in report.figures)} targets missed; "
          f"run took {elapsed:.0f} s ({'quick' if args.quick else 'full'})")

    if args.json:
        out = {
            "mode": "quick" if args.quick else "full",
            "elapsed_s": elapsed,
            "environment": {
                "python": platform.python_version(), "torch": torch.__version__,
                "savable_loader": sl.__version__, "cpu_count": os.cpu_count(),
                "start_method": torch.multiprocessing.get_start_method(), "platform": platform.platform(),
            },
            "parameters": {
                "samples": n, "batch_size": batch_size, "slow_batch_size": slow_batch_size,
                "num_workers": NUM_WORKERS, "runs": runs, "save_steps_cheap": cheap_steps,
                "save_steps_sleep": slow_steps, "first_batch_runs": first_runs, "sleep_s": SLEEP_S,
                "interrupt_at_batch": interrupt_at,
            },
            "raw": {
                f"{key}.{side}": [asdict(r) for r in getattr(c, side)]
                for key, c in comparisons.items()
                for side in ("ours", "theirs")
            },
            "figures": [asdict(f) for f in report.ordered()],
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
