"""Reference points measured in the same run: the limits each kind of archive is compared to.

- copy-bound limit (raw): gathering shuffled batches of the archive's sample
  shape from an array already in memory into a preallocated batch buffer, in
  one process, the faster of two ways (each measured; the report names the
  one taken): ``torch.index_select`` on torch's default threads, and
  ``numpy.take`` (``mode="clip"``: a ``memcpy`` per sample) in as many Python
  threads, each gathering its share of the batch.  No loader can deliver raw
  batches faster from one process without skipping the copy.  (On a 2-core
  machine the threaded ``numpy.take`` reached 74-79k images/s of 3x256x256
  where ``index_select`` reached 57-65k; an earlier version of this limit
  took ``index_select`` alone, and one before it a single ``numpy.take``,
  each of which made every loader look closer to the limit than it is.)
- bare decode rate (encoded): decoding the archive's own bytes (the first
  ``DECODE_SAMPLES`` samples, already in memory) in a tight loop the fastest
  known way that is not ours: PyTorch's ``decode_image`` (libjpeg-turbo,
  libpng; TorchCodec's, else torchvision's: ``image_decode``, as ``decoder``
  records) and, when the loader resizes, torch's antialiased uint8 bilinear
  resize to the same square size; no container, no DataLoader, in as many
  processes as the loader it is compared with (``max(1, workers)``), started
  together.  (An earlier version decoded and resized with Pillow, as the
  loader then did: the slow resize in both made the loader look close to it.)
"""

from __future__ import annotations

import statistics
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import image_decode

COPY_MEMORY_CAP = 1 << 30  # bytes of in-memory data for the copy-bound limit
DECODE_SAMPLES = 128


def copy_bound_rate(
    shape: Sequence[int], count: int, batch_size: int, seconds: float = 1.0, repeats: int = 3
) -> Dict[str, object]:
    """Images/s of gathering random batches of ``shape`` from memory (median of ``repeats``), the faster of
    ``torch.index_select`` and threaded ``numpy.take`` (``ways`` gives both)."""
    shape = tuple(int(x) for x in shape)
    sample_bytes = int(np.prod(shape))
    n = max(1, min(int(count), max(batch_size, COPY_MEMORY_CAP // sample_bytes)))
    rng = np.random.default_rng(0)
    data = torch.from_numpy(rng.integers(0, 256, size=(n,) + shape, dtype=np.uint8))
    out = torch.zeros((min(batch_size, n),) + shape, dtype=torch.uint8)
    threads = max(1, torch.get_num_threads())
    ways = {
        "torch.index_select": _timed_gathers(lambda chunk: torch.index_select(data, 0, chunk, out=out[: len(chunk)]),
                                             n, int(out.shape[0]), rng, seconds / 2, repeats),
    }
    with ThreadPoolExecutor(threads) as pool:
        rows, into = data.numpy().reshape(n, -1), out.numpy().reshape(len(out), -1)

        def take(chunk: torch.Tensor) -> None:
            idx = chunk.numpy()
            shares = [(k * len(idx) // threads, (k + 1) * len(idx) // threads) for k in range(threads)]
            for done in [pool.submit(np.take, rows, idx[a:b], 0, into[a:b], "clip") for a, b in shares if b > a]:
                done.result()

        ways[f"numpy.take in {threads} thread(s)"] = _timed_gathers(take, n, int(out.shape[0]), rng, seconds / 2,
                                                                    repeats)
    best = max(ways, key=lambda way: statistics.median(ways[way]))
    return {
        "name": "copy-bound",
        "shape": list(shape),
        "samples_in_memory": n,
        "batch_size": int(out.shape[0]),
        "processes": 1,
        "way": best,
        "ways": {way: statistics.median(rates) for way, rates in ways.items()},
        "images_per_s": statistics.median(ways[best]),
        "repeats": [float(r) for r in ways[best]],
    }


def _timed_gathers(gather: Callable[[torch.Tensor], object], n: int, batch: int, rng: np.random.Generator,
                   seconds: float, repeats: int) -> List[float]:
    """Images/s of ``gather(chunk)`` over shuffled batches of ``n`` samples, in ``repeats`` spans of
    ``seconds / repeats``."""
    rates = []
    for _ in range(repeats):
        images, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / repeats or images == 0:
            order = torch.from_numpy(rng.permutation(n))
            for first in range(0, n, batch):
                chunk = order[first : first + batch]
                gather(chunk)
                images += len(chunk)
        rates.append(images / (time.perf_counter() - start))
    return rates


def decode_to(blob: bytes, size: Optional[int]) -> torch.Tensor:
    """CxHxW RGB pixels of ``blob`` by PyTorch's decoder (``image_decode``), resized by torch to ``size`` x
    ``size`` when given."""
    import torch.nn.functional as F

    image = image_decode.decode([torch.frombuffer(bytearray(blob), dtype=torch.uint8)])[0]
    if size is not None and tuple(image.shape[1:]) != (size, size):
        batch = image.unsqueeze(0).contiguous(memory_format=torch.channels_last)
        image = F.interpolate(batch, size=(size, size), mode="bilinear", antialias=True)[0]
    return image


def _decode_worker(blobs: List[bytes], size: Optional[int], seconds: float, barrier, results) -> None:
    barrier.wait()
    results.put(_decode_loop(blobs, size, seconds))


def _decode_loop(blobs: List[bytes], size: Optional[int], seconds: float) -> Tuple[int, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per process, as a DataLoader worker runs
    try:
        images, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or images == 0:
            for blob in blobs:
                decode_to(blob, size)
                images += 1
        return images, time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def bare_decode_rate(
    blobs: List[bytes], processes: int, context: str, seconds: float = 1.0, size: Optional[int] = None
) -> Dict[str, object]:
    """Images/s of decoding ``blobs`` in a loop in ``processes`` processes started together (summed)."""
    import multiprocessing

    if processes <= 1:
        results = [_decode_loop(blobs, size, seconds)]
    else:
        ctx = multiprocessing.get_context(context)
        barrier, queue = ctx.Barrier(processes), ctx.Queue()
        workers = [
            # every concrete context has Process; typeshed's BaseContext, which get_context(str) returns, does not
            ctx.Process(  # type: ignore[attr-defined]
                target=_decode_worker, args=(blobs, size, seconds, barrier, queue)
            )
            for _ in range(processes)
        ]
        for w in workers:
            w.start()
        results = [queue.get(timeout=120 + 10 * seconds) for _ in workers]
        for w in workers:
            w.join()
    return {
        "name": "bare-decode",
        "decoder": image_decode.describe(),
        "processes": max(1, processes),
        "decode_size": size,
        "samples": len(blobs),
        "mean_bytes": float(np.mean([len(b) for b in blobs])) if blobs else 0.0,
        "images_per_s": float(sum(n / s for n, s in results)),
        "per_process": [float(n / s) for n, s in results],
    }


def decode_sample(reader) -> Tuple[List[bytes], str]:
    """DECODE_SAMPLES stored byte strings spread evenly over an encoded reader, and a fingerprint of them.

    Spread, not the first ones: an archive is sorted by class and file name, and
    its first images need not be typical in size (here they decoded ~1.5x faster).
    """
    count = min(len(reader), DECODE_SAMPLES)
    picks = np.linspace(0, len(reader) - 1, count).round().astype(np.int64) if count else []
    blobs = [reader.read_bytes(int(i)) for i in picks]
    fingerprint = 0
    for blob in blobs:
        fingerprint = zlib.crc32(blob, fingerprint)
    return blobs, f"{len(blobs)}:{fingerprint:08x}"
