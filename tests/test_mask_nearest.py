"""Masks are resized by torchvision's nearest-neighbour rule, at conversion and on read.

torchvision's v2 ``Resize`` on a ``Mask`` (NEAREST) is ``torch.nn.functional.interpolate(mode="nearest")``:
output pixel d takes source pixel ``floor(d * in / out)``.  PIL's NEAREST takes the pixel under each output
pixel's centre, ``floor((d + 0.5) * in / out)``, which picks another pixel on a share of a mask's edges
(0.38% of the pixels of region masks resized to sizes such as a segmentation recipe draws), so a mask packed
at a size, or cut at decode, would not be the one torchvision gives from the files.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats import policy
from packed_formats.loading.field_batches import cut_mask

from .test_fields import png

SIZES = [((30, 40), (17, 23)), ((30, 40), (71, 97)), ((37, 50), (37, 25)), ((19, 13), (38, 26)), ((50, 37), (29, 41))]


def noise_mask(height, width, seed=0) -> np.ndarray:
    """Classes changing at every pixel: any pixel another rule picks shows."""
    return np.random.default_rng(seed).integers(0, 21, (height, width), dtype=np.uint8)


def torchvision_nearest(mask: np.ndarray, size) -> np.ndarray:
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    resized = F.resize(tv_tensors.Mask(torch.from_numpy(np.array(mask))[None]), list(size),
                       interpolation=F.InterpolationMode.NEAREST)
    return resized[0].numpy()


@pytest.mark.parametrize("source,size", SIZES)
def test_a_mask_cut_on_read_is_torchvisions_resize(source, size):
    mask = noise_mask(*source)
    got = cut_mask(mask, ((0, 0) + source, (source[1], source[0]), size))
    np.testing.assert_array_equal(got, torchvision_nearest(mask, size))
    top, left = 3, 5  # a crop, then the resize: torchvision's resized_crop on the mask
    crop = (top, left, source[0] - 7, source[1] - 9)
    got = cut_mask(mask, (crop, (source[1], source[0]), size))
    np.testing.assert_array_equal(got, torchvision_nearest(mask[top:top + crop[2], left:left + crop[3]], size))


@pytest.mark.parametrize("mode", ["L", "P", "I;16"])
@pytest.mark.parametrize("source,size", SIZES)
def test_a_mask_resized_at_conversion_is_torchvisions_resize_in_its_own_mode(source, size, mode):
    mask = noise_mask(*source)
    image = Image.fromarray(mask.astype(np.uint16) * 1000 if mode == "I;16" else mask,
                            "P" if mode == "P" else None)
    if mode == "P":
        image.putpalette([v for k in range(256) for v in (k, 255 - k, k // 2)])
    resized = policy.resize(image, size, "stretch", resample=Image.Resampling.NEAREST)
    assert resized.mode == image.mode and resized.size == (size[1], size[0])
    if mode == "P":
        assert resized.getpalette() == image.getpalette()
    np.testing.assert_array_equal(np.asarray(resized), torchvision_nearest(np.asarray(image), size))


@pytest.mark.filterwarnings("ignore:.*1 class found")
def test_convert_packs_a_mask_as_torchvision_resizes_it(tmp_path):
    mask = noise_mask(30, 40, seed=3)
    with tarfile.open(tmp_path / "shard-000.tar", "w") as tar:
        for extension, data in {"png": png(np.zeros((30, 40, 3), np.uint8)), "cls": b"0", "seg.png": png(mask)}.items():
            info = tarfile.TarInfo(f"s0000.{extension}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out.zip"
    pf.convert(tmp_path / "shard-000.tar", out, fields=["seg=image"], size=(17, 23), quiet=True, workers=1)
    with pf.open_archive(out) as reader:
        stored = np.asarray(Image.open(io.BytesIO(reader.read_field(0, "seg"))))
    np.testing.assert_array_equal(stored, torchvision_nearest(mask, (17, 23)))
