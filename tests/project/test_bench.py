"""The benchmark suite (bench/): a quick run on a tiny size writes the expected JSON and
finds SavableDataLoader's resumed stream bit-identical."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str, out: Path) -> tuple[dict, str]:
    """``python -m <module> <args> --json <out>`` from the repository root: its JSON and
    what it printed (the test fails with the run's stderr if it exits non-zero)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_quick_run_writes_json_with_every_figure(tmp_path):
    results, printed = run_bench(
        "bench",
        *("--quick", "--workloads", "tiny", "--contenders", "savable", "--scale", "0.4"),
        *("--no-scaling", "--extras", "costs"),
        out=tmp_path / "run.json",
    )
    assert results["mode"] == "quick" and results["machine"]["cpu_count"] >= 1 and results["date"]
    assert results["parameters"]["repeats"] == 2
    tiny = results["workloads"]["tiny"]["contenders"]
    assert set(tiny) == {"savable", "torch-map"}  # the baseline is added
    for name in ("savable",):
        d = tiny[name]
        assert d["bit_identical"] is True, d["resume_detail"]
        # every ratio: paired per interleaved repeat, median with min and max
        for figure in ("throughput_ratio", "cpu_ratio", "restore_ratio"):
            f = d[figure]
            assert len(f["values"]) == 2 and f["min"] <= f["median"] <= f["max"] and f["min"] > 0, figure
        assert d["throughput_ratio"]["values"] == [a / b for a, b in zip(d["rates"], tiny["torch-map"]["rates"])]
        assert d["cpu_ratio"]["values"] == [b / a for a, b in zip(d["cpu_us"], tiny["torch-map"]["cpu_us"])]
        assert d["samples_per_s"]["median"] > 0 and d["cpu_us_per_sample"]["median"] > 0
        assert set(d["save_ms"]) == {"p50", "p99", "max"} and 0 < d["save_ms"]["p50"] <= d["save_ms"]["max"]
        assert len(d["save_series_ms"]) == min(60, -(-results["workloads"]["tiny"]["samples"] // 64) - 1)
        assert d["state_bytes"] > 0 and d["restore_ms"]["median"] > 0 and d["cold_ms"]["median"] > 0
    assert tiny["torch-map"]["samples_per_s"]["median"] > 0 and "save_ms" not in tiny["torch-map"]
    results_by_figure = {t["figure"]: t for t in results["targets"]}
    assert "tiny / savable: resume bit-identical" in results_by_figure
    assert "tiny / savable: save p99 (ms)" in results_by_figure
    assert {t["result"] for t in results["targets"]} <= {"PASS", "NOISY", "MISS"}
    cpu = results_by_figure["tiny / savable: CPU ratio (all processes)"]
    assert cpu["target"] == ">= 0.9" and cpu["value"] == tiny["savable"]["cpu_ratio"]
    assert "re-seed (seed_global)" in results["costs"]["us_per_sample"]
    assert "| SavableDataLoader (drop-in)" in printed  # the table


def test_verdicts_flag_a_spread_wider_than_the_margin():
    from bench.measure import interleaved, paired, verdict

    assert verdict({"median": 0.99, "min": 0.975, "max": 1.1}, 0.97, higher_is_better=True) == "PASS"
    assert verdict({"median": 0.99, "min": 0.95, "max": 1.1}, 0.97, higher_is_better=True) == "NOISY"
    assert verdict({"median": 0.96, "min": 0.95, "max": 0.99}, 0.97, higher_is_better=True) == "MISS"
    assert verdict({"median": 1.2, "min": 1.0, "max": 1.6}, 1.5, higher_is_better=False) == "NOISY"
    assert verdict({"median": 1.2, "min": 1.0, "max": 1.4}, 1.5, higher_is_better=False) == "PASS"
    order: list[str] = []
    got = interleaved({"a": lambda r: order.append("a") or r, "b": lambda r: order.append("b") or 10 * r}, 4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # A B, then B A: the order rotates
    assert got == {"a": [0, 1, 2, 3], "b": [0, 10, 20, 30]}
    ratio = paired([2.0, 3.0, 8.0], [1.0, 1.0, 2.0])
    assert (ratio["median"], ratio["min"], ratio["max"]) == (3.0, 2.0, 4.0)


def test_confidence_interval_verdicts_say_noisy_while_the_interval_holds_the_target():
    from bench.measure import ci_verdict, fmt_spread, mean_ci, t95

    assert t95(1) == 12.706 and t95(30) == 2.042
    assert abs(t95(40) - 2.021) < 1e-3 and abs(t95(120) - 1.980) < 1e-3  # (the expansion past the table)
    figure = mean_ci([0.004, 0.006, 0.005, 0.005])
    # mean 0.005, sd 0.000816: the interval is 0.005 +- 3.182 * 0.000408
    assert abs(figure["mean"] - 0.005) < 1e-12 and abs(figure["high"] - 0.0062991) < 1e-6
    assert figure["median"] == 0.005 and figure["values"] == [0.004, 0.006, 0.005, 0.005]
    assert ci_verdict(figure, 0.01, higher_is_better=False) == "PASS"
    assert ci_verdict(figure, 0.006, higher_is_better=False) == "NOISY"  # (the interval holds it)
    assert ci_verdict(figure, 0.003, higher_is_better=False) == "MISS"
    assert ci_verdict(figure, 0.003, higher_is_better=True) == "PASS"
    assert ci_verdict(figure, 0.0045, higher_is_better=True) == "NOISY"
    assert ci_verdict(figure, 0.01, higher_is_better=True) == "MISS"
    assert fmt_spread(figure) == "0.005 [0.0037 to 0.0063]"
    with pytest.raises(ValueError, match="at least 2 values, got 1"):
        mean_ci([0.1])
    with pytest.raises(ValueError, match="at least 1 degree of freedom, got 0"):
        t95(0)


def test_unknown_workload_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--workloads", "nope"],
        cwd=ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown workload 'nope'" in proc.stderr


def test_dropin_bench_writes_every_figure(tmp_path):
    """`bench/bench_dropin.py` (#30) on a tiny size: every loader's figures, the paired
    ratios and the per-sample worker steps are in its JSON."""
    results, printed = run_bench(
        "bench.bench_dropin",
        *("--samples", "128", "--repeats", "2", "--batch-reseed", "--step-rounds", "20"),
        out=tmp_path / "dropin.json",
    )
    assert set(results["loaders"]) == {"torch", "savable", "savable-batch"}
    for figures in results["loaders"].values():
        assert set(figures) == {"samples_per_s", "main_us", "workers_us", "cpu_us"}
        assert len(figures["cpu_us"]["values"]) == 2 and figures["workers_us"]["median"] > 0
    for name in ("wall_ratio", "cpu_ratio", "wall_ratio_batch", "cpu_ratio_batch", "per_sample_reseed_us"):
        assert len(results[name]["values"]) == 2
    assert {"sample", "re-seed all three", "twist random", "twist numpy", "twist torch"} <= set(results["steps_us"])
    assert [t["figure"] for t in results["targets"]] == ["wall ratio", "CPU ratio"]
    assert "CPU ratio:" in printed


def test_stats_bench_writes_every_figure(tmp_path):
    """`bench/bench_stats.py` (#34) on a tiny size: every case ran with statistics on (its
    stages named) and off, and its overheads are paired per repeat and judged."""
    results, printed = run_bench("bench.bench_stats", *("--quick", "--scale", "0.1"), out=tmp_path / "stats.json")
    assert set(results["cases"]) == {"dropin", "dropin-tiny", "pipe-2w", "pipe-0w", "pack-0w"}
    for case, res in results["cases"].items():
        for side in ("on", "off", "off again"):
            assert len(res[side]["samples_per_s"]["values"]) == 2 and res[side]["cpu_us"]["median"] > 0
        for figure in ("wall_overhead", "cpu_overhead", "cpu_control"):
            assert len(res[figure]["values"]) == 2  # (a value per repeat)
            assert res[figure]["low"] <= res[figure]["mean"] <= res[figure]["high"]
        assert "collate" in res["stages"], case
        # the main process's loaders are also timed batch by batch, in turn
        assert ("cpu_overhead_in_turn" in res) == (case in ("pipe-0w", "pack-0w")), case
    assert len(results["cases"]["pipe-0w"]["cpu_control_in_turn"]["values"]) == 2
    assert "MapDataset(small_item)" in results["cases"]["pipe-0w"]["stages"]
    assert "PackingDataset" in results["cases"]["pack-0w"]["stages"]
    assert results["cases"]["pack-0w"]["samples"] > 0  # (the packed rows of the corpus)
    assert len(results["targets"]) == 12 and {t["result"] for t in results["targets"]} <= {"PASS", "NOISY", "MISS"}
    assert "record_stats, pipe-0w: CPU overhead" in printed
    assert "record_stats, pack-0w: CPU, batches in turn, overhead" in printed
    assert results["fresh_processes"] is False  # (--quick: every repeat in the bench's process)
    assert (results["repeats"], results["pairs"], results["gc_thresholds"]) == (2, 1, [600, 800])


def test_stats_bench_epochs_run_under_the_threshold_they_are_given():
    """Each timed epoch of `bench/bench_stats.py` runs under the garbage collector
    threshold drawn for it, and the process's own is put back after it."""
    import torch

    from bench import bench_stats

    seen: list[int] = []

    def make() -> Any:
        class Batches:
            record_stats = False

            def __iter__(self):
                seen.append(gc.get_threshold()[0])
                yield torch.zeros(2)

        return Batches()

    kept = gc.get_threshold()
    got = bench_stats.epoch(make, 2, threshold=613)
    assert seen == [613] and gc.get_threshold() == kept and got["samples"] == 2
    bench_stats.epoch(make, 2)
    assert seen == [613, kept[0]]


def test_stats_bench_runs_each_repeat_in_a_fresh_process(tmp_path):
    """Without --quick each repeat of `bench/bench_stats.py` runs in a fresh process (the
    corpus of pack-0w written once, by the bench's): its figures come back whole."""
    args = ("--cases", "pipe-0w,pack-0w", "--repeats", "2", "--pairs", "2", "--scale", "0.02")
    results, printed = run_bench("bench.bench_stats", *args, out=tmp_path / "stats.json")
    assert results["fresh_processes"] is True
    assert set(results["cases"]) == {"pipe-0w", "pack-0w"}
    for res in results["cases"].values():
        for side in ("on", "off", "off again"):  # (2 repeats of 2 rounds: 4 epochs)
            assert len(res[side]["cpu_us"]["values"]) == 4 and res[side]["cpu_us"]["median"] > 0
        assert len(res["cpu_control"]["values"]) == 2 and len(res["cpu_overhead_in_turn"]["values"]) == 2
    assert "PackingDataset" in results["cases"]["pack-0w"]["stages"]
    assert "CPU, off vs off" in printed
