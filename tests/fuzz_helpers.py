"""The pieces of the corruption fuzz (tests/test_fuzz.py): damage, the read paths, isolation, verdicts.

A trial copies a known-good archive, damages one file of the copy in one
place, reads the copy every way a user can, each in a forked child under a
time limit, and compares what came back with what the intact archive gives.
Every read path must either return exactly the intact data or raise a
``PackedFormatError``; anything else (different data, another exception, a
hang, a signal) is a bad outcome, reported with everything needed to
reproduce it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import resource
import shutil
import signal
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch

import packed_formats as pf

EDGE = 4096  # headers and trailers: where indexes, manifests and central directories live
ZEROS = 512
DAMAGES = ("flip", "bytes", "zeros", "truncate")
READ_PATHS = ("dataset", "dataloader", "make_loader", "verify")
CHILD_MEMORY_LIMIT = 16 << 30  # address space a read child may add: an absurd allocation fails instead of swapping


def limit_memory() -> None:
    """Let this (forked) process and its DataLoader workers add at most ``CHILD_MEMORY_LIMIT`` of address
    space to what it has already: a long test session's parent may hold many GiB of maps, which a fixed
    limit would leave the workers no room beyond (they then die at start, exit code 1)."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    limit = mapped + CHILD_MEMORY_LIMIT
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


BATCH_SIZE = 4

# Verdicts.  The first three are allowed; the others are bugs.
SAME = "same"  # exactly the intact data
NAMED = "named error"  # a PackedFormatError
FLAGGED = "flagged"  # verify: report.ok is False
WRONG = "silent wrong result"
FOREIGN = "exception outside PackedFormatError"
HANG = "hang"
CRASH = "crash"
MISSED = "verify passed a damaged archive"
ALLOWED = (SAME, NAMED, FLAGGED)


# ---- the intact data ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Reference:
    """What each read path gives on the intact archive."""

    count: int
    classes: List[str]
    keys: List[str]
    labels: torch.Tensor  # int64 [N]
    images: torch.Tensor  # uint8 [N, C, H, W]: PackedDataset's pixels (decoded for encoded archives)
    loader_images: torch.Tensor  # what make_loader gives, in order
    loader_labels: torch.Tensor


def loader_options(mode: str) -> dict:
    """make_loader's arguments: every encoded image is decoded at the one size of the uniform archives."""
    options = dict(batch_size=BATCH_SIZE, num_workers=0, shuffle=False)
    if mode == "encoded":
        options["size"] = (24, 32)
    return options


def reference_of(path: str, mode: str) -> Reference:
    """Read the intact archive at ``path`` through PackedDataset and make_loader."""
    with pf.PackedDataset(path, output="tensor") as dataset:
        samples = [dataset[i] for i in range(len(dataset))]
        keys = [dataset.key(i) for i in range(len(dataset))]
        classes = list(dataset.classes)
    loader = pf.make_loader(path, **loader_options(mode))
    batches = list(loader)
    loader.reader.close()
    return Reference(
        count=len(samples),
        classes=classes,
        keys=keys,
        labels=torch.tensor([label for _, label in samples], dtype=torch.int64),
        images=torch.stack([image for image, _ in samples]),
        loader_images=torch.cat([images.contiguous() for images, _ in batches]),
        loader_labels=torch.cat([labels for _, labels in batches]),
    )


# ---- damage -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Damage:
    """One change to one file of an archive: ``kind`` at byte ``offset`` of ``file`` (relative to the archive)."""

    file: str  # "" for a single-file archive: the archive itself
    size: int  # the file's size before the damage
    kind: str  # one of DAMAGES
    offset: int
    payload: bytes = b""  # "bytes": what is written; "flip": the one-bit mask

    def describe(self) -> str:
        where = f"file {self.file or '<the archive file>'} ({self.size} bytes)"
        if self.kind == "flip":
            what = f"flip bit mask 0x{self.payload[0]:02x} at offset {self.offset}"
        elif self.kind == "bytes":
            what = f"write {self.payload.hex()} at offset {self.offset}"
        elif self.kind == "zeros":
            what = f"write {ZEROS} zero bytes at offset {self.offset}"
        else:
            what = f"truncate to {self.offset} bytes"
        return f"{where}: {what}"


def archive_files(path: str) -> List[Tuple[str, int]]:
    """(name relative to the archive, size) of every file of the archive at ``path``, as its reader lists them."""
    with pf.open_archive(path) as reader:
        files = reader.files()
    return [(relative_name(path, f), os.path.getsize(f)) for f in files]


