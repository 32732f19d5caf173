"""A dataset wrapper for loader tests, in a module light enough for spawn workers to import."""

from __future__ import annotations

import os
import zlib

import torch

import packed_formats as pf
from packed_formats import handles


class Probe(torch.utils.data.Dataset):
    """Wraps a PackedDataset; each item reports what it got and which process read it."""

    def __init__(self, dataset: pf.PackedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def _report(self, i, image, label):
        key = (self.dataset.reader.format_name, os.path.realpath(self.dataset.path))
        held = handles.open_handles().get(key)
        return {
            "index": int(i),
            "crc": zlib.crc32(image.numpy().tobytes()),
            "label": label,
            "pid": os.getpid(),
            "handle_pid": None if held is None else held[0],
            "opens": handles.opens_in_this_process(),
        }

    def __getitem__(self, i):
        return self._report(i, *self.dataset[i])

    def __getitems__(self, indices):
        return [self._report(i, *item) for i, item in zip(indices, self.dataset.__getitems__(indices))]


def as_list(batch):
    return batch
