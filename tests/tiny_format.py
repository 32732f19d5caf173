"""A tiny format defined outside the library: proof that a format is one module plus one ``register`` line.

A directory with ``tiny.json`` (the manifest, written last), ``blob.bin`` (every
sample's bytes, one after the other) and one ``.npy`` per index array.  The
shared test suite runs on it when PF_TEST_EXTRA_FORMAT=tests.tiny_format
(see test_registry.py).
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import numpy as np

from packed_formats.backends import FormatSpec, Writer, register
from packed_formats.backends.base import Backend, Handle
from packed_formats.errors import ArchiveNotFoundError, CorruptArchiveError, IncompleteArchiveError
from packed_formats.index import SampleIndex
from packed_formats.manifest import ArchiveManifest

MANIFEST, BLOB = "tiny.json", "blob.bin"


class TinyHandle(Handle):
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)


class TinyBackend(Backend[TinyHandle]):
    format_name = "tiny"

    @classmethod
    def read_metadata(cls, path: str) -> Tuple[ArchiveManifest, SampleIndex]:
        if not os.path.isdir(path):
            raise ArchiveNotFoundError(path, "no such directory")
        if not os.path.exists(os.path.join(path, MANIFEST)):
            raise IncompleteArchiveError(path, "no manifest: never sealed")
        try:
            with open(os.path.join(path, MANIFEST)) as file:
                manifest = ArchiveManifest.from_json(file.read(), path=path)
            names = [n[:-4] for n in os.listdir(path) if n.endswith(".npy")]
            arrays = {n: np.load(os.path.join(path, n + ".npy"), allow_pickle=False) for n in names}
        except (OSError, ValueError) as exc:
            raise CorruptArchiveError(path, f"cannot read the index: {exc}") from None
        return manifest, SampleIndex.from_arrays(arrays)

    def data_file(self) -> str:
        return os.path.join(self.path, BLOB)

    def files(self) -> List[str]:
        return [os.path.join(self.path, n) for n in sorted(os.listdir(self.path))]

    def open(self) -> TinyHandle:
        return TinyHandle(self.data_file())

    def _span(self, i: int) -> Tuple[int, int]:
        if self.manifest.mode == "raw":  # samples of one size, one after the other
            return i * self.sample_nbytes, self.sample_nbytes
        return int(self.offsets[i]), int(self.offsets[i + 1] - self.offsets[i])

    def read(self, handle: TinyHandle, i: int) -> bytes:
        start, size = self._span(i)
        data = os.pread(handle.fd, size, start)
        if len(data) != size:
            raise self.corrupt("the file is truncated", i)
        return data

    def sample_location(self, i: int) -> Optional[Tuple[str, int]]:
        return self.data_file(), self._span(i)[0]


class TinyWriter(Writer):
    format_name = "tiny"

    def begin(self, temp_path: str) -> None:
        os.mkdir(temp_path)
        self._blob = open(os.path.join(temp_path, BLOB), "wb")

    def append(self, blob: bytes, i: int, crc: int) -> int:
        self._blob.write(blob)
        return -1

    def finish(self, index: SampleIndex, manifest: ArchiveManifest) -> None:
        self._blob.close()
        for name, array in index.arrays().items():
            np.save(os.path.join(self.temp_path, name + ".npy"), array, allow_pickle=False)
        with open(os.path.join(self.temp_path, MANIFEST), "w") as file:
            file.write(manifest.to_json())

    def discard(self) -> None:
        self._blob.close()


def _sniff(path: str, head: Optional[bytes]) -> bool:
    return head is None and os.path.exists(os.path.join(path, MANIFEST))


SPEC = FormatSpec("tiny", TinyBackend, TinyWriter, (".tiny",), _sniff)
register(SPEC)
