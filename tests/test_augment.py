"""Per-sample augmentations (RandomErasing, TrivialAugmentWide, RandAugment) and transforms of (images, labels).

The augmentations are specified by torchvision's per-image transforms: the same
distributions of random parameters, drawn per sample, and the same pixels as
torchvision's functional op for each op and magnitude.  MixUp and CutMix are
specified by torchvision's reference training script: applied to whole
normalised batches and their labels, which become soft float targets.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

import packed_formats as pf
from packed_formats import transforms as T
from packed_formats.loading.device import copy_then_transform

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
CLASSES = ("ants", "bees", "cats")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def random_images(b=8, h=20, w=28, dtype=torch.uint8, seed=0, device="cpu"):
    """uint8 [0, 255] or float [0, 1] images (non-square, to catch swapped axes)."""
    images = torch.randint(0, 256, (b, 3, h, w), dtype=torch.uint8, generator=gen(seed))
    images = images if dtype == torch.uint8 else images.to(dtype) / 255
    return images.to(device)


def ks_statistic(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov distance between the empirical distributions of a and b."""
    a, b = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    points = np.concatenate([a, b])
    below_a, below_b = np.searchsorted(a, points, "right") / len(a), np.searchsorted(b, points, "right") / len(b)
    return float(np.abs(below_a - below_b).max())


def ks_limit(n, m) -> float:
    """The KS distance two samples of one distribution exceed with probability 0.001."""
    return 1.95 * math.sqrt((n + m) / (n * m))


def chi_square(counts_a, counts_b) -> float:
    """Two-sample chi-square statistic of two count vectors over the same categories."""
    a, b = np.asarray(counts_a, dtype=float), np.asarray(counts_b, dtype=float)
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    ka, kb = math.sqrt(b.sum() / a.sum()), math.sqrt(a.sum() / b.sum())
    return float(((ka * a - kb * b) ** 2 / (a + b)).sum())


CHI_SQUARE_LIMIT = {13: 34.53, 30: 59.70}  # degrees of freedom -> value exceeded with probability 0.001


# ---- RandomErasing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_random_erasing_erases_exactly_the_drawn_box_of_each_sample(device):
    batch = random_images(16, device=device)
    erasing = T.RandomErasing(p=0.7, value=(1, 2, 3))
    erased, tops, lefts, heights, widths = erasing.get_params(16, 20, 28, gen(4))
    out = erasing(batch, generator=gen(4))
    assert 0 < int(erased.sum()) < 16 and out.dtype == torch.uint8 and out.device == batch.device
    for b in range(16):
        expected = batch[b].clone()
        if erased[b]:
            t, left, h, w = int(tops[b]), int(lefts[b]), int(heights[b]), int(widths[b])
            expected[:, t : t + h, left : left + w] = torch.tensor([1, 2, 3], dtype=torch.uint8).view(3, 1, 1)
        assert torch.equal(out[b], expected)


def torchvision_erasing_boxes(erasing, image, n):
    """(h, w, top, left) of n torchvision RandomErasing draws that erase something; and how many did not fit."""
    torch.manual_seed(0)
    boxes, misses = [], 0
    for _ in range(n):
        params = erasing.make_params([image])
        if params["v"] is None:
            misses += 1
        else:
            boxes.append((params["h"], params["w"], params["i"], params["j"]))
    return np.array(boxes), misses


def test_random_erasing_boxes_follow_torchvision_in_area_aspect_and_position():
    height, width, scale, ratio = 20, 28, (0.05, 0.6), (0.5, 4.0)  # asymmetric: h/w and w/h differ
    ours = T.RandomErasing(p=1.0, scale=scale, ratio=ratio)
    erased, tops, lefts, heights, widths = (t.numpy() for t in ours.get_params(40000, height, width, gen(1)))
    theirs, misses = torchvision_erasing_boxes(
        v2.RandomErasing(p=1.0, scale=scale, ratio=ratio), torch.zeros(3, height, width), 4000)
    h, w, top, left = (erased_values[erased] for erased_values in (heights, widths, tops, lefts))
    limit = ks_limit(len(h), len(theirs))
    assert ks_statistic(h * w / (height * width), theirs[:, 0] * theirs[:, 1] / (height * width)) < limit
    assert ks_statistic(h / w, theirs[:, 0] / theirs[:, 1]) < limit
    assert ks_statistic(top / (height - h + 1), theirs[:, 2] / (height - theirs[:, 0] + 1)) < limit
    assert ks_statistic(left / (width - w + 1), theirs[:, 3] / (width - theirs[:, 1] + 1)) < limit
    # boxes that never fit leave the sample as it is, as often as in torchvision
    assert abs((1 - erased.mean()) - misses / 4000) < 4 * math.sqrt(0.25 / 4000)


