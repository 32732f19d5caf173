"""The README's "Use it in your training script" recipe holds: its lines, run as written in a small
training loop of the shape of torchvision's classification reference, train and evaluate on an
encoded archive of photos of mixed sizes, carrying over the reference's augmentation settings."""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch import nn

import packed_formats as pf
from packed_formats import transforms as T
from packed_formats.synthetic import make_photo_folder

README = Path(__file__).resolve().parent.parent / "README.rst"
SECTION = "Use it in your training script"


def python_blocks(section: str) -> List[str]:
    """The ``.. code-block:: python`` blocks of a README section, dedented, as written."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{section}\n")
    end = re.search(r"\n[^\n]+\n-{3,}\n", text[start + len(section) + 2 :])
    body = text[start : start + len(section) + 2 + (end.start() if end else len(text))]
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?:   [^\n]*)?\n)+)", body)
    return [textwrap.dedent(block) for block in blocks]


def recipe() -> str:
    """The block that replaces the reference's data loading."""
    found = [block for block in python_blocks(SECTION) if "make_loader(train_archive" in block]
    assert len(found) == 1, "the README's training-script recipe is gone"
    return found[0]


def reference_args(data_path: Path, *argv: str) -> argparse.Namespace:
    """The reference's data and augmentation options with its defaults (our own small parser)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-path", default=str(data_path))
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("-j", "--workers", default=0, type=int)
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--lr", default=0.05, type=float)
    parser.add_argument("--auto-augment", default=None, type=str)
    parser.add_argument("--ra-magnitude", default=9, type=int)
    parser.add_argument("--random-erase", default=0.0, type=float)
    parser.add_argument("--mixup-alpha", default=0.0, type=float)
    parser.add_argument("--cutmix-alpha", default=0.0, type=float)
    parser.add_argument("--val-resize-size", default=40, type=int)
    parser.add_argument("--val-crop-size", default=32, type=int)
    parser.add_argument("--train-crop-size", default=32, type=int)
    return parser.parse_args(list(argv))


class Loop:
    """A small loop of the reference's shape: ``train_one_epoch`` and ``evaluate`` with its signatures,
    recording what they saw."""

    def __init__(self) -> None:
        self.train_labels: List[torch.Tensor] = []
        self.losses: List[float] = []
        self.accuracies: List[float] = []
        self.image_shapes: set = set()

    def train_one_epoch(self, model, criterion, optimizer, data_loader, device, epoch, args) -> None:
        model.train()
        for image, target in data_loader:
            image, target = image.to(device), target.to(device)
            loss = criterion(model(image), target)  # soft [B, K] targets after MixUp/CutMix, as in the reference
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            self.train_labels.append(target)
            self.losses.append(loss.item())
            self.image_shapes.add(tuple(image.shape[1:]))

    def evaluate(self, model, criterion, data_loader, device) -> None:
        model.eval()
        correct = seen = 0
        with torch.inference_mode():
            for image, target in data_loader:
                output = model(image.to(device))
                correct += int((output.argmax(dim=1) == target.to(device)).sum())
                seen += len(target)
        self.accuracies.append(correct / seen)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> Path:
    """<data-path> with train.zip and val.zip: encoded photos of mixed sizes, as convert packs them."""
    root = tmp_path_factory.mktemp("reference")
    for split, seed in (("train", 1), ("val", 2)):
        folder = make_photo_folder(root / split, images_per_class=6, classes=("a", "b", "c"), sizes=(48, 96),
                                   seed=seed)
        pf.convert(folder, str(root / f"{split}.zip"), mode="encoded", quiet=True)
    return root


def run_recipe(data_path: Path, *argv: str) -> Loop:
    """The README's lines, as written, with the names the reference has defined by then."""
    torch.manual_seed(0)
    loop = Loop()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    args = reference_args(data_path, *argv)
    namespace: Dict[str, object] = {
        "args": args, "device": torch.device("cpu"), "model": model, "criterion": nn.CrossEntropyLoss(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=args.lr),
        "train_one_epoch": loop.train_one_epoch, "evaluate": loop.evaluate,
    }
    exec(compile(recipe(), str(README), "exec"), namespace)
    return loop


def test_the_readme_recipe_is_found_and_defines_what_it_uses():
    code = recipe()
    for name in ("train_archive =", "val_archive =", "args.mixup_alpha", "args.cutmix_alpha", "args.auto_augment",
                 "args.random_erase", "args.val_resize_size"):
        assert name in code


def test_train_carries_over_the_references_augmentation_settings():
    assert isinstance(T.train(32), T.CropFlipNormalize)  # the fused pass when nothing is added
    steps = T.train(32, auto_augment="ra", ra_magnitude=5, random_erase=0.25).transforms
    assert [type(t).__name__ for t in steps] == [
        "RandomResizedCrop", "RandomHorizontalFlip", "RandAugment", "Normalize", "RandomErasing"]
    assert steps[2].magnitude == 5 and steps[4].p == 0.25
    assert isinstance(T.train(32, auto_augment="ta_wide").transforms[2], T.TrivialAugmentWide)
    for policy in ("augmix", "imagenet"):
        with pytest.raises(ValueError, match="not supported"):
            T.train(32, auto_augment=policy)


@pytest.mark.slow
def test_the_readme_recipe_trains_and_evaluates_with_the_reference_defaults(data_path):
    loop = run_recipe(data_path, "--workers", "2")
    assert len(loop.accuracies) == 2 and all(0.0 <= a <= 1.0 for a in loop.accuracies)
    assert loop.image_shapes == {(3, 32, 32)}
    assert all(t.dtype == torch.int64 and t.dim() == 1 for t in loop.train_labels)  # hard labels
    assert all(math.isfinite(loss) for loss in loop.losses)


@pytest.mark.slow
@pytest.mark.parametrize("augment", ["ta_wide", "ra"])
def test_the_readme_recipe_carries_mixup_cutmix_auto_augment_and_random_erase_over(data_path, augment):
    loop = run_recipe(data_path, "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--auto-augment", augment,
                      "--random-erase", "0.5", "--val-resize-size", "36", "--train-crop-size", "24")
    assert len(loop.accuracies) == 2 and loop.image_shapes == {(3, 24, 24)}
    soft = [t for t in loop.train_labels if t.dim() == 2]
    assert len(soft) == len(loop.train_labels) and all(t.shape[1] == 3 for t in soft)  # soft targets, as mixed
    assert all(torch.allclose(t.sum(dim=1), torch.ones(len(t))) for t in soft)
    assert any(not torch.equal(t, t.round()) for t in soft)
    assert all(math.isfinite(loss) for loss in loop.losses)
