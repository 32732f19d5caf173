"""Parting an image's channels (HxWxC -> CxHxW) and joining them back, natively and with numpy.

The C module (``packed_formats._pixels``, built at install where a compiler is) and numpy's fallback
give the same bytes for every shape the readers hand them: one image or a batch, 1 to 4 channels,
odd sizes; views that are not contiguous go to numpy; a shape that does not match is refused.  A
raw batch read as NCHW from an interleaved archive, and channels-last from a planar one, are the
same through either.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import native

from .conftest import CLASSES, RAW_SHAPE, expected_samples
from .test_bad_input import flip_byte_inside_sample

BUILT = native._pixels is not None
PATHS = ["native", "numpy"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> str:
    """Each test once through the C module, once through numpy (the module taken away)."""
    if request.param == "native" and not BUILT:
        pytest.skip("the C module is not built here (no compiler when the package was installed)")
    if request.param == "numpy":
        monkeypatch.setattr(native, "_pixels", None)
    return request.param


@pytest.mark.parametrize("shape", [(5, 7, 3), (1, 1, 3), (4, 6, 9, 3), (3, 5, 7, 1), (2, 4, 5, 4), (2, 3, 3, 2)])
def test_channels_are_parted_and_joined_as_numpy_transposes_them(path, shape):
    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    planar = np.full(shape[:-3] + (shape[-1], shape[-3], shape[-2]), 7, np.uint8)
    assert native.to_planar(pixels, planar) is planar
    np.testing.assert_array_equal(planar, np.moveaxis(pixels, -1, -3))
    np.testing.assert_array_equal(native.to_planar(pixels), planar)  # into a new array
    back = np.zeros_like(pixels)
    assert native.to_interleaved(planar, back) is back
    np.testing.assert_array_equal(back, pixels)


def test_views_that_are_not_contiguous_are_copied_right(path):
    pixels = np.random.default_rng(1).integers(0, 256, (6, 8, 10, 3), dtype=np.uint8)
    batch = np.zeros((6, 3, 8, 20), np.uint8)
    native.to_planar(pixels, batch[..., ::2])  # every other column of a wider batch
    np.testing.assert_array_equal(batch[..., ::2], pixels.transpose(0, 3, 1, 2))
    assert not batch[..., 1::2].any()
    out = np.zeros((6, 8, 10, 3), np.uint8)
    native.to_interleaved(batch[::-1, :, :, ::2], out)  # a reversed view
    np.testing.assert_array_equal(out, pixels[::-1])


@pytest.mark.parametrize("out_shape", [(3, 5, 8), (5, 7, 3), (1, 3, 5, 7), (3, 7, 5), (35, 3)])
def test_a_shape_that_does_not_match_is_refused(path, out_shape):
    with pytest.raises(ValueError, match="cannot copy"):
        native.to_planar(np.zeros((5, 7, 3), np.uint8), np.zeros(out_shape, np.uint8))
    with pytest.raises(ValueError, match="images of three axes"):
        native.to_interleaved(np.zeros((5, 7), np.uint8), np.zeros((7, 5), np.uint8))


@pytest.mark.skipif(not BUILT, reason="the C module is not built here")
def test_the_c_module_gathers_only_images_inside_its_source_into_rows_of_its_batch():
    gather = native._pixels.gather
    src, out = np.arange(60, dtype=np.uint8), np.zeros((3, 12), np.uint8)
    at = np.array([48, 0], np.int64)
    gather(src, at, out, np.array([2, 0], np.int64), 12, 3, True)  # rows 2 and 0 of out, channels parted
    np.testing.assert_array_equal(out[2], src[48:60].reshape(4, 3).T.reshape(-1))
    np.testing.assert_array_equal(out[0], src[0:12].reshape(4, 3).T.reshape(-1))
    assert not out[1].any()
    rows = np.array([0, 1], np.int64)
    for starts, places, problem in [([49, 0], rows, "at byte 49 of 60"), ([-1, 0], rows, "at byte -1"),
                                    ([0, 0], [0, 3], "into row 3 of 3"), ([0, 0], [-1, 0], "into row -1")]:
        with pytest.raises(ValueError, match=problem):
            gather(src, np.array(starts, np.int64), out, np.array(places, np.int64), 12, 3, True)
    with pytest.raises(ValueError, match="12 bytes and 5 channels"):
        gather(src, at, out, rows, 12, 5, True)
    with pytest.raises(ValueError, match="from 2 starts into 1 places"):
        gather(src, at, out, rows[:1], 12, 3, True)
    read_only = np.zeros((3, 12), np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((BufferError, TypeError, ValueError)):
        gather(src, at, read_only, rows, 12, 3, True)
    with pytest.raises((BufferError, TypeError, ValueError)):  # not contiguous
        gather(np.zeros(120, np.uint8)[::2], at, out, rows, 12, 3, True)
    assert not out[1].any()


def can_build_c() -> bool:
    """Whether this interpreter has what pip needs to build the C module: a compiler and Python.h."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(compiler) is not None and Path(sysconfig.get_paths()["include"], "Python.h").is_file()