def relative_name(archive: str, file: str) -> str:
    return "" if os.path.abspath(file) == os.path.abspath(archive) else os.path.relpath(file, archive)


def file_of(archive: str, name: str) -> str:
    return os.path.join(archive, name) if name else archive


def choose_offset(rng: random.Random, size: int, landmarks: Tuple[int, ...] = ()) -> int:
    """A byte offset in a file of ``size`` bytes: half of the time anywhere; else in its first or last EDGE
    bytes or, given ``landmarks`` (where its structures start), at most 600 bytes from one of them."""
    if rng.random() < 0.5:
        return rng.randrange(size)
    where = rng.random()
    if landmarks and where < 1 / 3:
        return min(size - 1, max(0, rng.choice(landmarks) + rng.randrange(-88, 600)))
    if where < 2 / 3:
        return rng.randrange(min(EDGE, size))
    return rng.randrange(max(0, size - EDGE), size)


def choose_damage(
    rng: random.Random, files: List[Tuple[str, int]], landmarks: Optional[Dict[str, Tuple[int, ...]]] = None
) -> Damage:
    """One damage, drawn from ``rng``, to one of ``files`` (``archive_files``'s list), aimed at the
    ``landmarks`` (``landmarks_of``) of the file a third of the time it is aimed at all."""
    name, size = rng.choice([f for f in files if f[1] > 0])
    kind = rng.choice(DAMAGES)
    offset = choose_offset(rng, size, (landmarks or {}).get(name, ()))
    payload = b""
    if kind == "flip":
        payload = bytes([1 << rng.randrange(8)])
    elif kind == "bytes":
        length = rng.randint(2, 16)
        payload = bytes(rng.randrange(256) for _ in range(length))
    return Damage(name, size, kind, offset, payload)


def copy_archive(src: str, dst: str) -> str:
    """A copy of the archive (file or directory) ``src`` at ``dst``."""
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)
    return dst


def apply_damage(archive: str, damage: Damage) -> None:
    """Damage the archive at ``archive`` (a copy) in place."""
    path = file_of(archive, damage.file)
    if damage.kind == "truncate":
        os.truncate(path, damage.offset)
        return
    with open(path, "r+b") as file:
        file.seek(damage.offset)
        if damage.kind == "flip":
            old = file.read(1)
            file.seek(damage.offset)
            file.write(bytes([old[0] ^ damage.payload[0]]))
        elif damage.kind == "bytes":
            file.write(damage.payload[: damage.size - damage.offset])
        else:
            file.write(bytes(min(ZEROS, damage.size - damage.offset)))


# ---- the read paths: each returns None (the intact data) or a description of the first difference -------
def first_difference(name: str, got, expected) -> Optional[str]:
    """None when ``got`` equals ``expected`` (tensors: same shape, dtype and values), else what differs."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{name}: got a {type(got).__name__}, expected a tensor"
        if got.shape != expected.shape or got.dtype != expected.dtype:
            return f"{name}: got {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}"
        if not torch.equal(got, expected):
            return f"{name}: {int((got != expected).sum())} values differ"
        return None
    return None if got == expected else f"{name}: got {got!r:.200}, expected {expected!r:.200}"


def read_dataset(path: str, ref: Reference, mode: str) -> Optional[str]:
    """``PackedDataset(path)[i]`` and ``key(i)`` for every i, its classes, length and targets."""
    dataset = pf.PackedDataset(path, output="tensor")
    checks = [("count", len(dataset), ref.count), ("classes", list(dataset.classes), ref.classes)]
    for name, got, expected in checks:
        problem = first_difference(name, got, expected)
        if problem:
            return problem
    problem = first_difference("targets", torch.as_tensor(dataset.targets, dtype=torch.int64), ref.labels)
    if problem:
        return problem
    for i in range(ref.count):
        image, label = dataset[i]
        for name, got, expected in (
            (f"sample {i} pixels", image, ref.images[i]),
            (f"sample {i} label", label, int(ref.labels[i])),
            (f"sample {i} key", dataset.key(i), ref.keys[i]),
        ):
            problem = first_difference(name, got, expected)
            if problem:
                return problem
    return None


def read_dataloader(path: str, ref: Reference, mode: str) -> Optional[str]:
    """A plain DataLoader with 2 workers over the whole PackedDataset."""
    dataset = pf.PackedDataset(path, output="tensor")
    problem = first_difference("count", len(dataset), ref.count)
    if problem:
        return problem
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=2)
    batches = list(loader)
    images = torch.cat([images for images, _ in batches]) if batches else torch.empty(0)
    labels = torch.cat([labels for _, labels in batches]) if batches else torch.empty(0)
    return first_difference("images", images, ref.images) or first_difference("labels", labels, ref.labels)


def read_make_loader(path: str, ref: Reference, mode: str) -> Optional[str]:
    """``make_loader(path, batch_size=4, num_workers=0, shuffle=False)`` over one epoch."""
    loader = pf.make_loader(path, **loader_options(mode))
    problem = first_difference("classes", list(loader.classes), ref.classes)
    if problem:
        return problem
    batches = list(loader)
    images = torch.cat([images.contiguous() for images, _ in batches]) if batches else torch.empty(0)
    labels = torch.cat([labels for _, labels in batches]) if batches else torch.empty(0)
    return first_difference("images", images, ref.loader_images) or first_difference(
        "labels", labels, ref.loader_labels
    )


class Flagged(Exception):
    """verify_archive's report says the archive is bad (an allowed outcome, carried out of the child)."""


