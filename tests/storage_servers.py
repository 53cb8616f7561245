"""Servers for the storage tests and benchmark, all on 127.0.0.1, started by the test:

* ``FileServer``: serves a folder over HTTP, honouring ``Range`` (or ignoring it, as
  Python's ``http.server`` does, with ``honour_range=False``), with ETags.
* ``FaultProxy``: forwards requests to another server (a ``MotoServer``), so that the
  same faults reach S3.
* ``MotoServer``: moto's S3 in a subprocess, with ``bucket(name, files)`` to fill it and
  ``options()`` the ``storage_options`` that reach it (directly or through a proxy).
* ``Replicas``: one folder copied to memory://, a moto bucket (behind a ``FaultProxy``)
  and served over HTTP: ``location(backend, sub)`` is the URL and options of each copy.

``FileServer`` and ``FaultProxy`` share ``Faults``: ``plan = {k: fault}`` injects a fault
on the k-th request (1-based, every request counted), ``always = fault`` on every
request, ``delay`` slows every request down; a fault is ``"503"``, ``"429"``, ``"reset"`` (the connection is reset before an
answer), ``"short"`` (the headers promise the whole body, half of it is sent, then the
connection closes; on a HEAD or an empty body it moves to the next request) or ``"stall"`` (nothing is sent for ``stall_seconds``). ``log``
records ``(method, path, range header, status or fault)`` of every request.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

FAULTS = ("503", "429", "reset", "short", "stall")


class Faults:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.plan: dict[int, str] = {}
        self.always: str | None = None
        self.stall_seconds = 30.0
        self.delay = 0.0  # seconds every request waits before it is answered
        self.log: list[tuple[str, str, str, str]] = []

    def next(self) -> str | None:
        with self.lock:
            self.count += 1
            return self.plan.get(self.count, self.always)

    def record(self, method: str, path: str, rng: str, what: str) -> None:
        with self.lock:
            self.log.append((method, path, rng, what))

    def reset(self) -> None:
        with self.lock:
            self.count, self.plan, self.always, self.log = 0, {}, None, []

    def gets(self, path_part: str = "") -> int:
        """GET requests answered (or faulted) for paths containing ``path_part``."""
        with self.lock:
            return sum(1 for m, p, _, _ in self.log if m == "GET" and path_part in p)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _fault(self, method: str) -> bool:
        """Apply the next fault, if any; True if the request was answered by it."""
        fault = self.server.faults.next()
        if self.server.faults.delay:
            time.sleep(self.server.faults.delay)
        rng = self.headers.get("Range", "")
        if fault is None or fault == "short":
            self._pending_short = fault == "short"
            return False
        self.server.faults.record(method, self.path, rng, fault)
        if fault in ("503", "429"):
            body = (
                (
                    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>Please reduce your request rate.</Message></Error>"
                )
                if fault == "503"
                else b"busy"
            )
            self.send_response(int(fault))
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Retry-After", "0")
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)
        elif fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
        elif fault == "stall":
            time.sleep(self.server.faults.stall_seconds)
            self.close_connection = True
        return True

    def _send(self, method: str, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        short = getattr(self, "_pending_short", False) and method == "GET" and len(body) > 1
        if getattr(self, "_pending_short", False) and not short:  # nothing to cut: the next request's
            faults = self.server.faults
            with faults.lock:
                later = next(k for k in range(faults.count + 1, faults.count + 1000) if k not in faults.plan)
                faults.plan[later] = "short"
        self.server.faults.record(method, self.path, self.headers.get("Range", ""), "short" if short else str(status))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if method == "HEAD":
            return
        if short:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    faults: Faults


class _FileHandler(_Handler):
    server: _FileServerImpl

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_GET(self) -> None:
        self._serve("GET")

    def _serve(self, method: str) -> None:
        if self._fault(method):
            return
        path = self.server.root / self.path.split("?")[0].lstrip("/")
        if not path.is_file():
            self._send(method, 404, [("Content-Length", "0")], b"")
            return
        data = path.read_bytes()
        etag = hashlib.md5(data).hexdigest()
        headers = [("ETag", f'"{etag}"'), ("Accept-Ranges", "bytes")]
        rng = self.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if match and self.server.honour_range:
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1 if match.group(2) else len(data), len(data))
            if start >= len(data):
                self._send(method, 416, [("Content-Range", f"bytes */{len(data)}"), ("Content-Length", "0")], b"")
                return
            body = data[start:end]
            headers += [("Content-Range", f"bytes {start}-{end - 1}/{len(data)}"), ("Content-Length", str(len(body)))]
            self._send(method, 206, headers, body)
        else:
            self._send(method, 200, [*headers, ("Content-Length", str(len(data)))], data)


class _FileServerImpl(_Server):
    root: Path
    honour_range: bool


class _ProxyHandler(_Handler):
    server: _ProxyImpl

    def _forward(self) -> None:
        method = self.command
        if self._fault(method):
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(method, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            drop = ("connection", "keep-alive", "transfer-encoding") + (() if method == "HEAD" else ("content-length",))
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in drop]
            if method != "HEAD":
                out.append(("Content-Length", str(len(data))))
            self._send(method, resp.status, out, data)
        finally:
            conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class _ProxyImpl(_Server):
    upstream: tuple[str, int]


class _Running:
    def __init__(self, server: _Server) -> None:
        self.server = server
        self.faults = server.faults
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> _Running:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FileServer(_Running):
    def __init__(self, root: Path, honour_range: bool = True) -> None:
        server = _FileServerImpl(("127.0.0.1", 0), _FileHandler)
        server.root, server.honour_range, server.faults = Path(root), honour_range, Faults()
        super().__init__(server)


class FaultProxy(_Running):
    def __init__(self, upstream_port: int) -> None:
        server = _ProxyImpl(("127.0.0.1", 0), _ProxyHandler)
        server.upstream, server.faults = ("127.0.0.1", upstream_port), Faults()
        super().__init__(server)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3 server in a subprocess on 127.0.0.1."""

    def __init__(self) -> None:
        self.port = _free_port()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self, port: int | None = None) -> dict[str, Any]:
        """storage_options reaching this server (or a proxy of it on ``port``)."""
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": f"http://127.0.0.1:{port or self.port}",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def bucket(self, name: str, files: dict[str, bytes]) -> None:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket=name)
        for key, data in files.items():
            s3.put_object(Bucket=name, Key=key, Body=data)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> MotoServer:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


