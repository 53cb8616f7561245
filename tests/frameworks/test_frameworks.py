"""Exact resume where users train: the loader put where the DataLoader goes, under the
real frameworks (CPU, gloo on 127.0.0.1), on 1 and 2 processes.

Each test runs a script of ``tests/frameworks/``: an uninterrupted reference run that
checkpoints after step 6 (the last batch of epoch 0) and step 9 (mid epoch 1), then, in
fresh processes, one resume from each checkpoint. Every step after the checkpoint —
epoch as the framework counts it, sample indices, a digest of the batch's tensors
(augmentations drawn in loader workers included) and the loss, bit for bit — must equal
the reference's, on every rank. Scenarios of one framework run one after the other in
the same processes (each into its own folder): a process costs seconds of imports and
a process group, a scenario a fraction of a second.

Scenarios that cannot be exact say so with a clear error, which is what they check.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.dist_harness import free_port
from tests.frameworks._common import SAVE_STEPS, TOTAL_STEPS

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
RUN_TIMEOUT = 300
#: How long the processes a run started may outlive its main process that exited normally.
EXIT_GRACE = 60
PORT = "{port}"  # in a command: a free port, chosen when the command starts
PORT_TAKEN = "EADDRINUSE"  # rank 0 could not listen on its port: another process took it first

pytestmark = pytest.mark.timeout(900)


def _requires(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")


def _env(port: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
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
            PORT,
            *cmd,
        ]
    return [sys.executable, *cmd]


_names = itertools.count()


class _Job:
    """One command in a session of its own, its output in files (a pipe would stay open
    while any process it started lives), the processes it started tracked."""

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        port = free_port()
        self.cmd = [str(port) if a == PORT else a for a in cmd]
        name = cwd / f"job{next(_names)}"
        self.stdout_path, self.stderr_path = name.with_suffix(".stdout"), name.with_suffix(".stderr")
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=cwd,
                env=_env(port),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started: dict[int, psutil.Process] = {}

    def survey(self) -> None:
        """Remember the processes the command started so far (torchrun's ranks have
        sessions of their own)."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.started.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def leftovers(self) -> list[psutil.Process]:
        alive = []
        for p in self.started.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill(self) -> None:
        for p in [*self.leftovers()]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()
        self.proc.wait()

    def result(self) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            self.cmd, self.proc.returncode, self.stdout_path.read_text(), self.stderr_path.read_text()
        )

    def describe(self) -> str:
        return f"{' '.join(self.cmd[-5:])}\n--- stderr (end) ---\n{self.stderr_path.read_text()[-4000:]}"


def _wait(jobs: list[_Job], timeout: float, grace: float) -> None:
    """Wait for every job; a job whose main process exited with an error has what it
    started killed at once (a rank waiting for a peer that died would wait for its process
    group's timeout, 30 minutes); one that exited normally gives them ``grace`` seconds."""
    deadline = time.monotonic() + timeout
    ended: dict[int, float] = {}
    try:
        while True:
            now = time.monotonic()
            for i, job in enumerate(jobs):
                job.survey()
                if i in ended or job.proc.poll() is None:
                    continue
                ended[i] = now
                if job.proc.returncode != 0:
                    job.kill()
            if len(ended) == len(jobs):
                late = [i for i, job in enumerate(jobs) if job.leftovers()]
                if not late:
                    return
                i = late[0]
                if now - ended[i] > grace:
                    raise AssertionError(
                        f"{jobs[i].describe()}\nexited with code {jobs[i].proc.returncode}, but processes it started "
                        f"({', '.join(p.name() for p in jobs[i].leftovers())}) were still running {grace} s later"
                    )
            elif now > deadline:
                hung = next(job for i, job in enumerate(jobs) if i not in ended)
                raise AssertionError(f"{hung.describe()}\ndid not finish within {timeout} s")
            time.sleep(0.2)
    finally:
        for job in jobs:
            if job.proc.poll() is None or job.leftovers():
                job.kill()


