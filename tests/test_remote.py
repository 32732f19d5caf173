"""Sets in object storage, read through the node-local cache, against a real S3 server (moto).

Every format as parts (and as one archive, cached whole); the fault proxy in front of the server
for retries and byte counts; two processes on one cache; a process killed while it downloads; a
cache of a quarter of the set over three epochs.  Each fault test was seen failing against a
broken variant: no check on arrival, eviction of a part in use, no retry.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import storage
from packed_formats.errors import (
    InsufficientSpaceError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from packed_formats.storage import remote as remote_module
from packed_formats.storage import remote_set
from packed_formats.synthetic import make_image_folder

pytest.importorskip("s3fs")
FORMATS = ["zip", "hdf5", "lmdb", "memmap"]
EXT = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}
SAMPLES, PER_PART = 48, 4  # 12 parts


@pytest.fixture(scope="module")
def local_sets(tmp_path_factory):
    """format -> (a sharded raw set of 6 parts, one unsharded archive), on local disk."""
    root = tmp_path_factory.mktemp("remote-sources")
    images = make_image_folder(root / "images", SAMPLES // 6, sizes=(20, 36))
    made = {}
    for fmt in FORMATS:
        sharded = root / fmt / f"train{EXT[fmt]}"
        single = root / fmt / f"single{EXT[fmt]}"
        os.makedirs(sharded.parent)
        pf.convert(images, sharded, format=fmt, mode="raw", size=16, shard_size=PER_PART, workers=1)
        pf.convert(images, single, format=fmt, mode="raw", size=16, workers=1)
        made[fmt] = (str(sharded), str(single))
    return made


@pytest.fixture(scope="module")
def remote_sets(s3, local_sets):
    """format -> (URL of the set, URL of the single archive), uploaded once for the module."""
    bucket = s3.bucket()
    urls = {}
    with pytest.MonkeyPatch.context() as patch:
        s3.use_env(patch)
        for fmt, (sharded, single) in local_sets.items():
            urls[fmt] = (f"s3://{bucket}/{fmt}/{os.path.basename(sharded)}",
                         f"s3://{bucket}/{fmt}/{os.path.basename(single)}")
            storage.upload(sharded, urls[fmt][0])
            storage.upload(single, urls[fmt][1])
    return urls


PART = re.compile(r"/train-\d{5}")  # a part's objects (a memmap part's files too), not the index or samples


def part_bytes_sent(proxy) -> int:
    """Body bytes the proxy sent of the sets' parts."""
    return sum(v["bytes"] for k, v in proxy.stats()["keys"].items() if PART.search(k))


def everything(reader):
    keys = [reader.index.key(i) for i in range(len(reader))]
    return reader.read_many(np.arange(len(reader))), np.asarray(reader.index.labels), keys


def same_content(remote, local):
    a, b = everything(remote), everything(local)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.slow
# ---- reading ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["sharded", "single"])
def test_a_remote_set_reads_as_the_local_one(fmt, which, s3_env, local_sets, remote_sets, tmp_path):
    k = 0 if which == "sharded" else 1
    with pf.open_archive(remote_sets[fmt][k], cache_dir=tmp_path) as remote, \
            pf.open_archive(local_sets[fmt][k]) as local:
        assert remote.path == remote_sets[fmt][k] and len(remote) == len(local)
        same_content(remote, local)
        dataset = pf.PackedDataset(remote_sets[fmt][k], cache_dir=tmp_path, output="numpy")
        image, label = dataset[5]
        assert np.array_equal(image, local.read(5)) and label == int(local.index.labels[5])


def test_opening_reads_no_part(s3_env, s3_proxy, remote_sets, tmp_path, monkeypatch):
    proxy = s3_proxy(rate=0.0)
    proxy.use_env(monkeypatch)
    url = remote_sets["zip"][0]
    with pf.open_archive(url, cache_dir=tmp_path) as reader:
        assert len(reader) == SAMPLES
        assert part_bytes_sent(proxy) == 0
        reader.read(0)  # now part 0, and only it
        fetched = [k for k, v in proxy.stats()["keys"].items() if v["bytes"] > 0 and PART.search(k)]
        assert [os.path.basename(k) for k in fetched] == ["train-00000.zip"]