def test_random_erasing_applies_with_probability_p_independently_per_sample():
    erased = T.RandomErasing(p=0.3, scale=(0.02, 0.1))(torch.ones(20000, 1, 8, 8), generator=gen(2)) == 0
    per_sample = erased.flatten(1).any(1).float()
    assert abs(float(per_sample.mean()) - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 20000)
    torch.manual_seed(2)
    theirs = v2.RandomErasing(p=0.3, scale=(0.02, 0.1))
    changed = [bool((theirs(torch.ones(1, 8, 8)) == 0).any()) for _ in range(3000)]
    assert abs(np.mean(changed) - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 3000)


def test_random_erasing_draws_a_box_per_sample():
    _, tops, lefts, heights, widths = T.RandomErasing(p=1.0).get_params(64, 40, 40, gen(3))
    assert len(set(zip(tops.tolist(), lefts.tolist(), heights.tolist(), widths.tolist()))) > 48


@pytest.mark.parametrize("device", DEVICES)
def test_random_erasing_random_value_is_standard_normal_noise_in_the_box(device):
    batch = torch.full((64, 3, 32, 32), 7.0, device=device)
    out = T.RandomErasing(p=1.0, value="random")(batch, generator=gen(5))
    noise = out[out != 7.0]
    assert noise.numel() > 10000
    assert abs(float(noise.mean())) < 0.05 and abs(float(noise.std()) - 1) < 0.05


def test_random_erasing_random_value_refuses_uint8_batches():
    with pytest.raises(ValueError, match="normalised float batches"):
        T.RandomErasing(p=1.0, value="random")(random_images(), generator=gen())


# ---- TrivialAugmentWide and RandAugment: each op equals torchvision's -------------------------------
def torchvision_op(name, image, magnitude, interpolation, fill):
    """The torchvision functional op that torchvision's auto-augment transforms apply for ``name``."""
    interpolation = v2.InterpolationMode(interpolation)  # torchvision before 0.24 takes no string here
    degrees = math.degrees(math.atan(magnitude))
    white = 1.0 if image.is_floating_point() else 255.0
    ops = {
        "Identity": lambda: image,
        "ShearX": lambda: TF.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=[degrees, 0.0],
                                    interpolation=interpolation, fill=fill, center=[0, 0]),
        "ShearY": lambda: TF.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=[0.0, degrees],
                                    interpolation=interpolation, fill=fill, center=[0, 0]),
        "TranslateX": lambda: TF.affine(image, angle=0.0, translate=[int(magnitude), 0], scale=1.0, shear=[0.0, 0.0],
                                        interpolation=interpolation, fill=fill),
        "TranslateY": lambda: TF.affine(image, angle=0.0, translate=[0, int(magnitude)], scale=1.0, shear=[0.0, 0.0],
                                        interpolation=interpolation, fill=fill),
        "Rotate": lambda: TF.rotate(image, angle=magnitude, interpolation=interpolation, fill=fill),
        "Brightness": lambda: TF.adjust_brightness(image, 1.0 + magnitude),
        "Color": lambda: TF.adjust_saturation(image, 1.0 + magnitude),
        "Contrast": lambda: TF.adjust_contrast(image, 1.0 + magnitude),
        "Sharpness": lambda: TF.adjust_sharpness(image, 1.0 + magnitude),
        "Posterize": lambda: TF.posterize(image, int(magnitude)),
        "Solarize": lambda: TF.solarize(image, white * magnitude),
        "AutoContrast": lambda: TF.autocontrast(image),
        "Equalize": lambda: TF.equalize(image),
    }
    return ops[name]()


