"""A set in object storage, read through the node-local cache: parts arrive when first read.

Opening ``s3://bucket/train.zip`` (a sharded set's index, or one archive of any format) reads
only small things: the set's index, the list of its parts with each one's size and ETag
(recorded now: a part that changes in the store later is refused by name), and the set's
sample index (labels, keys, CRC32s), which ``upload`` writes beside the parts
(``<stem>-samples.npz``, its CRC32 in the set's index).  A set without one (a single archive,
or parts uploaded by other means) is indexed by fetching each part once, through the cache.

Reading a sample needs its part: the first process on the node that needs it downloads it
into the cache (``PartCache``), checks it on arrival (the part's own index and manifest
checksums, every sample's CRC32, and its index against the set's) and moves it into place;
every other process waits for it or reads other parts.  Each process keeps a lease on the
parts it has open (at most ``max_open_parts``, 4 by default for a remote set), so no process
evicts a part another is reading.  Below the cache, each part is a local archive read by its
own backend, with every check and speed it has locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple, cast

import numpy as np

from ..backends.base import Reader
from ..backends.sharded import ShardedBackend, ShardedHandle, is_shard_index, read_shard_index
from ..errors import (
    CorruptArchiveError,
    CorruptSampleError,
    PackedFormatError,
    RemoteChangedError,
    RemoteNotFoundError,
    UnknownFormatError,
)
from ..handles import ProcessLocal
from ..index import SampleIndex
from ..manifest import ArchiveManifest
from .cache import Lease, PartCache, entry_name
from .remote import ObjectInfo, Store, ainfo, aread, atree, object_info
from .urls import basename, clean_url, join

DEFAULT_OPEN_PARTS = 4  # parts a process holds (and pins in the cache) at once, unless told otherwise
DOWNLOAD_TRIES = 3  # a download whose content fails its checksums is fetched again this many times in all


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

    url = clean_url(url)
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
    backend = RemoteSetBackend.create(local_index, url, part_format, description["parts"], cache, store,
                                      description.get("manifest"), arrays)
    reader = Reader.of_backend(backend, verify=verify, path=url)
    sharded.limit_open_parts(reader, max_open_parts)
    return reader


def stage_remote(url: str, to: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[str, bool, int]:
    """Download the set or archive at ``url`` into the directory ``to``, each part once per node and
    checked on arrival (see ``PartCache``: processes staging it at once wait for each other); return
    (the local path to open, whether this call downloaded anything, bytes of the set).

    ``to`` is a cache without a bound: a set's parts keep the cache's names, and a local index beside
    them (``<to>/<set>/<name>``) makes them one local set that reads with no network.
    """
    reader = open_remote(url, verify=False, cache_dir=to, storage_options=storage_options, max_open_parts=1)
    try:
        backend = cast(RemoteSetBackend, reader.backend)
        fetched = False
        for p in range(len(backend.remote_parts)):
            path = backend.entry_path(p)
            before = os.path.lexists(path)
            backend.fetch(p)
            fetched = fetched or not before
        nbytes = sum(part.info.size for part in backend.remote_parts)
        if len(backend.remote_parts) == 1 and backend.remote_parts[0].url == backend.url:
            return backend.entry_path(0), fetched, nbytes  # one archive: the cached copy is it
        index = {"packed_formats_shards": 1, "format": backend.part_format,
                 "parts": [{"name": os.path.basename(backend.entry_path(p)), "count": part.count}
                           for p, part in enumerate(backend.remote_parts)]}
        local = os.path.join(os.path.dirname(backend.path), f"local-{os.path.basename(backend.path)}")
        temp = f"{local}.tmp-{os.getpid()}"
        with open(temp, "w") as file:
            file.write(json.dumps(index, indent=1) + "\n")
        os.replace(temp, local)
        return local, fetched, nbytes
    finally:
        reader.close()


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
            infos = await asyncio.gather(*(ainfo(fs, f"{folder}/{n}", join(url, n)) for n in index["names"]))
            parts = [RemotePart(n, join(url, n), c, object_info(i))
                     for n, c, i in zip(index["names"], index["counts"], infos)]
        samples = spec.get("samples") if isinstance(spec, dict) else None
        if samples is not None:
            samples = dict(samples, url=join(url, str(samples["name"])))
        return {"format": index["format"], "parts": parts, "samples": samples, "manifest": spec.get("manifest")}

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


def _folder_part(url: str, files: Dict[str, ObjectInfo], count: int) -> RemotePart:
    if not files:
        raise RemoteNotFoundError(url, "no such object or folder in the store")
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


def _fetch_samples(store: Store, samples: Dict[str, Any], folder: str) -> Dict[str, np.ndarray]:
    """The set's sample index (labels, keys, CRC32s, counts), checked against its CRC32, mapped from the cache."""
    url, expected_crc, size = samples["url"], int(samples["crc32"]), int(samples["size"])
    target = os.path.join(folder, ".pf", f"samples-{expected_crc:08x}-{size}")
    if not os.path.isfile(os.path.join(target, "done")):
        data = store.read(url, 0, size)
        if zlib.crc32(data) != expected_crc:
            raise RemoteChangedError(url, "the set's sample index does not match the CRC32 its index records",
                                     hint="upload the set again, or open it again if it was being replaced")
        temp = f"{target}.tmp-{os.getpid()}"
        os.makedirs(temp, exist_ok=True)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            for name in npz.files:
                np.save(os.path.join(temp, f"{name}.npy"), npz[name], allow_pickle=False)
        open(os.path.join(temp, "done"), "w").close()
        with contextlib.suppress(OSError):
            os.replace(temp, target)
    return {name[:-4]: np.load(os.path.join(target, name), mmap_mode="r", allow_pickle=False)
            for name in os.listdir(target) if name.endswith(".npy")}


