"""A node-local cache of downloaded parts, shared by every process and job on the node.

Layout under the cache directory (``cache_dir=``, else ``PF_CACHE_DIR``, else
``$TMPDIR/packed_formats-cache-<uid>``, one per user, refused when another user owns it)::

    <namespace>/<entry>            a part (file or folder), exactly as the store holds it
    <namespace>/.pf/<entry>.lock   its lock: shared while a process has it open, exclusive to fill or evict it
    <namespace>/.pf/<entry>.json   what it is (URL without credentials, size, ETag); mtime = last use
    <namespace>/.pf/tmp-*          downloads under way (never read: a part is moved into place only once checked)
    downloads.jsonl                one line per download (URL, bytes, time): ``PartCache.downloads()``

An entry's name carries a digest of the object's name and ETag, so a part that changed in the store
is a new entry: a process still reading the old version keeps it, and nothing mixes the two.
Names come from the store, so they are untrusted: an entry's name keeps only a bounded run of
``[A-Za-z0-9._-]`` of the object's name (never a separator, never ``.`` or ``..``), and every local
path made from store content goes through ``confined``, which refuses one outside its folder.
A cache directory that cannot be used (not writable, full, a name too long) raises
``CacheDirectoryError`` or ``InsufficientSpaceError`` naming it, never a bare ``OSError``.

* **Once per node.**  A process that needs an entry takes its lock shared; if the entry is
  complete it keeps that lock while it reads the part (a *lease*).  Otherwise it tries the lock
  exclusively (without waiting: a process filling the entry, or reading it, holds it) and, when it
  gets it, downloads into a temporary name, checks the download (the caller's check: the part's
  index, manifest and sample checksums), moves it into place and writes its record.  Others poll
  until the entry is complete (or its filler died: the kernel drops a dead process's locks, and
  the next one fills it).  A download cut off by a kill leaves only a temporary file, which is
  removed the next time room is made.
* **Bounded.**  Before an entry is filled, entries no process holds are evicted least recently
  used first until the new one fits ``limit`` (``cache_limit=``, ``PF_CACHE_LIMIT``; "200GB").  An
  entry in use anywhere on the node (its lock held shared) is never deleted; when everything is
  in use the cache goes over its bound, saying so once.  Only entries with our record are
  counted or deleted: the cache deletes nothing it did not download.
* **Disk.**  A fill needs the part's size free on the cache's file system after eviction, or
  raises ``InsufficientSpaceError`` naming the cache directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..backends.files import remove_path
from ..errors import CacheDirectoryError, InsufficientSpaceError, PackedFormatError
from ..handles import pid_alive
from ..space import check_free_space, human_bytes

CACHE_DIR_VARIABLE = "PF_CACHE_DIR"
CACHE_LIMIT_VARIABLE = "PF_CACHE_LIMIT"
_META = ".pf"
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DOWNLOAD_LOG = "downloads.jsonl"  # one line per part downloaded, appended by every process
POLL_S = 0.05  # how often a process waiting for another's download looks again


class CacheOverLimitWarning(UserWarning):
    """Every entry that could make room is in use: the cache holds more than its bound for now."""


def parse_size(value: Any, what: str = "cache_limit") -> Optional[int]:
    """Bytes from 200_000_000, "200GB", "1.5TiB", "512 MB" (None stays None: no bound); ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size like '200GB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(f"{what} must be a size like '200GB', '1.5TiB' or a number of bytes, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).upper()
    else:
        raise ValueError(f"{what} must be a size like '200GB' or a number of bytes, got {value!r}")
    if number <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return int(number * _UNITS[unit])


def default_cache_dir() -> str:
    """``PF_CACHE_DIR``, else this user's ``packed_formats-cache-<uid>`` under ``$TMPDIR`` (node-local on
    most clusters; one per user, so no user writes where another's files are)."""
    return os.environ.get(CACHE_DIR_VARIABLE) or _own_cache_dir()


def _own_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"packed_formats-cache-{os.geteuid()}")


_PLAIN = re.compile(r"[^A-Za-z0-9_-]+")
_STEM_CHARS, _EXT_CHARS = 80, 16  # an entry's name stays far below any file system's 255 bytes


