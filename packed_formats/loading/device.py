"""Batches onto the training device: pinned copies ahead of use, then the transform there."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Deque, Iterator, Optional, Tuple, Union

import torch

from ..transforms import apply_with_labels

Batch = Tuple[torch.Tensor, torch.Tensor]  # (images, labels)
Generators = Callable[[int], torch.Generator]  # batch number -> the generator of its random transforms
# a host batch's images -> (its images on the device, the generator its transform continues, or None)
Decoder = Callable[[Any, torch.device], Tuple[torch.Tensor, Optional[torch.Generator]]]


def to_device(images: Any, device: torch.device, decoder: Optional[Decoder], non_blocking: bool = True
              ) -> Tuple[torch.Tensor, Optional[torch.Generator]]:
    """A host batch's images on ``device``: copied (``non_blocking``: asynchronous from pinned memory),
    or decoded there by ``decoder`` (an ``EncodedBatch``: ``device_decode``)."""
    if decoder is not None:
        return decoder(images, device)
    return images.to(device, non_blocking=non_blocking), None


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch.device with its CUDA index; ValueError when CUDA is asked for but absent."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def in_memory_format(images: torch.Tensor, memory_format: Optional[torch.memory_format]) -> torch.Tensor:
    """A [B,C,H,W] batch in ``memory_format`` (None: as it is), copied on its device only when it is not.

    Host batches for a device keep the archive's channels-last layout: on a GPU
    the conversion is one fast device copy, where on the host it would cost a pass.
    """
    if memory_format is None or images.dim() != 4 or images.is_contiguous(memory_format=memory_format):
        return images
    return images.contiguous(memory_format=memory_format)


def copy_then_transform(host: Iterator[Batch], device: torch.device, transform: Optional[Callable],
                        generators: Generators,
                        memory_format: Optional[torch.memory_format] = None,
                        decoder: Optional[Decoder] = None) -> Iterator[Batch]:
    """Host batches moved with a plain (blocking, unpinned) ``.to(device)``, or decoded there by
    ``decoder``, then transformed there.

    What a device other than CUDA gets, and the benchmark's reference for what
    pinned memory and side-stream prefetch buy on CUDA.  Batches come out in
    ``memory_format`` (None: as the transform leaves them).
    """
    for k, (images, labels) in enumerate(host):
        images, generator = to_device(images, device, decoder, non_blocking=False)
        images, labels = in_memory_format(images, memory_format), labels.to(device)
        if transform is not None:
            generator = generators(k) if generator is None else generator
            images, labels = apply_with_labels(transform, images, labels, generator)
            images = in_memory_format(images, memory_format)
        yield images, labels


class CudaPrefetcher:
    """Copies pinned host batches to a CUDA device on a side stream, ``prefetch`` ahead, then transforms them.

    Each batch's copy is followed by an event; the consumer's stream waits on
    that event, and the device tensors are marked as used by the consumer's
    stream (record_stream) so the caching allocator never reuses them early.
    The host batch is let go only once its event has completed: a batch in a
    worker's slot (``slots``, registered as pinned memory) gives the slot back
    then, never while the copy may still read it.

    Args:
        batches: pinned host batches.
        device: the CUDA device.
        prefetch: batches copied ahead of the one in use (at least 1).
        transform: run on each batch on the device (None: none).
        seeds: batch number -> the generator of its transform.
        memory_format: the layout batches come out in, converted on the side stream
            after the copy (None: as copied and transformed).
        decoder: turns each batch's host images into device images on the side stream
            (``device_decode``: encoded batches decoded there), with the generator its
            transform continues; None: a copy.
    """

    def __init__(self, batches: Iterator[Batch], device: torch.device, prefetch: int,
                 transform: Optional[Callable] = None, seeds: Optional[Generators] = None,
                 memory_format: Optional[torch.memory_format] = None, decoder: Optional[Decoder] = None) -> None:
        self.batches, self.device, self.prefetch = batches, device, max(1, prefetch)
        self.transform, self.seeds, self.memory_format = transform, seeds, memory_format
        self.decoder = decoder
        self.stream = torch.cuda.Stream(device=device)
        self.queue: Deque[Tuple[torch.Tensor, torch.Tensor, torch.cuda.Event, Optional[torch.Generator]]] = deque()
        self.copying: Deque[Tuple[torch.cuda.Event, Any]] = deque()  # (copy done, its host batch) per batch
        weakref.finalize(self, _let_go, self.copying).atexit = False  # CUDA may be gone by then
        self.number = 0

    def _issue(self) -> bool:
        try:
            host = next(self.batches)
        except StopIteration:
            return False
        images, labels = host
        with torch.cuda.stream(self.stream):
            images, generator = to_device(images, self.device, self.decoder)
            images = in_memory_format(images, self.memory_format)
            labels = labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.queue.append((images, labels, done, generator))
        self.copying.append((done, host))
        return True

    def __iter__(self) -> "CudaPrefetcher":
        return self

    def __next__(self) -> Batch:
        while len(self.queue) < self.prefetch and self._issue():
            pass
        if not self.queue:
            raise StopIteration
        images, labels, done, generator = self.queue.popleft()
        while self.copying and self.copying[0][0].query():  # copies done: their host memory may go
            self.copying.popleft()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        images.record_stream(current)
        labels.record_stream(current)
        self._issue()
        if self.transform is not None:
            if generator is None and self.seeds is not None:
                generator = self.seeds(self.number)
            images, labels = apply_with_labels(self.transform, images, labels, generator)
            images = in_memory_format(images, self.memory_format)
        self.number += 1
        return images, labels


def _let_go(copying: Deque[Tuple[torch.cuda.Event, Any]]) -> None:
    """Drop the host batches of a prefetcher that goes, each once its copy has completed."""
    while copying:
        done, _ = copying[0]
        done.synchronize()
        copying.popleft()