BACKENDS = ("local", "memory", "s3", "http")


class Replicas:
    """The files of ``root/data`` in four places: the folder itself, ``memory://<memory>``,
    the moto bucket ``bucket`` (keys ``data/...``; the server starts on first use and is
    reached through a ``FaultProxy``) and an HTTP server of ``root``. S3 and HTTP both take
    faults (``server(backend).faults``)."""

    def __init__(self, root: Path, memory: str, bucket: str) -> None:
        import fsspec

        self.folder = root / "data"
        self.files = {
            p.relative_to(self.folder).as_posix(): p.read_bytes() for p in sorted(self.folder.rglob("*")) if p.is_file()
        }
        self.memory_root, self.bucket_name = memory, bucket
        fs = fsspec.filesystem("memory")
        for name, data in self.files.items():
            fs.pipe(f"/{memory}/{name}", data)
        self.http = FileServer(root)
        self.moto: MotoServer | None = None
        self.proxy: FaultProxy | None = None

    def s3(self) -> FaultProxy:
        if self.proxy is None:
            import pytest

            pytest.importorskip("s3fs")
            pytest.importorskip("moto")
            self.moto = MotoServer()
            self.moto.bucket(self.bucket_name, {f"data/{k}": v for k, v in self.files.items()})
            self.proxy = FaultProxy(self.moto.port)
        return self.proxy

    def server(self, backend: str) -> Any:
        return self.s3() if backend == "s3" else self.http

    def location(self, backend: str, sub: str = "") -> tuple[str, dict[str, Any] | None]:
        """``(url, storage_options)`` of the copy of ``data/<sub>`` in ``backend``."""
        tail = f"/{sub}" if sub else ""
        if backend == "local":
            return str(self.folder / sub) if sub else str(self.folder), None
        if backend == "memory":
            return f"memory://{self.memory_root}{tail}", None
        if backend == "s3":
            proxy = self.s3()
            assert self.moto is not None
            return f"s3://{self.bucket_name}/data{tail}", self.moto.options(proxy.port)
        return f"{self.http.url}/data{tail}", None

    def reset_faults(self) -> None:
        for server in (self.http, self.proxy):
            if server is not None:
                server.faults.reset()

    def close(self) -> None:
        self.http.stop()
        if self.proxy is not None:
            self.proxy.stop()
        if self.moto is not None:
            self.moto.stop()
