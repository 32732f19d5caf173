"""``image_decode``: PyTorch's image decoders picked in one place, TorchCodec's first and torchvision's
where TorchCodec cannot be used.  Both are checked on the CPU (TorchCodec's skipped, saying why, where
it does not import), on real files, and the references of the benchmarks decode with no deprecation
warning where TorchCodec is installed."""

from __future__ import annotations

import io
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats import image_decode
from packed_formats import transforms as T
from packed_formats.bench import references, segmentation
from packed_formats.synthetic import make_photo_folder

TORCHCODEC = pytest.mark.skipif(image_decode.torchcodec_error() is not None,
                                reason=f"TorchCodec cannot decode images here: {image_decode.torchcodec_error()}")
# torchvision 0.29 on deprecates its decoders: the tests that pick them on purpose expect that warning
TORCHVISION = pytest.mark.filterwarnings("ignore::DeprecationWarning")
BOTH = [pytest.param("torchcodec", marks=TORCHCODEC), pytest.param("torchvision", marks=TORCHVISION)]


@pytest.fixture
def without_torchcodec(monkeypatch):
    """A process in which ``import torchcodec`` fails, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    image_decode._torchcodec.cache_clear()
    yield
    image_decode._torchcodec.cache_clear()


def photo(seed: int = 0, shape=(67, 93)) -> np.ndarray:
    """A smooth HxWx3 uint8 image (odd sizes: the decoders' chroma upsampling at the edges is seen)."""
    rng = np.random.default_rng(seed)
    walk = np.cumsum(rng.normal(0, 6, shape + (3,)), axis=1) + np.cumsum(rng.normal(0, 6, shape + (3,)), axis=0)
    return np.clip(walk + 128, 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, format: str, **options) -> torch.Tensor:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=format, **options)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


JPEGS = {"4:2:0": {}, "4:4:4": {"subsampling": 0}, "progressive": {"progressive": True}}


@pytest.mark.parametrize("using", BOTH)
def test_each_decoder_reads_jpegs_as_pillow_does_and_pngs_exactly(using):
    pixels = photo()
    blobs = [encoded(pixels, "JPEG", quality=90, **options) for options in JPEGS.values()]
    for blob, image in zip(blobs, image_decode.decode(blobs, using=using)):
        expected = np.array(Image.open(io.BytesIO(blob.numpy().tobytes())).convert("RGB"))
        assert image.dtype == torch.uint8 and image.shape == (3, 67, 93)
        assert (image.permute(1, 2, 0).int() - torch.from_numpy(expected).int()).abs().max() <= 1
    rgb, mask = image_decode.decode([encoded(pixels, "PNG"), encoded(pixels[..., 0] // 50, "PNG")], "UNCHANGED",
                                    using=using)
    assert torch.equal(rgb.permute(1, 2, 0), torch.from_numpy(pixels))
    assert mask.shape == (1, 67, 93) and torch.equal(mask[0], torch.from_numpy(pixels[..., 0] // 50))
    grey = encoded(pixels[..., 0], "JPEG")
    assert image_decode.decode([grey], using=using)[0].shape == (3, 67, 93)  # RGB: three channels


@TORCHCODEC
@TORCHVISION
def test_both_decoders_give_the_same_pixels():
    blobs = [encoded(photo(seed), "JPEG", quality=85, **options) for seed, options in enumerate(JPEGS.values())]
    for ours, theirs in zip(image_decode.decode(blobs, using="torchcodec"),
                            image_decode.decode(blobs, using="torchvision")):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("using", BOTH)
def test_each_decoder_refuses_a_damaged_jpeg(using):
    data = encoded(photo(), "JPEG")
    for bad in (data[: len(data) // 2], torch.cat([data[:3], torch.zeros(100, dtype=torch.uint8)])):
        with pytest.raises((RuntimeError, ValueError)):
            image_decode.decode([bad], using=using)


def test_an_unknown_mode_or_decoder_is_refused():
    blob = encoded(photo(), "PNG")
    with pytest.raises(ValueError, match="mode must be one of"):
        image_decode.decode([blob], "CMYK")
    with pytest.raises(ValueError, match="using must be one of"):
        image_decode.decode([blob], using="pillow")


@TORCHCODEC
def test_torchcodec_is_the_default_where_it_imports():
    assert image_decode.decoder() == "torchcodec"
    assert image_decode.describe().startswith("torchcodec ")


@TORCHVISION
def test_without_torchcodec_torchvision_decodes_and_says_why(without_torchcodec):
    assert image_decode.decoder() == "torchvision"
    assert "torchcodec" in image_decode.torchcodec_error() and "torchcodec unusable" in image_decode.describe()
    pixels = photo()
    assert torch.equal(image_decode.decode([encoded(pixels, "PNG")])[0].permute(1, 2, 0), torch.from_numpy(pixels))
    with pytest.raises(ImportError, match=r"packed_formats\[torchcodec\]"):
        image_decode.decode([encoded(pixels, "PNG")], using="torchcodec")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-decode")
    folder = make_photo_folder(root / "photos", images_per_class=4, classes=("a", "b"), sizes=(120, 200), seed=3)
    return pf.convert(folder, str(root / "photos.zip"), mode="encoded", quiet=True).destination


def device_epoch(path):
    loader = pf.make_loader(path, batch_size=4, num_workers=0, seed=5, decode="device", transform=T.train(96),
                            return_index=True)
    return [tuple(batch) for batch in loader]


@TORCHCODEC
@TORCHVISION
def test_decode_on_the_device_gives_the_same_batches_with_either_decoder(photos, monkeypatch):
    ours = device_epoch(photos)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torchcodec", None)
        patch.setitem(sys.modules, "torchcodec.decoders", None)
        image_decode._torchcodec.cache_clear()
        try:
            assert image_decode.decoder() == "torchvision"
            theirs = device_epoch(photos)
        finally:
            image_decode._torchcodec.cache_clear()
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@TORCHCODEC
def test_the_references_decode_with_no_deprecation_warning(tmp_path):
    blob = encoded(photo(), "JPEG").numpy().tobytes()
    root = tmp_path / "set"
    segmentation.make_segmentation_folder(str(root), 2, sizes=(40, 56))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert references.decode_to(blob, 32).shape == (3, 32, 32)
        assert references.bare_decode_rate([blob], 1, "spawn", seconds=0.01)["decoder"].startswith("torchcodec ")
        image, mask = segmentation.FilesWithMasks(str(root), segmentation.transform(24))[0]
    assert image.shape == (3, 24, 24) and mask.shape == (24, 24)


def test_doctor_names_the_decoder(photos):
    jpeg = pf.diagnose(photos)["jpeg"]
    assert jpeg["image_decoder"] == image_decode.describe() and jpeg["torchvision_decode_jpeg"] is True
