"""Copy an archive to node-local storage once per node, verified, even under many ranks.

On a cluster every rank of a job may call ``stage(path, os.environ["TMPDIR"])`` at
the same moment.  One of them takes an exclusive ``flock`` on a lock file in the
destination directory and copies the archive under a temporary name, checks every
sample of the copy against the stored CRC32s, and moves it into place with
``os.replace``; the others wait on the lock, then find an identical copy and reuse
it.  A copy is reused as it is only while its files keep the sizes and
modification times recorded when it was verified (a stamp beside it); one
written to since, or staged by an older release, has every sample checked
again before it is reused, and is replaced if one fails.  A sharded archive
is staged part by part (each verified), its index last.  A damaged source
raises CorruptSampleError naming the sample and leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager, suppress
from typing import Iterator, List, Optional, Tuple

from . import storage
from .archives import open_archive
from .backends import PACKED_FORMATS, detect_format
from .backends.files import publish, remove_path, temp_path_for
from .backends.reader import Reader
from .backends.set_samples import check_sample_index
from .backends.sharded import read_shard_index
from .errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    ArchiveInUseError,
    DestinationError,
    PackedFormatError,
    UnknownFormatError,
)
from .index import chunks
from .space import archive_files, check_free_space, disk_usage
from .verify import verify_archive

log = logging.getLogger("packed_formats")

STAGEABLE = PACKED_FORMATS + ("sharded",)


@dataclasses.dataclass(frozen=True)
class StagedArchive:
    """The outcome of one stage call: where the copy is and whether this call made it."""

    path: str
    copied: bool
    nbytes: int
    seconds: float


def default_stage_dir() -> str:
    """Node-local scratch: $SLURM_TMPDIR, else $TMPDIR, else /tmp."""
    for name in ("SLURM_TMPDIR", "TMPDIR"):
        value = os.environ.get(name)
        if value:
            return value
    return "/tmp"


def stage(path: "str | os.PathLike[str]", to: "str | os.PathLike[str]", timeout: Optional[float] = None) -> str:
    """Copy the archive at ``path`` into directory ``to`` (once per node); return the local path.

    Safe to call from many processes at once: they wait for the one that copies.
    An identical existing copy is reused; a different archive of the same name is
    replaced.  ``timeout`` (seconds) bounds the wait for the lock (None: forever).

    Raises:
        CorruptSampleError: a sample of the source fails its checksum (no copy is left).
        UnknownFormatError: the source is not a packed archive.
        InsufficientSpaceError: the destination has no room for the copy.
        DestinationError: this user may not create or write in the destination folder.
        ArchiveInUseError: the lock wait timed out.
        PackedFormatError: any other problem with the source or the copy.
    """
    return stage_archive(path, to, timeout=timeout).path


def stage_archive(
    path: "str | os.PathLike[str]", to: "str | os.PathLike[str]", timeout: Optional[float] = None
) -> StagedArchive:
    """Like stage(), but also says whether this call copied and how much.  A URL (s3://...) is
    downloaded into ``to`` once per node, each part checked on arrival (``storage.stage_remote``)."""
    started = time.monotonic()
    source = os.fspath(path)
    if storage.is_remote(source):
        local, copied, nbytes = storage.stage_remote(source, os.fspath(to))
        return StagedArchive(local, copied, nbytes, time.monotonic() - started)
    parts = _parts_of(source)
    directory = os.fspath(to)
    _make_destination(directory)
    target = os.path.join(directory, os.path.basename(os.path.normpath(source)))
    if os.path.realpath(target) == os.path.realpath(source):
        return StagedArchive(target, False, sum(disk_usage(p, parts=False) for p in parts + [source]), 0.0)
    copied, nbytes = False, 0
    with _exclusive(_lock_path(target), timeout):
        for part in parts:  # each part of a sharded archive is a complete archive of its own
            done, size = _stage_one(part, os.path.join(directory, os.path.basename(part)), check_samples=True)
            copied, nbytes = copied or done, nbytes + size
        if parts:  # then the set's sample index, which its index records
            done, size = _stage_sample_index(source, directory)
            copied, nbytes = copied or done, nbytes + size
        done, size = _stage_one(source, target, check_samples=not parts)
        copied, nbytes = copied or done, nbytes + size
    seconds = time.monotonic() - started
    log.info("stage: %s %s to %s (%d bytes, %.1f s)", "copied" if copied else "reused", source, target, nbytes, seconds)
    return StagedArchive(target, copied, nbytes, seconds)


def _stage_one(source: str, target: str, check_samples: bool) -> Tuple[bool, int]:
    """Copy one archive unless an identical copy is there (caller holds the lock); (copied, bytes)."""
    expected = _source_fingerprint(source)
    nbytes = disk_usage(source, parts=False)  # a sharded archive's parts are staged one by one
    _remove_leftovers(target)
    if _is_identical_copy(target, expected, check_samples):
        return False, nbytes
    _check_room(os.path.dirname(target), source, nbytes)
    _copy_verified(source, target, expected, check_samples)
    _write_stamp(target, expected)
    return True, nbytes


def _stage_sample_index(source: str, directory: str) -> Tuple[bool, int]:
    """Copy the sample index that the set's index at ``source`` records (checked against the set's parts,
    ``set_samples.check_sample_index``) into ``directory``, unless the same is there; (copied, bytes)."""
    checked = check_sample_index(source)
    if checked is None:
        return False, 0
    path, data = checked
    target = os.path.join(directory, os.path.basename(path))
    with suppress(OSError), open(target, "rb") as file:
        if file.read(len(data) + 1) == data:
            return False, len(data)
    temp = temp_path_for(target)
    try:
        with open(temp, "wb") as file:
            file.write(data)
        publish(temp, target, overwrite=True)
    finally:
        remove_path(temp)
    return True, len(data)


def _parts_of(source: str) -> List[str]:
    """The part archives a sharded archive's index names (none for other formats)."""
    format = detect_format(source)
    if format == "folder":
        raise UnknownFormatError(
            source,
            "an image folder, not a packed archive: staging it would copy every small file",
            hint="pack it first with `packed-formats convert`, then stage the archive",
        )
    if format != "sharded":
        return []
    directory = os.path.dirname(os.path.abspath(source))
    return [os.path.join(directory, name) for name in read_shard_index(source)["names"]]


