"""The format registry, built from each backend module's ``FormatSpec``, and format detection.

Adding a format is one module exporting a ``SPEC`` and one line in ``SPECS``
(or ``register(spec)`` at run time).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple, Type

from ..errors import (
    ArchiveNotFoundError,
    ArchivePermissionError,
    FormatMismatchError,
    PackedFormatError,
    UnknownFormatError,
)
from ..policy import VerifyPolicy
from ..tracebacks import drops_frames
from . import folder, hdf5, lmdb, memmap, sharded, zip
from .base import Backend, FormatSpec
from .reader import Reader
from .writer import Writer

# Detection asks each in this order: a shard index (a JSON file) before the binary
# formats, and a plain image folder last.
SPECS: List[FormatSpec] = [sharded.SPEC, zip.SPEC, hdf5.SPEC, lmdb.SPEC, memmap.SPEC, folder.SPEC]
_BY_NAME: Dict[str, FormatSpec] = {s.name: s for s in SPECS}


def register(format_spec: FormatSpec) -> None:
    """Add (or replace) a format: reading, detection, writing and extensions come from its spec."""
    SPECS[:] = [s for s in SPECS if s.name != format_spec.name]
    SPECS.insert(len(SPECS) - 1, format_spec)  # before the folder fallback
    _BY_NAME[format_spec.name] = format_spec
    _refresh()


def unregister(name: str) -> None:
    """Remove a format added with ``register``."""
    SPECS[:] = [s for s in SPECS if s.name != name]
    _BY_NAME.pop(name, None)
    _refresh()


def _refresh() -> None:
    global FORMATS, PACKED_FORMATS
    FORMATS = tuple(s.name for s in SPECS if s.name != "sharded")
    PACKED_FORMATS = tuple(s.name for s in SPECS if s.writer is not None)
    EXTENSIONS.clear()
    EXTENSIONS.update({ext: s.name for s in SPECS if s.writer is not None for ext in s.extensions})


FORMATS: Tuple[str, ...] = ()  # every format a Reader opens (a sharded archive is parts of one of them)
PACKED_FORMATS: Tuple[str, ...] = ()  # the formats we write
EXTENSIONS: Dict[str, str] = {}  # file extension -> format written for it
_refresh()


def spec(format: str) -> FormatSpec:
    """The registered spec of ``format`` (ValueError naming the choices otherwise)."""
    try:
        return _BY_NAME[format]
    except KeyError:
        raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}") from None


def writer_class(format: str) -> Type[Writer]:
    writer = spec(format).writer if format in _BY_NAME else None
    if writer is None:
        raise ValueError(f"cannot write format {format!r}; choose one of {', '.join(PACKED_FORMATS)}")
    return writer


def sniff_format(path: str) -> Optional[str]:
    """The format of ``path`` from its content, or None if it is none of ours."""
    head: Optional[bytes] = None
    if not os.path.isdir(path):
        with open(path, "rb") as file:
            head = file.read(64)
    return next((s.name for s in SPECS if s.sniff(path, head)), None)


def unsearchable_folder(path: str) -> Optional[str]:
    """The folder on the way to ``path`` (links followed) that this user may not search, or None.

    A folder without search permission (``x``: mode 000, or 444) hides what is in it: a path
    under it looks absent (``os.path.exists`` is False) although it may well be there.
    """
    try:
        target = os.path.realpath(path)  # as far as links can be followed: one may lead into the folder
    except OSError:  # the working directory is gone
        return None
    prefix, names = os.path.sep, [n for n in target.split(os.path.sep) if n]
    for name in names:
        below = os.path.join(prefix, name)
        try:
            os.stat(below)
        except PermissionError:
            return prefix
        except OSError:  # absent (or not a folder): nothing further down is hidden by a permission
            return None
        prefix = below
    return None


def folder_denied(archive: "os.PathLike[str] | str", folder: str) -> ArchivePermissionError:
    """The error for ``archive`` (or a part of it) in (or being) ``folder``, which this user may not search."""
    return ArchivePermissionError(
        archive, f"permission denied: this user may not search the folder {folder}, so nothing in it can be opened",
        hint=f"ask the folder's owner for search (x) permission on it; `ls -ld {folder}` shows its owner and mode",
    )


def not_found(path: str, problem: str = "no such file or directory") -> PackedFormatError:
    """The error to raise for ``path``, which cannot be found: ArchivePermissionError naming the
    folder on the way that this user may not search, else ArchiveNotFoundError saying ``problem``."""
    folder = unsearchable_folder(path)
    if folder is not None:
        return folder_denied(path, folder)
    if os.path.islink(path):
        problem += f": a link to {os.readlink(path)}, which does not exist"
    return ArchiveNotFoundError(path, problem, hint="check the path")


def detect_format(path: "str | os.PathLike[str]", expected: Optional[str] = None) -> str:
    """The format of the archive at ``path``; checks it against ``expected`` if given.

    Raises:
        ArchiveNotFoundError: nothing is at ``path``.
        ArchivePermissionError: this user may not read it, or search a folder on the way to it.
        UnknownFormatError: it is not an archive (FormatMismatchError: not of the ``expected`` format).
    """
    path = os.fspath(path)
    if expected is not None:
        spec(expected)
    if not os.path.exists(path):
        raise not_found(path)
    if os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):  # its files cannot even be listed
        raise ArchivePermissionError.denied(path)
    try:
        found = sniff_format(path)
    except PermissionError:
        raise ArchivePermissionError.denied(path) from None
    except OSError as exc:
        raise UnknownFormatError(path, f"cannot read it: {exc.strerror}") from None
    if found is None:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise UnknownFormatError(path, "empty file, not an archive")
        raise UnknownFormatError(
            path,
            "not an archive this library reads",
            hint=f"expected one of {', '.join(FORMATS)}; create one with `packed-formats convert`",
        )
    if expected is not None and found != expected:
        raise FormatMismatchError(
            path, f"this is a {found} archive, not {expected}", hint=f"open it as format={found!r}"
        )
    return found


@drops_frames  # a kept error of a failed open must not keep the half-made Reader (and its parts) alive
def open_local(
    path: "str | os.PathLike[str]", format: Optional[str] = None, verify: VerifyPolicy = True,
    *, max_open_parts: Optional[int] = None,
) -> Reader:
    """Open an archive on a local (or mounted) file system as a Reader; ``packed_formats.open_archive``
    (``archives``) takes URLs too.  ``format``, ``verify`` and ``max_open_parts`` as there."""
    reader = Reader(path, spec(detect_format(path, format)).backend, verify=verify)
    sharded.limit_open_parts(reader, max_open_parts)
    return reader


def open_writer(path: "str | os.PathLike[str]", format: str = "zip", **options) -> Writer:
    """A Writer for a new archive at ``path`` in ``format`` (zip, hdf5, lmdb or memmap; see Writer for options)."""
    return writer_class(format)(path, **options)


__all__ = [
    "Backend",
    "EXTENSIONS",
    "FORMATS",
    "FormatSpec",
    "PACKED_FORMATS",
    "Reader",
    "SPECS",
    "Writer",
    "detect_format",
    "folder_denied",
    "not_found",
    "open_local",
    "open_writer",
    "register",
    "sniff_format",
    "spec",
    "unregister",
    "unsearchable_folder",
    "writer_class",
]
