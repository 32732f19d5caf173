"""The README's recipes hold.

The "Use it in your training script" recipe: its lines, run as written in a small training loop of the
shape of torchvision's classification reference, train and evaluate on an encoded archive of photos of
mixed sizes, carrying over the reference's augmentation settings.  The quickstart leaves the checkout
clean, and the benchmark command the demo prints at its end works as printed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch import nn

import packed_formats as pf
from packed_formats import transforms as T
from packed_formats.synthetic import make_photo_folder

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.rst"
SECTION = "Use it in your training script"


def section_text(section: str) -> str:
    """The text of a README section (``-`` underlined), up to the next one."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{section}\n")
    end = re.search(r"\n[^\n]+\n-{3,}\n", text[start + len(section) + 2 :])
    return text[start : start + len(section) + 2 + (end.start() if end else len(text))]


def code_blocks(section: str, language: str) -> List[str]:
    """The ``.. code-block:: <language>`` blocks of a README section, dedented, as written."""
    blocks = re.findall(rf"\.\. code-block:: {language}\n\n((?:(?:   [^\n]*)?\n)+)", section_text(section))
    return [textwrap.dedent(block) for block in blocks]


def python_blocks(section: str) -> List[str]:
    """The ``.. code-block:: python`` blocks of a README section, dedented, as written."""
    return code_blocks(section, "python")


def recipe() -> str:
    """The block that replaces the reference's data loading."""
    found = [block for block in python_blocks(SECTION) if "make_loader(train_archive" in block]
    assert len(found) == 1, "the README's training-script recipe is gone"
    return found[0]


def epoch_line() -> str:
    """The block that changes the reference's epoch loop."""
    found = [block for block in python_blocks(SECTION) if "set_epoch(epoch)" in block]
    assert len(found) == 1, "the README's epoch-loop line is gone"
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
        self.epochs_seen: List[int] = []

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
    }
    exec(compile(recipe(), str(README), "exec"), namespace)
    # the reference's epoch loop, with the README's line where it says, and the rest of the loop kept
    lr_scheduler = torch.optim.lr_scheduler.StepLR(namespace["optimizer"], step_size=1)  # type: ignore[arg-type]
    changed = compile(epoch_line(), str(README), "exec")
    for epoch in range(args.start_epoch, args.epochs):
        exec(changed, {**namespace, "epoch": epoch})
        loop.train_one_epoch(model, namespace["criterion"], namespace["optimizer"], namespace["data_loader"],
                             namespace["device"], epoch, args)
        loop.epochs_seen.append(namespace["data_loader"].epoch)  # type: ignore[attr-defined]
        lr_scheduler.step()
        loop.evaluate(model, namespace["criterion"], namespace["data_loader_test"], namespace["device"])
    return loop


def test_the_readme_recipe_is_found_and_defines_what_it_uses():
    code = recipe()
    for name in ("train_archive =", "val_archive =", "args.mixup_alpha", "args.cutmix_alpha", "args.auto_augment",
                 "args.random_erase", "args.val_resize_size"):
        assert name in code


def test_the_readme_recipe_changes_only_the_data_lines_and_keeps_the_rest_of_the_epoch_loop():
    assert "for epoch" not in recipe(), "the recipe must not stand in for the reference's whole epoch loop"
    (statement,) = [line for line in epoch_line().splitlines() if line.split("#")[0].strip()]
    assert statement.split("#")[0].strip() == "data_loader.sampler.set_epoch(epoch)"
    words = " ".join(section_text(SECTION).split())
    for kept in ("lr_scheduler.step()", "EMA", "scaler", "checkpoint"):
        assert kept in words, f"the README does not say that the loop keeps {kept}"


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
    assert loop.epochs_seen == [0, 1]  # the epochs the reference's loop asked for
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


def test_what_the_quickstart_writes_in_the_repository_is_ignored_by_git():
    """Run from the repository's top folder as shown, the quickstart leaves ``git status`` clean."""
    written = [shlex.split(line)[3] for block in code_blocks("Quickstart", "console")
               for line in block.replace("\\\n", " ").splitlines() if line.startswith("packed-formats convert ")]
    assert written, "the quickstart converts nothing"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True, text=True)
    ignored = done.stdout.split()
    assert ignored == written, f"{sorted(set(written) - set(ignored))} would show in git status: add to .gitignore"


def load_demo():
    """tools/demo.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_tool", ROOT / "tools" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demos_benchmark_hint_names_the_demos_archives_and_parses():
    from packed_formats.cli import build_parser

    argv = shlex.split(load_demo().bench_command("demo_data", 32))
    assert argv[0].endswith("packed-formats") and argv[1] == "bench"
    args = build_parser().parse_args(argv[1:])
    assert args.paths == ["demo_data/images", "demo_data/demo-raw.memmap", "demo_data/demo-encoded.zip"]


@pytest.mark.slow
def test_the_benchmark_command_the_demo_prints_runs_on_the_demos_archives(tmp_path):
    """The last line of ``make demo``, pasted as printed (here with small counts added), measures its archives."""
    demo = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo.py"), "--root", "demo", "--images-per-class", "3",
         "--workers", "0", "--size", "32", "--batch-size", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    argv = shlex.split(demo.stdout.strip().splitlines()[-1])
    assert argv[1] == "bench", demo.stdout[-1000:]
    small = ["--workers", "0", "--epochs", "1", "--warmup", "0", "--no-references", "--no-tensordict-baseline"]
    bench = subprocess.run(argv + small, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert "demo-raw.memmap" in bench.stdout and "no batches" not in bench.stdout, bench.stdout[-3000:]


def test_the_readme_describes_every_command_of_the_command_line_and_no_other():
    from packed_formats.cli import COMMANDS

    described = re.findall(r"^``([a-z]+)[ `]", section_text("Command line"), flags=re.MULTILINE)
    assert sorted(described) == sorted(COMMANDS)
