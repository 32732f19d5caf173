"""Encoded archives do a transform's first crop while decoding: the crop is drawn in each source
image's own size, the JPEG decoded at the least DCT scale that covers it, and only it resized."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats import codecs, native, policy
from packed_formats import transforms as T
from packed_formats.synthetic import make_photo_folder
from packed_formats.transforms.at_decode import CenterCropAtDecode, RandomCropAtDecode, split_at_decode


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """An encoded ZIP of 24 photographic JPEGs of mixed sizes (120-300 px) in 3 classes."""
    root = tmp_path_factory.mktemp("crop-at-decode")
    folder = make_photo_folder(root / "photos", images_per_class=8, classes=("a", "b", "c"), sizes=(120, 300), seed=3)
    return pf.convert(folder, str(root / "photos.zip"), mode="encoded", quiet=True).destination


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(ramp + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def reference_crop(data: bytes, box, size) -> torch.Tensor:
    """The slow way: decode the whole image, cut the box out, resize it."""
    top, left, h, w = box
    whole = torch.from_numpy(policy.decode(data, 3)).permute(2, 0, 1)
    return native.resize(whole[:, top : top + h, left : left + w], size)


# ---- the draws ----
def test_crops_drawn_per_image_size_are_the_draws_made_for_a_batch_of_that_size():
    """Row j of a batch of mixed sizes is exactly what a batch all of image j's size draws at row j."""
    crop = T.RandomResizedCrop(32)
    heights, widths = torch.tensor([40, 300, 64, 500, 17, 230]), torch.tensor([300, 40, 64, 375, 90, 230])
    mixed = crop.get_params(6, heights, widths, gen(7))
    for j in range(6):
        alone = crop.get_params(6, int(heights[j]), int(widths[j]), gen(7))
        assert [int(p[j]) for p in mixed] == [int(p[j]) for p in alone]
    tops, lefts, h, w = mixed
    assert torch.all((tops >= 0) & (lefts >= 0) & (tops + h <= heights) & (lefts + w <= widths))


def test_crop_boxes_follow_torchvisions_random_resized_crop_distribution():
    """Area share, aspect and position of 4,000 boxes in a 300x500 image against torchvision's own draws."""
    from torchvision.transforms import RandomResizedCrop

    n = 4000
    ours = RandomCropAtDecode(T.RandomResizedCrop(64)).boxes(np.full(n, 300), np.full(n, 500), gen(1))
    torch.manual_seed(2)
    theirs = np.array([RandomResizedCrop.get_params(torch.empty(3, 300, 500), (0.08, 1.0), (3 / 4, 4 / 3))
                       for _ in range(n)])

    def ks(a: np.ndarray, b: np.ndarray) -> float:  # two-sample Kolmogorov-Smirnov statistic
        grid = np.sort(np.concatenate([a, b]))
        return float(np.abs(np.searchsorted(np.sort(a), grid, "right") / len(a)
                            - np.searchsorted(np.sort(b), grid, "right") / len(b)).max())

    def features(box: np.ndarray):
        top, left, h, w = box.T.astype(np.float64)
        return h * w / (300 * 500), w / h, (top + h / 2) / 300, (left + w / 2) / 500

    for a, b in zip(features(ours), features(theirs)):
        assert ks(a, b) < 0.05  # 1.36 * sqrt(2 / 4000) = 0.030 is the 5% level; a real difference is far above


def test_val_boxes_are_resize_then_center_crop_in_source_pixels():
    boxes = CenterCropAtDecode(256, T.CenterCrop(224)).boxes(np.array([512, 300]), np.array([512, 600]), None)
    assert boxes.tolist() == [[32, 32, 448, 448], [19, 169, 262, 262]]


def test_only_transforms_that_start_with_a_crop_are_split():
    crop, rest = split_at_decode(T.train(32))
    assert isinstance(crop, RandomCropAtDecode) and isinstance(rest, T.FlipNormalize)  # the rest in one pass
    assert [type(t).__name__ for t in rest.transforms] == ["RandomHorizontalFlip", "Normalize"]
    crop, rest = split_at_decode(T.val(32, resize=40))
    assert isinstance(crop, CenterCropAtDecode) and isinstance(rest, T.FlipNormalize)
    assert [type(t).__name__ for t in rest.transforms] == ["Normalize"]
    crop, rest = split_at_decode(T.Compose([T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.ToFloat(), abs]))
    assert type(rest) is T.Compose and len(rest.transforms) == 3
    assert split_at_decode(T.RandomResizedCrop(8)) is not None
    assert split_at_decode(T.Compose([T.RandomHorizontalFlip(), T.RandomResizedCrop(8)])) is None
    assert split_at_decode(T.RandomResizedCrop(8, antialias=False)) is None
    assert split_at_decode(T.Normalize()) is None and split_at_decode(None) is None


