"""Reference points measured in the same run: the limits each kind of archive is compared to.

- copy-bound limit (raw): gathering shuffled batches of the archive's sample
  shape from an array already in memory into preallocated batch buffers, in
  one process, the fastest of three ways (each measured; the report names the
  one taken): ``torch.index_select`` on torch's default threads, and
  ``numpy.take`` (``mode="clip"``: a ``memcpy`` per sample) in as many Python
  threads, each gathering its share of every batch or each whole batches in
  turn.  The batches go to two buffers in turn (three for a batch a thread):
  a loop holds the batch it was handed while the next is gathered, so no
  loader can use fewer.  No loader can deliver raw batches faster from one
  process without skipping the copy.  (Earlier versions gathered every batch
  into one buffer, which a batch of 12.6 MB (64 of 3x256x256) fits in the
  32 MB processor cache of the 2-core machine: 1.1-1.6x the rate into two,
  made by the cache, not the copy; the report still gives it as ``one buffer``.
  Before that, ``index_select`` alone, and a single ``numpy.take``, each of
  which made every loader look closer to the limit than it is.)
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

import itertools
import json
import statistics
import subprocess
import sys
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import image_decode

COPY_MEMORY_CAP = 1 << 30  # bytes of in-memory data for the copy-bound limit
OUT_BUFFERS = 2  # batches the copy-bound limit gathers into in turn: the one handed out, the next
DECODE_SAMPLES = 128


class CopyBound:
    """The copy-bound limit's data and buffers for one sample shape, made once: ``rates`` measures each way
    of gathering, for the reference point or for a short span beside each epoch of a loader
    (``runner.measure_one``), so that the loader and its limit meet the machine in the same state.

    Gathers random batches of ``shape`` from memory into batches a caller can hold while the next is
    gathered: ``torch.index_select``, ``numpy.take`` by threads each gathering its share of every batch,
    and ``numpy.take`` by threads each gathering whole batches in turn.  The batches go to
    ``OUT_BUFFERS`` buffers in turn, ``threads + 1`` for a batch a thread: the fewest a loader that
    gathers while its caller holds a batch can use.  ``one_buffer`` is the shared gather into one buffer
    every batch, which no loader can do: a buffer that fits in the processor's cache is written there
    (see the module's note).  Each span starts after ``warmup`` batches it does not time.
    """

    def __init__(self, shape: Sequence[int], count: int, batch_size: int, warmup: int = 0) -> None:
        self.shape, self.warmup = tuple(int(x) for x in shape), warmup
        sample_bytes = int(np.prod(self.shape))
        self.count = n = max(1, min(int(count), max(batch_size, COPY_MEMORY_CAP // sample_bytes)))
        self.rng = np.random.default_rng(0)
        self.data = torch.from_numpy(self.rng.integers(0, 256, size=(n,) + self.shape, dtype=np.uint8))
        self.batch = min(batch_size, n)
        self.threads = max(1, torch.get_num_threads())
        self.outs = [torch.zeros((self.batch,) + self.shape, dtype=torch.uint8)
                     for _ in range(max(OUT_BUFFERS, self.threads + 1))]
        self.rows = self.data.numpy().reshape(n, -1)
        self.pool = ThreadPoolExecutor(self.threads)
        self._turn = itertools.count()
        threads = f"numpy.take in {self.threads} thread(s)"
        self.ways: Dict[str, Callable[[float, int], List[float]]] = {
            "torch.index_select": lambda seconds, repeats: self._timed(self._index_select, seconds, repeats),
            f"{threads}, a share of each batch": lambda seconds, repeats: self._timed(self._shared, seconds, repeats),
            f"{threads}, a batch each": self._pipelined,
        }

    def __enter__(self) -> "CopyBound":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown()

    def rates(self, seconds: float, repeats: int = 1) -> Dict[str, List[float]]:
        """Images/s of each way, ``repeats`` spans each, the ways sharing ``seconds``."""
        return {way: measure(seconds / len(self.ways), repeats) for way, measure in self.ways.items()}

    def one_buffer(self, seconds: float, repeats: int = 1) -> List[float]:
        """Images/s of the shared gather into the same buffer every batch (not a loader's way: see the class)."""
        return self._timed(lambda chunk: self._shared(chunk, self.outs[0]), seconds, repeats)

    def _into(self) -> torch.Tensor:
        """The next of the buffers in turn."""
        return self.outs[next(self._turn) % OUT_BUFFERS]

    def _index_select(self, chunk: torch.Tensor) -> None:
        torch.index_select(self.data, 0, chunk, out=self._into()[: len(chunk)])

    def _shared(self, chunk: torch.Tensor, out: Optional[torch.Tensor] = None) -> None:
        idx, to = chunk.numpy(), (self._into() if out is None else out).numpy().reshape(self.batch, -1)
        shares = [(k * len(idx) // self.threads, (k + 1) * len(idx) // self.threads) for k in range(self.threads)]
        for done in [self.pool.submit(np.take, self.rows, idx[a:b], 0, to[a:b], "clip") for a, b in shares if b > a]:
            done.result()

    def _chunks(self) -> Iterator[torch.Tensor]:
        """Shuffled batches of sample numbers, pass after pass, endlessly."""
        while True:
            order = torch.from_numpy(self.rng.permutation(self.count))
            yield from (order[first : first + self.batch] for first in range(0, self.count, self.batch))

    def _timed(self, gather: Callable[[torch.Tensor], object], seconds: float, repeats: int) -> List[float]:
        """Images/s of ``gather(chunk)`` over shuffled batches, in ``repeats`` spans of ``seconds / repeats``,
        each after ``warmup`` batches it does not time (as a loader's epoch)."""
        rates, chunks = [], self._chunks()
        for _ in range(repeats):
            for _, chunk in zip(range(self.warmup), chunks):
                gather(chunk)
            images, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / repeats or images == 0:
                chunk = next(chunks)
                gather(chunk)
                images += len(chunk)
            rates.append(images / (time.perf_counter() - start))
        return rates

    def _pipelined(self, seconds: float, repeats: int) -> List[float]:
        """Images/s of ``numpy.take`` of shuffled batches, a whole batch a task, ``threads`` of them in
        flight, each into the buffer of the batch handed out before the last (``threads + 1`` buffers), in
        ``repeats`` spans of ``seconds / repeats``, each timed from the end of its ``warmup``-th batch."""
        outs = [out.numpy().reshape(self.batch, -1) for out in self.outs[: self.threads + 1]]
        rates, chunks, turn = [], self._chunks(), itertools.count()

        def submit() -> "Future[np.ndarray]":
            idx = next(chunks).numpy()
            return self.pool.submit(np.take, self.rows, idx, 0, outs[next(turn) % len(outs)][: len(idx)], "clip")

        for _ in range(repeats):
            pending = deque(submit() for _ in range(self.threads))
            for _ in range(self.warmup):
                pending.popleft().result()
                pending.append(submit())
            images, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / repeats or images == 0:
                images += len(pending.popleft().result())
                pending.append(submit())
            for done in pending:
                done.result()
            rates.append(images / (time.perf_counter() - start))
        return rates


class BoundBeside:
    """A ``CopyBound`` in a process of its own, measured on request beside a loader's epochs
    (``measure.time_loader``): its data (up to ``COPY_MEMORY_CAP``) and its threads are none of the
    loader's process, whose memory is measured meanwhile.  ``rates(seconds)`` gives each way's images/s
    over ``seconds`` shared between the ways, held within (``shortest``, ``longest``), after ``warmup``
    batches each (as the loader's epochs).  A plain
    subprocess (not ``multiprocessing``, which would start a resource tracker beside the loader)."""

    def __init__(self, shape: Sequence[int], count: int, batch_size: int, warmup: int, shortest: float,
                 longest: float) -> None:
        self.shortest, self.longest = shortest, max(shortest, longest)
        code = "from packed_formats.bench.references import serve_bound; serve_bound()"
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        self.pid: Optional[int] = self._process.pid
        self._ask(json.dumps({"shape": [int(x) for x in shape], "count": int(count), "batch_size": int(batch_size),
                              "warmup": int(warmup)}))

    def rates(self, seconds: float) -> Dict[str, float]:
        return self._ask(repr(min(max(seconds, self.shortest), self.longest)))

    def _ask(self, line: str) -> Dict[str, float]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the copy-bound process ended (exit status {self._process.wait()})")
        return json.loads(answer)

    def close(self) -> None:
        try:
            if self._process.stdin is not None:
                self._process.stdin.close()  # its end of input: it ends
            self._process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


def serve_bound() -> None:
    """``BoundBeside``'s process: the bound's setting on the first line of standard input, then one span of
    each way per line (its seconds), each answered with a line of JSON, until the input ends."""
    setting = json.loads(sys.stdin.readline())
    with CopyBound(setting["shape"], setting["count"], setting["batch_size"], setting["warmup"]) as bound:
        bound.rates(0.03)  # the first touch of the buffers and threads, in no span
        print(json.dumps({}), flush=True)
        for line in sys.stdin:
            rates = bound.rates(float(line))
            print(json.dumps({way: values[0] for way, values in rates.items()}), flush=True)


def fastest(rates: Dict[str, List[float]]) -> Tuple[str, float]:
    """The way whose median rate is highest, and that median."""
    best = max(rates, key=lambda way: statistics.median(rates[way]))
    return best, statistics.median(rates[best])


def copy_bound_rate(
    shape: Sequence[int], count: int, batch_size: int, seconds: float = 1.0, repeats: int = 3
) -> Dict[str, object]:
    """Images/s of gathering random batches of ``shape`` from memory (median of ``repeats``), the fastest
    way (``CopyBound``; ``ways`` gives each one's, ``one_buffer`` the rate into one buffer)."""
    with CopyBound(shape, count, batch_size) as bound:
        ways = bound.rates(seconds, repeats)
        one_buffer = bound.one_buffer(seconds / 6, repeats)
    best, images_per_s = fastest(ways)
    return {
        "name": "copy-bound",
        "shape": list(bound.shape),
        "samples_in_memory": bound.count,
        "batch_size": bound.batch,
        "processes": 1,
        "out_buffers": OUT_BUFFERS,
        "way": best,
        "ways": {way: statistics.median(rates) for way, rates in ways.items()},
        "one_buffer": statistics.median(one_buffer),
        "images_per_s": images_per_s,
        "repeats": [float(r) for r in ways[best]],
    }


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
