"""The benchmark suite (bench/): a quick run on a tiny size writes the expected JSON and
finds SavableDataLoader's resumed stream bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_writes_json_with_every_figure(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--workloads", "tiny", "--contenders", "savable",
         "--scale", "0.4", "--no-scaling", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["mode"] == "quick" and results["machine"]["cpu_count"] >= 1 and results["date"]
    tiny = results["workloads"]["tiny"]["contenders"]
    assert set(tiny) == {"savable", "torch-map"}  # the baseline is added
    for name in ("savable",):
        d = tiny[name]
        assert d["bit_identical"] is True, d["resume_detail"]
        assert d["samples_per_s"] > 0 and d["throughput_ratio"] > 0 and d["cpu_ratio"] > 0
        assert set(d["save_ms"]) == {"p50", "p99", "max"} and 0 < d["save_ms"]["p50"] <= d["save_ms"]["max"]
        assert len(d["save_series_ms"]) == min(60, -(-results["workloads"]["tiny"]["samples"] // 64) - 1)
        assert d["state_bytes"] > 0 and d["restore_ms"] > 0 and d["cold_ms"] > 0 and d["restore_ratio"] > 0
    assert tiny["torch-map"]["samples_per_s"] > 0 and "save_ms" not in tiny["torch-map"]
    figures = {t["figure"] for t in results["targets"]}
    assert "tiny / savable: resume bit-identical" in figures and "tiny / savable: save p99 (ms)" in figures
    assert "| SavableDataLoader (drop-in)" in proc.stdout  # the table


def test_unknown_workload_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "bench", "--workloads", "nope"], cwd=ROOT, capture_output=True, check=False,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown workload 'nope'" in proc.stderr
