"""make_loader: whole batches equal per-sample reads, seeded randomness, skip policy."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats import transforms as T
from packed_formats.loading.loader import SkippedSampleWarning, shard_indices

from .conftest import RAW_SHAPE, digest, kind_id, sample_lookup


def epoch_indices(loader, lookup) -> list:
    return [lookup[digest(image)] for images, _ in loader for image in images]


def test_batches_equal_per_sample_getitem(uniform):
    dataset = pf.PackedDataset(uniform, output="tensor")
    loader = pf.make_loader(uniform, batch_size=5, shuffle=False, num_workers=0)
    seen = 0
    for images, labels in loader:
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        for image, label in zip(images, labels):
            expected_image, expected_label = dataset[seen]
            assert torch.equal(image, expected_image) and int(label) == expected_label
            seen += 1
    assert seen == len(dataset)


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_workers_return_the_same_batches_as_the_main_process(uniform_archives, fmt):
    path = uniform_archives[(fmt, "raw")]
    main = list(pf.make_loader(path, batch_size=7, num_workers=0, seed=3))
    workers = list(pf.make_loader(path, batch_size=7, num_workers=2, seed=3))
    assert len(main) == len(workers) == 4
    for (a, la), (b, lb) in zip(main, workers):
        assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.slow
def test_spawned_workers_read_and_transform_alike(uniform_archives):
    path = uniform_archives[("hdf5", "encoded")]
    options = dict(batch_size=8, transform=T.train(16), seed=1)
    main = list(pf.make_loader(path, num_workers=0, **options))
    spawned = list(pf.make_loader(path, num_workers=2, multiprocessing_context="spawn", **options))
    for (a, la), (b, lb) in zip(main, spawned):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_an_epoch_covers_every_sample_once_in_shuffled_order(uniform_archives):
    path = uniform_archives[("memmap", "raw")]
    lookup = sample_lookup(path)
    order = epoch_indices(pf.make_loader(path, batch_size=5, num_workers=2), lookup)
    assert sorted(order) == list(range(len(lookup))) and order != sorted(order)


def test_epochs_are_shuffled_differently_and_reproducibly(uniform_archives):
    path = uniform_archives[("zip", "raw")]
    lookup = sample_lookup(path)
    loader = pf.make_loader(path, batch_size=6, num_workers=2, seed=4)
    first, second = epoch_indices(loader, lookup), epoch_indices(loader, lookup)
    assert first != second
    again = pf.make_loader(path, batch_size=6, num_workers=0, seed=4)
    again.set_epoch(1)
    assert epoch_indices(again, lookup) == second
    assert first == list(shard_indices(len(lookup), epoch=0, seed=4))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_epoch_order_is_drawn_once_when_the_first_batch_is_asked_for(uniform_archives, monkeypatch, num_workers):
    # At millions of samples one draw costs a good part of a second: a DataLoader asks its sampler
    # for an iterator twice before it uses one, and a loader built must draw nothing at all.
    from packed_formats.loading import sampling

    draws = []
    real = sampling.epoch_order
    monkeypatch.setattr(sampling, "epoch_order", lambda *a, **k: draws.append(k) or real(*a, **k))
    path = uniform_archives[("memmap", "raw")]
    loader = pf.make_loader(path, batch_size=5, num_workers=num_workers, seed=3, multiprocessing_context="fork"
                            if num_workers else None)
    loader.set_epoch(2)
    assert len(loader) > 1 and draws == []
    unused = iter(loader.sampler)
    assert draws == []
    batches = iter(loader)
    next(batches)
    assert [d["epoch"] for d in draws] == [2]
    loader.set_epoch(5)  # an iteration under way keeps the epoch it was started with
    assert len(list(batches)) == len(loader) - 1 and [d["epoch"] for d in draws] == [2]
    del unused, batches


def test_other_seed_other_order(uniform_archives):
    path = uniform_archives[("memmap", "raw")]
    lookup = sample_lookup(path)
    a = epoch_indices(pf.make_loader(path, batch_size=6, num_workers=0, seed=0), lookup)
    b = epoch_indices(pf.make_loader(path, batch_size=6, num_workers=0, seed=1), lookup)
    assert a != b


def test_transformed_batches_are_reproducible_whatever_the_worker_count(uniform_archives):
    path = uniform_archives[("lmdb", "raw")]
    runs = [list(pf.make_loader(path, batch_size=6, num_workers=n, transform=T.train(16), seed=2)) for n in (0, 2, 3)]
    for batches in runs[1:]:
        for (a, _), (b, _) in zip(runs[0], batches):
            assert torch.equal(a, b)


def crop_offsets(batch: torch.Tensor) -> torch.Tensor:
    return batch[:, 0, 0, 0]  # the first pixel of a crop of a ramp image tells its offset


@pytest.fixture(scope="module")
def ramp_archive(tmp_path_factory):
    """A raw archive of 16 identical horizontal ramps: any difference in output is randomness."""
    ramp = np.tile(np.arange(64, dtype=np.uint8).reshape(1, 64, 1), (8, 1, 3))
    path = tmp_path_factory.mktemp("ramp") / "ramp.memmap"
    with pf.open_writer(path, format="memmap", mode="raw", shape=ramp.shape, classes=["r"]) as writer:
        for i in range(16):
            writer.add(ramp, 0, f"{i}")
    return os.fspath(path)


def test_random_crops_differ_across_workers_and_epochs(ramp_archive):
    loader = pf.make_loader(ramp_archive, batch_size=4, num_workers=2, transform=T.RandomCrop((8, 32)))
    epochs = [[tuple(crop_offsets(images).tolist()) for images, _ in loader] for _ in range(2)]
    batches = epochs[0] + epochs[1]  # 8 batches: 2 workers x 2 epochs
    assert len(set(batches)) == len(batches)


def global_rng_noise(batch: torch.Tensor) -> torch.Tensor:
    """A user transform that draws from the worker's global torch RNG."""
    return torch.rand(batch.shape[0])