@pytest.mark.slow
def test_info_verify_and_stage_take_a_url(s3, remote_sets, local_sets, tmp_path):
    env = dict(s3.subprocess_env(), PF_CACHE_DIR=str(tmp_path / "cache"))
    cli = [sys.executable, "-m", "packed_formats"]
    url = remote_sets["hdf5"][0]
    info = subprocess.run(cli + ["info", "--json", url], capture_output=True, text=True, env=env, timeout=120)
    assert info.returncode == 0, info.stderr
    facts = json.loads(info.stdout)
    assert facts["samples"] == SAMPLES and len(facts["parts"]) == SAMPLES // PER_PART
    checked = subprocess.run(cli + ["verify", url], capture_output=True, text=True, env=env, timeout=120)
    assert checked.returncode == 0 and "OK" in checked.stdout, checked.stderr
    staged = subprocess.run(cli + ["stage", url, "--to", str(tmp_path / "node"), "-q"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert staged.returncode == 0, staged.stderr
    with pf.open_archive(staged.stdout.strip()) as copy, pf.open_archive(local_sets["hdf5"][0]) as local:
        same_content(copy, local)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_a_loader_with_workers_reads_every_sample_once(context, s3_env, local_sets, remote_sets, tmp_path):
    # workers of a forkserver started earlier in the session have its environment, not this test's:
    # the endpoint and keys travel with the loader as storage options (as a user's would)
    options = {"endpoint_url": s3_env.endpoint_url, "key": "testing", "secret": "testing"}
    loader = pf.make_loader(remote_sets["lmdb"][0], batch_size=5, num_workers=2, cache_dir=tmp_path,
                            multiprocessing_context=context, return_index=True, storage_options=options)
    with pf.open_archive(local_sets["lmdb"][0]) as local:
        for _ in range(2):
            seen = []
            for images, labels, index in loader:
                idx = index.numpy()
                seen.extend(idx.tolist())
                expected = np.ascontiguousarray(local.read_many(idx).transpose(0, 3, 1, 2))
                assert np.array_equal(images.numpy(), expected)
                assert np.array_equal(labels.numpy(), np.asarray(local.index.labels)[idx])
            assert sorted(seen) == list(range(SAMPLES))


# ---- the cache ------------------------------------------------------------------------------------
def test_a_part_in_use_is_never_evicted_and_only_downloads_are(s3_env, remote_sets, tmp_path):
    url = remote_sets["zip"][0]
    (tmp_path / "mine.txt").write_text("not the cache's")
    holder = pf.open_archive(url, cache_dir=tmp_path)
    holder.read(0)  # holds part 0
    part0 = holder.backend.entry_path(0)
    part_bytes = os.path.getsize(part0)
    with pf.open_archive(url, cache_dir=tmp_path, cache_limit=3 * part_bytes + 1, max_open_parts=1) as small:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", storage.CacheOverLimitWarning)
            for i in range(0, SAMPLES, PER_PART):
                small.read(i)
        assert os.path.exists(part0), "a part in use by another reader was evicted"
        cached = [p for p in range(SAMPLES // PER_PART) if os.path.exists(small.backend.entry_path(p))]
        assert 0 in cached and len(cached) <= 3
    holder.close()
    assert (tmp_path / "mine.txt").read_text() == "not the cache's"


@pytest.mark.slow
def test_a_cache_limit_of_a_quarter_over_three_epochs_fetches_each_part_once_an_epoch(
        s3_env, s3_proxy, local_sets, remote_sets, tmp_path, monkeypatch):
    proxy = s3_proxy(rate=0.0)
    proxy.use_env(monkeypatch)
    url, parts = remote_sets["zip"][0], SAMPLES // PER_PART
    with pf.open_archive(local_sets["zip"][0]) as local:
        part_bytes = max(os.path.getsize(p.path) for p in local.backend.parts)
        set_bytes = sum(os.path.getsize(p.path) for p in local.backend.parts)
        limit = set_bytes // 4  # 3 parts
        loader = pf.make_loader(url, batch_size=4, num_workers=0, shuffle="window", window=1, cache_dir=tmp_path,
                                cache_limit=limit, return_index=True)
        for epoch in range(3):
            proxy.reset_stats()
            began = time.time()
            seen = []
            for images, _, index in loader:
                seen.extend(index.tolist())
                assert np.array_equal(images.numpy(), local.read_many(index.numpy()).transpose(0, 3, 1, 2))
            downloaded = part_bytes_sent(proxy)
            assert sorted(seen) == list(range(SAMPLES)), epoch
            fetched = [d["url"].rsplit("/", 1)[-1] for d in storage.PartCache(str(tmp_path)).downloads(began)]
            assert downloaded <= 1.05 * set_bytes, (epoch, downloaded, set_bytes, fetched)
            # within the bound, but for what is in use at once: the reader's window and one (2 parts), the
            # batch's part pinned and the next one downloading (a cache this small is one part over at times)
            assert storage.PartCache(str(tmp_path)).usage() <= limit + 2 * part_bytes
    assert parts > 4


def test_a_global_shuffle_with_a_small_cache_warns_with_its_cost(s3_env, remote_sets, tmp_path):
    with pytest.warns(storage.CacheThrashWarning, match=r"downloads about .* an epoch .*shuffle='window'"):
        pf.make_loader(remote_sets["zip"][0], batch_size=8, num_workers=0, cache_dir=tmp_path, cache_limit=2000)


def _read_all(url: str, cache_dir: str, env: dict) -> list:
    os.environ.update(env)
    with pf.open_archive(url, cache_dir=cache_dir) as reader:
        return np.asarray(reader.read_many(np.arange(len(reader)))).sum(axis=(1, 2, 3)).tolist()


@pytest.mark.slow
def test_two_jobs_on_one_cache_download_each_part_once(s3, s3_proxy, local_sets, remote_sets, tmp_path):
    proxy = s3_proxy(rate=0.0)
    url = remote_sets["memmap"][0]
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        results = pool.starmap(_read_all, [(url, str(tmp_path), proxy.env)] * 2)
    assert results[0] == results[1]
    with pf.open_archive(local_sets["memmap"][0]) as local:
        set_bytes = sum(size for p in local.backend.parts for _, size in pf.space.archive_files(p.path))
    downloaded = part_bytes_sent(proxy)
    assert downloaded == set_bytes


@pytest.mark.slow
def test_a_download_killed_midway_leaves_nothing_that_is_read_later(s3, s3_proxy, local_sets, remote_sets,
                                                                     tmp_path, monkeypatch):
    proxy = s3_proxy(rate=0.0)
    url, opened = remote_sets["zip"][0], tmp_path / "opened"
    code = (f"import time, packed_formats as pf; r = pf.open_archive({url!r}, cache_dir={str(tmp_path)!r}); "
            f"open({str(opened)!r}, 'w').close(); time.sleep(1); r.read(0)")
    child = subprocess.Popen([sys.executable, "-c", code], env=proxy.subprocess_env())
    deadline = time.monotonic() + 60
    while not opened.exists():
        assert time.monotonic() < deadline and child.poll() is None, "the set did not open"
        time.sleep(0.05)
    proxy.set_rate(1.0, kinds=("drop",))  # every body GET fails now: the part's download hangs in retries
    while not list(tmp_path.glob("*/.pf/tmp-*")):
        assert time.monotonic() < deadline and child.poll() is None, "the download never started"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    proxy.set_rate(0.0)
    proxy.use_env(monkeypatch)
    with pf.open_archive(url, cache_dir=tmp_path) as remote, pf.open_archive(local_sets["zip"][0]) as local:
        same_content(remote, local)
    assert not list(tmp_path.glob("*/.pf/tmp-*"))


def test_a_full_cache_disk_raises_insufficient_space_and_leaves_nothing(s3_env, remote_sets, tmp_path, monkeypatch):
    from packed_formats import space

    monkeypatch.setattr(space, "free_bytes", lambda directory: 10)
    with pytest.raises(InsufficientSpaceError, match=str(tmp_path)):
        with pf.open_archive(remote_sets["zip"][0], cache_dir=tmp_path) as reader:
            reader.read(0)
    assert not list(tmp_path.glob("*/.pf/tmp-*")) and not list(tmp_path.glob("*/train-*"))


@pytest.mark.slow
# ---- faults ---------------------------------------------------------------------------------------
def test_transient_faults_are_retried_and_no_corrupt_sample_is_returned(s3_env, s3_proxy, local_sets,
                                                                        remote_sets, tmp_path, monkeypatch):
    import s3fs

    proxy = s3_proxy(rate=0.3, seed=7)
    proxy.use_env(monkeypatch)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries and s3fs's: ours are under test
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.01)
    with pf.open_archive(remote_sets["hdf5"][0], cache_dir=tmp_path) as remote, \
            pf.open_archive(local_sets["hdf5"][0]) as local:
        same_content(remote, local)
    faults = sum(sum(v["faults"].values()) for v in proxy.stats()["keys"].values())
    assert faults > 0


@pytest.mark.slow
def test_a_store_that_keeps_failing_raises_a_named_error(s3_env, s3_proxy, remote_sets, tmp_path, monkeypatch):
    import s3fs

    proxy = s3_proxy(rate=1.0, kinds=("503",))
    proxy.use_env(monkeypatch)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries and s3fs's: ours are under test
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(remote_module, "ATTEMPTS", 2)
    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.01)
    with pytest.raises(RemoteUnavailableError, match="failed 2 times"):
        with pf.open_archive(remote_sets["zip"][0], cache_dir=tmp_path) as reader:
            reader.read(0)


def test_a_corrupt_download_is_found_by_its_checksums_and_fetched_again(s3_env, local_sets, remote_sets, tmp_path,
                                                                        monkeypatch):
    real, calls = remote_set._download, []

    def damaging(store, part, temp):  # the network flips a byte in the first download only
        real(store, part, temp)
        calls.append(part.name)
        if len(calls) == 1:
            with open(temp, "r+b") as file:
                file.seek(os.path.getsize(temp) // 2)
                byte = file.read(1)
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte[0] ^ 0xFF]))

    monkeypatch.setattr(remote_set, "_download", damaging)
    with pf.open_archive(remote_sets["zip"][0], cache_dir=tmp_path) as remote, \
            pf.open_archive(local_sets["zip"][0]) as local:
        assert np.array_equal(remote.read_many(np.arange(PER_PART)), local.read_many(np.arange(PER_PART)))
    assert calls == ["train-00000.zip", "train-00000.zip"]


