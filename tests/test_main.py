"""The command line: ``python -m savable_loader`` (help, the torch-free import, the demo)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from savable_loader.__main__ import main
from savable_loader.state import RankState, load_file

ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT = 240


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CI="true", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "savable_loader", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=timeout,
    )


def test_help():
    top = run_cli("--help")
    assert top.returncode == 0, top.stderr
    assert "demo" in top.stdout
    demo = run_cli("demo", "--help")
    assert demo.returncode == 0, demo.stderr
    for option in ("--workers", "--steps", "--kill-at", "--seed", "--out"):
        assert option in demo.stdout
    assert "--_child" not in demo.stdout


def test_main_in_process_help_and_missing_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_importing_the_command_line_does_not_import_torch():
    code = (
        "import sys, savable_loader.__main__ as m; m.build_parser().parse_args(['demo']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_demo_rejects_kill_at_past_the_end():
    out = run_cli("demo", "--steps", "10", "--kill-at", "10")
    assert out.returncode == 2
    assert "--kill-at" in out.stderr


def _children_of(out_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "--_child" in cmdline and str(out_dir) in cmdline:
            found.append(proc)
    return found


def test_demo_default_kill_point():
    out = run_cli("demo", "--steps", "30", "--workers", "2", "--seed", "1", timeout=DEMO_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical: yes" in out.stdout
    killed = int(re.search(r"after step (\d+) \(--kill-at (\d+)\)", out.stdout).group(2))
    assert 10 <= killed <= 20  # the middle third of 30 steps
    assert "plain torch DataLoader:" in out.stdout
    assert "reference run" in out.stderr  # progress lines, plain (no TTY)
    assert "\r" not in out.stderr


def test_demo_explicit_kill_at_keeps_its_files(tmp_path):
    out_dir = tmp_path / "demo"
    out = run_cli("demo", "--steps", "30", "--workers", "2", "--seed", "1", "--kill-at", "17",
                  "--out", str(out_dir), timeout=DEMO_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical: yes" in out.stdout
    killed = int(re.search(r"after step (\d+) \(--kill-at 17\)", out.stdout).group(1))
    assert killed >= 17
    restored = re.search(r"restored: +epoch (\d+), (\d+) samples consumed -> continues at step (\d+)", out.stdout)
    assert restored is not None, out.stdout
    epoch, consumed, next_step = map(int, restored.groups())
    # Saves come every 5 steps, after the step's training; the kill lands during a step.
    saved = next_step - 1
    assert saved in {5 * ((killed - 1) // 5), 5 * (killed // 5)}, (saved, killed)
    per_epoch = 16  # 250 samples in batches of 16
    assert (epoch, consumed) == (saved // per_epoch, saved % per_epoch * 16)
    state = load_file(out_dir / "loader.state")
    assert isinstance(state, RankState)
    assert (state.position.epoch, state.position.consumed) == (epoch, consumed)
    assert (out_dir / "train.log").stat().st_size > 0 and (out_dir / "resume.log").stat().st_size > 0
    assert _children_of(out_dir) == []  # the killed process group left nothing behind