def test_global_rng_of_workers_is_distinct_per_batch_and_epoch(ramp_archive):
    noise = pf.transforms.Batched(global_rng_noise)  # it draws one number per image of the batch itself
    loader = pf.make_loader(ramp_archive, batch_size=4, num_workers=2, transform=noise)
    draws = [tuple(noise.tolist()) for _ in range(2) for noise, _ in loader]
    assert len(set(draws)) == len(draws) == 8


@pytest.mark.parametrize("drop_last,batches,last", [(False, 5, 4), (True, 4, 5)])
def test_len_counts_batches(uniform_archives, drop_last, batches, last):
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=5, num_workers=0, drop_last=drop_last)
    sizes = [len(labels) for _, labels in loader]
    assert len(loader) == len(sizes) == batches and sizes[-1] == last


def test_batches_are_channels_last_views_of_one_buffer(uniform_archives):
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=4, num_workers=0,
                            memory_format=torch.channels_last)
    images, _ = next(iter(loader))
    assert images.shape == (4, RAW_SHAPE[2], RAW_SHAPE[0], RAW_SHAPE[1])
    assert images.is_contiguous(memory_format=torch.channels_last)


def test_nchw_raw_batches_are_read_straight_into_the_batch_with_no_buffer_between(uniform_archives):
    """The default contiguous NCHW batch is the read itself: the samples' channels are parted on their
    one copy out of the archive, not read as stored into another buffer first and transposed from it."""
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=4, num_workers=0, shuffle=False)
    images, _ = next(iter(loader))
    assert images.is_contiguous() and images.shape == (4, RAW_SHAPE[2], RAW_SHAPE[0], RAW_SHAPE[1])
    buffers = loader.batch_reader._buffers.get()._buffers  # this process's reused buffers: the batch alone
    assert len(buffers) == 1 and images.data_ptr() == buffers[0][0].ctypes.data


