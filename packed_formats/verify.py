"""Checking an archive end to end: every sample's checksum, the records its format keeps of it (a ZIP's
local header and central directory entry), and optionally that it decodes."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
from tqdm import tqdm

from . import codecs, policy
from .archives import open_archive
from .backends.set_samples import check_sample_index
from .backends.sharded import ShardedBackend
from .errors import CorruptSampleError, printable

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
        decoded: whether encoded samples (and image fields) were decoded too.
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
        """Human-readable report: one line per reported bad sample, then a verdict (a character that does not
        print, as in a part's name, escaped as a key is)."""
        out = [f"{self.path} [sample index {b.index}, key {b.key!r}]: {b.problem}" for b in self.bad]
        if self.bad_count > len(self.bad):
            out.append(f"... and {self.bad_count - len(self.bad)} more bad samples")
        what = "checksums" if self.checksums else "reads (no checksums stored)"
        if self.decoded:
            what += " and decoding"
        verdict = "OK" if self.ok else f"FAILED: {self.bad_count} bad sample{'' if self.bad_count == 1 else 's'}"
        out.append(f"{self.path}: {self.checked} samples, {what} checked: {verdict}")
        return [printable(line) for line in out]


def verify_archive(
    path: "str | os.PathLike[str]", decode: bool = False, max_report: int = 10, progress: bool = False
) -> VerifyReport:
    """Read every sample of the archive at ``path``, checking its CRC32 (and, with ``decode``, that it decodes
    strictly: pixel data that ends early is bad, and is the size the index records of it, where it records
    one), and each of its fields: against its CRC32, and that its bytes are a value of the field's kind
    (with ``decode``, an image field decodes strictly too, is its image's size and is the kind of image,
    one channel or colour, that the field's first is).

    The records the format keeps of each sample besides its bytes, which our
    reads never use but other tools do, are checked too: a ZIP member's local
    header and central directory entry must name it and agree with the index
    (``Reader.structure_problems``).  Bad samples are counted and the first
    ``max_report`` described (index, key, every problem found); the archive
    itself is never modified.  ``progress`` shows a progress bar.  A local sharded
    set's sample index (``backends.set_samples``) is checked against its parts first.

    Raises:
        PackedFormatError: the archive cannot be opened at all (missing, not an
            archive, never sealed, damaged index), or a set's sample index is damaged
            or disagrees with its parts.
    """
    bad: List[BadSample] = []
    bad_count = 0
    with open_archive(path, verify=True) as reader:
        if type(reader.backend) is ShardedBackend:  # a local set: the sample index beside it, against its parts
            check_sample_index(os.fspath(path))
        decode_encoded = decode and (reader.mode == "encoded" or any(s.kind == "image" for s in reader.fields))
        kinds: Dict[str, str] = {}  # each image field's kind of image (one channel or colour), as its first sample's
        structure: Dict[int, str] = {}
        for i in tqdm(range(len(reader)), desc="verifying", unit="img", disable=not progress):
            if i % STRUCTURE_CHUNK == 0:
                structure = reader.structure_problems(i, i + STRUCTURE_CHUNK)
            problem, records = _check_sample(reader, i, decode_encoded, kinds), structure.get(i)
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


def _check_sample(reader, i: int, decode: bool, kinds: Dict[str, str]) -> Optional[str]:
    """What is wrong with sample i (its image, then each field), or None.  With ``decode``, encoded images
    (the sample's and its image fields') decode strictly (``policy.check_decodes``), and an image field
    (a mask, a second view) is its image's size, told from its header first, and of one kind of image (one
    channel or colour) in every sample, as in the first (``kinds`` holds each field's)."""
    problems = []
    size: Optional[Tuple[int, int]] = None  # the sample image's (width, height)
    try:
        stored = reader.read(i)  # checks the CRC32
        if decode and isinstance(stored, np.ndarray):
            size = (int(stored.shape[1]), int(stored.shape[0]))
        elif decode:
            policy.check_decodes(stored)
            size = codecs.image_header(stored)[0]
            problems.extend(_recorded_size_problem(reader, i, size))
    except CorruptSampleError as exc:
        problems.append(exc.problem)
    except codecs.DecodeError as exc:
        problems.append(f"does not decode: {exc}")
    for spec in reader.fields:  # each checked against its CRC32, and read as a value of its kind
        try:
            value = reader.read_field(i, spec.name)
            if decode and spec.kind == "image":
                problem = _image_field_problem(value, size, spec.name, kinds)
                if problem is not None:
                    problems.append(f"field {spec.name!r}: {problem}")
        except CorruptSampleError as exc:
            problems.append(exc.problem)
        except codecs.DecodeError as exc:
            problems.append(f"field {spec.name!r} does not decode: {exc}")
    return "; ".join(problems) or None


def _recorded_size_problem(reader, i: int, size: Tuple[int, int]) -> List[str]:
    """Why the image size the index records of sample i (when it records one) is not its image's ``size``."""
    widths, heights = reader.index.widths, reader.index.heights
    if widths is None or heights is None:
        return []
    recorded = (int(widths[i]), int(heights[i]))
    if recorded == (0, 0) or recorded == tuple(size):  # (0, 0): its header did not read when it was written
        return []
    return [f"the index records its size as {recorded[0]}x{recorded[1]}, the image is {size[0]}x{size[1]} "
            "(width x height): the index is damaged, convert the archive again"]


_ONE_CHANNEL = ("1", "L", "P", "I;16", "I;16B", "I;16L", "I")  # modes a mask can be read from (its values)


def _image_field_problem(data: bytes, size: Optional[Tuple[int, int]], name: str, kinds: Dict[str, str]
                         ) -> Optional[str]:
    """Why an image field's value is not its sample image's size (``size``, None when unknown), or not the
    kind of image the field's first is; codecs.DecodeError when it does not decode strictly."""
    stored, mode = codecs.image_header(data)
    if size is not None and tuple(stored) != tuple(size):  # told before decoding: it may say 13,000 x 13,000
        return (f"an image of {stored[0]}x{stored[1]} for a sample image of {size[0]}x{size[1]} (width x height): "
                "a mask or second view is its image's size")
    kind = f"one-channel ({mode})" if mode in _ONE_CHANNEL else f"colour ({mode})"
    first = kinds.setdefault(name, kind)
    if first.split()[0] != kind.split()[0]:
        return f"a {kind} image where the field's first is {first}: a field's images are of one kind"
    policy.check_decodes(data)
    return None

