"""Sharded archives of hundreds of parts under a low open-file limit: every sample reads back,
descriptors stay bounded, a limit that is reached is named, and no failure hangs a loader.

Each scenario runs in a child process whose open-file limit (RLIMIT_NOFILE) is
lowered to LIMIT, below the descriptors 300 open parts would need; the child
prints a JSON report and the tests check it.  Children have a wall-clock
timeout: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends.sharded import ShardedWriter

PARTS = 300
PER_PART = 3
SHAPE = (4, 4, 3)
LIMIT = 128  # open files a child may hold: 300 parts at 1-2 descriptors each do not fit
DEFAULT_BOUND = LIMIT // 8  # parts a process keeps open by default under LIMIT
EXTENSIONS = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}
FORMATS = list(EXTENSIONS)
TIMEOUT = 120  # seconds a child may take (a hang ends here, as a failure)

# The child's common part: lower the limit first, then what the parent wrote is known.
PRELUDE = """
import json, os, resource, sys, time
os.environ.pop("PF_MAX_OPEN_PARTS", None)  # the default bound, whatever the caller set
resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import numpy as np
import packed_formats as pf
from tests.test_shard_limits import expected, sample_number

def open_fds(pid="self"):
    return len(os.listdir(f"/proc/{pid}/fd"))

def report(**fields):
    print("REPORT " + json.dumps(fields), flush=True)
"""


def expected(i: int) -> np.ndarray:
    """Sample i: its number in its first two bytes, so that a batch says which samples it holds."""
    image = np.full(SHAPE, i % 251, dtype=np.uint8)
    image[0, 0, 0], image[0, 0, 1] = i >> 8, i & 255
    return image


def sample_number(image: np.ndarray) -> int:
    return int(image[0, 0, 0]) << 8 | int(image[0, 0, 1])


def run_child(body: str, *args: str, timeout: float = TIMEOUT) -> dict:
    """Run PRELUDE + body in a fresh interpreter under LIMIT open files; its REPORT line, parsed."""
    code = f"LIMIT = {LIMIT}\n" + PRELUDE + body
    child = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        start_new_session=True,  # its DataLoader workers too are ended if it hangs
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise AssertionError(f"the child did not finish in {timeout} s: it hangs") from None
    lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"the child reported nothing (exit {child.returncode}):\n{stdout}\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT "):])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """format -> a sharded raw archive of PARTS parts of PER_PART samples (made on first use)."""
    made = {}

    def make(fmt: str) -> str:
        if fmt not in made:
            path = str(tmp_path_factory.mktemp(f"shards-{fmt}") / f"data{EXTENSIONS[fmt]}")
            with ShardedWriter(path, fmt, shard_size=PER_PART, mode="raw", shape=SHAPE, classes=["a", "b"]) as w:
                for i in range(PARTS * PER_PART):
                    w.add(expected(i), i % 2)
            made[fmt] = path
        return made[fmt]

    return make


# ---- a Reader and a PackedDataset in one process ---------------------------------------------------------
DIRECT = """
def read_all(path):
    reader = pf.open_archive(path)
    n, order = len(reader), np.random.default_rng(0).permutation(len(reader))
    baseline, peak, most_open, wrong = open_fds(), 0, 0, []

    def note():
        nonlocal peak, most_open
        peak, most_open = max(peak, open_fds()), max(most_open, len(reader.backend.open_parts()))

    for i in order[:100].tolist():  # one at a time
        if not np.array_equal(reader.read(i), expected(i)):
            wrong.append(i)
        note()
    batch = reader.read_many(order)  # one batch over every part
    wrong += [int(i) for j, i in enumerate(order) if not np.array_equal(batch[j], expected(int(i)))]
    note()
    dataset = pf.PackedDataset(reader, output="numpy")
    for start in range(0, n, 100):  # batches of a DataLoader without workers
        chunk = order[start:start + 100].tolist()
        wrong += [i for i, (image, label) in zip(chunk, dataset.__getitems__(chunk))
                  if not np.array_equal(image, expected(i)) or label != i % 2]
        note()
    reader.close()
    return dict(samples=n, wrong=wrong, baseline=baseline, peak=peak, most_open=most_open, after_close=open_fds(),
                error=error_when_no_descriptor_is_left(path))

def error_when_no_descriptor_is_left(path):
    reader = pf.open_archive(path)
    reader.read(0)
    filler = []
    try:
        while True:
            filler.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        reader.read(len(reader) - 1)  # in the last part, not open yet
        return None
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    finally:
        for fd in filler:
            os.close(fd)
        reader.close()