def some_magnitudes(name, n, height, width):
    """n magnitudes of op ``name`` from the tables of both transforms, the signed ones of both signs."""
    values = []
    for transform in (T.TrivialAugmentWide(), T.RandAugment()):
        table, signed = transform.magnitude_table(height, width)
        row = transform.op_names.index(name)
        values += [float(table[row, k]) * (-1 if signed[row] and i % 2 else 1) for i, k in enumerate((0, 9, 20, 30))]
    return torch.tensor(values[:n], dtype=torch.float64)


GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
OP_CASES = [(op, "nearest", None) for op in T.TrivialAugmentWide().op_names] + [
    (op, interpolation, fill)
    for op in GEOMETRIC
    for interpolation, fill in (("bilinear", None), ("nearest", [9, 8, 7]), ("bilinear", 5))
]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32], ids=["uint8", "float"])
@pytest.mark.parametrize("op, interpolation, fill", OP_CASES, ids=lambda x: str(x))
def test_each_op_gives_torchvision_pixels_per_sample(op, interpolation, fill, dtype):
    images = random_images(8, dtype=dtype, seed=len(op))
    if dtype == torch.uint8:  # a flat channel and a dark sample: autocontrast and equalize corner cases
        images[0, 1] = 77
        images[1] //= 8
    magnitudes = some_magnitudes(op, 8, 20, 28)
    augment = T.TrivialAugmentWide(interpolation=interpolation, fill=fill)
    ops = torch.full((8,), augment.op_names.index(op))
    out = augment.apply_ops(images, ops, magnitudes)
    assert out.dtype == dtype and out.shape == images.shape
    for b in range(8):
        expected = torchvision_op(op, images[b], float(magnitudes[b]), interpolation, fill)
        if dtype == torch.uint8:
            assert int((out[b].int() - expected.int()).abs().max()) <= 1
            assert float((out[b] != expected).float().mean()) < 1e-3
        else:
            assert torch.allclose(out[b], expected, atol=1e-5), (b, float(magnitudes[b]))


def test_ops_apply_in_turn_for_each_round():
    images = random_images(6)
    augment = T.RandAugment(num_ops=2)
    names = augment.op_names
    ops = torch.tensor([[names.index("Rotate")] * 6, [names.index("Posterize")] * 6])
    magnitudes = torch.tensor([[30.0] * 6, [4.0] * 6], dtype=torch.float64)
    out = augment.apply_ops(images, ops, magnitudes)
    for b in range(6):
        expected = TF.posterize(TF.rotate(images[b], 30.0), 4)
        assert torch.equal(out[b], expected)


# ---- TrivialAugmentWide and RandAugment: draws -------------------------------------------------------
def torchvision_draws(transform, calls, monkeypatch):
    """(op name, magnitude) of every op torchvision's ``transform`` applies in ``calls`` calls."""
    seen = []

    def record(image, name, magnitude, interpolation, fill):
        seen.append((name, magnitude))
        return image

    monkeypatch.setattr(transform, "_apply_image_or_video_transform", record)
    torch.manual_seed(0)
    image = torch.zeros(3, 20, 28, dtype=torch.uint8)
    for _ in range(calls):
        transform(image)
    return seen


def our_draws(transform, n):
    ops, magnitudes = transform.get_params(n, 20, 28, gen(7))
    return [(transform.op_names[o], m) for o, m in zip(ops.flatten().tolist(), magnitudes.flatten().tolist())]


def check_same_draws(ours, theirs, names):
    """Op frequencies alike; the same magnitudes; each magnitude as often; signs half and half."""
    op_counts = [[sum(1 for n, _ in draws if n == name) for name in names] for draws in (ours, theirs)]
    assert chi_square(*op_counts) < CHI_SQUARE_LIMIT[len(names) - 1]
    their_values = {(n, m) for n, m in theirs}
    our_values = {(n, m) for n, m in ours}
    assert their_values <= our_values
    for draws in (ours, theirs):
        signed = [m for n, m in draws if n in GEOMETRIC + ("Brightness", "Color", "Contrast", "Sharpness") and m != 0]
        assert abs(np.mean(np.array(signed) < 0) - 0.5) < 4 * math.sqrt(0.25 / len(signed))
    return our_values


