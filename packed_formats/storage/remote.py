"""Objects in a store, read and written through fsspec, with retries and named errors.

Every call runs on an event loop in the calling thread, taken from this process's idle ones
(``_LoopPool``), with the file system and session that loop keeps: no background thread of
fsspec's is ever started and no loop runs between calls, so nothing of ours is alive when
DataLoader workers fork, and a forked or spawned process starts from a clean slate.  Called
where a loop already runs (a Jupyter cell, an asyncio application), the call's loop runs on a
thread of its own, which ends with the call.

Transient failures (5xx, throttling, reset connections, a body cut short, timeouts) are retried
with exponential backoff and jitter; a download is fetched in ranges, each checked for its length.
A read that receives no byte for ``stall_timeout`` seconds (60 by default; the store's
``storage_options={"stall_timeout": 5}`` or the environment's ``PF_STALL_TIMEOUT``) fails that
try, and is retried like the others; so does a try still unfinished after the stall timeout once, then
once more per request it makes and per MiB it moves (``_deadline``): a request that waits on nothing that ever comes (a
connection pool, a third-party coroutine) fails and is retried instead of hanging the job.  A try that moves bytes
must also keep to a floor rate: done within ``rate_grace`` seconds (10) plus its bytes at ``min_rate`` (64 KiB/s), so
a body that drips a byte at a time, which no stall timeout sees, fails that try and is retried like a stall
(``storage_options={"min_rate": "1MiB", "rate_grace": 5}``, or ``PF_MIN_RATE`` and ``PF_RATE_GRACE``; a
``min_rate`` of 0 turns the floor off).

Requests go to the URL as given (``urls.request_url``: a presigned URL keeps its signature);
errors, logs and records name it as shown (``urls.clean_url``: no credentials).
Permanent failures raise named errors that give the URL without credentials:
``RemoteNotFoundError`` (missing), ``RemoteAccessError`` (403, credentials),
``RemoteChangedError`` (another size or ETag than the one recorded),
``RemoteUnavailableError`` (still failing after every retry).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import dataclasses
import os
import random
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple, TypeVar

from ..errors import (
    MissingDependencyError,
    RemoteAccessError,
    RemoteChangedError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from ..space import human_bytes
from .cache import parse_size
from .logs import hide_secrets_in_logs
from .urls import HTTP_SCHEMES, basename, clean_url, filesystem, http_authorization, redact, request_url

T = TypeVar("T")
CHUNK_BYTES = 8 << 20  # one ranged GET
CONCURRENT_RANGES = 4  # in flight per download
LISTING_REQUESTS = 20  # a listing's pages (a thousand keys each) counted into its deadline
ATTEMPTS = int(os.environ.get("PF_REMOTE_ATTEMPTS", "5"))  # tries of one request before RemoteUnavailableError
BACKOFF_S = 0.1  # the first retry's wait; doubled each time, up to MAX_BACKOFF_S, with jitter
MAX_BACKOFF_S = 8.0
STALL_TIMEOUT_S = 60.0  # a read that receives no byte for this long fails (one try; then retried)
MIN_RATE = 64 << 10  # bytes/s: a try that moves bytes slower than this (after RATE_GRACE_S) fails
RATE_GRACE_S = 10.0  # seconds a try has before the floor rate counts (connecting, the first byte)
_PACE_OPTIONS = ("stall_timeout", "min_rate", "rate_grace")  # ours: never given to fsspec


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What identifies one version of a stored object: its size and its ETag (or the store's equivalent)."""

    size: int
    etag: str

    def to_json(self) -> Dict[str, Any]:
        return {"size": self.size, "etag": self.etag}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ObjectInfo":
        return cls(int(data["size"]), str(data["etag"]))


def object_info(info: Dict[str, Any]) -> ObjectInfo:
    """ObjectInfo from an fsspec ``info`` dict (S3 ETag, GCS etag/generation, HTTP ETag or Last-Modified)."""
    keys = ("ETag", "etag", "generation", "md5Hash", "mtime", "Last-Modified")
    etag = next((str(info[k]) for k in keys if info.get(k)), "")
    return ObjectInfo(int(info.get("size") or 0), etag.strip('"'))


# botocore's (and google-auth's) errors for credentials that are absent or cannot be read: no retry helps
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError")


class _Transient(Exception):
    """A failure worth another try (wraps the original)."""


