"""Exact resume where users train: the loader put where the DataLoader goes, under the
real frameworks (CPU, gloo on 127.0.0.1), on 1 and 2 processes.

Each scenario runs a script of ``tests/frameworks/``: an uninterrupted reference run that
checkpoints after step 6 (the last batch of epoch 0) and step 9 (mid epoch 1), then, in
fresh processes, one resume from each checkpoint. Every step after the checkpoint —
epoch as the framework counts it, sample indices, a digest of the batch's tensors
(augmentations drawn in loader workers included) and the loss, bit for bit — must equal
the reference's, on every rank.

Scenarios that cannot be exact say so with a clear error, which is what they check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port
from tests.frameworks._common import SAVE_STEPS, TOTAL_STEPS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "frameworks"
RUN_TIMEOUT = 300

pytestmark = pytest.mark.timeout(900)


def _requires(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    return env


def _command(script: str, out: Path, run: str, procs: int, torchrun: bool, *args: str) -> list[str]:
    """``script OUT RUN args...``: under torchrun with ``procs`` ranks, or with python
    (Lightning and Fabric start their other ranks themselves from ``args``)."""
    cmd = [str(SCRIPTS / script), str(out), run, *args]
    if torchrun:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(procs),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *cmd,
        ]
    return [sys.executable, *cmd]


def _run(cmds: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands side by side; their results in order."""
    procs = [
        subprocess.Popen(
            cmd,
            cwd=cwd,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for cmd in cmds
    ]
    done = []
    for cmd, p in zip(cmds, procs):
        try:
            stdout, stderr = p.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{cmd} did not finish within {RUN_TIMEOUT} s") from None
        done.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return done


def _ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{' '.join(done.args[-4:])} failed:\n{done.stderr[-4000:]}"


def _steps(out: Path, run: str, rank: int) -> list[dict]:
    path = out / f"{run}.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assert_continues(got: list[dict], want: list[dict], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"{what}: step {b['step']} differs\n  resumed:       {a}\n  uninterrupted: {b}"
    assert len(got) == len(want), f"{what}: {len(got)} steps after the resume, expected {len(want)}"


def check_scenario(
    tmp_path: Path, script: str, procs: int, torchrun: bool, *args: str, resume_from: tuple[int, ...] = SAVE_STEPS
) -> None:
    """Reference run, then a resume from each checkpoint side by side; compare every rank."""
    _ok(_run([_command(script, tmp_path, "ref", procs, torchrun, *args)], tmp_path)[0])
    runs = [f"resume-{s}" for s in resume_from]
    for done in _run([_command(script, tmp_path, run, procs, torchrun, *args) for run in runs], tmp_path):
        _ok(done)
    for rank in range(procs):
        reference = _steps(tmp_path, "ref", rank)
        assert [s["step"] for s in reference] == list(range(1, TOTAL_STEPS + 1)), f"rank {rank}: reference run"
        for step, run in zip(resume_from, runs):
            _assert_continues(_steps(tmp_path, run, rank), reference[step:], f"rank {rank}, resumed from step {step}")
    if procs > 1:
        assert _steps(tmp_path, "ref", 0)[0]["index"] != _steps(tmp_path, "ref", 1)[0]["index"], "ranks share data"


# -- Lightning -----------------------------------------------------------------------


@_requires("lightning")
@pytest.mark.parametrize("procs", [1, 2])
def test_lightning_trainer(tmp_path, procs):
    """The loader from ``train_dataloader()``; on 2 devices it is already split (its
    sampler is a DistributedSampler) and Lightning keeps it; rank 1 resumes from rank 0's
    checkpoint entry."""
    check_scenario(tmp_path, "lightning_trainer.py", procs, False, str(procs))


@_requires("lightning")
def test_lightning_trainer_loader_built_before_fit(tmp_path):
    """``trainer.fit(model, loader)`` with the loader built before the process group
    exists: Lightning rebuilds it with a DistributedSampler and the user's arguments;
    rank 1 derives its DistributedSampler position from rank 0's entry."""
    check_scenario(tmp_path, "lightning_trainer.py", 2, False, "2", "--before-fit")


@_requires("lightning")
@pytest.mark.parametrize("procs", [1, 2])
def test_lightning_trainer_pipeline(tmp_path, procs):
    """A savable pipeline (no ``len()``): Lightning fetches a batch ahead, the state leaves
    it out; on 2 devices every rank's state is gathered into rank 0's checkpoint."""
    check_scenario(tmp_path, "lightning_trainer.py", procs, False, str(procs), "--pipeline")


@_requires("lightning")
@pytest.mark.parametrize("procs", [1, 2])
def test_fabric(tmp_path, procs):
    """Fabric's ``setup_dataloaders`` keeps the loader; its per-process ``set_epoch`` count
    (0 again after a resume) does not move the loader's epochs."""
    check_scenario(tmp_path, "fabric_loop.py", procs, False, str(procs))


# -- Accelerate ----------------------------------------------------------------------


@_requires("accelerate")
@pytest.mark.parametrize("procs", [1, 2])
def test_accelerate_register_for_checkpointing(tmp_path, procs):
    check_scenario(tmp_path, "accelerate_loop.py", procs, procs > 1, "register")


@_requires("accelerate")
@pytest.mark.parametrize("procs", [1, 2])
def test_accelerate_prepare_is_a_clear_error(tmp_path, procs):
    """``accelerator.prepare(loader)`` rebuilds a plain DataLoader from the loader's
    attributes: the first batch says so, and what to do."""
    done = _run([_command("accelerate_loop.py", tmp_path, "ref", procs, procs > 1, "prepare")], tmp_path)[0]
    assert done.returncode != 0
    assert "LoaderUsageError" in done.stderr and "register_for_checkpointing" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "ref.rank0.jsonl").exists()


