"""Our objects in the training code users already have: transforms they bring, archives they re-create."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import packed_formats as pf


@pytest.fixture(scope="module")
def identical_images(tmp_path_factory):
    """A raw archive of 16 copies of one noise image: any difference after a transform is the transform's."""
    path = tmp_path_factory.mktemp("same") / "same.memmap"
    image = np.random.default_rng(0).integers(0, 256, size=(24, 32, 3), dtype=np.uint8)
    with pf.open_writer(path, format="memmap", mode="raw", shape=(24, 32, 3), classes=["a"]) as writer:
        for k in range(16):
            writer.add(image, 0, f"{k}.png")
    return str(path)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torchvision_pipeline_draws_its_random_crop_per_image_not_per_batch(identical_images, workers):
    v2 = pytest.importorskip("torchvision.transforms.v2")
    transform = v2.Compose([v2.RandomResizedCrop(8, antialias=True), v2.RandomHorizontalFlip()])
    loader = pf.make_loader(identical_images, batch_size=16, shuffle=False, num_workers=workers, transform=transform)
    images, _ = next(iter(loader))
    assert images.shape == (16, 3, 8, 8)
    distinct = {images[k].numpy().tobytes() for k in range(16)}
    assert len(distinct) > 8, "one crop was drawn for the whole batch"


def test_a_callable_marked_batched_gets_the_whole_batch_once(identical_images):
    calls = []

    def scale(batch: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(batch.shape))
        return batch.float() / 255

    loader = pf.make_loader(
        identical_images, batch_size=8, shuffle=False, num_workers=0, transform=pf.transforms.Batched(scale)
    )
    batches = list(loader)
    assert calls == [(8, 3, 24, 32), (8, 3, 24, 32)]
    assert batches[0][0].dtype == torch.float32 and float(batches[0][0].max()) <= 1


def test_a_transform_that_needs_pil_images_says_how_to_fix_it(identical_images):
    transforms = pytest.importorskip("torchvision.transforms")
    loader = pf.make_loader(identical_images, batch_size=4, num_workers=0, transform=transforms.ToTensor())
    with pytest.raises(TypeError, match="torchvision.transforms.v2"):
        next(iter(loader))


def test_per_image_results_of_different_sizes_are_refused_with_advice(identical_images):
    sizes = iter([8, 9, 8, 9])
    loader = pf.make_loader(
        identical_images, batch_size=4, num_workers=0, transform=lambda image: image[:, : next(sizes), :8]
    )
    with pytest.raises(ValueError, match="crop or resize to one size"):
        next(iter(loader))
