"""One retry policy for every remote call: backoff with jitter, a timeout per attempt, a
deadline per request, and a :class:`~savable_loader.errors.StorageError` at the end.

What is retried (``transient_reason`` says why, ``None`` means "not retried"):

* connection failures: resets, refusals, aborts, broken pipes, closed connections,
  unreachable hosts (``ConnectionError`` and the ``OSError`` numbers behind them);
* timeouts (``TimeoutError``, fsspec's ``FSTimeoutError``, the clients' own timeout
  errors);
* HTTP 5xx, 429 (too many requests) and 408 (request timeout), found on the exception
  or any exception in its ``__cause__`` / ``__context__`` chain, whatever the client
  (aiohttp ``.status``, requests / httpx / Azure ``.status_code`` or
  ``.response.status_code``, botocore ``.response["ResponseMetadata"]``, gcsfs and
  urllib ``.code``), and the S3 error codes that mean the same (``SlowDown``,
  ``InternalError``, ...);
* short reads: a body that ends before its length (:class:`ShortRead`, aiohttp's
  ``ClientPayloadError``, ``IncompleteRead``).

Everything else fails at once: a missing file, a refused permission, another 4xx, a
server that ignores ``Range``, a size or checksum that differs from the metadata.
Clients are recognised by the names of their exception classes, so none is imported.

The wait before attempt ``k + 1`` is ``min(max_delay, initial_delay * multiplier**(k-1))``
times a random factor in ``[1 - jitter, 1]``, drawn from a generator private to the
process: the global RNGs, which the loader re-seeds for every sample, are never drawn
from. Attempts stop after ``attempts``, or when the next one would start after
``deadline`` seconds; each attempt is given ``min(timeout, seconds left)``, so a request
fails within about ``deadline`` seconds, never hangs.

Example::

    policy = RetryPolicy(attempts=5, deadline=20.0)
    data = policy.call(lambda timeout: fetch(url, timeout=timeout), url=url)
"""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from savable_loader.errors import LoaderUsageError, SavableLoaderError, StorageError

__all__ = ["RetryPolicy", "ShortRead", "transient_reason"]

T = TypeVar("T")


class ShortRead(Exception):
    """A read returned fewer bytes than asked for (retried like a dropped connection).

    Example::

        if len(data) < end - start:
            raise ShortRead(f"got {len(data)} of {end - start} bytes")
    """


_CONNECTION_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.ENETRESET,
    errno.EHOSTDOWN,
}
# Exception class names (anywhere in the class's MRO) of the clients fsspec uses, and of
# redis: recognised without importing them.
_TRANSIENT_NAMES = {
    # aiohttp (http, s3fs, gcsfs, adlfs)
    "ClientPayloadError": "short read",
    "ServerDisconnectedError": "connection closed",
    "ClientConnectionError": "connection failed",
    "ServerTimeoutError": "timeout",
    # botocore / aiobotocore (s3fs)
    "ReadTimeoutError": "timeout",
    "ConnectTimeoutError": "timeout",
    "EndpointConnectionError": "connection failed",
    "ConnectionClosedError": "connection closed",
    "IncompleteReadError": "short read",
    "ResponseStreamingError": "short read",
    # urllib3 / requests / http.client (huggingface_hub, webhdfs)
    "ProtocolError": "connection closed",
    "ChunkedEncodingError": "short read",
    "IncompleteRead": "short read",
    "Timeout": "timeout",
    # fsspec, redis, the standard library's own
    "FSTimeoutError": "timeout",
    "ConnectionError": "connection failed",
    "TimeoutError": "timeout",
}
_S3_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "TooManyRequestsException",
}


