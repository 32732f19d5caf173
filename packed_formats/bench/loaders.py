"""The loaders the benchmark times: the fast path, the plain Dataset path, and torchvision ImageFolder.

Every loader yields ``(images, labels)``; ``images`` is a batch tensor, or a
list of uint8 tensors when samples differ in size (pipeline ``none`` over
encoded data).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import multiprocessing
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from . import LOADERS, PIPELINES  # noqa: F401 - the choices, named here too

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def collate_list(samples: List[Tuple[Any, int]]) -> Tuple[List[Any], torch.Tensor]:
    """Keep images of different sizes as a list; labels become one int64 tensor."""
    return [s[0] for s in samples], torch.as_tensor([int(s[1]) for s in samples], dtype=torch.int64)


def torchvision_transform(pipeline: str, size: int) -> Callable:
    """torchvision's standard per-sample transforms for ImageNet-style training (PIL in)."""
    from torchvision import transforms as T

    if pipeline == "none":
        return T.PILToTensor()
    if pipeline == "val":
        return T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), T.ToTensor(), T.Normalize(MEAN, STD)])
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


def _data_loader(dataset, batch_size: int, workers: int, shuffle: bool, context: Optional[str], collate=None):
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=workers,
        collate_fn=collate,
        multiprocessing_context=context if workers else None,
    )


def imagefolder_loader(path: str, pipeline: str, size: int, batch_size: int, workers: int, shuffle: bool,
                       context: Optional[str]):
    """The baseline: torchvision.datasets.ImageFolder with its standard transforms."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(path, transform=torchvision_transform(pipeline, size))
    collate = collate_list if pipeline == "none" else None
    return _data_loader(dataset, batch_size, workers, shuffle, context, collate)


def dataset_loader(path: str, mode: str, pipeline: str, size: int, batch_size: int, workers: int, shuffle: bool,
                   context: Optional[str]):
    """PackedDataset in a plain DataLoader (batched reads via __getitems__, per-sample transforms)."""
    from ..loading.dataset import PackedDataset

    if pipeline == "none":
        dataset = PackedDataset(path, output="tensor")
        collate = None if mode == "raw" else collate_list
    else:
        dataset = PackedDataset(path, output="pil", transform=torchvision_transform(pipeline, size))
        collate = None
    return _data_loader(dataset, batch_size, workers, shuffle, context, collate)


def fast_path():
    """(make_loader, transforms module) from the library, or None where this build lacks them."""
    import packed_formats

    make_loader = getattr(packed_formats, "make_loader", None)
    try:
        transforms = importlib.import_module("packed_formats.transforms")
    except ModuleNotFoundError:
        transforms = None
    if make_loader is None or transforms is None:
        return None
    return make_loader, transforms


def accepts(function: Callable, name: str) -> bool:
    """Whether ``function`` takes keyword ``name`` (or **kwargs)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def batch_transform(transforms, pipeline: str, size: int) -> Optional[Callable]:
    """``pf.transforms.val/train(size)`` for a pipeline (None for "none")."""
    return None if pipeline == "none" else getattr(transforms, pipeline)(size)


def make_loader_loader(path: str, mode: str, pipeline: str, size: int, batch_size: int, workers: int,
                       shuffle: bool, context: Optional[str], decode_size: Optional[int] = None, seed: int = 0,
                       device: str = "cpu", decode: str = "workers", layout: str = "channels-last"):
    """``pf.make_loader`` with ``pf.transforms.val/train(size)`` (whole-batch uint8 work, crop before float);
    untransformed batches in ``layout``: "channels-last" (the archive's own; see below) or "nchw"
    (make_loader's default, contiguous [B,C,H,W]).

    Encoded archives are decoded to ``decode_size`` x ``decode_size`` so that a batch has one shape,
    except where the transform crops while decoding (train and val).
    On CUDA, batches are pinned and copied on a side stream, and transformed on the GPU;
    ``decode="device"`` decodes encoded archives there too (nvJPEG), the workers only reading bytes.
    """
    found = fast_path()
    if found is None:
        raise RuntimeError("packed_formats.make_loader is not available in this build")
    make_loader, transforms = found
    transform = batch_transform(transforms, pipeline, size)
    options = dict(batch_size=batch_size, shuffle=shuffle, num_workers=workers, device=device,
                   transform=transform, drop_last=False, seed=seed)
    if decode != "workers":
        options["decode"] = decode
    if mode == "encoded" and decode_size and pipeline == "none":
        options["size"] = decode_size  # train and val crop at decode: no resize to one size first
    if pipeline == "none" and layout == "channels-last" and accepts(make_loader, "memory_format"):
        # untransformed batches as read, [B,H,W,C] in memory, like the copy-bound limit's gather:
        # the default contiguous NCHW transposes each sample on its way into the batch
        options["memory_format"] = torch.channels_last
    if workers and context and accepts(make_loader, "multiprocessing_context"):
        options["multiprocessing_context"] = context
    return make_loader(path, **options)


class PlainCopyLoader:
    """make_loader's host batches with a plain ``.to(device)`` and the transform on the device.

    The same reads and the same transform as ``make_loader(device="cuda")``,
    without pinned memory or side-stream prefetch: the benchmark's measure of
    what those two buy.
    """

    def __init__(self, path: str, mode: str, pipeline: str, size: int, batch_size: int, workers: int,
                 shuffle: bool, context: Optional[str], decode_size: Optional[int] = None, seed: int = 0,
                 device: str = "cuda"):
        from ..loading.sampling import batch_generator

        self.host = make_loader_loader(path, mode, "none", size, batch_size, workers, shuffle, context,
                                       decode_size, seed, device="cpu")
        self.device, self.seed, self.generators = torch.device(device), seed, batch_generator
        self.transform = batch_transform(fast_path()[1], pipeline, size)

    def __len__(self) -> int:
        return len(self.host)

    def __iter__(self):
        from ..loading.device import copy_then_transform

        batches = iter(self.host)  # starts the next epoch
        epoch, seed = self.host.epoch, self.seed
        return copy_then_transform(batches, self.device, self.transform, lambda k: self.generators(seed, epoch, 0, k))


class ToDevice:
    """Moves each batch a baseline loader yields to ``device`` with a plain ``.to`` (lists stay on the host)."""

    def __init__(self, loader, device: str) -> None:
        self.loader, self.device = loader, torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for images, labels in self.loader:
            if isinstance(images, torch.Tensor):
                images = images.to(self.device)
            yield images, labels.to(self.device)


@contextlib.contextmanager
def default_start_method(method: Optional[str]) -> Iterator[None]:
    """Make ``method`` the default start method for loaders that take no context, then restore it."""
    if method is None:
        yield
        return
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)
