"""Batches onto the training device: pinned copies ahead of use, then the transform there."""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Iterator, Optional, Tuple, Union

import torch

from .transforms import apply_transform

Batch = Tuple[torch.Tensor, torch.Tensor]  # (images, labels)
Generators = Callable[[int], torch.Generator]  # batch number -> the generator of its random transforms


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch.device with its CUDA index; ValueError when CUDA is asked for but absent."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def copy_then_transform(host: Iterator[Batch], device: torch.device, transform: Optional[Callable],
                        generators: Generators) -> Iterator[Batch]:
    """Host batches moved with a plain (blocking, unpinned) ``.to(device)``, then transformed there.

    What a device other than CUDA gets, and the benchmark's reference for what
    pinned memory and side-stream prefetch buy on CUDA.
    """
    for k, (images, labels) in enumerate(host):
        images, labels = images.to(device), labels.to(device)
        if transform is not None:
            images = apply_transform(transform, images, generators(k))
        yield images, labels


class CudaPrefetcher:
    """Copies pinned host batches to a CUDA device on a side stream, ``prefetch`` ahead, then transforms them.

    Each batch's copy is followed by an event; the consumer's stream waits on
    that event, and the device tensors are marked as used by the consumer's
    stream (record_stream) so the caching allocator never reuses them early.

    Args:
        batches: pinned host batches.
        device: the CUDA device.
        prefetch: batches copied ahead of the one in use (at least 1).
        transform: run on each batch on the device (None: none).
        seeds: batch number -> the generator of its transform.
    """

    def __init__(self, batches: Iterator[Batch], device: torch.device, prefetch: int,
                 transform: Optional[Callable] = None, seeds: Optional[Generators] = None) -> None:
        self.batches, self.device, self.prefetch = batches, device, max(1, prefetch)
        self.transform, self.seeds = transform, seeds
        self.stream = torch.cuda.Stream(device=device)
        self.queue: Deque[Tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = deque()
        self.number = 0

    def _issue(self) -> bool:
        try:
            images, labels = next(self.batches)
        except StopIteration:
            return False
        with torch.cuda.stream(self.stream):
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.queue.append((images, labels, done))
        return True

    def __iter__(self) -> "CudaPrefetcher":
        return self

    def __next__(self) -> Batch:
        while len(self.queue) < self.prefetch and self._issue():
            pass
        if not self.queue:
            raise StopIteration
        images, labels, done = self.queue.popleft()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        images.record_stream(current)
        labels.record_stream(current)
        self._issue()
        if self.transform is not None:
            generator = None if self.seeds is None else self.seeds(self.number)
            images = apply_transform(self.transform, images, generator)
        self.number += 1
        return images, labels
