"""folder: a plain ImageFolder tree (root/<class>/<image>), read-only.

The baseline every benchmark compares against, and a conversion source.  Like
torchvision's ImageFolder: classes are the sorted sub-directory names, samples
the image files below each (recursively), sorted.  No checksums: the files are
the source of truth.
"""

from __future__ import annotations

import os
import warnings
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import ArchiveNotFoundError, UnknownFormatError
from ..index import SampleIndex, encode_keys
from ..manifest import ArchiveManifest
from .base import Backend, FormatSpec, Handle

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Images of kinds that are not read (as torchvision's ImageFolder leaves them out): named apart when skipped.
UNREAD_IMAGE_EXTENSIONS = (".gif", ".avif", ".heic", ".heif", ".jp2", ".jxl", ".ico", ".svg")
SKIPPED_NAMES_KEPT = 1000  # names of skipped files a listing keeps, to show them (a source may have millions)


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def keep_names(kept: List[str], names: Iterable[str]) -> None:
    """Append ``names`` to ``kept`` until it holds ``SKIPPED_NAMES_KEPT``."""
    for name in names:
        if len(kept) >= SKIPPED_NAMES_KEPT:
            return
        kept.append(name)


def scan_image_folder(root: str, skipped_names: Optional[List[str]] = None
                      ) -> Tuple[List[str], np.ndarray, np.ndarray, int]:
    """(classes, image paths relative to ``root``, labels, files skipped) of an ImageFolder tree, the
    paths as one fixed-width bytes array (as ``encode_keys`` makes them) and the labels int64.  Files
    skipped are those below the classes that are no image of a kind read here (``IMAGE_EXTENSIONS``):
    ``skipped_names``, when given, gets the first ``SKIPPED_NAMES_KEPT`` of them, relative to ``root``.

    Classes are the sorted sub-directories, images sorted by directory path, then file name.
    Symbolic links to directories are followed, each real directory once: a link back to a
    directory already being scanned (a loop) or to one scanned already (a duplicate) is skipped
    with a warning naming it, so no image is counted twice or under another class.  File names
    that are not valid UTF-8 are stored surrogate-escaped and round-trip.

    Each directory's image names become a bytes array as soon as it is listed, and the keys are
    made from those, directory by directory, into one array: at its peak the listing holds about
    twice the keys' bytes, plus one directory's names as Python strings.
    """
    with os.scandir(root) as entries:
        classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    parts: List[np.ndarray] = []  # the keys of each directory's images, in order
    part_labels: List[int] = []
    skipped = 0
    seen = {os.path.realpath(root)}
    for label, name in enumerate(classes):
        listing = []
        for directory, files in _walk_once(os.path.join(root, name), seen):
            images = [file for file in files if is_image_file(file)]
            skipped += len(files) - len(images)
            if skipped_names is not None and len(images) < len(files):
                left_out = (os.path.relpath(os.path.join(directory, f), root) for f in files if not is_image_file(f))
                keep_names(skipped_names, left_out)
            if images:
                prefix = os.path.join(os.path.relpath(directory, root), "").encode("utf-8", "surrogateescape")
                listing.append((directory, np.char.add(prefix, encode_keys(images))))
            del files, images
        for _, keys in sorted(listing, key=lambda entry: entry[0]):
            parts.append(keys)
            part_labels.append(label)
    keys = np.concatenate(parts) if parts else np.zeros(0, dtype="S1")  # as wide as the longest key
    labels = np.repeat(np.array(part_labels, dtype=np.int64), [len(part) for part in parts])
    return classes, keys, labels, skipped


def _walk_once(top: str, seen: set) -> Iterator[Tuple[str, List[str]]]:
    """(directory, sorted file names) of ``top`` and every directory below, following links to directories once."""
    real = os.path.realpath(top)
    if real in seen:
        warnings.warn(
            f"{top}: skipped, a link to {real}, which is scanned already (a loop, or a second link to it)",
            SourceLinkWarning, stacklevel=3,
        )
        return
    seen.add(real)
    try:
        with os.scandir(top) as listing:
            entries = sorted(listing, key=lambda e: e.name)
    except OSError as exc:
        warnings.warn(f"{top}: skipped, cannot list it ({exc.strerror})", SourceLinkWarning, stacklevel=3)
        return
    yield top, [e.name for e in entries if not _is_dir(e)]
    for entry in entries:
        if _is_dir(entry):
            yield from _walk_once(entry.path, seen)


def _is_dir(entry: "os.DirEntry[str]") -> bool:
    try:
        return entry.is_dir()  # follows symbolic links
    except OSError:
        return False


class SourceLinkWarning(UserWarning):
    """A linked directory of a source folder was skipped (a loop, or a second link to one directory)."""


def looks_like_image_folder(root: str) -> bool:
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if entry.is_dir() and not entry.name.startswith("."):
                    with os.scandir(entry.path) as subs:
                        if any(sub.is_file() and is_image_file(sub.name) for sub in subs):
                            return True
    except OSError:
        return False
    return False


class FolderHandle(Handle):
    """Nothing is held open between reads: each read opens its file anew."""

    def __init__(self, root: str) -> None:
        self.root = root

    def close(self) -> None:
        """Nothing to release."""


class FolderBackend(Backend[FolderHandle]):
    format_name = "folder"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        if not os.path.isdir(path):
            raise ArchiveNotFoundError(path, "no such directory")
        classes, keys, labels, _ = scan_image_folder(path)
        if not len(keys):
            raise UnknownFormatError(
                path, "no images found in class sub-directories", hint="expected root/<class>/<image> files"
            )
        manifest = ArchiveManifest(
            format="folder", mode="encoded", count=len(keys), classes=tuple(classes), encoding="mixed", checksum=None
        )
        index = SampleIndex(labels=labels, keys=keys)
        return manifest, index

    def data_file(self) -> None:
        return None  # a folder may legitimately gain files

    def files(self) -> List[str]:
        return [os.path.join(self.path, self.index.key(i)) for i in range(len(self.index))]

    def open(self) -> FolderHandle:
        if not os.path.isdir(self.path):
            raise ArchiveNotFoundError(self.path, "no such directory")
        return FolderHandle(self.path)

    def read(self, handle: FolderHandle, i: int) -> bytes:
        path = os.path.join(handle.root, self.index.key(i))
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise self.corrupt(f"cannot read {path}: {exc.strerror}", i) from None

    def sample_location(self, i: int) -> Tuple[str, int]:
        return os.path.join(self.path, self.index.key(i)), 0


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is None and looks_like_image_folder(path)


SPEC = FormatSpec("folder", FolderBackend, None, (), _sniff)
