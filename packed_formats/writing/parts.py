"""Parts of a sharded set written independently (``convert --part I/N``) and joined once all are sealed.

A sharded conversion (``--shard-size S``) splits the source into slots of S
samples: slot k holds samples ``k*S .. (k+1)*S - 1`` and is written as the part
``<stem>-0000k<ext>`` (``backends.sharded.part_name``), the same files a
one-process conversion writes.  With ``--part I/N`` (one task of N, such as a
Slurm array task) a conversion writes only the slots ``I*K//N .. (I+1)*K//N - 1``
of the K slots, so the split does not depend on N, each part is
byte-identical to the one-process conversion's, and ``join`` writes the same
index (``backends.sharded`` writes and reads it).  The set's id is derived
from the plan (``set_id``), by every task and by a one-process conversion
alike, and each part's manifest names its slot as its place in the set.  The
plan names what the source lists and where it is, not its pixels: each seal
records the content digest of the part it seals (``sharded.part_digest``) and
the index records it, so a part put in place of another after its seal, even
one of another conversion by the same plan, is refused when the set is opened.

What the tasks share lives beside the destination, in ``.<name>.pf-parts/``:

* ``plan.json``: what the set is made from (the source's listing and location,
  the options, the library version) and into how many tasks it was split,
  written by the first task to start; every later task must match it (``--part
  auto`` takes N from it, so a re-run of one array task alone finds its slots);
* ``<part>.lock``: held (``flock``) by the process writing that part, released
  by the system however the process ends, so a second writer of the same part
  is refused at once and a killed writer leaves no stale lock;
* ``<part>.seal``: written once the part is in place: its slot, its sample
  count, its content digest and its files' sizes and modification times.  A
  part without a seal (its task was killed while writing it) is rewritten by
  the next run of that task, and ``join`` refuses it.

A part written with the same plan and still as sealed is not written again:
re-running a finished task changes nothing.  ``join`` (``packed-formats join
DST``, or the last task to finish) checks every seal and every part against
them and publishes the index only when all are there: a refusal names what is
missing or differs and leaves nothing at the destination.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import re
import socket
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from .. import __version__
from ..backends.files import remove_path, temp_path_for
from ..backends.set_samples import sample_index, samples_name
from ..backends.sharded import file_digest, index_text, part_name
from ..errors import ArchiveExistsError, ArchiveInUseError, CorruptArchiveError, IncompleteArchiveError
from ..manifest import part_of_set
from ..sources import Source

PLAN_VERSION = 1
_TEMP_MARK = ".pf-tmp-"


# ---- which slots a task writes ----------------------------------------------------------------------------
def parse_part(text: str, environ: "Optional[Mapping[str, str]]" = None) -> Tuple[Optional[int], Optional[int]]:
    """``"I/N"`` as (I, N), 0 <= I < N; ``"auto"`` as (I, None) from ``SLURM_ARRAY_TASK_ID`` (N comes from the
    set's plan when one exists, else from ``SLURM_ARRAY_TASK_COUNT``: see ``resolve_tasks``).  ValueError otherwise."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    text = text.strip()
    if text == "auto":
        task = env.get("SLURM_ARRAY_TASK_ID")
        if task is None or not task.isdigit():
            raise ValueError("--part auto reads SLURM_ARRAY_TASK_ID, which is not set: run it as a Slurm array "
                             "task (sbatch --array=0-N-1), or give --part I/N")
        return int(task), None
    index, _, count = text.partition("/")
    if not (index.strip().isdigit() and count.strip().isdigit()) or int(count) < 1 or int(index) >= int(count):
        raise ValueError(f"--part must be I/N with 0 <= I < N (task I of N, counted from 0) or auto, got {text!r}")
    return int(index), int(count)


def resolve_tasks(task: int, tasks: Optional[int], plan: Optional[dict], environ: "Optional[Mapping[str, str]]" = None
                  ) -> int:
    """N for ``--part auto``: the plan's (a re-run of one task, ``sbatch --array=3``, keeps the split), or the
    array's ``SLURM_ARRAY_TASK_COUNT``.  An explicit N is returned as given."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if tasks is None:
        count = env.get("SLURM_ARRAY_TASK_COUNT", "")
        tasks = int(plan["tasks"]) if plan is not None else int(count) if count.isdigit() else 0
        if task >= tasks:
            raise ValueError(f"--part auto: array task {task} is not one of 0..{tasks - 1}: submit the array as "
                             f"--array=0-{max(tasks, task + 1) - 1} (tasks are counted from 0)")
    return tasks


def slot_count(samples: int, shard_size: int) -> int:
    """How many parts (slots) a set of ``samples`` in parts of ``shard_size`` has."""
    return max(1, -(-samples // shard_size))


def task_slots(task: int, tasks: int, slots: int) -> range:
    """The slots task ``task`` of ``tasks`` writes: a contiguous run, the same for every N's union."""
    return range(task * slots // tasks, (task + 1) * slots // tasks)


def task_of_slot(slot: int, tasks: int, slots: int) -> int:
    """The task (of ``tasks``) that writes ``slot``."""
    return next(t for t in range(tasks) if slot in task_slots(t, tasks, slots))


# ---- a slot of the source ------------------------------------------------------------------------------------
class SourceRange(Source):
    """Samples ``start .. stop - 1`` of ``source``, as a source of their own (what one part is made from)."""

    kind = "range"

    def __init__(self, source: Source, start: int, stop: int) -> None:
        super().__init__(source.path, source.classes, source.keys[start:stop], source.labels[start:stop],
                         skipped=source.skipped, failed=source.failed if start == 0 else [], layout=source.layout)
        self.source, self.start = source, start
        self.random_access = source.random_access
        self.fields, self.labelled = source.fields, source.labelled

    def load_fields(self, i: int) -> Dict[str, Any]:
        return self.source.load_fields(self.start + i)

    def location(self, i: int) -> str:
        return self.source.location(self.start + i)

    def load(self, i: int) -> Any:
        return self.source.load(self.start + i)

    def __iter__(self) -> Iterator[Any]:
        if self.random_access:
            yield from super().__iter__()
            return
        for i, sample in enumerate(self.source):  # one ordered pass: what comes before is read and dropped
            if i >= self.start + len(self):
                break
            if i >= self.start:
                yield sample

    @property
    def raw_shape(self) -> Optional[Tuple[int, int, int]]:
        return self.source.raw_shape

    def stored_size(self, i: int) -> Optional[int]:
        return self.source.stored_size(self.start + i)

    def runs(self) -> Optional[np.ndarray]:
        runs = self.source.runs()
        if runs is None:
            return None
        inside = runs[(runs > self.start) & (runs < self.start + len(self))] - self.start
        return np.concatenate([[0], inside]).astype(np.int64)


def source_location(source: Source) -> str:
    """Where the source is (its real path, when it is one on this machine; else its name, as a Python
    source's): tasks that read other folders listing the same names are tasks of other conversions, and
    the plan tells them apart by it."""
    path = str(source.path)
    return os.path.realpath(path) if os.path.exists(path) else path


def listing_digest(source: Source) -> str:
    """A digest of what the source lists (classes, keys, labels): parts from another source differ in it."""
    digest = hashlib.sha256()
    digest.update(json.dumps(list(source.classes)).encode())
    digest.update(np.ascontiguousarray(source.keys).tobytes())
    digest.update(np.ascontiguousarray(source.labels, dtype="<i8").tobytes())
    return digest.hexdigest()


# ---- the set's shared state beside the destination ------------------------------------------------------------
def state_dir(dst: str) -> str:
    """The folder of the set's plan, locks and seals: ``.<name>.pf-parts`` beside ``dst``."""
    directory, name = os.path.split(os.path.abspath(dst))
    return os.path.join(directory, f".{name}.pf-parts")


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as file:
            value = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CorruptArchiveError(path, f"cannot read it: {exc}", hint="remove it and re-run the task") from None
    if not isinstance(value, dict):
        raise CorruptArchiveError(path, "not a JSON object", hint="remove it and re-run the task")
    return value


def _write_json(path: str, value: dict, exclusive: bool = False) -> bool:
    """Write ``value`` to ``path`` atomically; with ``exclusive``, only if ``path`` does not exist (False then)."""
    temp = f"{path}{_TEMP_MARK}{os.getpid()}"
    with open(temp, "w") as file:
        file.write(json.dumps(value, indent=1, sort_keys=True) + "\n")
        file.flush()
        os.fsync(file.fileno())
    try:
        if not exclusive:
            os.replace(temp, path)
            return True
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        return True
    finally:
        if exclusive:
            remove_path(temp)


def ensure_plan(dst: str, plan: dict) -> dict:
    """The set's plan: ``plan`` when this task is the first, else the one written before, which must agree
    with ``plan`` on everything but the number of tasks (CorruptArchiveError naming what differs)."""
    directory = state_dir(dst)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "plan.json")
    if not _write_json(path, plan, exclusive=True):
        existing = _read_json(path)
        if existing is None:
            raise CorruptArchiveError(path, "the plan vanished while it was read", hint="re-run the task")
        _check_same(path, dst, existing, plan)
        return existing
    return plan


def read_plan(dst: str) -> Optional[dict]:
    """The set's plan, or None when no task has started."""
    return _read_json(os.path.join(state_dir(dst), "plan.json"))


def _check_same(path: str, dst: str, existing: dict, plan: dict) -> None:
    ignored = ("tasks",)
    for field in sorted(set(existing) | set(plan), key=lambda f: (f == "location", f)):  # where, when all else agrees
        was, now = existing.get(field, _LEFT_OUT.get(field)), plan.get(field, _LEFT_OUT.get(field))
        if field not in ignored and was != now:
            raise CorruptArchiveError(
                dst,
                f"the set's parts are being written from another {_WHAT.get(field, field)}: "
                f"{was!r} (in {os.path.basename(path)}), this conversion has {now!r}",
                hint=f"convert with the same source and options, or remove the set's parts and {state_dir(dst)} "
                     "to start it again",
            )


_WHAT = {"source": "source listing", "location": "source location", "version": "library version",
         "shard_size": "shard size", "resize_mode": "resize mode", "samples": "number of samples",
         "raw_layout": "raw layout"}
_LEFT_OUT = {"raw_layout": "hwc"}  # what a plan means by a key it leaves out


def make_plan(source: Source, format: str, recipe: Any, on_error: str, shard_size: int,
              tasks: int) -> dict:
    """What a set is made from, and how it is split."""
    return {
        "packed_formats_parts": PLAN_VERSION, "version": __version__, "source": listing_digest(source),
        "location": source_location(source),
        "samples": len(source), "format": format, "mode": recipe.mode,
        "size": None if recipe.size is None else list(recipe.size), "resize_mode": recipe.resize_mode,
        "encoding": recipe.encoding, "quality": recipe.quality, "on_error": on_error, "shard_size": shard_size,
        "slots": slot_count(len(source), shard_size), "tasks": tasks,
        **({"fields": [spec.describe() for spec in source.fields]} if source.fields else {}),
        **({"boxes": [list(pair) for pair in recipe.boxes]} if recipe.boxes else {}),
        **({"raw_layout": recipe.raw_layout} if recipe.raw_layout != "hwc" else {}),  # an hwc plan as it was
    }


# ---- one part: lock, write, seal ---------------------------------------------------------------------------
class PartLock:
    """The lock of one part (``flock``: released by the system however its holder ends)."""

    def __init__(self, dst: str, name: str) -> None:
        self.path = os.path.join(state_dir(dst), f"{name}.lock")
        self.dst, self.name, self.fd = dst, name, -1

    def __enter__(self) -> "PartLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise ArchiveInUseError(
                self.dst, f"part {self.name} is being written by {holder}",
                hint="let that task finish it (this one stops here), or end it first",
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, _holder().encode(), 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)  # releases the lock


