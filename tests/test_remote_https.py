"""Sets served over plain HTTP (fsspec's HTTP file system), read through the node-local cache.

A local HTTP server (tests/http_server.py) serves a sharded zip set uploaded to it: samples equal
the local set's, a second open reads from the cache, a 503 is retried, a part whose ETag changed is
refused by name, a stalled body fails within seconds by name, a presigned URL is read with its
signature and shown without it, and a memmap set (folders, which HTTP cannot list) is refused by name.
"""

from __future__ import annotations

import os
import time
from urllib.parse import quote

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import storage
from packed_formats.errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from packed_formats.storage import PartCache, Store
from packed_formats.storage import remote as remote_module
from packed_formats.synthetic import make_image_folder

from .conftest import small_remote_sets
from .http_server import HTTPFileServer

pytest.importorskip("aiohttp")
SAMPLES, PER_PART = 24, 4  # 6 parts
SIGNATURE = "c2lnbmF0dXJl/+Zm9v="  # the store's signature of a presigned URL
SIGNED = f"?X-Amz-Expires=60&X-Amz-Signature={quote(SIGNATURE, safe='')}"  # its query string


@pytest.fixture(scope="module")
def local_sets(tmp_path_factory):
    """format -> a sharded raw set of 6 parts on local disk (zip and memmap)."""
    root = tmp_path_factory.mktemp("http-sources")
    images = make_image_folder(root / "images", SAMPLES // 6, sizes=(20, 36))
    return small_remote_sets(root, images, PER_PART)


@pytest.fixture
def server(tmp_path):
    with HTTPFileServer(tmp_path / "www", stall_s=20, writable=True) as running:
        os.makedirs(running.root, exist_ok=True)
        yield running


@pytest.fixture
def served(server, local_sets):
    """(the server, the URL of the zip set uploaded to it)."""
    url = server.url("sets/train.zip")
    storage.upload(local_sets["zip"], url)
    return server, url


def everything(reader):
    keys = [reader.index.key(i) for i in range(len(reader))]
    return reader.read_many(np.arange(len(reader))), np.asarray(reader.index.labels), keys


def test_a_set_over_http_reads_as_the_local_one(served, local_sets, tmp_path):
    server, url = served
    with pf.open_archive(url, cache_dir=tmp_path / "cache") as remote, pf.open_archive(local_sets["zip"]) as local:
        assert remote.path == url and len(remote) == len(local) == SAMPLES
        a, b = everything(remote), everything(local)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    assert server.gets("/sets/train-0") == 6  # each part fetched once


def test_a_second_open_downloads_no_part(served, tmp_path):
    server, url = served
    cache = tmp_path / "cache"
    with pf.open_archive(url, cache_dir=cache) as reader:
        first = everything(reader)
    downloads, gets = len(PartCache(str(cache)).downloads()), server.gets("/sets/train-0")
    assert downloads >= 6
    with pf.open_archive(url, cache_dir=cache) as reader:
        again = everything(reader)
    assert np.array_equal(first[0], again[0]) and first[2] == again[2]
    assert len(PartCache(str(cache)).downloads()) == downloads
    assert server.gets("/sets/train-0") == gets


def test_a_transient_503_is_retried(served, local_sets, tmp_path):
    server, url = served
    server.fault("503", times=2, match="train-00001.zip")
    with pf.open_archive(url, cache_dir=tmp_path / "cache") as remote, pf.open_archive(local_sets["zip"]) as local:
        assert np.array_equal(remote.read(PER_PART), local.read(PER_PART))
    assert server.faults == [("503", "/sets/train-00001.zip")] * 2


def test_a_503_to_the_first_request_is_retried(served, tmp_path):
    server, url = served
    server.fault("503", times=2, match="/sets/train.zip")
    with pf.open_archive(url, cache_dir=tmp_path / "cache") as reader:
        assert len(reader) == SAMPLES
    assert server.faults == [("503", "/sets/train.zip")] * 2


def test_a_part_whose_etag_changed_is_refused_by_name(served, tmp_path):
    server, url = served
    with pf.open_archive(url, cache_dir=tmp_path / "cache") as reader:
        reader.read(0)
        part = os.path.join(server.root, "sets", "train-00002.zip")
        with open(part, "r+b") as file:  # the same size, another content: another ETag
            file.seek(100)
            byte = file.read(1)
            file.seek(100)
            file.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(RemoteChangedError, match="train-00002.zip.*ETag"):
            reader.read(2 * PER_PART)


@pytest.mark.parametrize("what", ["a set's part", "one archive"])
def test_an_object_that_changes_during_its_download_is_named_by_its_url_as_changed(what, served, local_sets,
                                                                                    tmp_path):
    server, url = served
    if what == "one archive":
        url = server.url("sets/train-00001.zip")
    # one archive: its head is read first (to tell an archive from a set's index), then it is fetched
    server.fault("change", times=1, match="train-00001.zip", skip=1 if what == "one archive" else 0)
    cache = tmp_path / "cache"
    with pytest.raises(RemoteChangedError) as caught:
        with pf.open_archive(url, cache_dir=cache) as reader:
            reader.read(PER_PART if what == "a set's part" else 0)
    message = str(caught.value)
    assert message.startswith(url.rsplit("/", 1)[0] + "/train-00001.zip")
    assert "changed in the store while it was downloaded" in message
    assert str(cache) not in message and "tmp-" not in message
    assert server.faults == [("change", "/sets/train-00001.zip")]


def test_a_stalled_body_fails_within_seconds_by_name(served, tmp_path, monkeypatch):
    server, url = served
    monkeypatch.setattr(remote_module, "ATTEMPTS", 3)
    server.fault("stall", times=100, match="train-00000.zip")
    started = time.monotonic()
    with pf.open_archive(url, cache_dir=tmp_path / "cache", storage_options={"stall_timeout": 1}) as reader:
        with pytest.raises(RemoteUnavailableError, match="train-00000.zip.*stall timeout"):
            reader.read(0)
    assert time.monotonic() - started < 15
    assert len(server.faults) == 3  # each try stalled once, then timed out


def test_a_try_past_its_deadline_is_retried_even_with_the_protocols_timeouts_off(served, local_sets, tmp_path):
    """A request the HTTP client would wait on forever (here its own timeouts are off; in the wild, a
    connection pool or a third-party coroutine that never answers) is given up after its deadline and
    tried again, instead of hanging the job."""
    import aiohttp

    server, url = served
    server.fault("stall", times=2, match="train-00000.zip")  # the server holds each for 20 s
    options = {"stall_timeout": 1, "client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None)}}
    started = time.monotonic()
    with pf.open_archive(url, cache_dir=tmp_path / "cache", storage_options=options) as reader, \
            pf.open_archive(local_sets["zip"]) as local:
        assert np.array_equal(reader.read(0), local.read(0))
    assert len(server.faults) == 2
    assert time.monotonic() - started < 15  # two deadlines of about 2 s each, not two 20-s stalls


@pytest.mark.parametrize("kind", ["drip", "halfway"])
def test_a_body_slower_than_the_floor_rate_fails_its_try_and_is_retried(kind, served, local_sets, tmp_path):
    """A byte every 50 ms never trips a stall timeout (here 30 s), nor does half a body and then
    nothing before it: the floor rate fails the try within its grace and the next try reads."""
    server, url = served
    server.fault(kind, times=1, match="train-00000.zip")
    options = {"stall_timeout": 30, "min_rate": "64KiB", "rate_grace": 1}
    with pf.open_archive(url, cache_dir=tmp_path / "cache", storage_options=options) as reader, \
            pf.open_archive(local_sets["zip"]) as local:
        assert np.array_equal(reader.read(0), local.read(0))
    assert server.faults == [(kind, "/sets/train-00000.zip")]


def test_a_body_that_keeps_dripping_fails_by_name_saying_it_was_too_slow(served, tmp_path, monkeypatch):
    server, url = served
    monkeypatch.setattr(remote_module, "ATTEMPTS", 2)
    server.fault("drip", times=100, match="train-00000.zip")
    options = {"stall_timeout": 30, "min_rate": 65536, "rate_grace": 1}
    with pf.open_archive(url, cache_dir=tmp_path / "cache", storage_options=options) as reader:
        with pytest.raises(RemoteUnavailableError, match=r"train-00000.zip.*too slow.*64.0 KiB/s") as caught:
            reader.read(0)
    assert "floor rate" in str(caught.value) and len(server.faults) == 2


def test_the_floor_rate_comes_from_the_options_then_the_environment(monkeypatch):
    monkeypatch.setenv("PF_MIN_RATE", "1MiB")
    monkeypatch.setenv("PF_RATE_GRACE", "3")
    assert Store().floor_rate == (1 << 20, 3) and Store({"min_rate": 0, "rate_grace": 0}).floor_rate == (0, 0)
    monkeypatch.delenv("PF_MIN_RATE")
    monkeypatch.delenv("PF_RATE_GRACE")
    assert Store().floor_rate == (remote_module.MIN_RATE, remote_module.RATE_GRACE_S)
    for bad in ({"min_rate": "fast"}, {"min_rate": -1}, {"rate_grace": "soon"}):
        with pytest.raises(RemoteError, match="floor rate|rate grace"):
            Store(bad)


def test_the_stall_timeout_comes_from_the_options_then_the_environment(monkeypatch):
    monkeypatch.setenv("PF_STALL_TIMEOUT", "7")
    assert Store().stall_timeout == 7 and Store({"stall_timeout": 2}).stall_timeout == 2
    monkeypatch.delenv("PF_STALL_TIMEOUT")
    assert Store().stall_timeout == remote_module.STALL_TIMEOUT_S
    with pytest.raises(RemoteError, match="stall timeout"):
        Store({"stall_timeout": "soon"})


def test_a_missing_object_over_http_is_not_found(server, tmp_path):
    with pytest.raises(RemoteNotFoundError, match="missing.zip"):
        pf.open_archive(server.url("missing.zip"), cache_dir=tmp_path / "cache")


def test_an_object_of_no_known_size_is_refused_by_name(served, tmp_path):
    server, url = served
    server.send_length = False
    with pytest.raises(RemoteError, match="train.zip.*no size"):
        pf.open_archive(url, cache_dir=tmp_path / "cache")


def test_a_memmap_set_over_http_is_refused_by_name(server, local_sets, tmp_path):
    url = server.url("sets/train.memmap")
    storage.upload(local_sets["memmap"], url)
    with pytest.raises(RemoteError, match="train.memmap.*HTTP has no listing"):
        pf.open_archive(url, cache_dir=tmp_path / "cache")


def test_the_store_sends_a_presigned_urls_signature_and_names_it_without(served):
    server, url = served
    server.require_query("X-Amz-Signature", SIGNATURE)
    signed = url + SIGNED
    store = Store()
    assert store.read(signed, 0, 4) == open(os.path.join(server.root, "sets", "train.zip"), "rb").read(4)
    with pytest.raises(RemoteAccessError) as refused:
        store.read(f"{url}?X-Amz-Expires=60&X-Amz-Signature=wrong{SIGNATURE}", 0, 4)
    assert "wrong" not in str(refused.value) and "X-Amz-Signature=***" in str(refused.value)


def test_a_presigned_set_reads_with_its_signature_and_shows_none(served, local_sets, tmp_path):
    server, url = served
    server.require_query("X-Amz-Signature", SIGNATURE)
    signed = url + SIGNED
    cache = tmp_path / "cache"
    with pf.open_archive(signed, cache_dir=cache) as remote, pf.open_archive(local_sets["zip"]) as local:
        assert SIGNED not in remote.path and "X-Amz-Signature=***" in remote.path
        assert np.array_equal(everything(remote)[0], everything(local)[0])
    for folder, _, names in os.walk(cache):  # its records, logs and copies
        for name in names:
            with open(os.path.join(folder, name), "rb") as file:
                content = file.read()
                assert quote(SIGNATURE, safe="").encode() not in content and SIGNATURE.encode() not in content, name
