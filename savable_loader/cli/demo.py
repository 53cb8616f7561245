"""The ``demo`` command: kill a training run mid-epoch, resume it, compare with an uninterrupted run.

1. A reference run (``demo --_child reference``, see :mod:`savable_loader.cli.demo_train`)
   trains a tiny convnet on :class:`~savable_loader.cli.demo_train.AugmentedImages` (random
   crop and flip from Python ``random``, brightness from NumPy, noise from torch, drawn
   inside the loader's worker processes) on ``--ranks`` ranks, logging every step's batch
   digest and loss.
2. A training run (``--_child train``) does the same and checkpoints model and loader
   state every few steps; once its log shows the chosen step, the parent kills its whole
   process group (ranks and loader workers) with SIGKILL.
3. A resumed run (``--_child resume``) restores model and loader from the last complete
   checkpoint and trains to the end.
4. The parent compares every rank's batches and losses with the reference, runs a plain
   ``torch.utils.data.DataLoader`` through the same interruption, and prints the report.

Imported only when the demo runs (it imports torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from savable_loader.cli.demo_train import (
    BATCH_SIZE,
    CKPT_DIR,
    DATASET_LEN,
    LATEST,
    SIDE,
    STATE_FILE,
    AugmentedImages,
    batches_per_epoch,
    child_main,
    digest,
    log_path,
)

__all__ = ["DemoError", "child_main", "run"]

_POLL_S = 0.002


# -- the parent -------------------------------------------------------------------------


class _Progress:
    """One ``\\r``-updated status line on a terminal; plain lines at milestones otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.width = 0

    def update(self, text: str, milestone: bool = False) -> None:
        line = f"[{time.perf_counter() - self.t0:5.1f} s] {text}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        elif milestone:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
        self.width = 0


class _LogTail:
    """Reads the complete lines appended to a log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        new = [json.loads(line) for line in lines if line.strip()]
        self.records.extend(new)
        return new

    def steps(self) -> dict[int, str]:
        return {r["step"]: r["digest"] for r in self.records if "digest" in r}

    def records_by_step(self) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in self.records if "digest" in r}

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == name]


class DemoError(Exception):
    """The demo could not run to its comparison."""


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _ForkedRun:
    """A training run in a forked copy of this process, in a new session (process group).

    Forking skips a second import of torch: the parent has imported it but has run no
    torch code yet. The resumed run is started as a fresh interpreter instead, so that it
    can only know what the checkpoint files hold.
    """

    def __init__(self, args: argparse.Namespace, role: str, stderr_path: Path) -> None:
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.setsid()
                os.dup2(err, 1)
                os.dup2(err, 2)
                child_args = argparse.Namespace(**vars(args))
                child_args._child = role
                code = child_main(child_args)
            except BaseException:  # noqa: BLE001 - a child role reports any failure, then exits
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(err)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


def _reap_group(proc: subprocess.Popen[bytes] | _ForkedRun) -> bool:
    """SIGKILL the child's process group and wait for it; False if something survives."""
    _killpg(proc.pid)
    deadline = time.monotonic() + 10
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    while _group_alive(proc.pid):
        if time.monotonic() > deadline:
            return False
        _killpg(proc.pid)
        time.sleep(0.02)
    return True