def read_verify(path: str, ref: Reference, mode: str) -> Optional[str]:
    """``verify_archive(path, decode=True)``: Flagged when its report is not ok."""
    report = pf.verify_archive(path, decode=True)
    if not report.ok:
        raise Flagged(report.lines()[-1])
    return first_difference("verified count", report.count, ref.count)


READERS: Dict[str, Callable[[str, Reference, str], Optional[str]]] = {
    "dataset": read_dataset,
    "dataloader": read_dataloader,
    "make_loader": read_make_loader,
    "verify": read_verify,
}


# ---- running a read path in a child ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Outcome:
    verdict: str
    detail: str = ""

    @property
    def allowed(self) -> bool:
        return self.verdict in ALLOWED

    def __str__(self) -> str:
        return f"{self.verdict}: {self.detail}" if self.detail else self.verdict


def verdict_of_exception(exc: BaseException) -> Outcome:
    """What an exception out of a read path means."""
    text = f"{type(exc).__name__}: {exc}"[:400]
    if isinstance(exc, Flagged):
        return Outcome(FLAGGED, str(exc)[:400])
    if isinstance(exc, pf.PackedFormatError):
        return Outcome(NAMED, text)
    if isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc):  # a worker died of a signal
        return Outcome(CRASH, text)
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    return Outcome(FOREIGN, text + (f" (at {where.filename}:{where.lineno})" if where else ""))


def _child(connection, read, path: str, ref: Reference, mode: str) -> None:
    """In the forked child: its own process group (so that a hang's DataLoader workers die with it), a memory
    limit, then the read; the outcome goes back through ``connection``."""
    os.setpgid(0, 0)
    limit_memory()
    # A forked child must not enter the OpenMP thread pool its parent used (GNU OpenMP is not fork-safe:
    # the child hangs); DataLoader's own workers run one torch thread for the same reason.
    torch.set_num_threads(1)
    try:
        difference = read(path, ref, mode)
        outcome = Outcome(SAME) if difference is None else Outcome(WRONG, difference)
    except BaseException as exc:  # noqa: B036 - every way out of a read is an outcome to report
        outcome = verdict_of_exception(exc)
    connection.send(outcome)
    connection.close()


def run_isolated(read, path: str, ref: Reference, mode: str, timeout: float) -> Outcome:
    """Run ``read(path, ref, mode)`` in a forked child; a hang past ``timeout`` seconds or a signal is an outcome."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(sender, read, path, ref, mode), daemon=False)
    child.start()
    sender.close()
    try:
        if receiver.poll(timeout):
            try:
                outcome = receiver.recv()
            except EOFError:
                outcome = None  # the child died before it could answer
            child.join(timeout)
        else:
            outcome = None
        if child.is_alive():
            kill_group(child)
            return Outcome(HANG, f"no answer in {timeout:.0f} s")
        if outcome is None:
            kill_group(child)
            return Outcome(CRASH, exit_description(child.exitcode))
        return outcome
    finally:
        receiver.close()


def kill_group(child) -> None:
    """End ``child`` and what it started (its DataLoader workers: the child leads their process group)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.kill()
    child.join()


def exit_description(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code} without an answer"