report(**{path: read_all(path) for path in sys.argv[1:]})
"""


@pytest.fixture(scope="module")
def direct(sharded):
    """format -> what DIRECT saw of its sharded archive (run once per format)."""
    reports = {}

    def report(fmt: str) -> dict:
        if fmt not in reports:
            reports[fmt] = run_child(DIRECT, sharded(fmt))[sharded(fmt)]
        return reports[fmt]

    return report


# The quick tier reads two formats (making and reading 300 parts takes seconds each); all four when slow.
EVERY_FORMAT = [f if f in ("zip", "lmdb") else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS]


@pytest.mark.parametrize("fmt", EVERY_FORMAT)
def test_every_sample_of_300_parts_reads_back_under_a_low_open_file_limit(direct, fmt):
    assert direct(fmt)["samples"] == PARTS * PER_PART
    assert direct(fmt)["wrong"] == []


@pytest.mark.parametrize("fmt", EVERY_FORMAT)
def test_a_process_keeps_at_most_the_bound_of_parts_and_their_descriptors_open(direct, fmt):
    report = direct(fmt)
    assert report["most_open"] == DEFAULT_BOUND
    assert report["peak"] - report["baseline"] <= 2 * DEFAULT_BOUND  # a file and its map at most, per part


@pytest.mark.parametrize("fmt", EVERY_FORMAT)
def test_closing_a_sharded_reader_closes_every_part(direct, fmt):
    assert direct(fmt)["after_close"] <= direct(fmt)["baseline"]


@pytest.mark.parametrize("fmt", EVERY_FORMAT)
def test_a_part_left_without_a_descriptor_is_named_with_what_to_do(direct, sharded, fmt):
    kind, message = direct(fmt)["error"]
    assert kind == "TooManyOpenFilesError"
    last_part = os.path.basename(sharded(fmt)).replace(EXTENSIONS[fmt], f"-{PARTS - 1:05d}{EXTENSIONS[fmt]}")
    assert sharded(fmt) in message and last_part in message
    assert "too many open files" in message and "ulimit -n" in message and "max_open_parts" in message


# ---- the bound, given -----------------------------------------------------------------------------------
def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def read_shuffled_batches(reader, seed: int = 1) -> int:
    """Read every sample in shuffled batches of 64, checking each; the most parts open at once."""
    order, most_open = np.random.default_rng(seed).permutation(len(reader)), 0
    for start in range(0, len(reader), 64):
        idx = order[start : start + 64]
        assert all(np.array_equal(image, expected(int(i))) for image, i in zip(reader.read_many(idx), idx))
        most_open = max(most_open, len(reader.backend.open_parts()))
    return most_open


def test_a_smaller_bound_is_kept_with_its_descriptors(sharded):
    before = open_descriptors()
    reader = pf.open_archive(sharded("zip"), max_open_parts=5)
    assert read_shuffled_batches(reader) == 5
    assert open_descriptors() - before <= 2 * 5
    reader.close()


def test_the_environment_variable_sets_the_bound(sharded, monkeypatch):
    monkeypatch.setenv("PF_MAX_OPEN_PARTS", "7")
    with pf.open_archive(sharded("lmdb")) as reader:
        assert read_shuffled_batches(reader) == 7


def test_a_batch_over_more_parts_than_the_bound_reads_right(sharded):
    with pf.open_archive(sharded("lmdb"), max_open_parts=3) as reader:
        idx = np.random.default_rng(2).permutation(len(reader))[:200]  # some 150 parts in one batch
        batch = reader.read_many(idx)
        assert all(np.array_equal(batch[j], expected(int(i))) for j, i in enumerate(idx))
        assert len(reader.backend.open_parts()) == 3


def test_a_bound_must_be_a_positive_integer(sharded, monkeypatch):
    with pytest.raises(ValueError, match="max_open_parts must be a positive integer"):
        pf.open_archive(sharded("zip"), max_open_parts=0)
    monkeypatch.setenv("PF_MAX_OPEN_PARTS", "many")
    with pytest.raises(ValueError, match="PF_MAX_OPEN_PARTS must be a positive integer"):
        pf.open_archive(sharded("zip"))


def test_make_loader_keeps_the_bound_of_a_reader_it_is_given(sharded):
    from packed_formats.loading.loader import make_loader

    loader = make_loader(pf.open_archive(sharded("zip"), max_open_parts=6), num_workers=0)
    assert loader.reader.backend.max_open_parts == 6


REFUSED = """
def refusal(**options):
    try:
        pf.open_archive(sys.argv[1], **options).close()
    except pf.TooManyOpenFilesError as exc:
        return str(exc)