def installed_here() -> bool:
    """Whether pip installed this package into this interpreter (not a checkout on PYTHONPATH)."""
    try:
        importlib.metadata.distribution("packed_formats")
    except importlib.metadata.PackageNotFoundError:
        return False
    return "PYTHONPATH" not in os.environ


@pytest.mark.skipif(not (installed_here() and can_build_c()),
                    reason="not installed by pip here, or no C compiler and Python headers to build with")
def test_an_install_where_a_compiler_is_parts_channels_natively():
    assert native.planar_copy() == "native", "pip had a compiler but the C module did not build: see its output"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, image_folder):
    """The same raw samples in a memmap archive stored interleaved and one stored planar."""
    root = tmp_path_factory.mktemp("pixels")
    samples = expected_samples(image_folder, "raw")
    paths = {}
    for layout in ("hwc", "chw"):
        paths[layout] = os.fspath(root / f"{layout}.memmap")
        with pf.open_writer(paths[layout], format="memmap", mode="raw", shape=RAW_SHAPE, classes=CLASSES,
                            raw_layout=layout) as writer:
            for pixels, label, key in samples:
                writer.add(pixels, label, key)
    return paths, np.stack([pixels for pixels, _, _ in samples])


@pytest.mark.parametrize("verify", ["once", True, False])
def test_a_batch_read_across_layouts_is_the_same_through_either_path(path, layouts, verify):
    paths, expected = layouts
    idx = [5, 0, 5, len(expected) - 1, 2]
    h, w, c = RAW_SHAPE
    with pf.open_archive(paths["hwc"], verify=verify) as reader:  # NCHW from interleaved: channels parted
        planar = reader.read_many_planar(idx, np.zeros((len(idx), c, h, w), np.uint8))
    np.testing.assert_array_equal(planar, expected[idx].transpose(0, 3, 1, 2))
    with pf.open_archive(paths["chw"], verify=verify) as reader:  # HxWxC from planar: channels joined
        np.testing.assert_array_equal(reader.read_many(idx), expected[idx])
        strided = np.zeros((len(idx), h, w, c + 1), np.uint8)[..., :c]  # a view, as of a pinned slot
        reader.read_many(idx, out=strided)
        np.testing.assert_array_equal(strided, expected[idx])


def test_loader_batches_from_either_layout_are_the_same_through_either_path(path, layouts):
    paths, expected = layouts
    import torch

    for layout, memory_format in (("hwc", torch.contiguous_format), ("chw", torch.channels_last)):
        loader = pf.make_loader(paths[layout], batch_size=7, shuffle=False, num_workers=0,
                                memory_format=memory_format)
        images = torch.cat([batch for batch, _ in loader])
        np.testing.assert_array_equal(images.numpy(), expected.transpose(0, 3, 1, 2))
        dataset = pf.PackedDataset(paths[layout], output="tensor")
        np.testing.assert_array_equal(dataset[3][0].numpy(), expected[3].transpose(2, 0, 1))


@pytest.mark.parametrize("fmt", ["memmap", "zip", "hdf5", "lmdb"])
@pytest.mark.parametrize("verify", ["once", True])
@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_a_damaged_sample_is_named_before_its_batch_is_moved(path, fmt, verify, layout, image_folder, tmp_path):
    """NCHW from interleaved and HxWxC from planar, every format (memmap, ZIP and HDF5 gather from their
    map in one call, LMDB sample by sample): the damaged sample's stored bytes are checked before its
    channels are moved, and it is named."""
    samples = expected_samples(image_folder, "raw")
    archive = os.fspath(tmp_path / f"{layout}.{fmt}")
    with pf.open_writer(archive, format=fmt, mode="raw", shape=RAW_SHAPE, classes=CLASSES,
                        raw_layout=layout) as writer:
        for pixels, label, key in samples:
            writer.add(pixels, label, key)
    flip_byte_inside_sample(archive, "raw", 6)
    h, w, c = RAW_SHAPE
    with pf.open_archive(archive, verify=verify) as reader:
        def read(idx):
            if layout == "hwc":
                return reader.read_many_planar(idx, np.zeros((len(idx), c, h, w), np.uint8))
            return reader.read_many(idx).transpose(0, 3, 1, 2)

        np.testing.assert_array_equal(read([1, 2]), np.stack([samples[1][0], samples[2][0]]).transpose(0, 3, 1, 2))
        for _ in range(2):  # "once" has not marked it checked: it fails each time
            with pytest.raises(pf.CorruptSampleError, match="checksum mismatch") as error:
                read([5, 6])
            assert error.value.index == 6 and samples[6][2] in str(error.value)
        if layout == "hwc":  # into chosen rows of a batch
            out = np.zeros((3, c, h, w), np.uint8)
            reader.read_many_planar([1, 2], out, rows=[2, 0])
            np.testing.assert_array_equal(out[[2, 0]], read([1, 2]))
            assert not out[1].any()
