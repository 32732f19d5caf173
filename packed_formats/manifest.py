"""The archive's self-description, stored as JSON inside every archive."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional, Sequence, Tuple

MODES = ("raw", "encoded")
CHECKSUM = "crc32"


@dataclasses.dataclass(frozen=True)
class ArchiveManifest:
    """What an archive holds: format, layout of its samples, classes.

    ``shape`` (H, W, C) is set for raw archives; ``encoding`` ("jpeg", "png" or
    "mixed") for encoded ones.  ``complete`` is written last: an archive whose
    manifest is missing or says ``complete: false`` was never sealed.
    """

    format: str
    mode: str
    count: int
    classes: Tuple[str, ...]
    shape: Optional[Tuple[int, int, int]] = None
    dtype: str = "uint8"
    encoding: Optional[str] = None
    checksum: Optional[str] = CHECKSUM
    format_version: int = 1
    created_with: str = ""
    created_at: str = ""
    complete: bool = True

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["classes"] = list(self.classes)
        data["shape"] = None if self.shape is None else list(self.shape)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: "str | bytes") -> "ArchiveManifest":
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown manifest fields {sorted(unknown)}")
        data["classes"] = tuple(data.get("classes", ()))
        if data.get("shape") is not None:
            data["shape"] = tuple(int(x) for x in data["shape"])
        return cls(**data)

    @property
    def sample_nbytes(self) -> Optional[int]:
        """Bytes of one raw sample, None for encoded archives."""
        if self.shape is None:
            return None
        h, w, c = self.shape
        return h * w * c


def new_manifest(
    format: str,
    mode: str,
    count: int,
    classes: Sequence[str],
    shape: Optional[Tuple[int, int, int]],
    encoding: Optional[str],
) -> ArchiveManifest:
    """A sealed manifest stamped with this library's version and the time."""
    from . import __version__

    return ArchiveManifest(
        format=format,
        mode=mode,
        count=count,
        classes=tuple(classes),
        shape=None if shape is None else tuple(int(x) for x in shape),
        encoding=encoding,
        created_with=f"packed_formats {__version__}",
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_build_time())),
    )


def _build_time() -> float:
    """Now, or $SOURCE_DATE_EPOCH when set (reproducible builds: byte-identical archives)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    return float(epoch) if epoch.strip().isdigit() else time.time()
