"""The private torch internals savable_loader uses exist in the installed torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from savable_loader._torch_internals import replace_worker_info, torch_worker_id, worker_done_event, worker_seed_setter


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


class _Seeded(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list:
        before = get_worker_info().seed
        worker_seed_setter()(1000 + i)
        return [before, get_worker_info().seed]


def test_worker_seed_setter_sets_what_get_worker_info_seed_says():
    assert worker_seed_setter() is None  # not in a worker
    loader = DataLoader(_Seeded(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    items = list(loader)
    assert [item[1] for item in items] == [1000, 1001]
    assert items[1][0] == 1000  # the info object itself holds it


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
import re

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


def test_multiprocessing_queue_internals():
    assert callable(multiprocessing.queues.Queue._on_queue_feeder_error)
    q = multiprocessing.get_context("fork").Queue()
    q.put("a")  # starts the feeder thread, which sends what the buffer holds
    ti.queue_push_front(q, "x")
    assert {q.get(timeout=10), q.get(timeout=10)} == {"a", "x"}
    q.close()


class _Count(torch.utils.data.IterableDataset):
    def __init__(self, n: int, length: int | None = None) -> None:
        self.n, self.length = n, length

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no length")
        return self.length


def test_next_batch_steps_the_single_process_iterator_as_next_does():
    loader = DataLoader(_Count(5), batch_size=2)
    it = iter(loader)
    got = []
    with pytest.raises(StopIteration):
        while True:
            got.append(ti.next_batch(it).tolist())
    assert got == [[0, 1], [2, 3], [4]] == [b.tolist() for b in loader]
    assert it._num_yielded == 3

    def mapped() -> DataLoader:
        return DataLoader(list(range(5)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))

    it = iter(mapped())
    assert [ti.next_batch(it).tolist() for _ in range(3)] == [b.tolist() for b in mapped()]


def test_next_batch_keeps_torchs_span_under_a_profiler_and_its_length_warning():
    from torch.profiler import profile

    loader = DataLoader(_Count(4), batch_size=2)
    with profile() as prof:
        it = iter(loader)
        ti.next_batch(it)
    assert any("DataLoader" in event.name for event in prof.events())
    reported = DataLoader(_Count(3, length=2), batch_size=None)
    assert len(reported) == 2
    it = iter(reported)
    ti.next_batch(it), ti.next_batch(it)
    with pytest.warns(UserWarning, match="was reported to be 2"):
        ti.next_batch(it)


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
