"""What a remote set reads from a store (its index, sample index, listings, parts) and from its node-local
cache is untrusted: it never chooses a local path, a missing or malformed field is a named error, a cached
copy is compared with the set's index, and trouble with the cache directory is reported as such.

Against a real S3 server (moto), with a small set: 3 parts of 4 samples, in ZIP and in memmap.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import warnings
import zipfile
import zlib

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import cli, storage
from packed_formats.backends.sharded import index_text
from packed_formats.errors import (
    CacheDirectoryError,
    CorruptArchiveError,
    InsufficientSpaceError,
    PackedFormatError,
)
from packed_formats.manifest import ArchiveManifest
from packed_formats.storage import cache as cache_module
from packed_formats.storage.upload import samples_name
from packed_formats.synthetic import make_image_folder

from .conftest import small_remote_sets

pytest.importorskip("s3fs")
PER_PART, PARTS = 4, 3
SAMPLES = PER_PART * PARTS


@pytest.fixture(scope="module")
def local_sets(tmp_path_factory):
    """format -> a local sharded raw set of 3 parts of 4 samples (16x16x3)."""
    root = tmp_path_factory.mktemp("untrusted-sources")
    images = make_image_folder(root / "images", PER_PART, classes=("a", "b", "c"), sizes=(20, 30))
    return small_remote_sets(root, images, PER_PART)


def uploaded(s3, local: str) -> str:
    """The set at ``local`` uploaded to a new bucket; its URL."""
    url = f"s3://{s3.bucket()}/{os.path.basename(local)}"
    storage.upload(local, url)
    return url


def index_of(s3, url: str) -> dict:
    return json.loads(s3.fs().cat_file(url))


def put_index(s3, url: str, spec: dict) -> None:
    """Write the set index ``spec`` at ``url``, sealed as a writer seals one (its checksum is no signature)."""
    extra = {k: v for k, v in spec.items() if k not in ("packed_formats_shards", "format", "set_id", "parts", "crc32")}
    parts = [(p["name"], p["count"], p.get("content", "")) for p in spec["parts"]]
    text = index_text(spec["format"], parts, spec.get("set_id"), **extra)
    s3.put(url, text.encode())


def put_samples(s3, url: str, data: bytes) -> None:
    """Replace the set's sample index by ``data``, and record its size and CRC32 in the set's index."""
    spec = index_of(s3, url)
    s3.put(url.rsplit("/", 1)[0] + "/" + spec["samples"]["name"], data)
    spec["samples"].update(size=len(data), crc32=zlib.crc32(data))
    put_index(s3, url, spec)


def sample_arrays(local: str) -> dict:
    """The arrays ``upload`` writes as the set's sample index."""
    with pf.open_archive(local) as reader:
        return {"labels": np.asarray(reader.index.labels, dtype=np.int64),
                "keys": np.asarray(reader.index.keys).astype(f"S{reader.index.keys.dtype.itemsize}"),
                "crc32": np.asarray(reader.index.crc32, dtype=np.uint32),
                "counts": np.full(PARTS, PER_PART, dtype=np.int64)}


def npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def read_everything(url: str, cache_dir, **options):
    with pf.open_archive(url, cache_dir=cache_dir, **options) as reader:
        return reader.read_many(np.arange(len(reader))), np.array(reader.index.labels), list(reader.classes)


def local_content(local: str):
    with pf.open_archive(local) as reader:
        return reader.read_many(np.arange(len(reader))), np.array(reader.index.labels), list(reader.classes)


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


