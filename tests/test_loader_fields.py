"""make_loader with fields: batches as dicts, masks, views and boxes cut and flipped with their images.

The archives here hold pictures whose pixels say where they are: red is the row and green the column
of the stored image, and the mask holds the same ramps (row * 256 + column, 16 bits).  Whatever box a
crop takes and however it is resized and flipped, a mask cut with its image therefore reads, at each
pixel, about what the image's red and green read there (bilinear against nearest: within a pixel or
two of the ramps away from the edges), and a mask cut from another box does not.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats.loading.field_batches import cut_boxes, cut_mask

from .test_fields import FIELD_FORMATS, assert_value, write

MARK = 0xFFFF  # the mask's value in the block its box goes round (no ramp value: rows and columns stay under 256)
SIZES = [(60, 80), (90, 70), (75, 75), (64, 100), (100, 64), (81, 93)]  # (height, width), one a sample


def ramp(height: int, width: int) -> np.ndarray:
    """uint8 HxWx3: red the row, green the column, blue 128."""
    rows, cols = np.mgrid[0:height, 0:width]
    return np.stack([rows, cols, np.full_like(rows, 128)], axis=-1).astype(np.uint8)


def ramp_mask(height: int, width: int) -> np.ndarray:
    rows, cols = np.mgrid[0:height, 0:width]
    return (rows * 256 + cols).astype(np.uint16)


def box_of(mask: np.ndarray, value: int):
    """[x0, y0, x1, y1] around the pixels of ``mask`` equal to ``value``."""
    ys, xs = np.nonzero(mask == value)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def write_ramps(path, fmt: str = "zip", encoding: str = "png", sizes=SIZES, mask_kind: str = "image") -> None:
    """Samples of ``sizes``: ramp images, ramp masks, and a box around a block of the mask marked ``MARK``."""
    with pf.open_writer(path, format=fmt, mode="encoded", classes=["a", "b"], encoding=encoding,
                        fields=[f"mask={mask_kind}", "boxes=array:float32[N,4]", "caption=text"]) as writer:
        for i, (height, width) in enumerate(sizes):
            mask = ramp_mask(height, width)
            y0, x0 = height // 4, width // 3
            mask[y0 : y0 + height // 3, x0 : x0 + width // 4] = MARK  # a block the box goes round
            box = np.array([[x0, y0, x0 + width // 4, y0 + height // 3]], np.float32)
            writer.add(ramp(height, width), i % 2, fields={"mask": mask, "boxes": box, "caption": f"sample {i}"})


def assert_cut_alike(batch) -> None:
    """Each sample's mask reads its image's ramps away from the edges and the marked block, and its box
    is the marked block's, within a pixel or two."""
    images, masks = batch["image"].numpy().astype(int), batch["mask"].as_subclass(torch.Tensor).numpy().astype(int)
    assert masks.shape == (images.shape[0],) + images.shape[2:]
    for image, mask, boxes in zip(images, masks, batch["boxes"]):
        ramped = (mask != MARK)[2:-2, 2:-2]
        assert np.abs(image[0, 2:-2, 2:-2] - mask[2:-2, 2:-2] // 256)[ramped].max() <= 2  # rows
        assert np.abs(image[1, 2:-2, 2:-2] - mask[2:-2, 2:-2] % 256)[ramped].max() <= 2  # columns
        if (mask == MARK).sum() > 4:  # the block is in the crop: its box goes round it
            assert np.abs(np.array(box_of(mask, MARK)) - boxes.numpy()[0]).max() <= 1.5


# ---- what a batch holds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raw", "encoded"])
@pytest.mark.parametrize("fmt", FIELD_FORMATS)
def test_batches_are_dicts_of_every_field_as_the_dataset_gives_them(tmp_path, fmt, mode):
    path = tmp_path / f"a.{fmt}"
    written = write(path, fmt, mode, count=9)
    names = ["mask", "boxes", "depth", "points", "caption", "meta"]
    dataset = pf.PackedDataset(path, output="tensor", fields=names)
    loader = pf.make_loader(path, batch_size=4, num_workers=2, shuffle=True, fields=names, return_index=True)
    seen = []
    for batch in loader:
        assert set(batch) == {"image", "label", "index", *names}
        # an image field asked for as a value is given as the image is (RGB), even a grey mask's PNG
        assert batch["mask"].shape == (len(batch["index"]), 3, 24, 32) and batch["depth"].dtype == torch.float16
        for j, i in enumerate(batch["index"].tolist()):
            want = dataset[i]
            assert torch.equal(batch["image"][j], want["image"]) and int(batch["label"][j]) == want["label"]
            for name in names:
                got = batch[name][j]
                assert torch.equal(got, want[name]) if isinstance(got, torch.Tensor) else got == want[name], name
            assert_value("boxes", batch["boxes"][j].numpy(), written[i]["boxes"])
            seen.append(i)
    assert sorted(seen) == list(range(9))


def test_without_fields_the_loader_reads_no_field_byte(tmp_path, monkeypatch):
    path = tmp_path / "a.zip"
    write(path, "zip", "encoded", count=6)

    def no(*args, **kwargs):
        raise AssertionError("a field was read")

    monkeypatch.setattr(pf.backends.reader.Reader, "read_field", no)
    monkeypatch.setattr(pf.backends.reader.Reader, "read_field_bytes", no)
    batches = list(pf.make_loader(path, batch_size=4, num_workers=0, shuffle=False))
    assert [len(labels) for _, labels in batches] == [4, 2]


# ---- cut with the image ---------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["png", "jpeg"])
def test_a_crop_first_transform_cuts_masks_and_boxes_with_their_images_while_decoding(tmp_path, encoding):
    from torchvision.transforms import v2

    path = tmp_path / "ramps.zip"
    write_ramps(path, encoding=encoding)
    transform = v2.Compose([v2.RandomResizedCrop((40, 48), scale=(0.3, 1.0)), v2.RandomHorizontalFlip(),
                            v2.RandomVerticalFlip()])
    loader = pf.make_loader(path, batch_size=3, num_workers=2, transform=transform, seed=4,
                            fields={"mask": "mask", "boxes": "boxes:XYXY", "caption": "value"}, return_index=True)
    flipped = 0
    for epoch in range(4):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            assert batch["image"].shape[1:] == (3, 40, 48) and type(batch["mask"]).__name__ == "Mask"
            assert batch["caption"] == [f"sample {i}" for i in batch["index"].tolist()]
            for boxes in batch["boxes"]:
                assert type(boxes).__name__ == "BoundingBoxes" and tuple(boxes.canvas_size) == (40, 48)
            if encoding == "png":
                assert_cut_alike(batch)
            else:  # JPEG's own error on top
                masks = batch["mask"].as_subclass(torch.Tensor).numpy().astype(int)
                reds = batch["image"].numpy()[:, 0].astype(int)
                inside = (masks != MARK)[:, 3:-3, 3:-3]
                assert np.abs(reds[:, 3:-3, 3:-3] - masks[:, 3:-3, 3:-3] // 256)[inside].max() <= 6
            flipped += int((np.diff(batch["image"].numpy()[:, 1].astype(int), axis=-1).mean(axis=(1, 2)) < 0).sum())
    assert 0 < flipped < 4 * len(SIZES)  # some flipped, some not: the flip was drawn per sample, masks alike


@pytest.mark.parametrize("resize_mode", ["stretch", "shorter-side-center-crop"])
def test_size_resizes_masks_and_boxes_with_their_images(tmp_path, resize_mode):
    path = tmp_path / "ramps.hdf5"
    write_ramps(path, fmt="hdf5")
    loader = pf.make_loader(path, batch_size=6, num_workers=0, shuffle=False, size=(32, 40), resize_mode=resize_mode,
                            fields={"mask": "mask", "boxes": "boxes:XYXY"})
    (batch,) = list(loader)
    assert batch["image"].shape == (6, 3, 32, 40) and batch["mask"].shape == (6, 32, 40)
    assert_cut_alike(batch)


def test_a_transform_without_a_crop_to_cut_at_decode_runs_on_each_samples_dict(tmp_path):
    from torchvision.transforms import v2

    path = tmp_path / "ramps.memmap"
    write_ramps(path, fmt="memmap", sizes=[(48, 64)] * 5)
    transform = v2.Compose([v2.RandomCrop((30, 30)), v2.RandomHorizontalFlip()])
    for batch in pf.make_loader(path, batch_size=2, num_workers=2, transform=transform,
                                fields={"mask": "mask", "boxes": "boxes:XYXY"}):
        assert batch["image"].shape[1:] == (3, 30, 30)
        assert_cut_alike(batch)


def test_a_2d_array_field_is_a_mask_too(tmp_path):
    from torchvision.transforms import v2

    path = tmp_path / "ramps.lmdb"
    write_ramps(path, fmt="lmdb", mask_kind="array:uint16[60,80]", sizes=[(60, 80)] * 4)
    loader = pf.make_loader(path, batch_size=3, num_workers=0, transform=v2.RandomResizedCrop(36),
                            fields={"mask": "mask", "boxes": "boxes:XYXY"})
    for batch in loader:
        assert batch["mask"].dtype == torch.uint16
        assert_cut_alike(batch)


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.slow),
                                    pytest.param("forkserver", marks=pytest.mark.slow), "fork"])