def _run(
    cmds: list[list[str]], cwd: Path, timeout: float = RUN_TIMEOUT, grace: float = EXIT_GRACE
) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands side by side; their results in order. A command whose rank 0
    could not listen on its port (taken between ``free_port()`` and the bind, before
    any step) runs again on another port, twice at most."""
    results: list[subprocess.CompletedProcess[str] | None] = [None] * len(cmds)
    pending = list(range(len(cmds)))
    for attempt in range(3):
        jobs = [_Job(cmds[i], cwd) for i in pending]
        _wait(jobs, timeout, grace)
        for i, job in zip(pending, jobs):
            results[i] = job.result()
        pending = [i for i, job in zip(pending, jobs) if job.proc.returncode != 0 and PORT_TAKEN in results[i].stderr]
        if not pending:
            break
    return [r for r in results if r is not None]


def _ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{' '.join(done.args[-5:])} failed:\n{done.stderr[-4000:]}"


def _steps(out: Path, run: str, rank: int) -> list[dict]:
    path = out / f"{run}.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assert_continues(got: list[dict], want: list[dict], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"{what}: step {b['step']} differs\n  resumed:       {a}\n  uninterrupted: {b}"
    assert len(got) == len(want), f"{what}: {len(got)} steps after the resume, expected {len(want)}"


def assert_resumes(out: Path, procs: int, what: str, resume_from: tuple[int, ...] = SAVE_STEPS) -> None:
    """The runs in ``out``: a whole reference on every rank, each resume its continuation."""
    for rank in range(procs):
        reference = _steps(out, "ref", rank)
        assert [s["step"] for s in reference] == list(range(1, TOTAL_STEPS + 1)), f"{what}, rank {rank}: reference run"
        for step in resume_from:
            _assert_continues(
                _steps(out, f"resume-{step}", rank), reference[step:], f"{what}, rank {rank}, resumed from step {step}"
            )
    if procs > 1:
        assert _steps(out, "ref", 0)[0]["index"] != _steps(out, "ref", 1)[0]["index"], f"{what}: ranks share data"


def check_scenarios(
    tmp_path: Path, script: str, procs: int, torchrun: bool, *args: str, scenarios: tuple[str, ...]
) -> None:
    """Reference run, then a resume from each checkpoint side by side; compare every
    scenario (``tmp_path/<scenario>``; ``""``: ``tmp_path`` itself) on every rank."""
    _ok(_run([_command(script, tmp_path, "ref", procs, torchrun, *args)], tmp_path)[0])
    runs = [f"resume-{s}" for s in SAVE_STEPS]
    for done in _run([_command(script, tmp_path, run, procs, torchrun, *args) for run in runs], tmp_path):
        _ok(done)
    for scenario in scenarios:
        assert_resumes(tmp_path / scenario, procs, scenario or script)


# -- the harness ---------------------------------------------------------------------


def test_a_run_whose_rank_0_fails_ends_at_once_with_its_output(tmp_path):
    """What hung for 300 s once: Lightning's rank 0 failed at start-up (its port taken,
    EADDRINUSE) and the rank 1 it had started waited for it for 30 minutes, holding the
    output pipes open. Now what a failed run started is killed, and its stderr shown."""
    orphan = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])"
    fail = f"{orphan}; time.sleep(0.5); sys.exit('rank 0 gave up')"
    start = time.monotonic()
    done = _run([[sys.executable, "-c", fail]], tmp_path)[0]
    assert time.monotonic() - start < 30
    assert done.returncode == 1 and "rank 0 gave up" in done.stderr
    survive = f"{orphan}; time.sleep(0.5)"
    with pytest.raises(AssertionError, match=r"exited with code 0, but processes it started \(python.*\) were still"):
        _run([[sys.executable, "-c", survive]], tmp_path, grace=1)
    with pytest.raises(AssertionError, match=r"did not finish within 1 s"):
        _run([[sys.executable, "-c", "import time; time.sleep(60)"]], tmp_path, timeout=1)


# -- Lightning -----------------------------------------------------------------------


@_requires("lightning")
@pytest.mark.parametrize("procs", [1, 2])
def test_lightning_trainer_and_fabric(tmp_path, procs):
    """The Trainer and Fabric, one scenario after the other in the same processes:

    * ``before-fit`` (2 devices): ``trainer.fit(model, loader)`` with the loader built
      before the process group exists: Lightning rebuilds it with a DistributedSampler
      and the user's arguments; rank 1 derives its DistributedSampler position from rank
      0's entry;
    * ``module``: the loader from ``train_dataloader()``; on 2 devices it is already split
      (its sampler is a DistributedSampler) and Lightning keeps it; rank 1 resumes from
      rank 0's checkpoint entry;
    * ``pipeline``: a savable pipeline (no ``len()``) with ``SavableLoaderCallback``:
      Lightning fetches a batch ahead, the state leaves it out; on 2 devices every rank's
      state is gathered into rank 0's checkpoint;
    * ``fabric``: Fabric's ``setup_dataloaders`` keeps the loader (its own order, nothing
      added); its per-process ``set_epoch`` count (0 again after a resume) does not move
      the loader's epochs;
    * ``fabric-sampler``: a DistributedSampler of the user's, saved as
      ``FabricLoaderState(loader)``: the sampler's epochs follow the loader's count;
    * ``fabric-pipeline``: a savable pipeline saved as ``FabricLoaderState(loader)``: on 2
      devices every rank's state is gathered into rank 0's checkpoint."""
    fabric = ("fabric", "fabric-sampler", "fabric-pipeline")
    scenarios = ("before-fit", "module", "pipeline", *fabric) if procs > 1 else ("module", "pipeline", *fabric)
    check_scenarios(tmp_path, "lightning_scenarios.py", procs, False, str(procs), *scenarios, scenarios=scenarios)


# -- Accelerate ----------------------------------------------------------------------


@_requires("accelerate")
@pytest.mark.parametrize("procs", [1, 2])
def test_accelerate(tmp_path, procs):
    """``register_for_checkpointing(loader)`` (the loader's own order) and
    ``register_for_checkpointing(EveryRankState(loader))`` (a savable pipeline) resume
    exactly; ``accelerator.prepare(loader)`` (run last in the reference's processes)
    rebuilds a plain DataLoader from the loader's attributes: its first batch says so, and
    what to do."""
    hows = ("register", "every-rank")
    done = _run([_command("accelerate_loop.py", tmp_path, "ref", procs, procs > 1, *hows, "prepare")], tmp_path)[0]
    assert done.returncode != 0
    assert "LoaderUsageError" in done.stderr and "register_for_checkpointing" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "prepare" / "ref.rank0.jsonl").exists()
    runs = [f"resume-{s}" for s in SAVE_STEPS]
    for resumed in _run(
        [_command("accelerate_loop.py", tmp_path, run, procs, procs > 1, *hows) for run in runs], tmp_path
    ):
        _ok(resumed)
    for how in hows:
        assert_resumes(tmp_path / how, procs, how)


# -- Hugging Face Trainer ------------------------------------------------------------


@_requires("transformers", "datasets")
@pytest.mark.parametrize("procs", [1, 2])
def test_savable_trainer(tmp_path, procs):
    """SavableTrainer resumes exactly. On one process the same processes also run a plain
    Trainer whose ``get_train_dataloader`` returns the loader: it trains, and its resume
    mid-epoch (from step 9, run last) is a clear error naming SavableTrainer, not a
    TypeError (the Trainer skips batches with ``skip_first_batches``, which rebuilds a
    plain DataLoader)."""
    torchrun = procs > 1
    plain = ("override",) if procs == 1 else ()
    _ok(_run([_command("hf_trainer.py", tmp_path, "ref", procs, torchrun, "savable", *plain)], tmp_path)[0])
    first, second = (f"resume-{s}" for s in SAVE_STEPS)
    resumed = _run(
        [
            _command("hf_trainer.py", tmp_path, first, procs, torchrun, "savable"),
            _command("hf_trainer.py", tmp_path, second, procs, torchrun, "savable", *plain),
        ],
        tmp_path,
    )
    _ok(resumed[0])
    if plain:
        assert resumed[1].returncode != 0
        assert "LoaderUsageError" in resumed[1].stderr and "SavableTrainer" in resumed[1].stderr, resumed[1].stderr[
            -3000:
        ]
        assert len(_steps(tmp_path / "override", "ref", 0)) == TOTAL_STEPS
    else:
        _ok(resumed[1])
    assert_resumes(tmp_path / "savable", procs, "SavableTrainer")


# -- torch.distributed.checkpoint ----------------------------------------------------


@pytest.mark.parametrize("procs", [1, 2])
def test_dcp_under_torchrun(tmp_path, procs):
    check_scenarios(tmp_path, "dcp_loop.py", procs, True, scenarios=("",))


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
        PORT,
        str(script),
    ]
    done = _run([cmd], tmp_path)[0]
    _ok(done)
    assert "rank 0 of 2 ok" in done.stdout and "rank 1 of 2 ok" in done.stdout, done.stdout
