"""The command line: ``python -m savable_loader`` (help, the torch-free import, the demo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from savable_loader.__main__ import main
from savable_loader.cli import demo as _demo
from savable_loader.state import RankState, load_file

ROOT = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT = 240


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, CI="true", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    return subprocess.run(
        [sys.executable, "-m", "savable_loader", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
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


def test_console_script_runs_the_same_commands(tmp_path):
    script = Path(sys.executable).parent / "savable-loader"
    if not script.exists():
        pytest.skip(f"the package is not installed in this environment ({script} is missing)")
    top = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "demo" in top.stdout and "inspect" in top.stdout, top.stderr
    garbage = tmp_path / "garbage.state"
    garbage.write_bytes(b"not a state")
    bad = subprocess.run([str(script), "inspect", str(garbage)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and str(garbage) in bad.stderr, bad.stderr


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
        "import sys, savable_loader.__main__ as m; m.build_parser().parse_args(['demo']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_demo_rejects_kill_at_past_the_end():
    out = run_cli("demo", "--steps", "10", "--kill-at", "10")
    assert out.returncode == 2
    assert "--kill-at" in out.stderr


def _children_of(out_dir: Path) -> list[psutil.Process]:
    """Live processes started for a demo run with ``--out out_dir``: its training runs
    (forked or not), their ranks and loader workers. The demo itself has exited."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if any(str(out_dir) in part for part in cmdline) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_demo_two_ranks_default_kill_point():
    out = run_cli(
        "demo",
        "--ranks",
        "2",
        "--steps",
        "12",
        "--workers",
        "1",
        "--seed",
        "1",
        "--save-every",
        "3",
        "--step-ms",
        "5",
        timeout=DEMO_TIMEOUT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical: yes" in out.stdout
    assert "on 2 ranks (gloo on 127.0.0.1)" in out.stdout
    killed = int(re.search(r"after step (\d+) \(--kill-at (\d+)\)", out.stdout).group(2))
    assert 4 <= killed <= 8  # the middle third of 12 steps
    restored = re.search(r"-> continues at step (\d+)", out.stdout)
    after = 12 - int(restored.group(1)) + 1
    assert f"batches after restart:  {2 * after}/{2 * after} equal" in out.stdout
    assert f"loss after restart:     {2 * after}/{2 * after} equal" in out.stdout
    assert "plain torch DataLoader: restarts epoch" in out.stdout
    assert "reference run" in out.stderr  # progress lines, plain (no TTY)
    assert "\r" not in out.stderr


def test_demo_explicit_kill_at_keeps_its_files(tmp_path):
    out_dir = tmp_path / "demo"
    out = run_cli(
        "demo",
        "--steps",
        "30",
        "--workers",
        "2",
        "--seed",
        "1",
        "--kill-at",
        "17",
        "--out",
        str(out_dir),
        "--step-ms",
        "10",
        timeout=DEMO_TIMEOUT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical: yes" in out.stdout
    killed = int(re.search(r"after step (\d+) \(--kill-at 17\)", out.stdout).group(1))
    assert killed >= 17
    restored = re.search(
        r"restored: +step-(\d+): rank 0 at epoch (\d+), (\d+) samples consumed "
        r"-> continues at step (\d+)",
        out.stdout,
    )
    assert restored is not None, out.stdout
    ckpt_step, epoch, consumed, next_step = map(int, restored.groups())
    # Checkpoints come every 5 steps, after the step's training; the kill lands during a step.
    saved = next_step - 1
    assert saved == ckpt_step
    assert saved in {5 * ((killed - 1) // 5), 5 * (killed // 5)}, (saved, killed)
    per_epoch = 16  # 250 samples in batches of 16
    assert (epoch, consumed) == (saved // per_epoch, saved % per_epoch * 16)
    assert f"loss after restart:     {30 - saved}/{30 - saved} equal" in out.stdout
    latest = out_dir / "ckpt" / (out_dir / "ckpt" / "latest").read_text().strip()
    assert latest.name == f"step-{saved:06d}"
    states = load_file(latest / "loader.state")
    assert isinstance(states, list) and len(states) == 1 and isinstance(states[0], RankState)
    assert (states[0].position.epoch, states[0].position.consumed) == (epoch, consumed)
    assert (latest / "model.pt").stat().st_size > 0
    for role in ("reference", "train", "resume"):
        assert (out_dir / f"{role}.rank0.log").stat().st_size > 0
    assert _children_of(out_dir) == []  # the killed process group left nothing behind


def _log(tmp_path, name, records):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tail = _demo._LogTail(path)
    tail.poll()
    return tail


def test_demo_comparison_can_fail(tmp_path):
    """The comparison behind "identical" reports a changed batch, a changed loss and a missing step."""
    ref = [{"step": s, "digest": f"d{s}", "loss": f"l{s}"} for s in range(1, 6)]
    reference = [_log(tmp_path, "ref", ref)]
    same = [_log(tmp_path, "same", ref[2:])]
    assert _demo._compare(reference, [same], range(3, 6)) == (3, 3, [])
    changed = [dict(r) for r in ref[2:]]
    changed[0]["digest"] = "other"
    changed[1]["loss"] = "other"
    del changed[2]
    bad = [_log(tmp_path, "bad", changed)]
    batches, losses, problems = _demo._compare(reference, [bad], range(3, 6))
    assert (batches, losses) == (1, 1)
    assert problems == ["rank 0 step 3: batch differs", "rank 0 step 4: loss differs", "rank 0 step 5 missing"]


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    """``python -m savable_loader inspect --json STATE | head``: the reader leaves before
    the document is written; no BrokenPipeError traceback, the shell's SIGPIPE status."""
    import savable_loader as sl
    from savable_loader.state import save_file

    loader = sl.SavableDataLoader(list(range(100)), batch_size=4, shuffle=True, seed=0)
    it = iter(loader)
    next(it)
    save_file(tmp_path / "loader.state", loader.save_state_rank())
    read, write = os.pipe()
    os.close(read)  # `head` has already exited
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-m", "savable_loader", "inspect", "--json", str(tmp_path / "loader.state")],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env=env,
    )
    os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)