def _holder() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    array = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    slurm = f", Slurm job {array[0]}_{array[1]}" if all(array) else f", Slurm job {job}" if job else ""
    return f"process {os.getpid()} on {socket.gethostname()}{slurm}"


def _files_state(path: str) -> List[List[Any]]:
    """[name, size, mtime_ns] of a part's files (the part itself, or each file of a folder part)."""
    if os.path.isdir(path):
        files = sorted(os.listdir(path))
        return [[f, *_stat(os.path.join(path, f))] for f in files]
    return [[os.path.basename(path), *_stat(path)]]


def _stat(path: str) -> List[int]:
    info = os.stat(path)
    return [info.st_size, info.st_mtime_ns]


def seal_path(dst: str, name: str) -> str:
    return os.path.join(state_dir(dst), f"{name}.seal")


def _is_sealed(dst: str, slot: int, plan: dict) -> bool:
    """Whether ``slot``'s part is in place and as its seal, written with ``plan``."""
    name = part_name(dst, slot)
    seal = _read_json(seal_path(dst, name))
    part = os.path.join(os.path.dirname(os.path.abspath(dst)), name)
    if seal is None or seal.get("plan") != _plan_id(plan) or seal.get("slot") != slot or not os.path.lexists(part) \
            or not isinstance(seal.get("content"), str):
        return False
    return seal.get("files") == _files_state(part)


