"""Hostile HDF5 files: no damage to HDF5's own metadata, re-sealed or not, makes a reader crash or hang.

HDF5 trusts what it parses: a damaged chunk index (its B-tree nodes, which
only small archives have checked at open) could end the process with SIGSEGV
at the next sample read, and a damaged object header or heap could make
opening spin forever, even in a file whose user block checksums were
recomputed after the damage (as a crafted file or a hand edit has them).
Readers now read archives without HDF5's parser (``hdf5_layout``), and an
archive written without a locator is described by HDF5 in a child process
under a time limit.  Each case here runs its reads in a fresh Python process
under a time limit: a signal, a hang, an exception outside PackedFormatError
or data other than the intact archive's is a failure.  The random trials draw
a fresh seed each run (printed; ``PF_HOSTILE_SEED`` replays one).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends import hdf5, hdf5_guard, hdf5_layout
from packed_formats.checksum import crc32

MANY = 5000  # samples: more chunks than the seal checks (4,096), each one tiny image
SHAPE = (4, 4, 3)
TRIALS = 8  # damaged chunk indexes per run
RESEAL_TRIALS = 8  # re-sealed damaged ranges per run
TIMEOUT = 240  # seconds a test's process may take: all its reads take a few (on 2 busy cores)
PROBE_SECONDS = 3  # the child's time limit for archives without a locator, in the trials
HANGING = (0, 223, 262)  # offsets into the manifest's stored text where 512 zero bytes hang HDF5 2.0
OPERATIONS = ("open", "read", "read_many", "verify")

# What a trial's process runs: each operation on each archive named, on its own reader, one line each:
# "PATH NAME ok RESULT", "PATH NAME named CLASS: MESSAGE" or "PATH NAME foreign CLASS: MESSAGE", after
# "PATH NAME start" (the last such line names what a crash or a hang interrupted).
SCRIPT = r"""
import hashlib, sys
import numpy as np
import packed_formats as pf
try:
    from packed_formats.backends import hdf5_layout
    hdf5_layout.PROBE_SECONDS = float(sys.argv[1])
except ImportError:
    pass

def digest(chunks):
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(bytes(chunk))
    return h.hexdigest()

def read_each(path):
    with pf.open_archive(path) as reader:
        return digest(reader.read(i) for i in range(len(reader)))

def read_many(path):
    with pf.open_archive(path) as reader:
        samples = reader.read_many(np.arange(len(reader)))
        return digest(samples if isinstance(samples, list) else [samples.tobytes()])

def verify(path):
    report = pf.verify_archive(path)
    return "verified" if report.ok else "flagged"

def open_only(path):
    with pf.open_archive(path) as reader:
        return str(len(reader))

for path in sys.argv[2:]:
    for name, run in (("open", open_only), ("read", read_each), ("read_many", read_many), ("verify", verify)):
        print(path, name, "start", flush=True)
        try:
            outcome = "ok " + run(path)
        except pf.PackedFormatError as exc:
            outcome = "named " + type(exc).__name__ + ": " + str(exc).replace("\n", " ")[:300]
        except BaseException as exc:
            outcome = "foreign " + type(exc).__name__ + ": " + str(exc).replace("\n", " ")[:300]
        print(path, name, outcome, flush=True)
