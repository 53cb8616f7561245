"""The private torch internals savable_loader uses exist in the installed torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from savable_loader._torch_internals import replace_worker_info, torch_worker_id, worker_done_event


class _Info(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list:
        info = get_worker_info()
        return [info.id, info.dataset, torch_worker_id()]


def _init(worker_id: int) -> None:
    replace_worker_info(id=worker_id + 10, dataset="user")


def test_replace_worker_info_changes_what_get_worker_info_returns():
    loader = DataLoader(_Info(), batch_size=None, num_workers=2, worker_init_fn=_init, multiprocessing_context="fork")
    assert sorted(item[0] for item in loader) == [10, 11]
    assert {item[1] for item in loader} == {"user"}
    assert sorted((item[0], item[2]) for item in loader) == [(10, 0), (11, 1)]  # torch's ids survive


class _Done(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list:
        event = worker_done_event()
        return [type(event).__name__, event.is_set(), worker_done_event() is event]


def test_worker_done_event_is_torchs_shutdown_signal_in_a_worker():
    assert worker_done_event() is None  # the main process
    loader = DataLoader(_Done(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert list(loader) == [["Event", False, True]] * 2


def test_replace_worker_info_outside_a_worker_is_an_error():
    with pytest.raises(RuntimeError, match="outside a DataLoader worker"):  # an InternalError
        replace_worker_info(id=1)
    assert torch_worker_id() is None
    assert torch.__version__


# -- every private attribute and error text, against the installed torch ------------------

import inspect
import multiprocessing.queues
import random
import re

import numpy as np
import torch.utils.data.dataloader as torch_dataloader
from torch.utils.data._utils import signal_handling

from savable_loader import _torch_internals as ti


class _Range(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def test_dataloader_iterator_attributes_exist_and_work():
    loader = DataLoader(
        _Range(), batch_size=None, num_workers=1, persistent_workers=True, multiprocessing_context="fork"
    )
    assert ti.loader_iterator(loader) is None
    it = iter(loader)
    assert ti.loader_iterator(loader) is it
    assert next(it) == 0
    processes = ti.worker_processes(it)
    assert len(processes) == 1 and processes[0].is_alive()
    assert ti.pending_worker(it) in (0, None)
    ti.shutdown_workers(it)
    processes[0].join(10)
    assert not processes[0].is_alive()
    ti.set_loader_iterator(loader, None)
    assert ti.loader_iterator(loader) is None


def test_in_process_iterators_have_no_workers():
    it = iter(DataLoader(_Range(), batch_size=None))
    assert ti.worker_processes(it) == [] and ti.pending_worker(it) is None
    ti.shutdown_workers(it)  # nothing to stop
    assert ti.worker_processes(None) == []


def test_a_missing_attribute_fails_loudly_naming_torch():
    class Moved(torch_dataloader._MultiProcessingDataLoaderIter):
        def __init__(self) -> None:  # no torch state at all
            pass

    with pytest.raises(
        AttributeError,
        match=re.escape(f"_MultiProcessingDataLoaderIter._workers, which torch {torch.__version__} does not have"),
    ):
        ti.worker_processes(Moved())
    with pytest.raises(AttributeError, match="DataLoader._iterator"):
        ti.loader_iterator(object())


def test_error_texts_are_torchs():
    source = inspect.getsource(torch_dataloader) + inspect.getsource(signal_handling)
    assert "DataLoader timed out after" in source and ti.TIMEOUT_TEXT in "DataLoader timed out after 3 seconds"
    assert "exited unexpectedly" in source and ti.DIED_TEXTS[0] == "exited unexpectedly"
    assert ti.WORKER_PROCESS_TEXT in inspect.getsource(torch.utils.data._utils.worker)
    # torch's text for several dead workers, and for one
    text = torch_dataloader._MultiProcessingDataLoaderIter._try_get_data.__code__.co_consts
    assert any(isinstance(c, str) and "DataLoader worker (pid(s) " in c for c in text)
    assert ti.died_pids("DataLoader worker (pid(s) 12, 345) exited unexpectedly") == {12, 345}
    assert ti.died_pids("DataLoader worker (pid 77) is killed by signal: Killed.") == {77}
    assert ti.died_pids("no pid here") == set()


def test_cpython_and_numpy_internals():
    assert isinstance(ti.PY_RANDOM, random.Random) and random.random.__self__ is ti.PY_RANDOM
    np.random.seed(5)
    assert ti.numpy_global_randomstate().get_state()[1][0] == np.random.get_state()[1][0]
    r = random.Random()
    ti.C_RANDOM_SEED(r, 3)
    assert r.random() == random.Random(3).random()
    assert callable(multiprocessing.queues.Queue._on_queue_feeder_error)
    q = multiprocessing.get_context("fork").Queue()
    q.put("a")  # starts the feeder thread, which sends what the buffer holds
    ti.queue_push_front(q, "x")
    assert {q.get(timeout=10), q.get(timeout=10)} == {"a", "x"}
    q.close()


def test_the_mersenne_twister_layouts_check_out_here():
    # the fast fingerprints read CPython's RandomObject and NumPy's mt19937_state: a new
    # interpreter or NumPy that moved them fails here first (the slow forms still work)
    assert ti._python_layout_ok() and ti._numpy_layout_ok()


@pytest.mark.parametrize("fast", [True, False])
def test_fingerprints_change_exactly_when_the_state_does(monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(ti, "_python_layout_ok", lambda: False)
        monkeypatch.setattr(ti, "_numpy_layout_ok", lambda: False)
    python = ti.python_random_fingerprint(ti.PY_RANDOM)
    numpy = ti.numpy_mt_fingerprint(ti.numpy_global_randomstate())
    random.seed(3)
    np.random.seed(3)
    before = python(), numpy()
    assert (python(), numpy()) == before
    random.gauss(0, 1)  # two normals drawn, one cached in gauss_next
    after_draw = python()
    assert after_draw != before[0]
    random.gauss(0, 1)  # the cached one: the words stay, gauss_next goes
    assert python() != after_draw
    np.random.rand()
    assert numpy() != before[1]
    state = ti.PY_RANDOM.getstate()
    random.seed(3)
    assert python() == before[0]  # the same state again: the same fingerprint
    ti.PY_RANDOM.setstate(state)
    np.random.seed(3)
    assert numpy() == before[1]


@pytest.mark.parametrize("fast", [True, False])
def test_numpy_fingerprint_sees_another_bit_generator(monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(ti, "_numpy_layout_ok", lambda: False)
    state = ti.numpy_global_randomstate()
    old = np.random.get_bit_generator()
    look = ti.numpy_mt_fingerprint(state)
    before = look()
    np.random.set_bit_generator(np.random.PCG64(1))
    try:
        assert look() != before
    finally:
        np.random.set_bit_generator(old)
    assert look() == before


def test_the_numpy_gauss_layout_checks_out_here():
    # NumPy's aug_bitgen_t inside RandomState: a NumPy that moved it fails here first
    assert ti._NP_GAUSS_OFFSET is not None


@pytest.mark.parametrize("fast", [True, False])
def test_numpy_gauss_fingerprint_sees_a_cached_gaussian_taken_or_put_back(monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(ti, "_NP_GAUSS_OFFSET", None)
    look = ti.numpy_gauss_fingerprint(ti.numpy_global_randomstate())
    words = ti.numpy_mt_fingerprint(ti.numpy_global_randomstate())
    np.random.seed(5)
    empty = look()
    np.random.randn()  # two normals made, one cached
    cached, moved = look(), words()
    assert cached != empty
    kept = np.random.get_state()
    np.random.randn()  # the cached one taken: the words stay
    assert words() == moved and look() != cached
    np.random.set_state(kept)  # put back
    assert look() == cached


class _DoneInThread(Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> list:
        import threading

        seen: list = []
        thread = threading.Thread(target=lambda: seen.append(worker_done_event()))
        thread.start()
        thread.join()
        return [seen[0] is None, worker_done_event() is not None]


def test_worker_done_event_is_none_in_a_users_thread_inside_a_worker():
    """A thread of the user's inside a worker (a prefetch wrapper) has no torch loop on its
    stack: no shutdown signal there (None), not an AttributeError."""
    loader = DataLoader(_DoneInThread(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    assert list(loader) == [[True, True]]