def _http_status(e: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):  # in this order: aiohttp deprecates .code
        value = getattr(e, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    else:
        value = getattr(response, "status_code", None) or getattr(response, "status", None)
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
        return value
    return None


def _verdict(e: BaseException) -> tuple[bool, str] | None:
    """``(transient, reason)`` if ``e`` alone decides, None to look further down the chain."""
    if isinstance(e, SavableLoaderError):  # already named: a StorageError, an IntegrityError...
        return False, ""
    if isinstance(e, ShortRead):
        return True, "short read"
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code in _S3_CODES:
            return True, f"S3 {code}"
    status = _http_status(e)
    if status is not None and status >= 400:
        if status >= 500 or status in (408, 429):
            return True, f"HTTP {status}"
        return False, ""
    if isinstance(e, OSError) and e.errno in _CONNECTION_ERRNOS:
        return True, errno.errorcode.get(e.errno, "connection failed")
    for cls in type(e).__mro__:
        reason = _TRANSIENT_NAMES.get(cls.__name__)
        if reason is not None:
            return True, reason
    return None


def transient_reason(error: BaseException) -> str | None:
    """Why ``error`` is worth another attempt (``"HTTP 503"``, ``"timeout"``,
    ``"ECONNRESET"``, ``"short read"``...), or None if it is not.

    The exception and its ``__cause__`` / ``__context__`` chain are looked at in turn;
    the first that decides wins (s3fs raises an ``OSError`` caused by botocore's error,
    which carries the HTTP status).

    Example::

        transient_reason(ConnectionResetError(104, "Connection reset by peer"))   # 'ECONNRESET'
        transient_reason(FileNotFoundError("s3://bucket/x"))                       # None
    """
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        verdict = _verdict(e)
        if verdict is not None:
            return verdict[1] if verdict[0] else None
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    return None


_JITTER: tuple[int, random.Random] | None = None


def _jitter_rng() -> random.Random:
    """A generator private to this process (seeded from the OS, again after a fork), so
    that workers do not retry in step and the global ``random`` is never drawn from."""
    global _JITTER
    if _JITTER is None or _JITTER[0] != os.getpid():
        _JITTER = (os.getpid(), random.Random(os.urandom(16)))
    return _JITTER[1]


def describe(url: str, byte_range: tuple[int, int] | None) -> str:
    """``url`` and, if there is one, its byte range as errors print them."""
    return url if byte_range is None else f"{url} bytes [{byte_range[0]}, {byte_range[1]})"


def _cause(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= 500 else text[:497] + "..."


@dataclass(frozen=True)
class RetryPolicy:
    """How remote calls are retried: ``attempts`` at most, backoff from ``initial_delay``
    growing by ``multiplier`` up to ``max_delay`` (times a random factor in
    ``[1 - jitter, 1]``), ``timeout`` seconds per attempt and ``deadline`` seconds per
    request, retries included. The defaults give up on a persistent fault within about a
    minute. See the module docstring for what is retried.

    Plain data: it pickles, and it is never part of a loader state.

    Example::

        fast = RetryPolicy(attempts=3, initial_delay=0.05, deadline=5.0)
        storage = Storage("s3://bucket/train", retry=fast)
    """

    attempts: int = 8
    initial_delay: float = 0.25
    max_delay: float = 8.0
    multiplier: float = 2.0
    jitter: float = 0.5
    timeout: float = 30.0
    deadline: float = 60.0

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> LoaderUsageError:
            return LoaderUsageError(f"RetryPolicy {field} is {getattr(self, field)!r}; expected {expected}")

        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise bad("attempts", "an int >= 1")
        for field in ("initial_delay", "max_delay", "timeout", "deadline"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise bad(field, "a number of seconds >= 0")
        if self.timeout <= 0 or self.deadline <= 0:
            raise bad("timeout" if self.timeout <= 0 else "deadline", "a number of seconds > 0")
        if not isinstance(self.multiplier, (int, float)) or not self.multiplier >= 1:
            raise bad("multiplier", "a number >= 1")
        if not isinstance(self.jitter, (int, float)) or not 0 <= self.jitter <= 1:
            raise bad("jitter", "a number in [0, 1]")

    def delays(self) -> Iterator[float]:
        """The waits before attempts 2, 3, ... without jitter (their upper bounds).

        Example::

            list(RetryPolicy(attempts=4).delays())   # [0.25, 0.5, 1.0]
        """
        for k in range(self.attempts - 1):
            yield min(self.max_delay, self.initial_delay * self.multiplier**k)

    def call(
        self,
        fn: Callable[[float], T],
        *,
        url: str,
        byte_range: tuple[int, int] | None = None,
        transient: Callable[[BaseException], str | None] = transient_reason,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> T:
        """``fn(timeout)`` until it returns, retried on transient failures; a
        :class:`StorageError` naming ``url``, ``byte_range``, the attempts and the last
        cause when they run out or a failure is not transient. ``fn`` must give up after
        ``timeout`` seconds (raising ``TimeoutError``). Our own errors raised by ``fn``
        (a server ignoring ``Range``, a checksum) pass through, not retried.

        Example::

            policy.call(lambda t: redis_client.xread(streams, block=int(t * 1000)), url="redis://host/stream")
        """
        start = time.monotonic()
        delays = self.delays()
        attempt = 0
        while True:
            attempt += 1
            left = self.deadline - (time.monotonic() - start)
            try:
                return fn(max(min(self.timeout, left), 0.001))
            except SavableLoaderError:
                raise
            except Exception as e:
                reason = transient(e)
                elapsed = time.monotonic() - start
                where = describe(url, byte_range)
                if reason is None:
                    raise StorageError(
                        f"{where}: {_cause(e)} (not retried: not a transient failure)",
                        url,
                        byte_range,
                        attempt,
                        _cause(e),
                    ) from e
                delay = next(delays, None)
                if delay is not None:
                    delay *= 1 - self.jitter * _jitter_rng().random()
                if delay is None or elapsed + delay >= self.deadline:
                    why = "attempts" if delay is None else "deadline"
                    raise StorageError(
                        f"{where}: {attempt} attempt{'s' * (attempt > 1)} in {elapsed:.1f} s failed, the last with "
                        f"{reason} ({_cause(e)}); the retry policy's {why} ran out "
                        f"(attempts={self.attempts}, deadline={self.deadline:g} s)",
                        url,
                        byte_range,
                        attempt,
                        f"{reason} ({_cause(e)})",
                    ) from e
                sleep(delay)
