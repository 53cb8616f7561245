"""RedisStreamSource: the entries of a Redis stream that producers ``XADD`` to, exact across restarts.

**Who reads what.** An entry's *ordinal* is its number since the stream's creation
(0-based): how many entries were added before it. Every reader computes the same
ordinal for the same entry whenever it reads: a worker that starts at the stream's head
reads ``XINFO STREAM`` in one transaction with its first page, and the first entry's
ordinal is ``entries-added - length`` (Redis >= 7.0; entries are removed only from the
start: an ``XDEL`` after a reader's position is a :class:`StreamTrimmedError`, since it
would change the numbering). Entry ``n`` goes to data-parallel rank ``n % world_size``;
within a rank, the rank's ``j``-th entry (``j = n // world_size``) goes to logical
worker ``j % K`` of the ``K`` workers per rank. So worker ``w`` of rank ``r`` takes the
entries whose ordinal is ``r + world_size * w`` modulo ``world_size * K`` (its
*residue*), in order: each worker reads the stream in batches and keeps its own entries
(Redis has no index by ordinal). A worker starts its epoch at the stream's first entry
when it first reads: entries removed before that are read by no one (a producer's
``MAXLEN`` that overtakes the readers drops data), and the others exactly once.

**A sample** is a dict of the entry's fields (``str`` names, ``bytes`` values) plus
``"__id__"``, the entry id (``str``). Its restore key is the entry id, so
``restore_sample`` reads that one entry again.

**follow.** ``follow=True``: one endless epoch that waits for new entries with blocking
reads (``XREAD BLOCK`` in slices of at most a second, so that ``timeout`` and shutdown are
honoured; no busy polling). ``follow=False``: an epoch is the entries present when the
worker first reads in that epoch (the id of the stream's last entry then, recorded in the
state, so that a resume reads the same set); each epoch reads the stream from its first
entry again.

**The state** of a worker is the id and ordinal of the last entry it consumed, the
ordinal of the first entry it found (``origin``, once it has read) and the epoch's end
id for ``follow=False``, snapshotted at every entry the loop consumes: a restore reads from that id on (``XRANGE`` from
the id), at a cost that does not depend on how far the stream is. A state never grows
with the stream: a restore on another world size adds one *stage* (per old rank and
logical worker, the count of entries it consumed; see :func:`resplit_state`).

**trim.** :meth:`RedisStreamSource.trim` removes the prefix of the stream every saved
worker has consumed (``XTRIM MINID``), keeping the last consumed entry of the slowest one
as a marker: a restore checks that the entry it resumes after is still there, so a
restore from a state whose next entries were trimmed is a :class:`StreamTrimmedError`,
never a skip (the same check runs on every read, so a producer's ``MAXLEN`` that
overtakes a reader is caught too).

**Failures.** Every Redis call goes through a :class:`~savable_loader.storage.RetryPolicy`
(connection failures and timeouts are retried with backoff); when it gives up, a
:class:`~savable_loader.errors.StorageError` names the URL (password masked) and the
stream. ``redis`` (``pip install 'savable_loader[redis]'``) is imported only when a
worker first reads; each process makes its own client, so fork, spawn and forkserver
workers all work.
"""

from __future__ import annotations

import os
import re
import struct
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from savable_loader.config import WorkerConfig, request_snapshot
from savable_loader.core.shutdown import worker_done_event
from savable_loader.dataset.base import SavableDataset, type_name
from savable_loader.errors import (
    DataError,
    LoaderUsageError,
    RestoreKeyError,
    StateError,
    StorageError,
    StreamTimeoutError,
    StreamTrimmedError,
)
from savable_loader.sources._stream_stages import (
    ORIGIN,
    Stage,
    check_id,
    checked_fields,
    current_ordinal,
    parse_id,
    resplit_state,
)
from savable_loader.state.schema import DatasetState, PipelinePosition, RankState
from savable_loader.storage.retry import RetryPolicy, transient_reason

__all__ = ["RedisStreamSource", "StreamTrimmedError", "mask_url", "resplit_state"]