"""


def fresh_seed() -> int:
    value = os.environ.get("PF_HOSTILE_SEED", "").strip()
    return int(value) if value else random.SystemRandom().randrange(1 << 32)


def expected_outcomes(path: str) -> Dict[str, str]:
    """What each operation prints for the intact archive at ``path``."""
    with pf.open_archive(path) as reader:
        count = len(reader)
        each = hashlib.sha256(b"".join(bytes(reader.read(i)) for i in range(count))).hexdigest()
        many = reader.read_many(np.arange(count))
        batch = hashlib.sha256(b"".join(bytes(s) for s in many) if isinstance(many, list) else many.tobytes())
    return {"open": str(count), "read": each, "read_many": batch.hexdigest(), "verify": "verified"}


def outcomes_of(trials: Dict[str, Tuple[str, Dict[str, str]]], timeout: float = TIMEOUT,
                must_read: bool = False) -> List[str]:
    """Every problem of the operations on each damaged archive of ``trials`` ({path: (what was done,
    expected_outcomes of the intact archive)}), all run in one fresh process under ``timeout``: a
    signal, a hang, an exception outside PackedFormatError or a silent wrong result (``must_read``:
    anything but the intact result)."""
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(PROBE_SECONDS), *trials],
                              capture_output=True, text=True, timeout=timeout, check=False)
        output, ended = done.stdout, f"status {done.returncode}"
        if done.returncode < 0:
            ended = f"crash: killed by signal {-done.returncode}"
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        ended, done = f"hang: no end within {timeout} s", None
    took = time.monotonic() - start
    outcomes: Dict[Tuple[str, str], str] = {}
    for line in output.splitlines():
        path, name, outcome = line.split(" ", 2)
        outcomes[path, name] = outcome
    problems = []
    for path, (what, expected) in trials.items():
        for name in OPERATIONS:
            outcome = outcomes.get((path, name))
            where = f"{os.path.basename(path)} ({what}) {name}"
            if outcome is None:
                continue  # not reached: the process ended before it
            if outcome == "start":
                stderr = "" if done is None else done.stderr[-500:]
                problems.append(f"{where}: {ended} after {took:.0f} s; stderr: {stderr}")
            elif outcome.startswith("ok ") and outcome[3:] not in (expected[name], "flagged"):
                problems.append(f"{where}: a silent wrong result ({outcome[3:]}, intact: {expected[name]})")
            elif not outcome.startswith(("ok ", "named ")) or (must_read and outcome != "ok " + expected[name]):
                problems.append(f"{where}: {outcome}")
    if not problems and (done is None or done.returncode != 0):
        problems.append(f"{ended}; stderr: {'' if done is None else done.stderr[-500:]}")
    return problems


# ---- a chunk index larger than the seal checks ---------------------------------------------------------------
@pytest.fixture(scope="module")
def many_chunks(tmp_path_factory) -> Tuple[str, Dict[str, str]]:
    """A raw archive of MANY tiny images (one chunk each) and what each operation gives on it."""
    path = str(tmp_path_factory.mktemp("hostile") / "many.h5")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (MANY,) + SHAPE, dtype=np.uint8)
    with pf.open_writer(path, format="hdf5", mode="raw", shape=SHAPE, classes=("a", "b")) as writer:
        for i, image in enumerate(images):
            writer.add(image, i % 2)
    return path, expected_outcomes(path)


def tree_nodes(path: str) -> List[int]:
    """Where HDF5's B-tree nodes ("TREE" signature) start in the file at ``path``."""
    with open(path, "rb") as file:
        content = file.read()
    found, at = [], content.find(b"TREE")
    while at >= 0:
        found.append(at)
        at = content.find(b"TREE", at + 1)
    return found


NODE_BYTES = 24 + 64 * 56  # a chunk B-tree node of a rank-4 dataset: its header and up to 64 entries


def damage_nodes(path: str, rng: random.Random, nodes: List[int]) -> str:
    """Write 8 random bytes at a random place in each of 1-3 random B-tree nodes; what was done."""
    done = []
    with open(path, "r+b") as file:
        for node in rng.sample(nodes, rng.randint(1, 3)):
            at = node + rng.randrange(4, NODE_BYTES)
            payload = bytes(rng.randrange(256) for _ in range(8))
            file.seek(at)
            file.write(payload)
            done.append(f"{payload.hex()} at {at}")
    return ", ".join(done)


def test_the_chunk_index_is_larger_than_the_seal_checks(many_chunks):
    """The premise of the trials below: most B-tree nodes lie outside every checked range."""
    path, _ = many_chunks
    with open(path, "rb") as file:
        ranges = hdf5_guard.stored_ranges(file.read(hdf5_guard.USERBLOCK))
    nodes = tree_nodes(path)
    unchecked = [n for n in nodes if not any(a <= n < a + length for a, length in ranges)]
    assert MANY > hdf5._CHECKED_CHUNKS and len(unchecked) > len(nodes) // 2


