"""A real ``redis-server`` for the Redis stream tests and benchmark, on a free loopback port.

``RedisServer()`` starts Debian's ``redis-server`` (no persistence, bound to 127.0.0.1)
and waits until it answers; ``stop()`` ends it (SIGKILL with ``kill=True``, as a crash
would) and ``start()`` starts it again on the same port. ``require_redis()`` skips a
test when ``redis-server`` or the ``redis`` package is missing, with a reason that says
how to install them; under CI (``CI=true``, where ``.ci/run`` installs them) it fails.

Example::

    server = RedisServer()
    client = server.client()
    client.xadd("s", {"x": b"1"})
    server.stop()
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_redis() -> str:
    """The path of ``redis-server``; skips (fails under CI) when it or ``redis`` is missing."""
    missing = []
    executable = shutil.which("redis-server")
    if executable is None:
        missing.append("redis-server (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("the redis package (pip install 'savable_loader[redis]')")
    if missing:
        message = f"needs {' and '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI installs it in .ci/run)")
        pytest.skip(message)
    assert executable is not None
    return executable


class RedisServer:
    """``redis-server`` on 127.0.0.1 at a free port, in memory only."""

    def __init__(self, executable: str | None = None, port: int | None = None, password: str | None = None) -> None:
        self.executable = executable or require_redis()
        self.port = port or _free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{self.password}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}") from None
                if time.monotonic() > deadline:
                    self.stop(kill=True)
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within 20 s") from None
                time.sleep(0.02)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10)

    def stop(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def __enter__(self) -> RedisServer:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