# ---- the backend ---------------------------------------------------------------------------------------
class _Held:
    """One process's parts in hand: part -> (its Reader over the cached copy, the lease that pins it)."""

    def __init__(self) -> None:
        self.parts: Dict[int, Tuple[Reader, Lease]] = {}


class RemoteSetBackend(ShardedBackend):
    """A sharded set whose parts live in a store: each part is fetched into the cache when a
    process first reads from it, and read there by its own format's backend."""

    pickles_itself = True  # its index is a map of cache files: pickled as their paths, mapped again

    @classmethod
    def create(cls, local_index: str, url: str, part_format: str, parts: List[RemotePart], cache: PartCache,
               store: Store, manifest_text: Optional[str], arrays: Optional[Dict[str, np.ndarray]]
               ) -> "RemoteSetBackend":
        if arrays is None or manifest_text is None:
            manifest, arrays = _index_by_fetching(url, part_format, parts, cache, store)
        else:
            manifest = ArchiveManifest.from_json(manifest_text, url)
        counts = [int(c) for c in arrays["counts"]]
        parts = [dataclasses.replace(p, count=c) for p, c in zip(parts, counts)]
        if len(counts) != len(parts) or sum(counts) != len(arrays["labels"]):
            raise CorruptArchiveError(url, "the set's sample index does not fit its parts")
        index = SampleIndex(labels=arrays["labels"], keys=arrays["keys"], crc32=arrays.get("crc32"))
        return cls(local_index, manifest, index, url=url, part_format=part_format, remote_parts=parts, cache=cache,
                   store=store, arrays=arrays)

    def __init__(self, path: str, manifest: ArchiveManifest, index: SampleIndex, *, url: str, part_format: str,
                 remote_parts: List[RemotePart], cache: PartCache, store: Store, arrays: Dict[str, np.ndarray]
                 ) -> None:
        super().__init__(path, manifest, index)
        self.url, self.part_format, self.remote_parts = url, part_format, remote_parts
        self.cache, self.store, self._arrays = cache, store, arrays
        self.starts = np.cumsum([0] + [p.count for p in remote_parts]).astype(np.int64)
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
        arrays = state["_arrays"]
        state["index"] = SampleIndex(labels=arrays["labels"], keys=arrays["keys"], crc32=arrays.get("crc32"))
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
        held = self._held.get()
        if p in held.parts:
            return held.parts[p][0]
        part = self.remote_parts[p]
        path = self.entry_path(p)
        lease = self.cache.acquire(path, part.info.size, functools.partial(self._fill, p), self._record(p))
        try:
            reader = self._open_part(path)
        except BaseException:
            lease.release()
            raise
        held.parts[p] = (reader, lease)
        return reader

    def _let_go(self, p: int) -> None:
        reader, lease = self._held.get().parts.pop(p, (None, None))
        if reader is not None:
            reader.close()
        if lease is not None:
            lease.release()

    def entry_path(self, p: int) -> str:
        part = self.remote_parts[p]
        return os.path.join(os.path.dirname(self.path), entry_name(part.name, part.info.etag))

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
            except (CorruptArchiveError, CorruptSampleError) as exc:
                problem = str(exc).replace(temp, part.url)
        raise CorruptArchiveError(part.url, f"every download fails its checks ({DOWNLOAD_TRIES} tries); the last: "
                                  f"{problem}", hint="the stored object is damaged: upload it again")

    def _check_arrival(self, p: int, temp: str) -> None:
        part = self.remote_parts[p]
        reader = self._open_part(temp)
        try:
            first, last = int(self.starts[p]), int(self.starts[p + 1])
            if len(reader) != last - first:
                raise RemoteChangedError(part.url, f"holds {len(reader)} samples, the set's index says {last - first}")
            ours = self.index
            for name in ("labels", "keys", "crc32"):
                mine, theirs = getattr(reader.index, name), getattr(ours, name)
                if mine is None or theirs is None:
                    continue
                if not np.array_equal(np.asarray(mine), np.asarray(theirs[first:last])):
                    raise RemoteChangedError(part.url, f"its {name} differ from the set's index: the part was "
                                                       "replaced in the store", hint="open the set again")
            _verify_every_sample(reader)
        finally:
            reader.close()