#: Longest single blocking read (``XREAD BLOCK``) in seconds: a timeout or a shutdown is
#: noticed within it.
BLOCK_SLICE = 0.5
#: The most entries one scan reads on the server (it blocks the server meanwhile).
_MAX_SCAN = 8192
#: The most decoded field names a reader keeps (a stream whose entries all have other
#: field names must not grow the cache without bound).
_MAX_NAMES = 4096
#: The most removed entries a reader that consumed nothing looks through for one of its own.
_MAX_GAP = 1 << 20
#: A server that runs no Lua scripts (disabled, or refused by an ACL): read client-side.
_NO_SCRIPTS = re.compile(r"unknown command|NOPERM|no permissions|NOSCRIPT|disabled|not allowed", re.IGNORECASE)
#: The scan: up to ARGV[3] entries after the cursor ARGV[1] (which must still be there)
#: up to ARGV[2]; returns {1, scanned, last id scanned, the stream's max-deleted-entry-id
#: ('' before Redis 7.0), then the entry at offset ARGV[5] and every ARGV[4]-th after it},
#: or {0} if the cursor entry is gone. The entries come packed in one string ('p', then
#: per entry: big-endian uint32 item count and id length, the id, and per field name and
#: value a uint32 length and the bytes: :func:`_unpack_entries`), which the client reads
#: about 5x faster than as nested replies; 'n' and the entries as XRANGE gives them on a
#: server whose Lua has no ``struct`` library.
_SCAN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
local r = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', tonumber(ARGV[3]) + 1)
if #r == 0 or r[1][1] ~= ARGV[1] then return {0} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local deleted = ''
for k = 1, #info, 2 do
  if info[k] == 'max-deleted-entry-id' then deleted = info[k + 1] end
