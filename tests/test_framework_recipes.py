"""docs/recipes.md's Lightning and Accelerate recipes under the real frameworks: a crash
after step 10 and a resume from the step-8 checkpoint give the uninterrupted run's
batches and losses, on 1 and 2 processes (CPU, gloo).

Lightning and Accelerate are not dependencies of the package; the `test` extra installs
them (these tests skip where they are missing; the docs test runs the recipes' hooks
without them).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "framework_recipes"

pytestmark = pytest.mark.timeout(900)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400,
                          stdin=subprocess.DEVNULL)


def _check(out: Path, ranks: int) -> None:
    for rank in range(ranks):
        reference = (out / f"ref.rank{rank}.log").read_text().splitlines()
        crashed = (out / f"crash.rank{rank}.log").read_text().splitlines()
        resumed = (out / f"resume.rank{rank}.log").read_text().splitlines()
        assert len(reference) == 20 and crashed == reference[:10], f"rank {rank}"
        assert resumed == reference[8:], f"rank {rank}: the resumed steps differ from the uninterrupted run"


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_recipe(tmp_path, devices):
    for mode in ("ref", "crash", "resume"):
        done = _run([sys.executable, str(SCRIPTS / "lightning_resume.py"), mode, str(tmp_path), str(devices)], tmp_path)
        assert (done.returncode != 0) == (mode == "crash"), f"{mode}:\n{done.stderr[-3000:]}"
    _check(tmp_path, devices)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
@pytest.mark.parametrize("processes", [1, 2])
def test_accelerate_recipe(tmp_path, processes):
    for mode in ("ref", "crash", "resume"):
        script = [str(SCRIPTS / "accelerate_resume.py"), mode, str(tmp_path)]
        if processes == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                   "--master-port", str(free_port()), *script]
        done = _run(cmd, tmp_path)
        assert (done.returncode != 0) == (mode == "crash"), f"{mode}:\n{done.stderr[-3000:]}"
    _check(tmp_path, processes)
