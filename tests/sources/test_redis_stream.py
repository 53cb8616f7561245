"""RedisStreamSource against a real redis-server: split, follow, resume, trim, failures.

Every stream comparison is against an uninterrupted run (follow=False gives a finite
reference; follow=True reads a known number of entries). The server is Debian's
``redis-server`` on a free loopback port (``tests/redis_server.py``); without it the
module skips (fails under CI).
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

import savable_loader as sl
from savable_loader.errors import (
    ConfigMismatchError,
    DataError,
    LoaderUsageError,
    StateError,
    StorageError,
    StreamTimeoutError,
    StreamTrimmedError,
)
from savable_loader.sources.redis_stream import RedisStreamSource, mask_url
from savable_loader.state.codec import decode, encode
from savable_loader.state.schema import RankState
from savable_loader.storage import RetryPolicy
from savable_loader.testing import check_resume
from savable_loader.wrappers import BatchDataset, FilterDataset, LimitDataset, MapDataset
from tests.redis_server import RedisServer, require_redis

pytestmark = pytest.mark.timeout(180)

FAST = RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.2, timeout=2.0, deadline=3.0)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    require_redis()
    with RedisServer() as s:
        yield s


@pytest.fixture
def stream(server: RedisServer) -> Iterator[str]:
    name = f"s-{uuid.uuid4().hex[:10]}"
    yield name
    server.client().delete(name)


def fill(server: RedisServer, stream: str, values: range) -> list[str]:
    """XADD one entry ``{"v": str(i)}`` per value; the entry ids."""
    pipe = server.client().pipeline(transaction=False)
    for i in values:
        pipe.xadd(stream, {"v": str(i).encode(), "x": b"\x00\xff"})
    return [i.decode() for i in pipe.execute()]


def make(
    server: RedisServer,
    stream: str,
    *,
    rank: int = 0,
    world: int = 1,
    workers: int = 0,
    follow: bool = False,
    wrap: Callable[[Any, sl.WorkerConfig], Any] | None = None,
    **options: Any,
) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=0)
    url = options.pop("url", server.url)
    ds: Any = RedisStreamSource(url, stream, wc, follow=follow, retry=options.pop("retry", FAST), **options)
    if wrap is not None:
        ds = wrap(ds, wc)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)


def v(sample: dict[str, Any]) -> int:
    return int(sample["v"])


def take(loader: Any, n: int) -> list[int]:
    it = iter(loader)
    try:
        return [v(s) for s in itertools.islice(it, n)]
    finally:
        del it


def roundtrip(state: RankState) -> RankState:
    got = decode(encode(state))
    assert isinstance(got, RankState)
    return got


# -- samples and the split ----------------------------------------------------------------


def test_sample_is_the_entry_fields_and_id(server: RedisServer, stream: str) -> None:
    ids = fill(server, stream, range(3))
    got = list(make(server, stream))
    assert got == [{"v": str(i).encode(), "x": b"\x00\xff", "__id__": ids[i]} for i in range(3)]
    assert [type(k) for k in got[0]] == [str, str, str] and isinstance(got[0]["v"], bytes)


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (1, 3), (2, 2), (3, 1)])
def test_entry_n_goes_to_rank_n_mod_world_in_order(server: RedisServer, stream: str, world: int, workers: int) -> None:
    fill(server, stream, range(23))
    for rank in range(world):
        assert [v(s) for s in make(server, stream, rank=rank, world=world, workers=workers)] == list(
            range(rank, 23, world)
        )


def test_follow_false_epoch_is_what_was_there_and_every_epoch_rereads(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(5))
    loader = make(server, stream, workers=2)
    it = iter(loader)
    first = [v(next(it)) for _ in range(2)]
    fill(server, stream, range(5, 8))  # after the epoch started: the next epoch's
    assert first + [v(s) for s in it] == list(range(5))
    assert [v(s) for s in loader] == list(range(8))


def test_empty_or_missing_stream_is_an_empty_epoch(server: RedisServer, stream: str) -> None:
    assert list(make(server, stream, workers=2)) == []


# -- resume ---------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (1, 2), (2, 0), (2, 2)])
def test_resume_at_every_step_follow_false(server: RedisServer, stream: str, world: int, workers: int) -> None:
    fill(server, stream, range(11))
    for rank in range(world):
        assert check_resume(lambda: make(server, stream, rank=rank, world=world, workers=workers), 2) > 10


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_step_follow_true_with_a_producer_thread(
    server: RedisServer, stream: str, workers: int
) -> None:
    n = 14
    fill(server, stream, range(3))

    def produce() -> None:
        for i in range(3, n):
            time.sleep(0.01)
            fill(server, stream, range(i, i + 1))

    producer = threading.Thread(target=produce)
    producer.start()
    reference = take(make(server, stream, workers=workers, follow=True), n)
    producer.join()
    assert reference == list(range(n))
    for k in range(0, n + 1, 2):
        loader = make(server, stream, workers=workers, follow=True)
        before = take(loader, k)
        state = roundtrip(loader.save_state_rank())
        resumed = make(server, stream, workers=workers, follow=True)
        resumed.restore_state_rank(state)
        assert before + take(resumed, n - k) == reference, k


def _produce_in_process(url: str, stream: str, start: int, stop: int) -> None:
    import redis

    client = redis.Redis.from_url(url)
    for i in range(start, stop):
        client.xadd(stream, {"v": str(i).encode()})
        time.sleep(0.002)


def test_two_ranks_follow_a_producer_process_and_resume(server: RedisServer, stream: str) -> None:
    import multiprocessing

    producer = multiprocessing.get_context("spawn").Process(
        target=_produce_in_process, args=(server.url, stream, 0, 40), daemon=True
    )
    producer.start()
    try:
        got = {}
        for rank in range(2):
            loader = make(server, stream, rank=rank, world=2, workers=2, follow=True, timeout=30)
            part = take(loader, 7)
            state = roundtrip(loader.save_state_rank())
            resumed = make(server, stream, rank=rank, world=2, workers=1, follow=True, timeout=30)
            resumed.restore_state_rank(state)  # another num_workers too
            got[rank] = part + take(resumed, 13)
    finally:
        producer.join(60)
    assert got == {0: list(range(0, 40, 2)), 1: list(range(1, 40, 2))}


@pytest.mark.parametrize(("saved", "restored"), [(2, 0), (2, 3), (3, 2), (0, 2)])
def test_another_num_workers_continues_exactly(server: RedisServer, stream: str, saved: int, restored: int) -> None:
    fill(server, stream, range(13))
    reference = [v(s) for s in make(server, stream, workers=saved)]
    for k in range(0, 14, 3):
        loader = make(server, stream, workers=saved)
        before = take(loader, k)
        state = roundtrip(loader.save_state_rank())
        resumed = make(server, stream, workers=restored)
        resumed.restore_state_rank(state)
        after = [v(s) for s in resumed]
        assert sorted(before + after) == list(range(13)), k  # every entry exactly once
        if restored == 0 or restored >= saved:  # (3 logical workers on 2 interleave otherwise)
            assert before + after == reference, k
        assert [v(s) for s in resumed] == list(range(13))  # the next epoch: the new num_workers' own


# -- another world size -----------------------------------------------------------------


def _save_ranks(
    server: RedisServer, stream: str, counts: list[int], workers: int, **kw: Any
) -> tuple[list[RankState], list[int]]:
    states, consumed = [], []
    for rank, k in enumerate(counts):
        loader = make(server, stream, rank=rank, world=len(counts), workers=workers, **kw)
        consumed += take(loader, k)
        states.append(roundtrip(loader.save_state_rank()))
    return states, consumed


@pytest.mark.parametrize(
    ("old", "new", "workers", "new_workers"), [(2, 1, 2, 0), (2, 3, 2, 2), (1, 2, 0, 2), (3, 2, 1, 3)]
)
def test_another_world_size_reads_every_entry_exactly_once(
    server: RedisServer, stream: str, old: int, new: int, workers: int, new_workers: int
) -> None:
    fill(server, stream, range(41))
    for counts in ([0] * old, [3, 1, 5][:old], [4, 0, 2][:old], [13, 12, 13][:old]):
        states, before = _save_ranks(server, stream, counts, workers)
        left = sorted(set(range(41)) - set(before))
        parts = []
        for rank in range(new):
            loader = make(server, stream, rank=rank, world=new, workers=new_workers)
            loader.restore_state_global(states)
            parts.append([v(s) for s in loader])
            # the next epoch is an ordinary epoch of the new world size
            assert [v(s) for s in loader] == list(range(rank, 41, new))
        assert sorted(before + [x for part in parts for x in part]) == list(range(41)), counts
        for rank, part in enumerate(parts):  # the rest in stream order, entry n of it to rank n % new
            assert part == left[rank::new], (counts, rank)


def test_another_world_size_twice_and_with_map_and_filter(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(60))

    def wrap(ds: Any, wc: sl.WorkerConfig) -> Any:
        return MapDataset(FilterDataset(ds, lambda s: v(s) % 5 != 0), lambda s: s)

    kept = [i for i in range(60) if i % 5]
    states, before = _save_ranks(server, stream, [4, 7], 2, wrap=wrap)
    # 3 ranks take a few each, then 2 ranks finish
    middle, mids = [], []
    for rank in range(3):
        loader = make(server, stream, rank=rank, world=3, workers=1, wrap=wrap)
        loader.restore_state_global(states)
        mids += take(loader, 2 + rank)
        middle.append(roundtrip(loader.save_state_rank()))
    rest = []
    for rank in range(2):
        loader = make(server, stream, rank=rank, world=2, workers=0, wrap=wrap)
        loader.restore_state_global(middle)
        rest += [v(s) for s in loader]
    assert sorted(before + mids + rest) == kept


@pytest.mark.parametrize(("old", "new", "workers", "new_workers"), [(2, 1, 2, 0), (2, 3, 0, 2), (3, 2, 1, 1)])
def test_another_world_size_with_batches_reads_every_entry_exactly_once(
    server: RedisServer, stream: str, old: int, new: int, workers: int, new_workers: int
) -> None:
    """The usual pipeline, a stream cut into batches: entries a rank had read into an
    unfinished batch were not consumed and go back to the pool; every entry exactly once
    over the batches before and after, and the next epoch is the new world size's own."""
    fill(server, stream, range(41))

    def batched(ds: Any, wc: sl.WorkerConfig) -> Any:
        return BatchDataset(ds, 3, collate_fn=lambda b: [v(s) for s in b])

    for counts in ([1, 2, 0][:old], [2, 0, 3][:old]):
        states, before = [], []
        for rank, k in enumerate(counts):
            loader = make(server, stream, rank=rank, world=old, workers=workers, wrap=batched)
            it = iter(loader)
            before += [x for batch in itertools.islice(it, k) for x in batch]
            states.append(roundtrip(loader.save_state_rank()))
            del it
        after = []
        for rank in range(new):
            loader = make(server, stream, rank=rank, world=new, workers=new_workers, wrap=batched)
            loader.restore_state_global(states)
            batches = list(loader)
            assert all(len(b) <= 3 for b in batches)
            after += [x for b in batches for x in b]
            assert sorted(x for b in loader for x in b) == list(range(rank, 41, new))  # the next epoch
        assert sorted(before + after) == list(range(41)), counts


