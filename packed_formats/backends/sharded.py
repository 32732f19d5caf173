"""sharded: several archives of one format opened as one dataset through a small JSON index.

``convert --shard-size N`` writes parts ``<stem>-00000<ext>``, ``<stem>-00001<ext>``...
beside the destination and, at the destination itself, an index::

    {"packed_formats_shards": 1, "format": "zip", "parts": [{"name": "train-00000.zip", "count": 1000}, ...]}

Part names are relative to the index's directory.  Each part is a complete
archive of its own; the ShardedReader composes the parts' Readers (each with
its own per-process handle) and checks checksums against the joined index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, List, Optional, Tuple

import numpy as np

from ..errors import ArchiveExistsError, ArchiveNotFoundError, CorruptArchiveError, PackedFormatError
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from .base import Reader, WriteTransaction, publish, remove_path, temp_path_for

INDEX_VERSION = 1
_MAGIC = re.compile(rb'\s*\{\s*"packed_formats_shards"\s*:')


def is_shard_index(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a shard index."""
    return _MAGIC.match(head) is not None


def part_name(path: str, k: int) -> str:
    """The file name of part ``k`` of the sharded archive at ``path``: <stem>-00000<ext>."""
    stem, ext = os.path.splitext(os.path.basename(os.path.abspath(path)))
    return f"{stem}-{k:05d}{ext}"


def read_shard_index(path: str) -> dict:
    """The parsed index at ``path`` (CorruptArchiveError if it is not a valid one)."""
    try:
        with open(path, "rb") as file:
            spec = json.loads(file.read())
        names = [str(p["name"]) for p in spec["parts"]]
        counts = [int(p["count"]) for p in spec["parts"]]
        version, part_format = int(spec["packed_formats_shards"]), str(spec["format"])
    except FileNotFoundError:
        raise ArchiveNotFoundError(path, "no such file") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptArchiveError(path, f"not a valid shard index: {exc}") from None
    if version > INDEX_VERSION or not names or any(os.path.basename(n) != n for n in names):
        raise CorruptArchiveError(path, "not a valid shard index (unknown version, no parts, or a part elsewhere)")
    return {"format": part_format, "names": names, "counts": counts}


class ShardedReader(Reader):
    format_name = "sharded"

    def _open(self) -> str:
        if not os.path.isfile(self.path):
            raise ArchiveNotFoundError(self.path, "no such file")
        return self.path  # nothing to hold: each part keeps its own handle

    @staticmethod
    def _close_handle(handle: Any) -> None:
        """Nothing is held by the index itself."""

    def _read_metadata(self, _handle: Any) -> Tuple[ArchiveManifest, SampleIndex]:
        from . import reader_class

        spec = read_shard_index(self.path)
        directory = os.path.dirname(os.path.abspath(self.path))
        part_class = reader_class(spec["format"])
        self.parts: List[Reader] = [part_class(os.path.join(directory, n), verify=False) for n in spec["names"]]
        self._check_parts(spec["counts"])
        self._starts = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)
        return self._joined_manifest(), self._joined_index()

    def _check_parts(self, counts: List[int]) -> None:
        first = self.parts[0].manifest
        for part, count in zip(self.parts, counts):
            m = part.manifest
            if len(part) != count:
                raise CorruptArchiveError(self.path, f"part {part.path} holds {len(part)} samples, index says {count}")
            if (m.mode, m.shape, m.classes) != (first.mode, first.shape, first.classes):
                raise CorruptArchiveError(self.path, f"part {part.path} differs from the first in mode/shape/classes")

    def _joined_manifest(self) -> ArchiveManifest:
        encodings = {p.manifest.encoding for p in self.parts}
        return dataclasses.replace(
            self.parts[0].manifest,
            format=self.format_name,
            count=int(self._starts[-1]),
            encoding=encodings.pop() if len(encodings) == 1 else "mixed",
        )

    def _joined_index(self) -> SampleIndex:
        indexes = [p.index for p in self.parts]
        crc = None if any(x.crc32 is None for x in indexes) else np.concatenate([x.crc32 for x in indexes])
        return SampleIndex(
            labels=np.concatenate([x.labels for x in indexes]),
            keys=np.concatenate([x.keys for x in indexes]),
            crc32=crc,
        )

    def _locate(self, i: int) -> Tuple[Reader, int]:
        p = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.parts[p], i - int(self._starts[p])

    def _read_blob(self, _handle: Any, i: int) -> Any:
        part, j = self._locate(i)
        return part._read_blob(part._live_handle(), j)

    def _read_raw_batch(self, _handle: Any, idx: np.ndarray, out: np.ndarray) -> None:
        owner = np.searchsorted(self._starts, idx, side="right") - 1
        for p in np.unique(owner):
            part, mask = self.parts[int(p)], owner == p
            local = idx[mask] - self._starts[p]
            if mask.all():
                part._read_raw_batch(part._live_handle(), local, out)
            else:
                buffer = np.empty((len(local),) + out.shape[1:], dtype=np.uint8)
                part._read_raw_batch(part._live_handle(), local, buffer)
                out[mask] = buffer

    def close(self) -> None:
        super().close()
        for part in getattr(self, "parts", ()):
            part.close()


