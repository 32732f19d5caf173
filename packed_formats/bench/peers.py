"""Streaming peers (litdata, mosaic streaming) read from the same S3 server, for side-by-side figures.

This module runs in a SEPARATE virtual environment that holds the peers (they pin their own
numpy, boto3 and friends, which must not leak into the library's environment)::

    python3 -m venv peers-venv
    peers-venv/bin/pip install torch torchvision litdata mosaicml-streaming 'moto[server]' s3fs
    peers-venv/bin/python -m moto.server -H 127.0.0.1 -p 5000 &
    PYTHONSAFEPATH=1 peers-venv/bin/python packed_formats/bench/peers.py --peer litdata \\
        --images PHOTOS --remote s3://peers-bench/litdata --endpoint http://127.0.0.1:5000 \\
        --cache-fraction 0.25 --epochs 2 --batch-size 64 --workers 2 --json litdata.json

(``tools/bench_peers.sh`` does all of that, for both peers.)  Run it by path as above, or with
``python -m packed_formats.bench.peers`` where the package's own requirements are installed too;
``PYTHONSAFEPATH=1`` keeps this folder's modules off ``sys.path``.  From the library's environment,
``run_peer(python, ...)`` runs it in a child process and returns the report.  At top level the
module imports only the standard library and torch; each peer (and torchvision, boto3) is
imported inside the function that uses it.

One run, for one peer:

1. writes the JPEG files under ``--images`` (``DIR/<class>/<file>.jpg``, labels are the sorted
   class folder names) into the peer's format unchanged (bytes as they are: litdata
   ``optimize``, mosaic ``MDSWriter``) in a local folder (``write_s``), then uploads that folder
   to ``--remote`` with boto3 (``upload_s``; the same uploader for every peer);
2. puts a ``CountingProxy`` in front of ``--endpoint`` and points the peer's reader at it, so
   every byte the peer downloads is counted, whatever the peer's own reporting;
3. streams the set back through the peer's reader with a cache limit (``--cache-bytes``, or
   ``--cache-fraction`` of the uploaded set) in a fresh cache folder, ``--epochs`` times, with a
   DataLoader of ``--workers`` processes: each JPEG decoded to a uint8 tensor by
   ``torchvision.io.decode_jpeg`` and resized to ``--size`` x ``--size`` in the workers, batches
   stacked (torchvision is imported before the workers start, for every peer alike); shards are
   1/128 of the set by default and mosaic is tuned for a cache smaller than the set
   (``_mosaic_options``: with its defaults it thrashes or fails);
4. reports, per epoch: seconds, images/s, samples seen, time to the first batch, bytes and
   requests downloaded, those bytes over the uploaded set's size, and the peak size of the
   cache folder (sampled), as JSON.

The first epoch starts with an empty cache (cold); later ones reuse what the peer kept.  A peer
that fails (they do, with some cache limits) gives ``{"peer": ..., "error": ...}`` and exit status 1.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import torch
from torch.utils.data import DataLoader, IterableDataset

PEERS = ("litdata", "mosaic", "packed_formats")
IMAGE_SUFFIXES = (".jpg", ".jpeg")
# Hop-by-hop headers (RFC 9110 7.6.1) are not forwarded; Expect is answered by the proxy itself.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "expect", "content-length"}


# --- counting proxy --------------------------------------------------------------------------------

class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    """Forwards one request to the upstream endpoint and streams the answer back, counting it."""

    protocol_version = "HTTP/1.1"
    server: "_ProxyServer"

    def do_GET(self) -> None:
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        response = self.server.request(self.command, self.path, body, headers)
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP:
                self.send_header(key, value)
        sent = 0
        if self.command == "HEAD":
            self.send_header("Content-Length", response.getheader("Content-Length", "0"))
            self.end_headers()
            response.read()
        elif response.getheader("Content-Length") is not None:
            self.send_header("Content-Length", response.getheader("Content-Length", "0"))
            self.end_headers()
            while True:
                block = response.read(1 << 20)
                if not block:
                    break
                self.wfile.write(block)
                sent += len(block)
        else:
            data = response.read()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            sent = len(data)
        self.server.count(self.command, sent)


class _ProxyServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: Tuple[str, int], upstream: str) -> None:
        super().__init__(address, _ProxyHandler)
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the counting proxy forwards to a plain http:// endpoint, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.totals: Dict[str, List[int]] = {}

    def request(self, method: str, path: str, body: Optional[bytes],
                headers: Dict[str, str]) -> http.client.HTTPResponse:
        """Send one request upstream on this thread's connection (reconnecting once if it went stale)."""
        for attempt in (1, 2):
            connection = getattr(self.local, "connection", None)
            if connection is None:
                connection = self.local.connection = http.client.HTTPConnection(*self.upstream, timeout=300)
            try:
                connection.request(method, path, body=body, headers=headers)
                return connection.getresponse()
            except (OSError, http.client.HTTPException):
                connection.close()
                self.local.connection = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A reader that hangs up mid-answer (a worker shutting down) is no error of the proxy's."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def count(self, method: str, sent: int) -> None:
        with self.lock:
            total = self.totals.setdefault(method, [0, 0])
            total[0] += sent
            total[1] += 1