def test_fields_arrive_alike_under_every_start_method(tmp_path, method):
    from torchvision.transforms import v2

    path = tmp_path / "ramps.zip"
    write_ramps(path)
    loader = pf.make_loader(path, batch_size=2, num_workers=2, multiprocessing_context=method,
                            transform=v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip()]),
                            fields={"mask": "mask", "boxes": "boxes:XYXY"}, persistent_workers=False)
    batches = list(loader)
    assert len(batches) == 3
    for batch in batches:
        assert_cut_alike(batch)
    after = []
    for caller_seed in (1, 2):
        here = pf.make_loader(path, batch_size=2, num_workers=0, transform=loader.batch_reader.transform,
                              fields={"mask": "mask", "boxes": "boxes:XYXY"})
        torch.manual_seed(caller_seed)
        for batch, again in zip(batches, here):  # the same draws in this process: crops and flips are the batch's
            assert torch.equal(batch["image"], again["image"]) and torch.equal(batch["mask"], again["mask"])  # own
        after.append(torch.rand(4))
    assert not torch.equal(*after)  # and the caller's generator goes on from its own state: it is not reseeded


# ---- helpers, and what is refused -----------------------------------------------------------------------
def test_the_cut_of_a_mask_and_boxes_is_the_boxes_nearest_pixels():
    mask = ramp_mask(10, 20)
    cut = cut_mask(mask, ((2, 4, 6, 8), (20, 10), (3, 4)))  # box: top 2, left 4, 6 high, 8 wide -> 3x4
    assert (cut // 256).tolist() == [[2] * 4, [4] * 4, [6] * 4]  # torchvision's rule: floor(d * in / out)
    assert (cut % 256).tolist() == [[4, 6, 8, 10]] * 3
    boxes = cut_boxes(np.array([[4, 2, 12, 8], [0, 0, 2, 2]], np.float32), "XYXY", ((2, 4, 6, 8), (20, 10), (3, 4)))
    assert boxes.tolist() == [[0, 0, 4, 3], [0, 0, 0, 0]]
    xywh = cut_boxes(np.array([[6, 4, 4, 2]], np.float32), "XYWH", ((2, 4, 6, 8), (20, 10), (3, 4)))
    assert xywh.tolist() == [[1, 1, 2, 1]]
    with pytest.raises(ValueError, match="a mask is its image's size"):
        cut_mask(ramp_mask(9, 20), ((2, 4, 6, 8), (20, 10), (3, 4)))


def test_what_cannot_take_fields_is_refused_by_name(tmp_path):
    path = tmp_path / "ramps.zip"
    write_ramps(path)
    with pytest.raises(ValueError, match="torchvision v2"):
        pf.make_loader(path, fields=["mask"], transform=pf.transforms.train(32))
    with pytest.raises(ValueError, match="decode='device'"):
        pf.make_loader(path, fields=["mask"], decode="device")
    with pytest.raises(KeyError, match="no field 'nope'"):
        pf.make_loader(path, fields=["nope"])
    with pytest.raises(ValueError, match="boxes"):
        pf.make_loader(path, fields={"caption": "boxes:XYXY"})


def test_a_mask_that_is_not_its_images_size_is_named_or_skipped(tmp_path):
    path = tmp_path / "bad.zip"
    with pf.open_writer(path, format="zip", mode="encoded", classes=["a"], encoding="png",
                        fields=["mask=image"]) as writer:
        for i in range(4):
            writer.add(ramp(20, 30), 0, key=f"s{i}", fields={"mask": ramp_mask(20, 30 if i != 2 else 29)})
    with pytest.raises(pf.CorruptSampleError, match=r"s2.*field 'mask'.*its image's size"):
        list(pf.make_loader(path, batch_size=4, num_workers=0, size=16, fields={"mask": "mask"}))
    with pytest.warns(pf.SkippedSampleWarning, match="s2"):
        batches = list(pf.make_loader(path, batch_size=4, num_workers=2, size=16, fields={"mask": "mask"},
                                      on_error="skip", shuffle=False, return_index=True))
    assert [b["index"].tolist() for b in batches] == [[0, 1, 3]] and batches[0]["mask"].shape == (3, 16, 16)


def test_a_damaged_field_in_a_worker_is_named_with_its_sample(tmp_path):
    from .test_fields import flip_field_byte

    path = tmp_path / "a.lmdb"
    write(path, "lmdb", "raw", count=6)
    with pf.open_archive(path) as reader:
        flip_field_byte(path, "lmdb", reader, "mask", 3)
        key = reader.key(3)
    with pytest.raises(pf.CorruptSampleError, match=rf"index 3.*{key}.*field 'mask'.*checksum") as error:
        list(pf.make_loader(path, batch_size=3, num_workers=2, shuffle=False, fields=["mask"]))
    assert error.value.index == 3


def png_bytes(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_second_view_is_cut_as_its_image_is(tmp_path):
    from torchvision.transforms import v2

    path = tmp_path / "views.zip"
    with pf.open_writer(path, format="zip", mode="encoded", classes=["a"], encoding="png",
                        fields=["depth=image"]) as writer:
        for height, width in SIZES:
            writer.add(ramp(height, width), 0, fields={"depth": png_bytes(ramp(height, width))})
    for batch in pf.make_loader(path, batch_size=3, num_workers=0, fields={"depth": "image"},
                                transform=v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()])):
        assert type(batch["depth"]).__name__ == "Image"
        assert torch.equal(batch["depth"].as_subclass(torch.Tensor), batch["image"])  # the same pixels, the same cut