@pytest.mark.slow
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_nchw_raw_batches_from_workers_equal_the_channels_last_ones(uniform_archives, fmt):
    path = uniform_archives[(fmt, "raw")]
    nchw = list(pf.make_loader(path, batch_size=7, num_workers=2, seed=4))
    channels_last = list(pf.make_loader(path, batch_size=7, num_workers=2, seed=4, memory_format=torch.channels_last))
    assert len(nchw) == len(channels_last) == 4
    for (a, la), (b, lb) in zip(nchw, channels_last):
        assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_encoded_images_of_mixed_sizes_need_a_size(archives):
    with pytest.raises(pf.PackedFormatError, match="size="):
        list(pf.make_loader(archives[("zip", "encoded")], batch_size=8, num_workers=0))


@pytest.mark.parametrize("fmt", ["zip", "folder"])
def test_size_resizes_encoded_images_at_decode(archives, fmt):
    loader = pf.make_loader(archives[(fmt, "encoded")], batch_size=8, num_workers=0, size=(20, 12))
    shapes = {tuple(images.shape[1:]) for images, _ in loader}
    assert shapes == {(3, 20, 12)}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resize_mode_crops_the_centre_instead_of_stretching(archives, num_workers):
    """Each image comes out as the decoder's centre crop (checked against Pillow in test_native_decode)."""
    from packed_formats import policy

    path = archives[("zip", "encoded")]
    loader = pf.make_loader(path, batch_size=8, num_workers=num_workers, size=(20, 12), shuffle=False,
                            resize_mode="shorter-side-center-crop", return_index=True)
    stretched = pf.make_loader(path, batch_size=8, num_workers=0, size=(20, 12), shuffle=False)
    with pf.open_archive(path) as reader:
        for (images, _, indices), (plain, _) in zip(loader, stretched):
            for image, i in zip(images, indices.tolist()):
                data = reader.read(i)
                expected = policy.decode(data, 3, (20, 12), "shorter-side-center-crop")
                assert torch.equal(image, torch.from_numpy(expected).permute(2, 0, 1)), i
            assert not torch.equal(images, plain)  # the mixed sizes are not all 20:12


def test_an_unknown_resize_mode_is_refused_by_make_loader(archives):
    with pytest.raises(ValueError, match="resize_mode"):
        pf.make_loader(archives[("zip", "encoded")], size=16, resize_mode="squash")


def test_size_is_refused_for_raw_archives(uniform_archives):
    with pytest.raises(ValueError, match="raw archive"):
        pf.make_loader(uniform_archives[("memmap", "raw")], size=8)


def test_a_packed_dataset_is_accepted_as_source(uniform_archives):
    path = uniform_archives[("hdf5", "raw")]
    a = list(pf.make_loader(pf.PackedDataset(path), batch_size=8, num_workers=0))
    b = list(pf.make_loader(path, batch_size=8, num_workers=0))
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))


def test_a_missing_archive_names_the_path(tmp_path):
    with pytest.raises(pf.ArchiveNotFoundError, match="nowhere"):
        pf.make_loader(tmp_path / "nowhere.zip")


@pytest.mark.parametrize("option", [{"on_error": "ignore"}, {"verify": "sometimes"}, {"batch_size": 0}])
def test_bad_options_are_refused(uniform_archives, option):
    with pytest.raises(ValueError):
        pf.make_loader(uniform_archives[("memmap", "raw")], **option)


# ---- bad samples ---------------------------------------------------------------------------------------
BAD = 5


def corrupt_copy(src: str, dst: str, fmt: str, mode: str) -> str:
    """A copy of an archive with one byte of sample BAD's data flipped."""
    reader = pf.open_archive(src)
    if fmt == "memmap":
        shutil.copytree(src, dst)
        name, header = ("images.npy", 128) if mode == "raw" else ("data.npy", 128)
        start = reader.manifest.sample_nbytes * BAD if mode == "raw" else int(reader.index.offsets[BAD])
        where = os.path.join(dst, name), header + start + 40
    else:
        shutil.copyfile(src, dst)
        where = dst, int(reader.index.positions[BAD]) + 40
    with open(where[0], "r+b") as file:
        file.seek(where[1])
        byte = file.read(1)
        file.seek(where[1])
        file.write(bytes([byte[0] ^ 0xFF]))
    return dst


