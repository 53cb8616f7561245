"""The ``demo`` command: kill a training process mid-epoch, resume it, compare the batches.

1. An uninterrupted reference run of a :class:`~savable_loader.SavableDataLoader` over
   :class:`AugmentedImages` (random crop and flip from Python ``random``, brightness from
   NumPy, noise from torch, all drawn inside the worker processes) records a digest of
   every batch.
2. A training process (``demo --_child train``) iterates the same loader, logs each
   step's digest to ``train.log`` (one fsynced JSON line a step) and saves the loader
   state to ``loader.state`` every few steps; the parent kills its whole process group
   with SIGKILL once the log shows the chosen step.
3. A second process (``demo --_child resume``) restores ``loader.state`` into a fresh
   loader and runs to the end, logging to ``resume.log``.
4. The parent compares both logs with the reference and runs a plain
   ``torch.utils.data.DataLoader`` through the same interruption.

Imported only when the demo runs (it imports torch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
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
from torch.utils.data import DataLoader

import savable_loader as sl
from savable_loader.state import IndexPosition, load_file, save_file

__all__ = ["AugmentedImages", "child_main", "run"]

DATASET_LEN = 250
BATCH_SIZE = 16
SIDE = 24
STATE_FILE = "loader.state"
TRAIN_LOG = "train.log"
RESUME_LOG = "resume.log"
_POLL_S = 0.002


class AugmentedImages:
    """A synthetic map-style dataset: ``(3 x side x side image, index)`` with random
    crop and flip (Python ``random``), brightness (NumPy) and noise (torch)."""

    def __init__(self, n: int = DATASET_LEN, side: int = SIDE) -> None:
        self.n = n
        self.side = side

    def __len__(self) -> int:
        return self.n

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "side": self.side}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        s = self.side + 4
        x = torch.arange(3 * s * s, dtype=torch.float32).reshape(3, s, s).mul_(index + 1).remainder_(97).div_(97)
        i, j = random.randint(0, 4), random.randint(0, 4)
        x = x[:, i : i + self.side, j : j + self.side]
        if random.random() < 0.5:
            x = x.flip(-1)
        x = x * float(np.random.uniform(0.8, 1.2))
        x = x + 0.05 * torch.randn(x.shape)
        return x.contiguous(), index


def digest(batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    """A short hex digest of a batch's bytes (images and indices)."""
    h = hashlib.blake2b(digest_size=8)
    for t in batch:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def make_loader(workers: int, seed: int) -> sl.SavableDataLoader:
    return sl.SavableDataLoader(
        AugmentedImages(), batch_size=BATCH_SIZE, shuffle=True, seed=seed, num_workers=workers,
        timeout=60 if workers else 0,  # torch allows a timeout only with worker processes
    )