# ---- the decode ----
@pytest.mark.parametrize("box", [(0, 0, 60, 80), (17, 33, 101, 90), (40, 80, 200, 240)])
def test_a_crop_that_needs_full_resolution_is_the_whole_decode_cut_and_resized(box):
    data = jpeg(320, 240)
    got = policy.decode_crop(data, 3, box, (112, 112))  # a half-scale decode would not cover any box at 112x112
    assert torch.equal(torch.from_numpy(got).permute(2, 0, 1), reference_crop(data, box, (112, 112)))


@pytest.mark.parametrize("box", [(100, 200, 1000, 1200), (37, 411, 523, 601), (0, 0, 1200, 1600)])
def test_a_large_crop_for_a_small_output_decodes_at_a_reduced_scale_and_still_matches(box):
    """At 1/2, 1/4 or 1/8 scale the crop's edges fall within half a decoded pixel of the box: on a
    smooth picture (where the DCT's and the resize's filters agree) the result is the slow way's."""
    y, x = np.mgrid[0:1200, 0:1600]
    smooth = np.stack([x / 1600 * 255, y / 1200 * 255, 127 + 100 * np.sin(x / 90.0) * np.cos(y / 70.0)], axis=2)
    out = io.BytesIO()
    Image.fromarray(smooth.astype(np.uint8)).save(out, format="JPEG", quality=95)
    data = out.getvalue()
    got = torch.from_numpy(policy.decode_crop(data, 3, box, (112, 112))).permute(2, 0, 1)
    expected = reference_crop(data, box, (112, 112))
    assert (got.float() - expected.float()).abs().mean() < 1.5
    assert (got.float() - expected.float()).abs().max() < 12


def test_grey_png_and_cmyk_images_are_cropped_like_any_other():
    data = jpeg(200, 150)
    grey = policy.decode_crop(data, 1, (10, 20, 100, 120), (32, 32))
    colour = policy.decode_crop(data, 3, (10, 20, 100, 120), (32, 32))
    assert grey.shape == (32, 32, 1) and colour.shape == (32, 32, 3)
    png = io.BytesIO()
    Image.open(io.BytesIO(data)).save(png, format="PNG")
    assert policy.decode_crop(png.getvalue(), 3, (0, 0, 150, 200), (16, 16)).shape == (16, 16, 3)
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("CMYK").save(cmyk, format="JPEG")
    assert policy.decode_crop(cmyk.getvalue(), 3, (0, 0, 150, 200), (16, 16)).shape == (16, 16, 3)


def test_a_truncated_jpeg_is_refused_not_filled():
    data = jpeg(200, 150)
    with pytest.raises(codecs.DecodeError):
        policy.decode_crop(data[: len(data) // 2], 3, (0, 0, 150, 200), (32, 32))
    with pytest.raises(codecs.DecodeError):
        policy.image_size(b"\xff\xd8\xff" + b"\x00" * 20)


# ---- through make_loader ----
@pytest.mark.parametrize("recipe", ["train", "val"])
def test_make_loader_crops_mixed_size_photos_at_decode_without_a_size(photos, recipe):
    transform = T.train(48) if recipe == "train" else T.val(48, resize=56)
    loader = pf.make_loader(photos, batch_size=8, num_workers=0, transform=transform, shuffle=False,
                            return_index=True)
    images, labels, indices = next(iter(loader))
    assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32 and images.is_contiguous()
    if recipe == "val":  # deterministic: each image is the resize-then-centre-crop box of its own decode
        with pf.open_archive(photos) as reader:
            for image, i in zip(images, indices.tolist()):
                data = reader.read(i)
                width, height = policy.image_size(data)
                box = CenterCropAtDecode(56, T.CenterCrop(48)).boxes(np.array([height]), np.array([width]), None)[0]
                crop = torch.from_numpy(policy.decode_crop(data, 3, tuple(box), (48, 48))).permute(2, 0, 1)
                assert torch.allclose(image, T.Normalize()(crop[None].contiguous())[0])
    else:  # every image gets its own crop: no two flips-and-crops of different photos coincide by accident
        assert len({tuple(image[:, 0, 0].tolist()) for image in images}) == 8


def test_crops_at_decode_are_the_same_with_any_number_of_workers(photos):
    def epoch(workers):
        loader = pf.make_loader(photos, batch_size=8, num_workers=workers, transform=T.train(32), seed=5)
        loader.sampler.set_epoch(1)
        return [(images, labels) for images, labels in loader]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the way
        alone, two = epoch(0), epoch(2)
    assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(alone, two))
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(alone, epoch(0)[::-1]))


