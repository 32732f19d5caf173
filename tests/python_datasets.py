"""Datasets made by Python code, for tests/test_python_source.py: at module level, so that a worker process
started with spawn or forkserver imports them."""

from __future__ import annotations

import io
import os
import signal
import threading

import numpy as np
from PIL import Image

CLASSES = ["cat", "dog", "fox"]


def pixels(i: int, size: int = 16) -> np.ndarray:
    """Item i's HxWx3 uint8 pixels (the same for every call)."""
    return np.random.default_rng(i).integers(0, 256, (size, size, 3), dtype=np.uint8)


def jpeg(i: int, size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels(i, size)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


class ArrayDataset:
    """(uint8 array, label) pairs, with torchvision's ``classes`` attribute."""

    classes = CLASSES

    def __init__(self, count: int = 48, size: int = 16) -> None:
        self.count, self.size = count, size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        return pixels(i, self.size), i % 3


class MixedDataset:
    """Items as users have them: PIL images, HxWxC arrays, CxHxW tensors, JPEG bytes and paths; labels as ints,
    class names and 0-d tensors; dicts with a field."""

    def __init__(self, folder: str, count: int = 12) -> None:
        self.folder, self.count = folder, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        import torch

        kind = i % 6
        label = [i % 3, CLASSES[i % 3], torch.tensor(i % 3)][i % 3]
        if kind == 0:
            return Image.fromarray(pixels(i)), label
        if kind == 1:
            return pixels(i), label
        if kind == 2:
            return torch.from_numpy(pixels(i)).permute(2, 0, 1).contiguous(), label
        if kind == 3:
            return jpeg(i), label
        if kind == 4:
            path = os.path.join(self.folder, f"{i}.jpg")
            with open(path, "wb") as file:
                file.write(jpeg(i))
            return path, label
        return {"image": pixels(i), "label": label, "caption": f"item {i}"}


class MappedTargets:
    """A dataset whose ``targets`` are not what ``__getitem__`` gives (as torchvision's target_transform maps
    them): no ``classes`` attribute, so the classes are found from the labels."""

    def __init__(self, count: int = 9) -> None:
        self.targets = [i % 3 for i in range(count)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return pixels(i), 2 - self.targets[i]


class BadDataset(ArrayDataset):
    """An ArrayDataset whose item ``index`` is bad in the way ``how`` says."""

    def __init__(self, how: str, index: int = 5, count: int = 12) -> None:
        super().__init__(count)
        self.how, self.index = how, index

    def __getitem__(self, i: int):
        if i != self.index:
            return super().__getitem__(i)
        if self.how == "type":
            return "not an item"
        if self.how == "shape":
            return pixels(i), 0, "extra"
        if self.how == "image":
            return {"image": 3.5, "label": 0}
        if self.how == "size":
            return pixels(i, 20), 0
        if self.how == "label":
            return pixels(i), 7
        if self.how == "raises":
            raise KeyError(f"no record {i}")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError(self.how)


class LockedDataset(ArrayDataset):
    """An ArrayDataset holding a lock, which cannot be pickled."""

    def __init__(self, count: int = 12) -> None:
        super().__init__(count)
        self.guard = threading.Lock()


class FieldsDataset(ArrayDataset):
    """Dict items with a text field and a box array; item ``odd`` lacks the text field."""

    def __init__(self, count: int = 12, odd: int = -1) -> None:
        super().__init__(count)
        self.odd = odd

    def __getitem__(self, i: int):
        item = {"image": pixels(i), "label": i % 3, "caption": f"item {i}",
                "boxes": np.full((1 + i % 2, 4), i, np.float32)}
        if i == self.odd:
            del item["caption"]
        return item


def make_train_set(count: int = 24, size: int = 16) -> LockedDataset:
    """A factory, as ``--python tests.python_datasets:make_train_set`` names it: its dataset holds a lock."""
    dataset = LockedDataset(count)
    dataset.size = size
    return dataset


def broken_factory(count: int = 1) -> ArrayDataset:
    """A factory that fails, as one whose database is not there."""
    raise RuntimeError(f"no database for {count} items")
