"""One exception tree for everything that can go wrong with an archive.

Every error names the archive path and, where one is involved, the sample index
and key, and says what to do about it.  The command line prints ``str(error)``
without a traceback.
"""

from __future__ import annotations

import json
import os
from typing import Optional


class PackedFormatError(Exception):
    """Base class: something is wrong with an archive or how it is used.

    ``PackedFormatError(path, problem, index=, key=, hint=)``; a single argument
    is taken as a whole message (how torch's DataLoader re-raises a worker's
    exception in the main process), so the class survives the crossing and
    ``except pf.CorruptSampleError`` works with ``num_workers > 0`` too.  When
    that message carries the fields' note (``note_fields``, which a
    PackedDataset adds in a worker), the path, index, key and hint come back
    from it as well.  ``message=`` gives the whole message by name (see ``message``).
    """

    def __init__(
        self,
        path: "os.PathLike[str] | str | None" = None,
        problem: Optional[str] = None,
        *,
        index: Optional[int] = None,
        key: Optional[str] = None,
        hint: Optional[str] = None,
        message: Optional[str] = None,
    ) -> None:
        if message is not None:
            path, problem = message, None
        if problem is None:  # one argument: a complete message
            message = "" if path is None else os.fspath(path)
            noted = _noted_fields(message) or {"path": None, "problem": message, "index": index, "key": key,
                                                "hint": hint}
            self.path, self.problem, self.index = noted["path"], noted["problem"], noted["index"]
            self.key, self.hint = noted["key"], noted["hint"]
            super().__init__(message)
            return
        # a plain str: a URL that carries its request form (storage.RemoteURL) leaves it out of the error
        self.path = None if path is None else str(os.fspath(path))
        self.problem = problem
        self.index = index
        self.key = key
        self.hint = hint
        super().__init__(self._message())

    @property
    def message(self) -> str:
        """The whole message, as ``str(error)``.

        Having it makes torch's DataLoader re-raise a worker's error in the main process as
        ``cls(message=text)``, raised at once; without it, torch keeps ``cls(text)`` in a variable
        of the frame that raises it, a reference cycle through the error's traceback that keeps the
        DataLoader's iterator and its worker processes alive until the garbage collector runs.
        """
        return str(self)

    def without_hint(self) -> str:
        """The message without its advice, for a report where the advice was already taken."""
        if self.hint is None:
            return str(self)
        hint, self.hint = self.hint, None
        try:
            return self._message()
        finally:
            self.hint = hint

    def _message(self) -> str:
        where = self.path if self.path is not None else "<no path>"
        sample = ""
        if self.index is not None or self.key is not None:
            parts = []
            if self.index is not None:
                parts.append(f"index {self.index}")
            if self.key is not None:
                parts.append(f"key {self.key!r}")
            sample = f" [sample {', '.join(parts)}]"
        text = f"{where}{sample}: {self.problem}"
        if self.hint:
            text += f" ({self.hint})"
        return text

    def __reduce__(self):
        # Keep the structured fields when an error crosses a DataLoader worker boundary.
        return (_rebuild, (type(self), self.path, self.problem, self.index, self.key, self.hint))


def _rebuild(cls, path, problem, index, key, hint):
    return cls(path, problem, index=index, key=key, hint=hint)


FIELDS_NOTE = "packed_formats error fields: "


def note_fields(error: PackedFormatError) -> None:
    """Add the error's fields to its traceback text as a note (Python 3.11 on; once).

    torch's DataLoader hands a worker's exception to the main process as its
    class and its traceback text, and raises ``cls(text)`` there: the note is
    how the path, sample index and key cross with it (see the one-argument
    form of PackedFormatError)."""
    add_note = getattr(error, "add_note", None)
    if add_note is None or any(note.startswith(FIELDS_NOTE) for note in getattr(error, "__notes__", ())):
        return
    fields = {"path": error.path, "problem": error.problem, "index": error.index, "key": error.key, "hint": error.hint}
    add_note(FIELDS_NOTE + json.dumps(fields))