def test_a_corrupt_photo_is_named_or_skipped_in_the_crop_path(photos, tmp_path):
    with pf.open_archive(photos) as reader:
        samples = [(reader.read(i), int(reader.labels[i]), reader.key(i)) for i in range(len(reader))]
    data, label, key = samples[5]
    samples[5] = (data[: len(data) // 3], label, key)  # truncated before it was packed: its CRC is right
    bad_key = key
    bad = str(tmp_path / "bad.zip")
    with pf.open_writer(bad, mode="encoded", classes=["a", "b", "c"]) as writer:
        for sample in samples:
            writer.add(*sample)
    with pytest.raises(pf.CorruptSampleError, match=bad_key):
        list(pf.make_loader(bad, batch_size=8, num_workers=0, transform=T.train(32), shuffle=False))
    loader = pf.make_loader(bad, batch_size=8, num_workers=0, transform=T.train(32), shuffle=False, on_error="skip")
    with pytest.warns(pf.SkippedSampleWarning, match=bad_key):
        sizes = [len(images) for images, _ in loader]
    assert sizes == [7, 8, 8]


# ---- through containers ----
def test_a_compose_that_starts_with_a_crop_is_split_however_nested():
    crop, rest = split_at_decode(T.Compose([T.train(32)]))
    assert isinstance(crop, RandomCropAtDecode) and isinstance(rest, T.FlipNormalize)
    crop, rest = split_at_decode(T.Compose([T.Compose([T.val(32, resize=40)]), abs]))
    assert isinstance(crop, CenterCropAtDecode) and crop.size == (32, 32)
    assert type(rest) is T.Compose and isinstance(rest.transforms[0], T.FlipNormalize) and rest.transforms[1] is abs
    assert split_at_decode(T.Compose([T.Compose([T.Normalize()]), T.train(32)])) is None


def test_mixup_and_cutmix_after_train_leave_the_crop_at_decode_and_keep_the_labels_step():
    from torchvision.transforms import v2

    mixer = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=3), v2.CutMix(alpha=1.0, num_classes=3)])
    crop, rest = split_at_decode(T.Compose([T.train(32), mixer]))
    assert isinstance(crop, RandomCropAtDecode) and crop.size == (32, 32)
    assert type(rest) is T.Compose and rest.takes_labels
    assert isinstance(rest.transforms[0], T.FlipNormalize) and rest.transforms[1] is mixer


@pytest.mark.parametrize("tv", ["v1", "v2"])
def test_a_torchvision_compose_that_starts_with_a_bilinear_crop_is_split(tv):
    import torchvision.transforms as v1
    from torchvision.transforms import v2

    t = v1 if tv == "v1" else v2
    flip = t.RandomHorizontalFlip()
    crop, rest = split_at_decode(t.Compose([t.RandomResizedCrop(32, scale=(0.25, 1.0)), flip]))
    assert isinstance(crop, RandomCropAtDecode) and crop.size == (32, 32) and crop.crop.scale == (0.25, 1.0)
    assert type(rest) is t.Compose and rest.transforms == [flip]
    crop, rest = split_at_decode(t.Compose([t.Resize(40), t.CenterCrop(32)]))
    assert isinstance(crop, CenterCropAtDecode) and (crop.resize, crop.size, rest) == (40, (32, 32), None)
    nearest = t.RandomResizedCrop(32, interpolation=t.InterpolationMode.NEAREST)
    assert split_at_decode(t.Compose([nearest])) is None  # the decoder resizes bilinearly only
    assert split_at_decode(t.Compose([t.Resize(40, max_size=50), t.CenterCrop(32)])) is None
    assert split_at_decode(t.Compose([flip, t.RandomResizedCrop(32)])) is None


def test_make_loader_mixes_labels_of_photos_cropped_at_decode(photos):
    """The README's MixUp/CutMix recipe on an encoded archive of mixed sizes, with no size=."""
    from torchvision.transforms import v2

    mixer = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=3), v2.CutMix(alpha=1.0, num_classes=3)])
    loader = pf.make_loader(photos, batch_size=8, num_workers=0, transform=T.Compose([T.train(48), mixer]))
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32
    assert labels.shape == (8, 3) and labels.dtype == torch.float32
    assert torch.allclose(labels.sum(dim=1), torch.ones(8))


def test_make_loader_crops_photos_at_decode_for_a_torchvision_pipeline(photos):
    from torchvision.transforms import v2

    transform = v2.Compose([v2.RandomResizedCrop(40), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)])
    images, labels = next(iter(pf.make_loader(photos, batch_size=8, num_workers=0, transform=transform)))
    assert images.shape == (8, 3, 40, 40) and images.dtype == torch.float32 and labels.shape == (8,)