# ---- one output form on every path: views as the image is given, masks as stored values --------------------
PNG_MODES = ["P", "1", "LA", "RGBA"]


def mode_png(mode: str, height: int = 20, width: int = 24, shift: int = 0) -> bytes:
    """A PNG of ``mode`` (palette, 1-bit, grey with alpha, RGBA) whose pixels vary over the image."""
    rows, cols = np.mgrid[0:height, 0:width]
    values = ((rows * 7 + cols * 3 + shift) % 5).astype(np.uint8)  # a palette's indices, 0..4
    if mode == "P":
        image = Image.fromarray(values, mode="P")
        image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0, 9, 9, 9] + [0] * (768 - 15))
    elif mode == "1":
        image = Image.fromarray(values % 2 == 1).convert("1")
    elif mode == "LA":
        image = Image.fromarray(np.stack([values * 50, (cols * 10).astype(np.uint8)], axis=-1), mode="LA")
    else:
        image = Image.fromarray(np.stack([values * 50, (rows * 12).astype(np.uint8), (cols * 10).astype(np.uint8),
                                          np.full_like(values, 90)], axis=-1), mode="RGBA")
    assert image.mode == mode
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def write_views(path, mode: str, archive_mode: str, count: int = 5) -> None:
    """Samples whose image and ``view`` field are the same PNG of ``mode``, and a ``seg`` mask of that mode."""
    with pf.open_writer(path, format="zip", mode=archive_mode, classes=["a"], shape=(20, 24, 3), encoding="png",
                        fields=["view=image", "seg=image"]) as writer:
        for i in range(count):
            data = mode_png(mode, shift=i)
            writer.add(data, 0, key=f"s{i}", fields={"view": data, "seg": data})