def test_a_damaged_chunk_index_never_crashes_or_hangs_a_reader(many_chunks, tmp_path):
    path, expected = many_chunks
    seed = fresh_seed()
    rng, nodes, trials = random.Random(seed), tree_nodes(path), {}
    for trial in range(TRIALS):
        copy = str(tmp_path / f"trial{trial}.h5")
        shutil.copyfile(path, copy)
        trials[copy] = (damage_nodes(copy, rng, nodes), expected)
    bad = outcomes_of(trials)
    assert not bad, f"seed {seed} (replay with PF_HOSTILE_SEED={seed}):\n" + "\n".join(bad)


def test_raw_reads_never_consult_hdf5s_chunk_index(many_chunks, tmp_path):
    """Every unchecked node of the chunk index wiped (all but its signature): every image still reads,
    intact, from the index's checked positions."""
    path, expected = many_chunks
    copy = str(tmp_path / "no-tree.h5")
    shutil.copyfile(path, copy)
    with open(path, "rb") as file:
        ranges = hdf5_guard.stored_ranges(file.read(hdf5_guard.USERBLOCK))
    wiped = 0
    with open(copy, "r+b") as file:
        for node in tree_nodes(path):
            if not any(a < node + 512 and node < a + length for a, length in ranges):
                file.seek(node + 4)
                file.write(bytes(508))  # its type, level, entry count, siblings and first entries
                wiped += 1
    assert wiped > len(tree_nodes(path)) // 2
    assert outcomes_of({copy: ("chunk index wiped", expected)}, must_read=True) == []


# ---- re-sealed damage ----------------------------------------------------------------------------------------
def stored_seal(path: str) -> Tuple[List[Tuple[int, int]], bytes]:
    """The checked ranges and the locator the user block of the (intact) archive at ``path`` holds."""
    with open(path, "rb") as file:
        block = file.read(hdf5_guard.USERBLOCK)
    return hdf5_guard.stored_ranges(block), hdf5_guard.locator_of(block)


def reseal(path: str, ranges: List[Tuple[int, int]], locator: bytes, crafted: bool) -> None:
    """Recompute the user block's checksums over ``ranges`` as the file is now (``crafted``: the locator's
    checksums too), so that the seal no longer tells the damage."""
    entries = hdf5_layout.unpack(path, locator) if crafted else None
    if entries:
        with open(path, "rb") as file:
            for name, entry in list(entries.items()):
                if entry.crc32:
                    file.seek(entry.offset)
                    entries[name] = hdf5_layout.Entry(entry.offset, entry.nbytes, crc32(file.read(entry.nbytes)),
                                                      entry.dtype)
        locator = hdf5_layout.pack(entries)
    hdf5_guard.write_userblock(path, ranges, locator)


def manifest_text_at(path: str) -> int:
    with open(path, "rb") as file:
        start = file.read().find(b'{\n "')
    assert start > 0
    return start


def zero(path: str, at: int, n: int = 512) -> None:
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(bytes(n))


def test_a_resealed_damaged_manifest_never_hangs_a_reader(uniform_archives, tmp_path):
    """512 zero bytes where they hang HDF5, the seal recomputed: every read ends with a named error."""
    trials = {}
    for mode in ("raw", "encoded"):
        good = uniform_archives[("hdf5", mode)]
        expected = expected_outcomes(good)
        for at in HANGING:
            for crafted in (False, True):
                copy = str(tmp_path / f"{mode}-{at}-{'crafted' if crafted else 'resealed'}.h5")
                shutil.copyfile(good, copy)
                ranges, locator = stored_seal(copy)
                zero(copy, manifest_text_at(copy) + at)
                reseal(copy, ranges, locator, crafted)
                what = f"{mode}, manifest text + {at} zeroed, {'crafted' if crafted else 'resealed'}"
                trials[copy] = (what, expected)
    assert outcomes_of(trials) == []
    for copy in trials:
        with pytest.raises(pf.CorruptArchiveError, match=os.path.basename(copy)):
            pf.open_archive(copy)


