"""No damage makes opening, reading or verifying an archive hang: each case runs in its own process, timed.

HDF5 trusts its metadata: 512 zero bytes over the manifest attribute's stored
text made ``h5py.File(path).attrs[...]`` spin forever (it does not return in
minutes), so a training job sat until its walltime.  An HDF5 archive now
carries the checksums of what HDF5 parses in its user block, checked first.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends import hdf5, hdf5_guard

from . import fuzz_helpers as fuzz
from .conftest import CLASSES

TIMEOUT = 60  # seconds: far above a good read of these small archives (well under one)
HANGING = (0, 223, 262)  # offsets into the manifest's stored text where 512 zero bytes hung HDF5 2.0


def zero_the_manifest_text(path: str, at: int) -> None:
    """Write 512 zero bytes ``at`` bytes into the manifest's text as stored in the HDF5 file at ``path``."""
    with open(path, "rb") as file:
        start = file.read().find(b'{\n "')
    assert start > 0
    with open(path, "r+b") as file:
        file.seek(start + at)
        file.write(bytes(512))


@pytest.mark.parametrize("at", HANGING)
@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_damage_hdf5_parses_is_refused_before_hdf5_reads_it(uniform_archives, tmp_path, mode, at):
    good = uniform_archives[("hdf5", mode)]
    ref = fuzz.reference_of(good, mode)
    copy = fuzz.copy_archive(good, str(tmp_path / os.path.basename(good)))
    zero_the_manifest_text(copy, at)
    for name in fuzz.READ_PATHS:
        outcome = fuzz.run_isolated(fuzz.READERS[name], copy, ref, mode, TIMEOUT)
        assert outcome.verdict in (fuzz.NAMED, fuzz.FLAGGED), (name, outcome)
        assert "does not match its checksum" in outcome.detail, (name, outcome)


def test_an_hdf5_archive_stays_a_plain_hdf5_file(uniform_archives):
    """h5py reads the archive as before: the checks sit in HDF5's user block, which HDF5 skips."""
    import h5py

    path = uniform_archives[("hdf5", "raw")]
    with h5py.File(path, "r") as file:
        assert file.userblock_size == hdf5_guard.USERBLOCK
        manifest = pf.ArchiveManifest.from_json(file.attrs[hdf5.MANIFEST_ATTR])
        assert file["images"].shape[0] == manifest.count
    assert pf.detect_format(path) == "hdf5"


def test_a_damaged_user_block_is_refused(uniform_archives, tmp_path):
    good = uniform_archives[("hdf5", "encoded")]
    copy = fuzz.copy_archive(good, str(tmp_path / "copy.h5"))
    with open(copy, "r+b") as file:
        file.seek(3)
        file.write(b"\0")
    with pytest.raises(pf.CorruptArchiveError, match="user block"):
        pf.open_archive(copy)


def test_an_archive_written_before_the_user_block_still_opens(uniform_archives, tmp_path, monkeypatch):
    """An older archive (HDF5's signature at offset 0, no checks stored) is read as before."""
    import h5py

    class NoUserBlock(h5py.File):
        def __init__(self, *args, userblock_size=None, **kwargs):
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(hdf5.h5py, "File", NoUserBlock)
    monkeypatch.setattr(hdf5, "seal_metadata", lambda path: None)
    good = uniform_archives[("hdf5", "raw")]
    with pf.open_archive(good) as reader:
        samples = [(bytes(reader.read(i)), int(reader.labels[i]), reader.key(i)) for i in range(len(reader))]
    old = str(tmp_path / "old.h5")
    with pf.open_writer(old, format="hdf5", mode="raw", shape=(24, 32, 3), classes=CLASSES) as w:
        for data, label, key in samples:
            w.add(np.frombuffer(data, dtype=np.uint8).reshape(24, 32, 3), label, key)
    monkeypatch.undo()
    with open(old, "rb") as file:
        assert file.read(8) == hdf5_guard.HDF5_SIGNATURE
    with pf.open_archive(old) as reader:
        assert [(bytes(reader.read(i)), int(reader.labels[i]), reader.key(i)) for i in range(len(reader))] == samples
