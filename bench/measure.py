"""Measurements shared by every contender: throughput, save latency, restore, exactness."""

from __future__ import annotations

import gc
import itertools
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Timer",
    "batch_len",
    "batches_equal",
    "ci_verdict",
    "close",
    "epoch_run",
    "finish",
    "first_batch",
    "fmt_spread",
    "interleaved",
    "log",
    "mean_ci",
    "paired",
    "peak_rss_mib",
    "percentiles_ms",
    "reset_peak_rss",
    "rss_mib",
    "resume_check",
    "save_latencies",
    "spread",
    "t95",
    "table",
    "verdict",
]


def close(it: Any) -> None:
    """Stop an iterator and its worker processes now (not at garbage collection)."""
    if hasattr(it, "close") and not hasattr(it, "_shutdown_workers"):  # generators
        it.close()
    elif hasattr(it, "_shutdown_workers"):  # torch's (and torchdata's) multiprocessing iterator
        it._shutdown_workers()
    del it
    gc.collect()


def batch_len(batch: Any) -> int:
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(x.shape[0])


def batches_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(batches_equal, a, b))
    return bool(a == b)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its reaped children (workers)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def epoch_run(make: Callable[[], Any], expected: int) -> tuple[float, float]:
    """One whole epoch of a fresh loader (worker start-up included): samples per second of
    wall time and CPU microseconds per sample over all processes."""
    gc.collect()
    loader = make()
    count = 0
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    it = iter(loader)
    for batch in it:
        count += batch_len(batch)
    seconds = time.perf_counter() - t0
    close(it)
    del loader
    gc.collect()
    cpu = cpu_seconds() - cpu0
    if count != expected:
        raise RuntimeError(f"an epoch yielded {count} samples, expected {expected}")
    return count / seconds, cpu / count * 1e6


def save_latencies(make: Callable[[], Any], save: Callable[[Any], Any], steps: int) -> tuple[list[float], Any]:
    """``save(loader)`` after each of ``steps`` batches: seconds per call, the last state."""
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
            state = save(loader)
            latencies.append(time.perf_counter() - t0)
    finally:
        close(it)
    return latencies, state