def test_another_world_size_refused_with_the_reason(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(10))

    def limited(ds: Any, wc: sl.WorkerConfig) -> Any:
        return LimitDataset(ds, 4)

    states, _ = _save_ranks(server, stream, [1, 1], 0, wrap=limited)
    loader = make(server, stream, rank=0, world=1, wrap=limited)
    with pytest.raises(ConfigMismatchError, match="LimitDataset holds what it has read per rank"):
        loader.restore_state_global(states)
    # one rank's state alone on another world size: says to pass all of them
    plain, _ = _save_ranks(server, stream, [1, 1], 0)
    with pytest.raises(ConfigMismatchError, match="restore_state_global"):
        make(server, stream, rank=0, world=1).restore_state_rank(plain[0])


def test_another_world_size_after_a_rank_ended_its_epoch(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(9))
    a = make(server, stream, rank=0, world=2, workers=2)
    b = make(server, stream, rank=1, world=2, workers=2)
    got = [v(s) for s in a] + take(b, 1)  # rank 0 finished, rank 1 took one
    states = [roundtrip(a.save_state_rank()), roundtrip(b.save_state_rank())]
    loader = make(server, stream, rank=0, world=1, workers=0)
    loader.restore_state_global(states)
    assert sorted(got + [v(s) for s in loader]) == list(range(9))


