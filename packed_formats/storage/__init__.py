"""Archives in object stores (s3://, gs://, https://): the one place that knows about URLs.

``open_archive("s3://bucket/train.zip")`` (and ``PackedDataset``, ``make_loader``, ``info``,
``verify``, ``stage``) read a set in a store through a node-local cache of its parts
(``PartCache``): each part downloaded once per node, checked on arrival, evicted least
recently used within ``cache_limit`` but never while a process reads it.  ``upload`` puts a
local archive or set into a store.  fsspec is the one layer for protocols; install it with
``pip install '.[remote]'`` in the project's folder.
"""

from .cache import CACHE_DIR_VARIABLE, CACHE_LIMIT_VARIABLE, CacheOverLimitWarning, PartCache, parse_size
from .prefetch import Prefetcher
from .remote import ObjectInfo, Store
from .remote_set import (
    CacheThrashWarning,
    RemoteSetBackend,
    open_remote,
    reopen_options,
    stage_remote,
    warn_if_cache_thrashes,
    warn_if_windows_thrash,
)
from .upload import upload
from .urls import clean_url, is_remote, redact

__all__ = [
    "CACHE_DIR_VARIABLE",
    "CACHE_LIMIT_VARIABLE",
    "CacheOverLimitWarning",
    "CacheThrashWarning",
    "ObjectInfo",
    "PartCache",
    "Prefetcher",
    "RemoteSetBackend",
    "Store",
    "clean_url",
    "is_remote",
    "open_remote",
    "parse_size",
    "redact",
    "reopen_options",
    "stage_remote",
    "upload",
    "warn_if_cache_thrashes",
    "warn_if_windows_thrash",
]
