"""A set in object storage, read through the node-local cache: parts arrive when first read.

Opening ``s3://bucket/train.zip`` (a sharded set's index, or one archive of any format) reads
only small things: the set's index, the list of its parts with each one's size and ETag
(recorded now: a part that changes in the store later is refused by name), and the set's
sample index (labels, keys, CRC32s), which a sharded conversion, ``join`` and ``upload`` write
beside the parts (``<stem>-samples.npz``, its CRC32 in the set's index; ``backends.set_samples``),
so a set copied into the store by any tool has it.  A set without one (a single archive, or a set
written by an older packed_formats) is indexed by fetching each part once, through the cache.

Reading a sample needs its part: the first process on the node that needs it downloads it
into the cache (``PartCache``), checks it on arrival (the part's own index and manifest
checksums, every sample's CRC32, and its index against the set's) and moves it into place;
every other process waits for it or reads other parts.  Each process keeps a lease on the
parts it has open (at most ``max_open_parts``, 4 by default for a remote set), so no process
evicts a part another is reading.  Below the cache, each part is a local archive read by its
own backend, with every check and speed it has locally.

Everything read from the store or the cache is untrusted.  No name from it chooses a local path:
a sample index holds only its known fields (``SAMPLE_FIELDS``), a folder part's objects must be
plain relative paths (``check_relative_key``), entry names are made plain (``cache.entry_name``)
and every path goes through ``cache.confined``.  A malformed set index, sample index or manifest
is a CorruptArchiveError naming the URL and the field, and no check is skipped for a missing one.
Each part's own manifest and index are compared with the set's when it arrives and, once a
process, when it is opened from the cache; a cached part found damaged (it does not open,
disagrees, or a sample fails its CRC32) is evicted and fetched again (``RemoteSetReader``).  A
set without a sample index is indexed from its parts once per node: the index is kept in the
cache, keyed by the parts' names, sizes and ETags.  Fields of a sample are read like its image: from
its part, each value checked against the CRC32 the set's sample index holds (``field_crc32``, one
row a field, in the manifest's order), which each arriving part's own index must match.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, cast

import numpy as np

from ..backends.files import remove_path
from ..backends.reader import Reader
from ..backends.set_samples import SAMPLE_FIELDS, npz_arrays
from ..backends.sharded import (
    AGREEING_FIELDS,
    ShardedBackend,
    ShardedHandle,
    check_agreement,
    check_content,
    check_part,
    file_digest,
    index_text,
    is_shard_index,
    read_shard_index,
)
from ..errors import (
    CorruptArchiveError,
    CorruptSampleError,
    PackedFormatError,
    RemoteChangedError,
    RemoteNotFoundError,
    UnknownFormatError,
)
from ..handles import ProcessLocal
from ..index import SampleIndex, field_array
from ..manifest import ArchiveManifest
from ..tracebacks import drops_frames
from .cache import Lease, PartCache, cache_errors, confined, entry_name
from .remote import ObjectInfo, Store, ainfo, aread, atree, fs_path, object_info
from .urls import RemoteURL, basename, join

DEFAULT_OPEN_PARTS = 4  # parts a process holds (and pins in the cache) at once, unless told otherwise
DOWNLOAD_TRIES = 3  # a download whose content fails its checksums is fetched again this many times in all
REFETCHES = 2  # a cached part found damaged when read is evicted and fetched again at most this many times a read
MAX_KEY_DEPTH = 8  # folders deep an object of a folder part (memmap) may lie
MAX_SAMPLE_INDEX_BYTES = 1 << 34  # a set index may not ask for a larger sample index than this
_KEY_COMPONENT = re.compile(r"[A-Za-z0-9._-]{1,255}")


@dataclasses.dataclass(frozen=True)
class RemotePart:
    """One part of a remote set: its name, URL, sample count, and the version recorded at open."""

    name: str
    url: str
    count: int
    info: ObjectInfo
    files: Optional[Dict[str, ObjectInfo]] = None  # a folder's (memmap) objects by relative path

    def to_json(self) -> Dict[str, Any]:
        data = {"name": self.name, "url": self.url, "count": self.count, **self.info.to_json()}
        if self.files is not None:
            data["files"] = {k: v.to_json() for k, v in self.files.items()}
        return data

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "RemotePart":
        files = data.get("files")
        return cls(str(data["name"]), str(data["url"]), int(data["count"]), ObjectInfo.from_json(data),
                   None if files is None else {k: ObjectInfo.from_json(v) for k, v in files.items()})


# ---- opening -------------------------------------------------------------------------------------------
def open_remote(url: str, *, verify: Any = True, cache_dir: Optional[str] = None, cache_limit: Any = None,
                storage_options: Optional[Dict[str, Any]] = None, max_open_parts: Optional[int] = None,
                format: Optional[str] = None) -> Reader:
    """A Reader of the set or archive at ``url``, read through the node-local cache."""
    from ..backends import sharded

    backend = _remote_backend(url, cache_dir, cache_limit, storage_options, format)
    try:
        reader = RemoteSetReader.of_backend(backend, verify=verify, path=backend.url)
    except BaseException:
        backend.close()
        raise
    sharded.limit_open_parts(reader, max_open_parts)
    return reader


def _remote_backend(url: str, cache_dir: Optional[str], cache_limit: Any, storage_options: Optional[Dict[str, Any]],
                    format: Optional[str]) -> "RemoteSetBackend":
    """The backend of the set or archive at ``url``: its index, listing and sample index read, no part yet."""
    url = RemoteURL(url)  # shown without its secrets, sent with them
    store, cache = Store(storage_options), PartCache(cache_dir, cache_limit)
    folder = cache.namespace(url)
    local_index = os.path.join(folder, basename(url) or "set")
    description = _describe(url, store)
    part_format = description["format"]
    if format is not None and format not in ("sharded", part_format):
        from ..errors import FormatMismatchError

        raise FormatMismatchError(url, f"holds {part_format} archives, not {format!r}")
    arrays = None
    if description.get("samples") is not None:
        arrays = _fetch_samples(store, description["samples"], folder)
    return RemoteSetBackend.create(local_index, url, part_format, description["parts"], cache, store,
                                   description.get("manifest"), arrays, set_id=description.get("set_id"),
                                   contents=description.get("contents"), indexed=bool(description.get("indexed")))


def stage_remote(url: str, to: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[str, bool, int]:
    """Download the set or archive at ``url`` into the directory ``to``, each part once per node and
    checked on arrival (see ``PartCache``: processes staging it at once wait for each other); return
    (the local path to open, whether this call downloaded anything, bytes of the set).

    ``to`` is a cache without a bound: a set's parts keep the cache's names, and a local index beside
    them (``<to>/<set>/<name>``) makes them one local set that reads with no network.
    """
    backend = _remote_backend(url, to, None, storage_options, None)  # its parts' fields too: staged, they are read
    try:
        fetched = False
        for p in range(len(backend.remote_parts)):
            path = backend.entry_path(p)
            before = os.path.lexists(path)
            backend.fetch(p)
            fetched = fetched or not before
        nbytes = sum(part.info.size for part in backend.remote_parts)
        if not backend.indexed or (len(backend.remote_parts) == 1 and backend.remote_parts[0].url == backend.url):
            return backend.entry_path(0), fetched, nbytes  # one archive: the cached copy is it
        text = index_text(backend.part_format, [(os.path.basename(backend.entry_path(p)), part.count,
                                                 file_digest(backend.entry_path(p), backend.part_format))
                                                for p, part in enumerate(backend.remote_parts)],  # each checked
                          backend.set_id)  # None (an index of version 1): a local set that is refused by name
        local = os.path.join(os.path.dirname(backend.path), f"local-{os.path.basename(backend.path)}")
        temp = f"{local}.tmp-{os.getpid()}"
        with cache_errors(to, f"write the staged set's index {local}"):
            with open(temp, "w") as file:
                file.write(text)
            os.replace(temp, local)
        return local, fetched, nbytes
    finally:
        backend.close()


class CacheThrashWarning(UserWarning):
    """The reading order will download parts again and again: the cache is smaller than what it reads."""


def warn_if_cache_thrashes(backend: "RemoteSetBackend", shuffle: Any, window: int, batch_size: int) -> None:
    """Warn, with the cost, when a global shuffle (or a window too large) meets a cache smaller than the set."""
    import warnings

    from ..space import human_bytes

    limit, parts = backend.cache.limit, len(backend.remote_parts)
    total = sum(p.info.size for p in backend.remote_parts)
    if limit is None or limit >= total or parts <= 1 or not shuffle:
        return
    per_part, fits = total / parts, max(1, int(limit // max(1.0, total / parts)))
    if shuffle == "window":
        if 2 * window <= fits:
            return
        warnings.warn(f"{backend.url}: a window of {window} parts (two windows are read at a window's end) does "
                      f"not fit the cache of {human_bytes(limit)} ({fits} parts of about {human_bytes(per_part)}): "
                      f"parts will be fetched more than once an epoch; use window={max(1, fits // 2)} or a larger "
                      "cache_limit", CacheThrashWarning, stacklevel=3)
        return
    batches = max(1, len(backend) // batch_size)
    touched = parts * (1 - (1 - 1 / parts) ** min(batch_size, len(backend)))  # parts a random batch reads
    downloaded = batches * touched * (1 - fits / parts) * per_part
    warnings.warn(
        f"{backend.url}: a global shuffle over {human_bytes(total)} in {parts} parts with a cache of "
        f"{human_bytes(limit)} downloads about {human_bytes(downloaded)} an epoch ({downloaded / total:.1f}x the "
        f"set): most batches read parts the cache has let go. shuffle='window' with window={max(1, fits // 2)} "
        "fetches each part once an epoch", CacheThrashWarning, stacklevel=3)


def warn_if_windows_thrash(backends: Sequence["RemoteSetBackend"], window: int) -> None:
    """Warn when the sets of a mixture, each read window by window at the same time through one cache,
    need more room together than it has: two windows of each (at a window's end the next one opens)."""
    import warnings

    from ..space import human_bytes

    limit = min((b.cache.limit for b in backends if b.cache.limit is not None), default=None)
    if limit is None:
        return
    per_part = [sum(p.info.size for p in b.remote_parts) / max(1, len(b.remote_parts)) for b in backends]
    needed = sum(min(2 * window, len(b.remote_parts)) * size for b, size in zip(backends, per_part))
    if needed <= limit:
        return
    fits = max(1, int(limit // max(1.0, 2 * sum(per_part))))
    warnings.warn(f"{len(backends)} sets in object storage read together, a window of {window} parts each, need "
                  f"about {human_bytes(needed)} of cache at once (two windows of each), more than its "
                  f"{human_bytes(limit)}: parts will be fetched more than once an epoch; use window={fits} or a "
                  "larger cache_limit", CacheThrashWarning, stacklevel=3)


def reopen_options(reader: Reader) -> Dict[str, Any]:
    """What ``open_archive`` needs besides the path to open ``reader``'s archive again as it was opened:
    a remote set's cache and file system options (nothing for a local archive)."""
    backend = reader.backend
    if not isinstance(backend, RemoteSetBackend):
        return {}
    return {"cache_dir": backend.cache.directory, "cache_limit": backend.cache.limit,
            "storage_options": backend.store.storage_options}


def _describe(url: str, store: Store) -> Dict[str, Any]:
    """What the set at ``url`` is: its parts' format, each part (name, URL, count, version), its sample index.
    All on one session: a few requests, and one listing per folder part."""

    async def body(fs: Any, path: str) -> Dict[str, Any]:
        try:
            details = await ainfo(fs, path, url)
        except RemoteNotFoundError:
            details = {"type": "directory"} if await atree(fs, path, url) else {}
            if not details:
                raise
        if details.get("type") == "directory":  # one archive that is a folder (memmap)
            return {"format": "memmap", "parts": [_folder_part(url.rstrip("/"), await atree(fs, path, url), -1)]}
        info = object_info(details)
        head = await aread(fs, path, url, 0, min(info.size, 4096))
        if not is_shard_index(head):  # one archive file: a set of one part, fetched whole
            return {"format": _sniff_head(url, head, info.size), "parts": [RemotePart(basename(url), url, -1, info)]}
        text = await aread(fs, path, url, 0, info.size)
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise CorruptArchiveError(url, f"not a valid shard index: {exc}") from None
        index = _parse_index(url, text)
        folder = path.rsplit("/", 1)[0]
        if index["format"] == "memmap":
            listing = await atree(fs, folder, url)
            parts = []
            for name, count in zip(index["names"], index["counts"]):
                files = {k[len(name) + 1:]: v for k, v in listing.items() if k.startswith(name + "/")}
                parts.append(_folder_part(join(url, name), files, count))
        else:
            infos = await asyncio.gather(*(ainfo(fs, fs_path(fs, join(url, n)), join(url, n))
                                           for n in index["names"]))
            parts = [RemotePart(n, join(url, n), c, object_info(i))
                     for n, c, i in zip(index["names"], index["counts"], infos)]
        return {"format": index["format"], "parts": parts, "samples": _samples_entry(url, spec.get("samples")),
                "manifest": spec.get("manifest"), "set_id": index.get("set_id"), "contents": index.get("contents"),
                "indexed": True}

    return store.run(url, body)


def _parse_index(url: str, text: bytes) -> Dict[str, Any]:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        file.write(text)
        file.flush()
        try:
            return read_shard_index(file.name)
        except PackedFormatError as exc:
            raise CorruptArchiveError(url, exc.problem or str(exc)) from None


def _samples_entry(url: str, samples: Any) -> Optional[Dict[str, Any]]:
    """The set index's record of its sample index (name, size, CRC32) and its URL; CorruptArchiveError
    naming the field when it is not one (its name must be a plain file name beside the index)."""
    if samples is None:
        return None
    checks = {"name": lambda v: isinstance(v, str) and 0 < len(v) <= 1024 and v not in (".", "..")
              and "/" not in v and "\\" not in v,
              "size": lambda v: type(v) is int and 0 <= v <= MAX_SAMPLE_INDEX_BYTES,
              "crc32": lambda v: type(v) is int and 0 <= v < 1 << 32}
    for field, valid in checks.items():
        value = samples.get(field) if isinstance(samples, dict) else None
        if not valid(value):
            raise CorruptArchiveError(url, f"the set's index records its sample index's {field} as {value!r}, "
                                           "which is not valid", hint=REDOWNLOAD_HINT)
    return dict(samples, url=join(url, samples["name"]))


def check_relative_key(url: str, key: str) -> None:
    """CorruptArchiveError naming ``url`` and ``key`` unless the store's ``key`` (an object's path inside
    the folder ``url``) is a plain relative path: at most MAX_KEY_DEPTH components, each of
    [A-Za-z0-9._-], not "." or "..", at most 255 bytes."""
    components = key.split("/")
    if len(components) > MAX_KEY_DEPTH or not all(_KEY_COMPONENT.fullmatch(c) and c not in (".", "..")
                                                   for c in components):
        raise CorruptArchiveError(url, f"the store lists an object {key!r} in this folder: not a plain relative "
                                       f"path (up to {MAX_KEY_DEPTH} names of letters, digits, '.', '_' or '-'), "
                                       "so it is not read", hint="remove that object from the store")


def _folder_part(url: str, files: Dict[str, ObjectInfo], count: int) -> RemotePart:
    # empty "folder" objects (a key ending in "/", as some tools make) hold nothing to download
    files = {k: v for k, v in files.items() if not ((k == "" or k.endswith("/")) and v.size == 0)}
    if not files:
        raise RemoteNotFoundError(url, "no such object or folder in the store")
    for key in files:
        check_relative_key(url, key)
        components = key.split("/")
        for folder in ("/".join(components[:depth]) for depth in range(1, len(components))):
            if folder in files:  # s3 lists both; a local copy (and the store's own HEAD) cannot hold both
                raise CorruptArchiveError(url, f"the store lists both an object {folder!r} and an object {key!r} "
                                               "in this folder: a file and a folder of one name, so it is not read",
                                          hint="remove one of them from the store")
    digest = hashlib.sha1(json.dumps({k: v.to_json() for k, v in files.items()}, sort_keys=True).encode())
    total = ObjectInfo(sum(v.size for v in files.values()), digest.hexdigest())
    return RemotePart(basename(url), url, count, total, files)


def _sniff_head(url: str, head: bytes, size: int) -> str:
    """The format of one archive file in the store, from its first bytes (and its size)."""
    import tempfile

    from ..backends import sniff_format

    with tempfile.NamedTemporaryFile() as file:  # the sniffers look at the start (and the size) of a file
        file.write(head)
        file.truncate(size)
        file.flush()
        found = sniff_format(file.name)
    if found is None:
        raise UnknownFormatError(url, "not an archive this library reads")
    return found


_FIELD_DTYPES = {"labels": np.dtype(np.int64), "crc32": np.dtype(np.uint32), "counts": np.dtype(np.int64),
                 "field_crc32": np.dtype(np.uint32), "widths": np.dtype(np.int32), "heights": np.dtype(np.int32)}
REDOWNLOAD_HINT = "open the set again; if this persists, upload the set again (packed-formats upload)"


def _fetch_samples(store: Store, samples: Dict[str, Any], folder: str) -> Dict[str, np.ndarray]:
    """The set's sample index (labels, keys, CRC32s, counts), checked against its CRC32, mapped from the cache."""
    url, expected_crc, size = samples["url"], samples["crc32"], samples["size"]
    target = os.path.join(folder, ".pf", f"samples-{expected_crc:08x}-{size}")

    def fetch() -> Tuple[Dict[str, np.ndarray], Optional[str]]:
        try:
            data = store.read(url, 0, size)
        except RemoteNotFoundError:  # a copy of the set that left it out
            raise RemoteNotFoundError(
                url, "no such object in the store, but the set's index records it as the set's sample index",
                hint=f"copy every file of the set, {samples['name']} too (it lies beside the set's index where "
                     "the set was converted), or put the set there with packed-formats upload") from None
        if zlib.crc32(data) != expected_crc:
            raise RemoteChangedError(url, "the set's sample index does not match the CRC32 its index records",
                                     hint="upload the set again, or open it again if it was being replaced")
        return _npz_arrays(url, data), None

    return _cached_arrays(url, target, fetch)[0]


def _npz_arrays(url: str, data: bytes) -> Dict[str, np.ndarray]:
    """The arrays of a sample index's .npz bytes read from ``url`` (``set_samples.npz_arrays``)."""
    return npz_arrays(url, data, REDOWNLOAD_HINT)


def _cached_arrays(url: str, target: str, make: Any) -> Tuple[Dict[str, np.ndarray], Optional[str]]:
    """(arrays, manifest text) kept in the cache folder ``target`` (SAMPLE_FIELDS as .npy files, and a
    manifest), made by ``make()`` when missing; a copy that cannot be read is made again."""
    loaded = _load_arrays(target)
    if loaded is not None:
        return loaded
    arrays, manifest_text = make()
    _store_arrays(target, arrays, manifest_text)
    loaded = _load_arrays(target)
    if loaded is None:
        raise CorruptArchiveError(url, f"its index, just written to the cache at {target}, cannot be read back",
                                  hint="check the cache directory's disk")
    return loaded


def _store_arrays(target: str, arrays: Dict[str, np.ndarray], manifest_text: Optional[str]) -> None:
    """Write ``arrays`` (and the manifest) as the cache folder ``target``: whole, or nothing left behind."""
    from ..space import check_free_space
    from .cache import CACHE_DIR_VARIABLE, cache_errors, confined

    directory = os.path.dirname(os.path.dirname(os.path.dirname(target)))
    needed = sum(int(a.nbytes) + 4096 for a in arrays.values()) + 8192
    check_free_space(directory, needed, "keep a set's index in the cache",
                     hint=f"free space there, or use another cache_dir ({CACHE_DIR_VARIABLE})")
    temp = f"{target}.tmp-{os.getpid()}"
    with cache_errors(directory, f"write the set's index to {target}"):
        try:
            os.makedirs(temp, exist_ok=True)
            for name, array in arrays.items():
                assert name in SAMPLE_FIELDS, name
                np.save(confined(temp, f"{name}.npy"), array, allow_pickle=False)
            if manifest_text is not None:
                with open(confined(temp, "manifest.json"), "w") as file:
                    file.write(manifest_text)
            open(confined(temp, "done"), "w").close()
            with contextlib.suppress(OSError):  # another process may have put its own in place first
                os.replace(temp, target)
        finally:
            remove_path(temp)


def _load_arrays(target: str) -> Optional[Tuple[Dict[str, np.ndarray], Optional[str]]]:
    """The arrays (mapped) and manifest text of the cache folder ``target``; None when it is missing or
    cannot be read (then it is removed, to be made again)."""
    if not os.path.isfile(os.path.join(target, "done")):
        return None
    try:
        arrays = {name: np.load(os.path.join(target, f"{name}.npy"), mmap_mode="r", allow_pickle=False)
                  for name in SAMPLE_FIELDS if os.path.isfile(os.path.join(target, f"{name}.npy"))}
        manifest = os.path.join(target, "manifest.json")
        text = None
        if os.path.isfile(manifest):
            with open(manifest) as file:
                text = file.read()
        return arrays, text
    except (OSError, ValueError, EOFError):
        with contextlib.suppress(OSError):
            remove_path(target)
        return None


def _check_sample_arrays(url: str, arrays: Dict[str, np.ndarray], parts: List[RemotePart],
                         manifest: ArchiveManifest) -> None:
    """CorruptArchiveError naming ``url`` and the field, for a sample index that does not fit the set:
    a field missing, of another type or length, counts that do not sum to the samples or disagree with
    the set's index.  CRC32s are required unless the set's manifest says it keeps none."""
    def refuse(field: str, problem: str) -> CorruptArchiveError:
        return CorruptArchiveError(url, f"the set's sample index is not valid: field {field!r} {problem}",
                                   hint=REDOWNLOAD_HINT)

    for name in arrays:
        if name not in SAMPLE_FIELDS:
            raise refuse(name, f"is not one of {', '.join(SAMPLE_FIELDS)}")
    checked = manifest.checksum is not None
    required = ("labels", "keys", "counts") + (("crc32",) if checked else ()) + \
        (("field_crc32",) if checked and manifest.fields else ())
    for name in required:
        if name not in arrays:
            raise refuse(name, "is missing")
    if "field_crc32" in arrays and not manifest.fields:
        raise refuse("field_crc32", "is there, but the set's manifest declares no field")
    if ("widths" in arrays) != ("heights" in arrays):
        raise refuse("heights" if "widths" in arrays else "widths", "is missing (the images' sizes come in pairs)")
    for name, array in arrays.items():
        ndim = 2 if name == "field_crc32" else 1
        if not isinstance(array, np.ndarray) or array.ndim != ndim:
            raise refuse(name, f"is not a {ndim}-D array (shape {getattr(array, 'shape', None)})")
        expected = _FIELD_DTYPES.get(name)
        if (expected is not None and array.dtype != expected) or (name == "keys" and array.dtype.kind != "S"):
            raise refuse(name, f"has dtype {array.dtype}, not {expected or 'bytes'}")
    counts, total = arrays["counts"], len(arrays["labels"])
    if len(counts) != len(parts):
        raise refuse("counts", f"has {len(counts)} entries for {len(parts)} parts")
    if len(counts) and int(counts.min()) < 0:
        raise refuse("counts", "holds a negative count")
    if int(counts.sum()) != total:
        raise refuse("counts", f"sums to {int(counts.sum())}, but there are {total} labels")
    if "field_crc32" in arrays and arrays["field_crc32"].shape != (len(manifest.fields), total):
        raise refuse("field_crc32", f"has shape {arrays['field_crc32'].shape}, not ({len(manifest.fields)} fields, "
                                    f"{total} samples)")
    for part, count in zip(parts, counts):
        if part.count >= 0 and part.count != int(count):
            raise refuse("counts", f"says part {part.name} holds {int(count)} samples, the set's index {part.count}")
    for name in ("keys", "crc32", "widths", "heights"):
        if name in arrays and len(arrays[name]) != total:
            raise refuse(name, f"has {len(arrays[name])} entries for {total} samples")
    if "widths" in arrays:  # each side from 1, or both 0 (unknown), as a part's own index (Reader) has them
        w, h = arrays["widths"], arrays["heights"]
        bad = np.flatnonzero((w < 0) | (h < 0) | ((w == 0) != (h == 0)))
        if len(bad):
            raise refuse("widths", f"gives sample {int(bad[0])} the size {int(w[bad[0]])} x {int(h[bad[0]])}, "
                                   "which no image has")
    if manifest.count != total:
        raise refuse("labels", f"has {total} entries, the set's manifest says {manifest.count} samples")


def _set_manifest(url: str, text: Any) -> ArchiveManifest:
    """The set's manifest from its index (CorruptArchiveError naming ``url`` and the field if it is not one)."""
    try:
        if not isinstance(text, str):
            raise ValueError(f"a JSON {type(text).__name__}, not the manifest's text")
        manifest = ArchiveManifest.from_json(text, url)
        shape_ok = manifest.shape is None or (len(manifest.shape) == 3 and all(0 < d < 1 << 16 for d in manifest.shape))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CorruptArchiveError(url, f"the set's manifest is not valid: {exc}", hint=REDOWNLOAD_HINT) from None
    problems = [("count", manifest.count < 0), ("mode", manifest.mode not in ("raw", "encoded")),
                ("shape", not shape_ok or (manifest.mode == "raw") != (manifest.shape is not None)),
                ("classes", not all(isinstance(c, str) for c in manifest.classes))]
    for field, wrong in problems:
        if wrong:
            raise CorruptArchiveError(url, f"the set's manifest is not valid: its {field} is "
                                           f"{getattr(manifest, field)!r}", hint=REDOWNLOAD_HINT)
    return manifest


# ---- the backend ---------------------------------------------------------------------------------------
class _Held:
    """One process's parts in hand: part -> (its Reader over the cached copy, the lease that pins it)."""

    def __init__(self) -> None:
        self.parts: Dict[int, Tuple[Reader, Lease]] = {}
        self.checked: Set[int] = set()  # parts whose cached copy this process compared with the set's index


class RemoteSetBackend(ShardedBackend):
    """A sharded set whose parts live in a store: each part is fetched into the cache when a
    process first reads from it, and read there by its own format's backend."""

    pickles_itself = True  # its index is a map of cache files: pickled as their paths, mapped again

    @classmethod
    def create(cls, local_index: str, url: str, part_format: str, parts: List[RemotePart], cache: PartCache,
               store: Store, manifest_text: Optional[str], arrays: Optional[Dict[str, np.ndarray]], *,
               set_id: Optional[str] = None, contents: Optional[List[str]] = None, indexed: bool = False
               ) -> "RemoteSetBackend":
        """The backend of the set at ``url``: ``parts`` as its index lists them (of the set ``set_id`` when
        ``indexed``: a set index, not one archive, which may record each part's content digest: ``contents``),
        its manifest and sample index given or built from the parts; CorruptArchiveError naming the field
        when they do not fit each other."""
        _check_listed_once(url, parts)
        kept = None
        if arrays is None or manifest_text is None:
            manifest, arrays, kept = _index_of_parts(url, part_format, parts, cache, store)
        else:
            manifest = _set_manifest(url, manifest_text)
        _check_sample_arrays(url, arrays, parts, manifest)
        counts = [int(c) for c in arrays["counts"]]
        parts = [dataclasses.replace(p, count=c) for p, c in zip(parts, counts)]
        index = _sample_index(arrays, manifest)
        backend = cls(local_index, manifest, index, url=url, part_format=part_format, remote_parts=parts,
                      cache=cache, store=store, arrays=arrays)
        backend.set_id, backend.indexed, backend.kept_index = set_id, indexed, kept
        backend.contents = contents if indexed else None
        return backend

    def __init__(self, path: str, manifest: ArchiveManifest, index: SampleIndex, *, url: str, part_format: str,
                 remote_parts: List[RemotePart], cache: PartCache, store: Store, arrays: Dict[str, np.ndarray]
                 ) -> None:
        super().__init__(path, manifest, index)
        self.url, self.part_format, self.remote_parts = url, part_format, remote_parts
        self.cache, self.store, self._arrays = cache, store, arrays
        self.starts = np.cumsum([0] + [p.count for p in remote_parts]).astype(np.int64)
        self.set_id: Optional[str] = None  # the set's id its index names (None: a version 1 index, or one archive)
        self.indexed = False  # whether the parts come from a set's index (each then names its place in the set)
        self.contents: Optional[List[str]] = None  # each part's content digest, as the index records it (or not)
        self.kept_index: Optional[str] = None  # the cache folder of the index built from the parts, if it is one
        self._held = ProcessLocal(_Held)

    @classmethod
    def load(cls, path: str) -> "RemoteSetBackend":
        raise PackedFormatError(path, "a remote set is opened with its URL (open_archive('s3://...'))")

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = {name: _MappedArray.of(a) for name, a in self._arrays.items()}
        state["index"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state["_arrays"] = {name: m.load() for name, m in state["_arrays"].items()}
        state["index"] = _sample_index(state["_arrays"], state["manifest"])
        self.__dict__.update(state)

    def __len__(self) -> int:
        return int(self.starts[-1])

    # ---- what the sharded layer asks of its parts ----
    def open(self) -> ShardedHandle:
        return ShardedHandle()

    def files(self) -> List[str]:
        return [self.path]

    def data_file(self) -> Optional[str]:
        return None

    def parts_that_fit(self) -> Optional[int]:
        """How many parts (of the average size) the cache's bound holds (None: no bound)."""
        if self.cache.limit is None:
            return None
        average = sum(p.info.size for p in self.remote_parts) / max(1, len(self.remote_parts))
        return max(1, int(self.cache.limit // max(1.0, average)))

    def open_part_bound(self) -> int:
        """Parts each process holds at once: given, else 4, or a quarter of what a bounded cache holds
        (the workers' parts, and those fetched ahead, must fit it together)."""
        if self.max_open_parts is not None:
            return self.max_open_parts
        fits = self.parts_that_fit()
        return DEFAULT_OPEN_PARTS if fits is None else max(1, min(DEFAULT_OPEN_PARTS, fits // 4))

    @contextlib.contextmanager
    def _part(self, p: int) -> Iterator[Reader]:
        open_parts = self._open.get()
        with open_parts.lock:
            closing = open_parts.enter(p, self.open_part_bound())
        for q in closing:
            self._let_go(q)
        try:
            yield self._in_hand(p)
        finally:
            with open_parts.lock:
                open_parts.leave(p)

    def locate(self, i: int) -> Tuple[Reader, int]:
        from ..index import part_of

        p, j = part_of(self.starts, i)
        return self._in_hand(p), j

    def sample_location(self, i: int) -> Optional[Tuple[str, int]]:
        return None

    def close(self) -> None:
        if self._held.made_here():
            for q in list(self._held.get().parts):
                self._let_go(q)
        self._open.clear()

    # ---- parts in hand ----
    def _in_hand(self, p: int) -> Reader:
        """Part p's Reader over its cached copy, held.  A cached copy is untrusted like the store: the first
        time a process opens it, its own manifest and index are compared with the set's; one that cannot be
        opened or disagrees is evicted and fetched again (whose arrival check then names the problem)."""
        held = self._held.get()
        if p in held.parts:
            return held.parts[p][0]
        path = self.entry_path(p)
        for attempt in range(REFETCHES + 1):
            lease = self.pin(p)
            try:
                try:
                    reader = self._open_part(path)
                except (CorruptArchiveError, CorruptSampleError, UnknownFormatError) as exc:
                    problem: Optional[str] = str(exc)
                else:
                    problem = None if p in held.checked else self._disagreement(p, reader)
                    if problem is None:
                        held.checked.add(p)
                        held.parts[p] = (reader, lease)
                        return reader
                    reader.close()
            except BaseException:
                lease.release()
                raise
            lease.release()
            self.evict_damaged(p, str(problem), last=attempt == REFETCHES)
        raise AssertionError("unreachable: the last try raises")

    def _disagreement(self, p: int, reader: Reader) -> Optional[str]:
        """What part p's own manifest and index say otherwise than the set's index (None: they agree)."""
        first, last = int(self.starts[p]), int(self.starts[p + 1])
        if len(reader) != last - first:
            return f"it holds {len(reader)} samples, the set's index says {last - first}"
        if self.indexed:
            try:
                check_part(self.url, self.remote_parts[p].url, reader.manifest, p, self.set_id, self.part_format)
                if self.contents is not None:
                    check_content(self.url, self.remote_parts[p].url, reader.manifest, p, self.set_id,
                                  self.contents[p])
            except CorruptArchiveError as exc:
                return exc.problem or str(exc)
        mine, theirs = reader.manifest, self.manifest
        for field in AGREEING_FIELDS + ("encoding",):
            if field == "encoding" and theirs.encoding == "mixed":
                continue
            if getattr(mine, field) != getattr(theirs, field):
                return (f"its manifest's {field} is {getattr(mine, field)!r}, the set's index says "
                        f"{getattr(theirs, field)!r}")
        for name in ("labels", "keys", "crc32", "widths", "heights"):
            own, listed = getattr(reader.index, name), getattr(self.index, name)
            if listed is None and name in ("widths", "heights"):  # an older set's: its sizes are read
                continue
            if (own is None) != (listed is None):
                return (f"it has {'no' if own is None else ''} {name}, the set's sample index "
                        f"{'has' if own is None else 'has none'}").replace("  ", " ")
            if own is not None and not np.array_equal(np.asarray(own), np.asarray(listed[first:last])):
                return f"its {name} differ from the set's sample index"
        for name, listed in self.index.fields.items():  # a field's CRC32s, when the set keeps checksums
            own = reader.index.fields.get(name)
            if own is None or not np.array_equal(np.asarray(own), np.asarray(listed[first:last])):
                return f"its {name} differ from the set's sample index"
        return None

    def evict_damaged(self, p: int, problem: str, last: bool) -> None:
        """Let part p's cached copy go and evict it, to be fetched again: it failed a check (``problem``).
        CorruptArchiveError naming the part's URL and the cache entry when ``last`` (no more tries) or when
        another process holds the entry (it cannot be replaced under it)."""
        self._let_go(p)
        self._held.get().checked.discard(p)
        part, path = self.remote_parts[p], self.entry_path(p)
        if last or not self.cache.evict(path):
            why = "even after it was fetched again" if last else "and another process holds it, so it stays"
            raise CorruptArchiveError(part.url, f"its copy in the cache ({path}) fails its checks {why}: {problem}",
                                      hint="if the node's disk is sound, remove that entry when no job reads the "
                                           "set; else use another cache_dir")

    def damaged_part(self, error: PackedFormatError) -> Optional[int]:
        """The part whose cached copy an error of a read names (by the set's sample, or its entry's path)."""
        from ..index import part_of

        if error.path == self.url and error.index is not None and 0 <= error.index < len(self):
            return part_of(self.starts, error.index)[0]
        for p in list(self._held.get().parts):
            entry = self.entry_path(p)
            if error.path is not None and (error.path == entry or error.path.startswith(entry + os.sep)):
                return p
        return None

    def corrupt(self, problem: str, i: int) -> CorruptSampleError:
        """A CorruptSampleError for sample i naming the set's URL, and the part and cache entry it was read from."""
        from ..index import part_of

        p = part_of(self.starts, i)[0]
        return CorruptSampleError(self.url, f"{problem} (part {self.remote_parts[p].url}, cached at "
                                            f"{self.entry_path(p)})", index=i, key=self.index.key(i),
                                  hint="the cached copy is fetched again; if this persists, upload the set again")

    def _let_go(self, p: int) -> None:
        reader, lease = self._held.get().parts.pop(p, (None, None))
        if reader is not None:
            reader.close()
        if lease is not None:
            lease.release()

    def entry_path(self, p: int) -> str:
        part = self.remote_parts[p]
        return confined(os.path.dirname(self.path), entry_name(part.name, part.info.etag))

    def held_parts(self) -> List[int]:
        """The parts this process holds in the cache now."""
        return sorted(self._held.get().parts)

    def _record(self, p: int) -> Dict[str, Any]:
        part = self.remote_parts[p]
        return {"url": part.url, "etag": part.info.etag, "set": self.url}

    def _open_part(self, path: str) -> Reader:
        from ..backends import spec

        return Reader(path, spec(self.part_format).backend, verify=False)

    def pin(self, p: int) -> Lease:
        """A lease on part p in the cache (downloaded first if missing): what prefetching holds."""
        part = self.remote_parts[p]
        return self.cache.acquire(self.entry_path(p), part.info.size, functools.partial(self._fill, p),
                                  self._record(p))

    def fetch(self, p: int) -> None:
        """Make sure part p is in the cache (download it if not), without holding it."""
        self.pin(p).release()

    def _fill(self, p: int, temp: str) -> None:
        """Download part p to ``temp`` and check it; fetched again while its content fails its checks."""
        part, problem = self.remote_parts[p], ""
        for _ in range(DOWNLOAD_TRIES):
            _download(self.store, part, temp)
            try:
                self._check_arrival(p, temp)
                return
            except (CorruptArchiveError, CorruptSampleError, RemoteChangedError) as exc:
                if self.kept_index is not None and not os.path.isdir(self.kept_index):
                    raise  # the index kept in the cache was wrong, not the download: it was removed
                changed = _changed_since_opened(self.store, part)
                if changed is not None:  # it changed while it was downloaded: no damage, another version
                    raise changed from None
                if isinstance(exc, RemoteChangedError):
                    raise
                problem = str(exc).replace(temp, part.url)
        raise CorruptArchiveError(part.url, f"every download fails its checks ({DOWNLOAD_TRIES} tries); the last: "
                                  f"{problem}", hint="the stored object is damaged: upload it again")

    def _check_arrival(self, p: int, temp: str) -> None:
        part = self.remote_parts[p]
        reader = self._open_part(temp)
        try:
            problem = self._disagreement(p, reader)
            if problem is not None and self.kept_index is not None:  # the index kept in the cache is wrong
                remove_path(self.kept_index)
                raise CorruptArchiveError(part.url, f"{problem}: the set's index kept in the cache "
                                                    f"({self.kept_index}) does not describe it; it is removed",
                                          hint="open the set again: its index is built again from its parts")
            if problem is not None:
                raise RemoteChangedError(part.url, f"{problem}: the part or the set's index in the store is not what "
                                                   "the set was uploaded as", hint=REDOWNLOAD_HINT)
            _verify_every_sample(reader)
        finally:
            reader.close()


class RemoteSetReader(Reader):
    """The Reader of a remote set: a read that finds a cached part damaged (a sample failing its CRC32, a
    record that cannot be read) evicts that part and fetches it again, at most REFETCHES times a read;
    then CorruptArchiveError names the part's URL and its cache entry."""

    @drops_frames
    def read_bytes(self, i: int) -> bytes:
        return cast(bytes, self._refetching(Reader.read_bytes, i))

    @drops_frames
    def read(self, i: int) -> "np.ndarray | bytes":
        return cast("np.ndarray | bytes", self._refetching(Reader.read, i))

    @drops_frames
    def read_many(self, idx: Any, out: Optional[np.ndarray] = None) -> "np.ndarray | List[bytes]":
        return cast("np.ndarray | List[bytes]", self._refetching(Reader.read_many, idx, out))

    @drops_frames
    def read_many_stored(self, idx: Any, out: Optional[np.ndarray] = None) -> np.ndarray:
        return cast(np.ndarray, self._refetching(Reader.read_many_stored, idx, out))

    @drops_frames
    def read_many_planar(self, idx: Any, out: np.ndarray, rows: Optional[np.ndarray] = None) -> np.ndarray:
        return cast(np.ndarray, self._refetching(Reader.read_many_planar, idx, out, rows))

    @drops_frames
    def read_field_bytes(self, i: int, name: str) -> bytes:
        return cast(bytes, self._refetching(Reader.read_field_bytes, i, name))

    @drops_frames
    def read_field(self, i: int, name: str) -> Any:
        return self._refetching(Reader.read_field, i, name)

    def _refetching(self, method: Callable[..., Any], *args: Any) -> Any:
        backend = cast(RemoteSetBackend, self.backend)
        for attempt in range(REFETCHES + 1):
            try:
                return method(self, *args)
            except (CorruptSampleError, CorruptArchiveError) as exc:
                p = backend.damaged_part(exc)
                if p is None:
                    raise
                problem = exc.problem or str(exc)
            backend.evict_damaged(p, problem, last=attempt == REFETCHES)
        raise AssertionError("unreachable: the last try raises")


def _verify_every_sample(reader: Reader, batch: int = 256) -> None:
    """Read every sample and field value once with its CRC32 checked (CorruptSampleError on the first that
    fails)."""
    checked = Reader.__new__(Reader)
    checked.__dict__.update(reader.__dict__)
    checked.verify = True
    for start in range(0, len(reader), batch):
        checked.read_many(np.arange(start, min(len(reader), start + batch)))
        for i in range(start, min(len(reader), start + batch)):
            for spec in reader.fields:
                checked.read_field_bytes(i, spec.name)


def _sample_index(arrays: Dict[str, np.ndarray], manifest: ArchiveManifest) -> SampleIndex:
    """The set's index over its sample index's arrays (each field's CRC32s a row of ``field_crc32``)."""
    rows = arrays.get("field_crc32")
    fields = {} if rows is None else {field_array(spec.name, "crc32"): rows[k]
                                      for k, spec in enumerate(manifest.fields)}
    return SampleIndex(labels=arrays["labels"], keys=arrays["keys"], crc32=arrays.get("crc32"), fields=fields,
                       widths=arrays.get("widths"), heights=arrays.get("heights"))


def _download(store: Store, part: RemotePart, temp: str) -> None:
    if part.files is None:
        store.download(part.url, temp, part.info)
        return
    os.makedirs(temp, exist_ok=True)
    items = []
    for relative, info in part.files.items():
        check_relative_key(part.url, relative)
        try:
            target = confined(temp, relative)
        except ValueError:
            raise CorruptArchiveError(part.url, f"the store lists an object {relative!r} that would be written "
                                                "outside the part's folder, so it is not read") from None
        os.makedirs(os.path.dirname(target), exist_ok=True)
        items.append((f"{part.url}/{relative}", target, info))
    store.download_all(items)


def _changed_since_opened(store: Store, part: RemotePart) -> Optional[RemoteChangedError]:
    """RemoteChangedError naming the object of ``part`` that the store now holds in another version (or no
    longer holds) than the one recorded when the set was opened; None when each is as recorded (asked
    after a download failed its checks: content replaced during the download is a change, not damage)."""
    objects = [(part.url, part.info)] if part.files is None else \
        [(f"{part.url}/{k}", v) for k, v in sorted(part.files.items())]
    for url, expected in objects:
        try:
            now = store.info(url)
        except RemoteNotFoundError:
            return RemoteChangedError(url, "removed from the store while it was downloaded",
                                      hint="open the set again to read it as it is now")
        except PackedFormatError:
            return None  # the store cannot tell now: the download's own failure is reported
        if (now.size, now.etag) != (expected.size, expected.etag):
            return RemoteChangedError(
                url, f"changed in the store while it was downloaded (size {expected.size} -> {now.size}, ETag "
                     f"{expected.etag or '?'} -> {now.etag or '?'}): the copy mixes two versions and is not used",
                hint="open the set again to read it as it is now")
    return None


def _check_listed_once(url: str, parts: List[RemotePart]) -> None:
    """CorruptArchiveError when the set's index lists a part twice (by name or by URL)."""
    for what in ("name", "url"):
        seen: Set[str] = set()
        for part in parts:
            value = getattr(part, what)
            if value in seen:
                raise CorruptArchiveError(url, f"the set's index lists the part {value!r} twice",
                                          hint=REDOWNLOAD_HINT)
            seen.add(value)


def _index_of_parts(url: str, part_format: str, parts: List[RemotePart], cache: PartCache, store: Store
                    ) -> Tuple[ArchiveManifest, Dict[str, np.ndarray], str]:
    """The manifest and sample index of a set without one beside it, built from its parts once
    (``_index_by_fetching``) and kept in the cache, keyed by the parts' names, sizes and ETags: the next
    process that opens the set reads no part.  A kept copy is untrusted like any cached file: each part is
    compared with it when first opened (``RemoteSetBackend._in_hand``).  Returns the manifest, the arrays
    and the cache folder that keeps them."""
    listing = [part_format] + [[p.name, p.info.size, p.info.etag] for p in parts]
    digest = hashlib.sha1(json.dumps(listing).encode()).hexdigest()[:24]
    target = os.path.join(cache.namespace(url), ".pf", f"index-{digest}")

    def build() -> Tuple[Dict[str, np.ndarray], Optional[str]]:
        manifest, arrays = _index_by_fetching(url, part_format, parts, cache, store)
        return arrays, manifest.to_json()

    arrays, text = _cached_arrays(url, target, build)
    try:
        manifest = _set_manifest(url, text)
        _check_sample_arrays(url, arrays, parts, manifest)
    except CorruptArchiveError:  # the kept copy is damaged: build it again
        remove_path(target)
        arrays, text = _cached_arrays(url, target, build)
        manifest = _set_manifest(url, text)
    return manifest, arrays, target


def _index_by_fetching(url: str, part_format: str, parts: List[RemotePart], cache: PartCache, store: Store
                       ) -> Tuple[ArchiveManifest, Dict[str, np.ndarray]]:
    """The set's manifest and sample index built from the parts themselves, each fetched (and cached) once."""
    import warnings

    from ..backends import spec
    from ..backends.sharded import _joined_manifest

    if len(parts) > 1:
        warnings.warn(f"{url} has no sample index beside it: each of its {len(parts)} parts is fetched once now "
                      "to index the set (upload it with packed_formats.storage.upload to write one)", stacklevel=4)
    folder = cache.namespace(url)
    readers, leases, labels, keys, crcs, counts, field_crcs = [], [], [], [], [], [], []
    sizes: List[Optional[Tuple[np.ndarray, np.ndarray]]] = []
    try:
        for part in parts:
            path = confined(folder, entry_name(part.name, part.info.etag))

            def fill(temp: str, part: RemotePart = part) -> None:
                _download(store, part, temp)
                try:
                    checked = Reader(temp, spec(part_format).backend, verify=False)
                    try:
                        _verify_every_sample(checked)
                    finally:
                        checked.close()
                except PackedFormatError as exc:  # named by its URL, never by the temporary file
                    changed = _changed_since_opened(store, part)
                    if changed is not None:
                        raise changed from None
                    raise CorruptArchiveError(part.url, f"its download fails its checks: {exc}".replace(temp, part.url),
                                              hint="the stored object is damaged: upload it again") from None

            leases.append(cache.acquire(path, part.info.size, fill, {"url": part.url, "etag": part.info.etag,
                                                                      "set": url}))
            reader = Reader(path, spec(part_format).backend, verify=False)
            readers.append(reader)
            if len(readers) > 1:  # the set's manifest is the first part's: each other part must agree with it
                check_agreement(url, part.url, reader.manifest, readers[0].manifest, f"the first part, {parts[0].url}")
            labels.append(np.asarray(reader.index.labels))
            keys.append(np.asarray(reader.index.keys))
            crcs.append(None if reader.index.crc32 is None else np.asarray(reader.index.crc32))
            field_crcs.append(reader.index.field_crc32s([f.name for f in reader.fields]))
            widths, heights = reader.index.widths, reader.index.heights
            sizes.append(None if widths is None or heights is None else (np.asarray(widths), np.asarray(heights)))
            counts.append(len(reader))
            if len(parts) > 1:  # let each go as soon as it is indexed: the cache may be smaller than the set
                reader.close()
                leases[-1].release()
        manifest = _joined_manifest(readers) if len(parts) > 1 else readers[0].manifest
        joined_keys = np.concatenate(keys)
        arrays = {"labels": np.concatenate(labels).astype(np.int64, copy=False),
                  "keys": joined_keys.astype(f"S{max(1, joined_keys.dtype.itemsize)}", copy=False)
                  if joined_keys.dtype.kind == "S" else joined_keys,
                  "counts": np.asarray(counts, dtype=np.int64)}
        if all(c is not None for c in crcs):
            arrays["crc32"] = np.concatenate(crcs).astype(np.uint32, copy=False)  # type: ignore[arg-type]
        if all(pair is not None for pair in sizes):
            for k, name in enumerate(("widths", "heights")):
                arrays[name] = np.concatenate([pair[k] for pair in sizes if pair is not None]).astype(np.int32,
                                                                                                     copy=False)
        present = [rows for rows in field_crcs if rows is not None]
        if manifest.fields and len(present) == len(field_crcs):  # the parts agree on their fields
            arrays["field_crc32"] = np.stack([np.concatenate([np.asarray(rows[k]) for rows in present])
                                              for k in range(len(manifest.fields))]).astype(np.uint32, copy=False)
    finally:
        for reader in readers:
            reader.close()
        for lease in leases:
            lease.release()
    if len(parts) == 1:
        manifest = dataclasses.replace(manifest, format=ShardedBackend.format_name, index_crc32=())
    return manifest, arrays


@dataclasses.dataclass(frozen=True)
class _MappedArray:
    """A map of a cache file, pickled as its path (an array built in memory pickles as itself)."""

    path: Optional[str]
    array: Optional[np.ndarray]

    @classmethod
    def of(cls, array: np.ndarray) -> "_MappedArray":
        filename = getattr(array, "filename", None)
        return cls(filename, None) if filename else cls(None, np.asarray(array))

    def load(self) -> np.ndarray:
        if self.path is None:
            assert self.array is not None
            return self.array
        return np.load(self.path, mmap_mode="r", allow_pickle=False)