def test_another_world_size_refuses_a_rank_that_read_into_the_next_epoch(server: RedisServer, stream: str) -> None:
    """Rank 0 finished epoch 0 and consumed 2 entries of epoch 1 while rank 1 was still in
    epoch 0: what rank 0 took of epoch 1 would be dealt out again there (doubled), so the
    resize is refused by name; a rank one epoch ahead that consumed nothing of it is fine
    (the test above)."""
    fill(server, stream, range(9))
    a = make(server, stream, rank=0, world=2, workers=0)
    b = make(server, stream, rank=1, world=2, workers=0)
    assert sorted(v(s) for s in a) == [0, 2, 4, 6, 8]
    assert take(a, 2) == [0, 2]  # epoch 1
    assert take(b, 1) == [1]
    states = [roundtrip(a.save_state_rank()), roundtrip(b.save_state_rank())]
    assert [s.position.epoch for s in states] == [1, 0]
    loader = make(server, stream, rank=0, world=1, workers=0)
    with pytest.raises(StateError, match=r"rank 0's state is in epoch 1 and its logical workers \[0\] had consumed"):
        loader.restore_state_global(states)


def test_another_world_size_with_another_seed_formula_is_a_state_error(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(9))
    loaders = [make(server, stream, rank=r, world=2, workers=0) for r in (0, 1)]
    for loader in loaders:
        take(loader, 2)
    states = [roundtrip(loader.save_state_rank()) for loader in loaders]
    states[1] = msgspec.structs.replace(states[1], config=msgspec.structs.replace(states[1].config, seed_formula=2))
    with pytest.raises(StateError, match=r"config.seed_formula is 2, expected 3: .* unreleased version"):
        make(server, stream, rank=0, world=1, workers=0).restore_state_global(states)


