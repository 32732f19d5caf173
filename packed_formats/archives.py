"""Opening an archive by path or URL: the one place that chooses between the local formats
(``backends``) and object storage (``storage``).

It sits above both, so that ``backends`` knows nothing of URLs and ``storage`` may build on
``backends`` without a circle: ``open_archive``, ``PackedDataset`` and ``make_loader`` all open what
they are given through here.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from . import storage
from .backends import open_local
from .backends.reader import Reader
from .policy import VerifyPolicy
from .tracebacks import drops_frames


@drops_frames  # a kept error of a failed open must not keep the half-made Reader (and its parts) alive
def open_archive(
    path: "str | os.PathLike[str]", format: Optional[str] = None, verify: VerifyPolicy = True,
    *, max_open_parts: Optional[int] = None, cache_dir: "str | os.PathLike[str] | None" = None,
    cache_limit: "int | str | None" = None, storage_options: Optional[Dict[str, Any]] = None,
) -> Reader:
    """Open any archive (format auto-detected) as a Reader.

    ``path``: the archive (a file, a directory, or a sharded archive's index).
    ``format``: insist on this format (FormatMismatchError otherwise).  ``verify``:
    check each sample's CRC32 on every read (True), the first time each process
    reads it ("once"), or never (False).  ``max_open_parts``: how
    many parts of a sharded archive each process keeps open at once (default:
    ``PF_MAX_OPEN_PARTS``, else from the open-file limit; see ``backends.sharded``).

    A URL (``s3://bucket/train.zip``, ``gs://...``, ``https://...``) opens a set or archive in
    object storage, read through the node-local cache of its parts (``packed_formats.storage``):
    ``cache_dir`` (default ``PF_CACHE_DIR``, else under ``$TMPDIR``), ``cache_limit`` (bytes or a
    size like "200GB"; default ``PF_CACHE_LIMIT``, else none) and ``storage_options`` (given to
    fsspec's file system; credentials otherwise come from the protocol's usual configuration).
    """
    if storage.is_remote(path):
        return storage.open_remote(
            str(path), verify=verify, cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            cache_limit=cache_limit, storage_options=storage_options, max_open_parts=max_open_parts, format=format,
        )
    return open_local(path, format, verify, max_open_parts=max_open_parts)
