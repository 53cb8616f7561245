"""How a training process ends: cleanly with a loader iterator still alive, and without
leaving its workers behind when it is killed.

* A program keeps its iterator in a module global (as nanochat keeps its loader) and
  exits after a few batches: exit status 0, no ``INTERNAL ASSERT`` from torch, whatever
  the pipeline (``PackingDataset``, ``ShuffleBufferDataset``, ``MicroBatchDataset``) and
  with 0 or 2 workers, persistent or not. The batches it printed are the loader's.
  (``loader/iterator.py``: live iterations are closed at exit.)
* A trainer with 2 workers whose items are large (each blocks its worker's queue) is
  killed with ``SIGKILL``: every worker process is gone within ``GRACE`` seconds, under
  ``fork`` (torch's own check notices its parent after up to 5 s) and ``forkserver``
  (a worker's parent is the fork server, which outlives the trainer: torch's workers
  stay for good). (``loader/parent_watch.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.timeout(240)

REPO = str(Path(__file__).resolve().parents[2])
GRACE = 10.0  # seconds the workers of a killed trainer may take to go

DEFINITIONS = '''
import sys, time
import numpy as np
import torch
import savable_loader as sl
from savable_loader.wrappers import BatchDataset, MicroBatchDataset, PackingDataset, ShuffleBufferDataset


class Docs(sl.SavableDataset):
    """Documents of 1 to 7 tokens (the issue's reproduction)."""

    _savable_fields = ("pos",)

    def __init__(self, n, wc):
        super().__init__(wc)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self):
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        while self.pos < self.n:
            i = self.pos
            self.pos += self.worker_config.workers_per_rank
            yield torch.arange(i % 7 + 1)

    def config(self):
        return {"n": self.n}


def pipeline(kind, wc):
    docs = Docs(400, wc)
    if kind == "greedy":
        return PackingDataset(docs, 8, strategy="greedy")
    if kind == "best_fit":
        return PackingDataset(docs, 8, strategy="best_fit", buffer_size=8)
    if kind == "shuffle":
        return ShuffleBufferDataset(docs, 16)
    return MicroBatchDataset(BatchDataset(PackingDataset(docs, 8), 4), 2)


KINDS = ("greedy", "best_fit", "shuffle", "micro")
'''

# The iterators stay in module globals until the interpreter ends.
PROGRAM = (
    """
# torch imports dill where it is installed, which happens to order the interpreter's last
# garbage collection so that the abort hides; a plain venv (torch, numpy, msgspec,
# cloudpickle, fsspec) has no dill.
import sys
sys.modules["dill"] = None
"""
    + DEFINITIONS
    + """
kinds = KINDS if sys.argv[1] == "all" else (sys.argv[1],)
workers, persistent = int(sys.argv[2]), sys.argv[3] == "1"
loaders, iterators = [], []
for kind in kinds:
    wc = sl.WorkerConfig(num_workers=workers, seed=0)
    loaders.append(sl.SavableDataLoader(pipeline(kind, wc), batch_size=None, worker_config=wc, persistent_workers=persistent))
    iterators.append(iter(loaders[-1]))
for kind, it in zip(kinds, iterators):
    for _ in range(3):
        print(kind, next(it).tolist(), flush=True)


def stream(loader):  # an endless stream of epochs, as a training script writes it
    while True:
        yield from loader


batches = stream(sl.SavableDataLoader(pipeline(kinds[0], wc), batch_size=None, worker_config=wc))
next(batches)
"""
)

TRAINER = '''
import sys, time
import numpy as np
import savable_loader as sl


class Big(sl.SavableDataset):
    """Endless items of 16 MB, pickled through the worker's queue: a worker blocks on it."""

    _savable_fields = ("pos",)

    def __init__(self, wc):
        super().__init__(wc)
        self.reset_state_own()

    def reset_state_own(self):
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        while True:
            i = self.pos
            self.pos += self.worker_config.workers_per_rank
            yield np.full(2_000_000, i, dtype=np.int64)

    def config(self):
        return {}


if __name__ == "__main__":
    wc = sl.WorkerConfig(num_workers=2, seed=0)
    loader = sl.SavableDataLoader(
        Big(wc), batch_size=None, worker_config=wc, persistent_workers=sys.argv[2] == "1",
        multiprocessing_context=sys.argv[1],
    )
    it = iter(loader)
    first, second = next(it), next(it)
    print(int(first[0]), int(second[-1]), " ".join(str(p.pid) for p in it._workers), flush=True)
    time.sleep(600)
'''


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _reference(kinds: tuple[str, ...], workers: int) -> list[str]:
    ns: dict[str, Any] = {}
    exec(DEFINITIONS, ns)  # the program's own definitions
    sl = ns["sl"]
    lines = []
    for kind in kinds:
        wc = sl.WorkerConfig(num_workers=workers, seed=0)
        loader = sl.SavableDataLoader(ns["pipeline"](kind, wc), batch_size=None, worker_config=wc)
        it = iter(loader)
        lines += [f"{kind} {next(it).tolist()}" for _ in range(3)]
        it.close()
    return lines


@pytest.mark.parametrize(
    ("kind", "workers", "persistent"),
    [
        ("greedy", 0, False),
        ("best_fit", 0, False),
        ("shuffle", 0, False),
        ("micro", 0, False),
        ("all", 2, False),
        ("all", 2, True),
    ],
)
def test_exit_with_live_iterators(tmp_path: Path, kind: str, workers: int, persistent: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    run = subprocess.run(
        [sys.executable, str(script), kind, str(workers), "1" if persistent else "0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=180,
        check=False,
    )
    assert "INTERNAL ASSERT" not in run.stderr, run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    # nor a generator's finally run as the modules are torn down ("Exception ignored in")
    assert "Exception ignored" not in run.stderr, run.stderr[-3000:]
    kinds = ("greedy", "best_fit", "shuffle", "micro") if kind == "all" else (kind,)
    assert run.stdout.splitlines() == _reference(kinds, workers)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(("method", "persistent"), [("fork", True), ("forkserver", False)])
def test_workers_go_when_the_trainer_is_killed(tmp_path: Path, method: str, persistent: bool) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), method, "1" if persistent else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    pids: list[int] = []
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline().split()
        assert line[:2] == ["0", "1"], (line, trainer.stderr.read() if trainer.poll() is not None else "")
        pids = [int(p) for p in line[2:]]
        assert len(pids) == 2 and all(_running(p) for p in pids)
        time.sleep(1.0)  # the workers fill their queues with the next items
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + GRACE
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if _running(p)]
        assert not left, f"workers {left} still running {GRACE} s after the trainer was killed"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in pids:  # never leave them to the other tests
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
