"""Batches of images of different sizes, as detection trains on them: ``size="own"`` (lists of images each
of its own size, boxes on each one's canvas), ``shuffle=pf.GroupByAspectRatio(k)`` (batches of one
aspect-ratio bin), and a per-image transform that brings mixed sizes to one.

The archives are small encoded zips of ramp images of mixed sizes with a mask, boxes and a caption
(``test_loader_fields.write_ramps``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats.loading.aspect_groups import grouped_batches

from .test_bad_input import flip_byte_inside_sample
from .test_loader_fields import SIZES, write_ramps

FIELDS = {"mask": "mask", "boxes": "boxes:XYXY"}
# (height, width): ratios width / height in bins 1..4 of k=1 (edges 1/2, 1, 2), a few of each
GROUPED_SIZES = [(40, 30), (30, 40), (30, 70), (60, 25), (40, 40), (32, 48), (50, 40), (30, 75), (28, 60),
                 (45, 30), (36, 36), (30, 50), (64, 20), (30, 31)]


def multiscale():
    """The detection reference's kind of training transform: each image to one of a few shorter sides, flipped."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomShortestSize([24, 32, 40], max_size=80), v2.RandomHorizontalFlip(),
                       v2.ToDtype(torch.float32, scale=True)])


def assert_on_own_canvas(batch) -> None:
    """Each sample's mask and boxes lie on its own image's canvas."""
    for image, mask, boxes in zip(batch["image"], batch["mask"], batch["boxes"]):
        assert image.dim() == 3 and tuple(mask.shape) == tuple(image.shape[1:])
        assert tuple(boxes.canvas_size) == tuple(image.shape[1:])
        height, width = image.shape[1:]
        assert (boxes[:, 0::2] >= 0).all() and (boxes[:, 0::2] <= width).all()
        assert (boxes[:, 1::2] >= 0).all() and (boxes[:, 1::2] <= height).all()


def as_plain(batch):
    """A batch's content as plain tensors and lists, to compare loaders."""
    return {name: [v.as_subclass(torch.Tensor) for v in value] if isinstance(value, list) else
            value.as_subclass(torch.Tensor) for name, value in batch.items()}