def _noted_fields(message: str) -> Optional[dict]:
    """The fields ``note_fields`` wrote into ``message`` (its last such line), or None."""
    at = message.rfind("\n" + FIELDS_NOTE)
    if at < 0:
        return None
    line = message[at + 1 + len(FIELDS_NOTE) :].split("\n", 1)[0]
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    types = {"path": (str, type(None)), "problem": (str,), "index": (int, type(None)), "key": (str, type(None)),
             "hint": (str, type(None))}
    if not isinstance(fields, dict) or set(fields) != set(types):
        return None
    if not all(isinstance(fields[name], kinds) for name, kinds in types.items()):
        return None
    return fields


def printable(text: str) -> str:
    """``text`` with each character that does not print (an escape, a NUL, a newline, a direction mark...)
    written as Python writes it in a key's repr (``\\x1b``): a name read from a file or a store (a set's
    part, a class) shown on a terminal as it is, never acting on it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ArchiveNotFoundError(PackedFormatError, FileNotFoundError):
    """The path does not exist."""


class ArchivePermissionError(PackedFormatError, PermissionError):
    """A file of the archive (the archive itself, a part, a member file) may not be read by this user."""

    @classmethod
    def denied(cls, archive: "os.PathLike[str] | str", file: "os.PathLike[str] | str | None" = None
               ) -> "ArchivePermissionError":
        """The error for ``file`` (default: the archive itself) of ``archive``, which this user may not read."""
        name = os.fspath(archive if file is None else file)
        return cls(archive, f"permission denied: this user may not read {name}",
                   hint="ask its owner for read permission (`ls -l` shows who may read it)")


class UnknownFormatError(PackedFormatError):
    """The path exists but is not an archive this library can read."""


class UnsupportedVersionError(UnknownFormatError):
    """The archive was written in a format version this packed_formats does not know (a newer one)."""


class FormatMismatchError(UnknownFormatError):
    """The archive is of another format than the one asked for."""


class CorruptArchiveError(PackedFormatError):
    """The archive's structure is damaged (truncated, overwritten, unreadable)."""


class IncompleteArchiveError(CorruptArchiveError):
    """The archive was never sealed: its writer was killed or failed."""


class ArchiveChangedError(PackedFormatError):
    """The archive file was replaced or modified after it was opened.

    Each read and each batch first checks that the archive's files kept the size and
    modification time they had when it was opened (``Reader.check_unchanged``): a file
    rewritten in place (``cp other.zip train.zip`` while a job reads ``train.zip``) raises
    this, naming it, instead of serving the other archive's samples and labels.  Open the
    archive (dataset, loader) again to read it as it is now.
    """


class CorruptSampleError(PackedFormatError):
    """One sample fails its checksum or cannot be decoded."""


class SampleIndexError(PackedFormatError, IndexError):
    """A sample index is out of range."""


class ClosedArchiveError(PackedFormatError, ValueError):
    """The reader or writer was used after close()."""


class ArchiveExistsError(PackedFormatError, FileExistsError):
    """The destination exists and overwriting was not asked for."""


class InvalidSampleError(PackedFormatError, ValueError):
    """A writer was given a sample it cannot store (wrong shape, not an image...)."""


class DestinationError(PackedFormatError):
    """The place an archive (or a report) is to be written cannot take it (missing directory, inside the source...)."""


class ArchiveInUseError(PackedFormatError):
    """The archive is in use in a way that prevents this operation here.

    Its LMDB environment is already open in this process, or another process
    has held the lock to stage it for longer than the timeout.
    """


class InsufficientSpaceError(DestinationError):
    """The destination's file system has less free space than what is about to be written there."""


class InvalidSourceError(PackedFormatError):
    """A conversion's source cannot be used as given.

    For example: not a folder, a label file that does not fit the folder's
    images, or not one image that converts.
    """


