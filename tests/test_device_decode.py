"""make_loader(decode="device"): workers read and check bytes, the main process decodes on its device.

On the CPU the device path runs with the same decoder on the CPU (``image_decode``), so everything but
nvJPEG itself is checked here: it must give the batches decoding in the workers
gives (same crops, flips and pixels), route what the device decoder does not take
through the workers, and refuse bad data by name.  The CUDA tests skip without a GPU.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from packed_formats import image_decode
from packed_formats import transforms as T
from packed_formats.loading import device_decode
from packed_formats.synthetic import make_photo_folder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """(bytes, label, key) of 18 photographic JPEGs of mixed sizes (120-300 px), in 3 classes."""
    root = tmp_path_factory.mktemp("device-decode")
    folder = make_photo_folder(root / "photos", images_per_class=6, classes=("a", "b", "c"), sizes=(120, 300), seed=4)
    zipped = pf.convert(folder, str(root / "photos.zip"), mode="encoded", quiet=True).destination
    with pf.open_archive(zipped) as reader:
        return [(reader.read(i), int(reader.labels[i]), reader.key(i)) for i in range(len(reader))]


def write(path, samples) -> str:
    with pf.open_writer(str(path), mode="encoded", classes=["a", "b", "c"]) as writer:
        for data, label, key in samples:
            writer.add(data, label, key)
    return str(path)


def reencoded(data: bytes, format: str, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert(mode).save(out, format=format)
    return out.getvalue()


@pytest.fixture(scope="module")
def photos(samples, tmp_path_factory):
    return write(tmp_path_factory.mktemp("jpegs") / "photos.zip", samples)


@pytest.fixture(scope="module")
def mixed(samples, tmp_path_factory):
    """The photos with a PNG and a CMYK JPEG among them (images the device decoder does not take), and a
    greyscale JPEG (which it takes)."""
    samples = list(samples)
    for j, (format, mode) in {2: ("PNG", "RGB"), 7: ("JPEG", "L"), 11: ("JPEG", "CMYK")}.items():
        data, label, key = samples[j]
        samples[j] = (reencoded(data, format, mode), label, key)
    return write(tmp_path_factory.mktemp("mixed") / "mixed.zip", samples)


def epoch(path, decode, workers=0, device="cpu", **options):
    options.setdefault("transform", T.train(160))  # 160 px from 120-300 px photos: no DCT scaling on either path
    loader = pf.make_loader(path, batch_size=8, num_workers=workers, seed=11, decode=decode, device=device,
                            return_index=True, **options)
    loader.sampler.set_epoch(2)
    return [tuple(t.cpu() for t in batch) for batch in loader]


def assert_same(a, b, levels=0):
    """The same batches: samples, labels and pixels (within ``levels`` of 255 where a resize differs)."""
    assert len(a) == len(b)
    for (images, labels, index), (images2, labels2, index2) in zip(a, b):
        assert torch.equal(index, index2) and torch.equal(labels, labels2)
        assert images.dtype == images2.dtype and images.shape == images2.shape
        if not levels:
            assert torch.equal(images, images2)
        elif images.dtype == torch.uint8:
            assert (images.int() - images2.int()).abs().max() <= levels
        else:  # normalised: a level is 1 / (255 std)
            assert (images - images2).abs().max() <= levels / (255 * min(T.IMAGENET_STD)) + 1e-5


RESIZED = 1  # the device path resizes every batch at once in float, the workers each image in uint8


# ---- the same batches as decoding in the workers ----
@pytest.mark.parametrize("recipe", ["train", "val", "crop only"])
def test_device_decode_gives_the_batches_the_workers_give(photos, recipe):
    transform = {"train": T.train(160), "val": T.val(160, resize=170), "crop only": T.RandomResizedCrop(160)}[recipe]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: TorchCodec decodes
        if image_decode.decoder() == "torchvision":  # where it cannot, torchvision's decoders say they are deprecated
            warnings.filterwarnings("ignore", category=DeprecationWarning)
        assert_same(epoch(photos, "device", transform=transform), epoch(photos, "workers", transform=transform),
                    RESIZED)


def test_device_decode_is_the_same_with_workers_and_every_start_method(photos):
    alone = epoch(photos, "device")
    assert_same(alone, epoch(photos, "device", workers=2))
    assert_same(alone, epoch(photos, "device", workers=2, multiprocessing_context="spawn", persistent_workers=False))
    assert len({tuple(images[0, :, 0, 0].tolist()) for images, _, _ in alone}) == len(alone)  # crops differ


@pytest.mark.parametrize("resize_mode", ["stretch", "shorter-side-center-crop"])
def test_device_decode_with_a_size_resizes_as_the_workers_do(photos, resize_mode):
    options = dict(transform=None, size=(160, 160), resize_mode=resize_mode)
    assert_same(epoch(photos, "device", **options), epoch(photos, "workers", **options), RESIZED)


def test_images_the_device_decoder_does_not_take_are_decoded_by_the_workers(mixed):
    with pf.open_archive(mixed) as reader:
        taken = [device_decode.takes(reader.read(i)) for i in range(len(reader))]
    assert [j for j, taken in enumerate(taken) if not taken] == [2, 11]  # the PNG and the CMYK JPEG
    assert_same(epoch(mixed, "device", workers=2), epoch(mixed, "workers"), RESIZED)


def test_a_jpeg_the_device_refuses_is_decoded_on_the_cpu(photos, monkeypatch):
    real = device_decode.decode_jpegs
    calls = []

    def picky(blobs, device):  # refuses any batch holding the largest JPEG, and that JPEG alone
        calls.append(len(blobs))
        if any(len(blob) == largest for blob in blobs):
            raise RuntimeError("nvjpeg: unsupported")
        return real(blobs, device)

    with pf.open_archive(photos) as reader:
        largest = max(len(reader.read(i)) for i in range(len(reader)))
    monkeypatch.setattr(device_decode, "decode_jpegs", picky)
    assert_same(epoch(photos, "device", workers=2), epoch(photos, "workers"), RESIZED)
    assert 1 in calls and 8 in calls  # one batch fell back to one image at a time


def test_a_truncated_jpeg_is_refused_before_the_device_sees_it(samples, tmp_path, monkeypatch):
    samples = list(samples)
    data, label, key = samples[5]
    samples[5] = (data[: len(data) // 3], label, key)  # truncated before it was packed: its CRC is right
    bad = write(tmp_path / "bad.zip", samples)
    seen = []
    real = device_decode.decode_jpegs
    monkeypatch.setattr(device_decode, "decode_jpegs", lambda blobs, device: seen.extend(blobs) or real(blobs, device))
    for workers in (0, 2):
        with pytest.raises(pf.CorruptSampleError, match=key) as raised:
            epoch(bad, "device", workers=workers, shuffle=False)
        assert raised.value.key == key
    with pytest.warns(pf.SkippedSampleWarning, match=key):
        batches = epoch(bad, "device", workers=2, shuffle=False, on_error="skip")
    assert [len(labels) for _, labels, _ in batches] == [7, 8, 2]
    assert 5 not in torch.cat([index for _, _, index in batches]).tolist()
    assert all(len(blob) != len(data) // 3 for blob in seen)


@pytest.mark.parametrize("workers", [0, 2])
def test_each_jpeg_is_checked_strictly_once_per_loader_not_once_per_read(photos, monkeypatch, workers):
    """The strict decode check costs about half a decode on photographs: it is made the first time any
    worker reads a sample (the CRC then holds the sample to those bytes), whatever reads it later."""
    import multiprocessing

    from packed_formats import native

    count, real = multiprocessing.get_context("fork").Value("i", 0), native.jpeg_decodes

    def counted(data):
        with count.get_lock():
            count.value += 1
        return real(data)

    monkeypatch.setattr(native, "jpeg_decodes", counted)
    loader = pf.make_loader(photos, batch_size=4, num_workers=workers, transform=T.train(64), decode="device",
                            multiprocessing_context="fork" if workers else None)
    for epoch_number in range(3):
        loader.sampler.set_epoch(epoch_number)
        assert sum(len(labels) for _, labels in loader) == 18
    assert count.value == 18


def test_a_damaged_stored_byte_is_named_by_its_checksum(samples, tmp_path):
    path = write(tmp_path / "damaged.zip", samples)
    data, _, key = samples[4]
    with open(path, "r+b") as f:
        content = f.read()
        at = content.index(data) + len(data) // 2
        f.seek(at)
        f.write(bytes([content[at] ^ 0x10]))
    with pytest.raises(pf.CorruptSampleError, match="checksum") as raised:
        epoch(path, "device", workers=2, shuffle=False)
    assert raised.value.key == key


def test_workers_cut_crops_for_a_device_that_does_the_rest(photos, monkeypatch):
    """What a GPU gets from an encoded archive under decode="workers" with train or val and no size:
    crops cut while decoding in the workers (at the least DCT scale, as on the CPU), the rest of the
    transform on the device from the batch's generator.  Run here with the CPU as that device."""
    from packed_formats.loading import loader as loader_module

    for transform in (T.train(64), T.val(64, resize=72)):
        workers = epoch(photos, "workers", workers=2, transform=transform)
        monkeypatch.setattr(loader_module, "_what_workers_send", lambda *args: "crops")
        built = pf.make_loader(photos, transform=transform)
        assert built.batch_reader.send == "crops" and built.decoder is not None
        crops = epoch(photos, "workers", workers=2, transform=transform)
        monkeypatch.undo()
        assert_same(crops, workers)