class ShardedWriter(WriteTransaction):
    """Writes parts of at most ``shard_size`` samples, then the index at ``path``.

    Parts are written into a temporary folder beside ``path`` and moved into
    place only at close(), parts first and the index last, so an interrupted
    conversion leaves nothing at ``path``.  Options are those of Writer.
    """

    def __init__(
        self, path: "str | os.PathLike[str]", format: str, shard_size: int, overwrite: bool = False, **options: Any
    ) -> None:
        from . import writer_class

        self.path = os.fspath(path)
        if shard_size < 1:
            raise ValueError(f"shard size must be at least 1, got {shard_size}")
        if os.path.lexists(self.path) and not overwrite:
            raise ArchiveExistsError(self.path, "already exists", hint="pass overwrite=True to replace it")
        self.format, self.shard_size, self.overwrite, self.options = format, shard_size, overwrite, options
        self._writer_class = writer_class(format)
        self.temp_path = temp_path_for(self.path)
        os.mkdir(self.temp_path)
        self._parts: List[Tuple[str, int]] = []
        self._current: Optional[Any] = None
        self._count = 0
        self.paths: List[str] = []  # published files, index last

    def __len__(self) -> int:
        return self._count

    def add(self, sample: Any, label: int, key: Optional[str] = None) -> int:
        """Append one sample (see Writer.add); return its index in the whole dataset."""
        if self._current is None or len(self._current) == self.shard_size:
            self._next_part()
        self._current.add(sample, label, key)
        self._count += 1
        return self._count - 1

    def _next_part(self) -> None:
        self._finish_part()
        name = part_name(self.path, len(self._parts))
        self._current = self._writer_class(os.path.join(self.temp_path, name), **self.options)
        self._parts.append((name, 0))

    def _finish_part(self) -> None:
        if self._current is not None:
            self._current.close()
            self._parts[-1] = (self._parts[-1][0], len(self._current))
            self._current = None

    def close(self) -> None:
        """Seal the last part and move every part, then the index, into place."""
        try:
            if not self._parts:
                self._next_part()
            self._finish_part()
            index_temp = os.path.join(self.temp_path, "index.json")
            with open(index_temp, "w") as file:
                file.write(_index_json(self.format, self._parts))
            self._publish_all(index_temp)
        except BaseException:
            self.abort()
            raise
        remove_path(self.temp_path)

    def _publish_all(self, index_temp: str) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        finals = [os.path.join(directory, name) for name, _ in self._parts]
        if not self.overwrite:
            for final in finals:
                if os.path.lexists(final):
                    raise ArchiveExistsError(final, "already exists", hint="pass overwrite=True to replace it")
        for (name, _), final in zip(self._parts, finals):
            publish(os.path.join(self.temp_path, name), final, overwrite=self.overwrite)
        publish(index_temp, self.path, overwrite=self.overwrite)
        self.paths = finals + [self.path]

    def abort(self) -> None:
        """Discard everything written; nothing at ``path`` changes."""
        if self._current is not None:
            self._current.abort()
            self._current = None
        remove_path(self.temp_path)


def _index_json(format: str, parts: List[Tuple[str, int]]) -> str:
    spec = {
        "packed_formats_shards": INDEX_VERSION,
        "format": format,
        "parts": [{"name": name, "count": count} for name, count in parts],
    }
    return json.dumps(spec, indent=1) + "\n"


def existing_parts(path: str) -> List[str]:
    """The part paths of the sharded archive now at ``path`` (none if it is not one)."""
    try:
        with open(path, "rb") as file:
            if not is_shard_index(file.read(64)):
                return []
        names = read_shard_index(path)["names"]
    except (OSError, PackedFormatError):
        return []
    directory = os.path.dirname(os.path.abspath(path))
    return [os.path.join(directory, n) for n in names]
