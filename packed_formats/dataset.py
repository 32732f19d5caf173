"""PackedDataset: a torch Dataset over any archive, safe with any DataLoader setup."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from . import codecs, policy
from .backends import open_archive
from .backends.base import Reader

OUTPUTS = ("tensor", "pil", "numpy")


class PackedDataset(torch.utils.data.Dataset):
    """``(image, label)`` pairs from a packed archive or an ImageFolder tree.

    Args:
        source: archive path (format auto-detected) or an open Reader.
        transform, target_transform: applied to the image and the label.
        output: "tensor" (uint8 CxHxW), "pil" (RGB/L image) or "numpy" (uint8 HxWxC).
        verify: check each sample's CRC32 on read (CorruptSampleError on mismatch).
        format: insist on this format (FormatMismatchError otherwise).

    Nothing is held open in the process that creates the dataset; each process
    (DataLoader worker, forked, spawned or forkserver) opens its own handle on
    first use.  ``__getitems__`` reads a whole batch at once.
    """

    def __init__(
        self,
        source: "str | os.PathLike[str] | Reader",
        transform: Optional[Callable] = None,
        target_transform: Optional[Callable] = None,
        output: str = "tensor",
        verify: bool = True,
        format: Optional[str] = None,
    ) -> None:
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.reader = source if isinstance(source, Reader) else open_archive(source, format=format, verify=verify)
        self.transform = transform
        self.target_transform = target_transform
        self.output = output

    # ---- ImageFolder-like metadata --------------------------------------------------
    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def manifest(self):
        return self.reader.manifest

    @property
    def classes(self) -> List[str]:
        return self.reader.classes

    @property
    def class_to_idx(self) -> Dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    @property
    def targets(self) -> np.ndarray:
        """int64 label of every sample (a read-only numpy array)."""
        return self.reader.labels

    def key(self, i: int) -> str:
        """The sample's original relative path."""
        return self.reader.key(i)

    def __len__(self) -> int:
        return len(self.reader)

    def __repr__(self) -> str:
        return f"PackedDataset({self.reader!r}, output={self.output!r})"

    # ---- samples ----------------------------------------------------------------------
    def __getitem__(self, i: int) -> Tuple[Any, Any]:
        i = self.reader.check_index(i)
        return self._sample(self.reader.read(i), i)

    def __getitems__(self, indices: Sequence[int]) -> List[Tuple[Any, Any]]:
        """The same list ``[self[i] for i in indices]`` would give, read as one batch."""
        idx = self.reader.check_indices(indices)
        stored = self.reader.read_many(idx)
        return [self._sample(stored[j], int(i)) for j, i in enumerate(idx)]

    def _sample(self, stored: Any, i: int) -> Tuple[Any, Any]:
        image = self._to_output(stored, i)
        label = int(self.reader.labels[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def _to_output(self, stored: Any, i: int) -> Any:
        channels = self._channels()
        try:
            if self.output == "pil":
                if isinstance(stored, np.ndarray):
                    return Image.fromarray(stored[:, :, 0] if channels == 1 else stored)
                image = codecs.open_image(stored)
                return codecs.to_8bit(image).convert("L" if channels == 1 else "RGB")
            pixels = stored if isinstance(stored, np.ndarray) else policy.decode(stored, channels)
        except codecs.DecodeError as exc:
            raise self.reader.sample_error(i, str(exc)) from None
        if self.output == "numpy":
            return np.array(pixels, copy=True) if not pixels.flags.writeable else pixels
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))

    def _channels(self) -> int:
        shape = self.reader.manifest.shape
        return 3 if shape is None else shape[2]

    # ---- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "PackedDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
