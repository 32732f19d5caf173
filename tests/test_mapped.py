"""Raw batches gathered from a memory map of the archive file (backends/mapped.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends import mapped


def write_rows(path, positions, nbytes, size=None):
    data = np.zeros(int(max(positions)) + nbytes, dtype=np.uint8)
    rows = np.random.default_rng(0).integers(0, 256, size=(len(positions), nbytes), dtype=np.uint8)
    for position, row in zip(positions, rows):
        data[position : position + nbytes] = row
    data[:size].tofile(path)
    return rows


@pytest.mark.parametrize("with_torch", [True, False], ids=["torch-imported", "numpy-only"])
@pytest.mark.parametrize("positions", [[7, 107, 207, 307, 407], [3, 90, 250, 260, 400]], ids=["even", "uneven"])
def test_a_gather_returns_the_rows_at_their_positions_in_the_asked_order(tmp_path, monkeypatch, positions, with_torch):
    """Whether or not the process imported torch (uneven rows are then cut with torch), the same rows."""
    monkeypatch.setattr(mapped, "torch_imported", lambda: with_torch)
    path = tmp_path / "rows.bin"
    rows = write_rows(path, positions, 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mapped.MappedRows.of(fd, np.asarray(positions), 10)
    finally:
        os.close(fd)  # the map outlives the descriptor
    assert (mapping.even is not None) == (positions[0] == 7)  # even spacing: one strided view
    idx = np.array([4, 0, 0, 2])
    out = np.full((4, 10), 255, dtype=np.uint8)
    mapping.gather(idx, out)
    np.testing.assert_array_equal(out, rows[idx])
    mapping.close()


@pytest.mark.parametrize("gap", [0, 51], ids=["rows-touch", "rows-apart"])
def test_a_gather_of_evenly_spaced_rows_copies_the_rows_not_the_map(tmp_path, gap):
    """numpy.take makes a view whose rows lie apart (a ZIP's members, each after its header) contiguous
    first: a copy of the whole map for each batch (a raw ZIP of 576 MiB read 2,400 images/s)."""
    import tracemalloc

    nbytes, count = 50_000, 200
    positions = np.arange(count) * (nbytes + gap) + 7
    path = tmp_path / "rows.bin"
    rows = write_rows(path, positions, nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mapped.MappedRows.of(fd, positions, nbytes)
    finally:
        os.close(fd)
    assert mapping.even == (count, nbytes + gap, 7)
    idx, out = np.array([199, 3, 3, 150]), np.zeros((4, nbytes), dtype=np.uint8)
    tracemalloc.start()
    try:
        mapping.gather(idx, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out, rows[idx])
    assert peak < count * nbytes // 20, f"the gather allocated {peak} bytes for a batch of {out.nbytes}"
    mapping.close()


def test_no_map_when_a_row_lies_past_the_end_of_the_file(tmp_path):
    path = tmp_path / "short.bin"
    write_rows(path, [0, 10, 20], 10, size=25)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert mapped.MappedRows.of(fd, np.array([0, 10, 20]), 10) is None
    finally:
        os.close(fd)


def test_even_step():
    assert mapped.even_step(np.array([5, 9, 13])) == 4
    assert mapped.even_step(np.array([5, 9, 14])) is None
    assert mapped.even_step(np.array([5])) == 0


def mapped_rows_of(reader):
    return reader.handle().rows


@pytest.mark.parametrize("fmt", ["memmap", "zip", "hdf5"])
def test_raw_batches_of_our_archives_come_from_the_map_and_equal_single_reads(archives, fmt):
    reader = pf.open_archive(archives[(fmt, "raw")])
    idx = np.array([len(reader) - 1, 0, 2, 2])
    batch = reader.read_many(idx)
    rows = mapped_rows_of(reader)
    assert rows is not None and rows is not False  # the fast path is taken, not silently lost
    for j, i in enumerate(idx):
        np.testing.assert_array_equal(batch[j], reader.read(int(i)))
    reader.close()
