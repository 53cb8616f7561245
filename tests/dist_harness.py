"""Run a function on N ranks: spawned processes, gloo on 127.0.0.1, bounded in time.

Each rank calls ``fn(rank, world_size, *args)`` after ``init_process_group`` (30 s
collective timeout unless ``collective_timeout`` says otherwise) and returns a picklable result; ``run_ranks`` returns the results by
rank, or the exception text of a rank that raised (``("error", type name, message)``).
A run that does not finish within ``timeout`` seconds kills every rank and fails.
"""

from __future__ import annotations

import datetime
import multiprocessing
import pickle
import random
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _ephemeral_low() -> int:
    """The first port of the kernel's range for ports bound to 0 and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, for ranks that bind it seconds later.

    Taken below the kernel's ephemeral range when that leaves room: a port from the range
    (what binding port 0 hands out) can meanwhile become the local end of any outgoing
    connection on the machine, and rank 0 then fails with EADDRINUSE. Chosen by the
    system's random source: tests seed ``random``, and two xdist workers must not agree."""
    low = _ephemeral_low()
    if low > 11024:
        choose = random.SystemRandom()
        for _ in range(50):
            port = choose.randrange(low - 10000, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...], collective_timeout: float
) -> None:
    # A spawned child inherits "spawn" as its default start method; torchrun's ranks are
    # fresh interpreters whose default (on Linux before Python 3.14) is "fork". Match them.
    multiprocessing.set_start_method("fork", force=True)
    result: Any
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which asserts on it
        result = ("error", type(e).__name__, f"{e}\n{traceback.format_exc()}")
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120, collective_timeout: float = 30
) -> list[Any]:
    """Results of ``fn`` on every rank (``("ok", value)`` or ``("error", type, text)``)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, out, fn, args, collective_timeout), daemon=False)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
        results = []
        for r in range(world):
            f = Path(out, f"rank{r}.pkl")
            if not f.exists():
                raise AssertionError(f"rank {r} exited with code {procs[r].exitcode} and no result")
            results.append(pickle.loads(f.read_bytes()))
        return results


def values(results: list[Any]) -> list[Any]:
    """The values of a run in which every rank succeeded (else fail with the errors)."""
    errors = [r for r in results if r[0] != "ok"]
    if errors:
        raise AssertionError("ranks failed:\n" + "\n".join(e[2] for e in errors))
    return [r[1] for r in results]
