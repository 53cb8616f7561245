"""bench/bench_streams.py runs at a tiny size and writes every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import require_redis

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_streams_quick_run_writes_its_figures(tmp_path: Path) -> None:
    require_redis()
    out = tmp_path / "streams.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    args = ["--entries", "2000", "--repeats", "1", "--saves", "20", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "bench/bench_streams.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["entries"] == 2000 and results["workers"] == 2
    assert results["plain_per_s"]["median"] > 0 and results["source_per_s"]["median"] > 0
    assert results["ratio"]["values"] == [results["source_per_s"]["median"] / results["plain_per_s"]["median"]]
    assert 0 < results["save_ms"]["p50"] <= results["save_ms"]["p99"] <= results["save_ms"]["max"]
    assert {t["result"] for t in results["targets"]} <= {"PASS", "NOISY", "MISS"}
    assert "| RedisStreamSource (2 workers)" in proc.stdout