def test_trivial_augment_draws_ops_and_magnitudes_as_torchvision(monkeypatch):
    ours = T.TrivialAugmentWide()
    mine = our_draws(ours, 60000)
    theirs = torchvision_draws(v2.TrivialAugmentWide(), 4000, monkeypatch)
    values = check_same_draws(mine, theirs, ours.op_names)
    # every value drawn: 9 signed ops of 31 bins (0 has no sign), posterize's 7 bit counts, 31 thresholds, 3 ops without
    assert len(values) == 9 * (2 * 31 - 1) + 7 + 31 + 3
    table, _ = ours.magnitude_table(20, 28)

    def bins(draws):  # which bin each magnitude is, over the ops with a magnitude that varies by bin
        found = [int(np.flatnonzero(table[ours.op_names.index(n)].numpy() == abs(m))[0])
                 for n, m in draws if n not in ("Identity", "AutoContrast", "Equalize", "Posterize")]
        return np.bincount(found, minlength=31)

    assert chi_square(bins(mine), bins(theirs)) < CHI_SQUARE_LIMIT[30]


def test_rand_augment_draws_ops_and_magnitudes_as_torchvision(monkeypatch):
    ours = T.RandAugment(num_ops=2, magnitude=9)
    mine = our_draws(ours, 30000)
    theirs = torchvision_draws(v2.RandAugment(num_ops=2, magnitude=9), 2000, monkeypatch)
    assert len(theirs) == 4000 and len(mine) == 60000
    values = check_same_draws(mine, theirs, ours.op_names)
    assert values == {(n, m) for n, m in theirs}  # one bin: the same handful of values


def test_augment_draws_each_sample_its_own_op_and_result():
    batch = random_images(1).expand(64, -1, -1, -1).contiguous()
    ops, _ = T.TrivialAugmentWide().get_params(64, 20, 28, gen(1))
    assert len(set(ops.tolist())) >= 10
    out = T.TrivialAugmentWide()(batch, generator=gen(1))
    assert len({out[b].numpy().tobytes() for b in range(64)}) > 32


@pytest.mark.parametrize("transform", [T.TrivialAugmentWide(), T.RandAugment(), T.RandomErasing(p=1.0)],
                         ids=["trivial", "rand", "erasing"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32], ids=["uint8", "float"])
def test_augmentations_keep_dtype_shape_and_layout(transform, dtype):
    batch = random_images(8, dtype=dtype).contiguous(memory_format=torch.channels_last)
    out = transform(batch, generator=gen(2))
    assert out.dtype == dtype and out.shape == batch.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, transform(batch, generator=gen(2)))
    assert not torch.equal(out, batch)


def test_auto_augment_refuses_images_of_other_channel_counts():
    with pytest.raises(ValueError, match="1 or 3 channels"):
        T.RandAugment()(torch.zeros(2, 4, 8, 8, dtype=torch.uint8))


@CUDA
@pytest.mark.parametrize("transform", [T.TrivialAugmentWide(), T.RandAugment(num_ops=3), T.RandomErasing(p=0.8)],
                         ids=["trivial", "rand", "erasing"])
def test_augmentations_on_cuda_match_the_cpu_ones(transform):
    batch = random_images(64, seed=3)
    cpu = transform(batch, generator=gen(9))
    cuda = transform(batch.cuda(), generator=gen(9)).cpu()
    assert float((cpu != cuda).float().mean()) < 1e-3  # nearest-pixel ties may fall apart by float rounding


# ---- transforms of (images, labels) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def labelled_archive(tmp_path_factory):
    """A raw memmap archive of 24 random 16x20 images in 3 classes."""
    path = tmp_path_factory.mktemp("augment") / "labelled.memmap"
    rng = np.random.default_rng(0)
    with pf.open_writer(path, format="memmap", mode="raw", shape=(16, 20, 3), classes=CLASSES) as writer:
        for i in range(24):
            writer.add(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8), i % 3, f"{CLASSES[i % 3]}/{i}.png")
    return str(path)