# ---- a trial -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Trial:
    """One damaged copy and what every read path made of it."""

    seed: int
    number: int
    fmt: str
    mode: str
    damage: Damage
    outcomes: Dict[str, Outcome]

    def bad(self) -> List[Tuple[str, Outcome]]:
        """(read path, outcome) of every forbidden outcome, a verify that passed a damaged archive included."""
        found = [(path, outcome) for path, outcome in self.outcomes.items() if not outcome.allowed]
        verify = self.outcomes.get("verify")
        if verify is not None and verify.verdict == SAME:
            unreadable = [p for p, o in self.outcomes.items() if p != "verify" and o.verdict != SAME]
            if unreadable:
                found.append(("verify", Outcome(MISSED, f"ok, but {', '.join(unreadable)} did not read it back")))
        return found

    def reproduction(self, path: str, outcome: Outcome) -> str:
        return (
            f"seed {self.seed} trial {self.number}: {self.fmt}/{self.mode}, {self.damage.describe()}; "
            f"read path {path}: {outcome}"
        )


def trial_rng(seed: int, fmt: str, mode: str, number: int) -> random.Random:
    """The generator of one trial: the same seed, kind and number always draw the same damage."""
    return random.Random(f"packed-formats-fuzz/{seed}/{fmt}/{mode}/{number}")


def run_trial(good: str, workdir: str, seed: int, number: int, fmt: str, mode: str, ref: Reference,
              files: List[Tuple[str, int]], timeout: float) -> Trial:
    """Copy ``good`` into ``workdir``, damage the copy, read it every way; the copy is removed after."""
    damage = choose_damage(trial_rng(seed, fmt, mode, number), files)
    copy = copy_archive(good, os.path.join(workdir, f"trial-{number}-{os.path.basename(good)}"))
    try:
        apply_damage(copy, damage)
        outcomes = {name: run_isolated(READERS[name], copy, ref, mode, timeout) for name in READ_PATHS}
    finally:
        (shutil.rmtree if os.path.isdir(copy) else os.unlink)(copy)
    return Trial(seed, number, fmt, mode, damage, outcomes)


def tally(trials: List[Trial]) -> Dict[str, int]:
    """How many (trial, read path) pairs ended in each verdict, a verify that missed damage counted too."""
    counts: Dict[str, int] = {}
    for trial in trials:
        for outcome in trial.outcomes.values():
            counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
        for _, outcome in trial.bad():
            if outcome.verdict == MISSED:
                counts[MISSED] = counts.get(MISSED, 0) + 1
    return counts


# ---- many trials: batches of trials, each batch in its own process, two at a time --------------------------
@dataclasses.dataclass(frozen=True)
class Job:
    """The trials ``numbers`` of one archive kind: what a batch process needs to run them."""

    good: str  # the intact archive
    workdir: str
    seed: int
    fmt: str
    mode: str
    numbers: Tuple[int, ...]
    ref: Reference
    files: Tuple[Tuple[str, int], ...]
    landmarks: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()


def _batch(connection, job: Job) -> None:
    """In a forked batch process: each trial's damaged copy read every way, in this process; before each
    read path a ("start", number, path) message, after it ("done", number, path, outcome), so that the
    parent knows which read hung or crashed the batch."""
    os.setpgid(0, 0)
    limit_memory()
    torch.set_num_threads(1)
    # Started by the forkserver, this process starts its DataLoader workers by forkserver too, from a
    # forkserver of its own (one a batch, in its process group).  Without a preload that forkserver imports
    # nothing, so each worker imported torch: 3 s a DataLoader read, most of the fuzz's time.
    multiprocessing.set_forkserver_preload(["torch", "packed_formats"])
    landmarks = dict(job.landmarks)
    for number in job.numbers:
        damage = choose_damage(trial_rng(job.seed, job.fmt, job.mode, number), list(job.files), landmarks)
        connection.send(("damage", number, damage))
        copy = copy_archive(job.good, os.path.join(job.workdir, f"trial-{number}-{os.path.basename(job.good)}"))
        try:
            apply_damage(copy, damage)
            for name in paths_of_trial(number):
                connection.send(("start", number, name))
                try:
                    difference = READERS[name](copy, job.ref, job.mode)
                    outcome = Outcome(SAME) if difference is None else Outcome(WRONG, difference)
                except BaseException as exc:  # noqa: B036 - every way out of a read is an outcome to report
                    outcome = verdict_of_exception(exc)
                connection.send(("done", number, name, outcome))
        finally:
            (shutil.rmtree if os.path.isdir(copy) else os.unlink)(copy)
    connection.send(("end",))
    connection.close()