argument = refusal(max_open_parts=100)
os.environ["PF_MAX_OPEN_PARTS"] = "100"
report(argument=argument, environment=refusal())
"""


@pytest.fixture(scope="module")
def refusals(sharded):
    """How REFUSED's child was refused a bound of 100 parts under LIMIT, asked each way."""
    return run_child(REFUSED, sharded("zip"))


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_bound_that_cannot_fit_the_open_file_limit_is_refused_at_open(sharded, refusals, how):
    refused = refusals[how]
    assert refused is not None and sharded("zip") in refused
    assert "max_open_parts=100" in refused and f"may open {LIMIT}" in refused
    assert "ulimit -n" in refused and "keep at most 48 parts open" in refused  # (128 - 32 reserved) / 2


# ---- make_loader with workers ---------------------------------------------------------------------------
LOADER = """
from packed_formats.loading.loader import make_loader
loader = make_loader(sys.argv[1], batch_size=64, num_workers=2, shuffle=True, multiprocessing_context="fork")
seen, wrong, peak = [], [], 0
for images, labels in loader:
    pids = [w.pid for w in loader.dataloader._iterator._workers]
    peak = max([peak] + [open_fds(pid) for pid in pids])
    for image, label in zip(images.permute(0, 2, 3, 1).numpy(), labels.tolist()):
        i = sample_number(image)
        seen.append(i)
        if not np.array_equal(image, expected(i)) or label != i % 2:
            wrong.append(i)
report(seen=sorted(seen), wrong=wrong, worker_peak=peak)
"""


@pytest.mark.parametrize("fmt", [f if f == "lmdb" else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS])
def test_make_loader_with_two_workers_reads_300_parts_under_a_low_open_file_limit(sharded, fmt):
    report = run_child(LOADER, sharded(fmt))
    assert report["seen"] == list(range(PARTS * PER_PART))
    assert report["wrong"] == []
    assert report["worker_peak"] < LIMIT - 16  # room to spare, not the limit reached


# ---- never a hang ---------------------------------------------------------------------------------------
HAND_BACK = """
import resource
from packed_formats.loading.loader import make_loader

def no_descriptor_left(batch):
    # This worker cannot open one more file from here on (new descriptors would be numbered 3 or
    # more): not even to share the memory of the batch it returns.
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, LIMIT))
    return batch

loader = make_loader(sys.argv[1], batch_size=16, num_workers=2, multiprocessing_context="fork",
                     transform=pf.transforms.Batched(no_descriptor_left))
start = time.monotonic()
try:
    for _ in loader:
        pass
    report(error=None, seconds=time.monotonic() - start)
except Exception as exc:
    report(error=[type(exc).__name__, str(exc)], seconds=time.monotonic() - start)
"""


def test_a_worker_that_cannot_hand_a_batch_back_fails_the_loader_in_seconds(sharded):
    """torch pickles a worker's batch in a queue thread that drops it on failure: without more,
    the main process would wait for that batch forever."""
    report = run_child(HAND_BACK, sharded("lmdb"), timeout=60)
    assert report["error"] is not None
    kind, message = report["error"]
    assert kind == "TooManyOpenFilesError" and "hand a batch back" in message and sharded("lmdb") in message
    assert report["seconds"] < 30


KILL = """
import signal
import torch
from packed_formats.loading.loader import make_loader
if sys.argv[2] == "make_loader":
    loader = make_loader(sys.argv[1], batch_size=8, num_workers=2, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    workers = loader.dataloader._iterator._workers
else:
    dataset = pf.PackedDataset(sys.argv[1], output="tensor")
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=2, shuffle=True,
                                               multiprocessing_context="fork"))
    next(batches)
    workers = batches._workers
start = time.monotonic()
try:
    os.kill(workers[1].pid, signal.SIGKILL)
    for _ in batches:
        pass
    report(error=None, seconds=time.monotonic() - start)
except Exception as exc:
    report(error=[type(exc).__name__, str(exc)], seconds=time.monotonic() - start)
"""


@pytest.mark.parametrize("loader", [pytest.param("make_loader", marks=pytest.mark.slow), "DataLoader"])
def test_a_worker_killed_mid_epoch_fails_the_loader_in_seconds(sharded, loader):
    report = run_child(KILL, sharded("lmdb"), loader, timeout=60)
    assert report["error"] is not None, "the epoch ended as if nothing had happened"
    kind, message = report["error"]
    if loader == "make_loader":
        assert kind == "DataLoaderWorkerError" and ("SIGKILL" in message or "exited unexpectedly" in message)
    else:  # torch's own: its watchdog's RuntimeError, or the reset or closed queue when that is seen first
        assert kind in ("RuntimeError", "ConnectionResetError", "EOFError"), (kind, message)
    assert report["seconds"] < 30
