"""PollingSource: a producer's stream read by index (``fetch`` polled until an item is
there), resumed exactly: at every step against the uninterrupted run while producer
threads write, across epochs (END), with another ``num_workers``, a save while the
iterating thread waits, restore keys, argument checks and hostile ``fetch`` functions.

The processes side (a producer process, SIGKILL, spawn/forkserver, gloo, timeouts in
workers) is in ``tests/sources/test_polling_processes.py``; both share the folder stream below.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch

import savable_loader as sl
import savable_loader.sources.polling as polling_module
from savable_loader.config import _ActiveWorker, _LogicalWorkers
from savable_loader.errors import ConfigMismatchError, LoaderUsageError, RestoreKeyError, StateError, UsageTypeError
from savable_loader.sources import END, PollingSource, StreamInfo
from savable_loader.state import decode, encode
from savable_loader.wrappers import BatchDataset, FilterDataset, MapDataset, ShuffleBufferDataset
from tests.common import assert_same, assert_streams, check_resume_everywhere, epochs_of
from tests.pipeline.test_hosting import check_resized

pytestmark = pytest.mark.timeout(120)

SEED = 7


# -- a folder stream: the producer writes <root>/rank<r>/epoch<e>/<i>.json, then END ----------


def length(rank: int, epoch: int) -> int:
    """Items of rank ``rank``'s stream in ``epoch`` (they differ: END per rank and epoch)."""
    return 7 + rank - 2 * epoch


def payload(rank: int, epoch: int, index: int) -> int:
    return (rank * 1000 + epoch * 100 + index) * 7919 % 10007


