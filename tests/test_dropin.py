"""Our objects in the training code users already have: transforms they bring, archives they re-create."""

from __future__ import annotations

import json
import os
import re
import shutil
import tracemalloc
import warnings
import zlib
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats.index import encode_keys
from packed_formats.synthetic import make_image_folder

from .conftest import kind_id


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


# ---- a drop-in for torchvision.datasets.ImageFolder ---------------------------------------------------------
# Training code written for ImageFolder(root, transform=...) runs on PackedDataset(archive, transform=...):
# compared here with a real ImageFolder over the very folder each archive was converted from.
TV_CLASSES = ("stripes", "boxes", "circles")
TV_SIDE = 24  # every image one size, so a raw archive holds the folder's pixels unresized
TV_KINDS = [(f, m) for f in pf.PACKED_FORMATS for m in ("raw", "encoded")]
PRESET_KINDS = [("zip", "encoded"), ("memmap", "raw"), ("hdf5", "raw"), ("lmdb", "encoded")]  # every format, both modes
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def png_folder(tmp_path_factory) -> str:
    """An ImageFolder tree of same-size PNGs, one of them a folder deeper (ImageFolder walks sub-folders)."""
    root = make_image_folder(
        tmp_path_factory.mktemp("tv") / "images", images_per_class=4, classes=TV_CLASSES,
        sizes=(TV_SIDE, TV_SIDE), seed=3, encoding="png",
    )
    os.makedirs(os.path.join(root, "boxes", "more"))
    deeper = os.path.join(root, "boxes", "more", "extra.png")
    shutil.copyfile(os.path.join(root, "circles", "circles_00001.png"), deeper)
    return root


@pytest.fixture(scope="module")
def converted(png_folder, tmp_path_factory) -> dict:
    """{(format, mode): archive converted from png_folder}."""
    out = tmp_path_factory.mktemp("tv-archives")
    return {
        (fmt, mode): pf.convert(
            png_folder, out / f"images-{mode}.{fmt}", format=fmt, mode=mode,
            size=TV_SIDE if mode == "raw" else None, workers=1, quiet=True,
        ).destination
        for fmt, mode in TV_KINDS
    }


@pytest.fixture(scope="module")
def image_folder_dataset(png_folder):
    from torchvision.datasets import ImageFolder

    return ImageFolder(png_folder)


def pixels(image) -> np.ndarray:
    return np.asarray(image)


@pytest.mark.parametrize("kind", TV_KINDS, ids=kind_id)
def test_items_are_the_pil_images_and_labels_imagefolder_gives(converted, image_folder_dataset, kind):
    dataset = pf.PackedDataset(converted[kind])
    assert len(dataset) == len(image_folder_dataset)
    for i in range(len(dataset)):
        (image, label), (expected, expected_label) = dataset[i], image_folder_dataset[i]
        assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == expected.size
        assert np.array_equal(pixels(image), pixels(expected)) and label == expected_label
    batch = dataset.__getitems__([len(dataset) - 1, 0])
    assert all(isinstance(image, Image.Image) and image.mode == "RGB" for image, _ in batch)


@pytest.mark.parametrize("kind", TV_KINDS, ids=kind_id)
def test_the_attributes_of_imagefolder_are_there_and_equal(converted, image_folder_dataset, png_folder, kind):
    dataset, reference = pf.PackedDataset(converted[kind]), image_folder_dataset
    assert dataset.root == converted[kind]
    assert (dataset.classes, dataset.class_to_idx) == (reference.classes, reference.class_to_idx)
    assert len(dataset.targets) == len(reference.targets) and dataset.targets == reference.targets
    assert [label for _, label in dataset.samples] == [label for _, label in reference.samples]
    assert [os.path.join(png_folder, key) for key, _ in dataset.samples] == [path for path, _ in reference.samples]
    assert list(dataset.imgs) == list(dataset.samples)
    assert dataset.extensions == reference.extensions
    assert dataset.find_classes(dataset.root) == reference.find_classes(png_folder)
    assert dataset.find_classes(png_folder) == reference.find_classes(png_folder)
    other = converted[("zip", "encoded")]
    assert dataset.find_classes(other) == reference.find_classes(png_folder)


def test_find_classes_says_what_is_missing_as_imagefolder_does(converted, tmp_path):
    dataset = pf.PackedDataset(converted[("zip", "raw")])
    (tmp_path / "flat").mkdir()
    with pytest.raises(FileNotFoundError, match="no class folders"):
        dataset.find_classes(tmp_path / "flat")
    with pytest.raises(pf.ArchiveNotFoundError, match="nowhere"):
        dataset.find_classes(tmp_path / "nowhere")


