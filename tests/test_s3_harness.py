"""The S3 test harness itself: moto's server in a child process, and the fault proxy in front of it."""

from __future__ import annotations

import errno
import http.client
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from .s3_server import HERE, REGION, is_alive

s3fs = pytest.importorskip("s3fs", reason="the S3 harness tests need s3fs")
botocore_exceptions = pytest.importorskip("botocore.exceptions")
aiohttp = pytest.importorskip("aiohttp")

#: One attempt per read, from s3fs and from botocore: the client sees the raw fault.
ONE_ATTEMPT = {"retries": 1, "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def put_object(s3, size: int, name: str = "data/object.bin", seed: int = 0) -> tuple[str, bytes]:
    """A new bucket holding one object of `size` random bytes: (its s3:// URL, its bytes)."""
    data = payload(size, seed)
    return s3.put(f"s3://{s3.bucket()}/{name}", data), data


def raw_get(endpoint, url: str, headers: dict | None = None) -> tuple[http.client.HTTPResponse, bytes]:
    """A signed GET of an object with http.client: what any S3 client sends, without its retries."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    path = "/" + url.split("://", 1)[1]
    request = AWSRequest(method="GET", url=endpoint.endpoint_url + path, headers=headers or {})
    S3SigV4Auth(Credentials("testing", "testing"), "s3", REGION).add_auth(request)
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.child.port, timeout=10)
    try:
        connection.request("GET", path, headers=dict(request.headers))
        response = connection.getresponse()
        return response, response.read()
    finally:
        connection.close()


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def wait_until_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- through the server, and through the proxy at rate 0 ---------------------------------------


def test_a_folder_round_trips_through_the_server(s3, tmp_path):
    files = {"a/one.bin": payload(1000, 1), "a/b/two.bin": payload(70_000, 2), "three.txt": b"three\n"}
    for name, data in files.items():
        (tmp_path / "set" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "set" / name).write_bytes(data)
    url = s3.upload(tmp_path / "set", f"s3://{s3.bucket()}/sets/set")
    fs = s3.fs()
    assert sorted(fs.find(url)) == sorted(f"{url[5:]}/{name}" for name in files)
    for name, data in files.items():
        assert fs.cat_file(f"{url}/{name}") == data
    fs.get_file(f"{url}/a/b/two.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == files["a/b/two.bin"]


def test_objects_round_trip_through_the_proxy_at_rate_zero(s3, s3_proxy):
    proxy = s3_proxy(rate=0)
    fs, url, data = proxy.fs(), f"s3://{proxy.bucket()}/big.bin", payload(3_000_000)
    fs.pipe_file(url, data)  # a PUT with a body, through the proxy
    assert s3.fs().cat_file(url) == data  # written through the proxy, read from the server
    assert fs.cat_file(url) == data
    with fs.open(url, block_size=1 << 20) as f:  # ranged reads, on kept-alive connections
        assert f.read() == data
    assert fs.ls(url.rsplit("/", 1)[0]) == [url[5:]]
    assert proxy.stats()["totals"]["faults"] == {}


def test_env_points_library_code_at_the_endpoint_and_no_cached_filesystem_leaks(s3_env, s3_proxy, monkeypatch):
    import fsspec

    url, data = put_object(s3_env, 1000)
    assert fsspec.filesystem("s3").cat_file(url) == data  # no arguments: all from the environment
    proxy = s3_proxy(rate=0)
    proxy.use_env(monkeypatch)
    assert fsspec.filesystem("s3").cat_file(url) == data  # the same arguments, so fsspec's cache must be empty
    assert proxy.key_stats(url)["bytes"] == len(data)
    assert proxy.subprocess_env({"AWS_PROFILE": "mine", "HOME": "/h"})["AWS_ENDPOINT_URL"] == proxy.endpoint_url
    assert "AWS_PROFILE" not in proxy.subprocess_env({"AWS_PROFILE": "mine"})


# -- counters ---------------------------------------------------------------------------------


def test_counters_are_exact_for_whole_ranged_and_concurrent_reads(s3, s3_proxy):
    url, data = put_object(s3, 200_000)
    proxy = s3_proxy(rate=0)
    fs = proxy.fs()
    proxy.reset_stats()
    assert fs.cat_file(url) == data
    assert (proxy.key_stats(url)["gets"], proxy.key_stats(url)["bytes"]) == (1, len(data))

    proxy.reset_stats()
    assert fs.cat_file(url, start=1000, end=51_000) == data[1000:51_000]
    assert (proxy.key_stats(url)["gets"], proxy.key_stats(url)["bytes"]) == (1, 50_000)

    bucket = url[5:].split("/")[0]
    objects = {f"s3://{bucket}/many/{i}.bin": payload(10_000 + 997 * i, seed=i) for i in range(8)}
    for name, blob in objects.items():
        s3.put(name, blob)
    proxy.reset_stats()
    got = fs.cat(list(objects))  # concurrent GETs
    assert {f"s3://{name}": blob for name, blob in got.items()} == objects
    stats = proxy.stats()
    assert {f"s3://{key}": row["bytes"] for key, row in stats["keys"].items()} == {
        name: len(blob) for name, blob in objects.items()}
    assert stats["totals"]["bytes"] >= sum(len(blob) for blob in objects.values())

    proxy.reset_stats()
    assert proxy.stats()["keys"] == {}


# -- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["503", "reset", "truncate", "drop"])
def test_the_proxy_injects_each_fault_on_the_wire(s3, s3_proxy, kind):
    url, data = put_object(s3, 100_000)
    proxy = s3_proxy(rate=1.0, kinds=[kind])
    if kind == "503":
        response, body = raw_get(proxy, url)
        assert response.status == 503 and b"<Code>SlowDown</Code>" in body
    elif kind == "truncate":
        with pytest.raises(http.client.IncompleteRead) as info:
            raw_get(proxy, url)
        assert len(info.value.partial) == len(data) // 2 and info.value.partial == data[: len(data) // 2]
        assert proxy.key_stats(url)["bytes"] == len(data) // 2
    else:
        with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)) as info:
            raw_get(proxy, url)
        assert isinstance(info.value, ConnectionResetError if kind == "reset" else http.client.RemoteDisconnected)
    assert proxy.key_stats(url)["faults"] == {kind: 1}
    response, body = raw_get(proxy, url + "?tagging")  # not an object read: passes untouched
    assert response.status == 200 and b"<Tagging" in body and proxy.key_stats(url)["faults"] == {kind: 1}


def test_ranges_pass_through_the_proxy_and_truncate_cuts_a_206(s3, s3_proxy):
    url, data = put_object(s3, 10_000)
    proxy = s3_proxy(rate=0)
    response, body = raw_get(proxy, url, {"Range": "bytes=100-1099"})
    assert (response.status, body) == (206, data[100:1100])
    proxy.set_rate(1.0, ["truncate"])
    with pytest.raises(http.client.IncompleteRead) as info:
        raw_get(proxy, url, {"Range": "bytes=100-1099"})
    assert info.value.partial == data[100:600]


@pytest.mark.parametrize("kind", ["503", "reset", "truncate", "drop"])
def test_s3fs_sees_each_fault(s3, s3_proxy, kind):
    url, data = put_object(s3, 100_000)
    proxy = s3_proxy(rate=1.0, kinds=[kind])
    expected = {
        "503": OSError,  # s3fs's translation of botocore's ClientError SlowDown
        "reset": (botocore_exceptions.ConnectionError, botocore_exceptions.ConnectionClosedError),
        "truncate": (aiohttp.ClientPayloadError, botocore_exceptions.IncompleteReadError),
        "drop": botocore_exceptions.ConnectionClosedError,
    }[kind]
    fs = proxy.fs(**ONE_ATTEMPT)
    with pytest.raises(expected) as info:
        fs.cat_file(url)
    if kind == "503":
        assert info.value.errno == errno.EBUSY and "reduce your request rate" in str(info.value)
    faults = proxy.key_stats(url)["faults"]
    assert list(faults) == [kind] and faults[kind] >= 1  # aiohttp retries a kept-alive connection once itself
    proxy.set_rate(0)
    assert fs.cat_file(url) == data  # and the client recovers on the next read


@pytest.mark.slow  # the client's backoff sleeps
def test_the_clients_own_retries_get_through_faults_at_a_moderate_rate(s3, s3_proxy):
    url, data = put_object(s3, 50_000)
    proxy = s3_proxy(rate=0.3, kinds=["503", "truncate"], seed=3)
    fs = proxy.fs(retries=10, config_kwargs={"retries": {"total_max_attempts": 1}})
    for _ in range(6):
        assert fs.cat_file(url) == data
    row = proxy.key_stats(url)
    assert row["faults"] and row["gets"] == 6 + sum(row["faults"].values())
    assert row["bytes"] == 6 * len(data) + row["faults"].get("truncate", 0) * (len(data) // 2)


# -- lifetimes --------------------------------------------------------------------------------


def test_stop_kills_the_child_and_frees_its_port(s3_proxy):
    proxy = s3_proxy(rate=0)
    pid, port = proxy.process.pid, proxy.child.port
    proxy.stop()
    assert not is_alive(pid) and refuses_connections(port)
    proxy.stop()  # twice is harmless: the fixture's teardown does it again


LAUNCHER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.s3_server import FaultProxy, S3Server
server = S3Server(Path({tmp!r}))
proxy = FaultProxy(server, Path({tmp!r}) / "proxy.log", rate=0)
print(server.process.pid, proxy.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # starts a second moto server
def test_the_servers_die_with_the_process_that_started_them(tmp_path):
    """A test session that is killed outright (no teardown at all) leaves no server behind."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LAUNCHER.format(root=str(HERE.parent),
                                                                                       tmp=str(tmp_path)))],
                                stdout=subprocess.PIPE)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(is_alive(pid) for pid in pids)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        launcher.stdout.close()
    assert all(wait_until_gone(pid) for pid in pids)
