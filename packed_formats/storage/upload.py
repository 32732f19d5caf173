"""Put a local archive or set into a store so that ``open_archive(url)`` reads it through the cache.

A sharded set goes part by part (each retried; a folder part file by file), then its sample
index (``<stem>-samples.npz``: labels, keys, CRC32s, part counts and each field's CRC32s, so that opening the set
reads no part), and the set's index last, so a reader never sees half a set: until the index
is there, the set does not exist at that URL.  The index gains the sample index's name, size
and CRC32, and the set's manifest (a local reader ignores both), and is sealed again over them:
the files a local sharded conversion and join write beside the parts (``backends.set_samples``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from ..backends import detect_format
from ..backends.set_samples import SAMPLES_SUFFIX, sample_index, samples_name
from ..backends.sharded import read_shard_index
from .remote import Store
from .urls import basename, clean_url, join

__all__ = ["SAMPLES_SUFFIX", "samples_name", "upload"]


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
    sample_url = join(url, samples_name(basename(url)))
    # first: a set that does not open is refused before any upload.  Built again from the parts, as a local
    # conversion writes it (never the local copy's file, which is untrusted), under the name it has there
    samples, text = sample_index(path, basename(sample_url))
    directory = os.path.dirname(os.path.abspath(path))
    for name in index["names"]:
        put(os.path.join(directory, name), join(url, name))
    local_samples = f"{path}.samples-upload-{os.getpid()}"
    try:
        with open(local_samples, "wb") as binary:
            binary.write(samples)
        put(local_samples, sample_url)
    finally:
        os.remove(local_samples)
    local_index = f"{path}.index-upload-{os.getpid()}"
    try:
        with open(local_index, "w") as file:
            file.write(text)
        put(local_index, url)
    finally:
        os.remove(local_index)
    return written