def mixing_kind(images, labels, plain, plain_labels):
    """"mixup" or "cutmix", having checked that (images, labels) are the plain batch mixed, sample by
    sample, with its predecessor in the batch (torchvision pairs each sample with the one before it)."""
    onehot = torch.nn.functional.one_hot(plain_labels, 3).float()
    rolled, rolled_onehot = plain.roll(1, 0), onehot.roll(1, 0)
    assert labels.shape == (len(plain), 3) and labels.dtype == torch.float32
    if bool(((images == plain) | (images == rolled)).all()):  # CutMix: one box pasted from the predecessor
        lam = 1 - float((images != plain).flatten(1).any(0).float().mean())
        kind = "cutmix"
    else:  # MixUp: a blend, lam * own + (1 - lam) * predecessor's
        difference = (plain - rolled).flatten()
        lam = float(((images - rolled).flatten() @ difference) / (difference @ difference))
        assert torch.allclose(images, lam * plain + (1 - lam) * rolled, atol=1e-5)
        kind = "mixup"
    assert torch.allclose(labels, lam * onehot + (1 - lam) * rolled_onehot, atol=1e-5)
    return kind


@pytest.mark.parametrize(
    "mixer, kinds",
    [(lambda: v2.MixUp(num_classes=3), {"mixup"}), (lambda: v2.CutMix(num_classes=3), {"cutmix"}),
     (lambda: v2.RandomChoice([v2.MixUp(num_classes=3), v2.CutMix(num_classes=3)]), {"mixup", "cutmix"})],
    ids=["mixup", "cutmix", "either"],
)
def test_mixup_and_cutmix_through_make_loader_with_two_workers_mix_pairs_within_each_batch(
    labelled_archive, mixer, kinds
):
    options = dict(batch_size=8, seed=3, persistent_workers=False)
    mixed = pf.make_loader(labelled_archive, num_workers=2, transform=T.Compose([T.ToFloat(), mixer()]), **options)
    plain = pf.make_loader(labelled_archive, num_workers=0, transform=T.ToFloat(), **options)
    seen = set()
    for _ in range(3):
        for (images, labels), (plain_images, plain_labels) in zip(mixed, plain):
            seen.add(mixing_kind(images, labels, plain_images, plain_labels))
    assert seen == kinds


def test_label_mixing_draws_follow_the_loader_seed_with_any_number_of_workers(labelled_archive):
    transform = T.Compose([T.Normalize(), v2.RandomChoice([v2.MixUp(num_classes=3), v2.CutMix(num_classes=3)])])
    options = dict(batch_size=8, seed=5, transform=transform, persistent_workers=False)
    torch.manual_seed(123)  # the caller's global state must not decide the draws
    main = list(pf.make_loader(labelled_archive, num_workers=0, **options))
    torch.manual_seed(456)
    workers = list(pf.make_loader(labelled_archive, num_workers=2, **options))
    for (a, la), (b, lb) in zip(main, workers):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_labels_transform_runs_after_the_steps_before_it_on_the_device_path():
    images, labels = random_images(4), torch.tensor([0, 1, 2, 0])
    seen = {}

    def double_labels(x, y):
        seen["dtype"] = x.dtype
        return x, y * 2

    batches = copy_then_transform(iter([(images, labels)]), torch.device("cpu"),
                                  T.Compose([T.Normalize(), T.WithLabels(double_labels)]), lambda k: gen(k))
    out, out_labels = next(batches)
    assert seen["dtype"] == torch.float32 and out.dtype == torch.float32
    assert torch.equal(out_labels, labels * 2)


@CUDA
def test_mixup_runs_on_the_gpu_when_batches_go_there(labelled_archive):
    transform = T.Compose([T.Normalize(), v2.MixUp(num_classes=3)])
    loader = pf.make_loader(labelled_archive, batch_size=8, num_workers=2, device="cuda", transform=transform)
    for images, labels in loader:
        assert images.is_cuda and labels.is_cuda and labels.shape == (8, 3) and labels.dtype == torch.float32


def with_labels_identity(x, y):
    return x, y