@pytest.fixture(params=[("memmap", "raw"), ("memmap", "encoded"), ("zip", "raw"), ("zip", "encoded")], ids=kind_id)
def corrupt(request, uniform_archives, tmp_path):
    fmt, mode = request.param
    return corrupt_copy(uniform_archives[(fmt, mode)], os.fspath(tmp_path / f"bad.{fmt}"), fmt, mode)


@pytest.mark.parametrize("num_workers, context", [(0, None), (2, None), (2, "fork")],
                         ids=["no-workers", "default-workers", "worker-processes"])
def test_a_corrupt_sample_raises_naming_path_and_key(corrupt, num_workers, context):
    # from a worker process too: torch re-raises a worker's error from its message alone, which loses the
    # fields; raw batches read by threads (the default for them) raise it as it is
    reader = pf.open_archive(corrupt, verify=False)
    key, raw = reader.key(BAD), reader.mode == "raw"
    loader = pf.make_loader(corrupt, batch_size=8, num_workers=num_workers, shuffle=False,
                            multiprocessing_context=context)
    assert loader.worker_kind == (None if not num_workers else "threads" if raw and not context else "processes")
    with pytest.raises(pf.CorruptSampleError) as info:
        list(loader)
    assert info.value.path == corrupt and info.value.key == key and info.value.index == BAD
    assert str(info.value).startswith(f"{corrupt} [sample index {BAD}, key {key!r}]: ")
    cause = str(info.value.__cause__ or "")
    assert (loader.worker_kind == "processes") == ("raised in a DataLoader worker" in cause and "Traceback" in cause)


def test_after_a_worker_error_the_loader_and_its_workers_go_with_the_last_reference(corrupt):
    # with the garbage collector left out: a reference cycle through the error would keep the workers
    # alive until it runs, and their shutdown from there waits 5 s per worker
    import gc
    import time

    from packed_formats.bench.scale import worker_pids

    gc.collect()
    gc.disable()
    others = set(worker_pids(os.getpid()))  # processes other tests left running (a forkserver, say)
    try:
        loader = pf.make_loader(corrupt, batch_size=8, num_workers=2, shuffle=False, multiprocessing_context="fork")
        batches = iter(loader)
        try:
            for _ in batches:
                pass
        except pf.CorruptSampleError as exc:
            assert exc.index == BAD
        workers = set(worker_pids(os.getpid())) - others
        assert len(workers) == 2
        del loader, batches
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and workers & set(worker_pids(os.getpid())):
            time.sleep(0.05)
        assert not workers & set(worker_pids(os.getpid()))
    finally:
        gc.enable()


def test_skip_drops_the_corrupt_sample_with_a_warning(corrupt):
    key = pf.open_archive(corrupt, verify=False).key(BAD)
    loader = pf.make_loader(corrupt, batch_size=8, num_workers=2, shuffle=False, on_error="skip")
    with pytest.warns(SkippedSampleWarning, match=key) as record:
        sizes = [len(labels) for _, labels in loader]
    # pytest.warns records every warning; others (Python 3.12+ warns of forking while torch runs
    # threads of its own) are not this test's business
    assert sizes == [7, 8, 8] and len([w for w in record if w.category is SkippedSampleWarning]) == 1
    assert [(s.index, s.key) for s in loader.skipped] == [(BAD, key)]