def write_atomic(path: Path, text: str) -> None:
    """Write then rename: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def produce(root: str, ranks: list[int], epochs: int, delay: float = 0.0, count: int | None = None) -> None:
    """Write every rank's stream of ``epochs`` epochs (``count`` items each, default
    ``length(rank, epoch)``), one index at a time, ``delay`` seconds apart; each epoch's
    END after its items."""
    size = length if count is None else (lambda rank, epoch: count)
    for epoch in range(epochs):
        folders = {r: Path(root, f"rank{r}", f"epoch{epoch}") for r in ranks}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        for i in range(max(size(r, epoch) for r in ranks)):
            for r in ranks:
                if i < size(r, epoch):
                    write_atomic(folders[r] / f"{i}.json", json.dumps({"index": i, "value": payload(r, epoch, i)}))
            if delay:
                time.sleep(delay)
        for r in ranks:
            write_atomic(folders[r] / "END", str(size(r, epoch)))


class FolderFetch:
    """``fetch`` over a folder a producer writes: the item once ``<i>.json`` exists, END
    at or past the count in ``END``, None before. Each item draws from ``random`` (the
    source re-seeds before every call, so the draw repeats on a resume)."""

    def __init__(self, root: str | Path) -> None:
        self.root = str(root)

    def __call__(self, info: StreamInfo, index: int) -> Any:
        folder = Path(self.root, f"rank{info.rank}", f"epoch{info.epoch}")
        try:
            data = json.loads((folder / f"{index}.json").read_text())
        except FileNotFoundError:
            try:
                end = int((folder / "END").read_text())
            except FileNotFoundError:
                return None
            return END if index >= end else None
        return torch.tensor([info.rank, info.epoch, data["index"], data["value"], random.randint(0, 10**6)])


def augment(x: Any) -> tuple[Any, float, float, float]:
    """A random augmentation above the source: draws from the three global RNGs."""
    return x, random.random(), float(np.random.rand()), float(torch.rand(()))


def wconf(rank: int = 0, world: int = 1, workers: int = 0) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=SEED)


def loader_of(ds: sl.SavableDataset, context: str = "fork", **kw: Any) -> sl.SavableDataLoader:
    if ds.worker_config.num_workers:
        kw.setdefault("multiprocessing_context", context)
        kw.setdefault("timeout", 60)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, **kw)


def folder_loader(root: Path, wc: sl.WorkerConfig, map_above: bool = True, **kw: Any) -> sl.SavableDataLoader:
    ds: sl.SavableDataset = PollingSource(FolderFetch(root), wc, poll_interval=0.002, timeout=30)
    return loader_of(MapDataset(ds, augment) if map_above else ds, **kw)


def values_of(items: list[Any]) -> list[tuple[int, int, int]]:
    """(rank, epoch, index) of each item (a tensor, or the tensor of an augmented tuple)."""
    out = []
    for x in items:
        t = x[0] if isinstance(x, (tuple, list)) else x
        out.append((int(t[0]), int(t[1]), int(t[2])))
    return out


# -- END -------------------------------------------------------------------------------------


def test_end_is_a_singleton_that_survives_pickling_and_copies():
    assert repr(END) == "END"
    assert type(END)() is END
    for again in (
        pickle.loads(pickle.dumps(END)),
        cloudpickle.loads(cloudpickle.dumps(END)),
        copy.copy(END),
        copy.deepcopy(END),
        pickle.loads(pickle.dumps([END, {"x": END}]))[1]["x"],
    ):
        assert again is END
    assert sl.sources.END is polling_module.END


# -- arguments --------------------------------------------------------------------------------


def ok(info: StreamInfo, index: int) -> Any:
    return END if index >= 5 else index


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"fetch": 3},
            UsageTypeError,
            r"PollingSource fetch must be callable as fetch\(info, index\), got 3 of type int",
        ),
        ({"fetch": None}, UsageTypeError, "fetch must be callable"),
        (
            {"poll_interval": 0},
            LoaderUsageError,
            r"poll_interval must be a finite number of seconds in \(0, 1\], got 0",
        ),
        ({"poll_interval": -0.1}, LoaderUsageError, r"poll_interval .* got -0.1"),
        ({"poll_interval": float("nan")}, LoaderUsageError, r"poll_interval .* got nan"),
        ({"poll_interval": float("inf")}, LoaderUsageError, r"poll_interval .* got inf"),
        ({"poll_interval": 1e9}, LoaderUsageError, r"poll_interval must be .* in \(0, 1\], got 1000000000.0"),
        ({"poll_interval": "0.1"}, UsageTypeError, r"poll_interval .* got '0.1' of type str"),
        ({"poll_interval": True}, UsageTypeError, r"poll_interval .* got True of type bool"),
        (
            {"timeout": 0},
            LoaderUsageError,
            r"timeout must be None \(wait forever\) or a finite number of seconds > 0, got 0",
        ),
        ({"timeout": -5}, LoaderUsageError, r"timeout .* got -5"),
        ({"timeout": float("nan")}, LoaderUsageError, r"timeout .* got nan"),
        ({"timeout": float("inf")}, LoaderUsageError, r"timeout .* got inf"),
        ({"timeout": "30"}, UsageTypeError, r"timeout .* got '30' of type str"),
        ({"timeout": False}, UsageTypeError, r"timeout .* got False of type bool"),
    ],
)
def test_bad_arguments_name_the_field_the_value_and_what_is_expected(kwargs, error, message):
    args = {"fetch": ok, **kwargs}
    fetch = args.pop("fetch")
    with pytest.raises(error, match=message):
        PollingSource(fetch, wconf(), **args)


def test_good_arguments_and_config():
    ds = PollingSource(ok, wconf(), poll_interval=1, timeout=0.5)
    assert (ds.poll_interval, ds.timeout) == (1.0, 0.5)
    assert ds.config() == {"fetch": ok}
    assert ds.can_restore_sample()
    with pytest.raises(LoaderUsageError, match="needs worker_config"):
        PollingSource(ok, None)  # type: ignore[arg-type]


# -- the split, the keys, the polling ------------------------------------------------------------


def worker_stream(ds: PollingSource, worker: int, workers: int, epoch: int) -> list[tuple[Any, Any]]:
    out = []
    with _ActiveWorker(worker, epoch), _LogicalWorkers(workers):
        ds.reset_state_deep()
        for x in ds:
            out.append((x, ds.sample_key))
    return out


def test_worker_w_of_k_fetches_w_then_every_kth_index_with_its_key():
    asked: list[tuple[int, int, int, int, int]] = []

    def fetch(info: StreamInfo, index: int) -> Any:
        asked.append((info.rank, info.worker, info.workers_per_rank, info.epoch, index))
        return END if index >= 11 else index

    ds = PollingSource(fetch, wconf(1, 2, 3))
    for w in range(3):
        got = worker_stream(ds, w, 3, 4)
        assert [x for x, _ in got] == list(range(w, 11, 3))
        assert [k for _, k in got] == [[4, i] for i in range(w, 11, 3)]
        stop = next(i for i in range(w, 100, 3) if i >= 11)  # the first index at or past the end
        assert [a[4] for a in asked] == [*range(w, 11, 3), stop]
        assert {a[:4] for a in asked} == {(1, w, 3, 4)}
        asked.clear()
    info = ds.info(worker=2, epoch=5)
    assert (info.rank, info.world_size, info.worker, info.workers_per_rank, info.epoch, info.seed) == (
        1,
        2,
        2,
        3,
        5,
        SEED,
    )


def test_polling_backs_off_doubling_to_one_second_and_resets_after_an_item(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(polling_module.time, "sleep", sleeps.append)
    misses = {0: 8, 1: 0, 2: 3}

    def fetch(info: StreamInfo, index: int) -> Any:
        if index >= 3:
            return END
        if misses[index]:
            misses[index] -= 1
            return None
        return index

    assert list(PollingSource(fetch, wconf(), poll_interval=0.05)) == [0, 1, 2]
    assert sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 0.05, 0.1, 0.2])


def test_draws_in_fetch_do_not_depend_on_how_many_polls_an_item_took():
    def fetch_after(misses: int) -> Any:
        calls: dict[int, int] = {}

        def fetch(info: StreamInfo, index: int) -> Any:
            draw = (random.random(), float(np.random.rand()), float(torch.rand(())))  # drawn on every call
            calls[index] = calls.get(index, 0) + 1
            if index >= 6:
                return END
            return None if calls[index] <= misses * (index % 2) else (index, draw)

        return fetch

    streams = []
    for misses in (0, 3):
        ds = MapDataset(PollingSource(fetch_after(misses), wconf(), poll_interval=1e-4), augment)
        streams.append(worker_stream(ds, 0, 1, 2))  # type: ignore[arg-type]
    assert_streams(streams[1], streams[0], "with polls")


# -- hostile fetch functions --------------------------------------------------------------------


def hostile(kind: str) -> Any:
    def fetch(info: StreamInfo, index: int) -> Any:
        if index < 2:
            return index
        if kind == "string":
            return "END"
        if kind == "bytes":
            return b"END"
        if kind == "stop":
            raise StopIteration
        raise KeyError(f"no item {index} in the store")

    return fetch


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        (
            "string",
            LoaderUsageError,
            r"returned 'END' for index 2 of rank 0's stream: return savable_loader.sources.END",
        ),
        ("bytes", LoaderUsageError, r"returned b'END' for index 2"),
        (
            "stop",
            LoaderUsageError,
            r"raised StopIteration for index 2 of rank 0's stream: return savable_loader.sources.END",
        ),
        ("raise", KeyError, "no item 2 in the store"),
    ],
)
def test_hostile_fetch_is_a_clear_error_in_the_main_process(kind, error, message, num_workers):
    loader = loader_of(PollingSource(hostile(kind), wconf(workers=num_workers)))
    got = []
    with pytest.raises(error, match=message):
        for x in loader:
            got.append(x)  # noqa: PERF402 - the items before the error
    assert sorted(got) == [0, 1]


def test_a_text_item_spelling_end_otherwise_is_data():
    """Only an item that is exactly the text END is refused (a likely mistake for the
    END marker); a stream of words may hold "End", "end" or " END "."""
    words = ["The", "End", "end", " END ", b"end"]

    def fetch(info: StreamInfo, index: int) -> Any:
        return words[index] if index < len(words) else END

    assert list(loader_of(PollingSource(fetch, wconf()))) == words


# -- resume at every step while a producer thread writes -----------------------------------------


@pytest.mark.parametrize(
    ("rank", "world", "num_workers"),
    [(0, 1, 0), (0, 1, 2), (1, 2, 0), (1, 2, 2), (0, 2, 0)],
    ids=["r0of1-w0", "r0of1-w2", "r1of2-w0", "r1of2-w2", "r0of2-w0"],
)
def test_resume_at_every_step_while_a_producer_thread_writes(tmp_path, rank, world, num_workers):
    producer = threading.Thread(target=produce, args=(str(tmp_path), list(range(world)), 2, 0.004))
    producer.start()
    try:
        factory = lambda: folder_loader(tmp_path, wconf(rank, world, num_workers))
        reference = epochs_of(factory(), 2)  # read while the producer writes: polls
        assert values_of(reference[0] + reference[1]) == [
            (rank, e, i) for e in range(2) for i in range(length(rank, e))
        ]
        variants = ("live", "break") if num_workers == 0 else ("live",)
        checked = check_resume_everywhere(factory, 2, reference=reference, variants=variants)
        assert checked >= length(rank, 0) + length(rank, 1) + 3
    finally:
        producer.join(30)


def test_the_ranks_of_a_world_read_their_own_streams_and_peers_the_same(tmp_path):
    produce(str(tmp_path), [0, 1], 1)
    streams = [[x for x in folder_loader(tmp_path, wconf(r, 2, 0))] for r in (0, 1)]
    assert values_of(streams[0]) == [(0, 0, i) for i in range(length(0, 0))]
    assert values_of(streams[1]) == [(1, 0, i) for i in range(length(1, 0))]
    peer = [x for x in folder_loader(tmp_path, wconf(1, 2, 2))]  # a tensor-parallel peer of rank 1
    assert_streams(peer, streams[1], "a peer of data-parallel rank 1")


# -- restore: a jump to the index, nothing consumed fetched again ----------------------------------


def test_a_restored_source_jumps_to_its_next_index():
    asked: list[int] = []

    def fetch(info: StreamInfo, index: int) -> Any:
        asked.append(index)
        return END if index >= 20 else index * 10

    ds = PollingSource(fetch, wconf(0, 1, 3))
    with _ActiveWorker(1, 0), _LogicalWorkers(3):
        ds.reset_state_deep()
        it = iter(ds)
        assert [next(it) for _ in range(3)] == [10, 40, 70]
        state = ds.save_state()
        assert state.fields == {"epoch": [0], "position": 3}
        fresh = PollingSource(fetch, wconf(0, 1, 3))
        fresh.restore_state(state)
        asked.clear()
        assert list(fresh) == [100, 130, 160, 190]
    assert asked == [10, 13, 16, 19, 22]  # from worker 1's 4th index on, then END


@pytest.mark.parametrize("position", [-1, 2.0, "3", None, True])
def test_a_malformed_position_is_a_state_error(position):
    ds = PollingSource(ok, wconf())
    state = ds.save_state()
    state.fields["position"] = position
    ds.restore_state(state)
    with pytest.raises(
        StateError, match=rf"PollingSource position must be an int >= 0 .*, got {re.escape(repr(position))}"
    ):
        list(ds)


def slow_fetch(info: StreamInfo, index: int) -> Any:
    ASKED.append(index)
    return END if index >= 10 else torch.tensor([index, random.randint(0, 10**6)])


ASKED: list[int] = []  # indices slow_fetch was asked for, in this process


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_restore_never_fetches_an_item_consumed_before_the_save(num_workers):
    """The source forces a snapshot after every item, however cheap its fetch (here an
    in-memory one of microseconds, next to which the snapshot policy alone would not
    snapshot): every state holds the snapshot of its position (skip 0), and a restore
    fetches only what the loop had not consumed."""
    wc = wconf(0, 1, num_workers)
    reference = list(loader_of(PollingSource(slow_fetch, wc)))
    loader = loader_of(PollingSource(slow_fetch, wc))
    states = []
    for _ in loader:
        state = loader.save_state_rank()
        states.append(state)
        assert [ws.skip for ws in state.position.workers] == [0] * max(num_workers, 1)
    for k in (3, 7):
        ASKED.clear()
        fresh = loader_of(PollingSource(slow_fetch, wconf(0, 1, 0)))
        fresh.restore_state_rank(decode(encode(states[k - 1])))
        assert_streams(list(fresh), reference[k:], f"restored after {k} items")
        if num_workers == 0:
            assert ASKED == list(range(k, 11))


# -- a save while the iterating thread (or the workers) wait in fetch ---------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_save_while_waiting_returns_at_once_and_continues_with_the_awaited_item(tmp_path, num_workers):
    root = tmp_path / "stream"
    folder = root / "rank0" / "epoch0"
    folder.mkdir(parents=True)
    first = 5
    for i in range(first):  # the producer has written 5 items, then stalls (waits for the trainer)
        write_atomic(folder / f"{i}.json", json.dumps({"index": i, "value": payload(0, 0, i)}))
    wc = wconf(0, 1, num_workers)
    loader = folder_loader(root, wc)
    got: list[Any] = []
    waiting = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            it = iter(loader)
            for _ in range(first):
                got.append(next(it))
            waiting.set()
            got.extend(it)  # blocks in fetch: index 5 is not there
        except BaseException as e:
            errors.append(e)

    trainer = threading.Thread(target=train)
    trainer.start()
    assert waiting.wait(30), errors
    time.sleep(0.3)  # the iterating thread / the workers are polling for index 5
    assert len(got) == first and trainer.is_alive()
    saved: list[Any] = []
    saver = threading.Thread(target=lambda: saved.append((time.perf_counter(), loader.save_state_rank())))
    t0 = time.perf_counter()
    saver.start()
    saver.join(5)
    assert saved, "save_state_rank() blocked while the iterating side waited for the producer"
    seconds = saved[0][0] - t0
    assert seconds < 1.0, f"the save took {seconds:.3f} s"
    print(f"save while waiting ({num_workers} workers): {seconds * 1000:.2f} ms")
    state = decode(encode(saved[0][1]))
    assert sum(ws.index for ws in state.position.workers) == first
    # the producer goes on: the training thread gets the awaited item and the rest
    for i in range(first, length(0, 0)):
        write_atomic(folder / f"{i}.json", json.dumps({"index": i, "value": payload(0, 0, i)}))
    write_atomic(folder / "END", str(length(0, 0)))
    trainer.join(30)
    assert not trainer.is_alive() and not errors, errors
    reference = list(folder_loader(root, wc))
    assert_streams(got, reference, "the run that was saved while waiting")
    fresh = folder_loader(root, wc)
    fresh.restore_state_rank(state)
    assert_streams(list(fresh), reference[first:], "restored from the save taken while waiting")


# -- another num_workers on resume: every index exactly once ------------------------------------------


def pure_fetch(info: StreamInfo, index: int) -> Any:
    if index >= 11 + info.epoch:
        return END
    return torch.tensor([info.epoch, index, random.randint(0, 10**6)])


def resized_factory(wrap: str):
    def make(workers: int, **kw: Any) -> sl.SavableDataLoader:
        wc = wconf(0, 1, workers)
        ds: sl.SavableDataset = PollingSource(pure_fetch, wc)
        if wrap == "map":
            ds = MapDataset(ds, augment)
        elif wrap == "filter-batch":
            ds = BatchDataset(FilterDataset(ds, lambda x: int(x[1]) % 4 != 3), 2)
        elif wrap == "shuffle":
            ds = ShuffleBufferDataset(MapDataset(ds, augment), 3)
        return loader_of(ds, **kw)

    return make


def indices(items: list[Any]) -> list[int]:
    out: list[int] = []
    for x in items:
        t = x[0] if isinstance(x, (tuple, list)) else x
        out.extend([int(t[1])] if t.dim() == 1 else [int(v) for v in t[:, 1]])
    return out


@pytest.mark.parametrize(("k_from", "k_to"), [(2, 0), (2, 1), (3, 2), (2, 3), (0, 2), (1, 2)])
def test_another_num_workers_on_resume_reads_every_index_exactly_once(k_from, k_to):
    steps = [(k, False) for k in (1, 4, 7, 10)] + [(11, True)]
    check_resized(resized_factory("map"), k_from, k_to, steps)
    # and as plain indices: the two runs together hold 0..10 once each (epoch 0)
    for k in (1, 4, 7):
        first = resized_factory("map")(k_from)
        it = iter(first)
        before = [next(it) for _ in range(k)]
        state = decode(encode(first.save_state_rank()))
        del it
        second = resized_factory("map")(k_to)
        second.restore_state_rank(state)
        after = list(second)
        assert sorted(indices(before + after)) == list(range(11)), (k_from, k_to, k)


@pytest.mark.parametrize("wrap", ["filter-batch", "shuffle"])
def test_another_num_workers_under_wrappers(wrap):
    factory = resized_factory(wrap)
    for k_from, k_to in [(2, 0), (0, 2)]:
        check_resized(factory, k_from, k_to, [(1, False), (3, False)])


# -- world size, peek, restore_sample -------------------------------------------------------------


def test_another_world_size_is_refused_naming_world_size(tmp_path):
    produce(str(tmp_path), [0, 1], 1)
    loader = folder_loader(tmp_path, wconf(0, 2, 0))
    it = iter(loader)
    next(it)
    state = decode(encode(loader.save_state_rank()))
    for world in (1, 3):
        with pytest.raises(ConfigMismatchError, match="world_size was 2 when the state was saved, but is") as e:
            folder_loader(tmp_path, wconf(0, world, 0)).restore_state_rank(state)
        assert (e.value.field, e.value.saved, e.value.current) == ("world_size", 2, world)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_peek_then_save_and_restore(tmp_path, num_workers):
    produce(str(tmp_path), [0], 2)
    wc = wconf(0, 1, num_workers)
    reference = epochs_of(folder_loader(tmp_path, wc), 2)
    loader = folder_loader(tmp_path, wc)
    assert_same(next(iter(loader)), reference[0][0], "the peek")
    state = decode(encode(loader.save_state_rank()))
    assert_streams(list(loader), reference[1], "the live loader's next iter() (epoch 1)")
    fresh = folder_loader(tmp_path, wc)
    fresh.restore_state_rank(state)
    assert_streams(list(fresh), reference[0][1:], "restored after the peek: epoch 0's rest")
    assert_streams(list(fresh), reference[1], "then epoch 1")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restore_sample_fetches_the_item_again(tmp_path, num_workers):
    produce(str(tmp_path), [0], 2)
    wc = wconf(0, 1, num_workers)
    loader = folder_loader(tmp_path, wc)
    seen = [(x, str(loader.restore_key)) for _ in range(2) for x in loader]
    other = folder_loader(tmp_path, wconf(0, 1, 0))
    for x, key in random.Random(2).sample(seen, 5) + [seen[-1]]:
        assert_same(other.restore_sample(key), x, key)


@pytest.mark.parametrize("key", [None, [0], [0, 1, 2], [0, -1], [True, 0], "0", [0, 1.0]])
def test_bad_restore_keys(key):
    with pytest.raises(RestoreKeyError, match=r"PollingSource key must be \[epoch, index\]"):
        PollingSource(ok, wconf()).restore_sample(key)


def test_restore_sample_of_an_index_now_past_the_end_is_an_error():
    with pytest.raises(RestoreKeyError, match=r"key \[0, 7\]: fetch ok returned END for index 7 .* the stream changed"):
        PollingSource(ok, wconf()).restore_sample([0, 7])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_empty_epochs_and_epochs_shorter_than_the_workers(num_workers):
    def fetch(info: StreamInfo, index: int) -> Any:
        return END if index >= info.epoch % 3 else (info.epoch, index)

    loader = loader_of(PollingSource(fetch, wconf(0, 1, num_workers)))
    assert epochs_of(loader, 4) == [[], [[1, 0]], [[2, 0], [2, 1]], []]


def test_epochs_end_at_end_and_the_next_iter_is_the_next_epoch():
    seen: list[tuple[int, int]] = []

    def fetch(info: StreamInfo, index: int) -> Any:
        seen.append((info.epoch, index))
        return END if index >= 2 + info.epoch else (info.epoch, index)

    loader = loader_of(PollingSource(fetch, wconf()))
    assert epochs_of(loader, 3) == [[[0, 0], [0, 1]], [[1, 0], [1, 1], [1, 2]], [[2, 0], [2, 1], [2, 2], [2, 3]]]
    assert [s for s in seen if s[1] == 0] == [(0, 0), (1, 0), (2, 0)]