def assert_batches_equal(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = as_plain(x), as_plain(y)
        assert x.keys() == y.keys()
        for name in x:
            if isinstance(x[name], list):
                assert len(x[name]) == len(y[name]) and all(torch.equal(p, q) for p, q in zip(x[name], y[name]))
            else:
                assert torch.equal(x[name], y[name]), name


# ---- size="own" -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers, context", [(0, None), (2, "fork"), pytest.param(2, "spawn", marks=pytest.mark.slow)])
def test_own_sizes_give_each_image_as_the_dataset_does(tmp_path, workers, context):
    path = tmp_path / "a.zip"
    write_ramps(path)
    dataset = pf.PackedDataset(path, output="tensor", fields=FIELDS)
    loader = pf.make_loader(path, batch_size=4, num_workers=workers, multiprocessing_context=context, size="own",
                            fields=FIELDS, return_index=True)
    seen = []
    for batch in loader:
        assert isinstance(batch["image"], list) and batch["label"].shape == (len(batch["image"]),)
        assert_on_own_canvas(batch)
        for j, i in enumerate(batch["index"].tolist()):
            want = dataset[i]
            assert torch.equal(batch["image"][j], want["image"]) and int(batch["label"][j]) == want["label"]
            assert torch.equal(batch["mask"][j].as_subclass(torch.Tensor), want["mask"].as_subclass(torch.Tensor))
            assert torch.equal(batch["boxes"][j].as_subclass(torch.Tensor), want["boxes"].as_subclass(torch.Tensor))
            seen.append(i)
    assert sorted(seen) == list(range(len(SIZES)))
    workers = 0 if context == "spawn" else workers  # without fields too (spawning workers again adds seconds)
    images, labels, index = next(iter(pf.make_loader(path, batch_size=4, num_workers=workers, size="own",
                                                     multiprocessing_context=context, return_index=True)))
    assert [tuple(image.shape) for image in images] == [(3, *SIZES[i]) for i in index.tolist()]
    assert all(torch.equal(image, dataset[i]["image"]) for image, i in zip(images, index.tolist()))


def test_own_sizes_of_a_raw_archive_are_its_one_size(tmp_path):
    path = tmp_path / "raw.zip"
    with pf.open_writer(path, format="zip", mode="raw", classes=["a", "b"], shape=(12, 10, 3)) as writer:
        for i in range(5):
            writer.add(np.full((12, 10, 3), i, np.uint8), i % 2)
    dataset = pf.PackedDataset(path, output="tensor")
    images, labels = next(iter(pf.make_loader(path, batch_size=5, num_workers=0, shuffle=False, size="own")))
    assert [torch.equal(image, dataset[i][0]) for i, image in enumerate(images)] == [True] * 5


def test_own_sizes_with_a_multiscale_transform_are_alike_for_any_workers(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path)
    runs = [list(pf.make_loader(path, batch_size=4, num_workers=workers, size="own", fields=FIELDS, seed=3,
                                transform=multiscale(), return_index=True)) for workers in (0, 2)]
    assert_batches_equal(*runs)
    for batch in runs[0]:
        assert_on_own_canvas(batch)
        assert all(image.dtype == torch.float32 and min(image.shape[1:]) in (24, 32, 40) or max(image.shape[1:]) == 80
                   for image in batch["image"])


def test_own_sizes_resume_mid_epoch_exactly(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path)
    options = dict(batch_size=2, num_workers=0, size="own", fields=FIELDS, seed=5, transform=multiscale())
    whole = list(pf.make_loader(path, **options))
    first = pf.make_loader(path, **options)
    batch = next(iter(first))
    state = first.state_dict()
    resumed = pf.make_loader(path, **options)
    resumed.load_state_dict(state)
    assert_batches_equal([batch, *resumed], whole)


def test_own_sizes_skip_a_bad_sample(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path)
    flip_byte_inside_sample(str(path), "encoded", 2)
    with pytest.warns(pf.SkippedSampleWarning, match="sample index 2"):
        batches = list(pf.make_loader(path, batch_size=3, num_workers=0, shuffle=False, size="own", fields=FIELDS,
                                      on_error="skip", return_index=True))
    assert [b["index"].tolist() for b in batches] == [[0, 1], [3, 4, 5]]
    assert [len(b["image"]) for b in batches] == [2, 3] and [len(b["boxes"]) for b in batches] == [2, 3]
    for i in (0, 1):  # a batch left empty is no batch, with workers too
        flip_byte_inside_sample(str(path), "encoded", i)
    with pytest.warns(pf.SkippedSampleWarning):
        batches = list(pf.make_loader(path, batch_size=3, num_workers=2, shuffle=False, size="own", on_error="skip",
                                      return_index=True))
    assert [index.tolist() for _, _, index in batches] == [[3, 4, 5]]


def test_what_own_sizes_do_not_take_is_refused_by_name(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path)
    with pytest.raises(ValueError, match="size must be an int, .* or 'own'"):
        pf.make_loader(path, size="mine")
    with pytest.raises(ValueError, match="size='own'.*batch transform.*whole batches"):
        pf.make_loader(path, size="own", transform=pf.transforms.train(32))
    with pytest.raises(ValueError, match="size='own'.*decode='device'"):
        pf.make_loader(path, size="own", decode="device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_own_sizes_come_on_the_loaders_device_as_on_the_cpu(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path)
    options = dict(batch_size=3, num_workers=2, size="own", fields=FIELDS, seed=3, transform=multiscale())
    on_cpu = list(pf.make_loader(path, **options))
    on_gpu = list(pf.make_loader(path, device="cuda", **options))
    assert all(image.is_cuda for batch in on_gpu for image in batch["image"] + batch["mask"] + batch["boxes"])
    assert_batches_equal(on_cpu, [{k: v.cpu() if isinstance(v, torch.Tensor) else [x.cpu() for x in v]
                                   for k, v in batch.items()} for batch in on_gpu])


# ---- mixed sizes without size= ---------------------------------------------------------------------------
def test_a_per_image_transform_that_ends_at_one_size_takes_mixed_sizes(tmp_path):
    from torchvision.transforms import v2

    path = tmp_path / "a.zip"
    write_ramps(path)
    transform = v2.Compose([v2.RandomShortestSize([24, 32]), v2.CenterCrop(20), v2.RandomHorizontalFlip()])
    for batch in pf.make_loader(path, batch_size=3, num_workers=0, fields=FIELDS, transform=transform):
        assert batch["image"].shape == (3, 3, 20, 20) and batch["mask"].shape == (3, 20, 20)
    images, labels = next(iter(pf.make_loader(path, batch_size=3, num_workers=0, transform=transform)))
    assert images.shape == (3, 3, 20, 20)


@pytest.mark.parametrize("fields", [None, FIELDS])
def test_mixed_sizes_that_stay_mixed_say_which_ways_fit(tmp_path, fields):
    from torchvision.transforms import v2

    path = tmp_path / "a.zip"
    write_ramps(path)
    crop = "torchvision v2 transform that starts with RandomResizedCrop" if fields else "pf.transforms.train or val"
    with pytest.raises(pf.PackedFormatError, match=rf"other images of the batch.*size=\(height, width\).*{crop}"
                                                   r".*size='own'"):
        list(pf.make_loader(path, batch_size=3, num_workers=0, fields=fields, shuffle=False))
    with pytest.raises(pf.PackedFormatError, match=r"different sizes .*0 \('00000000'\): 3x60x80, "
                                                   r"1 \('00000001'\): 3x90x70.*size='own'"):
        list(pf.make_loader(path, batch_size=3, num_workers=0, fields=fields, shuffle=False,
                            transform=v2.RandomHorizontalFlip()))


def test_the_fix_a_mixed_size_error_suggests_with_fields_is_accepted(tmp_path):
    from torchvision.transforms import v2

    path = tmp_path / "a.zip"
    write_ramps(path)
    with pytest.raises(pf.PackedFormatError) as error:
        list(pf.make_loader(path, batch_size=3, num_workers=0, fields=FIELDS))
    assert "pf.transforms" not in str(error.value)  # its batch transforms are refused with fields
    with pytest.raises(ValueError, match="with fields"):
        pf.make_loader(path, fields=FIELDS, transform=pf.transforms.val(24))
    for transform in (v2.RandomResizedCrop(24), v2.Compose([v2.Resize(28), v2.CenterCrop(24)]),
                      v2.Compose([v2.RandomShortestSize([28, 32]), v2.RandomHorizontalFlip(), v2.CenterCrop(24)])):
        for batch in pf.make_loader(path, batch_size=3, num_workers=0, fields=FIELDS, transform=transform):
            assert batch["image"].shape == (3, 3, 24, 24) and batch["mask"].shape == (3, 24, 24)
    for batch in pf.make_loader(path, batch_size=3, num_workers=0, fields=FIELDS, size=(24, 24)):
        assert batch["image"].shape == (3, 3, 24, 24) and batch["mask"].shape == (3, 24, 24)


# ---- GroupByAspectRatio -----------------------------------------------------------------------------------
def bins_of(sizes, k: int) -> np.ndarray:
    """torchvision's create_aspect_ratio_groups on (height, width) sizes."""
    ratios = np.array([w / h for h, w in sizes])
    return np.digitize(ratios, (2 ** np.linspace(-1, 1, 2 * k + 1)).tolist())


def reference_batches(order, bins, batch_size: int):
    """torchvision's GroupedBatchSampler's scan (a batch as its bin fills), the leftovers batched in order."""
    buckets, batches = {}, []
    for i in order:
        buckets.setdefault(bins[i], []).append(i)
        if len(buckets[bins[i]]) == batch_size:
            batches.append(buckets.pop(bins[i]))
    rest = sorted((i for bucket in buckets.values() for i in bucket), key=list(order).index)
    return batches + [rest[a : a + batch_size] for a in range(0, len(rest), batch_size)]


def test_grouped_batches_follow_the_reference_scan():
    rng = np.random.default_rng(0)
    for _ in range(20):
        groups = rng.integers(0, 5, 40)
        order = rng.permutation(40)
        got = [b.tolist() for b in grouped_batches(order, groups, 3, drop_last=False)]
        assert got == reference_batches(order.tolist(), groups, 3)
        dropped = [b.tolist() for b in grouped_batches(order, groups, 3, drop_last=True)]
        assert dropped == [b for b in got if len(b) == 3] and len(dropped) == 40 // 3


@pytest.mark.parametrize("k", [1, 3])
def test_group_by_aspect_ratio_batches_one_bin_at_a_time(tmp_path, k):
    path = tmp_path / "a.zip"
    write_ramps(path, sizes=GROUPED_SIZES)
    bins = bins_of(GROUPED_SIZES, k)
    loader = pf.make_loader(path, batch_size=3, num_workers=0, size="own", seed=2, return_index=True,
                            shuffle=pf.GroupByAspectRatio(k=k))
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        order = torch.randperm(len(GROUPED_SIZES), generator=torch.Generator().manual_seed(2 + epoch)).tolist()
        got = [index.tolist() for _, _, index in loader]
        assert got == reference_batches(order, bins, 3) and len(got) == len(loader) == 5
        full = int(sum(np.bincount(bins) // 3))  # the batches of one bin; then the leftovers, bins mixed
        assert all(len({bins[i] for i in batch}) == 1 for batch in got[:full])
        assert sorted(i for batch in got for i in batch) == list(range(len(GROUPED_SIZES)))
    shares = [[index.tolist() for _, _, index in pf.make_loader(
        path, batch_size=3, num_workers=0, size="own", seed=2, return_index=True, rank=rank, world_size=2,
        shuffle=pf.GroupByAspectRatio(k=k))] for rank in (0, 1)]
    order = torch.randperm(len(GROUPED_SIZES), generator=torch.Generator().manual_seed(2)).tolist()
    assert shares == [reference_batches(order[rank::2], bins, 3) for rank in (0, 1)]  # each rank's share grouped


def test_group_by_aspect_ratio_is_alike_for_any_workers_and_resumes(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path, sizes=GROUPED_SIZES)
    options = dict(batch_size=3, size="own", seed=1, return_index=True, shuffle=pf.GroupByAspectRatio(k=1),
                   transform=multiscale())
    runs = [[(images, index) for images, _, index in pf.make_loader(path, num_workers=workers, **options)]
            for workers in (0, 2)]
    for (a, i), (b, j) in zip(*runs):
        assert torch.equal(i, j) and all(torch.equal(x, y) for x, y in zip(a, b))
    first = pf.make_loader(path, num_workers=0, **options)
    taken = [index.tolist() for _, (_, _, index) in zip(range(2), first)]
    state = first.state_dict()
    resumed = pf.make_loader(path, num_workers=2, **options)
    resumed.load_state_dict(state)
    assert taken + [index.tolist() for _, _, index in resumed] == [index.tolist() for _, index in runs[0]]
    other = pf.make_loader(path, num_workers=0, rank=0, world_size=2, **options)
    with pytest.raises(ValueError, match="saved on 1 rank.*GroupByAspectRatio"):
        other.load_state_dict(state)
    plain = pf.make_loader(path, num_workers=0, **{**options, "shuffle": True})
    with pytest.raises(ValueError, match="aspect_groups"):
        plain.load_state_dict(state)


def test_group_by_aspect_ratio_takes_known_sizes_instead_of_reading_them(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path, sizes=GROUPED_SIZES)
    known = [(w, h) for h, w in GROUPED_SIZES]
    read, given = ([index.tolist() for _, _, index in pf.make_loader(
        path, batch_size=3, num_workers=0, size="own", return_index=True, shuffle=grouping)]
        for grouping in (pf.GroupByAspectRatio(k=1), pf.GroupByAspectRatio(k=1, sizes=known)))
    assert read == given
    with pytest.raises(ValueError, match="sizes give 13 samples' sizes.*has 14 samples"):
        pf.make_loader(path, shuffle=pf.GroupByAspectRatio(sizes=known[:-1]))
    with pytest.raises(ValueError, match=r"sizes must be integers \[N, 2\]"):
        pf.GroupByAspectRatio(sizes=[(0, 3)] * 14)
    first = pf.make_loader(path, batch_size=3, num_workers=0, size="own", shuffle=pf.GroupByAspectRatio(k=1))
    next(iter(first))
    other = pf.make_loader(path, batch_size=3, num_workers=0, size="own",
                           shuffle=pf.GroupByAspectRatio(k=1, sizes=[(9, 3)] * 14))
    with pytest.raises(ValueError, match="groups_crc32"):  # other bins: other batches
        other.load_state_dict(first.state_dict())


def test_group_by_aspect_ratio_refuses_what_it_does_not_take(tmp_path):
    path = tmp_path / "a.zip"
    write_ramps(path)
    with pytest.raises(ValueError, match="k must be an integer"):
        pf.GroupByAspectRatio(k=0)
    write_ramps(tmp_path / "b.zip")
    with pytest.raises(ValueError, match="GroupByAspectRatio.*Mixture"):
        pf.make_loader(pf.Mixture({str(path): 1.0, str(tmp_path / "b.zip"): 1.0}), shuffle=pf.GroupByAspectRatio())
    with pytest.raises(ValueError, match="ResumableSampler yields samples"):
        pf.ResumableSampler(6, shuffle=pf.GroupByAspectRatio())