# -- saves while waiting, timeouts, shutdown -----------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_save_while_waiting_returns_at_once_and_resumes_with_the_awaited_entry(
    server: RedisServer, stream: str, workers: int
) -> None:
    fill(server, stream, range(3))
    loader = make(server, stream, workers=workers, follow=True, timeout=30)
    got: list[int] = []
    it = iter(loader)

    def consume(items: Iterator[Any]) -> None:
        for s in items:
            got.append(v(s))
            if len(got) == 4:
                return

    thread = threading.Thread(target=consume, args=(it,))
    thread.start()
    deadline = time.monotonic() + 20
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the consumer now waits for entry 3
    t0 = time.monotonic()
    state = roundtrip(loader.save_state_rank())
    assert time.monotonic() - t0 < 0.5
    fill(server, stream, range(3, 5))
    thread.join(20)
    assert got == [0, 1, 2, 3]
    del it
    resumed = make(server, stream, workers=workers, follow=True, timeout=30)
    resumed.restore_state_rank(state)
    assert take(resumed, 2) == [3, 4]


@pytest.mark.parametrize("workers", [0, 2])
def test_timeout_names_rank_entry_and_seconds(server: RedisServer, stream: str, workers: int) -> None:
    fill(server, stream, range(2))
    loader = make(server, stream, workers=workers, follow=True, timeout=0.6)
    t0 = time.monotonic()
    got: list[int] = []
    with pytest.raises(StreamTimeoutError, match=r"rank 0 worker \d waited 0\.\d s .*timeout=0.6"):
        for s in loader:
            got.append(v(s))
    assert got == [0, 1] and time.monotonic() - t0 < 10


def test_closing_a_waiting_loader_is_quick(server: RedisServer, stream: str) -> None:
    loader = make(server, stream, workers=2, follow=True)
    fill(server, stream, range(1))
    it = iter(loader)
    assert v(next(it)) == 0
    t0 = time.monotonic()
    del it
    assert time.monotonic() - t0 < 3  # the waiting workers see torch's shutdown signal


# -- trim --------------------------------------------------------------------------------


def _snapshot_afters(states: list[RankState]) -> list[str]:
    out = []
    for state in states:
        for ws in state.position.workers:
            assert ws.dataset is not None
            out.append(ws.dataset.fields["after"])
    return out