class CountingProxy:
    """An HTTP reverse proxy in front of an S3 endpoint that counts the bytes it hands out.

    ``with CountingProxy("http://127.0.0.1:5000") as proxy:`` point readers at ``proxy.url``;
    ``proxy.downloaded()`` is (bytes, requests) of GET answers so far, so the difference over an
    epoch is what the reader downloaded in it.  Requests are forwarded unchanged (Host included, so
    signatures stay valid), in a thread per connection of the calling process.
    """

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _ProxyServer((host, port), upstream)
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def downloaded(self) -> Tuple[int, int]:
        """Bytes and requests of GET answers so far."""
        with self._server.lock:
            sent, requests = self._server.totals.get("GET", [0, 0])
            return sent, requests

    def __enter__(self) -> "CountingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- what every peer shares -------------------------------------------------------------------------

def list_images(root: str) -> Tuple[List[Tuple[str, int]], List[str]]:
    """(path, label) of every JPEG under ``root/<class>/``, in a fixed order, and the class names."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    items = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for file in sorted(os.listdir(folder)):
            if file.lower().endswith(IMAGE_SUFFIXES):
                items.append((os.path.join(folder, file), label))
    if not items:
        raise SystemExit(f"no JPEG files under {root}/<class>/: give --images an ImageFolder tree")
    return items, classes


def read_sample(item: Tuple[str, int]) -> Dict[str, Any]:
    """The record every peer stores: the JPEG's bytes as they are and the label."""
    path, label = item
    with open(path, "rb") as file:
        return {"image": file.read(), "label": label}


def decode_resize(data: Any, size: int) -> torch.Tensor:
    """JPEG bytes to a uint8 RGB tensor of size x size: the work every reader does per image."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2.functional import resize

    image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return resize(image, [size, size], antialias=True)


class DecodeSample:
    """Picklable per-sample transform: a stored record to (uint8 image tensor, label)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, sample: Dict[str, Any]) -> Tuple[torch.Tensor, int]:
        return decode_resize(sample["image"], self.size), int(sample["label"])


class Decoded(IterableDataset):
    """Wraps an iterable peer dataset (its sharding per worker untouched) with ``DecodeSample``."""

    def __init__(self, inner: Any, size: int) -> None:
        self.inner = inner
        self.decode = DecodeSample(size)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, int]]:
        for sample in self.inner:
            yield self.decode(sample)


