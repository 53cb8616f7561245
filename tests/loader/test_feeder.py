"""Unit tests for savable_loader.loader.feeder: a result that cannot be pickled in a worker
becomes an ExceptionWrapper on the same queue, not a silently dropped item."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
from typing import Any

import pytest
from torch._utils import ExceptionWrapper

from savable_loader.core.shutdown import worker_done_event
from savable_loader.loader.feeder import WorkerInit, install_feeder_hook

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


def _in_worker(init: WorkerInit, out: Any) -> None:
    init(0)  # what torch's worker loop does first
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(worker_done_event()))
    thread.start()
    thread.join()
    out.put([worker_done_event() is init.done, seen[0] is init.done, worker_done_event().is_set()])


@pytest.mark.timeout(300)  # a spawned child imports torch: slow on a loaded machine
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_done_event_is_the_loaders_event_in_its_worker_process_only(context: str) -> None:
    ctx = multiprocessing.get_context(context)
    done, out = ctx.Event(), ctx.Queue()
    init = WorkerInit(None).with_done(done)
    assert worker_done_event() is None  # the main process: no worker init ran here
    child = ctx.Process(target=_in_worker, args=(init, out))
    child.start()
    assert out.get(timeout=240) == [True, True, False]  # any thread of the worker sees it
    child.join(60)
    done.set()
    assert worker_done_event() is None