@pytest.mark.parametrize("send", ["bytes", "crops"])
def test_batches_sent_in_reused_shared_memory_slots_are_not_overwritten(mixed, monkeypatch, send):
    """Every batch's bytes and crops travel in the workers' slots here (a 1-byte floor instead of
    1 MiB); over three epochs each slot is reused, and no batch kept is changed by a later one."""
    from packed_formats.loading import loader as loader_module
    from packed_formats.memory import SlotPool

    expected = [epoch(mixed, "workers", workers=2) for _ in range(3)]
    if send == "crops":
        monkeypatch.setattr(loader_module, "_what_workers_send", lambda *args: "crops")
    loader = pf.make_loader(mixed, batch_size=8, num_workers=2, seed=11, transform=T.train(160),
                            decode="device" if send == "bytes" else "workers", return_index=True)
    loader.batch_reader.pool = SlotPool(2, min_bytes=1)
    kept = []
    for _ in range(3):
        loader.sampler.set_epoch(2)
        kept.append([tuple(batch) for batch in loader])
    for got, want in zip(kept, expected):
        assert_same(got, want, RESIZED if send == "bytes" else 0)


def test_what_the_workers_send_for_each_device_and_transform(photos, tmp_path):
    from packed_formats.loading.loader import _what_workers_send

    raw = pf.convert(photos, str(tmp_path / "raw.zip"), mode="raw", size=(32, 32), quiet=True).destination
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pf.open_archive(photos) as encoded, pf.open_archive(raw) as packed_raw:
        assert _what_workers_send(encoded, "workers", cuda, T.train(64), None) == "crops"
        assert _what_workers_send(encoded, "workers", cuda, T.val(64), None) == "crops"
        assert _what_workers_send(encoded, "workers", cuda, T.train(64), (80, 80)) == "batches"  # resized first
        assert _what_workers_send(encoded, "workers", cuda, T.Normalize(), (80, 80)) == "batches"
        assert _what_workers_send(encoded, "workers", cpu, T.train(64), None) == "batches"  # all in the workers
        assert _what_workers_send(encoded, "device", cpu, T.train(64), None) == "bytes"
        assert _what_workers_send(encoded, "device", cuda, None, (80, 80)) == "bytes"
        assert _what_workers_send(packed_raw, "device", cuda, T.train(16), None) == "batches"