def entry_name(name: str, etag: str) -> str:
    """The cache's name for version ``etag`` of the object called ``name``: <stem>.<digest><.ext>, where
    stem and ext keep a bounded run of [A-Za-z0-9_-] of the name and the digest is of the name and ETag
    (a name or ETag from the store never makes a separator, ``..`` or a name too long)."""
    digest = hashlib.sha1(json.dumps([name, etag]).encode()).hexdigest()[:16]
    stem, ext = os.path.splitext(name)
    stem = _PLAIN.sub("_", stem)[:_STEM_CHARS].strip("_") or "part"
    ext = _PLAIN.sub("_", ext[1:])[:_EXT_CHARS]
    return f"{stem}.{digest}.{ext}" if ext else f"{stem}.{digest}"


def confined(base: str, relative: str) -> str:
    """The local path ``relative`` names under the folder ``base``, checked to lie inside it once every
    link and ``..`` is resolved (a name from a store must never reach another file).

    Raises:
        ValueError: the path would leave ``base`` (or is ``base`` itself).
    """
    root = os.path.realpath(base)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root or path == root:
        raise ValueError(f"{relative!r} is not a path inside {base}")
    return path


_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def cache_failure(directory: str, exc: OSError, doing: str) -> PackedFormatError:
    """The error for ``exc``, met while ``doing`` something in the cache ``directory``: a full disk is
    InsufficientSpaceError, anything else CacheDirectoryError; each names the directory and what to do."""
    reason = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in _SPACE_ERRNOS:
        return InsufficientSpaceError(directory, f"the cache's disk is full: cannot {doing}{where}: {reason}",
                                      hint="free space there, set a smaller cache_limit, or another cache_dir "
                                           f"({CACHE_DIR_VARIABLE})")
    if exc.errno == errno.ENAMETOOLONG:
        hint = f"use a cache directory with a shorter path (cache_dir= or {CACHE_DIR_VARIABLE})"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = f"make it writable by this user, or use another cache_dir ({CACHE_DIR_VARIABLE})"
    else:
        hint = f"check the directory, or use another cache_dir ({CACHE_DIR_VARIABLE})"
    return CacheDirectoryError(directory, f"the cache directory cannot be used: cannot {doing}{where}: {reason}",
                               hint=hint)


@contextlib.contextmanager
def cache_errors(directory: str, doing: str) -> Iterator[None]:
    """Turn an OSError of the local file system (not a store's error) into ``cache_failure``."""
    try:
        yield
    except PackedFormatError:
        raise
    except OSError as exc:
        raise cache_failure(directory, exc, doing) from None


# ---- leases: an entry held in use by this process -------------------------------------------------------
_LEASES: "weakref.WeakSet[Lease]" = weakref.WeakSet()


