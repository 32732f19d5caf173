"""A damaged LMDB leaf node can send LMDB past the end of the file: no reader may die of it.

LMDB takes a value's size and its overflow page from the leaf node, and the lmdb binding touches
every page of the value before Python sees it: one flipped bit in a size made a reader end with
SIGBUS (found by the corruption fuzz, seed 814847175).  Each damage below is made on purpose, at the
byte that carries it, and every read path runs in a child process, so a crash is an outcome, not the
end of the test run.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends import lmdb_guard
from packed_formats.backends.lmdb import MANIFEST_KEY, sample_key

from . import fuzz_helpers as fuzz

TIMEOUT = 60  # seconds a read path may take: a guarded one needs well under 1


def nodes_at(data: bytes, key: bytes) -> list:
    """Where each leaf node with ``key`` starts (its header: size lo, size hi, flags, key size, right
    before the key): the live one, and the copies that earlier commits left on free pages."""
    pattern = struct.pack("<H", len(key)) + key
    found, at = [], data.find(pattern)
    while at >= 0:
        found.append(at - 6)
        at = data.find(pattern, at + 1)
    assert found, key
    return found


def damage(path: str, key: bytes, how: str) -> None:
    """Damage ``key``'s leaf nodes in the file at ``path``: the value's size gains 1 GiB (bit 0x40 of
    its top byte: the fuzz's finding), or its overflow run starts on the file's last page."""
    with open(path, "r+b") as file:
        data = bytearray(file.read())
        for node in nodes_at(bytes(data), key):
            if how == "size":
                data[node + 3] ^= 0x40
            else:
                flags, = struct.unpack_from("<H", data, node + 4)
                assert flags & 1, "the value is on overflow pages"
                struct.pack_into("<Q", data, node + 8 + len(key), len(data) // 4096 - 1)
        file.seek(0)
        file.write(data)


@pytest.fixture(scope="module")
def references(uniform_archives):
    return {kind: fuzz.reference_of(path, kind[1]) for kind, path in uniform_archives.items() if kind[0] == "lmdb"}


def outcomes_of(path: str, ref, mode: str) -> dict:
    return {name: fuzz.run_isolated(fuzz.READERS[name], path, ref, mode, TIMEOUT) for name in fuzz.READ_PATHS}


@pytest.mark.parametrize("how, mode", [("size", "raw"), ("size", "encoded"), ("page", "raw")])
def test_a_sample_whose_node_points_past_the_file_is_named_on_every_read_path(
    uniform_archives, references, tmp_path, how, mode
):
    copy = fuzz.copy_archive(uniform_archives["lmdb", mode], str(tmp_path / "d.lmdb"))
    damage(copy, sample_key(1), how)
    outcomes = outcomes_of(copy, references["lmdb", mode], mode)
    assert all(o.allowed for o in outcomes.values()), outcomes
    assert outcomes["dataset"].verdict == fuzz.NAMED and "sample index 1" in outcomes["dataset"].detail, outcomes
    assert outcomes["verify"].verdict == fuzz.FLAGGED, outcomes
    if how == "size" and overflows(copy, sample_key(1)):  # a value in its leaf LMDB checks against the page
        assert "claims 1073" in outcomes["dataset"].detail and "outside the file's" in outcomes["dataset"].detail


def overflows(path: str, key: bytes) -> bool:
    """Whether ``key``'s value lies on overflow pages (flag 1 of its leaf node)."""
    with open(path, "rb") as file:
        data = file.read()
    return all(struct.unpack_from("<H", data, node + 4)[0] & 1 for node in nodes_at(data, key))


@pytest.fixture(scope="module")
def many_classes(tmp_path_factory):
    """A raw LMDB archive of 300 samples in 300 classes: its manifest and its index records of keys and
    labels are large enough for overflow pages, as a real archive's are."""
    path = str(tmp_path_factory.mktemp("many") / "many.lmdb")
    pixels = np.random.default_rng(0).integers(0, 256, (300, 4, 4, 3), np.uint8)
    classes = [f"class-{i:04d}" for i in range(300)]
    with pf.open_writer(path, format="lmdb", mode="raw", shape=(4, 4, 3), classes=classes) as writer:
        for i in range(300):
            writer.add(pixels[i], i, f"{classes[i]}/{i:04d}.png")
    return path, fuzz.reference_of(path, "raw")


@pytest.mark.parametrize("key", [MANIFEST_KEY, b"__index__/keys"], ids=["manifest", "index"])
def test_a_manifest_or_index_record_claiming_bytes_past_the_file_is_refused_on_open(many_classes, tmp_path, key):
    good, reference = many_classes
    copy = fuzz.copy_archive(good, str(tmp_path / "d.lmdb"))
    assert overflows(copy, key)
    damage(copy, key, "size")
    outcomes = outcomes_of(copy, reference, "raw")
    assert all(o.allowed and o.verdict != fuzz.SAME for o in outcomes.values()), outcomes
    detail = outcomes["dataset"].detail
    assert "CorruptArchiveError" in detail and "outside the file's" in detail, outcomes
    assert ("the manifest" if key == MANIFEST_KEY else "index array 'keys'") in detail, outcomes


def read_past_the_file(path: str, ref, mode: str) -> None:
    """Read the first page of a guarded environment's map past the file's end: zeros, never SIGBUS."""
    env, guard = lmdb_guard.open_readonly(path)
    size = os.path.getsize(path)
    assert guard.active and 0 < guard.end <= size
    past = ctypes.string_at(guard.base + -(-size // mmap.PAGESIZE) * mmap.PAGESIZE, 4096)
    env.close()
    if past != bytes(4096):
        raise AssertionError("the page past the file's end is not zeros")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="the guard finds LMDB's map in /proc/self/maps")
def test_the_map_past_the_files_end_reads_as_zeros(uniform_archives):
    outcome = fuzz.run_isolated(read_past_the_file, uniform_archives["lmdb", "raw"], None, "raw", TIMEOUT)
    assert outcome.verdict == fuzz.SAME, outcome


def convert_pickled(path: str, ref, mode: str) -> None:
    pf.convert(path, path + ".zip", allow_pickle=True, workers=1, quiet=True)


@pytest.mark.filterwarnings("ignore::packed_formats.sources.base.UnpicklingWarning")
def test_a_third_party_lmdb_with_a_record_past_the_file_is_named_by_its_key(tmp_path):
    path = str(tmp_path / "theirs.lmdb")
    with lmdb.open(path, subdir=False, map_size=1 << 24, lock=False) as env, env.begin(write=True) as txn:
        for i in range(4):
            image = pf.codecs.encode(np.random.default_rng(i).integers(0, 256, (48, 48, 3), np.uint8))
            txn.put(b"img-%d" % i, pickle.dumps((image, i % 2)))
    damage(path, b"img-2", "size")
    outcome = fuzz.run_isolated(convert_pickled, path, None, "encoded", TIMEOUT)
    assert outcome.verdict == fuzz.NAMED and "CorruptSampleError" in outcome.detail, outcome
    assert "img-2" in outcome.detail and "outside the file's" in outcome.detail, outcome


def test_without_the_address_space_for_the_guard_an_archive_reads_unguarded_with_a_warning(uniform_archives):
    """Under ``ulimit -v`` with room for the file's map but not for the guard's 4 GiB, the archive still
    reads, and a warning says what is lost."""
    path = uniform_archives["lmdb", "raw"]
    script = textwrap.dedent(f"""
        import resource, warnings
        import packed_formats as pf
        from packed_formats.backends.lmdb_guard import UnguardedLMDBWarning
        PackedDataset = pf.PackedDataset  # imports torch before the limit
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), used + (1 << 30)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dataset = PackedDataset({path!r}, output="tensor")
            print("READ", len(dataset), int(dataset[3][1]), dataset.reader.handle().guard.active)
        print("WARNED", [str(w.message) for w in caught if w.category is UnguardedLMDBWarning])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    read, warned = done.stdout.splitlines()
    assert read == "READ 24 0 False"
    assert "ulimit -v" in warned and path in warned


def test_a_map_the_listing_does_not_show_is_read_unguarded_with_a_warning(uniform_archives, tmp_path, monkeypatch):
    copy = fuzz.copy_archive(uniform_archives["lmdb", "raw"], str(tmp_path / "d.lmdb"))
    monkeypatch.setattr(lmdb_guard, "_MAPS", str(tmp_path / "no-such-listing"))
    monkeypatch.setattr(lmdb_guard, "_warned", False)
    with pytest.warns(lmdb_guard.UnguardedLMDBWarning, match="not in /proc/self/maps.*SIGBUS"):
        env, guard = lmdb_guard.open_readonly(copy)
    with env:
        assert not guard.active and guard.end == os.path.getsize(copy)
        with env.begin(buffers=True) as txn:
            assert guard.outside(txn.get(sample_key(0))) is None