@pytest.mark.parametrize("kind", TV_KINDS, ids=kind_id)
def test_loader_opens_a_samples_key_as_imagefolders_loader_opens_its_path(converted, image_folder_dataset, kind):
    dataset = pf.PackedDataset(converted[kind], output="tensor")  # the loader gives PIL images whatever output is
    for (key, _), (path, _) in zip(dataset.samples, image_folder_dataset.samples):
        image = dataset.loader(key)
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert np.array_equal(pixels(image), pixels(image_folder_dataset.loader(path)))
    last_path = image_folder_dataset.imgs[-1][0]
    assert np.array_equal(pixels(dataset.loader(-1)), pixels(image_folder_dataset.loader(last_path)))
    with pytest.raises(pf.SampleIndexError, match="no sample has the key 'boxes/missing.png'"):
        dataset.loader("boxes/missing.png")
    with pytest.raises(pf.SampleIndexError):
        dataset.loader(dataset.samples[0][0] + "x" * 200)  # longer than any key: never cut to a stored one


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_transforms_set_after_construction_apply_as_in_imagefolder(converted, png_folder, mode):
    from torchvision import transforms as v1
    from torchvision.datasets import ImageFolder

    dataset, reference = pf.PackedDataset(converted[("lmdb", mode)]), ImageFolder(png_folder)
    assert dataset.transforms is None
    for target in (dataset, reference):
        target.transform, target.target_transform = v1.ToTensor(), (lambda label: label + 10)
    (image, label), (expected, expected_label) = dataset[5], reference[5]
    assert torch.equal(image, expected) and label == expected_label == reference.targets[5] + 10
    joint_image, joint_label = dataset.transforms(dataset.loader(5), 2)
    assert torch.equal(joint_image, expected) and joint_label == 12


def v1_preset():
    from torchvision import transforms as v1

    return v1.Compose([v1.RandomResizedCrop(16), v1.RandomHorizontalFlip(), v1.ToTensor(), v1.Normalize(MEAN, STD)])


def v2_preset():
    """torchvision's classification reference preset (PIL backend, v2)."""
    v2 = pytest.importorskip("torchvision.transforms.v2")
    return v2.Compose([
        v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD), v2.ToPureTensor(),
    ])


def seeded_batches(dataset) -> list:
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7)
    )
    return list(loader)


@pytest.mark.parametrize("preset", [v1_preset, v2_preset], ids=["v1", "v2"])
@pytest.mark.parametrize("kind", PRESET_KINDS, ids=kind_id)
def test_a_torchvision_preset_gives_imagefolders_batches_through_two_workers(converted, png_folder, kind, preset):
    """The same seeds draw the same crops: batches equal ImageFolder's only if the transform gets the same images."""
    from torchvision.datasets import ImageFolder

    got = seeded_batches(pf.PackedDataset(converted[kind], transform=preset()))
    expected = seeded_batches(ImageFolder(png_folder, transform=preset()))
    assert len(got) == len(expected) and got[0][0].shape == (4, 3, 16, 16) and got[0][0].dtype == torch.float32
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert torch.equal(labels, want_labels)
        assert torch.allclose(images, want_images, atol=1e-6)


def test_targets_work_where_imagefolders_list_does(converted, image_folder_dataset):
    targets, expected = pf.PackedDataset(converted[("hdf5", "encoded")]).targets, image_folder_dataset.targets
    assert json.dumps(Counter(targets)) == json.dumps(Counter(expected))
    assert np.array_equal(np.bincount(targets), np.bincount(expected))
    assert all(type(t) is int for t in targets) and type(targets[-1]) is int
    assert (len(targets), targets[0], targets[-1]) == (len(expected), expected[0], expected[-1])
    assert targets.tolist() == expected
    assert targets[2:9] == expected[2:9] and targets[::-1] == expected[::-1] and targets != expected[:-1]
    assert (targets.count(1), targets.index(2), 1 in targets, 7 in targets) == (
        expected.count(1), expected.index(2), True, False
    )
    weights = 1.0 / np.bincount(expected)
    draws = [
        list(torch.utils.data.WeightedRandomSampler(
            [weights[t] for t in labels], num_samples=40, generator=torch.Generator().manual_seed(3)
        ))
        for labels in (targets, expected)
    ]
    assert draws[0] == draws[1]
    copy = np.asarray(targets)
    copy[0] = 99  # a fresh array: the archive's labels stay as they are
    assert targets[0] == expected[0]


