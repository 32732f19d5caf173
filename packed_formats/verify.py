"""Checking an archive end to end: every sample's checksum, the records its format keeps of it (a ZIP's
local header and central directory entry), and optionally that it decodes."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

from tqdm import tqdm

from . import codecs
from .archives import open_archive
from .errors import CorruptSampleError

STRUCTURE_CHUNK = 4096  # samples whose records in the format's structure are checked at once


@dataclasses.dataclass(frozen=True)
class BadSample:
    index: int
    key: str
    problem: str


@dataclasses.dataclass
class VerifyReport:
    """The outcome of verify_archive: ``ok`` when every checked sample passed.

    Args:
        path, format, mode, count: the archive checked, its format, mode and number of samples.
        checked: how many samples were checked.
        checksums: False when the archive has none (a plain image folder).
        decoded: whether encoded samples were decoded too.
        bad: the first ``max_report`` bad samples, in index order (``BadSample``: index, key, problem).
        bad_count: how many samples were bad in all.
    """

    path: str
    format: str
    mode: str
    count: int
    checked: int
    checksums: bool  # False when the archive has none (a plain image folder)
    decoded: bool  # encoded samples were decoded too
    bad: List[BadSample]  # the first ``max_report`` bad samples, in index order
    bad_count: int

    @property
    def ok(self) -> bool:
        return self.bad_count == 0

    def lines(self) -> List[str]:
        """Human-readable report: one line per reported bad sample, then a verdict."""
        out = [f"{self.path} [sample index {b.index}, key {b.key!r}]: {b.problem}" for b in self.bad]
        if self.bad_count > len(self.bad):
            out.append(f"... and {self.bad_count - len(self.bad)} more bad samples")
        what = "checksums" if self.checksums else "reads (no checksums stored)"
        if self.decoded:
            what += " and decoding"
        verdict = "OK" if self.ok else f"FAILED: {self.bad_count} bad sample{'' if self.bad_count == 1 else 's'}"
        out.append(f"{self.path}: {self.checked} samples, {what} checked: {verdict}")
        return out


def verify_archive(
    path: "str | os.PathLike[str]", decode: bool = False, max_report: int = 10, progress: bool = False
) -> VerifyReport:
    """Read every sample of the archive at ``path``, checking its CRC32 (and, with ``decode``, that it decodes),
    and each of its fields: against its CRC32, and that its bytes are a value of the field's kind.

    The records the format keeps of each sample besides its bytes, which our
    reads never use but other tools do, are checked too: a ZIP member's local
    header and central directory entry must name it and agree with the index
    (``Reader.structure_problems``).  Bad samples are counted and the first
    ``max_report`` described (index, key, every problem found); the archive
    itself is never modified.  ``progress`` shows a progress bar.

    Raises:
        PackedFormatError: the archive cannot be opened at all (missing, not an
            archive, never sealed, damaged index).
    """
    bad: List[BadSample] = []
    bad_count = 0
    with open_archive(path, verify=True) as reader:
        decode_encoded = decode and reader.mode == "encoded"
        structure: Dict[int, str] = {}
        for i in tqdm(range(len(reader)), desc="verifying", unit="img", disable=not progress):
            if i % STRUCTURE_CHUNK == 0:
                structure = reader.structure_problems(i, i + STRUCTURE_CHUNK)
            problem, records = _check_sample(reader, i, decode_encoded), structure.get(i)
            if records is not None:
                problem = records if problem is None else f"{problem}; {records}"
            if problem is not None:
                bad_count += 1
                if len(bad) < max_report:
                    bad.append(BadSample(i, reader.index.key(i), problem))
        return VerifyReport(
            path=os.fspath(path),
            format=reader.manifest.format,
            mode=reader.mode,
            count=len(reader),
            checked=len(reader),
            checksums=reader.index.crc32 is not None,
            decoded=decode_encoded,
            bad=bad,
            bad_count=bad_count,
        )


def _check_sample(reader, i: int, decode: bool) -> Optional[str]:
    """What is wrong with sample i (its image, then each field), or None."""
    problems = []
    try:
        stored = reader.read(i)  # checks the CRC32
        if decode:
            codecs.open_image(stored)
    except CorruptSampleError as exc:
        problems.append(exc.problem)
    except codecs.DecodeError as exc:
        problems.append(f"does not decode: {exc}")
    for spec in reader.fields:  # each checked against its CRC32, and read as a value of its kind
        try:
            value = reader.read_field(i, spec.name)
            if decode and spec.kind == "image":
                codecs.open_image(value)
        except CorruptSampleError as exc:
            problems.append(exc.problem)
        except codecs.DecodeError as exc:
            problems.append(f"field {spec.name!r} does not decode: {exc}")
    return "; ".join(problems) or None

