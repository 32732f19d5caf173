"""Decoding on the device costs a few operator calls per batch, whatever its size, and keeps its pixels.

A GPU pays for every operator call the main process makes (a launch each), so the
device path (``make_loader(decode="device")``: batched decode, crops resized,
then the rest of the transform) must not make calls per image.  Run here on the
CPU, where the same code path uses the decoder's CPU build, the calls that
compute or copy are counted (views, allocations and the decoder's own calls
aside) for batches of 64 and 256.
"""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

import packed_formats as pf
from packed_formats import transforms as T
from packed_formats.loading import device_decode
from packed_formats.loading.device import copy_then_transform, in_memory_format
from packed_formats.synthetic import make_photo_folder

ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"}
DECODERS = {"torchcodec_ns", "image"}  # the operator namespaces of TorchCodec's and torchvision's decoders


class CountedCalls(TorchDispatchMode):
    """The operator calls that compute or copy, by name: views, allocations and the JPEG decoder's calls
    (TorchCodec's ``torchcodec_ns`` operators, torchvision's ``image`` ones) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or func.namespace in DECODERS or name in ALLOCATIONS):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """An encoded ZIP of 256 photographic JPEGs of 48-96 px (small: the count does not depend on sizes)."""
    root = tmp_path_factory.mktemp("op-counts")
    folder = make_photo_folder(root / "photos", images_per_class=64, sizes=(48, 96), seed=5)
    return pf.convert(folder, str(root / "photos.zip"), mode="encoded", quiet=True).destination


def device_batch(path, batch_size, memory_format=torch.contiguous_format, **options):
    """(counted calls, images) of the main process's share of one batch on the device path (device="cpu"):
    the batch's decode, resize and transform as make_loader's device path runs them."""
    loader = pf.make_loader(path, batch_size=batch_size, decode="device", device="cpu", shuffle=False, seed=3,
                            memory_format=memory_format, **options)
    encoded, labels, _, _ = loader.batch_reader[next(iter(loader.sampler))]
    decoder = device_decode.DeviceDecoder(loader.reader, memory_format)
    rest = T.batchwise(T.with_memory_format(loader.transform, memory_format))
    with CountedCalls() as counted:
        images, _ = next(copy_then_transform(iter([(encoded, labels)]), torch.device("cpu"), rest,
                                             lambda k: torch.Generator().manual_seed(k), memory_format, decoder))
    return counted, images


@pytest.mark.parametrize("options, most", [(dict(size=256), 64), (dict(transform=T.train(224)), 96)],
                         ids=["size=256", "train(224)"])
def test_a_device_batch_takes_a_few_operator_calls_whatever_its_size(photos, options, most):
    small, images = device_batch(photos, 64, **options)
    large, images2 = device_batch(photos, 256, **options)
    assert images.shape[0] == 64 and images2.shape[0] == 256
    assert large.total <= most, large.calls
    assert large.total == small.total, (small.calls, large.calls)  # none per image
    assert "_upsample_bilinear2d_aa" not in large.calls


def test_channels_last_is_written_by_the_normalisation_with_no_copy_after(photos):
    options = dict(transform=T.train(224))
    contiguous, expected = device_batch(photos, 64, **options)
    channels_last, images = device_batch(photos, 64, torch.channels_last, **options)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert in_memory_format(images, torch.channels_last) is images
    copies = [c.calls["copy_"] + c.calls["clone"] + c.calls["_to_copy"] for c in (contiguous, channels_last)]
    assert copies[1] == copies[0]  # neither the decoded nor the float batch is copied into the layout
    assert torch.equal(images, expected)


# ---- the pixels ----
def photo(width: int, height: int, seed: int) -> torch.Tensor:
    """A 3xHxW uint8 photograph crop, decoded as the device decoder would get it."""
    rng = np.random.default_rng(seed)
    source = Image.open(pf.synthetic.sample_photographs()[0]).convert("RGB")
    left, top = int(rng.integers(0, source.width - width // 2)), int(rng.integers(0, source.height - height // 2))
    crop = source.crop((left, top, left + width // 2, top + height // 2)).resize((width, height))
    out = io.BytesIO()
    crop.save(out, format="JPEG", quality=90)
    return device_decode.decode_jpegs([torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)],
                                      torch.device("cpu"))[0]


def reference(image: torch.Tensor, box, size) -> torch.Tensor:
    """torchvision's antialiased bilinear resize of the box, one image at a time."""
    from torchvision.transforms.v2 import functional as tvf

    top, left, height, width = box
    return tvf.resize(image[:, top : top + height, left : left + width], list(size), antialias=True)


def resampled(images, boxes, size, limit=device_decode.GATHER_LIMIT) -> torch.Tensor:
    out = torch.zeros((len(images), 3) + tuple(size), dtype=torch.uint8)
    device_decode.resample(images, np.array(boxes), size, out, list(range(len(images))), limit=limit)
    return out


SIZES = [(375, 500), (500, 333), (97, 143), (300, 40), (224, 224), (40, 700)]
BOXES = [(0, 0, 375, 500), (50, 20, 400, 300), (10, 30, 60, 100), (100, 5, 150, 30), (0, 0, 224, 224), (5, 0, 30, 700)]