@pytest.mark.parametrize("archive_mode", ["raw", "encoded"])
@pytest.mark.parametrize("mode", PNG_MODES)
def test_an_image_field_is_given_as_its_image_on_every_path(tmp_path, mode, archive_mode):
    """A view (an image field asked for as "value" or "image") comes in the sample image's own form, RGB, from
    the dataset in every output and from make_loader whole, cut while decoding, or resized: never a palette's
    indices, a 1-bit image's bools, or a grey or alpha channel that the image does not have."""
    from torchvision.transforms import v2

    path = tmp_path / f"{mode}.zip"
    write_views(path, mode, archive_mode)
    for output in ("tensor", "numpy", "pil"):
        dataset = pf.PackedDataset(path, output=output, fields={"view": "value"})
        for i in range(len(dataset)):
            sample = dataset[i]
            if output == "pil":
                assert sample["view"].mode == sample["image"].mode == "RGB", (output, i)
            got, want = np.asarray(sample["view"]), np.asarray(sample["image"])
            assert got.dtype == want.dtype == np.uint8 and np.array_equal(got, want), (output, i)
    sample = pf.PackedDataset(path, output="tensor", fields={"view": "image"})[0]
    assert type(sample["view"]).__name__ == "Image" and torch.equal(sample["view"], sample["image"])
    crop = v2.Compose([v2.RandomResizedCrop((12, 16), scale=(0.3, 1.0)), v2.RandomHorizontalFlip()])
    paths = [{}, {"transform": crop}, {"transform": crop, "num_workers": 2}]
    paths += [{"size": (16, 14)}, {"size": 12, "resize_mode": "shorter-side-center-crop"}] \
        if archive_mode == "encoded" else []
    for role in ("value", "image"):
        for options in paths:
            loader = pf.make_loader(path, batch_size=3, **{"num_workers": 0, **options}, fields={"view": role})
            for batch in loader:
                view = batch["view"].as_subclass(torch.Tensor)
                assert view.shape == batch["image"].shape and view.shape[1] == 3, (role, options)
                assert torch.equal(view, batch["image"]), (role, options)  # the same pixels, the same cut


