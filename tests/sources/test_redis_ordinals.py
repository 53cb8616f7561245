"""RedisStreamSource numbers entries since the stream's creation: readers that start at
different moments agree on who reads what, whatever was trimmed from the head meanwhile.

Every test moves the stream's head at a fixed point (``XTRIM``, ``XADD ... MAXLEN``,
``trim``) between two readers' first reads, or before a restore, and compares the
entries read with what exactly-once requires. Without absolute ordinals (each reader
counting from the first entry it saw) the first three tests read entries twice and lose
others; their docstrings say which.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import pytest

import savable_loader as sl
from savable_loader.errors import StreamTrimmedError
from savable_loader.sources._stream_stages import ORIGIN
from savable_loader.sources.redis_stream import RedisStreamSource
from tests.redis_server import RedisServer
from tests.sources import test_redis_stream
from tests.sources.test_redis_stream import FAST, fill, make, roundtrip, take, v

pytestmark = pytest.mark.timeout(180)


# the same server and per-test stream fixtures as the main Redis test module
server = test_redis_stream.server
stream = test_redis_stream.stream


def _hold_worker_one(gate: str, worker_id: int) -> None:
    """worker_init_fn: worker 1 starts reading only once ``gate`` exists."""
    if worker_id != 1:
        return
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_worker_that_first_reads_after_the_head_moved_reads_its_own_entries(
    server: RedisServer, stream: str, tmp_path: Path
) -> None:
    """Worker 0 reads entries 0..9 and the loop consumes entry 0; a producer's MAXLEN then
    drops entry 0; worker 1 reads only after that. Counting from the first entry it saw,
    worker 1 would take entries 2, 4, 6, 8 (worker 0's: each twice) and nobody 1, 3, 5,
    7, 9."""
    fill(server, stream, range(10))
    gate = tmp_path / "go"
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
    source = RedisStreamSource(server.url, stream, wc, follow=False, retry=FAST)
    loader = sl.SavableDataLoader(
        source, batch_size=None, worker_config=wc, worker_init_fn=partial(_hold_worker_one, str(gate))
    )
    it = iter(loader)
    got = [v(next(it))]
    assert got == [0]
    server.client().xtrim(stream, maxlen=9, approximate=False)  # entry 0, consumed, goes
    gate.touch()
    got += [v(s) for s in it]
    assert got == list(range(10))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_that_first_reads_after_the_head_moved_reads_its_own_entries(
    server: RedisServer, stream: str, workers: int
) -> None:
    """Rank 0 consumes entry 0, then entry 0 is trimmed, then rank 1 first reads. Counting
    from the first entry it saw, rank 1 would take 2, 4, 6, 8 (rank 0's too) and lose
    1, 3, 5, 7, 9."""
    fill(server, stream, range(10))
    rank0 = make(server, stream, rank=0, world=2, workers=workers)
    it = iter(rank0)
    first = [v(next(it))]
    server.client().xtrim(stream, maxlen=9, approximate=False)
    got1 = [v(s) for s in make(server, stream, rank=1, world=2, workers=workers)]
    got0 = first + [v(s) for s in it]
    assert got0 == [0, 2, 4, 6, 8] and got1 == [1, 3, 5, 7, 9]


def test_a_state_that_had_read_nothing_restored_after_a_trim_with_newer_states(
    server: RedisServer, stream: str
) -> None:
    """Rank 1's old state had read nothing; a newer checkpoint's states (rank 1 consumed
    entry 1) trim entry 0; restoring the old states, rank 1 starts at the head (entry 1).
    Counting from there, rank 1 would take 2, 4, 6, ... (rank 0's) and lose 1, 3, 5, ..."""
    fill(server, stream, range(12))
    rank0, rank1 = make(server, stream, rank=0, world=2), make(server, stream, rank=1, world=2)
    before = take(rank0, 3)
    old = [roundtrip(rank0.save_state_rank()), roundtrip(rank1.save_state_rank())]
    assert take(rank1, 1) == [1]
    newer = [old[0], roundtrip(rank1.save_state_rank())]
    assert make(server, stream).dataset.trim(newer) == 1  # entry 0 (rank 1 keeps entry 1, its anchor)
    parts = []
    for rank in range(2):
        loader = make(server, stream, rank=rank, world=2)
        loader.restore_state_rank(old[rank])
        parts.append([v(s) for s in loader])
    assert parts == [[6, 8, 10], [1, 3, 5, 7, 9, 11]]
    assert sorted(before + parts[0] + parts[1]) == list(range(12))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_step_with_a_producer_whose_maxlen_trims_consumed_entries(
    server: RedisServer, workers: int
) -> None:
    """The producer adds one entry per consumed one with ``MAXLEN 10`` (exact): the head
    moves all along, behind every worker's last consumed entry. A save at every step and a
    restore read what the uninterrupted run reads."""
    n, start, maxlen = 24, 6, 10
    client = server.client()

    def run(stream: str, k: int | None) -> list[int]:
        fill(server, stream, range(start))
        made = start

        def produce() -> None:
            nonlocal made
            client.xadd(stream, {"v": str(made).encode()}, maxlen=maxlen, approximate=False)
            made += 1

        loader = make(server, stream, workers=workers, follow=True, timeout=30)
        got: list[int] = []
        it = iter(loader)
        for _ in range(n if k is None else k):
            got.append(v(next(it)))
            produce()
        if k is None:
            return got
        del it
        state = roundtrip(loader.save_state_rank())
        resumed = make(server, stream, workers=workers, follow=True, timeout=30)
        resumed.restore_state_rank(state)
        it = iter(resumed)
        for _ in range(n - k):
            got.append(v(next(it)))
            produce()
        del it
        return got

    reference = run(f"o-{os.urandom(5).hex()}", None)
    assert reference == list(range(n))
    for k in range(n + 1):
        name = f"o-{os.urandom(5).hex()}"
        try:
            assert run(name, k) == reference, k
        finally:
            client.delete(name)


def test_a_worker_that_began_and_consumed_nothing_refuses_a_head_past_its_entries(
    server: RedisServer, stream: str
) -> None:
    """A state records where a worker began its epoch (the absolute ordinal of the head it
    first read). If entries of its own from there on were removed before it consumed any,
    reading on would lose them: a StreamTrimmedError."""
    ids = fill(server, stream, range(8))
    loader = make(server, stream)
    take(loader, 1)
    state = loader.save_state_rank()
    node = state.position.workers[0].dataset
    assert node is not None and node.fields["origin"] == [ORIGIN, 0]
    node.fields.update(after="", ordinal=-1)  # as if it had consumed nothing
    server.client().xtrim(stream, minid=ids[3], approximate=False)
    resumed = make(server, stream)
    resumed.restore_state_rank(roundtrip(state))
    with pytest.raises(StreamTrimmedError, match="began its epoch at the entry numbered 0 .* now begins at number 3"):
        list(resumed)


@pytest.mark.parametrize("scripts", [True, False])
def test_xdel_in_the_middle_is_a_named_error(server: RedisServer, stream: str, scripts: bool) -> None:
    ids = fill(server, stream, range(10))
    url = server.url
    if not scripts:
        server.client().acl_setuser(
            "noscripts", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@scripting"]
        )
        url = f"redis://noscripts:pw@127.0.0.1:{server.port}/0"
    reader = make(server, stream, follow=True, batch=2, url=url)
    it = iter(reader)
    assert [v(next(it)) for _ in range(2)] == [0, 1]
    server.client().xdel(stream, ids[6])
    with pytest.raises(StreamTrimmedError, match=rf"{stream}.*entry {ids[6]} was deleted \(XDEL\) after {ids[1]}"):
        for _ in range(8):
            next(it)
    del it
    # a reader starting at the head sees the deletion inside the stream too
    with pytest.raises(StreamTrimmedError, match=rf"entry {ids[6]} was deleted \(XDEL\)"):
        list(make(server, stream, url=url))
    # deleting the first entries is a trim: the numbering holds
    server.client().xtrim(stream, minid=ids[7], approximate=False)
    server.client().xdel(stream, ids[7])
    assert [v(s) for s in make(server, stream, world=2, url=url)] == [8]


@pytest.mark.parametrize("new", [1, 3])
def test_another_world_size_after_ranks_began_at_different_heads(server: RedisServer, stream: str, new: int) -> None:
    """Rank 0 began at entry 0, rank 1 after entries 0 and 1 were trimmed (entry 1, rank
    1's, was read by nobody): on another world size the entries present that no rank consumed
    are split exactly once, in stream order."""
    ids = fill(server, stream, range(20))
    rank0 = make(server, stream, rank=0, world=2, workers=2)
    before = take(rank0, 3)
    server.client().xtrim(stream, minid=ids[2], approximate=False)  # rank 0 resumes after 2 and 4
    rank1 = make(server, stream, rank=1, world=2, workers=2)
    before += take(rank1, 2)
    assert before == [0, 2, 4, 5, 3]  # rank 1 worker 0 owns 1 (gone), 5, 9, ...; worker 1 owns 3, 7, ...
    states = [roundtrip(rank0.save_state_rank()), roundtrip(rank1.save_state_rank())]
    left = sorted(set(range(2, 20)) - set(before))
    parts = []
    for rank in range(new):
        loader = make(server, stream, rank=rank, world=new, workers=2)
        loader.restore_state_global(states)
        parts.append([v(s) for s in loader])
    assert parts == [left[r::new] for r in range(new)]


class _OldServer:
    """A client of a Redis 6.2 server: XINFO STREAM has no entries-added."""

    def pipeline(self, transaction: bool) -> _OldServer:
        return self

    def xinfo_stream(self, name: str) -> None:
        pass

    def xrange(self, name: str, min: str, max: str, count: int) -> None:
        pass

    def execute(self, raise_on_error: bool) -> list[object]:
        entry = (b"1-0", {b"v": b"0"})
        return [{"length": 1, "last-generated-id": b"1-0", "first-entry": entry, "last-entry": entry}, [entry]]

    def info(self, section: str) -> dict[str, str]:
        return {"redis_version": "6.2.14"}


def test_a_server_older_than_7_is_a_clear_error() -> None:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)
    source = RedisStreamSource("redis://127.0.0.1:1/0", "s", wc, follow=True, retry=FAST)
    source._client = (os.getpid(), _OldServer())
    with pytest.raises(sl.errors.LoaderUsageError, match=r"needs Redis >= 7.0 .*the server is Redis 6.2.14"):
        next(iter(source))


def test_a_state_of_the_first_numbering_is_refused(
    server: RedisServer, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """States saved before ordinals counted from the stream's creation (no "ordinals" in
    the source's configuration) would split the rest differently: refused."""
    from savable_loader.errors import ConfigMismatchError

    fill(server, stream, range(4))
    with monkeypatch.context() as m:
        m.setattr(RedisStreamSource, "config", lambda self: {"stream": self.stream, "follow": self.follow})
        loader = make(server, stream)
        take(loader, 1)
        old = roundtrip(loader.save_state_rank())
    with pytest.raises(ConfigMismatchError):
        make(server, stream).restore_state_rank(old)