def test_resealed_damage_anywhere_hdf5_parses_never_hangs_a_reader(uniform_archives, tmp_path):
    seed = fresh_seed()
    rng, trials = random.Random(seed), {}
    for trial in range(RESEAL_TRIALS):
        mode = rng.choice(["raw", "encoded"])
        good = uniform_archives[("hdf5", mode)]
        copy = str(tmp_path / f"trial{trial}.h5")
        shutil.copyfile(good, copy)
        ranges, locator = stored_seal(copy)
        start, length = rng.choice(ranges)
        at = start + rng.randrange(length)
        zero(copy, at)
        crafted = rng.random() < 0.5
        reseal(copy, ranges, locator, crafted)
        what = f"{mode}, 512 zero bytes at {at} (range {start}+{length}), {'crafted' if crafted else 'resealed'}"
        trials[copy] = (what, expected_outcomes(good))
    bad = outcomes_of(trials)
    assert not bad, f"seed {seed} (replay with PF_HOSTILE_SEED={seed}):\n" + "\n".join(bad)


# ---- archives written before the locator ----------------------------------------------------------------------
def without_locator(good: str, path: str) -> str:
    """A copy of the archive ``good`` as a writer before the locator left it: its ranges checked, no locator."""
    shutil.copyfile(good, path)
    ranges, _ = stored_seal(path)
    hdf5_guard.write_userblock(path, ranges)
    return path


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_an_archive_without_a_locator_reads_through_hdf5_in_a_child(uniform_archives, tmp_path, mode):
    good = uniform_archives[("hdf5", mode)]
    old = without_locator(good, str(tmp_path / "old.h5"))
    assert outcomes_of({old: ("no locator", expected_outcomes(good))}) == []
    with pf.open_archive(old) as reader, pf.open_archive(good) as intact:
        assert len(reader) == len(intact)
        for i in range(len(reader)):
            assert bytes(reader.read(i)) == bytes(intact.read(i))


def test_an_archive_without_a_locator_that_hangs_hdf5_is_named_within_the_time_limit(uniform_archives, tmp_path,
                                                                                      monkeypatch):
    good = uniform_archives[("hdf5", "raw")]
    expected, trials = expected_outcomes(good), {}
    for at in HANGING[1:2]:  # one is enough: each read of it waits out the time limit
        old = without_locator(good, str(tmp_path / f"old-{at}.h5"))
        ranges, _ = stored_seal(old)
        zero(old, manifest_text_at(old) + at)
        reseal(old, ranges, b"", crafted=False)
        trials[old] = (f"no locator, manifest text + {at} zeroed, resealed", expected)
    start = time.monotonic()
    assert outcomes_of(trials, timeout=TIMEOUT) == []
    assert time.monotonic() - start < len(trials) * len(OPERATIONS) * (PROBE_SECONDS + 5) + 60
    monkeypatch.setattr(hdf5_layout, "PROBE_SECONDS", PROBE_SECONDS)
    with pytest.raises(pf.CorruptArchiveError, match="old-223.h5.*HDF5 did not answer within"):
        pf.open_archive(str(tmp_path / "old-223.h5"))


# ---- a crafted locator -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, offset, nbytes", [
    ("positions", 1 << 40, 8), ("keys", hdf5_guard.USERBLOCK - 64, 64), ("manifest", hdf5_guard.USERBLOCK, 1 << 40),
])
def test_a_locator_that_points_outside_the_file_is_refused(uniform_archives, tmp_path, name, offset, nbytes):
    """A locator re-sealed to point at bytes the file has not got (or at its user block): a named error."""
    copy = str(tmp_path / "crafted.h5")
    shutil.copyfile(uniform_archives[("hdf5", "raw")], copy)
    ranges, locator = stored_seal(copy)
    entries = hdf5_layout.unpack(copy, locator)
    assert entries is not None and name in entries
    entries[name] = hdf5_layout.Entry(offset, nbytes, entries[name].crc32, entries[name].dtype)
    hdf5_guard.write_userblock(copy, ranges, hdf5_layout.pack(entries))
    with pytest.raises(pf.CorruptArchiveError, match=f"crafted.h5: its locator puts '{name}' at bytes {offset}"):
        pf.open_archive(copy)
