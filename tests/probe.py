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
        key = self.dataset.reader.handle_key
        held = handles.open_handles().get(key)
        return {
            "index": int(i),
            "crc": zlib.crc32(image.numpy().tobytes()),
            "label": label,
            "pid": os.getpid(),
            "handle_pid": None if held is None else held[0],
            "handle": handle_identity(self.dataset.reader),
            "opens": handles.opens_in_this_process(),
        }

    def __getitem__(self, i):
        return self._report(i, *self.dataset[i])

    def __getitems__(self, indices):
        return [self._report(i, *item) for i, item in zip(indices, self.dataset.__getitems__(indices))]


def as_list(batch):
    return batch


# An offset no reader ever seeks to (they all use pread): it marks an open file description.
PARENT_MARK = 0x5EED_0000


def handle_identity(reader: pf.Reader) -> tuple:
    """What identifies the open resource this process reads ``reader`` through, comparable across fork.

    Equal in a parent and its forked worker means the worker reads through the
    parent's file.  Below our handle table: HDF5's own serial number of the open
    file (a child's h5py.File() of a file its parent holds shares it, h5py#934),
    a descriptor's file offset (per open file description, see mark_parent_handle).
    Python object ids compare only while the parent's handle object stays alive:
    the caller keeps a reference (a fork copies it into every worker).
    """
    handle = reader.handle()
    if hasattr(handle, "file") and hasattr(handle.file, "id"):  # an h5py file
        return ("hdf5-file", handle.file.id.fileno)
    if hasattr(handle, "fd"):  # a descriptor: its open file description's offset tells whose it is
        return ("fd", handle.fd, os.lseek(handle.fd, 0, os.SEEK_CUR))
    return ("object", id(handle)) + tuple(id(v) for v in vars(handle).values() if v is not None)


def mark_parent_handle(reader: pf.Reader) -> tuple:
    """Mark this process's handle where handle_identity can see it (a descriptor's offset); its identity."""
    handle = reader.handle()
    if hasattr(handle, "fd"):
        os.lseek(handle.fd, PARENT_MARK, os.SEEK_SET)
    return handle_identity(reader)


class Pair(torch.utils.data.Dataset):
    """Two datasets (say train and val on one archive) read side by side in one process."""

    def __init__(self, first: pf.PackedDataset, second: pf.PackedDataset) -> None:
        self.first, self.second = first, second

    def __len__(self) -> int:
        return min(len(self.first), len(self.second))

    def __getitem__(self, i):
        images = [self.first[i][0], self.second[i][0]]
        key = self.first.reader.handle_key
        return {
            "index": int(i),
            "crcs": [zlib.crc32(image.numpy().tobytes()) for image in images],
            "pid": os.getpid(),
            "users": handles.open_handles()[key][2],
        }