# ---- identity ---------------------------------------------------------------------------
def fingerprint(reader: Reader) -> str:
    """A cheap content hash: file names and sizes, manifest, and index arrays (labels, CRCs...)."""
    digest = hashlib.sha256(reader.manifest.to_json().encode())
    for name, size in archive_files(reader.path):
        digest.update(f"{name}\0{size}\0".encode())
    for name, array in sorted(reader.index.arrays().items()):
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        for chunk in chunks(array):  # a sharded archive's joined array piece by piece
            digest.update(chunk.data)
    return digest.hexdigest()


def _source_fingerprint(source: str) -> str:
    with open_archive(source, verify=True) as reader:
        return fingerprint(reader)


def _is_identical_copy(target: str, expected: str, check_samples: bool = True) -> bool:
    if not os.path.lexists(target):
        return False
    if detect_format_or_none(target) not in STAGEABLE:
        raise ArchiveExistsError(
            target,
            "exists and is not a packed archive; refusing to replace it",
            hint="remove it or stage to another directory",
        )
    try:
        with open_archive(target, verify=True) as reader:
            if fingerprint(reader) != expected:
                return False
        if _stamp_matches(target, expected):
            return True
        if check_samples and not verify_archive(target).ok:
            log.info("stage: %s was changed since it was staged and fails its checksums: replacing it", target)
            return False
    except PackedFormatError:
        return False  # a damaged or stale archive of ours: replace it
    _write_stamp(target, expected)
    return True


def _stamp_path(target: str) -> str:
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.pf-staged")


def _file_states(target: str) -> List[List]:
    """[relative name, size, mtime in ns] of every file of the archive at ``target``."""
    states = []
    for name, size in archive_files(target):
        states.append([name, size, os.stat(os.path.join(target, name) if name else target).st_mtime_ns])
    return states


def _write_stamp(target: str, expected: str) -> None:
    """Record what the verified copy at ``target`` looks like (written aside, then moved into place)."""
    stamp = _stamp_path(target)
    temp = f"{stamp}.{os.getpid()}"
    with open(temp, "w") as file:
        json.dump({"fingerprint": expected, "files": _file_states(target)}, file)
    os.replace(temp, stamp)


