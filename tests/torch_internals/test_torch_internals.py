"""The private torch internals savable_loader uses exist in the installed torch."""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import savable_loader as sl
from savable_loader._torch import internals as ti
from savable_loader._torch.internals import replace_worker_info, torch_worker_id, worker_seed_setter
from savable_loader.core.shutdown import worker_done_event
from savable_loader.loader.feeder import WorkerInit


class _Info(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list:
        info = get_worker_info()
        return [info.id, info.dataset, torch_worker_id(), info.num_workers, info.seed]


def _init(worker_id: int) -> None:
    replace_worker_info(id=worker_id + 10, dataset="user")


def test_replace_worker_info_changes_what_get_worker_info_returns():
    # the installed torch's WorkerInfo, whichever shape it has (the adapter chosen for it)
    loader = DataLoader(_Info(), batch_size=None, num_workers=2, worker_init_fn=_init, multiprocessing_context="fork")
    plain = DataLoader(_Info(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    torch.manual_seed(4)
    items = list(loader)
    torch.manual_seed(4)
    untouched = list(plain)
    assert sorted(item[0] for item in items) == [10, 11]
    assert {item[1] for item in items} == {"user"}
    assert sorted((item[0], item[2]) for item in items) == [(10, 0), (11, 1)]  # torch's ids survive
    # every other field kept: num_workers and the seed torch drew
    assert sorted((i[2], i[3], i[4]) for i in items) == sorted((i[0], i[3], i[4]) for i in untouched)


# torch's two shapes of WorkerInfo, as they are: each adapter runs on every torch
def _plain_worker_info() -> type:
    class WorkerInfo:  # torch 2.4 to 2.12 (torch/utils/data/_utils/worker.py), its private names too
        id: int
        __initialized = False

        def __init__(self, **kwargs):
            for k, v in kwargs.items():
                setattr(self, k, v)
            self.__keys = tuple(kwargs.keys())
            self.__initialized = True

        def __setattr__(self, key, val):
            if self.__initialized:
                raise RuntimeError(f"Cannot assign attributes to {self.__class__.__name__} objects")
            return super().__setattr__(key, val)

    return WorkerInfo


_PlainWorkerInfo = _plain_worker_info()


@dataclasses.dataclass(frozen=True, slots=True)
class _DataclassWorkerInfo:  # torch 2.13 and later
    id: int
    num_workers: int
    seed: int
    dataset: object
    rng: object = None
    worker_method: str | None = "multiprocessing"


@pytest.mark.parametrize(
    ("make", "replace"),
    [(_PlainWorkerInfo, "_replace_plain"), (_DataclassWorkerInfo, "_replace_dataclass")],
    ids=["plain class (torch < 2.13)", "frozen dataclass (torch >= 2.13)"],
)
def test_each_worker_info_adapter_makes_a_changed_copy(monkeypatch, make, replace):
    import torch.utils.data._utils.worker as torch_worker

    info = make(id=1, num_workers=3, seed=77, dataset="engine")
    with pytest.raises((RuntimeError, dataclasses.FrozenInstanceError)):
        info.id = 5  # torch's object refuses assignments: a copy is made
    monkeypatch.setattr(torch_worker, "_worker_info", info)
    monkeypatch.setattr(ti, "_REPLACE_INFO", getattr(ti, replace))
    monkeypatch.setattr(ti, "_original", [])
    replace_worker_info(id=4, dataset="user")
    got = torch_worker._worker_info
    assert type(got) is make and got is not info
    assert (got.id, got.num_workers, got.seed, got.dataset) == (4, 3, 77, "user")
    assert (info.id, info.dataset) == (1, "engine")  # torch's own left as it was
    assert torch_worker_id() == 1  # the id torch gave
    with pytest.raises(AttributeError, match=re.escape(f"WorkerInfo fields ['nope'], which torch {torch.__version__}")):
        replace_worker_info(nope=1)


def test_the_adapter_for_the_installed_torch_is_the_one_of_its_shape():
    from torch.utils.data._utils.worker import WorkerInfo

    expected = ti._replace_dataclass if dataclasses.is_dataclass(WorkerInfo) else ti._replace_plain
    assert ti._REPLACE_INFO is expected
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert (expected is ti._replace_dataclass) == (version >= (2, 13))  # the releases known today


def test_a_worker_info_of_neither_shape_fails_loudly_naming_torch(monkeypatch):
    import torch.utils.data._utils.worker as torch_worker

    class Other:  # no dataclass, no __keys
        id = 0

    monkeypatch.setattr(torch_worker, "_worker_info", Other())
    monkeypatch.setattr(ti, "_REPLACE_INFO", ti._replace_plain)
    with pytest.raises(AttributeError, match=re.escape(f"which torch {torch.__version__} does not have")):
        replace_worker_info(id=1)


# -- the loader's shutdown Event (ShutdownEventLoader), no torch frame read ---------------


class _Recording:
    """A worker init function that records the Event each torch iterator hands out."""

    def __init__(self) -> None:
        self.events: list = []

    def with_done(self, done):
        self.events.append(done)
        return WorkerInit(None, done)


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
    def __init__(self, woke: str) -> None:
        self.woke = woke

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list:
        event = worker_done_event()
        if i == 3:  # waits inside its item until the loader shuts the workers down
            set_in_time = event.wait(60)
            with open(self.woke, "w") as f:
                f.write(f"{set_in_time} {time.time()}")
            return [set_in_time]
        return [type(event).__name__, event.is_set(), worker_done_event() is event]


@pytest.mark.timeout(300)  # spawned workers import torch: slow on a loaded machine
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_each_iterator_of_workers_hands_them_an_event_it_sets_when_it_stops_them(context, tmp_path):
    assert worker_done_event() is None  # the main process
    init = _Recording()
    woke = tmp_path / "woke"
    loader = ti.ShutdownEventLoader(
        _Done(str(woke)), batch_size=None, num_workers=2, worker_init_fn=init, multiprocessing_context=context
    )
    assert loader.worker_init_fn is init
    it = iter(loader)
    assert [next(it) for _ in range(3)] == [["Event", False, True]] * 3
    assert len(init.events) == 1 and not init.events[0].is_set()
    assert loader.worker_init_fn is init  # the Event went to this iterator's workers only
    time.sleep(0.5)  # item 3 waits
    assert not woke.exists()
    processes = ti.worker_processes(it)
    started = time.time()
    del it  # collected: torch's __del__ shuts the workers down, item 3's wait ends
    for process in processes:
        process.join(30)
    assert init.events[0].is_set()
    set_in_time, when = woke.read_text().split()
    assert set_in_time == "True" and float(when) - started < 2.5  # (torch joins a worker for 5 s)
    # the end of an epoch (no persistent workers) sets the next iterator's own Event
    whole = ti.ShutdownEventLoader(
        _Range(), batch_size=None, num_workers=2, worker_init_fn=init, multiprocessing_context=context
    )
    assert list(whole) == [0, 1, 2, 3]
    assert len(init.events) == 2 and init.events[1].is_set()


def test_persistent_workers_keep_one_event_until_they_are_shut_down():
    init = _Recording()
    loader = ti.ShutdownEventLoader(
        _Range(),
        batch_size=None,
        num_workers=1,
        worker_init_fn=init,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    assert list(loader) == list(loader) == [0, 1, 2, 3]
    assert len(init.events) == 1 and not init.events[0].is_set()
    ti.shutdown_workers(ti.loader_iterator(loader))
    assert init.events[0].is_set()


def test_in_process_iteration_has_no_event():
    init = _Recording()
    loader = ti.ShutdownEventLoader(_Range(), batch_size=None, worker_init_fn=init)
    assert list(loader) == [0, 1, 2, 3] and init.events == []


def test_replace_worker_info_outside_a_worker_is_an_error():
    with pytest.raises(RuntimeError, match="outside a DataLoader worker"):  # an InternalError
        replace_worker_info(id=1)
    assert torch_worker_id() is None
    assert torch.__version__


# -- every private attribute and error text, against the installed torch ------------------

import inspect
import multiprocessing.queues

import torch.utils.data.dataloader as torch_dataloader
from torch.utils.data._utils import signal_handling


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


def _pipe_bytes(queue) -> int:
    import fcntl

    return int(fcntl.fcntl(queue._reader.fileno(), fcntl.F_GETPIPE_SZ))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe sizes are set on Linux only")
def test_widen_pipe_grows_a_queues_pipe_and_the_loaders_result_pipe():
    q = multiprocessing.get_context("fork").Queue()
    assert _pipe_bytes(q) == 65536  # Linux's default
    assert ti.widen_pipe(q) == ti.RESULT_PIPE_BYTES == _pipe_bytes(q)
    q.put(b"x" * 300_000)  # one write: no reader needed while it goes in
    assert q.get(timeout=10) == b"x" * 300_000
    q.close()
    loader = sl.SavableDataLoader(list(range(8)), batch_size=2, num_workers=2, seed=0)
    it = iter(loader)
    next(it)
    torch_iter = it._started().torch_iter
    assert _pipe_bytes(torch_iter._worker_result_queue) == ti.RESULT_PIPE_BYTES
    del it


def test_widen_pipe_leaves_a_pipe_it_cannot_grow_as_it_is(monkeypatch):
    import fcntl

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    q = multiprocessing.get_context("fork").Queue()
    monkeypatch.setattr(fcntl, "fcntl", refuse)
    assert ti.widen_pipe(q) is None
    q.put(1)
    assert q.get(timeout=10) == 1
    q.close()


def test_next_batch_steps_the_iterator_of_workers_as_next_does():
    loader = DataLoader(list(range(9)), batch_size=2, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    assert type(it) in ti._STEPPED
    got = []
    with pytest.raises(StopIteration):
        while True:
            got.append(ti.next_batch(it).tolist())
    assert got == [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert it._num_yielded == 5


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


def test_a_state_dict_of_bytes_loads_with_weights_only_on_every_torch():
    import io

    import savable_loader.loader  # noqa: F401 - allows bytes where torch refuses them (torch 2.4)

    buffer = io.BytesIO()
    torch.save({"dp_rank_0": b"\x00\xffstate"}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"dp_rank_0": b"\x00\xffstate"}
    assert ti._weights_only_loads_bytes()


@pytest.mark.parametrize("takes_bytes", [True, False])
def test_each_weights_only_shape(monkeypatch, takes_bytes):
    import _codecs

    added: list = []
    monkeypatch.setattr(ti, "_weights_only_loads_bytes", lambda: takes_bytes)
    monkeypatch.setattr(torch.serialization, "add_safe_globals", added.extend)
    ti.allow_bytes_in_weights_only_loads()
    assert added == ([] if takes_bytes else [_codecs.encode])


def test_without_a_worker_init_function_to_hand_it_there_is_no_event():
    loader = ti.ShutdownEventLoader(_Range(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    it = iter(loader)
    assert type(it) is torch_dataloader._MultiProcessingDataLoaderIter  # torch's own
    assert list(it) == [0, 1, 2, 3]
