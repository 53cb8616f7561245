"""examples/ddp_train.py under torchrun (2 ranks, gloo, CPU): a crash and a resume give
the uninterrupted run's batches and losses, per rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_harness import free_port

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


RUN_TIMEOUT_S = 240


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (ranks, their loader workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


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
    # faulthandler in every process: a run that hangs is failed with every process's stacks
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        below = _descendants(process.pid)
        for pid in below:  # faulthandler prints the Python stacks of all threads, then aborts
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        time.sleep(3)
        for pid in [*below, process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = process.communicate()
        logs = {str(log.relative_to(cwd)): log.read_text()[-2000:] for log in sorted(cwd.glob("*/rank*.log"))}
        pytest.fail(
            f"torchrun {' '.join(args)} ran past {RUN_TIMEOUT_S} s; its processes' stacks follow\n"
            f"stdout: {out[-3000:]}\nstep logs: {logs}\nstderr:\n{err[-30000:]}"
        )
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


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