@pytest.mark.parametrize(
    "call",
    [
        lambda batch: T.apply_transform(v2.MixUp(num_classes=3), batch.float()),
        lambda batch: T.Compose([T.ToFloat(), v2.CutMix(num_classes=3)])(batch),
        lambda batch: T.per_sample(v2.RandomChoice([v2.MixUp(num_classes=3), v2.CutMix(num_classes=3)]), batch),
        lambda batch: T.apply_transform(T.WithLabels(with_labels_identity), batch),
        lambda batch: T.WithLabels(with_labels_identity)(batch),
    ],
    ids=["mixup", "compose", "per-sample", "with-labels", "with-labels-alone"],
)
def test_a_labels_transform_given_only_images_says_so(call):
    with pytest.raises(TypeError, match=r"takes \(images, labels\), but was given images only"):
        call(random_images(4))


def test_a_mixer_not_marked_as_taking_labels_is_told_its_images_dtype_and_to_use_with_labels(labelled_archive):
    """A plain ``fn(images, labels)`` after Normalize gets float32 images one at a time: the error says
    float32 (what it got), and how to give it the labels."""
    def blend_with_next(images, labels):
        return (images + images.roll(1, 0)) / 2, labels

    loader = pf.make_loader(labelled_archive, batch_size=8, num_workers=0,
                            transform=T.Compose([T.Normalize(), blend_with_next]))
    with pytest.raises(TypeError) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert "float32" in message and "uint8" not in message
    assert "pf.transforms.WithLabels(" in message and "(images, labels)" in message


def test_mixup_of_uint8_batches_says_to_normalise_first(labelled_archive):
    loader = pf.make_loader(labelled_archive, batch_size=8, num_workers=0, transform=v2.MixUp(num_classes=3))
    with pytest.raises(ValueError, match="needs float images.*after pf.transforms.Normalize"):
        next(iter(loader))


def test_mixing_the_labels_of_samples_without_one_is_refused_by_name(tmp_path):
    """torch's one_hot said only "Class values must be non-negative", at the first batch."""
    images = [torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8) for _ in range(4)]
    path = tmp_path / "unlabelled.memmap"
    pf.convert(pf.PythonSource(images, labelled=False), path, format="memmap", mode="raw", quiet=True, workers=1)
    for mixer in (v2.MixUp(num_classes=3), T.Compose([T.Normalize(), v2.CutMix(num_classes=3)])):
        with pytest.raises(pf.PackedFormatError, match="mixes the batch's labels.*have no label") as caught:
            pf.make_loader(path, batch_size=2, num_workers=0, transform=mixer)
        assert caught.value.path == str(path)
    # a batch that holds samples without a label (a mixture of sets with and without) says where they are
    with pytest.raises(ValueError, match=r"samples without a label \(-1, at places \[1\] of the batch\)"):
        T.apply_with_labels(v2.CutMix(num_classes=3), random_images(2), torch.tensor([0, -1]))


def test_cutmix_needs_no_float_images():
    images, labels = T.apply_with_labels(v2.CutMix(num_classes=3), random_images(4), torch.tensor([0, 1, 2, 0]))
    assert images.dtype == torch.uint8 and labels.shape == (4, 3)


def test_a_torchvision_pipeline_mixing_mixup_with_per_image_ops_is_refused():
    pipeline = v2.Compose([v2.RandomHorizontalFlip(), v2.MixUp(num_classes=3)])
    assert T.takes_labels(pipeline)
    with pytest.raises(ValueError, match="draw once per batch"):
        T.apply_with_labels(pipeline, random_images(4).float(), torch.tensor([0, 1, 2, 0]))


def test_takes_labels_recognises_mixers_and_marked_transforms_only():
    assert T.takes_labels(v2.MixUp(num_classes=3)) and T.takes_labels(v2.CutMix(num_classes=3))
    assert T.takes_labels(v2.RandomApply([v2.MixUp(num_classes=3)], p=0.5))
    assert T.takes_labels(T.WithLabels(with_labels_identity))
    assert T.takes_labels(T.Compose([T.Normalize(), v2.MixUp(num_classes=3)]))
    assert not T.takes_labels(v2.Compose([v2.RandomHorizontalFlip()]))
    assert not T.takes_labels(T.train(16)) and not T.takes_labels(T.TrivialAugmentWide())