def test_skip_keeps_the_good_samples_of_the_batch_intact(uniform_archives, tmp_path):
    src = uniform_archives[("memmap", "raw")]
    bad = corrupt_copy(src, os.fspath(tmp_path / "bad.memmap"), "memmap", "raw")
    dataset = pf.PackedDataset(src, output="tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        images, labels = next(iter(pf.make_loader(bad, batch_size=8, num_workers=0, shuffle=False, on_error="skip")))
    expected = [dataset[i][0] for i in range(8) if i != BAD]
    assert all(torch.equal(a, b) for a, b in zip(images, expected)) and len(images) == 7


def test_verify_false_reads_a_corrupt_raw_sample_without_complaint(uniform_archives, tmp_path):
    bad = corrupt_copy(uniform_archives[("memmap", "raw")], os.fspath(tmp_path / "bad.memmap"), "memmap", "raw")
    assert sum(len(y) for _, y in pf.make_loader(bad, batch_size=8, num_workers=0, verify=False)) == 24


@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_planar_reads_equal_reads_as_stored_transposed(uniform_archives, fmt):
    reader = pf.open_archive(uniform_archives[(fmt, "raw")])
    idx = np.array([3, 0, 17, 3, 23])
    h, w, c = RAW_SHAPE
    out = np.full((len(idx), c, h, w), 7, dtype=np.uint8)
    assert reader.read_many_planar(idx, out=out) is out
    assert np.array_equal(out, reader.read_many(idx).transpose(0, 3, 1, 2))
    with pytest.raises(ValueError, match="out must be uint8"):
        reader.read_many_planar(idx, out=np.empty((len(idx), h, w, c), dtype=np.uint8))


@pytest.mark.parametrize("fmt", ["memmap", "zip"])
def test_a_planar_read_checks_each_sample_before_it_copies_it(uniform_archives, tmp_path, fmt):
    bad = corrupt_copy(uniform_archives[(fmt, "raw")], os.fspath(tmp_path / f"bad.{fmt}"), fmt, "raw")
    reader = pf.open_archive(bad)
    h, w, c = RAW_SHAPE
    with pytest.raises(pf.CorruptSampleError, match="checksum mismatch") as info:
        reader.read_many_planar([0, BAD], out=np.empty((2, c, h, w), dtype=np.uint8))
    assert info.value.path == bad and info.value.index == BAD


# ---- GPU ---------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_is_refused_without_a_gpu(uniform_archives):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="cuda"):
        pf.make_loader(uniform_archives[("memmap", "raw")], device="cuda")


def test_cuda_without_an_index_is_the_current_device_when_a_pass_starts(uniform_archives, monkeypatch):
    """As for tensor.to("cuda"): a loader built before torch.cuda.set_device(local_rank) follows it
    (every rank on GPU 0 otherwise), and one built for "cuda:1" stays there."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    path = uniform_archives[("memmap", "raw")]
    loader, pinned = pf.make_loader(path, device="cuda", num_workers=0), pf.make_loader(path, device="cuda:1")
    assert loader.device == torch.device("cuda", 0)
    current[0] = 3  # torch.cuda.set_device(3), after the loader was built
    assert loader.device == torch.device("cuda", 3) and pinned.device == torch.device("cuda", 1)
    assert "device=cuda:3" in repr(loader)


@needs_cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_batches_equal_cpu_batches(uniform_archives, num_workers):
    path = uniform_archives[("memmap", "raw")]
    cpu = list(pf.make_loader(path, batch_size=8, num_workers=0, transform=T.RandomCrop(16), seed=5))
    cuda = list(
        pf.make_loader(path, batch_size=8, num_workers=num_workers, device="cuda", transform=T.RandomCrop(16), seed=5)
    )
    assert len(cpu) == len(cuda)
    for (a, la), (b, lb) in zip(cpu, cuda):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()) and torch.equal(la, lb.cpu())


@needs_cuda
def test_cuda_prefetch_survives_slow_consumers(uniform_archives):
    path = uniform_archives[("memmap", "raw")]
    expected = [x for x, _ in pf.make_loader(path, batch_size=4, num_workers=0, shuffle=False)]
    loader = pf.make_loader(path, batch_size=4, num_workers=2, shuffle=False, device="cuda", prefetch=3)
    for (images, _), want in zip(loader, expected):
        torch.cuda._sleep(10_000_000)  # keep the consumer stream busy while copies run ahead
        assert torch.equal(images.cpu(), want)


def test_the_loader_and_its_warning_are_exported_at_the_top(uniform):
    loader = pf.make_loader(uniform, batch_size=4, num_workers=0)
    assert isinstance(loader, pf.PackedLoader) and pf.SkippedSampleWarning is SkippedSampleWarning
    assert {"PackedLoader", "SkippedSampleWarning"} <= set(pf.__all__)