def test_an_unknown_place_to_decode_or_a_missing_decoder_is_refused(photos, monkeypatch):
    with pytest.raises(ValueError, match="decode must be one of"):
        pf.make_loader(photos, decode="gpu")
    import torchvision.io

    def missing(*args, **kwargs):
        raise RuntimeError("Couldn't load custom C++ ops")

    # no TorchCodec, and a torchvision built without its image extension
    monkeypatch.setattr(image_decode, "_torchcodec", lambda: (None, "ModuleNotFoundError('torchcodec')"))
    monkeypatch.setattr(torchvision.io, "decode_image", missing)
    with pytest.raises(ValueError, match=r"needs a JPEG decoder \(torchvision .*packed_formats\[torchcodec\]"):
        pf.make_loader(photos, decode="device")


def test_a_raw_archive_has_nothing_to_decode(photos, tmp_path):
    raw = pf.convert(photos, str(tmp_path / "raw.zip"), mode="raw", size=(64, 64), quiet=True).destination
    assert_same(epoch(raw, "device", transform=T.train(48)), epoch(raw, "workers", transform=T.train(48)))


def test_boxes_of_a_resize_mode_are_what_the_resize_keeps():
    sizes = np.array([[300, 120], [120, 300], [160, 160]])  # (width, height)
    assert device_decode.resize_boxes(sizes, (160, 160), "stretch").tolist() == [
        [0, 0, 120, 300], [0, 0, 300, 120], [0, 0, 160, 160]]
    assert device_decode.resize_boxes(sizes, (160, 160), "shorter-side-center-crop").tolist() == [
        [0, 90, 120, 120], [90, 0, 120, 120], [0, 0, 160, 160]]