def test_trim_removes_what_every_rank_consumed_and_restore_goes_on(server: RedisServer, stream: str) -> None:
    ids = fill(server, stream, range(30))
    states, before = _save_ranks(server, stream, [6, 4], 2)
    source = make(server, stream).dataset
    # a snapshot at every consumed entry: each worker's state holds its last consumed entry
    lasts = [before[:6][w::2][-1] for w in range(2)] + [before[6:][w::2][-1] for w in range(2)]
    assert sorted(ids.index(a) for a in _snapshot_afters(states)) == sorted(lasts)
    # every worker resumes after the entry its snapshot holds: the earliest of those stays
    keep = min(ids.index(a) for a in _snapshot_afters(states))
    assert source.trim(states) == keep and server.client().xlen(stream) == 30 - keep
    assert source.trim(states) == 0
    rest = []
    for rank in range(2):
        loader = make(server, stream, rank=rank, world=2, workers=2)
        loader.restore_state_rank(states[rank])
        rest += [v(s) for s in loader]
    assert sorted(before + rest) == list(range(30))


def test_trim_follows_the_snapshots_of_a_waiting_reader(server: RedisServer, stream: str) -> None:
    ids = fill(server, stream, range(1))

    def produce() -> None:
        for i in range(1, 12):
            time.sleep(0.03)
            ids.extend(fill(server, stream, range(i, i + 1)))

    producer = threading.Thread(target=produce)
    producer.start()
    loader = make(server, stream, workers=0, follow=True)
    got = take(loader, 9)
    producer.join()
    state = roundtrip(loader.save_state_rank())
    keep = ids.index(_snapshot_afters([state])[0])
    assert keep == 8  # a snapshot at every consumed entry: trim removes all the loop consumed but the last
    assert make(server, stream).dataset.trim([state]) == keep
    resumed = make(server, stream, follow=True)
    resumed.restore_state_rank(state)
    assert got + take(resumed, 3) == list(range(12))


def test_trim_keeps_everything_while_a_worker_consumed_nothing(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(10))
    states, _ = _save_ranks(server, stream, [1], 2)  # worker 1 took nothing yet
    assert make(server, stream).dataset.trim(states[0]) == 0
    assert server.client().xlen(stream) == 10


def test_restore_from_a_trimmed_state_is_a_named_error(server: RedisServer, stream: str) -> None:
    ids = fill(server, stream, range(20))
    old, _ = _save_ranks(server, stream, [2], 0)
    new, _ = _save_ranks(server, stream, [9], 0)
    assert make(server, stream).dataset.trim(new) == ids.index(_snapshot_afters(new)[0])
    server.client().xtrim(stream, minid=ids[10], approximate=False)  # a trim made with a newer state
    loader = make(server, stream)
    loader.restore_state_rank(old[0])
    needed, first = _snapshot_afters(old)[0], server.client().xrange(stream, count=1)[0][0].decode()
    with pytest.raises(StreamTrimmedError, match=rf"{stream}.*entry {needed} .*its first entry is {first}") as e:
        list(loader)
    assert (e.value.stream, e.value.needed, e.value.first) == (stream, needed, first)
    loader = make(server, stream, workers=2)  # in a worker process too
    loader.restore_state_rank(old[0])
    with pytest.raises(StreamTrimmedError):
        list(loader)


def test_trim_refuses_foreign_states(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(3))
    states, _ = _save_ranks(server, stream, [1], 0)
    with pytest.raises(LoaderUsageError, match="no RedisStreamSource of stream 'other'"):
        make(server, "other").dataset.trim(states)
    with pytest.raises(LoaderUsageError, match="save_state_global"):
        make(server, stream).dataset.trim("nope")


# -- failures -------------------------------------------------------------------------------