def _plan_id(plan: dict) -> str:
    fields = {k: v for k, v in plan.items() if k != "tasks"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def set_id(plan: dict) -> str:
    """The id of the set made by ``plan``: its plan's id (16 hexadecimal digits), which every task
    computes alike, named by each part's manifest and by the index ``join`` writes."""
    return _plan_id(plan)


WritePart = Callable[[Source, str], Tuple[int, List[str]]]


def write_slots(source: Source, dst: str, plan: dict, task: int, tasks: int, write: WritePart
                ) -> Tuple[int, List[str], List[str], List[str]]:
    """Write task ``task``'s slots of ``tasks`` (``write(range_source, part_path) -> (written, failed)``
    writes one part in place, atomically); return (samples written, failed, parts written, parts already
    sealed)."""
    directory = os.path.dirname(os.path.abspath(dst))
    shard, slots, samples = int(plan["shard_size"]), int(plan["slots"]), int(plan["samples"])
    written, failed, done, kept = 0, [], [], []  # type: Tuple[int, List[str], List[str], List[str]]
    for slot in task_slots(task, tasks, slots):
        name = part_name(dst, slot)
        path = os.path.join(directory, name)
        with PartLock(dst, name):
            if _is_sealed(dst, slot, plan):
                kept.append(path)
                continue
            remove_path(seal_path(dst, name))  # from here the part is unsealed until it is written again
            for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}{_TEMP_MARK}*")):
                remove_path(stale)  # a killed writer's: this process holds the part's lock
            start = slot * shard
            with part_of_set(set_id(plan), slot):  # the part's manifest names the set and its place in it
                count, bad = write(SourceRange(source, start, min(samples, start + shard)), path)
            seal = {"slot": slot, "name": name, "plan": _plan_id(plan), "count": count, "task": f"{task}/{tasks}",
                    "content": file_digest(path, plan["format"]), "files": _files_state(path)}
            _write_json(seal_path(dst, name), seal)
        written, failed = written + count, failed + bad
        done.append(path)
    return written, failed, done, kept


