"""Unit tests for savable_loader._feeder: a result that cannot be pickled in a worker
becomes an ExceptionWrapper on the same queue, not a silently dropped item."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
from typing import Any

import pytest
from torch._utils import ExceptionWrapper

from savable_loader._feeder import WorkerInit, install_feeder_hook

pytestmark = pytest.mark.timeout(60)


def _child(q: Any) -> None:
    install_feeder_hook()
    q.put("not a result", block=False)
    q.put((3, threading.Lock()))  # a DataLoader-shaped result that cannot be pickled
    q.put((4, "fine"))
    q.close()
    q.join_thread()


def test_unpicklable_result_becomes_an_exception_wrapper() -> None:
    context = multiprocessing.get_context("fork")
    q = context.Queue()
    child = context.Process(target=_child, args=(q,))
    child.start()
    first = q.get(timeout=20)
    assert first == "not a result"
    idx, wrapper = q.get(timeout=20)
    assert idx == 3 and isinstance(wrapper, ExceptionWrapper)
    assert wrapper.exc_type is TypeError and "cannot be pickled" in wrapper.where
    assert "lock" in wrapper.exc_msg
    assert q.get(timeout=20) == (4, "fine")
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    child.join(20)
    assert child.exitcode == 0


def test_worker_init_round_trips_a_lambda_and_calls_it() -> None:
    # torch pickles the worker init function for spawn/forkserver workers with the
    # standard pickler: WorkerInit carries the user's function by cloudpickle
    calls: list[int] = []
    init = pickle.loads(pickle.dumps(WorkerInit(lambda worker_id: calls.append(worker_id))))
    init(5)  # the unpickled copy appends to its own copy of `calls`
    assert WorkerInit(None).user_fn is None
    direct = WorkerInit(calls.append)
    direct(2)
    assert calls == [2]
