"""Describe an HDF5 archive written without a locator, in a child process of its reader (``hdf5_layout.probe``).

Run as a script (``python hdf5_probe.py PATH SETTINGS``, SETTINGS a Python
literal: the manifest attribute's name, the sample and index dataset names, the
encoded chunk size), it imports only h5py and numpy, asks HDF5 what the reader
needs (the manifest's text, where each index array lies, the sample dataset's
chunk addresses) and writes it to stdout, pickled, as plain values.  A file that
makes HDF5 crash or hang ends this process; its reader names the file damaged.
"""

from __future__ import annotations

import ast
import pickle
import sys
from typing import Any, Dict, Optional

import h5py
import numpy as np


def describe(path: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """What the reader of the archive at ``path`` needs, or {"error": (kind, problem)}."""
    try:
        file = h5py.File(path, "r", locking=False, rdcc_nbytes=0)
    except OSError as exc:
        return {"error": ("unopenable", f"HDF5 cannot open it ({exc})")}
    with file:
        names = set(file.keys())
        samples = [name for name in settings["samples"] if name in names]
        manifest = file.attrs.get(settings["manifest"])
        if manifest is None:
            if _written_here(file, settings):
                return {"error": ("unsealed", "no manifest: the archive was never sealed")}
            return {"error": ("foreign", "an HDF5 file, but not a packed_formats archive (no manifest attribute)")}
        if not samples:
            return {"error": ("foreign", "an HDF5 file, but not a packed_formats archive (no images/data dataset)")}
        data = file[samples[0]]
        arrays = {name: _array(file[name]) for name in settings["index"] if name in names}
        found: Dict[str, Any] = {"manifest": manifest, "arrays": arrays}
        if data.ndim == 4 and "positions" in arrays:
            return found
        step = 1 if data.ndim == 4 else settings["chunk"]
        filtered = data.id.get_create_plist().get_nfilters()
        if data.chunks != (step,) + data.shape[1:] or filtered or data.dtype != np.uint8:
            return {"error": ("layout", "its sample dataset is not laid out as packed_formats writes it "
                                        "(one unfiltered chunk per image, or 64 KiB chunks of bytes)")}
        found["chunks"] = _chunk_addresses(data, step)
        found["chunk_bytes"] = int(np.prod(data.chunks))
        found["data_nbytes"] = int(np.prod(data.shape))
        if found["chunks"] is None:
            return {"error": ("layout", "a chunk of its sample dataset is not stored in the file")}
        return found


def _array(dataset: h5py.Dataset) -> tuple:
    """("at", (offset, dtype, count)) where a 1-D dataset lies as plain bytes, else ("values", its values)."""
    plist = dataset.id.get_create_plist()
    plain = plist.get_layout() == h5py.h5d.CONTIGUOUS and not plist.get_nfilters() and not plist.get_external_count()
    if plain and dataset.ndim == 1 and dataset.dtype.kind in "iuS" and dataset.id.get_offset() is not None:
        return "at", (int(dataset.id.get_offset()), dataset.dtype.str, len(dataset))
    return "values", dataset[()]


def _chunk_addresses(data: h5py.Dataset, step: int) -> Optional[np.ndarray]:
    """The file address of each chunk of ``data`` (``step`` elements along its first axis), or None
    where one is not in the file."""
    count = -(-data.shape[0] // step)
    addresses = np.full(count, -1, dtype=np.int64)
    if hasattr(data.id, "chunk_iter"):

        def note(chunk) -> None:
            k = chunk.chunk_offset[0] // step
            if 0 <= k < count:
                addresses[k] = chunk.byte_offset

        data.id.chunk_iter(note)
    else:  # h5py before 3.8
        for k in range(count):
            info = data.id.get_chunk_info_by_coord((k * step,) + (0,) * (data.ndim - 1))
            addresses[k] = -1 if info.byte_offset is None else info.byte_offset
    return None if count and addresses.min() < 0 else addresses


def _written_here(file: h5py.File, settings: Dict[str, Any]) -> bool:
    """Whether the file holds only our datasets, the sample dataset laid out as our writer makes it."""
    if not set(file.keys()) <= set(settings["samples"]) | set(settings["index"]) | set(settings["extra"]):
        return False
    images, data = file.get("images"), file.get("data")
    if isinstance(images, h5py.Dataset):
        return images.ndim == 4 and images.dtype == np.uint8 and images.chunks == (1,) + images.shape[1:]
    if isinstance(data, h5py.Dataset):
        return data.ndim == 1 and data.dtype == np.uint8 and data.chunks == (settings["chunk"],)
    return False


def main() -> None:
    path, settings = sys.argv[1], ast.literal_eval(sys.argv[2])
    answer = pickle.dumps(describe(path, settings), protocol=4)
    sys.stdout.buffer.write(answer)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
