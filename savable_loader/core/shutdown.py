"""The loader's shutdown signal, as a worker process sees it.

The loader makes a ``multiprocessing`` Event for each torch iterator of worker processes
and sets it when that iterator stops its workers; its worker init function
(``loader.feeder.WorkerInit``) hands it to each worker with :func:`keep_done_event`. A
source waiting inside one item (a stream waiting for its producers) waits on it, and
ends at once instead of being killed after torch's 5 s join timeout per worker.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["keep_done_event", "worker_done_event"]

#: (pid, the Event) in a loader's worker process, set by :func:`keep_done_event`.
_done: list[tuple[int, Any]] = []


def keep_done_event(done: Any) -> None:
    """In a worker process: keep the loader's shutdown Event (None: there is none)."""
    _done[:] = [(os.getpid(), done)] if done is not None else []


def worker_done_event() -> Any:
    """In a worker process of a :class:`~savable_loader.SavableDataLoader`: the Event
    the loader sets when it shuts this worker's iterator down (the end of an epoch
    without persistent workers, an error, a restore, the iterator collected); None
    elsewhere (the main process, a plain torch DataLoader's worker). Any thread of the
    worker may wait on it.

    Example::

        done = worker_done_event()
        if done is not None and done.wait(0.5):
            return   # the loader is shutting its workers down
    """
    if _done and _done[0][0] == os.getpid():
        return _done[0][1]
    return None