# ---- local paths from store content ----------------------------------------------------------------------
def test_a_sample_index_member_that_names_a_path_is_refused_and_writes_nothing_outside(s3_env, local_sets,
                                                                                      tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    outside = tmp_path / "escaped.npy"  # where "../../../../escaped" leads from the cache's temporary folder
    outside.write_bytes(b"mine")
    arrays = sample_arrays(local_sets["zip"])
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, array in dict(arrays, **{"../../../../escaped": arrays["labels"]}).items():
            member = io.BytesIO()
            np.save(member, array)
            archive.writestr(f"{name}.npy", member.getvalue())
    put_samples(s3_env, url, buffer.getvalue())
    with pytest.raises(CorruptArchiveError, match=r"escaped") as caught:
        pf.open_archive(url, cache_dir=tmp_path / "cache")
    assert samples_name("train.zip") in str(caught.value)
    assert outside.read_bytes() == b"mine"
    assert not list((tmp_path / "cache").rglob("*escaped*"))


@pytest.mark.parametrize("key", ["../../../../escaped", "ABSOLUTE", "sub//x", "./x", "sub/../../x", "sp ace",
                                 "a" * 256])
def test_a_folder_part_listing_an_odd_key_is_refused_naming_it(key, s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["memmap"])
    outside = tmp_path / "escaped"
    outside.write_bytes(b"mine")
    if key == "ABSOLUTE":  # the listing's relative path is then an absolute path into tmp_path
        key = "/" + str(outside).lstrip("/")
    s3_env.put(url.rsplit("/", 1)[0] + f"/train-00000.memmap/{key}", b"theirs")
    with pytest.raises(CorruptArchiveError) as caught:
        with pf.open_archive(url, cache_dir=tmp_path / "cache") as reader:
            reader.read(0)
    assert repr(key) in str(caught.value) and "train-00000.memmap" in str(caught.value)
    assert outside.read_bytes() == b"mine"


def test_empty_folder_objects_beside_a_folder_parts_files_are_no_trouble(s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["memmap"])
    s3_env.put(url.rsplit("/", 1)[0] + "/train-00000.memmap/", b"")  # as some tools mark a folder
    s3_env.put(url.rsplit("/", 1)[0] + "/train-00001.memmap/sub/", b"")
    assert same(read_everything(url, tmp_path), local_content(local_sets["memmap"]))


def test_confined_refuses_a_path_that_leaves_its_folder_by_dots_or_by_a_link(tmp_path):
    base = tmp_path / "entry"
    base.mkdir()
    (base / "link").symlink_to(tmp_path)
    assert cache_module.confined(str(base), "a/b.npy") == str(base / "a" / "b.npy")
    for relative in ("../x", "/etc/passwd", "a/../../x", "link/x", ".", ""):
        with pytest.raises(ValueError):
            cache_module.confined(str(base), relative)


@pytest.mark.parametrize("name,etag", [("../../x.zip", "e"), ("a/b.zip", "../.."), ("..", "/"), ("x" * 400 + ".zip",
                                                                                                  "e" * 300)])
def test_an_entry_name_from_any_part_name_or_etag_is_one_plain_bounded_name(name, etag):
    entry = cache_module.entry_name(name, etag)
    assert "/" not in entry and entry not in (".", "..") and not entry.startswith(".") and len(entry) < 128
    assert entry != cache_module.entry_name(name + "x", etag) and entry != cache_module.entry_name(name, etag + "x")


def test_part_names_too_long_for_the_file_system_read_through_the_cache(s3_env, local_sets, tmp_path):
    bucket = s3_env.bucket()
    folder, long = os.path.dirname(local_sets["zip"]), "p" * 300
    names = [f"{long}-{k}.zip" for k in range(PARTS)]
    for k, name in enumerate(names):
        s3_env.upload(os.path.join(folder, f"train-{k:05d}.zip"), f"s3://{bucket}/{name}")
    with open(local_sets["zip"]) as file:
        listed = json.load(file)
    put_index(s3_env, f"s3://{bucket}/train.zip", {"format": "zip", "set_id": listed.get("set_id"), "parts": [
        {"name": n, "count": PER_PART, "content": p["content"]} for n, p in zip(names, listed["parts"])]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remote = read_everything(f"s3://{bucket}/train.zip", tmp_path)
    assert same(remote, local_content(local_sets["zip"]))


# ---- the sample index --------------------------------------------------------------------------------------
def _without(arrays, name):
    return {k: v for k, v in arrays.items() if k != name}


MALFORMED = {
    "counts missing": (lambda a: npz(**_without(a, "counts")), "counts"),
    "crc32 missing": (lambda a: npz(**_without(a, "crc32")), "crc32"),
    "labels as floats": (lambda a: npz(**dict(a, labels=a["labels"].astype(np.float64))), "labels"),
    "labels too short": (lambda a: npz(**dict(a, labels=a["labels"][:-1])), "labels|counts"),
    "keys not bytes": (lambda a: npz(**dict(a, keys=np.arange(SAMPLES))), "keys"),
    "counts negative": (lambda a: npz(**dict(a, counts=np.array([-4, 8, 8]))), "counts"),
    "counts not summing": (lambda a: npz(**dict(a, counts=np.array([4, 4, 3]))), "counts"),
    "crc32 too long": (lambda a: npz(**dict(a, crc32=np.zeros(SAMPLES + 1, np.uint32))), "crc32"),
    "a pickled array": (lambda a: npz(**dict(a, labels=np.array([{"x": 1}] * SAMPLES, dtype=object))), "labels"),
    "an unknown field": (lambda a: npz(**dict(a, extra=a["labels"])), "extra"),
    "not an npz": (lambda a: b"these are not the bytes of an npz file", "npz"),
    "one array": (lambda a: (lambda b: (np.save(b, a["labels"]), b.getvalue())[1])(io.BytesIO()), "npz"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_sample_index_is_a_named_error(case, s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    make, field = MALFORMED[case]
    put_samples(s3_env, url, make(sample_arrays(local_sets["zip"])))
    with pytest.raises(CorruptArchiveError, match=field) as caught:
        with pf.open_archive(url, cache_dir=tmp_path) as reader:
            reader.read(0)
    assert "train" in str(caught.value) and str(caught.value).startswith("s3://")


@pytest.mark.parametrize("field,value", [("name", "../other.npz"), ("size", "12"), ("crc32", -1), ("size", None)])
def test_a_malformed_sample_index_record_in_the_set_index_is_a_named_error(field, value, s3_env, local_sets,
                                                                            tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    spec = index_of(s3_env, url)
    spec["samples"][field] = value
    put_index(s3_env, url, spec)
    with pytest.raises(CorruptArchiveError, match=field):
        pf.open_archive(url, cache_dir=tmp_path)


# ---- the set's index against its parts ---------------------------------------------------------------------
def test_a_warm_cache_refuses_a_sample_index_that_disagrees_with_its_parts(s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    assert same(read_everything(url, tmp_path), local_content(local_sets["zip"]))  # every part now cached
    arrays = sample_arrays(local_sets["zip"])
    put_samples(s3_env, url, npz(**dict(arrays, labels=arrays["labels"][::-1].copy())))
    with pytest.raises(PackedFormatError, match="labels"):
        read_everything(url, tmp_path)


@pytest.mark.parametrize("field,change", [("classes", lambda m: {"classes": m.classes[::-1]}),
                                          ("shape", lambda m: {"shape": (32, 8, 3)})])
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_a_set_manifest_that_disagrees_with_its_parts_is_refused_naming_the_field(field, change, cache, s3_env,
                                                                                   local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    if cache == "warm":
        read_everything(url, tmp_path)
    spec = index_of(s3_env, url)
    manifest = ArchiveManifest.from_json(spec["manifest"])
    spec["manifest"] = dataclasses.replace(manifest, **change(manifest)).to_json()
    put_index(s3_env, url, spec)
    with pytest.raises(PackedFormatError, match=f"manifest's {field}"):
        with pf.open_archive(url, cache_dir=tmp_path) as reader:
            reader.read(0)


def test_a_part_listed_twice_is_refused_when_the_set_is_opened(s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    spec = index_of(s3_env, url)
    spec["parts"] = [spec["parts"][0]] + spec["parts"]
    put_index(s3_env, url, spec)
    arrays = sample_arrays(local_sets["zip"])
    first = slice(0, PER_PART)
    put_samples(s3_env, url, npz(**{k: np.concatenate([v[first], v]) for k, v in arrays.items() if k != "counts"},
                                 counts=np.full(PARTS + 1, PER_PART, dtype=np.int64)))
    with pytest.raises(CorruptArchiveError, match="train-00000.zip.* twice"):
        pf.open_archive(url, cache_dir=tmp_path)


# ---- the cache directory ------------------------------------------------------------------------------------
def test_the_default_cache_directory_is_this_users_and_refused_when_another_owns_it(s3_env, local_sets, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.delenv(storage.CACHE_DIR_VARIABLE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = cache_module.default_cache_dir()
    assert directory == str(tmp_path / f"packed_formats-cache-{os.geteuid()}")
    os.makedirs(directory)
    try:
        os.chown(directory, os.geteuid() + 1, -1)
    except PermissionError:
        pytest.skip("only root can give a directory to another user")
    url = uploaded(s3_env, local_sets["zip"])
    with pytest.raises(CacheDirectoryError, match="another user") as caught:
        pf.open_archive(url)
    assert directory in str(caught.value) and storage.CACHE_DIR_VARIABLE in str(caught.value)


def _open_as_another_user(url: str, cache: str, answer) -> None:
    """In a forked child: as nobody when root (who may write anywhere), open the set and read a sample."""
    try:
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        pf.open_archive(url, cache_dir=cache).read(0)
        answer.send(("no error", ""))
    except PackedFormatError as error:
        answer.send((type(error).__name__, str(error)))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        answer.send((type(error).__name__, repr(error)))


def test_a_cache_directory_this_user_may_not_write_is_named(s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    read_everything(url, tmp_path / "other")  # every module the child needs is imported before it drops root
    root = tempfile.mkdtemp(prefix="pf-read-only-")  # under /tmp: another user can reach it
    cache = os.path.join(root, "cache")
    try:
        os.makedirs(cache)
        os.chmod(root, 0o755)
        os.chmod(cache, 0o555)
        context = multiprocessing.get_context("fork")
        mine, theirs = context.Pipe()
        child = context.Process(target=_open_as_another_user, args=(url, cache, theirs))
        child.start()
        assert mine.poll(120), "the child process did not answer"
        kind, message = mine.recv()
        child.join(30)
        assert kind == "CacheDirectoryError" and cache in message and "writable" in message, (kind, message)
    finally:
        os.chmod(cache, 0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_a_full_disk_while_keeping_the_sample_index_is_named_and_leaves_nothing(s3_env, local_sets, tmp_path,
                                                                                  monkeypatch):
    url = uploaded(s3_env, local_sets["zip"])
    real_save = np.save

    def save_on_a_full_disk(file, array, *args, **kwargs):  # the disk fills up while the arrays are written
        real_save(file, array[: len(array) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))

    monkeypatch.setattr(np, "save", save_on_a_full_disk)
    with pytest.raises(InsufficientSpaceError, match=str(tmp_path)):
        pf.open_archive(url, cache_dir=tmp_path)
    assert not list(tmp_path.glob("*/.pf/samples-*"))


# ---- a damaged cached part ---------------------------------------------------------------------------------
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["a sample", "the end record"])
def test_a_cached_part_damaged_after_its_check_is_fetched_again(where, s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["zip"])
    with pf.open_archive(url, cache_dir=tmp_path) as reader:
        reader.read(PER_PART)
        entry = reader.backend.entry_path(1)
    with pf.open_archive(entry) as part:
        offset = part.backend.sample_location(1)[1] + 5 if where == "a sample" else os.path.getsize(entry) - 10
    _flip(entry, offset)
    began = time.time()
    assert same(read_everything(url, tmp_path), local_content(local_sets["zip"]))
    fetched = [d["url"].rsplit("/", 1)[-1] for d in storage.PartCache(str(tmp_path)).downloads(began)]
    assert "train-00001.zip" in fetched


def test_a_cached_part_that_stays_damaged_names_its_cache_entry_and_url(s3_env, local_sets, tmp_path, monkeypatch):
    url = uploaded(s3_env, local_sets["zip"])
    real_fill = storage.PartCache._fill
    landed = []

    def fill_on_a_failing_disk(self, path, size, fill, record):  # each copy is damaged once in place
        real_fill(self, path, size, fill, record)
        landed.append(path)
        with pf.open_archive(path) as part:
            offset = part.backend.sample_location(0)[1] + 5
        _flip(path, offset)

    monkeypatch.setattr(storage.PartCache, "_fill", fill_on_a_failing_disk)
    with pytest.raises(CorruptArchiveError) as caught:
        with pf.open_archive(url, cache_dir=tmp_path) as reader:
            reader.read(0)
    message = str(caught.value)
    assert message.startswith(url.rsplit("/", 1)[0] + "/train-00000.zip") and landed[-1] in message
    assert "checksum" in message and len(landed) == 3


# ---- a set without a sample index --------------------------------------------------------------------------
def copy_without_sample_index(s3, local: str) -> str:
    """The set at ``local`` copied file by file into a new bucket, its index rewritten to record no sample index
    and that left out (as a set written before conversions wrote one); its URL."""
    bucket, folder = s3.bucket(), os.path.dirname(local)
    for name in sorted(os.listdir(folder)):
        if name != samples_name(os.path.basename(local)):
            s3.upload(os.path.join(folder, name), f"s3://{bucket}/{name}")
    url = f"s3://{bucket}/{os.path.basename(local)}"
    spec = index_of(s3, url)
    put_index(s3, url, {k: v for k, v in spec.items() if k not in ("samples", "manifest")})
    return url


def test_a_set_copied_without_its_sample_index_is_indexed_once_per_node(s3, s3_proxy, local_sets, tmp_path,
                                                                         monkeypatch):
    proxy = s3_proxy(rate=0.0)
    proxy.use_env(monkeypatch)
    url = copy_without_sample_index(s3, local_sets["zip"])
    with pytest.warns(UserWarning, match="no sample index"):
        first = read_everything(url, tmp_path)
    cache = storage.PartCache(str(tmp_path))
    for _, entry, _ in cache.entries():  # a bounded cache let the parts go
        assert cache.evict(entry)
    proxy.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pf.open_archive(url, cache_dir=tmp_path) as reader:
            assert len(reader) == SAMPLES and list(reader.classes) == first[2]
            assert np.array_equal(np.asarray(reader.index.labels), first[1])
    parts_read = sum(v["bytes"] for k, v in proxy.stats()["keys"].items() if "train-0" in k)
    assert parts_read == 0
    assert same(first, local_content(local_sets["zip"]))


def test_a_kept_index_that_disagrees_with_a_part_is_refused_and_built_again(s3_env, local_sets, tmp_path):
    url = copy_without_sample_index(s3_env, local_sets["zip"])
    with pytest.warns(UserWarning, match="no sample index"):
        first = read_everything(url, tmp_path)
    (kept,) = tmp_path.glob("*/.pf/index-*")
    labels = np.load(kept / "labels.npy")
    np.save(kept / "labels.npy", labels[::-1].copy())  # the cache's copy is changed (or another process wrote it)
    with pytest.raises(CorruptArchiveError, match="labels"):
        read_everything(url, tmp_path)
    assert not kept.exists()
    with pytest.warns(UserWarning, match="no sample index"):
        assert same(read_everything(url, tmp_path), first)


# ---- the upload command ------------------------------------------------------------------------------------
def test_the_upload_command_prints_each_object_and_the_set_opens_by_its_url(s3_env, local_sets, tmp_path, capsys):
    bucket = s3_env.bucket()
    code = cli.main(["upload", local_sets["zip"], f"s3://AKIAEXAMPLE:s3cr3t@{bucket}/sets/train.zip"])
    out = capsys.readouterr().out
    assert code == 0 and "s3cr3t" not in out
    lines = out.replace("***@", "").split()
    assert lines[-1] == f"s3://{bucket}/sets/train.zip" and lines[-2].endswith("/train-samples.npz")
    assert sorted(lines[:PARTS]) == [f"s3://{bucket}/sets/train-{k:05d}.zip" for k in range(PARTS)]
    assert same(read_everything(lines[-1], tmp_path), local_content(local_sets["zip"]))


def test_the_upload_command_has_help_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["upload", "--help"])
    assert exit_info.value.code == 0 and "packed-formats upload " in capsys.readouterr().out.split("examples:")[1]


def test_a_folder_part_listing_a_file_and_a_folder_of_one_name_is_refused_naming_both(s3_env, local_sets, tmp_path):
    url = uploaded(s3_env, local_sets["memmap"])
    s3_env.put(url.rsplit("/", 1)[0] + "/train-00000.memmap/images.npy/x", b"theirs")
    with pytest.raises(CorruptArchiveError) as caught:
        with pf.open_archive(url, cache_dir=tmp_path / "cache") as reader:
            reader.read(0)
    message = str(caught.value)
    assert "train-00000.memmap" in message and "'images.npy'" in message and "'images.npy/x'" in message


def test_a_folder_part_download_that_fails_leaves_no_task_pending(s3_env, local_sets, tmp_path):
    """One object of a folder part changed since the set was opened: its download fails, and its
    siblings' downloads, under way on the same event loop, are cancelled and ended with it (a task left
    pending is destroyed with a traceback when the process exits)."""
    import asyncio

    from packed_formats.storage import remote as remote_module

    url = uploaded(s3_env, local_sets["memmap"])
    with pf.open_archive(url, cache_dir=tmp_path / "cache") as reader:
        folder = url.rsplit("/", 1)[0] + "/train-00000.memmap"
        changed = sorted(s3_env.fs().find(folder))[0]
        s3_env.put(f"s3://{changed}", b"another version")
        with pytest.raises(PackedFormatError, match="changed"):
            reader.read(0)
    left = [t for pooled in remote_module._POOL.every for t in asyncio.all_tasks(pooled.loop) if not t.done()]
    assert left == []