@pytest.mark.parametrize("size", [(224, 224), (64, 96), (256, 256)])
def test_batched_resize_is_torchvisions_antialiased_resize_within_two_levels(size):
    images = [photo(w, h, seed) for seed, (h, w) in enumerate(SIZES)]
    out = resampled(images, BOXES, size)
    for image, box, got in zip(images, BOXES, out):
        assert (got.int() - reference(image, box, size).int()).abs().max() <= 2


def test_batched_resize_keeps_antialiasing_on_a_pattern_finer_than_the_output():
    """Diagonal stripes of a 3-pixel period downscaled 4x: the antialiased reference is a nearly flat
    grey, a resize that skips source pixels (no antialiasing) shows a coarse false pattern."""
    y, x = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    stripes = (((x + y) % 3 == 0) * 255).to(torch.uint8).expand(3, 256, 256).contiguous()
    box = (0, 0, 256, 256)
    got = resampled([stripes], [box], (64, 64))[0]
    want = reference(stripes, box, (64, 64))
    aliased = TF.interpolate(stripes[None].float(), size=(64, 64), mode="bilinear", antialias=False)[0]
    assert (got.int() - want.int()).abs().max() <= 2
    assert got.float().std() < 0.25 * aliased.std()


def test_images_decoded_interleaved_or_planar_resize_the_same():
    """The CPU decoders give HxWxC memory, nvJPEG CxHxW; a batch mixing both (a CPU fallback) works."""
    images = [photo(w, h, seed) for seed, (h, w) in enumerate(SIZES)]
    assert not images[0].is_contiguous()  # interleaved, as decoded here
    planar = [image.contiguous() for image in images]
    mixed = [image if j % 2 else image.contiguous() for j, image in enumerate(images)]
    expected = resampled(images, BOXES, (80, 80))
    assert torch.equal(resampled(planar, BOXES, (80, 80)), expected)
    assert torch.equal(resampled(mixed, BOXES, (80, 80)), expected)


def test_a_batch_too_large_for_one_pass_is_resized_in_groups_to_the_same_pixels():
    images = [photo(w, h, seed) for seed, (h, w) in enumerate(SIZES)]
    whole = resampled(images, BOXES, (64, 64))
    assert device_decode._groups(np.array([b[2] for b in BOXES]), np.array([b[3] for b in BOXES]), 200_000) != 1
    assert torch.equal(resampled(images, BOXES, (64, 64), limit=200_000), whole)
    assert torch.equal(resampled(images, BOXES, (64, 64), limit=1), whole)  # one image at a time


def test_a_generator_state_handed_over_inside_a_larger_buffer_is_restored():
    """A worker's slot hands the batch's generator state on as a view into its memory."""
    generator = torch.Generator().manual_seed(9)
    state = generator.get_state()
    buffer = torch.zeros(100 + len(state), dtype=torch.uint8)
    buffer[100:] = state
    restored = device_decode.restored(buffer[100:])
    assert torch.equal(torch.rand(4, generator=restored), torch.rand(4, generator=generator))
    assert device_decode.restored(torch.zeros(0, dtype=torch.uint8)) is None


# ---- the transforms' own switches ----
def test_fused_train_writes_channels_last_directly_with_the_same_values():
    batch = torch.randint(0, 256, (4, 64, 80, 3), dtype=torch.uint8).permute(0, 3, 1, 2)  # as workers read
    expected = T.train(32)(batch, generator=torch.Generator().manual_seed(1))
    laid_out = T.with_memory_format(T.train(32), torch.channels_last)
    got = laid_out(batch, generator=torch.Generator().manual_seed(1))
    assert expected.is_contiguous() and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, expected)


def test_with_memory_format_rebuilds_only_the_final_normalisation():
    train = T.train(32)
    laid_out = T.with_memory_format(train, torch.channels_last)
    assert laid_out is not train and train._parts[2].memory_format is None  # the given transform is kept
    assert laid_out._parts[2].memory_format == torch.channels_last and laid_out._parts[0] is train._parts[0]
    val = T.with_memory_format(T.val(32), torch.channels_last)
    assert val.transforms[-1].memory_format == torch.channels_last
    erase = T.train(32, random_erase=0.5)
    assert T.with_memory_format(erase, torch.channels_last) is erase  # ends with RandomErasing: as it is
    assert T.with_memory_format(train, None) is train


def test_batchwise_flip_normalize_is_bit_identical_to_the_fused_pass():
    _, rest = T.at_decode.split_at_decode(T.train(32))
    batch = torch.randint(0, 256, (6, 32, 32, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    fused = rest(batch, generator=torch.Generator().manual_seed(4))
    with CountedCalls() as counted:
        batched = T.batchwise(rest)(batch, generator=torch.Generator().manual_seed(4))
    assert torch.equal(batched, fused)
    assert counted.calls["flip"] == 1 and counted.calls["copy_"] == 1


def test_batchwise_train_resizes_within_a_level_of_the_fused_pass():
    batch = torch.randint(0, 256, (6, 3, 64, 80), dtype=torch.uint8)
    fused = T.train(32)(batch, generator=torch.Generator().manual_seed(2))
    batched = T.batchwise(T.train(32))(batch, generator=torch.Generator().manual_seed(2))
    assert (batched - fused).abs().max() <= 1 / (255 * min(T.IMAGENET_STD)) + 1e-5