class _Demo:
    def __init__(self, args: argparse.Namespace, out: Path, progress: _Progress) -> None:
        self.args = args
        self.out = out
        self.progress = progress
        self.live: subprocess.Popen[bytes] | _ForkedRun | None = None
        self.leftovers = False

    def tails(self, role: str) -> list[_LogTail]:
        return [_LogTail(log_path(self.out, role, r)) for r in range(self.args.ranks)]

    def run_child(self, role: str, tails: list[_LogTail], kill_at: int | None = None) -> int | None:
        """Run one training run; kill it once rank 0 has logged ``kill_at``. The last step logged."""
        a = self.args
        stderr_path = self.out / f"{role}.stderr"
        proc: subprocess.Popen[bytes] | _ForkedRun
        if role == "resume":  # a fresh interpreter: it knows only what the files hold
            cmd = [
                sys.executable,
                "-m",
                "savable_loader",
                "demo",
                "--_child",
                role,
                "--workers",
                str(a.workers),
                "--steps",
                str(a.steps),
                "--seed",
                str(a.seed),
                "--out",
                str(self.out),
                "--ranks",
                str(a.ranks),
                "--save-every",
                str(a.save_every),
                "--step-ms",
                str(a.step_ms),
                "--timeout",
                str(a.timeout),
            ]
            env = dict(os.environ)
            root = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            with open(stderr_path, "wb") as err:
                self.live = proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, start_new_session=True
                )
            how = "new interpreter"
        else:
            self.live = proc = _ForkedRun(argparse.Namespace(**{**vars(a), "out": str(self.out)}), role, stderr_path)
            how = "forked"
        what = {"reference": "reference run (uninterrupted)", "train": "training run", "resume": "resumed run"}[role]
        self.progress.update(
            f"{what} started ({how}, pid {proc.pid}, {a.ranks} rank{'s' if a.ranks > 1 else ''})", milestone=True
        )
        deadline = time.monotonic() + a.timeout
        last = None
        try:
            while True:
                for record in tails[0].poll():
                    if "digest" in record:
                        last = record["step"]
                        suffix = f" (kill at {kill_at})" if kill_at else ""
                        self.progress.update(f"{what}: step {last}/{a.steps}{suffix}", milestone=last % 20 == 0)
                if kill_at is not None and last is not None and last >= kill_at:
                    self.cleanup()  # SIGKILL to the process group, then reap it
                    for tail in tails:
                        tail.poll()
                    last = max(tails[0].steps())
                    self.progress.update(f"{what} killed with SIGKILL after step {last}", milestone=True)
                    return last
                code = proc.poll()
                if code is not None:
                    for tail in tails:
                        tail.poll()
                    if code != 0 or kill_at is not None:
                        text = stderr_path.read_text(errors="replace").strip()[-3000:]
                        why = f"exited with code {code}" if code else f"finished before step {kill_at} was seen"
                        raise DemoError(f"the {what} {why}" + (f":\n{text}" if text else ""))
                    return max(tails[0].steps(), default=None)
                if time.monotonic() > deadline:
                    raise DemoError(f"the {what} did not finish within --timeout {a.timeout:g} s")
                time.sleep(_POLL_S)
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        if self.live is not None:
            proc, self.live = self.live, None
            if not _reap_group(proc):
                self.leftovers = True


# -- the plain torch DataLoader ---------------------------------------------------------


def _plain_stream(
    dataset: Any, args: argparse.Namespace, rank: int, epoch: int, first: int, last: int
) -> Iterator[tuple[int, str, set[int]]]:
    """A plain torch DataLoader from the start of ``epoch``, numbered from step ``first``:
    ``(step, digest, sample indices)``. A careful script: ``DistributedSampler`` with
    ``set_epoch``, worker seeds from a generator seeded with ``(seed, epoch)``."""
    step = first - 1
    while True:
        s = (args.seed * 1_000_003 + epoch) % 2**63
        if args.workers == 0:  # samples load in this process: seed its global RNGs
            random.seed(s)
            np.random.seed(s % 2**32)
            torch.manual_seed(s)
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=args.ranks, rank=rank, shuffle=True, seed=args.seed
        )
        sampler.set_epoch(epoch)
        loader = DataLoader(
            dataset,
            batch_size=BATCH_SIZE,
            sampler=sampler,
            num_workers=args.workers,
            generator=torch.Generator().manual_seed(s),
            timeout=60 if args.workers else 0,
        )
        for batch in loader:
            step += 1
            yield step, digest(batch[:2]), set(batch[2].tolist())
            if step >= last:
                return
        epoch += 1


def _plain_comparison(args: argparse.Namespace, saved: int, per_epoch: int) -> str:
    dataset = _Indexed(AugmentedImages())
    epoch = saved // per_epoch
    repeated = differ = total = twice = 0
    for rank in range(args.ranks):
        reference = {s: (d, idx) for s, d, idx in _plain_stream(dataset, args, rank, 0, 1, args.steps)}
        seen = set().union(*(reference[s][1] for s in range(epoch * per_epoch + 1, saved + 1)))
        after = list(_plain_stream(dataset, args, rank, epoch, saved + 1, args.steps))
        # The first per_epoch batches after the restart are epoch `epoch` again.
        repeated += sum(1 for k, (_, _, idx) in enumerate(after) if k < per_epoch and idx & seen)
        differ += sum(1 for s, d, _ in after if d != reference[s][0])
        total += len(after)
        twice += len(seen)
    ranks = f" over {args.ranks} ranks" if args.ranks > 1 else ""
    return (
        f"restarts epoch {epoch}: {repeated} of {total} batches after the restart{ranks} repeat samples "
        f"already trained on ({twice} samples twice), {differ}/{total} differ from its uninterrupted run"
    )