# ---- joining ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class JoinState:
    """What ``join`` found: the plan, each slot's (name, count, content digest), and the slots not ready
    (with why)."""

    plan: dict
    parts: List[Tuple[str, int, str]]
    missing: Dict[int, str]


def inspect(dst: str) -> JoinState:
    """The state of the set at ``dst``'s parts (IncompleteArchiveError when no task has started;
    CorruptArchiveError when two seals claim one slot or a seal does not fit its part)."""
    plan = read_plan(dst)
    if plan is None:
        raise IncompleteArchiveError(
            dst, f"no parts of it were written ({state_dir(dst)} has no plan)",
            hint="convert it first with --part I/N (or --part auto in a Slurm array job)",
        )
    directory = os.path.dirname(os.path.abspath(dst))
    slots, tasks = int(plan["slots"]), int(plan["tasks"])
    claimed: Dict[int, List[str]] = {}
    for seal_file in sorted(glob.glob(os.path.join(glob.escape(state_dir(dst)), "*.seal"))):
        seal = _read_json(seal_file) or {}
        slot, name = seal.get("slot"), os.path.basename(seal_file)[: -len(".seal")]
        if not isinstance(slot, int) or not 0 <= slot < slots:
            raise CorruptArchiveError(seal_file, f"claims slot {slot!r}, not one of the set's 0..{slots - 1}",
                                      hint="remove it and re-run the task that writes that part")
        claimed.setdefault(slot, []).append(name)
    for slot, names in sorted(claimed.items()):
        if len(names) > 1:
            raise CorruptArchiveError(
                dst, f"two parts claim slot {slot}: {' and '.join(names)}",
                hint=f"remove the one that is not {part_name(dst, slot)} (and its seal) and join again",
            )
        if names[0] != part_name(dst, slot):
            name = names[0]
            raise CorruptArchiveError(
                dst, f"part {name} claims slot {slot}, which is {part_name(dst, slot)}'s",
                hint="parts are not renamed: remove it (and its seal) and re-run the task that writes it",
            )
    parts, missing = [], {}
    for slot in range(slots):
        name = part_name(dst, slot)
        path = os.path.join(directory, name)
        sealed = _read_json(seal_path(dst, name))
        task = task_of_slot(slot, tasks, slots)
        again = f"re-run task {task} of {tasks} (--part {task}/{tasks})"
        if not os.path.lexists(path):
            missing[slot] = f"part {name} is missing: {again}"
        elif sealed is None:
            missing[slot] = f"part {name} is not sealed (its writer did not finish): {again}"
        elif sealed.get("plan") != _plan_id(plan):
            raise CorruptArchiveError(
                dst, f"part {name} was written by another conversion (another source, options or library version)",
                hint=f"{again} with this set's source and options",
            )
        elif sealed.get("files") != _files_state(path):
            raise CorruptArchiveError(dst, f"part {name} changed after it was sealed", hint=again)
        elif not re.fullmatch(r"[0-9a-f]{16}", str(sealed.get("content"))):
            raise CorruptArchiveError(dst, f"part {name}'s seal does not record what the part holds", hint=again)
        else:
            parts.append((name, int(sealed["count"]), sealed["content"]))
    return JoinState(plan, parts, missing)