# -- Hugging Face Trainer ------------------------------------------------------------


@_requires("transformers", "datasets")
@pytest.mark.parametrize("procs", [1, 2])
def test_savable_trainer(tmp_path, procs):
    check_scenario(tmp_path, "hf_trainer.py", procs, procs > 1, "savable")


@_requires("transformers", "datasets")
def test_trainer_with_the_loader_says_use_savable_trainer(tmp_path):
    """A plain Trainer skips batches with ``skip_first_batches``, which rebuilds a plain
    DataLoader: a clear error naming SavableTrainer, not a TypeError."""
    _ok(_run([_command("hf_trainer.py", tmp_path, "ref", 1, False, "override")], tmp_path)[0])
    done = _run([_command("hf_trainer.py", tmp_path, f"resume-{SAVE_STEPS[1]}", 1, False, "override")], tmp_path)[0]
    assert done.returncode != 0
    assert "LoaderUsageError" in done.stderr and "SavableTrainer" in done.stderr, done.stderr[-3000:]


# -- torch.distributed.checkpoint ----------------------------------------------------


@pytest.mark.parametrize("procs", [1, 2])
def test_dcp_under_torchrun(tmp_path, procs):
    check_scenario(tmp_path, "dcp_loop.py", procs, True)


def test_docs_dcp_block_under_torchrun(tmp_path):
    """docs/recipes.md's DCP block, after the page's setup block, on 2 ranks."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "recipes.md").read_text(), flags=re.DOTALL)
    dcp_block = next(b for b in blocks if "dcp.save(" in b)
    script = tmp_path / "dcp_block.py"
    script.write_text(f"{blocks[0]}\n{dcp_block}\nprint(f'rank {{dist.get_rank()}} of {{dist.get_world_size()}} ok')\n")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
    ]
    done = _run([cmd], tmp_path)[0]
    _ok(done)
    assert "rank 0 of 2 ok" in done.stdout and "rank 1 of 2 ok" in done.stdout, done.stdout