# ---- torchvision's window ----
# Odd and even sides, portrait, landscape and square, smaller and larger than the resize: the sizes
# where a resized side or a centring margin rounds one way or the other.
RAMP_SIZES = [
    (231, 347), (347, 231), (224, 224), (225, 225), (256, 256), (257, 383), (375, 500), (500, 375),
    (333, 500), (240, 320), (241, 321), (299, 299), (300, 451), (451, 300), (480, 640), (427, 640),
    (640, 427), (183, 275), (200, 301), (301, 200), (255, 257), (257, 255), (313, 417), (417, 313),
    (500, 333), (243, 365), (365, 243), (289, 433), (199, 199), (612, 459),
]


def ramp(height: int, width: int) -> torch.Tensor:
    """uint8 [3,H,W]: across the width, down the height, and along both (a one-pixel shift shows in each)."""
    y = torch.linspace(0, 255, height).view(-1, 1).expand(height, width)
    x = torch.linspace(0, 255, width).view(1, -1).expand(height, width)
    return torch.stack([x, y, (x + y) / 2]).round().to(torch.uint8)


def torchvision_window(height: int, width: int, resize: int, crop: int):
    """(top, left, resized height, resized width): where torchvision's ``Resize(resize)`` then
    ``CenterCrop(crop)`` cut an image of ``height`` x ``width``, found by running them."""
    from torchvision.transforms import v2

    resized_h, resized_w = v2.Resize(resize)(torch.zeros(1, height, width)).shape[-2:]
    places = torch.arange(resized_h * resized_w).view(1, resized_h, resized_w)
    first = int(v2.CenterCrop(crop)(places)[0, 0, 0])
    return first // resized_w, first % resized_w, resized_h, resized_w


@pytest.mark.parametrize("height, width", RAMP_SIZES)
def test_val_boxes_are_torchvisions_resize_and_center_crop_window_to_the_nearest_source_pixel(height, width):
    """Each edge of the box lies within half a source pixel of torchvision's window taken back to the source."""
    top, left, resized_h, resized_w = torchvision_window(height, width, 256, 224)
    box = CenterCropAtDecode(256, T.CenterCrop(224)).boxes(np.array([height]), np.array([width]), None)[0]
    y0, x0, h, w = box.tolist()
    edges = [(y0, top * height / resized_h), (y0 + h, (top + 224) * height / resized_h),
             (x0, left * width / resized_w), (x0 + w, (left + 224) * width / resized_w)]
    for got, exact in edges:
        assert abs(got - exact) <= 0.5, (box.tolist(), edges)


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (major, minor)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_val_resize_and_center_crop_on_a_batch_are_torchvisions(dtype):
    """Without decoding, Resize(256) + CenterCrop(224) give torchvision's pixels exactly."""
    from torchvision.transforms import v2

    ours, theirs = T.Compose([T.Resize(256), T.CenterCrop(224)]), v2.Compose([v2.Resize(256), v2.CenterCrop(224)])
    for height, width in RAMP_SIZES:
        image = ramp(height, width).to(dtype) * (97 if dtype == torch.float32 else 1)  # float: a steep ramp
        expected = theirs(image)
        got = ours(image[None])[0]
        if dtype == torch.uint8 and (torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
                                     or _torch_before(2, 14)):
            # torchvision resizes in float there; torch 2.8's AVX512 uint8 kernel, on the floor tier, rounds a
            # few pixels one level apart (seen at 231x347 on an AVX512-BF16 machine)
            assert (got.int() - expected.int()).abs().max() <= 1
        else:
            assert torch.equal(got, expected), (height, width)


def test_val_cropped_at_decode_is_torchvisions_resize_and_center_crop(tmp_path):
    """``val(224)`` through make_loader on lossless ramps of many sizes (cut while decoding) against
    torchvision's ``Resize(256) + CenterCrop(224)`` of the same pixels: within the resize's rounding
    (the box's edges are whole source pixels, torchvision's window edges fractional ones): two levels
    anywhere, half a level on average (a window one pixel off is further on the smaller ramps)."""
    from torchvision.transforms import v2

    path = str(tmp_path / "ramps.zip")
    images = [ramp(h, w) for h, w in RAMP_SIZES]
    with pf.open_writer(path, mode="encoded", classes=["ramp"]) as writer:
        for k, image in enumerate(images):
            png = io.BytesIO()
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(png, format="PNG")
            writer.add(png.getvalue(), 0, f"ramp{k}.png")
    loader = pf.make_loader(path, batch_size=len(images), num_workers=0, shuffle=False,
                            transform=T.val(224, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)))
    cut, _ = next(iter(loader))
    theirs = v2.Compose([v2.Resize(256), v2.CenterCrop(224)])
    for got, image, size in zip(cut, images, RAMP_SIZES):
        difference = ((got * 255).round() - theirs(image).float()).abs()
        assert difference.max() <= 2 and difference.mean() <= 0.5, (size, float(difference.mean()))