def _verify_every_sample(reader: Reader, batch: int = 256) -> None:
    """Read every sample once with its CRC32 checked (CorruptSampleError on the first that fails)."""
    checked = Reader.__new__(Reader)
    checked.__dict__.update(reader.__dict__)
    checked.verify = True
    for start in range(0, len(reader), batch):
        checked.read_many(np.arange(start, min(len(reader), start + batch)))


def _download(store: Store, part: RemotePart, temp: str) -> None:
    if part.files is None:
        store.download(part.url, temp, part.info)
        return
    os.makedirs(temp, exist_ok=True)
    items = []
    for relative, info in part.files.items():
        target = os.path.join(temp, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        items.append((f"{part.url}/{relative}", target, info))
    store.download_all(items)


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
    readers, leases, labels, keys, crcs, counts = [], [], [], [], [], []
    try:
        for part in parts:
            path = os.path.join(folder, entry_name(part.name, part.info.etag))

            def fill(temp: str, part: RemotePart = part) -> None:
                _download(store, part, temp)
                checked = Reader(temp, spec(part_format).backend, verify=False)
                try:
                    _verify_every_sample(checked)
                finally:
                    checked.close()

            leases.append(cache.acquire(path, part.info.size, fill, {"url": part.url, "etag": part.info.etag,
                                                                      "set": url}))
            reader = Reader(path, spec(part_format).backend, verify=False)
            readers.append(reader)
            labels.append(np.asarray(reader.index.labels))
            keys.append(np.asarray(reader.index.keys))
            crcs.append(None if reader.index.crc32 is None else np.asarray(reader.index.crc32))
            counts.append(len(reader))
            if len(parts) > 1:  # let each go as soon as it is indexed: the cache may be smaller than the set
                reader.close()
                leases[-1].release()
        manifest = _joined_manifest(readers) if len(parts) > 1 else readers[0].manifest
        arrays = {"labels": np.concatenate(labels), "keys": np.concatenate(keys),
                  "counts": np.asarray(counts, dtype=np.int64)}
        if all(c is not None for c in crcs):
            arrays["crc32"] = np.concatenate(crcs)  # type: ignore[arg-type]
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

