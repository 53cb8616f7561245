"""Worker processes end when the main process is gone, whatever they are doing.

torch's worker loop checks its parent between two indices (every 5 s at most), then
returns; the process then waits, at exit, for its queue's feeder thread to write the
items it still holds, and a large item blocked in a full pipe is never written: the
worker lives on. Under ``forkserver`` a worker's parent is the fork server, which
outlives the main process, so torch's check never fires at all. Either way a worker
stays after ``kill -9`` of the trainer, holding memory and files.

:func:`start_parent_watch` (run by the loader's worker init) starts a daemon thread that
looks at the main process every :data:`POLL_S` seconds and ends the worker at once
(``os._exit``) when it is gone: no finaliser, no queue flush (nobody is left to read).
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["POLL_S", "process_alive", "start_parent_watch"]

#: Seconds between two looks at the main process.
POLL_S = 0.5
#: The exit status of a worker whose main process is gone.
EXIT_STATUS = 1


def _linux_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` of ``pid`` from ``/proc`` (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[0], fields[19]


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether ``pid`` is a running process (not a zombie). Where ``/proc`` exists and
    ``started`` is given, a process with another start time (the pid reused) does not
    count. Example::

        process_alive(os.getpid())   # True
    """
    if os.path.isdir("/proc/self"):
        stat = _linux_stat(pid)
        if stat is None or stat[0] in ("Z", "X", "x"):
            return False
        return started is None or stat[1] == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - another user's process: it exists
        return True
    return True


def start_parent_watch(main_pid: int) -> threading.Thread | None:
    """In a worker process: end this process (``os._exit``) within about
    :data:`POLL_S` seconds once ``main_pid`` is gone or this process's parent changed
    (it was re-parented: its parent died). Returns the daemon thread, or None where
    ``main_pid`` is this process (nothing to watch)."""
    if main_pid == os.getpid():
        return None
    parent = os.getppid()
    stat = _linux_stat(main_pid) if os.path.isdir("/proc/self") else None
    started = stat[1] if stat is not None else None

    def watch() -> None:
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent or not process_alive(main_pid, started):
                os._exit(EXIT_STATUS)  # nothing to flush: no one is left to read it

    thread = threading.Thread(target=watch, name="savable_loader-parent-watch", daemon=True)
    thread.start()
    return thread
