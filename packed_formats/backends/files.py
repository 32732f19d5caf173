"""What the backends share about files: their identity, how failures reading them are named, and how
a finished archive is published.

* A file's identity (``file_identity``, ``fd_identity``) and the key under which processes share an
  archive's handle (``handle_key``).
* The errors for an archive that changed under its reader (``replaced_error``, ``changed_error``) and
  ``named_failures``, which turns what a format library raises on damaged data into a
  ``PackedFormatError`` naming the archive (with ``DAMAGED_HINT``).
* Writing: a temporary name beside the destination (``temp_path_for``), atomic publication with the
  fsyncs it needs (``publish``) and removal (``remove_path``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Iterator, Optional, Tuple

from ..errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    CorruptArchiveError,
    CorruptSampleError,
    PackedFormatError,
    TooManyOpenFilesError,
)
from ..index import SampleIndex
from .mapped import FileTruncatedError

Identity = Tuple[int, int, int, int]  # (device, inode, size, mtime_ns) of a file (why no ctime: Reader.check_unchanged)

DAMAGED_HINT = "the archive is damaged: run `packed-formats verify` on it and re-create it"


def file_identity(path: str) -> Optional[Identity]:
    """(device, inode, size, mtime_ns) of the file at ``path``, or None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def fd_identity(fd: int) -> Identity:
    """The identity of an open file (as ``file_identity``)."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def handle_key(format_name: str, path: str, identity: Optional[Identity]) -> tuple:
    """The key under which processes share a handle: the format, the real path, and the file's identity,
    so that an archive replaced at the same path never gets the old one's handle."""
    return (format_name, os.path.realpath(path)) + (identity or ())


def replaced_error(path: str) -> ArchiveChangedError:
    """The archive at ``path`` is no longer the file a reader opened."""
    return ArchiveChangedError(
        path, "the archive was replaced or modified after it was opened",
        hint="re-create the dataset; never rewrite an archive that is being read",
    )


def changed_error(archive: str, path: str, then: Identity, now: Identity) -> ArchiveChangedError:
    """The file ``path`` of the open ``archive`` was rewritten in place: its identity (device, inode,
    size, modification time) was ``then`` when the archive was opened, and is ``now``."""
    where = os.path.relpath(os.path.abspath(path), os.path.abspath(archive))
    what = "the file" if where == "." else f"its file {where}"
    change = "same size, new modification time"
    if now[2] != then[2]:
        change = f"its size went from {then[2]} to {now[2]} bytes"
    problem = f"{what} was rewritten in place while the archive was open ({change}): reads would mix two archives"
    return ArchiveChangedError(
        archive, problem,
        hint="open the dataset again (in a job: restart it) to read the archive as it is now; to update an "
             "archive that is being read, write the new one under another name and move it into place",
    )


@contextlib.contextmanager
def named_failures(
    path: str, doing: str, index: Optional[int] = None, index_data: Optional[SampleIndex] = None
) -> Iterator[None]:
    """Turn what a format library raises on damaged data (h5py's RuntimeError, numpy's parse
    errors, a file truncated under its map...) into a PackedFormatError naming the archive
    (and sample ``index``, with its key from ``index_data``)."""
    try:
        yield
    except TooManyOpenFilesError:
        raise
    except PackedFormatError as exc:
        if TooManyOpenFilesError.describes(exc):  # a backend took the failed open for damage
            raise _no_descriptor_left(path, doing) from None
        raise
    except FileTruncatedError as exc:
        raise ArchiveChangedError(
            path, str(exc), hint="an archive must not be rewritten in place while it is read; re-create it"
        ) from None
    except MemoryError:
        raise
    except Exception as exc:  # a damaged file can make a library fail in any way
        if TooManyOpenFilesError.describes(exc):
            raise _no_descriptor_left(path, doing) from None
        problem = f"{doing}: {type(exc).__name__}: {exc}"
        if index is None:
            raise CorruptArchiveError(path, problem, hint=DAMAGED_HINT) from None
        key = None if index_data is None else index_data.key(index)
        raise CorruptSampleError(path, problem, index=index, key=key, hint=DAMAGED_HINT) from None


def _no_descriptor_left(path: str, doing: str) -> TooManyOpenFilesError:
    """EMFILE or ENFILE, named as such: the archive is fine, the process is out of file descriptors."""
    usage = TooManyOpenFilesError.usage()
    return TooManyOpenFilesError(path, f"{doing}: too many open files ({usage})", hint=TooManyOpenFilesError.HINT)


def temp_path_for(path: str) -> str:
    """A unique temporary name beside ``path`` (same file system, so os.replace works)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.pf-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish(temp: str, path: str, overwrite: bool) -> None:
    """Atomically move a finished archive (file or directory) into place."""
    _fsync_tree(temp)
    if os.path.isdir(temp) and os.path.lexists(path):
        if not overwrite:
            raise ArchiveExistsError(path, "already exists", hint="pass overwrite=True to replace it")
        trash = temp_path_for(path) + "-old"
        os.replace(path, trash)
        os.replace(temp, path)
        remove_path(trash)
    else:
        if os.path.lexists(path) and not overwrite:
            raise ArchiveExistsError(path, "already exists", hint="pass overwrite=True to replace it")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        os.replace(temp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _fsync_tree(path: str) -> None:
    files = [path]
    if os.path.isdir(path):
        files = [os.path.join(path, name) for name in os.listdir(path)]
    for name in files:
        if os.path.isfile(name):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if os.path.isdir(path):
        _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
