"""A file this user may not read gives an error that says permission and names the file, in every format.

Root reads any file whatever its mode, so where the tests run as root the read
runs in a forked child that has given up root for the ``nobody`` user (after a
read in the parent has imported everything the read needs: the child may not
be allowed to read Python's own files).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pwd
import shutil
import tempfile
from typing import Callable

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import cli
from packed_formats.backends.sharded import ShardedWriter

from .conftest import ARCHIVE_KINDS, kind_id

SHAPE = (4, 5, 3)


def drop_to() -> "tuple[int, int] | None":
    """(uid, gid) the child reads as: ``nobody`` when running as root, None when already unprivileged."""
    if os.geteuid() != 0:
        return None
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and there is no user 'nobody' to drop privileges to")
    return user.pw_uid, user.pw_gid


def read_everything(path: str) -> int:
    with pf.PackedDataset(path, output="numpy") as dataset:
        return sum(int(dataset[i][1]) for i in range(len(dataset)))


def read_as_unprivileged(path: str) -> "tuple[str, str]":
    """(exception class name or "ok", message) of ``read_everything(path)`` in a child without root."""
    return as_unprivileged(lambda: read_everything(path))


def as_unprivileged(call: "Callable[[], object]") -> "tuple[str, str]":
    """(exception class name, message) of ``call()`` in a child without root; ("ok", what it returned)
    when it returns."""
    ids = drop_to()
    receiver, sender = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, whatever happens
        try:
            os.close(receiver)
            if ids is not None:
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])
            try:
                result = f"ok\n{call()}"
            except BaseException as exc:  # noqa: B036 - every outcome is reported to the parent
                result = f"{type(exc).__name__}\n{exc}"
            os.write(sender, result.encode())
        finally:
            os._exit(0)
    os.close(sender)
    chunks = []
    while True:
        chunk = os.read(receiver, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(receiver)
    os.waitpid(pid, 0)
    name, _, message = b"".join(chunks).decode().partition("\n")
    return name, message


@pytest.fixture
def shared_dir():
    """A directory every user may enter (pytest's own are root's alone), removed after."""
    path = tempfile.mkdtemp(prefix="pf-permissions-")
    os.chmod(path, 0o755)
    yield path
    for directory, subdirs, names in os.walk(path):
        for name in subdirs + names:
            os.chmod(os.path.join(directory, name), 0o755)
    shutil.rmtree(path)


def public_copy(src: str, dst: str) -> str:
    """A copy of the archive ``src`` at ``dst`` that every user may read (``src`` itself where they are one)."""
    if dst != src:
        (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)
    for directory, _subdirs, names in os.walk(dst):
        os.chmod(directory, 0o755)
        for name in names:
            os.chmod(os.path.join(directory, name), 0o644)
    if not os.path.isdir(dst):
        os.chmod(dst, 0o644)
    return dst


def files_of(path: str) -> "list[str]":
    """The archive's files, and the archive itself where it is a directory."""
    with pf.open_archive(path) as reader:
        files = list(reader.files())
    return ([path] if os.path.isdir(path) else []) + files


def assert_denied(archive: str, unreadable: str) -> None:
    os.chmod(unreadable, 0)
    try:
        name, message = read_as_unprivileged(archive)
    finally:
        os.chmod(unreadable, 0o755 if os.path.isdir(unreadable) else 0o644)
    assert name == "ArchivePermissionError", (unreadable, name, message)
    assert "permission denied" in message and unreadable in message, message


@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_an_unreadable_file_of_an_archive_says_permission_and_names_it(archives, shared_dir, kind):
    path = public_copy(archives[kind], os.path.join(shared_dir, os.path.basename(archives[kind])))
    assert read_as_unprivileged(path)[0] == "ok"  # the control: readable, it reads
    read_everything(path)  # imports, in the parent, what the child's read needs
    for unreadable in files_of(path):
        assert_denied(path, unreadable)


