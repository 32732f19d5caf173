"""A real S3 server for the tests: moto's server in a child process, and the fault proxy in front of it.

Fixtures (registered in conftest.py):

- ``s3`` (session): an :class:`S3Server` on a free localhost port, killed at the end of the session.
- ``s3_env`` (function): points the usual AWS environment variables at ``s3`` for one test, so
  library code that reads its configuration from the environment talks to it; yields ``s3``.
- ``s3_proxy`` (function): a factory ``s3_proxy(rate=0.05, kinds=FAULT_KINDS, seed=0, drop_delay=0.0)``
  that starts a :class:`FaultProxy` (tests/fault_proxy.py) in front of ``s3``; each is killed after
  the test.

Servers run in child processes, never as threads of the test process: the tests fork DataLoader
workers, and a forked copy of a live server thread is what we avoid. Each child exits when its stdin
closes, so it dies with the test process even when that is killed; teardown kills it first anyway.
s3fs caches filesystem instances by their arguments, not by the environment: every fixture here
clears that cache on the way in and out, so no test reads through another test's endpoint.

Run as a module (``python -m tests.s3_server``) it is the child: it serves moto on 127.0.0.1, prints
``PORT <n>`` and runs until its stdin closes.
"""

from __future__ import annotations

import http.client
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Iterator, Sequence
from urllib.parse import urlencode

import pytest

from .fault_proxy import FAULT_KINDS

REGION = "us-east-1"
#: Variables that would override or confuse what `env` sets; removed wherever `env` is applied.
UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3",
         "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")
STARTUP_TIMEOUT = 60.0
HERE = Path(__file__).resolve().parent
_bucket_numbers = itertools.count()


def aws_env(endpoint_url: str) -> dict[str, str]:
    """The environment that points botocore, aiobotocore and s3fs at `endpoint_url` with test keys."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def clear_s3fs_cache() -> None:
    if "s3fs" in sys.modules:
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()


def is_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class ChildServer:
    """A server child process that prints ``PORT <n>`` once it listens and exits when stdin closes."""

    def __init__(self, argv: Sequence[str], name: str, log_path: Path, cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")
        self.process = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, close_fds=True, cwd=cwd
        )
        try:
            self.port = self._read_port()
            self.endpoint_url = f"http://127.0.0.1:{self.port}"
            self._wait_until_it_answers()
        except BaseException:
            self.stop()
            raise

    def _read_port(self) -> int:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode(errors="replace")  # the child writes it at once, or dies
        if not line.startswith("PORT "):
            self.process.wait(STARTUP_TIMEOUT)
            raise RuntimeError(f"{self.name} did not start (exit code {self.process.returncode}):\n{self.log_tail()}")
        return int(line.split()[1])

    def _wait_until_it_answers(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                connection.request("GET", "/")
                connection.getresponse().read()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} on port {self.port} does not answer:\n{self.log_tail()}") from None
                time.sleep(0.05)
            finally:
                connection.close()

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Kill the child and reap it; safe to call twice."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self._log):
            if stream is not None:
                stream.close()


class S3Endpoint:
    """What a test needs to talk S3 to one endpoint: its URL, its environment, an s3fs filesystem."""

    endpoint_url: str

    @property
    def env(self) -> dict[str, str]:
        return aws_env(self.endpoint_url)

    def subprocess_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) with `env` applied, for a child process such as the CLI."""
        merged = {k: v for k, v in (os.environ if base is None else base).items() if k not in UNSET}
        merged.update(self.env)
        return merged

    def use_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this test's environment at this endpoint (undone with the monkeypatch)."""
        for name in UNSET:
            monkeypatch.delenv(name, raising=False)
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)
        clear_s3fs_cache()

    def fs(self, retries: int | None = None, **options):
        """A fresh s3fs.S3FileSystem on this endpoint; `options` go to its constructor.

        `retries` sets s3fs's own attempts per call (its default is 5); botocore's are set with
        ``config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}}``.
        """
        import s3fs

        options.setdefault("client_kwargs", {}).setdefault("region_name", REGION)
        fs = s3fs.S3FileSystem(
            endpoint_url=self.endpoint_url, key="testing", secret="testing", skip_instance_cache=True, **options
        )
        if retries is not None:
            fs.retries = retries
        return fs