def test_server_down_is_a_storage_error_in_bounded_time(stream: str) -> None:
    require_redis()
    srv = RedisServer()
    try:
        fill(srv, stream, range(5))
        loader = make(srv, stream, workers=2, follow=True)
        it = iter(loader)
        assert [v(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
        srv.stop(kill=True)
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=rf"redis://127.0.0.1:{srv.port}/0 stream '{stream}'.*attempt"):
            next(it)
        assert time.monotonic() - t0 < 15
    finally:
        srv.stop()


@pytest.mark.parametrize("workers", [0, 2])
def test_server_restarted_within_the_retry_window_changes_nothing(stream: str, workers: int) -> None:
    require_redis()
    srv = RedisServer()
    patient = RetryPolicy(attempts=50, initial_delay=0.05, max_delay=0.2, timeout=2.0, deadline=20.0)
    try:
        fill(srv, stream, range(12))
        loader = make(srv, stream, workers=workers, follow=True, retry=patient)
        it = iter(loader)
        got = [v(next(it)) for _ in range(4)]
        # without persistence the restarted server is empty: the producer writes the same entries again
        client = srv.client()
        entries = [(i.decode(), f) for i, f in client.xrange(stream)]
        srv.stop(kill=True)

        def restart() -> None:
            time.sleep(1.0)
            srv.start()
            pipe = srv.client().pipeline()
            for entry_id, fields in entries:
                pipe.xadd(stream, fields, id=entry_id)
            pipe.execute()

        thread = threading.Thread(target=restart)
        thread.start()
        got += [v(next(it)) for _ in range(8)]
        thread.join()
        del it
        assert got == list(range(12))
    finally:
        srv.stop()


def test_password_url_and_a_wrong_password_fails_at_once_masked(stream: str) -> None:
    require_redis()
    with RedisServer(password="s3cret") as srv:
        fill(srv, stream, range(3))
        assert [v(s) for s in make(srv, stream, workers=2)] == [0, 1, 2]
        wrong = RedisStreamSource(
            f"redis://:hunter2@127.0.0.1:{srv.port}/0", stream, sl.WorkerConfig(0, 1, 0), follow=False, retry=FAST
        )
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="not retried") as e:
            list(wrong)
        assert time.monotonic() - t0 < 2
        assert "hunter2" not in str(e.value) and ":***@" in str(e.value)


def test_a_key_of_another_type_is_a_storage_error_not_retried(server: RedisServer, stream: str) -> None:
    server.client().set(stream, b"x")
    with pytest.raises(StorageError, match="WRONGTYPE.*not retried"):
        list(make(server, stream))


# -- arguments, restore keys, contexts -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "http://x"}, "url is 'http://x'; expected a str 'redis://"),
        ({"url": 5}, "url is 5"),
        ({"stream": ""}, "stream is ''; expected a non-empty str"),
        ({"follow": 1}, "follow is 1; expected True or False"),
        ({"timeout": 0}, "timeout is 0; expected None or a number of seconds > 0"),
        ({"timeout": True}, "timeout is True"),
        ({"retry": 3}, "retry is 3; expected None or a savable_loader.storage.RetryPolicy"),
        ({"batch": 0}, "batch is 0; expected an int in"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)
    args = {"url": "redis://127.0.0.1:1/0", "stream": "s", **kwargs}
    with pytest.raises(LoaderUsageError, match=match):
        RedisStreamSource(args.pop("url"), args.pop("stream"), wc, **args)


def test_a_user_not_allowed_scripts_reads_client_side(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(9))
    server.client().acl_setuser(
        "reader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@scripting"]
    )
    url = f"redis://reader:pw@127.0.0.1:{server.port}/0"
    assert [v(s) for s in make(server, stream, workers=2, url=url)] == list(range(9))
    assert check_resume(lambda: make(server, stream, workers=2, url=url), 1) > 8


def test_a_unix_socket_url(tmp_path: Any, stream: str) -> None:
    executable = require_redis()
    sock = tmp_path / "redis.sock"
    args = [executable, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        import redis

        redis.Redis(unix_socket_path=str(sock)).xadd(stream, {"v": b"7"})
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
        source = RedisStreamSource(f"unix://{sock}?db=0", stream, wc, follow=False, retry=FAST)
        assert [v(s) for s in sl.SavableDataLoader(source, batch_size=None, worker_config=wc)] == [7]
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("after", "nope", "after is 'nope', expected an entry id"),
        ("ordinal", -5, "ordinal is -5"),
        ("origin", ["0-0"], r"origin is \['0-0'\]"),
        ("stages", [{"world_size": 2}], r"stages\[0\]"),
        ("end", 3, "end is 3"),
    ],
)
def test_a_malformed_state_is_a_state_error(
    server: RedisServer, stream: str, field: str, value: Any, match: str
) -> None:
    fill(server, stream, range(4))
    loader = make(server, stream)
    take(loader, 2)
    state = loader.save_state_rank()
    node = state.position.workers[0].dataset
    assert node is not None
    node.fields[field] = value
    resumed = make(server, stream)
    resumed.restore_state_rank(roundtrip(state))
    with pytest.raises(StateError, match=match):
        list(resumed)