def collate(samples: Sequence[Tuple[torch.Tensor, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stack images and labels, the same for every peer."""
    return torch.stack([image for image, _ in samples]), torch.tensor([label for _, label in samples])


def folder_bytes(path: str) -> int:
    """Total size of the files under ``path`` (files vanishing meanwhile are skipped)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


class PeakSize:
    """Samples a folder's size in a thread while in use; ``peak`` is the largest size seen."""

    def __init__(self, path: str, every_s: float = 0.1) -> None:
        self.path, self.every_s, self.peak = path, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-size", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, folder_bytes(self.path))
            self._stop.wait(self.every_s)

    def __enter__(self) -> "PeakSize":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, folder_bytes(self.path))


def s3_client(endpoint: str) -> Any:
    import boto3  # type: ignore[import-not-found, import-untyped, unused-ignore]

    return boto3.client("s3", endpoint_url=endpoint)


def split_remote(remote: str) -> Tuple[str, str]:
    parts = urlsplit(remote)
    if parts.scheme != "s3" or not parts.netloc:
        raise SystemExit(f"--remote must be s3://bucket/prefix, not {remote!r}")
    return parts.netloc, parts.path.strip("/")


def upload_folder(local: str, remote: str, endpoint: str) -> int:
    """Upload every file under ``local`` to ``remote`` (creating the bucket); return the bytes sent."""
    bucket, prefix = split_remote(remote)
    client = s3_client(endpoint)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # botocore's ClientError: absent or not ours; create_bucket says which
        client.create_bucket(Bucket=bucket)
    sent = 0
    for folder, _, files in os.walk(local):
        for name in sorted(files):
            path = os.path.join(folder, name)
            key = "/".join(p for p in (prefix, os.path.relpath(path, local).replace(os.sep, "/")) if p)
            client.upload_file(path, bucket, key)
            sent += os.path.getsize(path)
    return sent


def shard_bytes_for(image_bytes: int) -> int:
    """Default shard size: 1/128 of the set, within 64 KiB..64 MiB, so a quarter-set cache holds ~32.

    With fewer (a quarter-set cache of 8 shards, 2 workers) litdata 0.2.76 hangs waiting for a
    chunk it never downloads, and mosaic needs a cache of at least 4 shards."""
    return max(64 << 10, min(64 << 20, image_bytes // 128))


# --- the peers ----------------------------------------------------------------------------------------

def _litdata_allow_http(*_: Any) -> None:
    """litdata downloads chunks with obstore, which refuses http:// endpoints unless told otherwise."""
    try:
        import litdata.streaming.downloader as downloader  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict) and not options.get("allow_http"):
        downloader._OBSTORE_CLIENT_OPTIONS = dict(options, allow_http=True)


def litdata_write(items: List[Tuple[str, int]], out: str, shard_bytes: int, workers: int) -> None:
    import litdata  # type: ignore[import-not-found, unused-ignore]

    start_method = multiprocessing.get_start_method(allow_none=True)
    litdata.optimize(fn=read_sample, inputs=items, output_dir=out, chunk_bytes=shard_bytes,
                     num_workers=max(1, workers), mode="overwrite")
    multiprocessing.set_start_method(start_method, force=True)  # optimize switches it to spawn for good


def litdata_loader(remote: str, cache: str, cache_bytes: int, endpoint: str, options: argparse.Namespace) -> Any:
    import litdata  # type: ignore[import-not-found, unused-ignore]

    _litdata_allow_http()
    dataset = litdata.StreamingDataset(remote, cache_dir=cache, max_cache_size=cache_bytes,
                                       storage_options={"endpoint_url": endpoint}, shuffle=options.shuffle,
                                       seed=options.seed, transform=DecodeSample(options.size))
    return litdata.StreamingDataLoader(dataset, batch_size=options.batch_size, num_workers=options.workers,
                                       collate_fn=collate, worker_init_fn=_litdata_allow_http,
                                       **_context(options))


def mosaic_write(items: List[Tuple[str, int]], out: str, shard_bytes: int, workers: int) -> None:
    from streaming import MDSWriter  # type: ignore[import-not-found, unused-ignore]

    with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit=shard_bytes) as writer:
        for item in items:
            writer.write(read_sample(item))


def mosaic_loader(remote: str, cache: str, cache_bytes: int, endpoint: str, options: argparse.Namespace) -> Any:
    from streaming import StreamingDataset  # type: ignore[import-not-found, unused-ignore]
    from streaming.base.util import clean_stale_shared_memory  # type: ignore[import-not-found, unused-ignore]

    os.environ["S3_ENDPOINT_URL"] = endpoint  # how mosaic's boto3 downloads find a non-AWS server
    clean_stale_shared_memory()
    dataset = StreamingDataset(remote=remote, local=cache, cache_limit=cache_bytes, batch_size=options.batch_size,
                               shuffle=options.shuffle, shuffle_seed=options.seed,
                               **_mosaic_options(options, cache_bytes))
    return DataLoader(Decoded(dataset, options.size), batch_size=options.batch_size,
                      num_workers=options.workers, collate_fn=collate, **_context(options))


def _mosaic_options(options: argparse.Namespace, cache_bytes: int) -> Dict[str, Any]:
    """Mosaic's tuning for a cache smaller than the set, as its documentation advises.

    By default mosaic splits the set into 64 canonical nodes per node and shuffles within blocks
    of millions of samples (all of a small set).  With a quarter-set cache and 2 workers that
    meant a shard download for nearly every sample (74x the set per epoch) or, with smaller
    shards, shards evicted while still being read (IndexError: "Relative sample index ... is not
    present").  So unless told otherwise: one canonical node (``--canonical-nodes``, 0: mosaic's
    default) and blocks sized so that each worker's block fits in a quarter of the cache
    (``--shuffle-block``, -1: mosaic's default)."""
    tuned: Dict[str, Any] = {"predownload": options.predownload or None,
                             "num_canonical_nodes": options.canonical_nodes or None}
    if options.shuffle and options.shuffle_block >= 0:
        samples_in_cache = cache_bytes // max(1, options.mean_sample_bytes)
        tuned["shuffle_block_size"] = options.shuffle_block or max(1, samples_in_cache // (4 * max(1, options.workers)))
    return tuned


def _context(options: argparse.Namespace) -> Dict[str, Any]:
    if options.workers == 0:
        return {}
    return {"multiprocessing_context": multiprocessing.get_context(options.start_method)}


def ours_write(items: List[Tuple[str, int]], out: str, shard_bytes: int, workers: int) -> None:
    """The same JPEG files, bytes unchanged, as an encoded sharded ZIP set of parts of about ``shard_bytes``."""
    import packed_formats as pf

    folder = os.path.join(out + "-images")
    for k, (path, label) in enumerate(items):  # an ImageFolder of links: the same bytes, the same labels
        target = os.path.join(folder, f"{label:05d}", f"{k:08d}{os.path.splitext(path)[1]}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.path.abspath(path), target)
    mean = sum(os.path.getsize(p) for p, _ in items) / max(1, len(items))
    os.makedirs(out)
    pf.convert(folder, os.path.join(out, "train.zip"), mode="encoded", shard_size=max(1, int(shard_bytes // mean)),
               workers=max(1, workers), quiet=True)


def ours_upload(written: str, remote: str, endpoint: str) -> int:
    """storage.upload: the parts, the set's sample index, its index last."""
    from packed_formats import storage

    bucket, _ = split_remote(remote)
    client = s3_client(endpoint)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # absent (the same as upload_folder does)
        client.create_bucket(Bucket=bucket)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    urls = storage.upload(os.path.join(written, "train.zip"), f"{remote.rstrip('/')}/train.zip")
    return sum(storage.Store().info(url).size for url in urls)


def ours_loader(remote: str, cache: str, cache_bytes: int, endpoint: str, options: argparse.Namespace) -> Any:
    """make_loader over the set's URL: JPEGs decoded and resized to ``size`` in the workers, and a window
    shuffle of half the parts the cache holds (the order that fits a bounded cache)."""
    import packed_formats as pf

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    url = f"{remote.rstrip('/')}/train.zip"
    with pf.open_archive(url, cache_dir=cache, verify=False) as reader:
        backend: Any = reader.backend
        fits = backend.parts_that_fit() if cache_bytes else None
    window = max(1, (fits or 2) // 2)
    return pf.make_loader(url, batch_size=options.batch_size, num_workers=options.workers, size=options.size,
                          shuffle="window" if options.shuffle else False, window=window, seed=options.seed,
                          cache_dir=cache, cache_limit=cache_bytes or None, **_context(options))


WRITERS = {"litdata": litdata_write, "mosaic": mosaic_write, "packed_formats": ours_write}
LOADERS = {"litdata": litdata_loader, "mosaic": mosaic_loader, "packed_formats": ours_loader}


def peer_version(peer: str) -> str:
    from importlib.metadata import version

    return version({"litdata": "litdata", "mosaic": "mosaicml-streaming", "packed_formats": "packed_formats"}[peer])


# --- one run ---------------------------------------------------------------------------------------------

def run(options: argparse.Namespace) -> Dict[str, Any]:
    """Write, upload and stream one peer's set as ``options`` say; return the report."""
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)  # a local test server takes any credentials
    items, classes = list_images(options.images)
    image_bytes = sum(os.path.getsize(path) for path, _ in items)
    shard_bytes = options.shard_bytes or shard_bytes_for(image_bytes)
    options.mean_sample_bytes = image_bytes // len(items)
    # Decode one image here: torchvision is then imported before the workers fork, not once per
    # worker and epoch (seconds on a small machine) inside the timed epochs of one peer only.
    DecodeSample(options.size)(read_sample(items[0]))
    work = tempfile.mkdtemp(prefix=f"peers-{options.peer}-", dir=options.work)
    try:
        written = os.path.join(work, "written")
        start = time.perf_counter()
        WRITERS[options.peer](items, written, shard_bytes, options.workers)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        upload = ours_upload if options.peer == "packed_formats" else upload_folder
        remote_bytes = upload(written, options.remote, options.endpoint)
        upload_s = time.perf_counter() - start
        cache_bytes = options.cache_bytes or int(remote_bytes * options.cache_fraction)
        cache = os.path.join(work, "cache")
        os.makedirs(cache)
        epochs = []
        with CountingProxy(options.endpoint) as proxy:
            os.environ["AWS_ENDPOINT_URL"] = proxy.url
            loader = LOADERS[options.peer](options.remote, cache, cache_bytes, proxy.url, options)
            for epoch in range(1, options.epochs + 1):
                epochs.append(_epoch(epoch, loader, proxy, cache, remote_bytes))
                print(f"{options.peer} epoch {epoch}: " + ", ".join(f"{k} {v}" for k, v in epochs[-1].items()),
                      file=sys.stderr, flush=True)
            del loader
    finally:
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "peer": options.peer, "peer_version": peer_version(options.peer), "torch": torch.__version__,
        "python": sys.version.split()[0], "images": len(items), "classes": len(classes),
        "image_bytes": image_bytes, "remote": options.remote, "remote_bytes": remote_bytes,
        "shard_bytes": shard_bytes, "cache_bytes": cache_bytes, "write_s": round(write_s, 3),
        "upload_s": round(upload_s, 3), "batch_size": options.batch_size, "workers": options.workers,
        "start_method": options.start_method, "shuffle": options.shuffle, "size": options.size,
        "peer_options": _mosaic_options(options, cache_bytes) if options.peer == "mosaic" else {},
        "epochs": epochs,
    }


def _epoch(epoch: int, loader: Any, proxy: CountingProxy, cache: str, remote_bytes: int) -> Dict[str, Any]:
    bytes_before, requests_before = proxy.downloaded()
    samples, first_batch_s = 0, None
    with PeakSize(cache) as peak:
        start = time.perf_counter()
        for _, labels in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - start
            samples += int(labels.numel())
        seconds = time.perf_counter() - start
    downloaded, requests = (now - before for now, before in zip(proxy.downloaded(), (bytes_before, requests_before)))
    return {
        "epoch": epoch, "seconds": round(seconds, 3), "images_per_s": round(samples / seconds, 1) if seconds else None,
        "samples": samples, "first_batch_s": None if first_batch_s is None else round(first_batch_s, 3),
        "downloaded_bytes": downloaded, "requests": requests,
        "downloaded_over_set": round(downloaded / remote_bytes, 3) if remote_bytes else None,
        "cache_peak_bytes": peak.peak,
    }


# --- from the library's environment ------------------------------------------------------------------------

def run_peer(python: str, peer: str, images: str, remote: str, endpoint: str, *, cache_bytes: int = 0,
             cache_fraction: float = 0.25, epochs: int = 2, batch_size: int = 64, workers: int = 2,
             extra: Sequence[str] = (), timeout: Optional[float] = None) -> Dict[str, Any]:
    """Run one peer with ``python`` (the peers' environment) in a child process; return its report
    (with an ``error`` entry where the peer failed)."""
    with tempfile.TemporaryDirectory(prefix="peers-") as folder:
        out = os.path.join(folder, "report.json")
        command = [python, os.path.abspath(__file__), "--peer", peer, "--images", images, "--remote", remote,
                   "--endpoint", endpoint, "--cache-bytes", str(cache_bytes), "--cache-fraction", str(cache_fraction),
                   "--epochs", str(epochs), "--batch-size", str(batch_size), "--workers", str(workers),
                   "--json", out, *extra]
        done = subprocess.run(command, timeout=timeout, env=dict(os.environ, PYTHONSAFEPATH="1"))
        if not os.path.exists(out):
            raise RuntimeError(f"{peer} run ended with status {done.returncode} and no report: {' '.join(command)}")
        with open(out) as file:
            report: Dict[str, Any] = json.load(file)
        return report


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Stream a JPEG ImageFolder through a peer's S3 reader and time it.")
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument("--images", required=True, help="ImageFolder tree: DIR/<class>/<file>.jpg")
    parser.add_argument("--remote", required=True, help="s3://bucket/prefix to write the peer's set to")
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL", ""),
                        help="the S3 server's http:// URL (default: $AWS_ENDPOINT_URL)")
    parser.add_argument("--cache-bytes", type=int, default=0, help="cache limit in bytes (0: use --cache-fraction)")
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="cache limit over the uploaded set's size")
    parser.add_argument("--shard-bytes", type=int, default=0, help="shard / chunk size (0: 1/128 of the set)")
    parser.add_argument("--predownload", type=int, default=0,
                        help="mosaic: samples each worker downloads ahead (0: mosaic's default, 8 batches)")
    parser.add_argument("--shuffle-block", type=int, default=0,
                        help="mosaic: samples per shuffle block (0: a quarter of the cache per worker, -1: mosaic's)")
    parser.add_argument("--canonical-nodes", type=int, default=1,
                        help="mosaic: num_canonical_nodes (0: mosaic's default, 64 per node)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=224, help="images are resized to size x size")
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-method", default="fork", choices=("fork", "spawn", "forkserver"))
    parser.add_argument("--work", default=None, help="folder for the written set and the cache (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the written set and the cache")
    parser.add_argument("--json", default=None, help="write the report here (default: print it)")
    options = parser.parse_args(argv)
    if not options.endpoint:
        parser.error("give --endpoint (or set AWS_ENDPOINT_URL)")
    return options


def main(argv: Optional[Sequence[str]] = None) -> int:
    options = parse_args(argv)
    try:
        report = run(options)
    except Exception as error:  # a peer failing is a result: say so in the report
        report = {"peer": options.peer, "error": f"{type(error).__name__}: {error}"}
    text = json.dumps(report, indent=2)
    if options.json:
        with open(options.json, "w") as file:
            file.write(text + "\n")
    else:
        print(text)
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