DATALOADER_EVERY = 4  # the 2-worker DataLoader path (the slowest: it starts 2 processes) runs in every 4th trial


def paths_of_trial(number: int) -> Tuple[str, ...]:
    """The read paths of trial ``number`` in a batch: all of them, the DataLoader one in every DATALOADER_EVERY-th."""
    return tuple(p for p in READ_PATHS if p != "dataloader" or number % DATALOADER_EVERY == 0)


def run_job(job: Job, timeout: float) -> List[Trial]:
    """Run ``job``'s trials in batch processes: a read that sends nothing for ``timeout`` seconds is a hang
    (its batch is killed), a batch that dies is a crash of its current read; the rest go on in a new batch.
    Batches start from the forkserver, a fresh interpreter: forked from the test session (and from a thread
    of it), they inherited what earlier tests left behind, under which their DataLoader workers could not start."""
    context = multiprocessing.get_context("forkserver")
    trials: Dict[int, Trial] = {}
    todo = list(job.numbers)
    while todo:
        receiver, sender = context.Pipe(duplex=False)
        batch = context.Process(target=_batch, args=(sender, dataclasses.replace(job, numbers=tuple(todo))))
        batch.start()
        sender.close()
        current: Optional[Tuple[int, str]] = None
        try:
            while True:
                if not receiver.poll(timeout):
                    failure = Outcome(HANG, f"no answer in {timeout:.0f} s")
                    break
                try:
                    message = receiver.recv()
                except EOFError:
                    batch.join(timeout)
                    failure = Outcome(CRASH, exit_description(batch.exitcode))
                    break
                if message[0] == "damage":
                    trials[message[1]] = Trial(job.seed, message[1], job.fmt, job.mode, message[2], {})
                    todo.remove(message[1])
                elif message[0] == "start":
                    current = (message[1], message[2])
                elif message[0] == "done":
                    trials[message[1]].outcomes[message[2]] = message[3]
                    current = None
                else:
                    failure = None
                    break
        finally:
            receiver.close()
            kill_group(batch)
        if failure is not None:
            if current is None:  # died between reads: charge it to the trial under way, else stop
                if not trials:
                    raise RuntimeError(f"a fuzz batch failed before its first trial: {failure}")
                current = (max(trials), "between reads")
            trials[current[0]].outcomes[current[1]] = failure
            copy = os.path.join(job.workdir, f"trial-{current[0]}-{os.path.basename(job.good)}")
            if os.path.lexists(copy):
                (shutil.rmtree if os.path.isdir(copy) else os.unlink)(copy)
    return [trials[n] for n in sorted(trials)]


def run_jobs(jobs: List[Job], timeout: float, processes: int = 2) -> List[Trial]:
    """``run_job`` over ``jobs``, ``processes`` batches at a time (threads wait on the batch processes)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(processes) as pool:
        return [trial for trials in pool.map(lambda job: run_job(job, timeout), jobs) for trial in trials]


# ---- where the structure is: damage aimed at what decides the archive ----------------------------------------
_MARKERS = (
    b'{\n "',  # a manifest's text (the HDF5 attribute, the ZIP member, the LMDB value)
    b"\x89HDF\r\n\x1a\n", b"TREE", b"HEAP", b"SNOD", b"GCOL", b"OHDR", b"OCHK",  # HDF5 superblock, B-trees, heaps
    b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07",  # ZIP headers and end records
    b"\x93NUMPY",  # .npy headers
)
_MAX_LANDMARKS = 64


def landmarks_of(archive: str, files: List[Tuple[str, int]]) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """(file, offsets) of every file of ``archive``: where its structures start (the markers above, every
    4 KiB page start of an LMDB file), at most _MAX_LANDMARKS per file, evenly picked."""
    found = []
    for name, _size in files:
        with open(file_of(archive, name), "rb") as file:
            data = file.read()
        offsets = set()
        for marker in _MARKERS:
            at = data.find(marker)
            while at >= 0:
                offsets.add(at)
                at = data.find(marker, at + 1)
        if archive.endswith(".lmdb") or name.endswith(".mdb"):
            offsets.update(range(0, len(data), 4096))
        ordered = sorted(offsets)
        step = max(1, len(ordered) // _MAX_LANDMARKS)
        found.append((name, tuple(ordered[::step])))
    return tuple(found)