def _classify(exc: BaseException, url: str) -> BaseException:
    """The error to raise for ``exc`` from a request on ``url``: a named permanent one, or _Transient."""
    text = redact(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, RemoteError):
        return exc
    cause = exc.__cause__
    if isinstance(exc, FileNotFoundError) and cause is not None and type(cause).__module__.startswith("aiohttp") \
            and _http_status(cause) != 404:
        return _classify(cause, url)  # fsspec's http info says "not found" for any failure: 503, 403, a timeout
    if isinstance(exc, FileNotFoundError) and isinstance(cause, ValueError):  # the client could not make the request
        return RemoteError(url, f"the request could not be made ({type(cause).__name__})", hint="check the URL")
    if isinstance(exc, FileNotFoundError):
        return RemoteNotFoundError(url, "no such object in the store", hint="check the URL and the bucket")
    if isinstance(exc, PermissionError):
        return RemoteAccessError(url, f"the store refused access ({text})",
                                 hint="check the credentials this process has (environment, profile files)")
    if type(exc).__name__ in _NO_CREDENTIALS:
        return RemoteAccessError(url, f"no credentials for the store ({text})",
                                 hint="set the protocol's usual configuration (AWS_ACCESS_KEY_ID and "
                                      "AWS_SECRET_ACCESS_KEY, a profile) or pass storage_options")
    status = _http_status(exc)
    if status in (401, 403):
        return RemoteAccessError(url, f"the store refused access (HTTP {status})",
                                 hint="check the credentials this process has (environment, profile files)")
    if status == 404:
        return RemoteNotFoundError(url, "no such object in the store (HTTP 404)", hint="check the URL")
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return RemoteError(url, f"the store refused the request ({text})")
    if isinstance(exc, (ImportError, MissingDependencyError, TypeError, AttributeError)):
        return exc  # a bug or a missing package: no retry hides it
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
        return _Transient(f"{text} (no byte arrived within the stall timeout)")
    return _Transient(text)


def _http_status(exc: BaseException) -> Optional[int]:
    for name in ("status", "code"):  # aiohttp's status (its "code" is deprecated), urllib's code
        candidate = getattr(exc, name, None)
        if isinstance(candidate, int) and 100 <= candidate < 600:
            return candidate
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


# the stall timeout and floor rate (bytes/s, grace seconds) of the Store whose call runs (set by Store.run,
# seen by every task of the call)
_STALL_S: "contextvars.ContextVar[float]" = contextvars.ContextVar("stall_timeout", default=STALL_TIMEOUT_S)
_FLOOR: "contextvars.ContextVar[Tuple[float, float]]" = contextvars.ContextVar("floor_rate",
                                                                              default=(MIN_RATE, RATE_GRACE_S))


def _deadline(nbytes: int = 0, requests: int = 1) -> Tuple[float, str]:
    """(seconds one try may take in all, what that limit is, for the error).  The stall timeout once,
    then once more per request it makes and per MiB it moves (a link slower than a MiB a stall timeout is
    as good as stalled); a try that moves bytes, at most the rate grace plus its bytes at the floor rate
    (a body that drips never stalls).  The protocol's own stall timeouts come first; this bounds what
    they do not cover."""
    seconds = _STALL_S.get() * (1 + requests + nbytes / (1 << 20))
    why = "no answer within {:.0f} s (the stall timeout once, then per request and per MiB)"
    rate, grace = _FLOOR.get()
    if nbytes > 0 and rate > 0 and grace + nbytes / rate < seconds:
        seconds = grace + nbytes / rate
        why = (f"too slow: {human_bytes(nbytes)} not moved within {{:.1f}} s ({grace:g} s to start, then the "
               f"floor rate of {human_bytes(rate)}/s)")
    return seconds, why.format(seconds)


class _Overdue(Exception):
    """A try that outlasted its deadline (told apart from a timeout the try raised itself)."""


async def _within(coroutine: Awaitable[T], seconds: float) -> T:
    """``await coroutine``, cancelled and _Overdue after ``seconds`` (not waiting on a coroutine that
    ignores its cancellation for more than a second)."""
    task = asyncio.ensure_future(coroutine)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an error it raises later is no news
        await asyncio.wait({task}, timeout=1.0)
        raise _Overdue()
    return task.result()