def test_mask_url() -> None:
    assert mask_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert mask_url("rediss://u:pw@h/2") == "rediss://u:***@h/2"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"


def test_restore_sample_reads_the_entry_again(server: RedisServer, stream: str) -> None:
    fill(server, stream, range(4))
    loader = make(server, stream, workers=2)
    items = list(loader)
    key = loader.restore_key
    assert key is not None and loader.restore_sample(key) == items[-1]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_make_their_own_client(server: RedisServer, stream: str, context: str) -> None:
    fill(server, stream, range(6))
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
    source = RedisStreamSource(server.url, stream, wc, follow=False, retry=FAST)
    source.client().ping()  # a client in the parent is not carried over
    loader = sl.SavableDataLoader(source, batch_size=None, worker_config=wc, multiprocessing_context=context)
    assert [v(s) for s in loader] == list(range(6))


def test_resplit_counts_a_worker_that_ended_its_epoch_as_having_consumed_all_of_its_share() -> None:
    from savable_loader.core.elastic import ALL_CONSUMED
    from savable_loader.sources._stream_stages import current_ordinal, resplit_state, stages_of

    # one rank, two workers: worker 0 ended its epoch, worker 1 consumed ordinals 1 and 3 (entry id "0-3")
    w1 = {"after": "0-3", "ordinal": 3, "end": "0-9", "origin": ["0-0", -1], "stages": []}
    new = resplit_state([[{ALL_CONSUMED: True}, w1]], 1, 2)
    assert new["origin"] == ["0-3", 3] and new["end"] == "0-9" and new["after"] == ""
    stages = stages_of(new["stages"])
    assert [current_ordinal(stages, n) for n in range(4, 10)] == [None, 0, None, 1, None, 2]


def test_the_packed_scan_gives_the_entries_as_xrange_does(server: RedisServer, stream: str) -> None:
    # the scan script packs each worker's entries into one string (_unpack_entries): binary
    # and empty values, non-ASCII and repeated field names, many fields, come out as XRANGE's
    client = server.client()
    bodies = [
        {"v": b"0", "x": b""},
        {"v": b"1", "d\xc3\xa9j\xc3\xa0": b"\xff" * 70000, "x": b"\x00"},
        {"v": b"2", **{f"f{k}": bytes([k]) * k for k in range(40)}},
        {"v": b"3"},
    ]
    ids = [client.xadd(stream, body).decode() for body in bodies]
    expected = [
        {**{k.decode(): val for k, val in fields.items()}, "__id__": i.decode()} for i, fields in client.xrange(stream)
    ]
    assert [e["__id__"] for e in expected] == ids
    got = list(make(server, stream, workers=2))
    assert sorted(got, key=lambda s: s["__id__"]) == expected


def test_a_packed_scan_reply_that_does_not_parse_is_a_data_error() -> None:
    from savable_loader.sources.redis_stream import _unpack_entries

    good = b"\x00\x00\x00\x02\x00\x00\x00\x031-0\x00\x00\x00\x01v\x00\x00\x00\x01a"
    assert _unpack_entries(good) == [("1-0", [(b"v", b"a")])]
    for bad in (good[:-1], good + b"\x00", good[:8], b"\x00\x00\x00\x01" + good[4:]):
        with pytest.raises(DataError, match="packed reply does not parse"):
            _unpack_entries(bad)


def test_a_server_without_luas_struct_library_gets_the_entries_unpacked(
    server: RedisServer, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import savable_loader.sources.redis_stream as module

    monkeypatch.setattr(module, "_SCAN", "local struct = nil\n" + module._SCAN)  # as such a server runs it
    fill(server, stream, range(11))
    assert sorted(v(s) for s in make(server, stream, workers=2)) == list(range(11))
    assert check_resume(lambda: make(server, stream, workers=2), 1) > 10