class _Indexed(torch.utils.data.Dataset):
    """The demo dataset with each sample's index appended (to count repeated samples)."""

    def __init__(self, inner: AugmentedImages) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return (*self.inner[index], index)


# -- the report -------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"p50 {statistics.median(values):.2f} ms, max {max(values):.2f} ms"


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit, so that the cleanup kills the child process groups."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _default_kill_at(steps: int, seed: int) -> int:
    """A random step in the middle third of the run, drawn from ``seed``."""
    lo, hi = max(1, math.ceil(steps / 3)), min(steps - 1, max(1, 2 * steps // 3))
    return random.Random(seed).randint(lo, max(lo, hi))


def _compare(
    reference: list[_LogTail], runs: list[list[_LogTail]], steps: range, only_logged: bool = False
) -> tuple[int, int, list[str]]:
    """(equal batches, equal losses, problems) over ``steps`` of every rank, taken from
    the last run that logged each step. ``only_logged``: a step a run did not log is no
    problem (a killed run: its ranks die at slightly different steps)."""
    batches = losses = 0
    problems: list[str] = []
    for rank, ref in enumerate(reference):
        ref_records = ref.records_by_step()
        logged: dict[int, dict[str, Any]] = {}
        for run in runs:
            logged.update(run[rank].records_by_step())
        for step in steps:
            got, want = logged.get(step), ref_records.get(step)
            if got is None and only_logged:
                continue
            if got is None or want is None:
                problems.append(f"rank {rank} step {step} missing")
                continue
            batches += got["digest"] == want["digest"]
            losses += got["loss"] == want["loss"]
            if got["digest"] != want["digest"]:
                problems.append(f"rank {rank} step {step}: batch differs")
            elif got["loss"] != want["loss"]:
                problems.append(f"rank {rank} step {step}: loss differs")
    return batches, losses, problems


def _curve(reference: _LogTail, resumed: _LogTail, saved: int, steps: int) -> str:
    """A few losses after the restart, resumed run against the uninterrupted one."""
    want, got = reference.records_by_step(), resumed.records_by_step()
    picks = sorted({saved + 1, *(saved + 1 + k * (steps - saved - 1) // 3 for k in (1, 2)), steps})

    def loss(records: dict[int, dict[str, Any]], step: int) -> str:
        return f"{float.fromhex(records[step]['loss']):.6f}" if step in records else "-"

    return (
        "steps "
        + "/".join(map(str, picks))
        + ": resumed "
        + " ".join(loss(got, p) for p in picks)
        + ", uninterrupted "
        + " ".join(loss(want, p) for p in picks)
    )


def run(args: argparse.Namespace) -> int:
    """The demo's parent process; see the module docstring. Exit code 0 if identical."""
    steps = args.steps  # >= 2, and kill_at < steps: checked by __main__
    kill_at = args.kill_at if args.kill_at is not None else _default_kill_at(steps, args.seed)
    started = time.perf_counter()
    with _sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="savable_loader_demo_") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for old in list(out.glob("*.rank*.log")) + list(out.glob("*.stderr")):
            old.unlink()
        if (out / CKPT_DIR).is_dir():
            shutil.rmtree(out / CKPT_DIR)
        progress = _Progress(sys.stderr)
        demo = _Demo(args, out, progress)
        ref, train, resume = demo.tails("reference"), demo.tails("train"), demo.tails("resume")
        try:
            demo.run_child("reference", ref)
            killed = demo.run_child("train", train, kill_at)
            demo.run_child("resume", resume)
            restored = [t.events("restored") for t in resume]
            if not all(restored):
                raise DemoError("the resumed run logged no restored position")
            saved = restored[0][0]["step"]
            progress.update("plain torch DataLoader, same interruption", milestone=True)
            per_epoch = batches_per_epoch(args.ranks)
            plain = _plain_comparison(args, saved, per_epoch)
        except DemoError as e:
            progress.close()
            print(f"demo failed: {e}", file=sys.stderr)
            return 1
        finally:
            demo.cleanup()
            progress.close()

        _before_ok, _, before_problems = _compare(ref, [train], range(1, steps + 1), only_logged=True)
        after_batches, after_losses, after_problems = _compare(ref, [resume], range(saved + 1, steps + 1))
        done = all(t.events("done") for t in resume)
        identical = not before_problems and not after_problems and done
        n_after = (steps - saved) * args.ranks
        saves = [e for e in train[0].events("save") if not e.get("initial")]
        last_save = train[0].events("save")[-1]
        r = restored[0][0]
        cold, warm = train[0].events("first_batch"), resume[0].events("first_batch")
        ranks_txt = f"{args.ranks} ranks (gloo on 127.0.0.1)" if args.ranks > 1 else "1 rank"
        per_rank = " per rank" if args.ranks > 1 else ""
        rows = [
            ("killed", f"SIGKILL to the training run's process group after step {killed} (--kill-at {kill_at})"),
            (
                "last checkpoint",
                (
                    f"step {last_save['step']}: model + loader states of {ranks_txt.split(' (')[0]}; "
                    f"rank 0 at epoch {last_save['epoch']}, {last_save['consumed']} samples consumed"
                ),
            ),
            (
                "save latency",
                (
                    f"save_state_global {_ms([e['state_ms'] for e in saves])}; whole checkpoint "
                    f"(model.pt, loader.state, latest) {_ms([e['ckpt_ms'] for e in saves])} "
                    f"({len(saves)} save{'s' if len(saves) != 1 else ''})"
                )
                if saves
                else "n/a (killed before the first save after step 0)",
            ),
            (
                "restored",
                (
                    f"{r['checkpoint']}: rank 0 at epoch {r['epoch']}, {r['consumed']} samples consumed "
                    f"-> continues at step {saved + 1}"
                ),
            ),
            (
                "restore time",
                f"loader state (load_file + restore_state_global) {r['loader_ms']:.1f} ms, model "
                f"{r['model_ms']:.1f} ms; restore-to-first-batch {warm[0]['ms']:.0f} ms"
                + (f" (cold start-to-first-batch {cold[0]['ms']:.0f} ms)" if cold else "")
                if warm
                else "n/a",
            ),
        ]
        if killed is not None and killed > saved:
            redone = f"{saved + 1}-{killed}" if killed > saved + 1 else f"{killed}"
            rows.append(
                (
                    "re-done steps",
                    (
                        f"{redone} (trained after the last checkpoint, before the kill: "
                        "they are lost with the model too, and trained again)"
                    ),
                )
            )
        rows += [
            (
                "batches after restart",
                (f"{after_batches}/{n_after} equal to the uninterrupted run (steps {saved + 1}-{steps}{per_rank})"),
            ),
            ("loss after restart", f"{after_losses}/{n_after} equal to the uninterrupted run, bit for bit"),
            ("loss curve (rank 0)", _curve(ref[0], resume[0], saved, steps)),
        ]
        problems = before_problems + after_problems + ([] if done else ["the resumed run did not finish"])
        if problems:
            rows.append(("differences", "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")))
        lines = [
            (
                f"savable_loader demo: {steps} steps on {ranks_txt}, {args.workers} loader "
                f"worker{'s' if args.workers != 1 else ''}{per_rank}, seed {args.seed}"
            ),
            (
                f"  a tiny convnet on {DATASET_LEN} synthetic 3x{SIDE}x{SIDE} images, batches of {BATCH_SIZE} "
                f"({per_epoch} an epoch{per_rank}); augmentation in the "
                f"{'workers' if args.workers else 'main process'}: crop+flip (random), brightness (numpy), noise (torch)"
            ),
            *(f"  {label + ':':<24}{value}" for label, value in rows),
            f"identical: {'yes' if identical else 'no'}",
            f"plain torch DataLoader: {plain}",
            (
                "  (it has no position to save: a restart can only go back to the start of the epoch, or load and "
                "drop the batches already trained on)"
            ),
        ]
        if args.out:
            latest = out / CKPT_DIR / (out / CKPT_DIR / LATEST).read_text().strip()
            lines.append(
                f"files: {latest / STATE_FILE} (try: python -m savable_loader inspect FILE), "
                f"logs {out}/{{reference,train,resume}}.rank*.log"
            )
        if demo.leftovers:
            lines.append("warning: some processes of a child's process group did not exit")
        lines.append(f"runtime: {time.perf_counter() - getattr(args, '_started', started):.1f} s")
        print("\n".join(lines), flush=True)
    return 0 if identical else 1
