"""Servers for the storage tests and benchmark, all on 127.0.0.1, started by the test:

* ``FileServer``: serves a folder over HTTP, honouring ``Range`` (or ignoring it, as
  Python's ``http.server`` does, with ``honour_range=False``), with ETags (none with
  ``etags=False``) and no ``Last-Modified``.
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
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
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
        """Apply the next fault, if any; True if the request was answered by it (or was a
        control request of a ``ServerProcess``: ``/__faults__/log``, ``/__faults__/reset``)."""
        if self.path.startswith("/__faults__/"):
            faults = self.server.faults
            if self.path == "/__faults__/reset":
                faults.reset()
            with faults.lock:
                body = json.dumps(faults.log).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True
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
        st = path.stat()
        stamp = (str(path), st.st_size, st.st_mtime_ns)
        etag = self.server.etags.get(stamp)
        if etag is None:  # hashed once per version of the file, not per request
            etag = self.server.etags[stamp] = hashlib.md5(path.read_bytes()).hexdigest()
        size = st.st_size
        headers = [("ETag", f'"{etag}"')] if self.server.send_etags else []
        headers.append(("Accept-Ranges", "bytes"))
        rng = self.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if match and self.server.honour_range:
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1 if match.group(2) else size, size)
            if start >= size:
                self._send(method, 416, [("Content-Range", f"bytes */{size}"), ("Content-Length", "0")], b"")
                return
            with open(path, "rb") as f:  # only the bytes asked for
                f.seek(start)
                body = f.read(end - start) if method != "HEAD" else b""
            headers += [("Content-Range", f"bytes {start}-{end - 1}/{size}"), ("Content-Length", str(end - start))]
            self._send(method, 206, headers, body)
        else:
            data = path.read_bytes() if method != "HEAD" else b""
            self._send(method, 200, [*headers, ("Content-Length", str(size))], data)


class _FileServerImpl(_Server):
    root: Path
    honour_range: bool
    send_etags: bool
    etags: dict[tuple[str, int, int], str]


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
    def __init__(self, root: Path, honour_range: bool = True, etags: bool = True) -> None:
        server = _FileServerImpl(("127.0.0.1", 0), _FileHandler)
        server.root, server.honour_range, server.faults = Path(root), honour_range, Faults()
        server.send_etags = etags
        server.etags = {}
        super().__init__(server)


class FaultProxy(_Running):
    def __init__(self, upstream_port: int) -> None:
        server = _ProxyImpl(("127.0.0.1", 0), _ProxyHandler)
        server.upstream, server.faults = ("127.0.0.1", upstream_port), Faults()
        super().__init__(server)


class _HubHandler(_Handler):
    """The Hugging Face Hub routes ``HfFileSystem`` calls to read a dataset repository:
    the repository's info, its tree (listing), ``paths-info`` (``info``) and ``resolve``
    (the bytes, honouring ``Range``). Sizes, git blob ids, LFS SHA-256s and ETags are the
    files' own; any other route is a 404."""

    server: _HubImpl

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        if self._fault(method):
            return
        path, _, query = self.path.partition("?")
        path = urllib.parse.unquote(path)
        repo, sha = re.escape(self.server.repo_id), self.server.sha
        if method == "POST" and (m := re.fullmatch(rf"/api/datasets/{repo}/paths-info/[^/]+", path)):
            asked = urllib.parse.parse_qs(body.decode()).get("paths", [])
            return self._json(method, [e for p in asked if (e := self._entry(p.strip("/"))) is not None])
        if re.fullmatch(rf"/api/datasets/{repo}(/revision/[^/]+)?", path):
            return self._json(method, {"id": self.server.repo_id, "sha": sha, "private": False, "siblings": []})
        if m := re.fullmatch(rf"/api/datasets/{repo}/tree/[^/]+(/.*)?", path):
            under = (m.group(1) or "").strip("/")
            recursive = urllib.parse.parse_qs(query).get("recursive", ["False"])[0].lower() == "true"
            base = self.server.root / under
            if not base.is_dir():
                return self._json(method, {"error": "not found"}, 404)
            found = base.rglob("*") if recursive else base.iterdir()
            rel = sorted(p.relative_to(self.server.root).as_posix() for p in found)
            return self._json(method, [self._entry(p) for p in rel])
        if m := re.fullmatch(rf"/datasets/{repo}/resolve/[^/]+/(.+)", path):
            return self._file(method, m.group(1))
        self._json(method, {"error": "no such route"}, 404)

    def _entry(self, rel: str) -> dict[str, Any] | None:
        path = self.server.root / rel
        if path.is_dir() and rel:
            return {"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "path": rel}
        if not path.is_file():
            return None
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        entry: dict[str, Any] = {"type": "file", "oid": blob, "size": len(data), "path": rel}
        if len(data) > self.server.lfs_from:  # stored in LFS: the pointer names the SHA-256
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _json(self, method: str, value: Any, status: int = 200) -> None:
        body = json.dumps(value).encode()
        self._send(method, status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body)

    def _file(self, method: str, rel: str) -> None:
        path = self.server.root / rel
        if not path.is_file():
            headers = [("X-Error-Code", "EntryNotFound"), ("Content-Length", "0")]
            return self._send(method, 404, headers, b"")
        data = path.read_bytes()
        headers = [("ETag", f'"{hashlib.sha256(data).hexdigest()}"'), ("Accept-Ranges", "bytes")]
        headers.append(("X-Repo-Commit", self.server.sha))
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if not match:
            return self._send(method, 200, [*headers, ("Content-Length", str(len(data)))], data)
        start = int(match.group(1))
        end = min(int(match.group(2)) + 1 if match.group(2) else len(data), len(data))
        if start >= len(data):
            return self._send(method, 416, [("Content-Range", f"bytes */{len(data)}"), ("Content-Length", "0")], b"")
        body = data[start:end]
        headers += [("Content-Range", f"bytes {start}-{end - 1}/{len(data)}"), ("Content-Length", str(len(body)))]
        self._send(method, 206, headers, body)


class _HubImpl(_Server):
    root: Path
    repo_id: str
    sha: str
    lfs_from: int


class HubServer(_Running):
    """A folder served as the Hugging Face dataset repository ``repo_id`` (see
    ``_HubHandler``): ``hf://datasets/<repo_id>/...`` with ``options()`` as storage_options."""

    def __init__(self, root: Path, repo_id: str = "savable/shards", lfs_from: int = 10_000) -> None:
        server = _HubImpl(("127.0.0.1", 0), _HubHandler)
        server.root, server.repo_id, server.faults, server.lfs_from = Path(root), repo_id, Faults(), lfs_from
        server.sha = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repo_id = repo_id
        super().__init__(server)

    def options(self) -> dict[str, Any]:
        return {"endpoint": self.url, "token": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(proc: subprocess.Popen[bytes], port: int, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"the {what} did not start") from None
            time.sleep(0.05)


class _Subprocess:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> _Subprocess:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MotoServer(_Subprocess):
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
        _wait_for_port(self.proc, self.port, "moto server")

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


TEST_TOOLS = Path(os.environ.get("SAVABLE_LOADER_TEST_TOOLS") or Path.home() / ".cache" / "savable_loader-test-tools")
AZURITE_VERSION = "3.37.0"
AZURITE_INSTALL = f"npm install --prefix {TEST_TOOLS} azurite@{AZURITE_VERSION} (what .ci/run does)"
# Azurite's well-known development account (public, in Microsoft's documentation)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_executable() -> str | None:
    """Azurite's blob server: ``$SAVABLE_LOADER_AZURITE``, the test-tools folder, or PATH."""
    for candidate in (
        os.environ.get("SAVABLE_LOADER_AZURITE"),
        str(TEST_TOOLS / "node_modules" / ".bin" / "azurite-blob"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("azurite-blob")


class AzuriteServer(_Subprocess):
    """Azurite's blob service (Azure Storage's emulator, Node.js) in memory on 127.0.0.1."""

    def __init__(self, executable: str) -> None:
        self.port = _free_port()
        args = ["--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence"]
        args += ["--extentMemoryLimit", "256", "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
        self.proc = subprocess.Popen([executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.proc, self.port, "Azurite blob server")

    def options(self, port: int | None = None) -> dict[str, Any]:
        """storage_options (adlfs) reaching this server (or a proxy of it on ``port``)."""
        endpoint = f"http://127.0.0.1:{port or self.port}/{AZURITE_ACCOUNT}"
        return {
            "connection_string": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
        }

    def container(self, name: str, files: dict[str, bytes]) -> None:
        import adlfs

        fs = adlfs.AzureBlobFileSystem(**self.options(), skip_instance_cache=True)
        fs.mkdir(name)
        for key, data in files.items():
            fs.pipe(f"{name}/{key}", data)


# gcsfs >= 2025.10 asks a gRPC control API (which no emulator has) for each bucket's layout
# unless this is off; it must be set before gcsfs is imported, in every process.
GCS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class GcsEmulator(_Subprocess):
    """``gcp-storage-emulator`` (Google Cloud Storage's JSON API, Python) in memory on 127.0.0.1."""

    def __init__(self) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "-H", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, "--in-memory", "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.proc, self.port, "GCS emulator")

    def options(self, port: int | None = None) -> dict[str, Any]:
        """storage_options (gcsfs) reaching this server (or a proxy of it on ``port``)."""
        return {"endpoint_url": f"http://127.0.0.1:{port or self.port}", "token": "anon", "project": "test"}

    def bucket(self, name: str, files: dict[str, bytes]) -> None:
        import gcsfs

        fs = gcsfs.GCSFileSystem(**self.options(), skip_instance_cache=True)
        fs.mkdir(name)
        for key, data in files.items():
            fs.pipe(f"{name}/{key}", data)


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


class _RemoteFaults:
    """The ``Faults`` of a server in another process, as far as reading its log goes."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _ask(self, what: str) -> list[tuple[str, str, str, str]]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/__faults__/{what}", timeout=30) as r:
            return [tuple(entry) for entry in json.loads(r.read())]  # type: ignore[misc]

    @property
    def log(self) -> list[tuple[str, str, str, str]]:
        return self._ask("log")

    def reset(self) -> None:
        self._ask("reset")


class ServerProcess(_Subprocess):
    """A ``FileServer`` of ``arg`` (``kind="file"``) or a ``FaultProxy`` of the port ``arg``
    (``kind="proxy"``) in its own process (a benchmark's servers do not share the reading
    process's GIL); ``faults.log`` and ``faults.reset()`` reach it over HTTP."""

    def __init__(self, kind: str, arg: str | int) -> None:
        repo = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage_servers", kind, str(arg)], stdout=subprocess.PIPE, env=env, cwd=repo
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the {kind} server process did not start")
        self.port = int(line)
        self.faults = _RemoteFaults(self.url)


def _serve_main(argv: list[str]) -> None:
    kind, arg = argv
    server = FileServer(Path(arg)) if kind == "file" else FaultProxy(int(arg))
    print(server.port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    _serve_main(sys.argv[1:])