@pytest.fixture
def torch_warns_every_time():
    """torch warns about a read-only numpy array once per process, unless asked to warn always."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)


def test_targets_become_tensors_without_a_warning(converted, torch_warns_every_time):
    targets = pf.PackedDataset(converted[("memmap", "raw")]).targets
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared, copied = torch.as_tensor(targets), torch.tensor(targets)
    assert shared.dtype == copied.dtype == torch.int64 and shared.tolist() == copied.tolist() == targets.tolist()
    shared[0] = 99  # its own memory: the archive's labels stay as they are
    assert targets[0] != 99


@pytest.fixture(scope="module")
def many_samples(tmp_path_factory) -> str:
    """A 200k-sample memmap archive of 1x1 images, laid out with plain numpy."""
    n = 200_000
    path = tmp_path_factory.mktemp("many") / "many.memmap"
    path.mkdir()
    np.save(path / "images.npy", np.zeros((n, 1, 1, 1), dtype=np.uint8))
    np.save(path / "labels.npy", np.arange(n, dtype=np.int64) % 100)
    np.save(path / "keys.npy", encode_keys([f"c{i % 100}/{i:07d}.png" for i in range(n)]))
    np.save(path / "crc32.npy", np.full(n, zlib.crc32(b"\0"), dtype=np.uint32))
    manifest = pf.ArchiveManifest(
        format="memmap", mode="raw", count=n, classes=tuple(f"c{c}" for c in range(100)), shape=(1, 1, 1)
    )
    (path / "manifest.json").write_text(manifest.to_json())
    return str(path)


def peak_allocation(work) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_samples_imgs_and_targets_are_views_not_lists_made_per_sample(many_samples):
    reader = pf.open_archive(many_samples)
    seen = {}

    def construct_and_read():
        dataset = pf.PackedDataset(reader)
        samples, imgs, targets = dataset.samples, dataset.imgs, dataset.targets
        seen.update(n=(len(samples), len(imgs), len(targets)), last=samples[-1], middle=imgs[100_000:100_002])

    assert peak_allocation(construct_and_read) < 256 * 1024
    assert seen["n"] == (200_000,) * 3 and seen["last"] == ("c99/0199999.png", 99)
    assert list(seen["middle"]) == [("c0/0100000.png", 0), ("c1/0100001.png", 1)]
    assert peak_allocation(lambda: list(pf.PackedDataset(reader).samples)) > 10 * 1024 * 1024  # what a list costs


NUMPY_REFUSED = {
    "v2-resize": lambda v1, v2: v2.Compose([v2.Resize(12), v2.CenterCrop(12), v2.ToImage()]),  # passed through
    "v2-crop": lambda v1, v2: v2.RandomResizedCrop(12),
    "v1-preset": lambda v1, v2: v1.Compose([v1.RandomResizedCrop(12), v1.ToTensor()]),
}
NUMPY_TAKEN = {
    "v2-to-image-first": lambda v1, v2: v2.Compose([v2.ToImage(), v2.RandomResizedCrop(12)]),
    "v1-to-tensor-first": lambda v1, v2: v1.Compose([v1.ToTensor(), v1.RandomResizedCrop(12)]),
}


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_numpy_output_never_reaches_a_torchvision_transform_that_passes_it_through(converted, mode):
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    path = converted[("zip", mode)]
    for name, make in NUMPY_REFUSED.items():
        with pytest.raises(TypeError, match=r"output='numpy'.*output='pil'") as error:
            pf.PackedDataset(path, output="numpy", transform=make(v1, v2))[0]
        assert os.path.basename(path) in str(error.value), name
    for name, make in NUMPY_TAKEN.items():
        image, _ = pf.PackedDataset(path, output="numpy", transform=make(v1, v2))[0]
        assert tuple(image.shape) == (3, 12, 12), name


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_a_relative_path_opened_from_another_directory_says_not_found(converted, tmp_path, monkeypatch, fmt):
    path = converted[(fmt, "raw")]
    monkeypatch.chdir(os.path.dirname(path))
    name = os.path.basename(path)
    assert len(pf.PackedDataset(name)) == 13
    monkeypatch.chdir(tmp_path)
    for attempt in (lambda: pf.open_archive(name), lambda: pf.PackedDataset(name)):
        with pytest.raises(pf.ArchiveNotFoundError, match=f"{name}: no such file"):
            attempt()


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_a_deleted_staged_copy_says_not_found(converted, tmp_path, fmt):
    copy = pf.stage(converted[(fmt, "encoded")], tmp_path)
    assert len(pf.PackedDataset(copy)) == 13
    shutil.rmtree(copy) if os.path.isdir(copy) else os.unlink(copy)
    for attempt in (lambda: pf.open_archive(copy), lambda: pf.PackedDataset(copy)):
        with pytest.raises(pf.ArchiveNotFoundError, match=f"{re.escape(copy)}: no such file"):
            attempt()


def test_a_path_given_with_a_tilde_is_expanded_as_imagefolder_does(converted, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copyfile(converted[("zip", "encoded")], tmp_path / "train.zip")
    dataset = pf.PackedDataset("~/train.zip")
    assert dataset.root == str(tmp_path / "train.zip") and len(dataset) == 13
    with pytest.raises(pf.ArchiveNotFoundError, match=re.escape(str(tmp_path / "gone.zip"))):
        pf.PackedDataset("~/gone.zip")