async def _retrying(url: str, attempt: Callable[[], Awaitable[T]], what: str, nbytes: int = 0,
                    requests: int = 1) -> T:
    """``attempt()`` until it succeeds, a permanent error, or ATTEMPTS transient failures; a try that
    outlasts ``_deadline(nbytes, requests)`` is a transient failure."""
    last = ""
    for k in range(ATTEMPTS):
        deadline, overdue = _deadline(nbytes, requests)
        try:
            return await _within(attempt(), deadline)
        except _Overdue:
            last = overdue
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is classified
            error = _classify(exc, url)
            if not isinstance(error, _Transient):
                raise error from None
            last = str(error)
        await asyncio.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2**k) * (0.5 + random.random()))
    raise RemoteUnavailableError(url, f"{what} failed {ATTEMPTS} times; the last: {last}",
                                 hint="the store or the network is failing; the job can be resumed")


_SESSIONS: Dict[int, Any] = {}
_CONFIGURING = ("AWS_", "BOTO_", "GOOGLE_", "GCE_", "FSSPEC_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


class _PooledLoop:
    """An event loop that runs only during a call, with the file systems (and sessions) made on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.filesystems: Dict[Any, Any] = {}
        self.sessions: List[Any] = []

    def settle(self) -> None:
        """Cancel the tasks a call left on this loop (a gather's others, when one of them failed) and let
        them end (a second at most, as ``_within`` waits): none runs in a later call, and none is destroyed
        pending, with a traceback, when the process exits."""
        left = asyncio.all_tasks(self.loop)
        if not left:
            return
        for task in left:
            task.cancel()
        self.loop.run_until_complete(asyncio.wait(left, timeout=1.0))
        for task in left:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: an error it ended with is no news after the call's own

    async def _close_sessions(self) -> None:
        for session in self.sessions:
            close = getattr(session, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result

    def close(self) -> None:
        try:
            self.loop.run_until_complete(asyncio.wait_for(self._close_sessions(), 5))
        except Exception:  # noqa: BLE001 - closing at exit: a dead connection must not stop it
            pass
        self.loop.close()


class _LoopPool:
    """This process's idle event loops: a call takes one (or makes one), runs on it in its own thread,
    and gives it back, so concurrent calls (prefetch threads) each have a loop and none is kept by a
    thread that has ended.  No loop runs between calls, so no thread of ours exists then; a forked
    child starts with an empty pool (it never touches the parent's connections), and the loops'
    sessions are closed when the process exits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: List[_PooledLoop] = []
        self.every: List[_PooledLoop] = []
        self.pid = os.getpid()

    def run(self, main: Callable[[_PooledLoop], Awaitable[T]]) -> T:
        with self.lock:
            if self.pid != os.getpid():
                self.__init__()  # type: ignore[misc]
            pooled = self.idle.pop() if self.idle else None
            if pooled is None:
                pooled = _PooledLoop()
                self.every.append(pooled)
        try:
            return pooled.loop.run_until_complete(main(pooled))
        finally:
            pooled.settle()
            with self.lock:
                if self.pid == os.getpid():
                    self.idle.append(pooled)

    def close(self) -> None:
        """Close every loop's sessions and the loops (at exit)."""
        with self.lock:
            pooled, self.idle, self.every = (self.every if self.pid == os.getpid() else []), [], []
        for one in pooled:
            one.close()

    def forget(self) -> None:
        """In a forked child: the parent's loops are the parent's (their connections too)."""
        self.lock = threading.Lock()
        self.idle, self.every, self.pid = [], [], os.getpid()


_POOL = _LoopPool()
hide_secrets_in_logs()  # what fsspec, botocore, aiohttp and urllib3 log at DEBUG: requests, headers, signatures
os.register_at_fork(after_in_child=_POOL.forget)
atexit.register(_POOL.close)


def _botocore_session() -> Any:
    """This process's aiobotocore session: its clients share the service models it loaded once (a
    client of a fresh session costs a quarter of a second), and it belongs to no event loop."""
    pid = os.getpid()
    if pid not in _SESSIONS:
        try:
            from aiobotocore.session import AioSession
        except ImportError:
            raise MissingDependencyError(None, "s3:// needs s3fs (and aiobotocore)",
                                         hint="pip install '.[remote]' in packed_formats' folder") from None
        _SESSIONS.clear()
        _SESSIONS[pid] = AioSession()
    return _SESSIONS[pid]


def stall_timeout(storage_options: Optional[Dict[str, Any]] = None) -> float:
    """Seconds a read may receive no byte before it fails: ``storage_options["stall_timeout"]``, else the
    environment's ``PF_STALL_TIMEOUT``, else STALL_TIMEOUT_S (RemoteError if it is not a positive number)."""
    given = (storage_options or {}).get("stall_timeout", os.environ.get("PF_STALL_TIMEOUT", STALL_TIMEOUT_S))
    try:
        seconds = float(given)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        raise RemoteError(None, f"the stall timeout must be a positive number of seconds, not {given!r}",
                          hint='set storage_options={"stall_timeout": 60} or PF_STALL_TIMEOUT=60')
    return seconds


def floor_rate(storage_options: Optional[Dict[str, Any]] = None) -> Tuple[float, float]:
    """(bytes per second a try that moves bytes must keep to, seconds before it counts):
    ``storage_options["min_rate"]`` (bytes, or a size such as "64KiB"; 0 for no floor) and
    ``["rate_grace"]``, else the environment's ``PF_MIN_RATE`` and ``PF_RATE_GRACE``, else MIN_RATE and
    RATE_GRACE_S (RemoteError if one is not a number of the kind)."""
    options = storage_options or {}
    given_rate = options.get("min_rate", os.environ.get("PF_MIN_RATE", MIN_RATE))
    given_grace = options.get("rate_grace", os.environ.get("PF_RATE_GRACE", RATE_GRACE_S))
    try:
        rate = 0.0 if given_rate in (0, "0") else float(parse_size(given_rate, "min_rate") or 0)
    except (TypeError, ValueError):
        rate = -1.0
    try:
        grace = float(given_grace)
    except (TypeError, ValueError):
        grace = -1.0
    if not rate >= 0:
        raise RemoteError(None, f"the floor rate must be a size per second (0 for none), not {given_rate!r}",
                          hint='set storage_options={"min_rate": "64KiB"} or PF_MIN_RATE=64KiB')
    if not grace >= 0:
        raise RemoteError(None, f"the rate grace must be a number of seconds, not {given_grace!r}",
                          hint='set storage_options={"rate_grace": 10} or PF_RATE_GRACE=10')
    return rate, grace


def _with_timeouts(scheme: str, options: Dict[str, Any], seconds: float) -> Dict[str, Any]:
    """The file system's options with the stall timeout as the protocol's own connect and read
    timeouts (an option the caller gave wins)."""
    if scheme in HTTP_SCHEMES:
        try:
            import aiohttp
        except ImportError:  # fsspec's HTTP file system needs it: ``filesystem`` names the extra to install
            return options
        client = dict(options.get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds))
        return dict(options, client_kwargs=client)
    if scheme in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", seconds)
        config.setdefault("read_timeout", seconds)
        return dict(options, config_kwargs=config)
    return options


def fs_path(fs: Any, url: str) -> str:
    """The path in ``fs`` of the object at ``url`` (a shown URL or a ``RemoteURL``): what requests use."""
    return str(fs._strip_protocol(http_authorization(request_url(url))[0]))


class Store:
    """One store location's objects (URLs), with the file system options to reach it.

    A URL given to its methods is sent as ``request_url`` makes it (a ``RemoteURL`` sends the URL it
    was made from: a presigned URL keeps its signature) and named in errors as ``clean_url`` shows it.
    ``storage_options`` go to fsspec, but for ``stall_timeout`` (seconds, see ``stall_timeout``),
    ``min_rate`` and ``rate_grace`` (the floor rate, see ``floor_rate``)."""

    def __init__(self, storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.stall_timeout = stall_timeout(self.storage_options)
        self.floor_rate = floor_rate(self.storage_options)

    def run(self, url: str, body: Callable[[Any, str], Awaitable[T]]) -> T:
        """``body(fs, path)`` on an event loop of this process's idle ones (``_LoopPool``), with the file
        system (and its connections) that loop keeps for these options: a client is made once per loop,
        not per call (making one costs tens of milliseconds of CPU, more than a small part's download).
        ``path`` is the path of ``url``'s request in ``fs``."""
        request, authorization = http_authorization(request_url(url))
        scheme = request.split("://", 1)[0]
        options = {k: v for k, v in self.storage_options.items() if k not in _PACE_OPTIONS}
        if authorization is not None:  # the URL's own credentials, as the bytes it holds
            options["headers"] = dict(options.get("headers") or {}, Authorization=authorization)
        options = dict(_with_timeouts(scheme, options, self.stall_timeout), asynchronous=True,
                       skip_instance_cache=True)
        if scheme in ("s3", "s3a") and "session" not in options:
            options["session"] = _botocore_session()
        # the environment is part of what a file system was made with (endpoint, credentials, profile)
        environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CONFIGURING)))
        key = (scheme, repr(sorted(self.storage_options.items())), self.stall_timeout, environment, authorization)

        async def main(loop: "_PooledLoop") -> T:
            _STALL_S.set(self.stall_timeout)  # this call's context: its tasks (gather's) copy it
            _FLOOR.set(self.floor_rate)
            fs = loop.filesystems.get(key)
            if fs is None:
                fs, _ = filesystem(request, options)
                if hasattr(fs, "set_session"):
                    loop.sessions.append(await fs.set_session())
                loop.filesystems[key] = fs
            return await body(fs, fs._strip_protocol(request))

        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop runs in this thread
            return _POOL.run(main)
        # called from code a loop is running (a notebook cell, an asyncio application): that loop
        # cannot run ours, so ours runs on a thread of its own while this call waits for it
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="packed_formats-store") as pool:
            return pool.submit(_POOL.run, main).result()

    # ---- reading ----
    def info(self, url: str) -> ObjectInfo:
        """The object's size and ETag (RemoteNotFoundError if it does not exist)."""
        shown = clean_url(url)

        async def body(fs: Any, path: str) -> ObjectInfo:
            fs.invalidate_cache(path)  # the store's answer now, not a listing's from before
            details = await ainfo(fs, path, shown)
            if details.get("type") == "directory":
                raise RemoteNotFoundError(shown, "a directory (prefix), not an object")
            return object_info(details)

        return self.run(url, body)

    def tree(self, url: str) -> Dict[str, ObjectInfo]:
        """Every object under the prefix ``url`` (a memmap archive is a directory), by relative path."""
        shown = clean_url(url).rstrip("/")

        return self.run(url, lambda fs, path: atree(fs, path.rstrip("/"), shown))

    def is_directory(self, url: str) -> bool:
        """Whether ``url`` is a prefix holding objects rather than an object."""
        shown = clean_url(url).rstrip("/")

        async def body(fs: Any, path: str) -> bool:
            try:
                details = await ainfo(fs, path.rstrip("/"), shown)
            except RemoteNotFoundError:
                return False
            return details.get("type") == "directory"

        return self.run(url, body)

    def read(self, url: str, start: int = 0, end: Optional[int] = None) -> bytes:
        """Bytes [start, end) of the object (all of it by default), retried until complete."""
        shown = clean_url(url)

        async def body(fs: Any, path: str) -> bytes:
            stop = end
            if stop is None:
                stop = object_info(await ainfo(fs, path, shown)).size
            return await _fetch(fs, path, shown, start, stop)

        return self.run(url, body)

    def download(self, url: str, target: str, expected: ObjectInfo,
                 on_bytes: Optional[Callable[[int], None]] = None) -> None:
        """Write the object to the local file ``target`` (created), checking first that it is still
        ``expected`` (size and ETag): RemoteChangedError otherwise."""
        self.download_all([(url, target, expected)], on_bytes)

    def download_all(self, items: List[Tuple[str, str, ObjectInfo]],
                     on_bytes: Optional[Callable[[int], None]] = None) -> None:
        """``download`` of each (url, target, expected), all on one session (a folder's files)."""
        if not items:
            return

        async def body(fs: Any, _: str) -> None:
            gate = asyncio.Semaphore(CONCURRENT_RANGES)

            async def one_object(url: str, target: str, expected: ObjectInfo) -> None:
                path, shown = fs_path(fs, url), clean_url(url)
                await _expect(fs, path, shown, expected)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.ftruncate(fd, expected.size)

                    async def one_range(start: int) -> None:
                        async with gate:
                            data = await _fetch(fs, path, shown, start, min(expected.size, start + CHUNK_BYTES))
                        os.pwrite(fd, data, start)
                        if on_bytes is not None:
                            on_bytes(len(data))

                    await asyncio.gather(*(one_range(s) for s in range(0, expected.size, CHUNK_BYTES)))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                # no second HEAD: content replaced mid-download fails the part's checks on arrival
                # (its CRCs and index against the set's), and the next try's HEAD names the change

            await asyncio.gather(*(one_object(*item) for item in items))

        self.run(items[0][0], body)

    # ---- writing ----
    def upload(self, local: str, url: str) -> ObjectInfo:
        """Put the local file at ``url``; return what the store now holds there."""
        shown = clean_url(url)

        async def body(fs: Any, path: str) -> ObjectInfo:
            size = os.path.getsize(local)  # a multipart upload: a request per 50 MiB
            await _retrying(shown, lambda: fs._put_file(local, path), "uploading", nbytes=size,
                            requests=1 + size // (50 << 20))
            info = object_info(await _retrying(shown, lambda: fs._info(path), "checking the upload"))
            if info.size != size:
                raise RemoteError(shown, f"the upload holds {info.size} bytes, not the {size} sent")
            return info

        return self.run(url, body)

    def remove(self, urls: List[str]) -> None:
        """Delete the objects (those missing are ignored)."""
        for url in urls:
            shown = clean_url(url)

            async def body(fs: Any, path: str, shown: str = shown) -> None:
                try:
                    await _retrying(shown, lambda: fs._rm_file(path), "deleting")
                except RemoteNotFoundError:
                    pass

            self.run(url, body)


# ---- coroutines for a body given to Store.run (several requests on one session) ----
async def ainfo(fs: Any, path: str, url: str) -> Dict[str, Any]:
    """fsspec's info dict of the object (retried; named errors; RemoteError for an object of no known
    size, as an HTTP server that sends no Content-Length gives)."""
    details: Dict[str, Any] = await _retrying(url, lambda: fs._info(path), "asking for the object's size")
    if details.get("size") is None and details.get("type") != "directory":
        raise RemoteError(url, "the server gives no size for it (no Content-Length), so it cannot be read in ranges",
                          hint="serve it with a Content-Length (a plain static file server does)")
    return details


async def atree(fs: Any, path: str, url: str) -> Dict[str, ObjectInfo]:
    """Every object under the prefix, by path relative to it.

    Raises:
        RemoteNotFoundError: over http(s), for the folder ``url`` itself (HTTP has no listing: it is
            not an object there, and a folder there cannot be read);
        RemoteError: over http(s), for a folder beside ``url`` (a memmap set's parts).
    """
    if _is_http(fs):
        why = ("HTTP has no listing, so a folder (a memmap archive, or a memmap set's part) cannot be read "
               "over http(s)")
        hint = "serve zip, hdf5 or lmdb archives over http(s), or read memmap sets from an object store (s3://, gs://)"
        if basename(path) == basename(url):
            raise RemoteNotFoundError(url, f"no such object on the server ({why})", hint=hint)
        raise RemoteError(url, why, hint=hint)
    found = await _retrying(url, lambda: fs._find(path, detail=True), "listing the directory",
                            requests=LISTING_REQUESTS)
    prefix = path.rstrip("/") + "/"
    return {name[len(prefix):]: object_info(d) for name, d in sorted(found.items()) if name.startswith(prefix)}


def _is_http(fs: Any) -> bool:
    protocol = getattr(fs, "protocol", ())
    return any(p in HTTP_SCHEMES for p in ((protocol,) if isinstance(protocol, str) else protocol))


async def aread(fs: Any, path: str, url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of the object."""
    return await _fetch(fs, path, url, start, end)


async def _expect(fs: Any, path: str, url: str, expected: ObjectInfo) -> None:
    fs.invalidate_cache(path)  # asked of the store, not of a listing this file system keeps from before
    now = object_info(await ainfo(fs, path, url))
    if (now.size, now.etag) != (expected.size, expected.etag):
        raise RemoteChangedError(
            url, f"changed in the store since the set was opened (size {expected.size} -> {now.size}, "
                 f"ETag {expected.etag or '?'} -> {now.etag or '?'})",
            hint="open the set again to read it as it is now")


async def _fetch(fs: Any, path: str, url: str, start: int, end: int) -> bytes:
    """Bytes [start, end), retried while the store fails or sends fewer bytes than asked."""

    async def attempt() -> bytes:
        data = await fs._cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise ConnectionError(f"a body cut short: {len(data)} of {end - start} bytes at offset {start}")
        return bytes(data)

    if end <= start:
        return b""
    return await _retrying(url, attempt, f"reading bytes {start}-{end}", nbytes=end - start)


def backoff_sleep(attempt: int) -> None:
    """The wait before retry ``attempt`` (0-based) of something done outside an event loop."""
    time.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2**attempt) * (0.5 + random.random()))
