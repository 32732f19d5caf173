"""Put a local archive or set into a store so that ``open_archive(url)`` reads it through the cache.

A sharded set goes part by part (each retried; a folder part file by file), then its sample
index (``<stem>-samples.npz``: labels, keys, CRC32s, part counts and each field's CRC32s, so that opening the set
reads no part), and the set's index last, so a reader never sees half a set: until the index
is there, the set does not exist at that URL.  The index gains the sample index's name, size
and CRC32, and the set's manifest (a local reader ignores both), and is sealed again over them.
"""

from __future__ import annotations

import io
import os
import zlib
from typing import Any, Dict, List, Optional

import numpy as np

from ..backends import detect_format, open_local
from ..backends.sharded import index_text, read_shard_index
from .remote import Store
from .urls import basename, clean_url, join

SAMPLES_SUFFIX = "-samples.npz"


def samples_name(index_name: str) -> str:
    """The sample index's object name beside the set's index ``index_name`` (train.zip -> train-samples.npz)."""
    return f"{os.path.splitext(index_name)[0]}{SAMPLES_SUFFIX}"


def upload(path: "str | os.PathLike[str]", url: str, storage_options: Optional[Dict[str, Any]] = None,
           on_object: Any = None) -> List[str]:
    """Upload the archive or set at ``path`` to ``url`` (its index's URL, for a set); return the URLs
    written, the set's index last.  ``on_object(url)`` is called after each one is in place."""
    path, url = os.fspath(path), clean_url(url)
    store, written = Store(storage_options), []

    def put(local: str, target: str) -> None:
        if os.path.isdir(local):
            for root, _, files in os.walk(local):
                for name in sorted(files):
                    file = os.path.join(root, name)
                    put(file, f"{target}/{os.path.relpath(file, local)}")
            return
        store.upload(local, target)
        written.append(target)
        if on_object is not None:
            on_object(target)

    if detect_format(path) != "sharded":
        put(path, url)
        return written
    index = read_shard_index(path)
    directory = os.path.dirname(os.path.abspath(path))
    for name in index["names"]:
        put(os.path.join(directory, name), join(url, name))
    samples, manifest_text = _samples_npz(path)
    sample_url = join(url, samples_name(basename(url)))
    local_samples = f"{path}.samples-upload-{os.getpid()}"
    try:
        with open(local_samples, "wb") as binary:
            binary.write(samples)
        put(local_samples, sample_url)
    finally:
        os.remove(local_samples)
    text = index_text(index["format"], list(zip(index["names"], index["counts"])), index["set_id"],
                      samples={"name": basename(sample_url), "size": len(samples), "crc32": zlib.crc32(samples)},
                      manifest=manifest_text)  # sealed again, over what it gained
    local_index = f"{path}.index-upload-{os.getpid()}"
    try:
        with open(local_index, "w") as file:
            file.write(text)
        put(local_index, url)
    finally:
        os.remove(local_index)
    return written


def _plain(keys: np.ndarray) -> np.ndarray:
    """Keys as a plain fixed-width bytes array (HDF5's carry dtype metadata that .npy cannot keep)."""
    return keys.astype(f"S{max(1, keys.dtype.itemsize)}") if keys.dtype.kind == "S" else keys


def _samples_npz(path: str) -> "tuple[bytes, str]":
    """The set's sample index as the bytes of an uncompressed .npz, and its manifest's JSON text."""
    with open_local(path, verify=False) as reader:
        backend: Any = reader.backend
        arrays: Dict[str, np.ndarray] = {
            "labels": np.asarray(reader.index.labels, dtype=np.int64),
            "keys": _plain(np.asarray(reader.index.keys)),
            "counts": np.asarray([len(p) for p in backend.parts], dtype=np.int64),
        }
        if reader.index.crc32 is not None:
            arrays["crc32"] = np.asarray(reader.index.crc32, dtype=np.uint32)
        rows = reader.index.field_crc32s([spec.name for spec in reader.fields])
        if reader.fields and rows is not None:  # each field's CRC32s, a row a field
            arrays["field_crc32"] = np.stack([np.asarray(row, dtype=np.uint32) for row in rows])
        manifest_text = reader.manifest.to_json()
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue(), manifest_text