class Lease:
    """This process's claim on a complete entry: its lock held shared, so no process evicts it.
    ``release()`` (or the lease's collection, or the process's end) lets it go."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd, self._pid = path, fd, os.getpid()
        _LEASES.add(self)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0 and self._pid == os.getpid():
            os.close(fd)  # the last descriptor of the lock's open file: the lock goes with it

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def __del__(self) -> None:
        self.release()


def _forget_inherited_leases() -> None:
    """In a forked child: close the parent's lease descriptors (the parent keeps its locks; the child
    holds none of them, so its lifetime never pins what the parent let go)."""
    for lease in list(_LEASES):
        if lease._fd >= 0:
            try:
                os.close(lease._fd)
            except OSError:
                pass
            lease._fd = -1


os.register_at_fork(after_in_child=_forget_inherited_leases)


# ---- the cache ------------------------------------------------------------------------------------------
class PartCache:
    """A cache directory with an optional bound in bytes (see the module's text)."""

    def __init__(self, directory: Optional[str] = None, limit: Any = None) -> None:
        own = not directory and not os.environ.get(CACHE_DIR_VARIABLE)
        self.directory = os.path.abspath(os.fspath(directory or default_cache_dir()))
        self.limit = parse_size(limit if limit is not None else os.environ.get(CACHE_LIMIT_VARIABLE) or None)
        with cache_errors(self.directory, "create the cache directory"):
            os.makedirs(self.directory, mode=0o700 if own else 0o777, exist_ok=True)
            if own:
                _check_owner(self.directory)
        self._warned = False

    def __repr__(self) -> str:
        bound = "no bound" if self.limit is None else f"limit {human_bytes(self.limit)}"
        return f"PartCache({self.directory!r}, {bound})"

    def __getstate__(self) -> Dict[str, Any]:
        return {"directory": self.directory, "limit": self.limit, "_warned": False}

    # ---- paths ----
    def namespace(self, key: str) -> str:
        """The folder of one set (its URL's digest plus a readable name); created."""
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", key.split("://", 1)[-1])[-48:].strip("._")
        folder = os.path.join(self.directory, f"{readable}-{digest}")
        with cache_errors(self.directory, "create a folder in it"):
            os.makedirs(os.path.join(folder, _META), exist_ok=True)
        return folder

    @staticmethod
    def _lock_path(path: str) -> str:
        folder, name = os.path.split(path)
        return os.path.join(folder, _META, name + ".lock")

    @staticmethod
    def _record_path(path: str) -> str:
        folder, name = os.path.split(path)
        return os.path.join(folder, _META, name + ".json")

    # ---- using an entry ----
    def acquire(self, path: str, size: int, fill: Callable[[str], None], record: Dict[str, Any]) -> Lease:
        """A lease on the complete entry at ``path`` (inside a namespace), filled first if missing.

        ``fill(temp)`` writes the entry at the temporary path ``temp`` and checks it (raising if the
        download is bad: nothing is then moved into place); ``record`` (the URL without credentials,
        size, ETag) is kept beside it, and ``size`` is what it will take on disk.
        """
        lock_path = self._lock_path(path)
        while True:
            fd = self._open_lock(lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if self._complete(path):
                    self._touch(path)
                    lease, fd = Lease(path, fd), -1
                    return lease
                fcntl.flock(fd, fcntl.LOCK_UN)
                if _try_exclusive(fd):
                    try:
                        if not self._complete(path):
                            with cache_errors(self.directory, f"write the cache entry {os.path.basename(path)}"):
                                self._fill(path, size, fill, record)
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)  # then take it shared again, above
                    continue
            finally:
                if fd >= 0:
                    os.close(fd)
            time.sleep(POLL_S)  # another process fills it, or was checking it: look again

    def _open_lock(self, lock_path: str) -> int:
        """A descriptor of an entry's lock file: created if missing; an existing one of a cache this user
        may only read is opened read-only (a lock needs no write access)."""
        try:
            return os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and os.path.exists(lock_path):
                with cache_errors(self.directory, "open a lock file"):
                    return os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
            raise cache_failure(self.directory, exc, "create a lock file") from None

    def _complete(self, path: str) -> bool:
        try:
            with open(self._record_path(path)) as file:
                record = json.load(file)
            return os.path.lexists(path) and _disk_size(path) == int(record["size"])
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def _touch(self, path: str) -> None:
        try:
            os.utime(self._record_path(path))
        except OSError:
            pass

    def _fill(self, path: str, size: int, fill: Callable[[str], None], record: Dict[str, Any]) -> None:
        folder, name = os.path.split(path)
        self.make_room(size, exclude=path)
        check_free_space(self.directory, size, f"cache {name}", hint="free space there, set a smaller cache_limit, "
                         f"or another cache_dir ({CACHE_DIR_VARIABLE})")
        temp = os.path.join(folder, _META, f"tmp-{os.getpid()}-{threading.get_ident()}-{name}")
        remove_path(temp)
        remove_path(self._record_path(path))
        try:
            fill(temp)
            remove_path(path)  # a stale or incomplete copy, which nobody holds (we hold its lock exclusively)
            os.replace(temp, path)
        finally:
            remove_path(temp)
        now, size = time.time(), _disk_size(path)
        data = json.dumps(dict(record, size=size, downloaded_by="packed_formats", downloaded_at=now))
        _write_atomically(self._record_path(path), data)
        line = json.dumps({"url": record.get("url"), "bytes": size, "at": now}) + "\n"
        fd = os.open(os.path.join(self.directory, DOWNLOAD_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            os.write(fd, line.encode())  # one write of one line: whole, even with other processes appending
        finally:
            os.close(fd)

    def downloads(self, since: float = 0.0) -> List[Dict[str, Any]]:
        """The downloads this cache made since the time ``since`` (URL, bytes, when), from every
        process and job that uses it: how much a reading order costs."""
        try:
            with open(os.path.join(self.directory, DOWNLOAD_LOG)) as file:
                lines = file.read().splitlines()
        except FileNotFoundError:
            return []
        found = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("at", 0) >= since:
                found.append(entry)
        return found

    # ---- room ----
    def entries(self) -> List[Tuple[float, str, int]]:
        """(last use, path, bytes) of every complete entry this cache downloaded, oldest use first."""
        found = []
        for folder in _namespaces(self.directory):
            meta = os.path.join(folder, _META)
            for record_name in os.listdir(meta):
                if not record_name.endswith(".json"):
                    continue
                record_path = os.path.join(meta, record_name)
                try:
                    with open(record_path) as file:
                        record = json.load(file)
                    if record.get("downloaded_by") != "packed_formats":
                        continue
                    found.append((os.stat(record_path).st_mtime, os.path.join(folder, record_name[:-5]),
                                  int(record["size"])))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
        return sorted(found)

    def usage(self) -> int:
        """Bytes held: complete entries and downloads under way."""
        return sum(size for _, _, size in self.entries()) + sum(_disk_size(t) for t in self._temps())

    def make_room(self, needed: int, exclude: Optional[str] = None) -> None:
        """Evict entries no process holds, least recently used first, until ``needed`` more bytes fit the bound."""
        self._remove_dead_downloads()
        if self.limit is None:
            return
        with _exclusive(os.path.join(self.directory, ".pf-room.lock")):
            entries = self.entries()
            used = sum(size for _, _, size in entries) + sum(_disk_size(t) for t in self._temps())
            for _, path, size in entries:
                if used + needed <= self.limit:
                    return
                if path != exclude and self.evict(path):
                    used -= size
            if used + needed > self.limit and not self._warned:
                self._warned = True
                warnings.warn(
                    f"the cache {self.directory} holds {human_bytes(used)} in parts in use and needs "
                    f"{human_bytes(needed)} more: over its limit of {human_bytes(self.limit)} until some are "
                    "let go (a larger cache_limit, fewer parts open per process, or a smaller shuffle window "
                    "keeps it within)", CacheOverLimitWarning, stacklevel=3)

    def evict(self, path: str) -> bool:
        """Delete the entry at ``path`` if no process holds it (True), else leave it (False)."""
        fd = self._open_lock(self._lock_path(path))
        try:
            if not _try_exclusive(fd):
                return False
            try:
                remove_path(self._record_path(path))
                remove_path(path)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            os.close(fd)

    def _temps(self) -> Iterator[str]:
        for folder in _namespaces(self.directory):
            meta = os.path.join(folder, _META)
            for name in os.listdir(meta):
                if name.startswith("tmp-"):
                    yield os.path.join(meta, name)

    def _remove_dead_downloads(self) -> None:
        """Remove downloads whose process is gone (killed mid-download)."""
        for temp in list(self._temps()):
            pid = temp.rsplit(os.sep, 1)[-1].split("-")[1]
            if pid.isdigit() and not pid_alive(int(pid)):
                remove_path(temp)


def _check_owner(directory: str) -> None:
    """CacheDirectoryError when this user's default cache directory belongs to another user (who could
    put there what this user's processes would then read)."""
    owner = os.stat(directory).st_uid
    if owner != os.geteuid():
        raise CacheDirectoryError(directory, f"the default cache directory belongs to another user (uid {owner}), "
                                             f"not to this one (uid {os.geteuid()})",
                                  hint=f"remove it, or pass cache_dir= or set {CACHE_DIR_VARIABLE} to a directory "
                                       "of your own")


def _namespaces(directory: str) -> Iterator[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        folder = os.path.join(directory, name)
        if os.path.isdir(os.path.join(folder, _META)):
            yield folder


def _try_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class _exclusive:
    """An exclusive flock on a file, waiting for it (held briefly: the bookkeeping of making room)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


def _disk_size(path: str) -> int:
    if os.path.isdir(path) and not os.path.islink(path):
        return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _write_atomically(path: str, text: str) -> None:
    temp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(temp, "w") as file:
        file.write(text)
    os.replace(temp, path)