def steps_of(loader: Any, first: int, last: int) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` for steps ``first..last`` (1-based), over as many epochs as needed."""
    step = first - 1
    while step < last:
        it = iter(loader)
        produced = False
        try:
            for batch in it:
                produced = True
                step += 1
                yield step, batch
                if step >= last:
                    return
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        if not produced:
            raise RuntimeError(f"the loader yielded nothing at step {step}")


# -- the child processes ----------------------------------------------------------------


class _Log:
    """One JSON object a line, flushed and fsynced, so a SIGKILL loses no logged step."""

    def __init__(self, path: Path) -> None:
        self.file: TextIO = open(path, "a", encoding="utf-8")

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def child_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    state_path = out / STATE_FILE
    if args._child == "train":
        log = _Log(out / TRAIN_LOG)
        t0 = time.perf_counter()
        loader = make_loader(args.workers, args.seed)
        t1 = time.perf_counter()
        save_file(state_path, loader.save_state_rank())  # the checkpoint at step 0
        log.write(event="save", step=0, epoch=0, consumed=0, initial=True)
        t0 += time.perf_counter() - t1  # the cold start-to-first-batch time leaves this save out
        for step, batch in steps_of(loader, 1, args.steps):
            if step == 1:
                log.write(event="first_batch", ms=(time.perf_counter() - t0) * 1e3)
            log.write(step=step, digest=digest(batch))
            time.sleep(args.step_ms / 1e3)  # the training step
            if step % args.save_every == 0:
                t1 = time.perf_counter()
                state = loader.save_state_rank()
                t2 = time.perf_counter()
                save_file(state_path, state)
                t3 = time.perf_counter()
                position = state.position
                log.write(event="save", step=step, epoch=position.epoch, consumed=position.consumed,
                          state_ms=(t2 - t1) * 1e3, file_ms=(t3 - t1) * 1e3)
        log.write(event="done")
        return 0
    log = _Log(out / RESUME_LOG)
    t0 = time.perf_counter()
    state = load_file(state_path)
    loader = make_loader(args.workers, args.seed)
    loader.restore_state_rank(state)  # type: ignore[arg-type]
    position = state.position  # type: ignore[union-attr]
    if not isinstance(position, IndexPosition):
        raise RuntimeError(f"{state_path}: not a drop-in loader state")
    saved = position.epoch * len(loader) + math.ceil(position.consumed / BATCH_SIZE)
    log.write(event="restored", step=saved, epoch=position.epoch, consumed=position.consumed)
    for step, batch in steps_of(loader, saved + 1, args.steps):
        if step == saved + 1:
            log.write(event="first_batch", ms=(time.perf_counter() - t0) * 1e3)
        log.write(step=step, digest=digest(batch))
    log.write(event="done")
    return 0


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


def _reap_group(proc: subprocess.Popen[bytes]) -> bool:
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
        self.live: subprocess.Popen[bytes] | None = None
        self.leftovers = False

    def reference(self) -> dict[int, str]:
        steps: dict[int, str] = {}
        self.progress.update("reference run (uninterrupted)", milestone=True)
        for step, batch in steps_of(make_loader(self.args.workers, self.args.seed), 1, self.args.steps):
            steps[step] = digest(batch)
            self.progress.update(f"reference run: step {step}/{self.args.steps}", milestone=step % 10 == 0)
        return steps

    def child(self, role: str, tail: _LogTail, kill_at: int | None) -> int | None:
        """Run a child; kill it once its log reaches ``kill_at``. The last step it logged."""
        a = self.args
        cmd = [sys.executable, "-m", "savable_loader", "demo", "--_child", role, "--workers", str(a.workers),
               "--steps", str(a.steps), "--seed", str(a.seed), "--out", str(self.out),
               "--save-every", str(a.save_every), "--step-ms", str(a.step_ms)]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        stderr_path = self.out / f"{role}.stderr"
        with open(stderr_path, "wb") as err:
            self.live = proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                                env=env, start_new_session=True)
        what = "training process" if role == "train" else "resumed process"
        self.progress.update(f"{what} started (pid {proc.pid})", milestone=True)
        deadline = time.monotonic() + a.timeout
        last = None
        try:
            while True:
                for record in tail.poll():
                    if "step" in record and "digest" in record:
                        last = record["step"]
                        suffix = f" (kill at {kill_at})" if kill_at else ""
                        self.progress.update(f"{what}: step {last}/{a.steps}{suffix}", milestone=last % 10 == 0)
                if kill_at is not None and last is not None and last >= kill_at:
                    self.cleanup()  # SIGKILL to the process group, then reap it
                    tail.poll()
                    last = max(tail.steps())
                    self.progress.update(f"{what} killed with SIGKILL after step {last}", milestone=True)
                    return last
                code = proc.poll()
                if code is not None:
                    tail.poll()
                    if code != 0 or kill_at is not None:
                        text = stderr_path.read_text(errors="replace").strip()[-2000:]
                        why = f"exited with code {code}" if code else f"finished before step {kill_at} was seen"
                        raise DemoError(f"the {what} {why}" + (f":\n{text}" if text else ""))
                    return max(tail.steps(), default=None)
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


def _plain_stream(dataset: Any, workers: int, seed: int, epoch: int, first: int, last: int) -> Iterator[tuple[int, str, set[int]]]:
    """A plain torch DataLoader from the start of ``epoch``, numbered from step ``first``:
    ``(step, digest, sample indices)``. Each epoch is seeded from ``(seed, epoch)``, as a
    careful training script does (``DistributedSampler.set_epoch`` style)."""
    step = first - 1
    while True:
        s = (seed * 1_000_003 + epoch) % 2**63
        if workers == 0:  # samples load in this process: seed its global RNGs
            random.seed(s)
            np.random.seed(s % 2**32)
            torch.manual_seed(s)
        loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=workers,
                            generator=torch.Generator().manual_seed(s), timeout=60 if workers else 0)
        for batch in loader:
            step += 1
            yield step, digest(batch), set(batch[1].tolist())
            if step >= last:
                return
        epoch += 1


def _plain_comparison(args: argparse.Namespace, saved: int, per_epoch: int) -> str:
    dataset = AugmentedImages()
    reference = {s: (d, idx) for s, d, idx in _plain_stream(dataset, args.workers, args.seed, 0, 1, args.steps)}
    epoch = saved // per_epoch
    epoch_start = epoch * per_epoch
    seen = set().union(*(reference[s][1] for s in range(epoch_start + 1, saved + 1)))
    after = list(_plain_stream(dataset, args.workers, args.seed, epoch, saved + 1, args.steps))
    # The first per_epoch batches after the restart are epoch `epoch` again.
    repeated = sum(1 for k, (_, _, idx) in enumerate(after) if k < per_epoch and idx & seen)
    differ = sum(1 for s, d, _ in after if d != reference[s][0])
    return (f"restarting epoch {epoch}, {repeated} of {len(after)} batches after the restart repeat samples "
            f"already trained on ({len(seen)} samples twice) and {differ}/{len(after)} differ from its "
            "uninterrupted run")


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"p50 {statistics.median(values):.3f} ms, max {max(values):.3f} ms"


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


def run(args: argparse.Namespace) -> int:
    """The demo's parent process; see the module docstring. Exit code 0 if identical."""
    steps = args.steps  # >= 2, and kill_at < steps: checked by __main__
    kill_at = args.kill_at
    if kill_at is None:  # the middle third of the run
        lo, hi = max(1, math.ceil(steps / 3)), min(steps - 1, max(1, 2 * steps // 3))
        kill_at = random.Random(args.seed).randint(lo, max(lo, hi))
    started = time.perf_counter()
    with _sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="savable_loader_demo_") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for name in (STATE_FILE, TRAIN_LOG, RESUME_LOG, "train.stderr", "resume.stderr"):
            (out / name).unlink(missing_ok=True)
        progress = _Progress(sys.stderr)
        demo = _Demo(args, out, progress)
        try:
            reference = demo.reference()
            train, resume = _LogTail(out / TRAIN_LOG), _LogTail(out / RESUME_LOG)
            killed = demo.child("train", train, kill_at)
            demo.child("resume", resume, None)
            progress.update("plain torch DataLoader runs", milestone=True)
            per_epoch = len(make_loader(0, args.seed))
            restored = resume.events("restored")
            if not restored:
                raise DemoError("the resumed process logged no restored position")
            saved = restored[0]["step"]
            plain = _plain_comparison(args, saved, per_epoch)
        except DemoError as e:
            progress.close()
            print(f"demo failed: {e}", file=sys.stderr)
            return 1
        finally:
            demo.cleanup()
            progress.close()

        before, after = train.steps(), resume.steps()
        expected_after = list(range(saved + 1, steps + 1))
        wrong = sorted(s for s, d in {**before, **after}.items() if reference.get(s) != d)
        missing = sorted(set(expected_after) - set(after))
        identical = not wrong and not missing and bool(resume.events("done"))
        saves = [e for e in train.events("save") if not e.get("initial")]
        last_logged, r = train.events("save")[-1], restored[0]
        cold, warm = train.events("first_batch"), resume.events("first_batch")
        rows = [
            ("killed", f"SIGKILL to the training process group after step {killed} (--kill-at {kill_at})"),
            ("last save", f"step {last_logged['step']}: epoch {last_logged['epoch']}, "
                          f"{last_logged['consumed']} samples consumed"),
            ("save latency", f"save_state_rank {_ms([e['state_ms'] for e in saves])}; with atomic save_file "
                             f"{_ms([e['file_ms'] for e in saves])} ({len(saves)} save{'s' if len(saves) != 1 else ''})"
                             if saves else "n/a (killed before the first save after step 0)"),
            ("restored", f"epoch {r['epoch']}, {r['consumed']} samples consumed -> continues at step {saved + 1}"
                         + ("" if last_logged["step"] == saved else " (saved after the last logged save)")),
            ("restore-to-first-batch", f"{warm[0]['ms']:.1f} ms" + (f" (cold start-to-first-batch {cold[0]['ms']:.1f} ms)"
                                       if cold else "") if warm else "n/a"),
        ]
        if killed is not None and killed > saved:
            redone = f"{saved + 1}-{killed}" if killed > saved + 1 else f"{killed}"
            rows.append(("re-done steps", f"{redone} (trained after the last save, before the kill; expected: "
                                          f"the model checkpoint is from step {saved} too)"))
        rows += [
            ("before the kill", f"{len(before) - len(set(wrong) & set(before))}/{len(before)} batches equal to "
                                "the uninterrupted run"),
            ("after the restart", f"{len(after) - len(set(wrong) & set(after))}/{len(expected_after)} batches equal "
                                  f"to the uninterrupted run (steps {saved + 1}-{steps})"),
        ]
        if wrong or missing:
            problems = ([f"steps {wrong[:10]} differ"] if wrong else []) + ([f"steps {missing[:10]} missing"] if missing else [])
            rows.append(("differences", ", ".join(problems) or "the resumed process did not finish"))
        lines = [
            f"savable_loader demo: {steps} steps of {BATCH_SIZE} samples ({DATASET_LEN}-sample dataset, "
            f"{per_epoch} batches an epoch), {args.workers} worker{'s' if args.workers != 1 else ''}, seed {args.seed}; "
            f"augmentation in the {'workers' if args.workers else 'main process'}: crop+flip (random), "
            "brightness (numpy), noise (torch)",
            *(f"  {label + ':':<24}{value}" for label, value in rows),
            f"identical: {'yes' if identical else 'no'}",
            f"plain torch DataLoader: {plain}",
            "  (it has no position to save: a restart can only go back to the start of the epoch, or load and "
            "drop the batches already trained on)",
        ]
        if args.out:
            lines.append(f"files: {out / STATE_FILE}, {out / TRAIN_LOG}, {out / RESUME_LOG}")
        if demo.leftovers:
            lines.append("warning: some processes of a child's process group did not exit")
        lines.append(f"runtime: {time.perf_counter() - getattr(args, '_started', started):.1f} s")
        print("\n".join(lines), flush=True)
    return 0 if identical else 1