@pytest.mark.parametrize("archive_mode", ["raw", "encoded"])
@pytest.mark.parametrize("mode", PNG_MODES)
def test_an_image_field_asked_for_as_a_mask_is_its_stored_values_on_every_path(tmp_path, mode, archive_mode):
    """A mask is a palette's indices and a 1-bit image's 0 and 1 (uint8, one channel) from the dataset and from
    make_loader whole, cut or resized; an image with more than one channel is no mask, on every path alike."""
    from torchvision.transforms import v2

    path = tmp_path / f"{mode}.zip"
    write_views(path, mode, archive_mode)
    crop = v2.Compose([v2.RandomResizedCrop((12, 16), scale=(0.3, 1.0)), v2.RandomHorizontalFlip()])
    paths = [{}, {"transform": crop}] + ([{"size": (16, 14)}] if archive_mode == "encoded" else [])
    if mode in ("LA", "RGBA"):
        with pytest.raises(pf.CorruptSampleError, match=rf"s0.*field 'seg'.*{mode} image is no mask"):
            pf.PackedDataset(path, output="tensor", fields={"seg": "mask"})[0]
        for options in paths:
            with pytest.raises(pf.CorruptSampleError, match=rf"field 'seg'.*{mode} image is no mask"):
                list(pf.make_loader(path, batch_size=3, num_workers=0, fields={"seg": "mask"}, **options))
        return
    stored = [np.asarray(Image.open(io.BytesIO(mode_png(mode, shift=i)))).astype(np.uint8) for i in range(5)]
    dataset = pf.PackedDataset(path, output="tensor", fields={"seg": "mask"})
    for i, want in enumerate(stored):
        got = dataset[i]["seg"].as_subclass(torch.Tensor)
        assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want), i
    whole = list(pf.make_loader(path, batch_size=5, num_workers=0, shuffle=False, fields={"seg": "mask"}))
    assert np.array_equal(whole[0]["seg"].as_subclass(torch.Tensor).numpy(), np.stack(stored))
    for options in paths[1:]:
        for batch in pf.make_loader(path, batch_size=3, num_workers=0, fields={"seg": "mask"}, **options):
            seg = batch["seg"].as_subclass(torch.Tensor)
            assert seg.dtype == torch.uint8 and seg.shape == batch["image"].shape[:1] + batch["image"].shape[2:]
            assert set(seg.unique().tolist()) <= ({0, 1} if mode == "1" else {0, 1, 2, 3, 4}), options


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fields_come_on_the_loaders_device(tmp_path):
    path = tmp_path / "ramps.zip"
    write_ramps(path)
    for batch in pf.make_loader(path, batch_size=3, num_workers=2, device="cuda", size=32,
                                fields={"mask": "mask", "boxes": "boxes:XYXY"}):
        assert batch["image"].is_cuda and batch["mask"].is_cuda and all(b.is_cuda for b in batch["boxes"])
        assert_cut_alike({k: (v.cpu() if isinstance(v, torch.Tensor) else [b.cpu() for b in v])
                          for k, v in batch.items()})
