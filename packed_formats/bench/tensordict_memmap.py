"""The tensordict-style memmap baseline: the loader of tensordict's tutorial "Batched data loading with tensorclasses".

The tutorial keeps uint8 images in a tensordict ``MemoryMappedTensor`` inside a
``tensorclass``, hands that object to ``DataLoader(data, batch_size=B,
collate_fn=Collate(transform, device))`` (the tensorclass's ``__getitems__``
returns the whole stacked batch, gathered with one fancy index), and in the
collate moves the batch to the device and applies three batched modules:
normalise (uint8 -> float on the *full* image), a per-sample random crop made
with two ``gather`` calls, and a per-sample random horizontal flip made by
blending a flipped and an unflipped copy with masks.

tensordict is not a dependency, so this module reproduces that behaviour
with plain torch: the archive's ``images.npy`` is mapped with
``numpy.load(mmap_mode="r")`` and wrapped by ``torch.from_numpy`` (as a
MemoryMappedTensor is), viewed as [N,C,H,W] like the tutorial's storage, and
indexed by a whole batch of indices at once.  Like MemoryMappedTensor it
pickles as its path and re-maps on the other side.  Only raw memmap archives
can be read this way.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..archives import open_archive
from ..errors import FormatMismatchError

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class TutorialMemmapData(torch.utils.data.Dataset):
    """images [N,C,H,W] uint8 and targets [N] int64 mapped from a raw memmap archive."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        for name in ("images.npy", "labels.npy"):
            if not os.path.exists(os.path.join(self.path, name)):
                raise FormatMismatchError(
                    self.path, f"the tensordict-style baseline needs a raw memmap archive ({name} is missing)"
                )
        self._mapped: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (images, targets) once mapped
        with open_archive(self.path, verify=False) as reader:  # images.npy is [N,C,H,W] already when planar
            self._planar = reader.manifest.raw_layout == "chw"
        self._length = int(np.load(os.path.join(self.path, "labels.npy"), mmap_mode="r").shape[0])

    def _map(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._mapped is None:
            images = np.load(os.path.join(self.path, "images.npy"), mmap_mode="r")
            labels = np.load(os.path.join(self.path, "labels.npy"), mmap_mode="r")
            with warnings.catch_warnings():  # read-only maps; nothing writes to them
                warnings.simplefilter("ignore", UserWarning)
                mapped = torch.from_numpy(images)
                self._mapped = mapped if self._planar else mapped.permute(0, 3, 1, 2), torch.from_numpy(labels)
        return self._mapped

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_mapped"] = None  # travel as the path, like MemoryMappedTensor
        return state

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        images, targets = self._map()
        return images[i], targets[i]

    def __getitems__(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        images, targets = self._map()
        index = torch.as_tensor(indices, dtype=torch.long)
        return images[index], targets[index]


class TutorialNormalize(nn.Module):
    """(x - 255 * mean) / (255 * std) per channel; turns a uint8 batch into float."""

    loc: torch.Tensor  # buffers, registered in __init__
    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("loc", torch.tensor(MEAN).view(3, 1, 1) * 255)
        self.register_buffer("scale", torch.tensor(STD).view(3, 1, 1) * 255)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.loc) / self.scale


class TutorialRandomCrop(nn.Module):
    """A size x size window per sample, at offsets drawn like the tutorial (randint(H - size)), via gather."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        s = self.size
        rows = torch.randint(h - s, (b, 1), device=x.device) + torch.arange(s, device=x.device)
        cols = torch.randint(w - s, (b, 1), device=x.device) + torch.arange(s, device=x.device)
        x = x.gather(2, rows[:, None, :, None].expand(b, c, s, w))
        return x.gather(3, cols[:, None, None, :].expand(b, c, s, s))


class TutorialRandomHFlip(nn.Module):
    """Flip each sample with probability 1/2 by blending masked flipped and unflipped copies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flip = torch.zeros(x.shape[0], 1, 1, 1, device=x.device, dtype=torch.bool).bernoulli_().expand_as(x)
        return x.masked_fill(flip, 0.0) + x.masked_fill(~flip, 0.0).flip(-1)


class TutorialCenterCrop(nn.Module):
    """A fixed centre window (the tutorial has no batched val transform; used for pipeline 'val')."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, left = (x.shape[-2] - self.size) // 2, (x.shape[-1] - self.size) // 2
        return x[..., top : top + self.size, left : left + self.size]


class TutorialCollate(nn.Module):
    """The tutorial's collate: pin (CUDA only), move to the device, apply the batch transform."""

    def __init__(self, transform: Optional[nn.Module] = None, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.transform = None if transform is None else transform.to(self.device)  # its buffers too

    def __call__(self, batch: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        images, targets = batch  # the (images, targets) pair that __getitems__ returned
        if self.device.type == "cuda":
            images, targets = images.pin_memory(), targets.pin_memory()
        images, targets = images.to(self.device), targets.to(self.device)
        if self.transform is not None:
            images = self.transform(images)
        return images, targets


def tutorial_transform(pipeline: str, size: int) -> Optional[nn.Module]:
    """The tutorial's batched modules in its order (normalise first, then crop, then flip)."""
    if pipeline == "none":
        return None
    if pipeline == "train":
        return nn.Sequential(TutorialNormalize(), TutorialRandomCrop(size), TutorialRandomHFlip())
    return nn.Sequential(TutorialNormalize(), TutorialCenterCrop(size))


def tutorial_loader(
    path: str,
    pipeline: str,
    size: int,
    batch_size: int,
    num_workers: int,
    shuffle: bool = True,
    multiprocessing_context: Optional[str] = None,
    device: str = "cpu",
) -> torch.utils.data.DataLoader:
    """The tutorial's DataLoader over a raw memmap archive."""
    return torch.utils.data.DataLoader(
        TutorialMemmapData(path),
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        collate_fn=TutorialCollate(tutorial_transform(pipeline, size), device),
        multiprocessing_context=multiprocessing_context if num_workers else None,
    )