def join(dst: str, require_all: bool = True) -> Optional[str]:
    """Publish the index of the set at ``dst`` once every part is sealed; return its path (None when parts
    are missing and not ``require_all``).  Refusals (IncompleteArchiveError, CorruptArchiveError,
    ArchiveExistsError) leave nothing at ``dst``.  The set's sample index (``backends.set_samples``) is
    written beside the parts first, and the index records it."""
    state = inspect(dst)
    if state.missing:
        if not require_all:
            return None
        first = min(state.missing)
        more = f" (and {len(state.missing) - 1} more)" if len(state.missing) > 1 else ""
        raise IncompleteArchiveError(dst, f"{state.missing[first]}{more}", hint="then join again")
    temp = temp_path_for(dst)  # a killed join's is cleaned like a killed conversion's
    _write_synced(temp, index_text(state.plan["format"], state.parts, set_id(state.plan)).encode())
    try:
        try:  # the parts open as one set (counts, modes, shapes, classes and contents agree), and are indexed
            data, text = sample_index(temp, samples_name(os.path.basename(dst)))
        except CorruptArchiveError as exc:  # named as the set, not as the index's temporary name
            raise CorruptArchiveError(dst, exc.problem or str(exc), hint=exc.hint) from None
        _write_synced(temp, text.encode())
        if os.path.lexists(dst):
            with open(dst, "rb") as existing:
                if existing.read() != text.encode():
                    raise ArchiveExistsError(dst, "already exists and is not this set's index",
                                             hint="remove it, then join again") from None
        samples = os.path.join(os.path.dirname(os.path.abspath(dst)), samples_name(os.path.basename(dst)))
        if _read_or_none(samples) != data:  # the same left as it is: joining again changes nothing
            samples_temp = temp_path_for(samples)
            try:  # the sample index before the index: a reader that finds the index finds what it records
                _write_synced(samples_temp, data)
                os.replace(samples_temp, samples)
            finally:
                remove_path(samples_temp)
        try:
            os.link(temp, dst)
        except FileExistsError:
            with open(dst, "rb") as existing:
                if existing.read() != text.encode():
                    raise ArchiveExistsError(dst, "already exists and is not this set's index",
                                             hint="remove it, then join again") from None
    finally:
        remove_path(temp)
    return dst


def _read_or_none(path: str) -> Optional[bytes]:
    """The bytes of the file at ``path``; None when there is none to read."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None


def _write_synced(path: str, data: bytes) -> None:
    """Write ``data`` to the file ``path`` and flush it to disk."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