def test_a_part_that_changed_in_the_store_is_refused_by_name(s3, s3_env, local_sets, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/train.zip"
    storage.upload(local_sets["zip"][0], url)
    with pf.open_archive(url, cache_dir=tmp_path / "c") as reader:
        reader.read(0)
        other = open(os.path.join(os.path.dirname(local_sets["zip"][0]), "train-00002.zip"), "rb").read()
        s3.put(f"s3://{bucket}/train-00001.zip", other)  # same count, other samples
        with pytest.raises(RemoteChangedError, match="train-00001.zip"):
            reader.read(PER_PART)


def test_missing_objects_are_named_and_credentials_never_shown(s3, s3_env, tmp_path):
    bucket = s3.bucket()
    with pytest.raises(RemoteNotFoundError) as caught:
        pf.open_archive(f"s3://AKIAEXAMPLE:s3cr3t@{bucket}/nothing.zip", cache_dir=tmp_path)
    assert f"{bucket}/nothing.zip" in str(caught.value) and "s3cr3t" not in str(caught.value)
    assert storage.redact("https://h/x?X-Amz-Signature=abc&a=1") == "https://h/x?X-Amz-Signature=***&a=1"


def test_a_set_is_not_there_until_its_index_is_uploaded_last(s3, s3_env, local_sets):
    bucket = s3.bucket()
    url = f"s3://{bucket}/train.lmdb"
    order = []

    def check(written):
        order.append(os.path.basename(written.split("/train.lmdb")[0]) if written.endswith("train.lmdb")
                     else written)
        if not written.endswith("/train.lmdb"):
            with pytest.raises(RemoteNotFoundError):
                pf.open_archive(url)

    storage.upload(local_sets["lmdb"][0], url, on_object=check)
    assert order[-1] == bucket and order[-2].endswith("train-samples.npz")


def test_resume_of_a_remote_window_shuffle_is_exact(s3_env, remote_sets, tmp_path):
    url = remote_sets["zip"][0]
    options = dict(batch_size=4, num_workers=0, shuffle="window", window=2, cache_dir=tmp_path, return_index=True)
    whole = [index.tolist() for _, _, index in pf.make_loader(url, **options)]
    first = pf.make_loader(url, **options)
    batches = iter(first)
    done = [next(batches)[2].tolist() for _ in range(5)]
    state = first.state_dict()
    second = pf.make_loader(url, **options)
    second.load_state_dict(state)
    rest = [index.tolist() for _, _, index in second]
    assert done + rest == whole


@pytest.mark.slow
def test_convert_reads_a_tar_in_a_bucket_and_writes_a_set_to_one(s3, s3_env, local_sets, tmp_path):
    import tarfile

    bucket = s3.bucket()
    images = os.path.join(os.path.dirname(os.path.dirname(local_sets["zip"][0])), "images")
    with tarfile.open(tmp_path / "images.tar", "w") as tar:
        tar.add(images, arcname="images")
    storage.Store().upload(str(tmp_path / "images.tar"), f"s3://{bucket}/src/images.tar")
    summary = pf.convert(f"s3://{bucket}/src/images.tar", f"s3://{bucket}/out/train.zip", mode="raw", size=16,
                         shard_size=PER_PART, workers=1, subdir="images", quiet=True)
    assert summary.destination == f"s3://{bucket}/out/train.zip" and summary.parts[0].startswith("s3://")
    with pf.open_archive(f"s3://{bucket}/out/train.zip", cache_dir=tmp_path / "c") as remote, \
            pf.open_archive(local_sets["zip"][0]) as local:
        same_content(remote, local)
    with pytest.raises(pf.ArchiveExistsError):
        pf.convert(f"s3://{bucket}/src/images.tar", f"s3://{bucket}/out/train.zip", mode="raw", size=16,
                   workers=1, subdir="images", quiet=True)


@pytest.mark.slow
def test_bench_measures_a_remote_set_per_epoch(s3, remote_sets, tmp_path):
    out = tmp_path / "remote.json"
    done = subprocess.run([sys.executable, "-m", "packed_formats", "bench", remote_sets["zip"][0], "--workers", "0",
                           "--epochs", "2", "--batch-size", "4", "--cache-limit", "20KB", "--out", str(out)],
                          capture_output=True, text=True, env=s3.subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["epoch"] for r in rows] == [1, 2] and all(r["samples"] == SAMPLES for r in rows)
    assert all(0.5 <= r["downloaded_over_set"] <= 1.05 for r in rows) and "window" in done.stdout


def test_missing_credentials_are_an_access_error_not_retried(tmp_path):
    from botocore.exceptions import NoCredentialsError

    error = remote_module._classify(NoCredentialsError(), "s3://bucket/train.zip")
    assert isinstance(error, pf.RemoteAccessError) and "storage_options" in str(error)
