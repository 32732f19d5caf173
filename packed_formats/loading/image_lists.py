"""Batches of images of different sizes (``make_loader(size="own")``): one tensor in transit, a list out.

A worker joins a batch's images (and its masks and second views, each its image's size) into one flat
tensor with each one's shape beside it (``join``), so that the batch still leaves in one slot and
crosses to a device in one copy; the main process hands out a list of views of it (``split``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

OWN = "own"  # make_loader's size= for images that each keep their own size


def join(tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the tensors' elements one after the other, in one 1-D tensor; int64 [B, dims] of their shapes).
    ValueError when they differ in dtype or in their number of dimensions."""
    dtypes = sorted({str(t.dtype) for t in tensors})
    dims = sorted({t.dim() for t in tensors})
    if len(dtypes) > 1 or len(dims) > 1:
        raise ValueError(f"the batch's images are of dtypes {dtypes} and {dims} dimensions: a transform must "
                         "give every image one dtype and the same number of dimensions")
    if not tensors:
        return torch.empty(0, dtype=torch.uint8), torch.empty((0, 3), dtype=torch.int64)
    shapes = torch.tensor([list(t.shape) for t in tensors], dtype=torch.int64)
    flat = torch.cat([t.as_subclass(torch.Tensor).reshape(-1) for t in tensors])
    return flat, shapes


def split(flat: torch.Tensor, shapes: torch.Tensor, device: Optional[torch.device] = None) -> List[torch.Tensor]:
    """``join``'s tensors again: contiguous views of ``flat`` (moved to ``device`` first, if given)."""
    if device is not None:
        flat = flat.to(device)
    sizes = shapes.prod(dim=1).tolist() if len(shapes) else []
    return [part.view(*shape) for part, shape in zip(torch.split(flat, sizes), shapes.tolist())]