@pytest.mark.parametrize("fmt", ["zip", "hdf5", "lmdb", "memmap"])
def test_an_unreadable_part_of_a_sharded_archive_says_permission_and_names_it(shared_dir, fmt):
    path = os.path.join(shared_dir, f"data.{fmt}")  # its parts are written beside it
    with ShardedWriter(path, fmt, shard_size=3, mode="raw", shape=SHAPE, classes=["a", "b"]) as writer:
        for i in range(9):
            writer.add(np.full(SHAPE, i, dtype=np.uint8), i % 2)
    public_copy(shared_dir, shared_dir)
    assert read_as_unprivileged(path)[0] == "ok"
    read_everything(path)
    files = files_of(path)
    assert len(files) > 3
    for unreadable in files:
        assert_denied(path, unreadable)


# ---- folders this user may not search (enter) ---------------------------------------------------------
FOLDER_MODES = (0o000, 0o444)  # neither read nor search; read (list) but not search


def open_and_close(path: str) -> None:
    pf.open_archive(path).close()


def cli_info(path: str) -> str:
    """``packed-formats info path``: its exit status and what it printed on stderr."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["info", path])
    return f"exit {status}: {printed.getvalue()}"


ENTRIES = {"PackedDataset": read_everything, "open_archive": open_and_close, "packed-formats info": cli_info}


def sharded_set(path: str, fmt: str) -> str:
    with ShardedWriter(path, fmt, shard_size=3, mode="raw", shape=SHAPE, classes=["a", "b"]) as writer:
        for i in range(9):
            writer.add(np.full(SHAPE, i, dtype=np.uint8), i % 2)
    return path


def assert_folder_denied(folder: str, outcome: "tuple[str, str]", entry: str) -> None:
    name, message = outcome
    if entry == "packed-formats info":
        assert name == "ok" and message.startswith("exit 2: packed-formats info: error: "), (folder, outcome)
    else:
        assert name == "ArchivePermissionError", (folder, entry, outcome)
    assert "permission denied" in message and f"may not search the folder {folder}" in message, (entry, message)


@pytest.mark.parametrize("kind", ARCHIVE_KINDS + [("sharded", fmt) for fmt in pf.PACKED_FORMATS], ids=kind_id)
def test_an_archive_in_a_folder_this_user_may_not_search_says_permission_and_names_the_folder(
        archives, shared_dir, kind):
    folder = os.path.join(shared_dir, "data")
    os.mkdir(folder)
    if kind[0] == "sharded":
        path = sharded_set(os.path.join(folder, f"set.{kind[1]}"), kind[1])
    else:
        path = os.path.join(folder, os.path.basename(archives[kind]))
        (shutil.copytree if os.path.isdir(archives[kind]) else shutil.copyfile)(archives[kind], path)
    public_copy(shared_dir, shared_dir)
    for entry, call in ENTRIES.items():
        call(path)  # imports, in the parent, what the child's call needs
        assert as_unprivileged(functools.partial(call, path))[0] == "ok", entry  # the control: a folder it may enter
    for mode in FOLDER_MODES:
        os.chmod(folder, mode)
        try:
            for entry, call in ENTRIES.items():
                assert_folder_denied(folder, as_unprivileged(functools.partial(call, path)), entry)
        finally:
            os.chmod(folder, 0o755)


def test_a_memmap_part_folder_this_user_may_not_search_says_permission_and_names_it(shared_dir):
    path = sharded_set(os.path.join(shared_dir, "set.memmap"), "memmap")  # each part a folder
    public_copy(shared_dir, shared_dir)
    assert read_as_unprivileged(path)[0] == "ok"
    read_everything(path)
    part = os.path.join(shared_dir, "set-00001.memmap")
    for mode in FOLDER_MODES:
        os.chmod(part, mode)
        try:
            name, message = read_as_unprivileged(path)
        finally:
            os.chmod(part, 0o755)
        assert name == "ArchivePermissionError", (oct(mode), name, message)
        assert "permission denied" in message and part in message, message


@pytest.mark.slow  # forks a child that gives up root
@pytest.mark.parametrize("kind", [("memmap", "raw"), ("folder", "encoded"), ("lmdb", "encoded"), ("zip", "raw")],
                         ids=kind_id)
def test_an_archive_this_user_may_not_read_says_permission_alike_on_every_entry(archives, shared_dir, kind):
    """An archive that this user may not read (a folder it may not list: memmap, a plain image folder; a file:
    LMDB, ZIP) is "permission denied" naming it from ``packed-formats info`` as from ``open_archive``, never
    "not a dataset this library reads"."""
    path = public_copy(archives[kind], os.path.join(shared_dir, os.path.basename(archives[kind])))
    for entry, call in ENTRIES.items():
        call(path)  # imports, in the parent, what the child's call needs
        assert as_unprivileged(functools.partial(call, path))[0] == "ok", entry  # the control: readable, it reads
    for mode in FOLDER_MODES if os.path.isdir(path) else (0o000,):
        os.chmod(path, mode)
        try:
            outcomes = {entry: as_unprivileged(functools.partial(call, path)) for entry, call in ENTRIES.items()}
        finally:
            os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
        for entry, (name, message) in outcomes.items():
            if entry == "packed-formats info":
                assert name == "ok" and message.startswith("exit 2: packed-formats info: error: "), (oct(mode), message)
            else:
                assert name == "ArchivePermissionError", (oct(mode), entry, name, message)
            assert f"permission denied: this user may not read {path}" in message, (oct(mode), entry, message)


# ---- staging where this user may not write ------------------------------------------------------------
@pytest.mark.parametrize("into", ["the folder", "a new folder in it"])
def test_staging_where_this_user_may_not_write_says_so_and_names_the_folder(archives, shared_dir, into):
    source = public_copy(archives[("zip", "raw")], os.path.join(shared_dir, "data.zip"))
    folder = os.path.join(shared_dir, "local")
    os.mkdir(folder)
    destination = folder if into == "the folder" else os.path.join(folder, "job", "data")
    os.chmod(folder, 0o555)  # this user may enter and list it, not write in it
    pf.stage(source, os.path.join(shared_dir, "imports"))  # imports, in the parent, what staging needs
    name, message = as_unprivileged(lambda: pf.stage(source, destination))
    assert name == "DestinationError", (name, message)
    assert "permission denied" in message and folder in message and "stage to a folder" in message, message
    assert os.listdir(folder) == []


def test_staging_beside_another_users_lock_file_says_so_and_names_it(archives, shared_dir):
    source = public_copy(archives[("zip", "raw")], os.path.join(shared_dir, "data.zip"))
    folder = os.path.join(shared_dir, "local")
    os.mkdir(folder)
    os.chmod(folder, 0o1777)  # like /tmp: everyone may write in it
    lock = os.path.join(folder, ".data.zip.pf-stage.lock")
    pf.stage(source, folder)  # imports, in the parent, what staging needs; leaves its lock file, this user's
    os.chmod(lock, 0o444)  # its owner may not write it either
    os.remove(os.path.join(folder, "data.zip"))
    name, message = as_unprivileged(lambda: pf.stage(source, folder))
    assert name == "DestinationError", (name, message)
    assert "permission denied" in message and lock in message and "ls -l" in message, message


def test_doctor_on_an_archive_in_a_folder_this_user_may_not_search_names_the_folder(archives, shared_dir):
    folder = os.path.join(shared_dir, "data")
    os.mkdir(folder)
    path = os.path.join(folder, os.path.basename(archives[("zip", "raw")]))
    shutil.copyfile(archives[("zip", "raw")], path)
    public_copy(shared_dir, shared_dir)
    os.chmod(folder, 0o000)
    try:
        name, message = as_unprivileged(functools.partial(pf.diagnose, path))
    finally:
        os.chmod(folder, 0o755)
    assert name == "ArchivePermissionError", (name, message)
    assert f"may not search the folder {folder}" in message