def percentiles_ms(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def first_batch(make: Callable[[], Any], restore: Callable[[Any], None] | None) -> tuple[float, Any]:
    """Seconds from building a loader (and restoring) to its first batch, and the batch."""
    gc.collect()
    t0 = time.perf_counter()
    loader = make()
    if restore is not None:
        restore(loader)
    it = iter(loader)
    batch = next(it)
    seconds = time.perf_counter() - t0
    close(it)
    return seconds, batch


def resume_check(
    make: Callable[[], Any],
    save: Callable[[Any], bytes],
    restore: Callable[[Any, bytes], None],
    interrupt_at: int,
) -> dict[str, Any]:
    """Interrupt a run after ``interrupt_at`` batches (saving its state), resume a fresh
    loader from the state and compare the rest of the epoch, batch by batch, with an
    uninterrupted reference run. Also checks that two fresh runs agree up to the save."""
    reference = iter(make())
    interrupted_loader = make()
    interrupted = iter(interrupted_loader)
    out: dict[str, Any] = {"identical": False, "detail": "", "state": b"", "first": None}
    try:
        for i in range(interrupt_at):
            if not batches_equal(next(interrupted), next(reference)):
                out["detail"] = f"two fresh loaders differ at batch {i}"
                return out
        out["state"] = save(interrupted_loader)
        next(interrupted)  # the workers are mid-flight when the run "dies"
        close(interrupted)
        resumed_loader = make()
        restore(resumed_loader, out["state"])
        resumed = iter(resumed_loader)
        compared = 0
        try:
            for ref, res in itertools.zip_longest(reference, resumed):
                if ref is None or res is None:
                    which = "resumed" if res is None else "reference"
                    out["detail"] = f"the {which} stream ended early after {compared} batches"
                    return out
                if out["first"] is None:
                    out["first"] = res
                if not batches_equal(ref, res):
                    out["detail"] = f"batch {interrupt_at + compared} differs (first of {compared + 1} compared)"
                    return out
                compared += 1
        finally:
            close(resumed)
        out["identical"] = True
        out["detail"] = f"{compared} batches after batch {interrupt_at} equal"
        return out
    finally:
        close(reference)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# -- interleaved repeats, ratios with their spread, verdicts ----------------------------


def spread(values: list[float]) -> dict[str, Any]:
    """Median with min and max (and the values themselves)."""
    return {
        "median": median(values),
        "min": float(min(values)),
        "max": float(max(values)),
        "values": [float(v) for v in values],
    }


def paired(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    """The ratios ``numerators[i] / denominators[i]`` of runs made side by side (the same
    repeat of an interleaved sequence), as :func:`spread`."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"paired ratios need equal, non-empty lists, got {len(numerators)} and {len(denominators)}")
    return spread([a / b for a, b in zip(numerators, denominators)])


def interleaved(runs: dict[str, Callable[[int], Any]], repeats: int) -> dict[str, list[Any]]:
    """Run every entry of ``runs`` once per repeat, in turn (A B A B ..., or A B C A B C
    ...), ``repeats`` times; ``runs[name](repeat)`` returns one measurement. The order
    within a repeat rotates, so that no entry always runs first (after a pause) or
    last."""
    names = list(runs)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(runs[name](r))
    return out


def verdict(figure: dict[str, Any], target: float, higher_is_better: bool) -> str:
    """PASS when every repeat meets ``target``; MISS when the median misses it; NOISY when
    the median meets it but the spread reaches past it (the margin is smaller than the
    noise: not a result either way)."""

    def ok(x: float) -> bool:
        return x >= target if higher_is_better else x <= target

    if not ok(figure["median"]):
        return "MISS"
    worst = figure["min"] if higher_is_better else figure["max"]
    return "PASS" if ok(worst) else "NOISY"


#: Two-sided 95 % quantiles of Student's t, by degrees of freedom (1 to 30).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (beyond
    30: its Cornish-Fisher expansion, within 0.001)."""
    if df < 1:
        raise ValueError(f"t95 needs at least 1 degree of freedom, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values: list[float]) -> dict[str, Any]:
    """:func:`spread` with the mean and its 95 % confidence interval (``low``, ``high``:
    Student's t over the values, taken as independent measurements of one quantity)."""
    if len(values) < 2:
        raise ValueError(f"a confidence interval needs at least 2 values, got {len(values)}")
    out = spread(values)
    mean = statistics.fmean(values)
    half = t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    out.update(mean=mean, low=mean - half, high=mean + half)
    return out


def ci_verdict(figure: dict[str, Any], target: float, higher_is_better: bool) -> str:
    """A :func:`mean_ci` figure against ``target``: PASS when the whole confidence
    interval meets it, MISS when the whole interval misses it, NOISY when the interval
    holds the target (the measurements cannot tell: more of them, or a quieter machine)."""
    low, high = figure["low"], figure["high"]
    if higher_is_better:
        low, high, target = -high, -low, -target
    if high <= target:
        return "PASS"
    return "MISS" if low > target else "NOISY"


def fmt_spread(figure: dict[str, Any], digits: int = 3) -> str:
    """``median (min-max)`` with ``digits`` significant digits; a :func:`mean_ci` figure:
    ``mean [low to high]`` (its 95 % confidence interval)."""

    def g(x: float) -> str:
        return f"{x:,.{digits}g}" if abs(x) < 10**digits else f"{x:,.0f}"

    if "low" in figure:
        return f"{g(figure['mean'])} [{g(figure['low'])} to {g(figure['high'])}]"
    return f"{g(figure['median'])} ({g(figure['min'])}-{g(figure['max'])})"


class Timer:
    """Wall and CPU seconds (this process, all threads) of a block (after a garbage collection).

    Example::

        with Timer() as t:
            work()
        t.wall, t.cpu
    """

    wall = 0.0
    cpu = 0.0

    def __enter__(self) -> Timer:
        gc.collect()  # a collection left over from earlier work is not the block's cost
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def log(message: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def table(rows: list[list[str]]) -> str:
    """A Markdown table; the first row is the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def finish(out: dict[str, Any], text: str, json_path: str | None) -> dict[str, Any]:
    """Print a section's tables and its targets; write its JSON if asked."""
    print(text)
    for t in out.get("targets", [out["target"]] if "target" in out else []):
        print(f"{t['figure']}: {fmt_spread(t['value'])} (target {t['target']}): {t['result']}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def peak_rss_mib() -> float:
    """Peak resident set size of this process (since :func:`reset_peak_rss`), in MiB."""
    status = _proc_status()
    if "VmHWM" in status:
        return status["VmHWM"] / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rss_mib() -> float:
    """Resident set size of this process now, in MiB (0 where /proc is missing)."""
    return _proc_status().get("VmRSS", 0) / 1024


def reset_peak_rss() -> bool:
    """Start a new peak (Linux >= 4.0: ``/proc/self/clear_refs``); False if not possible,
    then the peak stays the lifetime's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status() -> dict[str, int]:
    """KiB fields of /proc/self/status (VmRSS, VmHWM)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    out[name] = int(value.split()[0])
    except OSError:
        pass
    return out
