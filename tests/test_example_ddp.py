"""examples/ddp_train.py under torchrun (2 ranks, gloo, CPU): a crash and a resume give
the uninterrupted run's batches and losses, per rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"


def torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(EXAMPLE),
        "--steps",
        "12",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)


def test_ddp_example_crash_and_resume(tmp_path):
    ref = torchrun(tmp_path, "--ckpt", "ref_ckpt", "--step-log", "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    crash = torchrun(tmp_path, "--ckpt", "ckpt", "--step-log", "crash", "--stop-after", "7")
    assert crash.returncode != 0  # the simulated crash
    resumed = torchrun(tmp_path, "--ckpt", "ckpt", "--step-log", "resumed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 5" in resumed.stdout
    for rank in (0, 1):
        reference = (tmp_path / "ref" / f"rank{rank}.log").read_text().splitlines()
        crashed = (tmp_path / "crash" / f"rank{rank}.log").read_text().splitlines()
        after = (tmp_path / "resumed" / f"rank{rank}.log").read_text().splitlines()
        assert len(reference) == 12 and crashed == reference[:7]
        assert after == reference[5:], f"rank {rank}: resumed steps differ from the uninterrupted run"
    assert (tmp_path / "ref" / "rank0.log").read_text() != (tmp_path / "ref" / "rank1.log").read_text()