# ---- on a GPU ----
@needs_cuda
def test_nvjpeg_batches_match_the_cpu_decode_within_a_few_levels(photos):
    crop = T.RandomResizedCrop(128)
    on_gpu = epoch(photos, "device", workers=2, device="cuda", transform=crop)
    on_cpu = epoch(photos, "device", workers=2, transform=crop)
    for (images, labels, index), (images2, labels2, index2) in zip(on_gpu, on_cpu):
        assert torch.equal(index, index2) and torch.equal(labels, labels2) and images.dtype == torch.uint8
        difference = (images.float() - images2.float()).abs()
        assert difference.mean() < 2 and difference.max() < 64  # nvJPEG's IDCT and upsampling are not libjpeg's


@needs_cuda
@pytest.mark.parametrize("decode", ["workers", "device"])
def test_encoded_train_batches_on_a_gpu_need_no_size_and_match_the_cpu(photos, decode):
    on_gpu = epoch(photos, decode, workers=2, device="cuda", transform=T.train(96))
    on_cpu = epoch(photos, "workers", workers=2, transform=T.train(96))
    for (images, labels, index), (images2, labels2, index2) in zip(on_gpu, on_cpu):
        assert torch.equal(index, index2) and torch.equal(labels, labels2) and images.shape == images2.shape
        tolerance = 1e-4 if decode == "workers" else 0.2  # the same crops; nvJPEG's pixels are not libjpeg's
        assert (images - images2).abs().mean() < tolerance


@needs_cuda
def test_nvjpeg_train_batches_are_normalised_on_the_gpu(mixed):
    loader = pf.make_loader(mixed, batch_size=8, num_workers=2, device="cuda", decode="device",
                            transform=T.train(112), seed=3)
    for images, labels in loader:
        assert images.is_cuda and images.dtype == torch.float32 and images.shape[1:] == (3, 112, 112)
        assert labels.is_cuda and torch.isfinite(images).all()