class MixtureError(PackedFormatError, ValueError):
    """The sources of a ``Mixture`` do not mix: raw ones of other shapes, an empty one, or one that lacks a
    field asked for."""


class RemoteError(PackedFormatError):
    """An archive in object storage (s3://, gs://, https://) could not be reached as it should.

    Its ``path`` is the object's URL without credentials (``storage.redact``): none are ever
    put in an error, a log or a resume state.
    """


class RemoteNotFoundError(RemoteError, ArchiveNotFoundError):
    """The object (an archive, a part of a set, its index) does not exist in the store."""


class RemoteAccessError(RemoteError, ArchivePermissionError):
    """The store refused access (403, invalid or missing credentials)."""


class RemoteChangedError(RemoteError, ArchiveChangedError):
    """An object of a set changed in the store since the set was opened (another size or ETag, or
    content that no longer matches the set's index): it is refused, never mixed with the old one."""


class RemoteUnavailableError(RemoteError):
    """The store kept failing (5xx, reset connections, bodies cut short) through every retry."""


class MissingDependencyError(PackedFormatError):
    """An optional dependency this use needs is not installed (the error says which extra installs it).
    Not an ImportError: that class keeps a ``path`` of its own (the module's), where ours names the archive."""


class DataLoaderWorkerError(PackedFormatError):
    """A DataLoader worker process died (killed by a signal, often the out-of-memory killer)."""


class TempDirTooDeepError(PackedFormatError):
    """The temporary folder (``$TMPDIR``) is too deep for the socket through which DataLoader workers pass
    shared memory (``packed_formats.loading.temp_dir``): workers would hang instead of sending batches."""


class ConversionFailedError(PackedFormatError):
    """A conversion stopped for a reason outside any one sample (e.g. a worker process was killed)."""


class TooManyOpenFilesError(PackedFormatError):
    """The process (or the whole system) has no file descriptor left to open an archive or part with.

    ``ulimit -n`` shows how many files a process may open; a sharded archive
    keeps at most ``max_open_parts`` of its parts open in each process (see
    ``packed_formats.backends.sharded``).
    """

    HINT = "raise the open-file limit (e.g. `ulimit -n 4096` in the shell that starts Python)"

    @staticmethod
    def limit() -> Optional[int]:
        """How many files this process may open (its soft RLIMIT_NOFILE), None where unlimited or unknown."""
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ImportError, OSError, ValueError):
            return None
        return None if soft == resource.RLIM_INFINITY else int(soft)

    @staticmethod
    def in_use() -> Optional[int]:
        """How many file descriptors this process has open (None where the system does not say)."""
        try:
            return len(os.listdir("/proc/self/fd")) - 1  # less the one listing the directory
        except OSError:
            return None

    @classmethod
    def usage(cls) -> str:
        """This process's descriptors in use and its limit, in words."""
        used, limit = cls.in_use(), cls.limit()
        allowed = "no limit" if limit is None else f"a limit of {limit}"
        held = "an unknown number of" if used is None else str(used)  # None: not even their list opens
        return f"this process has {held} files open, with {allowed} (`ulimit -n`)"

    @staticmethod
    def describes(exc: Optional[BaseException]) -> bool:
        """Whether ``exc``, or an exception it was raised while handling, is EMFILE or ENFILE.

        Libraries report it their own way: h5py keeps the errno, LMDB and torch
        only the text, and a backend may have wrapped it as a damaged archive.
        """
        import errno

        codes = (errno.EMFILE, errno.ENFILE)
        texts = tuple(os.strerror(code) for code in codes)
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if isinstance(exc, OSError) and exc.errno in codes:
                return True
            if any(text in str(exc) for text in texts):
                return True
            exc = exc.__cause__ or exc.__context__
        return False


class CacheDirectoryError(DestinationError):
    """The node-local cache directory of remote sets cannot be used as it is (not writable, another
    user's, a name too long for its file system): the error names it and says what to do."""