class S3Server(S3Endpoint):
    """moto's S3 server in a child process."""

    def __init__(self, log_dir: Path) -> None:
        self.child = ChildServer([sys.executable, "-m", __name__], "moto S3 server", log_dir / "moto.log",
                                 cwd=HERE.parent)
        self.endpoint_url = self.child.endpoint_url
        self._fs = self.fs()

    @property
    def process(self) -> subprocess.Popen:
        return self.child.process

    def bucket(self, name: str | None = None) -> str:
        """Create a new bucket (a fresh unique name unless `name` is given) and return its name."""
        name = name or f"pf-test-{next(_bucket_numbers)}-{uuid.uuid4().hex[:8]}"
        self._fs.call_s3("create_bucket", Bucket=name)  # no LocationConstraint: us-east-1
        self._fs.invalidate_cache()
        return name

    def upload(self, local: str | os.PathLike, url: str) -> str:
        """Upload a file to `url`, or a directory's files under the prefix `url`; returns `url`."""
        local = Path(local)
        url = url.rstrip("/")
        if local.is_dir():
            for path in sorted(p for p in local.rglob("*") if p.is_file()):
                self._fs.put_file(str(path), f"{url}/{path.relative_to(local).as_posix()}")
        else:
            self._fs.put_file(str(local), url)
        self._fs.invalidate_cache()
        return url

    def put(self, url: str, data: bytes) -> str:
        """Write `data` to the object `url`; returns `url`."""
        self._fs.pipe_file(url, data)
        self._fs.invalidate_cache()
        return url

    def stop(self) -> None:
        self.child.stop()


class FaultProxy(S3Endpoint):
    """tests/fault_proxy.py in a child process, in front of an S3Server.

    `bucket`, `upload` and `put` go straight to the server, so setting data up neither meets faults nor
    shows in the counters.
    """

    def __init__(self, server: S3Server, log_path: Path, rate: float = 0.05, kinds: Sequence[str] = FAULT_KINDS,
                 seed: int = 0, drop_delay: float = 0.0) -> None:
        self.server = server
        argv = [sys.executable, str(HERE / "fault_proxy.py"), "--upstream", server.endpoint_url, "--watch-stdin",
                "--rate", str(rate), "--kinds", ",".join(kinds), "--seed", str(seed), "--drop-delay", str(drop_delay)]
        self.child = ChildServer(argv, "fault proxy", log_path)
        self.endpoint_url = self.child.endpoint_url

    @property
    def process(self) -> subprocess.Popen:
        return self.child.process

    def bucket(self, name: str | None = None) -> str:
        return self.server.bucket(name)

    def upload(self, local: str | os.PathLike, url: str) -> str:
        return self.server.upload(local, url)

    def put(self, url: str, data: bytes) -> str:
        return self.server.put(url, data)

    def _control(self, method: str, path: str) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.child.port, timeout=30)
        try:
            connection.request(method, path)
            response = connection.getresponse()
            body = response.read().decode()
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"fault proxy {method} {path}: {response.status} {body}")
        return json.loads(body)

    def stats(self) -> dict:
        """``{"keys": {"bucket/key": {"requests", "gets", "bytes", "faults": {kind: n}}}, "totals": {...}}``."""
        return self._control("GET", "/__stats__")

    def key_stats(self, url: str) -> dict:
        """The counters of one object, ``s3://bucket/key`` or ``bucket/key`` (zeros if never asked for)."""
        key = url.split("://", 1)[-1]
        return self.stats()["keys"].get(key, {"requests": 0, "gets": 0, "bytes": 0, "faults": {}})

    def reset_stats(self) -> None:
        self._control("POST", "/__stats__/reset")

    def set_rate(self, rate: float, kinds: Sequence[str] | None = None) -> None:
        query = {"rate": rate} if kinds is None else {"rate": rate, "kinds": ",".join(kinds)}
        self._control("POST", "/__config__?" + urlencode(query))

    def stop(self) -> None:
        self.child.stop()


def _require_server_packages() -> None:
    missing = [name for name in ("s3fs", "moto", "flask", "werkzeug") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the S3 tests need s3fs and moto[server] ({', '.join(missing)} not installed): "
                    "pip install s3fs 'moto[server]'")


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[S3Server]:
    """moto's S3 server in a child process for the whole session."""
    _require_server_packages()
    server = S3Server(tmp_path_factory.mktemp("s3-server"))
    try:
        yield server
    finally:
        server.stop()
        clear_s3fs_cache()


@pytest.fixture
def s3_env(s3, monkeypatch) -> Iterator[S3Server]:
    """The AWS environment variables of this test point at `s3`."""
    s3.use_env(monkeypatch)
    yield s3
    clear_s3fs_cache()


@pytest.fixture
def s3_proxy(s3, tmp_path_factory):
    """A factory: ``s3_proxy(rate=0.05, kinds=FAULT_KINDS, seed=0, drop_delay=0.0)`` -> FaultProxy."""
    started: list[FaultProxy] = []
    log_dir = tmp_path_factory.mktemp("fault-proxy")

    def start(rate: float = 0.05, kinds: Sequence[str] = FAULT_KINDS, seed: int = 0,
              drop_delay: float = 0.0) -> FaultProxy:
        proxy = FaultProxy(s3, log_dir / f"proxy-{len(started)}.log", rate, kinds, seed, drop_delay)
        started.append(proxy)
        return proxy

    try:
        yield start
    finally:
        for proxy in started:
            proxy.stop()
        clear_s3fs_cache()


def serve_moto() -> None:
    """The child's side: serve moto's S3 on 127.0.0.1, print the port, run until stdin closes."""
    import logging

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(f"PORT {server.get_host_and_port()[1]}", flush=True)
    sys.stdin.buffer.read()
    os._exit(0)


if __name__ == "__main__":
    serve_moto()
