"""The private parts of torch's DataLoader that savable_loader relies on, in one place.

torch offers no public way to do what is done here. Every access goes through this
module and fails loudly (``AttributeError`` naming the torch version) if a torch release
moves something, rather than degrading silently; ``tests/test_torch_internals.py``
checks each of them against the installed torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch.utils.data._utils import worker as _torch_worker

__all__ = ["replace_worker_info", "torch_worker_id"]

#: (pid, id torch gave the worker process), recorded before the first replacement.
_original: list[tuple[int, int]] = []


def _missing(what: str) -> AttributeError:
    return AttributeError(f"savable_loader needs {what}, which torch {torch.__version__} does not have")


def replace_worker_info(**changes: Any) -> None:
    """In a DataLoader worker, make ``get_worker_info()`` return its info with ``changes``
    (e.g. ``dataset=`` the user's dataset, ``id=`` a logical worker id).

    Example::

        replace_worker_info(dataset=user_dataset)   # get_worker_info().dataset is now it
    """
    if not hasattr(_torch_worker, "_worker_info"):
        raise _missing("torch.utils.data._utils.worker._worker_info")
    info = _torch_worker._worker_info
    if info is None:
        raise RuntimeError("replace_worker_info called outside a DataLoader worker")
    if not _original or _original[0][0] != os.getpid():
        _original[:] = [(os.getpid(), info.id)]
    _torch_worker._worker_info = dataclasses.replace(info, **changes)


def torch_worker_id() -> int | None:
    """The id torch gave this worker process (its place in torch's round robin), also
    after :func:`replace_worker_info` changed what ``get_worker_info().id`` says; None
    outside a DataLoader worker.

    Example::

        replace_worker_info(id=3)
        torch_worker_id()          # still the id torch started the worker with
    """
    info = _torch_worker._worker_info
    if info is None:
        return None
    if _original and _original[0][0] == os.getpid():
        return _original[0][1]
    return info.id