def _stamp_matches(target: str, expected: str) -> bool:
    try:
        with open(_stamp_path(target)) as file:
            stamp = json.load(file)
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("fingerprint") != expected:
        return False
    return stamp.get("files") == _file_states(target)


def detect_format_or_none(path: str) -> Optional[str]:
    try:
        return detect_format(path)
    except PackedFormatError:
        return None


# ---- copying ----------------------------------------------------------------------------
def _check_room(directory: str, source: str, nbytes: int) -> None:
    hint = "free space there or stage to another node-local directory"
    check_free_space(directory, nbytes, f"stage {source}", hint=hint)


def _copy_verified(source: str, target: str, expected: str, check_samples: bool) -> None:
    temp = _stage_temp_prefix(target) + f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if os.path.isdir(source):
            shutil.copytree(source, temp)
        else:
            shutil.copyfile(source, temp)
        with open_archive(temp, verify=True) as copy:
            if fingerprint(copy) != expected:
                raise ArchiveChangedError(source, "the copy differs from the source", hint="is it being rewritten?")
        if check_samples:
            _verify_copy(temp, source)
        publish(temp, target, overwrite=True)
    except BaseException:
        remove_path(temp)
        raise


def _verify_copy(copy: str, source: str) -> None:
    """Check every sample of the copy against its CRC32; blame the source when it is the culprit."""
    report = verify_archive(copy)
    if report.ok:
        return
    bad = report.bad[0].index
    with open_archive(source, verify=True) as original:
        original.read_bytes(bad)  # raises CorruptSampleError naming the source when the source is damaged
    raise DestinationError(
        source, f"the copy of sample {bad} differs from the source", hint="retry; check the local disk"
    )


# ---- the destination --------------------------------------------------------------------
_DESTINATION_HINT = ("stage to a folder this user may write in (e.g. $TMPDIR), "
                     "or ask the folder's owner for write permission")


def _make_destination(directory: str) -> None:
    """Create the folder ``directory`` where it is missing.

    Raises:
        DestinationError: it cannot be created (naming the folder that refuses it), or is a file.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except PermissionError:
        parent = _nearest_existing(directory)
        raise DestinationError(
            directory, f"permission denied: this user may not create folders in {parent}", hint=_DESTINATION_HINT
        ) from None
    except OSError as exc:
        raise DestinationError(directory, f"cannot be created: {exc.strerror}", hint=_DESTINATION_HINT) from None


def _nearest_existing(path: str) -> str:
    """The closest folder above ``path`` that exists (where a folder on the way to it would be made)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def _open_lock(lock_path: str) -> int:
    """The lock file's descriptor, the file created where it is missing.

    Raises:
        DestinationError: this user may not write in its folder, or open another user's lock file there.
    """
    directory = os.path.dirname(lock_path) or "."
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        if not os.access(directory, os.W_OK | os.X_OK):
            raise DestinationError(
                directory, "permission denied: this user may not write in this folder", hint=_DESTINATION_HINT
            ) from None
        raise DestinationError(
            directory, f"permission denied: this user may not open the lock file {lock_path} for writing",
            hint="`ls -l` shows whose it is: stage to a folder of this user's own (e.g. $TMPDIR), or ask its owner",
        ) from None
    except OSError as exc:
        raise DestinationError(
            directory, f"cannot create the lock file {lock_path}: {exc.strerror}", hint=_DESTINATION_HINT
        ) from None


# ---- locking and leftovers --------------------------------------------------------------
def _lock_path(target: str) -> str:
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.pf-stage.lock")


def _stage_temp_prefix(target: str) -> str:
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.pf-stage-")


def _remove_leftovers(target: str) -> None:
    """Temp copies left by a killed stager (only the lock holder ever writes one)."""
    for leftover in glob.glob(glob.escape(_stage_temp_prefix(target)) + "*"):
        log.info("stage: removing leftover %s", leftover)
        remove_path(leftover)


@contextmanager
def _exclusive(lock_path: str, timeout: Optional[float]) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path``; other processes calling this wait."""
    fd = _open_lock(lock_path)
    try:
        _flock(fd, lock_path, timeout)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _flock(fd: int, lock_path: str, timeout: Optional[float]) -> None:
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise ArchiveInUseError(
                lock_path,
                f"another process has been staging this archive for more than {timeout:g} s",
                hint="wait longer (--timeout) or remove a stale lock holder",
            )
        time.sleep(0.05)