end
local scanned = #r - 1
if scanned <= 0 then return {1, 0, '', deleted} end
local out = {1, scanned, r[#r][1], deleted}
local period = tonumber(ARGV[4])
local i = 2 + tonumber(ARGV[5])
if struct == nil then
  out[5] = 'n'
  while i <= #r do
    out[#out + 1] = r[i]
    i = i + period
  end
  return out
end
local parts, n = {}, 0
while i <= #r do
  local e = r[i]
  local f = e[2]
  parts[n + 1] = struct.pack('>I4I4', #f, #e[1])
  parts[n + 2] = e[1]
  n = n + 2
  for k = 1, #f do
    parts[n + 1] = struct.pack('>I4', #f[k])
    parts[n + 2] = f[k]
    n = n + 2
  end
  i = i + period
end
out[5] = 'p'
out[6] = table.concat(parts)
return out
"""
_SCHEMES = ("redis", "rediss", "unix")


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (as errors and configs show it).

    >>> mask_url("redis://:secret@db:6379/0"), mask_url("redis://user:pw@db/1")
    ('redis://:***@db:6379/0', 'redis://user:***@db/1')
    """
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _before(entry_id: str) -> str:
    """The greatest id below ``entry_id`` (a bound for ids compared with it)."""
    ms, seq = parse_id(entry_id)
    return f"{ms}-{seq - 1}" if seq else f"{max(ms - 1, 0)}-{2**64 - 1 if ms else 0}"


_PAIR = struct.Struct(">II").unpack_from
_LENGTH = struct.Struct(">I").unpack_from


def _unpack_entries(blob: bytes) -> list[tuple[str, list[tuple[bytes, bytes]]]]:
    """The entries the scan script packed into ``blob`` (see ``_SCAN``): ``(id, [(field
    name, value), ...])`` each. A blob that does not parse to its end is a
    :class:`DataError` (a server-side script of another version, say), never entries
    read from the wrong bytes."""
    out: list[tuple[str, list[tuple[bytes, bytes]]]] = []
    at, end = 0, len(blob)
    try:
        while at < end:
            items, length = _PAIR(blob, at)
            at += 8
            entry_id = blob[at : at + length].decode("ascii")
            at += length
            flat = []
            for _ in range(items):
                (length,) = _LENGTH(blob, at)
                at += 4
                flat.append(blob[at : at + length])
                at += length
            if at > end or items % 2:
                raise ValueError(f"entry {entry_id} runs past the reply or has an odd item count {items}")
            out.append((entry_id, list(zip(flat[::2], flat[1::2]))))
    except (struct.error, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise DataError(f"the stream scan's packed reply does not parse at byte {at} of {end}: {e}") from None
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


#: redis-py errors that are ConnectionErrors but will not pass on another attempt.
_FINAL = {"AuthenticationError", "AuthenticationWrongNumberOfArgsError", "AuthorizationError"}


def _transient(error: BaseException) -> str | None:
    if any(cls.__name__ in _FINAL for cls in type(error).__mro__):
        return None
    return transient_reason(error)


def _bad(field: str, found: Any, expected: str) -> LoaderUsageError:
    return LoaderUsageError(f"RedisStreamSource {field} is {found!r}; expected {expected}")


class RedisStreamSource(SavableDataset):
    """A savable source over the Redis stream ``stream`` at ``url``.

    ``url``: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS) or
    ``unix:///path/to/socket?db=0``. ``follow``: wait for new entries forever (True) or
    read the entries present at each epoch's start (False). ``timeout``: seconds a
    worker may wait for its next entry before a :class:`StreamTimeoutError` (None: no
    limit). ``retry``: the policy for connection failures. ``batch``: entries read per
    request.

    Example::

        wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
        source = RedisStreamSource("redis://localhost:6379/0", "rollouts", wc, follow=True)
        loader = SavableDataLoader(source, batch_size=None, worker_config=wc)
        for sample in loader:             # {"prompt": b"...", "__id__": "1712345678901-0"}
            ...
        state = loader.save_state_rank()  # in the checkpoint hook; once it is durable:
        source.trim([state])              # drop what every rank has consumed
    """

    #: A sample this source has read may be gone later (the producer drops what was read,
    #: a trim): a buffer above it saves its samples, not their keys (``wrappers._held``).
    samples_may_vanish: ClassVar[bool] = True

    #: This source can split what is left of an epoch over another world size
    #: (``restore_state_global`` on another number of ranks; see :func:`resplit_state`).
    resplits: ClassVar[bool] = True
    _savable_fields = ("after", "ordinal", "end", "origin", "stages")

    @staticmethod
    def resplit(
        fields: Sequence[Sequence[dict[str, Any] | None]], world_size: int, new_world_size: int
    ) -> dict[str, Any]:
        """:func:`resplit_state`: the state every new worker starts from on another world size."""
        return resplit_state(fields, world_size, new_world_size)

    def __init__(
        self,
        url: str,
        stream: str,
        worker_config: WorkerConfig,
        *,
        follow: bool = True,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        batch: int = 256,
    ) -> None:
        super().__init__(worker_config)
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in _SCHEMES:
            raise _bad("url", url, "a str 'redis://host:port/db', 'rediss://...' or 'unix:///path?db=0'")
        if not isinstance(stream, str) or not stream:
            raise _bad("stream", stream, "a non-empty str (the stream's key)")
        if not isinstance(follow, bool):
            raise _bad("follow", follow, "True or False")
        if timeout is not None and (
            not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0
        ):
            raise _bad("timeout", timeout, "None or a number of seconds > 0")
        if retry is None:
            retry = RetryPolicy()
        elif not isinstance(retry, RetryPolicy):
            raise _bad("retry", retry, "None or a savable_loader.storage.RetryPolicy")
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 100_000:
            raise _bad("batch", batch, "an int in [1, 100000]")
        self.url = url
        self.stream = stream
        self.follow = follow
        self.timeout = None if timeout is None else float(timeout)
        self.retry = retry
        self.batch = batch
        self._client: tuple[int, Any] | None = None
        self._script: tuple[Any, Any] | None = None
        self._scripting = True  # False once the server refused to run the scan script
        self._names: dict[Any, str] = {}  # field names as read, decoded (process-local)
        self.reset_state_own()

    # -- state ------------------------------------------------------------------------

    def reset_state_own(self) -> None:
        self.after = ""  # the id of the last entry consumed in the current stage ("": none)
        self.ordinal = -1  # its ordinal in the epoch
        self.end = ""  # follow=False: the epoch's last id ("": not read yet)
        self.origin = [ORIGIN, -1]  # where the current stage starts: [id, ordinal]
        self.stages: list[dict[str, Any]] = []  # the epoch's earlier stages (other world sizes)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # a client belongs to the process that made it
        state["_script"] = None
        state["_names"] = {}
        return state

    def config(self) -> dict[str, Any]:
        # not the URL: the same stream served from another address is the same data.
        # "ordinals": how the state numbers entries (2: since the stream's creation; the
        # unreleased first numbering, from each reader's first entry, restores nowhere)
        return {"stream": self.stream, "follow": self.follow, "ordinals": 2}

    @property
    def where(self) -> str:
        """The masked URL and the stream, as errors name them."""
        return f"{mask_url(self.url)} stream {self.stream!r}"

    # -- Redis ------------------------------------------------------------------------

    def client(self) -> Any:
        """This process's client (made on first use; a forked child makes its own)."""
        pid = os.getpid()
        if self._client is None or self._client[0] != pid:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:
                raise LoaderUsageError(
                    "RedisStreamSource needs the redis package: pip install 'savable_loader[redis]'"
                ) from None
            client = redis.Redis.from_url(
                self.url,
                socket_timeout=self.retry.timeout + BLOCK_SLICE,
                socket_connect_timeout=self.retry.timeout,
                retry=Retry(NoBackoff(), 0),  # our policy retries, not redis-py's
            )
            self._client = (pid, client)
        return self._client[1]

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return self.retry.call(lambda _timeout: fn(self.client()), url=self.where, transient=_transient)
        except StorageError as e:
            raise StorageError(f"{e.args[0]} (while {what})", self.where, None, e.attempts, e.cause) from e.__cause__

    def _info_and_range(self, what: str, start: str, last: str, count: int) -> tuple[dict[str, Any] | None, list[Any]]:
        """``XINFO STREAM`` and ``XRANGE start last COUNT count`` in one transaction (the
        two see the same stream); ``(None, [])`` if the stream does not exist."""

        def call(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=True)
            pipe.xinfo_stream(self.stream)
            pipe.xrange(self.stream, min=start, max=last, count=count)
            got: list[Any] = pipe.execute(raise_on_error=False)
            if isinstance(got[0], Exception) and "no such key" in str(got[0]).lower():
                return [None, []]
            for part in got:
                if isinstance(part, Exception):
                    raise part
            return got

        info, entries = self._call(what, call)
        if info is None:
            return None, []
        info = {_text(k): v for k, v in info.items()}
        if "entries-added" not in info or "max-deleted-entry-id" not in info:
            self._too_old()
        return info, [(_text(i), f) for i, f in entries]

    def _too_old(self) -> None:
        info = self._call("reading the server's version", lambda c: c.info("server"))
        raise LoaderUsageError(
            f"{self.where}: RedisStreamSource needs Redis >= 7.0 (XINFO STREAM entries-added and "
            f"max-deleted-entry-id number the entries), the server is Redis {info.get('redis_version', '?')}"
        )

    def _check_deleted(self, deleted: Any, after: str) -> None:
        """A :class:`StreamTrimmedError` if an entry after ``after`` was deleted (``XDEL``):
        the entries after it would be numbered differently by different readers."""
        deleted = _text(deleted)
        if not deleted:
            self._too_old()
        if parse_id(deleted) > parse_id(after):
            raise StreamTrimmedError(
                f"{self.where}: the entry {deleted} was deleted (XDEL) after {after}, inside the part of the stream "
                "still to be read; entries are dealt out to ranks and workers by their number since the stream's "
                "creation, which a deletion in the middle breaks (readers would disagree). Remove entries only "
                "from the stream's start (trim, XTRIM MINID/MAXLEN), or start a fresh stream",
                self.stream,
                deleted,
                after,
            )

    def _head(self, last: str) -> tuple[int, list[tuple[str, dict[bytes, bytes]]]] | None:
        """The absolute ordinal of the stream's first entry and the first page from it
        (up to ``last``); None if the stream is empty or does not exist."""
        info, entries = self._info_and_range("reading the stream's first entries", "-", last, self.batch)
        if info is None or not entries or int(info["length"]) == 0:
            return None
        first = _text(info["first-entry"][0]) if info.get("first-entry") else ""
        if first != entries[0][0]:  # not one view of the stream: a bug of the server or client
            raise StorageError(
                f"{self.where}: XINFO STREAM's first entry {first} and XRANGE's {entries[0][0]} differ within one "
                "transaction (MULTI/EXEC): the server does not give one view of the stream",
                self.where,
            )
        # removal only from the start (XTRIM, trim): the first entry's number is what was ever
        # added minus what is there; an XDEL after the first entry would break that
        self._check_deleted(info["max-deleted-entry-id"], _before(first))
        return int(info["entries-added"]) - int(info["length"]), entries

    def _read(self, cursor: str, last: str) -> list[tuple[str, dict[bytes, bytes]]]:
        """Up to ``batch`` entries after ``cursor`` (up to ``last``; "+" for no bound);
        a :class:`StreamTrimmedError` if ``cursor`` (a consumed entry) is gone or an entry
        after it was deleted."""
        info, entries = self._info_and_range(f"reading after {cursor}", cursor, last, self.batch + 1)
        if info is None or not entries or entries[0][0] != cursor:
            self._trimmed(cursor)
        self._check_deleted(info["max-deleted-entry-id"] if info else "", cursor)
        return entries[1:]

    def _trimmed(self, cursor: str, detail: str = "") -> None:
        first = self._call("looking up the first entry", lambda c: c.xrange(self.stream, count=1))
        head = first[0][0].decode() if first else ""
        raise StreamTrimmedError(
            f"{self.where}: the entry {cursor} this reader resumes after is no longer in the stream (its first "
            f"entry is {head or 'none: the stream is empty'}), so the entries after it may have been trimmed; "
            f"{detail}reading on could skip entries. Restore from a checkpoint taken after the trim (trim only "
            "with the states of the newest durable checkpoint), or start a fresh loader",
            self.stream,
            cursor,
            head,
        )

    def _wait(self, cursor: str, seconds: float) -> None:
        """Block up to ``seconds`` until an entry after ``cursor`` exists (XREAD BLOCK)."""
        ms = max(int(seconds * 1000), 1)
        self._call(
            f"waiting for entries after {cursor}",
            lambda c: c.xread({self.stream: cursor}, count=1, block=ms),
        )

    def _last_id(self) -> str:
        got = self._call("reading the last entry", lambda c: c.xrevrange(self.stream, count=1))
        return got[0][0].decode() if got else ORIGIN

    # -- reading ----------------------------------------------------------------------

    def _validated(self) -> tuple[list[Stage], str, int]:
        stages, origin = checked_fields(self.__dict__)
        if self.after:
            return stages, self.after, self.ordinal
        return stages, origin[0], origin[1]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stages, cursor, ordinal = self._validated()
        wc = self.worker_config
        period = wc.world_size * wc.workers_per_rank
        mine = wc.rank + wc.world_size * wc.rank_worker_id()
        if not self.follow and not self.end:
            self.end = self._last_id()
        last = "+" if self.follow else self.end
        waited_since = time.monotonic()
        while True:
            if not self.follow and parse_id(cursor) >= parse_id(self.end):
                return
            page, reached = self._page(cursor, ordinal, last, stages, period, mine)
            if reached is None:
                if not self.follow:
                    return
                waited = time.monotonic() - waited_since
                if self.timeout is not None and waited >= self.timeout:
                    raise StreamTimeoutError(
                        f"rank {wc.rank} worker {wc.rank_worker_id()} waited {waited:.1f} s for its next entry of "
                        f"{self.where} after {cursor} (timeout={self.timeout:g}); is the producer running?",
                        wc.rank,
                        cursor,
                        waited,
                    )
                done = worker_done_event()
                if done is not None and done.is_set():
                    return  # the loader shuts its workers down: nothing more is wanted
                left = BLOCK_SLICE if self.timeout is None else min(BLOCK_SLICE, self.timeout - waited)
                self._wait(cursor, max(left, 0.001))
                continue
            names = self._names
            for entry_id, fields, entry_ordinal in page:
                sample: dict[str, Any] = {}
                for k, v in fields:
                    name = names.get(k)
                    if name is None:  # field names repeat: decoded once per process
                        name = names[k] = _text(k)
                    sample[name] = v
                sample["__id__"] = entry_id
                self.mark_sample(entry_id)
                self.after, self.ordinal = entry_id, entry_ordinal
                # a snapshot at every entry, whatever it costs (the state is five small
                # fields): trim and a restore then start from the entry itself, never
                # from an older one whose next entries a trim may have removed
                request_snapshot(True)
                yield sample
            waited_since = time.monotonic()  # after the page's last entry was consumed
            if len(names) > _MAX_NAMES:
                names.clear()
            cursor, ordinal = reached

    def _page(
        self, cursor: str, ordinal: int, last: str, stages: list[Stage], period: int, mine: int
    ) -> tuple[list[tuple[str, list[tuple[Any, bytes]], int]], tuple[str, int] | None]:
        """This worker's entries of the next page after ``cursor`` (whose ordinal is
        ``ordinal``), as ``(id, [(field, value)], ordinal)``, and the id and ordinal of
        the last entry scanned (None: none after ``cursor`` yet). From :data:`ORIGIN`,
        the page starts at the stream's first entry, whose ordinal the server gives."""
        if cursor == ORIGIN:
            head = self._head(last)
            if head is None:
                return [], None
            start, entries = head
            self._check_start(ordinal, start, stages, period, mine)
            self.origin = [ORIGIN, start]
            ordinal = start - 1
        elif not stages and self._scripting:
            got = self._scan(cursor, ordinal, last, period, mine)
            if got is not None:
                return got
            entries = self._read(cursor, last)
        else:
            entries = self._read(cursor, last)
        if not entries:
            return [], None
        out = []
        for entry_id, fields in entries:
            ordinal += 1
            n = current_ordinal(stages, ordinal)
            if n is not None and n % period == mine:
                out.append((entry_id, list(fields.items()), ordinal))
        return out, (entries[-1][0], ordinal)

    def _check_start(self, known: int, start: int, stages: list[Stage], period: int, mine: int) -> None:
        """A worker that began its epoch at ordinal ``known`` (-1: it has not read yet)
        and consumed nothing finds the stream starting at ordinal ``start``: a
        :class:`StreamTrimmedError` if one of its entries in between was removed."""
        if known < 0 or start == known:
            return
        lost = start < known or start - known > _MAX_GAP  # a recreated stream; or too far to look
        n = known
        while not lost and n < start:
            k = current_ordinal(stages, n)
            lost = k is not None and k % period == mine
            n += 1
        if lost:
            self._trimmed(
                ORIGIN,
                f"this reader began its epoch at the entry numbered {known} since the stream's creation and had "
                f"consumed nothing; the stream now begins at number {start}; ",
            )

    def _scan(
        self, cursor: str, ordinal: int, last: str, period: int, mine: int
    ) -> tuple[list[tuple[str, list[tuple[Any, bytes]], int]], tuple[str, int] | None] | None:
        """:meth:`_page` after an entry ``cursor`` with the filtering done by the server (a
        Lua script), so that a worker receives only its own entries; None if the server
        runs no scripts."""
        first = (mine - ordinal - 1) % period  # offset of this worker's first entry after the cursor
        count = min(self.batch * period, _MAX_SCAN)

        def call(client: Any) -> Any:
            script = self._script
            if script is None or script[0] is not client:
                script = self._script = (client, client.register_script(_SCAN))
            try:
                return script[1](keys=[self.stream], args=[cursor, last, count, period, first])
            except Exception as e:
                if type(e).__name__ in ("ResponseError", "NoPermissionError") and _NO_SCRIPTS.search(str(e)):
                    return None
                raise

        got = self._call(f"reading after {cursor}", call)
        if got is None:
            self._scripting = False
            return None
        if not got[0]:
            self._trimmed(cursor)
        self._check_deleted(got[3], cursor)
        scanned = int(got[1])
        if not scanned:
            return [], None
        if _text(got[4]) == "p":
            entries = _unpack_entries(got[5])
        else:  # a server without Lua's struct library: the entries as XRANGE gives them
            entries = [(_text(entry_id), list(zip(flat[::2], flat[1::2]))) for entry_id, flat in got[5:]]
        out = [(entry_id, fields, ordinal + 1 + first + k * period) for k, (entry_id, fields) in enumerate(entries)]
        return out, (_text(got[2]), ordinal + scanned)

    # -- restore keys -----------------------------------------------------------------

    def restore_sample(self, key: Any) -> dict[str, Any]:
        """The sample of entry ``key`` (an entry id), read again."""
        if not isinstance(key, str):
            raise RestoreKeyError(f"RedisStreamSource key must be an entry id str, got {key!r}")
        try:
            parse_id(key)
        except ValueError:
            raise RestoreKeyError(f"RedisStreamSource key {key!r} is not an entry id '<ms>-<seq>'") from None
        got = self._call(f"reading entry {key}", lambda c: c.xrange(self.stream, min=key, max=key))
        if not got:
            raise RestoreKeyError(f"{self.where}: entry {key} is not in the stream (trimmed or deleted)")
        self.mark_sample(key)
        sample: dict[str, Any] = {k.decode("utf-8", "surrogateescape"): v for k, v in got[0][1].items()}
        sample["__id__"] = key
        return sample

    def restore_sample_blocker(self) -> str | None:
        return None

    # -- trim -------------------------------------------------------------------------

    def trim(self, states: Any) -> int:
        """Remove the entries every state's workers have consumed; return how many went.

        ``states``: the list ``save_state_global`` returns, or one rank's ``RankState``
        (a one-rank job). Take them from a checkpoint that is durable (written and
        synced): a restore from an older state after the trim raises
        :class:`StreamTrimmedError`. The last entry the slowest worker consumed stays (a
        restore checks it is there); a worker that consumed nothing in its epoch keeps
        the whole stream. With ``follow=False`` the trimmed entries are gone from later
        epochs too.

        Example::

            states = loader.save_state_global(0)
            if rank == 0:
                write_durably(states)
                source.trim(states)
        """
        ids = self._anchors(states)
        if not ids or ORIGIN in ids:
            return 0
        keep = min(ids, key=parse_id)
        return int(self._call(f"trimming before {keep}", lambda c: c.xtrim(self.stream, minid=keep, approximate=False)))

    def _anchors(self, states: Any) -> list[str]:
        """Per saved worker (not ended) of this stream: the id its restore reads after."""
        if isinstance(states, RankState):
            states = [states]
        if not isinstance(states, (list, tuple)) or not all(isinstance(s, RankState) for s in states):
            raise LoaderUsageError(
                f"RedisStreamSource.trim needs the list save_state_global returns or one RankState, got {states!r:.200}"
            )
        ids: list[str] = []
        for i, s in enumerate(states):
            if not isinstance(s.position, PipelinePosition):
                raise LoaderUsageError(f"RedisStreamSource.trim: states[{i}] is a drop-in state, not a pipeline's")
            paths = list(self._paths(s.config.dataset_config, []))
            if not paths:
                raise LoaderUsageError(
                    f"RedisStreamSource.trim: states[{i}] has no RedisStreamSource of stream {self.stream!r} "
                    "(a state of another pipeline?)"
                )
            for ws in s.position.workers:
                if ws.exhausted:
                    continue  # it needs nothing more of this epoch
                for path in paths:
                    node = ws.dataset if ws.dataset is not None else ws.carried
                    for step in path:
                        node = None if node is None or step >= len(node.children) else node.children[step]
                    ids.append(self._anchor_of(node))
        return ids

    def _paths(self, config: Any, path: list[int]) -> Iterator[list[int]]:
        """Paths (child indices) to this stream's sources in a saved configuration tree."""
        if not isinstance(config, dict):
            return
        if config.get("type") == type_name(self) and config.get("stream") == self.stream:
            yield path
        for i, child in enumerate(config.get("children", ())):
            yield from self._paths(child, [*path, i])

    def _anchor_of(self, node: DatasetState | None) -> str:
        if node is None:
            return ORIGIN  # at the start of its epoch: it needs every entry
        if node.type != type_name(self):
            raise StateError(f"RedisStreamSource.trim: the state has {node.type} where the source is")
        after, origin = node.fields.get("after"), node.fields.get("origin")
        if after:
            return check_id(after, "after")
        if not isinstance(origin, (list, tuple)) or len(origin) != 2:
            raise StateError(f"RedisStreamSource state origin is {origin!r}, expected [entry id, ordinal]")
        return check_id(origin[0], "origin")
