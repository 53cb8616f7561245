"""savable_loader.storage.retry: what is transient (every client's way of saying 5xx, 429,
a reset, a timeout, a short read), backoff with jitter from a private generator, the
attempts and the deadline, and the StorageError at the end."""

from __future__ import annotations

import errno
import multiprocessing
import pickle
import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from savable_loader.errors import IntegrityError, LoaderUsageError, RangeIgnoredError, StorageError
from savable_loader.storage import RetryPolicy, ShortRead, transient_reason
from savable_loader.storage import retry as retry_module

pytestmark = pytest.mark.timeout(60)


class Status(Exception):
    """aiohttp's ClientResponseError shape: ``.status``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


class Response:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class RequestsHTTPError(Exception):
    """requests / huggingface_hub shape: ``.response.status_code``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"{status} error")
        self.response = Response(status)


class ClientError(Exception):
    """botocore shape: ``.response`` dict."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


class HttpError(Exception):
    """gcsfs shape: ``.code``."""

    def __init__(self, code: int) -> None:
        super().__init__(f"{code}")
        self.code = code


class ClientPayloadError(Exception):  # aiohttp's name, not its class
    pass


class RedisError(Exception):
    pass


class ConnectionError(RedisError):
    pass


def caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "ECONNRESET"),
        (OSError(errno.ECONNREFUSED, "refused"), "ECONNREFUSED"),
        (BrokenPipeError(errno.EPIPE, "broken pipe"), "EPIPE"),
        (TimeoutError("timed out"), "timeout"),
        (ShortRead("got 3 of 10 bytes"), "short read"),
        (Status(503), "HTTP 503"),
        (Status(500), "HTTP 500"),
        (Status(429), "HTTP 429"),
        (Status(408), "HTTP 408"),
        (RequestsHTTPError(502), "HTTP 502"),
        (HttpError(504), "HTTP 504"),
        (ClientError("SlowDown", 503), "S3 SlowDown"),
        (ClientError("InternalError", 500), "S3 InternalError"),
        (caused(OSError(errno.EIO, "Please reduce your request rate."), ClientError("Weird", 503)), "HTTP 503"),
        (caused(RuntimeError("wrapped"), ConnectionResetError()), "connection failed"),
        (ClientPayloadError("Response payload is not completed"), "short read"),
        (ConnectionError("Error 111 connecting to localhost:6379"), "connection failed"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_transient_failures(error: BaseException, reason: str) -> None:
    assert transient_reason(error) == reason


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError("s3://bucket/x"),
        PermissionError("Access Denied"),
        Status(404),
        Status(403),
        Status(416),
        RequestsHTTPError(401),
        ClientError("NoSuchKey", 404),
        caused(OSError(errno.EIO, "?"), Status(400)),
        OSError(errno.EIO, "disk"),
        ValueError("bad"),
        StorageError("already named"),
        RangeIgnoredError("ignored Range"),
        IntegrityError("size"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_permanent_failures(error: BaseException) -> None:
    assert transient_reason(error) is None


def test_real_client_exceptions() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    from fsspec.exceptions import FSTimeoutError

    assert transient_reason(aiohttp.ClientPayloadError("Response payload is not completed")) == "short read"
    assert transient_reason(aiohttp.ServerDisconnectedError()) == "connection closed"
    assert transient_reason(FSTimeoutError()) == "timeout"
    info = aiohttp.RequestInfo(
        url=aiohttp.client.URL("http://h/x"),
        method="GET",
        headers={},  # type: ignore[call-arg]
        real_url=aiohttp.client.URL("http://h/x"),
    )
    assert transient_reason(aiohttp.ClientResponseError(info, (), status=503)) == "HTTP 503"
    assert transient_reason(aiohttp.ClientResponseError(info, (), status=404)) is None


def test_a_cycle_in_the_chain_ends() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert transient_reason(a) is None


# -- the policy -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attempts", 0),
        ("attempts", 1.5),
        ("attempts", True),
        ("initial_delay", -1),
        ("max_delay", float("nan")),
        ("timeout", 0),
        ("deadline", 0),
        ("multiplier", 0.5),
        ("jitter", 1.5),
        ("jitter", -0.1),
    ],
)
def test_bad_policies_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(LoaderUsageError, match=f"RetryPolicy {field} is {value!r}"):
        RetryPolicy(**{field: value})


def test_delays_grow_and_are_capped() -> None:
    assert list(RetryPolicy(attempts=6, initial_delay=0.5, max_delay=3.0).delays()) == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert list(RetryPolicy(attempts=1).delays()) == []
    default = RetryPolicy()
    assert sum(default.delays()) < default.deadline <= 60  # a persistent fault ends within a minute


def flaky(failures: list[BaseException], result: Any = "ok") -> Any:
    calls: list[float] = []

    def fn(timeout: float) -> Any:
        calls.append(timeout)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return result

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_transient_failures_are_retried_with_jittered_backoff() -> None:
    policy = RetryPolicy(attempts=5, initial_delay=1.0, multiplier=2.0, max_delay=3.0, jitter=0.5)
    slept: list[float] = []
    fn = flaky([Status(503), ConnectionResetError(), ShortRead("x"), TimeoutError()])
    assert policy.call(fn, url="s3://b/x", sleep=slept.append) == "ok"
    assert len(fn.calls) == 5 and all(0 < t <= policy.timeout for t in fn.calls)
    for got, nominal in zip(slept, [1.0, 2.0, 3.0, 3.0]):
        assert nominal * 0.5 <= got <= nominal


def test_no_jitter_means_the_nominal_delays() -> None:
    slept: list[float] = []
    RetryPolicy(attempts=4, initial_delay=0.1, jitter=0.0).call(
        flaky([TimeoutError()] * 3), url="u", sleep=slept.append
    )
    assert slept == pytest.approx([0.1, 0.2, 0.4])


def test_attempts_run_out_into_a_storage_error_naming_everything() -> None:
    policy = RetryPolicy(attempts=3, initial_delay=0.0)
    fn = flaky([Status(503)] * 10)
    with pytest.raises(StorageError) as info:
        policy.call(fn, url="s3://bucket/train/shard-00007.tar", byte_range=(0, 16777216), sleep=lambda s: None)
    e = info.value
    assert len(fn.calls) == 3
    assert (e.url, e.byte_range, e.attempts) == ("s3://bucket/train/shard-00007.tar", (0, 16777216), 3)
    assert str(e).startswith("s3://bucket/train/shard-00007.tar bytes [0, 16777216): 3 attempts in ")
    assert "the last with HTTP 503 (Status: status 503)" in str(e) and "attempts ran out" in str(e)
    assert e.cause == "HTTP 503 (Status: status 503)"
    assert isinstance(e.__cause__, Status)
    assert type(pickle.loads(pickle.dumps(e))) is StorageError


def test_permanent_failures_are_not_retried() -> None:
    fn = flaky([FileNotFoundError("no such key")] * 5)
    with pytest.raises(StorageError, match=r"^s3://b/x: FileNotFoundError: no such key \(not retried") as info:
        RetryPolicy().call(fn, url="s3://b/x", sleep=lambda s: pytest.fail("slept"))
    assert len(fn.calls) == 1 and info.value.attempts == 1 and info.value.byte_range is None


@pytest.mark.parametrize("error", [RangeIgnoredError("r", "u"), IntegrityError("i", "u", "size", 1, 2)])
def test_named_storage_errors_pass_through(error: StorageError) -> None:
    fn = flaky([error])
    with pytest.raises(type(error)) as info:
        RetryPolicy().call(fn, url="u")
    assert info.value is error and len(fn.calls) == 1


def test_the_deadline_bounds_a_request_and_each_attempt() -> None:
    policy = RetryPolicy(attempts=1000, initial_delay=0.05, max_delay=0.05, jitter=0.0, timeout=0.3, deadline=0.5)
    seen: list[float] = []

    def slow(timeout: float) -> None:
        seen.append(timeout)
        time.sleep(min(timeout, 0.2))
        raise TimeoutError("no answer")

    start = time.monotonic()
    with pytest.raises(StorageError, match="deadline ran out") as info:
        policy.call(slow, url="http://h/x")
    assert time.monotonic() - start < 0.5 + 0.2 + 0.1
    assert 2 <= info.value.attempts <= 3
    assert seen[0] == pytest.approx(0.3, abs=0.01) and all(t <= 0.3 for t in seen)


def test_a_custom_classifier() -> None:
    fn = flaky([KeyError("busy")] * 2)
    assert RetryPolicy(initial_delay=0).call(fn, url="redis://h/s", transient=lambda e: "busy") == "ok"


def test_jitter_never_draws_from_the_global_rngs() -> None:
    """The loader re-seeds the global RNGs for every sample; a retry in a background
    thread must not move them."""
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    RetryPolicy(attempts=20, initial_delay=0.0).call(flaky([TimeoutError()] * 19), url="u")
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1]) and torch.equal(torch.get_rng_state(), before[2])


def _child_draw(queue: Any) -> None:
    queue.put(retry_module._jitter_rng().random())


def test_forked_workers_do_not_retry_in_step() -> None:
    retry_module._jitter_rng()  # made in the parent before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child_draw, args=(queue,)) for _ in range(2)]
    for p in procs:
        p.start()
    draws = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
    assert len({*draws, retry_module._jitter_rng().random()}) == 3


def test_policies_are_plain_data() -> None:
    policy = RetryPolicy(attempts=3, deadline=5.0)
    assert pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(AttributeError):
        policy.attempts = 4  # type: ignore[misc]
