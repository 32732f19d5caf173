"""pf.transforms: batched crops, flips and normalisation on known inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packed_formats import memory
from packed_formats import transforms as T


def position_batch(b=8, h=20, w=30, dtype=torch.uint8):
    """A batch whose pixels encode (sample, row, column) in channels 0, 1, 2."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    batch = torch.stack([torch.stack([torch.full((h, w), s), rows, cols]) for s in range(b)])
    return batch.to(dtype)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_random_crop_takes_the_drawn_window_of_each_sample():
    batch = position_batch()
    crop = T.RandomCrop((8, 10))
    tops, lefts = crop.get_params(8, 20, 30, gen(3))
    out = crop(batch, generator=gen(3))
    assert out.shape == (8, 3, 8, 10)
    for b in range(8):
        t, left = int(tops[b]), int(lefts[b])
        assert torch.equal(out[b], batch[b, :, t : t + 8, left : left + 10])
        assert int(out[b, 1, 0, 0]) == t and int(out[b, 2, 0, 0]) == left


def test_random_crop_offsets_differ_between_samples():
    tops, lefts = T.RandomCrop(4).get_params(32, 40, 40, gen(0))
    assert len(set(zip(tops.tolist(), lefts.tolist()))) > 16
    assert 0 <= int(tops.min()) and int(tops.max()) <= 36 and int(lefts.max()) <= 36


def test_center_crop_takes_the_middle():
    out = T.CenterCrop((10, 10))(position_batch())
    assert int(out[0, 1, 0, 0]) == 5 and int(out[0, 2, 0, 0]) == 10
    assert out.shape == (8, 3, 10, 10)


@pytest.mark.parametrize("transform", [T.RandomCrop(21), T.CenterCrop((10, 31))], ids=["random", "center"])
def test_crops_reject_windows_larger_than_the_images(transform):
    with pytest.raises(ValueError, match="does not fit"):
        transform(position_batch())


def test_transforms_reject_a_single_image():
    with pytest.raises(ValueError, match=r"\[B,C,H,W\]"):
        T.RandomHorizontalFlip()(torch.zeros(3, 8, 8, dtype=torch.uint8))


def test_random_resized_crop_resizes_each_drawn_box():
    batch = position_batch(b=6, h=40, w=40)
    rrc = T.RandomResizedCrop(16, scale=(0.2, 0.6))
    tops, lefts, hs, ws = rrc.get_params(6, 40, 40, gen(5))
    out = rrc(batch, generator=gen(5))
    assert out.shape == (6, 3, 16, 16) and out.dtype == torch.uint8
    for b in range(6):
        t, left, h, w = int(tops[b]), int(lefts[b]), int(hs[b]), int(ws[b])
        assert 0.2 * 1600 * 0.9 <= h * w <= 0.6 * 1600 * 1.1 and t + h <= 40 and left + w <= 40
        crop = batch[b : b + 1, :, t : t + h, left : left + w]
        expected = F.interpolate(crop, size=(16, 16), mode="bilinear", antialias=True, align_corners=False)
        assert torch.equal(out[b], expected[0])


def test_random_resized_crop_draws_a_different_box_per_sample():
    boxes = T.RandomResizedCrop(8).get_params(32, 50, 50, gen(1))
    assert len(set(zip(*(t.tolist() for t in boxes)))) == 32


def test_random_resized_crop_of_the_whole_image_is_a_resize():
    batch = position_batch(b=2, h=30, w=30, dtype=torch.float32)
    out = T.RandomResizedCrop(10, scale=(1.0, 1.0), ratio=(1.0, 1.0))(batch, generator=gen())
    expected = F.interpolate(batch, size=(10, 10), mode="bilinear", antialias=True, align_corners=False)
    assert out.dtype == torch.float32 and torch.allclose(out, expected)


def test_random_resized_crop_falls_back_to_a_center_crop():
    # no box of 100% area with aspect 2 fits a square image: torchvision's fallback
    tops, lefts, hs, ws = T.RandomResizedCrop(4, scale=(1, 1), ratio=(2, 2)).get_params(3, 20, 20, gen())
    assert hs.tolist() == [10] * 3 and ws.tolist() == [20] * 3 and tops.tolist() == [5] * 3


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_horizontal_flip_mirrors_exactly_the_chosen_samples(layout):
    batch = position_batch(b=64)
    if layout == "channels_last":  # as make_loader hands batches over: a view of an NHWC buffer
        batch = batch.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    flip = T.RandomHorizontalFlip()
    chosen = flip.get_params(64, gen(2))
    out = flip(batch, generator=gen(2))
    assert 0 < int(chosen.sum()) < 64
    for b in range(64):
        assert torch.equal(out[b], batch[b].flip(-1) if chosen[b] else batch[b])


def test_flip_leaves_its_input_unchanged():
    batch = position_batch()
    before = batch.clone()
    T.RandomHorizontalFlip(p=1.0)(batch)
    assert torch.equal(batch, before)


def test_to_float_scales_uint8_to_unit_range():
    out = T.ToFloat()(torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1))
    assert out.dtype == torch.float32
    assert torch.allclose(out.flatten(), torch.tensor([0.0, 0.2, 1.0]))


def test_normalize_uint8_uses_unit_range_mean_and_std():
    batch = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1)
    out = T.Normalize(mean=(0.5, 0.5, 0.1), std=(0.5, 0.25, 0.1))(batch).flatten()
    assert torch.allclose(out, torch.tensor([-1.0, 2.0, 1.0]), atol=1e-6)


def test_normalize_float_equals_normalize_uint8():
    batch = torch.randint(0, 256, (4, 3, 5, 5), generator=gen(), dtype=torch.uint8)
    norm = T.Normalize()
    assert torch.allclose(norm(batch), norm(batch.float() / 255), atol=1e-5)


def test_channels_last_batches_stay_channels_last():
    batch = torch.zeros(4, 20, 20, 3, dtype=torch.uint8).permute(0, 3, 1, 2)
    for transform in (T.RandomCrop(8), T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.Normalize()):
        assert transform(batch, generator=gen()).is_contiguous(memory_format=torch.channels_last)


def test_same_generator_seed_gives_same_batch_and_other_seed_another():
    batch = torch.randint(0, 256, (16, 3, 32, 32), generator=gen(9), dtype=torch.uint8)
    train = T.train(16)
    a, b, c = train(batch, generator=gen(1)), train(batch, generator=gen(1)), train(batch, generator=gen(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_constructor_generator_is_used_without_one_in_forward():
    batch = position_batch(b=16)
    a = T.RandomCrop(5, generator=gen(4))(batch)
    b = T.RandomCrop(5)(batch, generator=gen(4))
    assert torch.equal(a, b)


def test_train_preset_gives_normalised_float_batches_of_size():
    out = T.train(12)(torch.randint(0, 256, (5, 3, 30, 40), dtype=torch.uint8), generator=gen())
    assert out.shape == (5, 3, 12, 12) and out.dtype == torch.float32
    assert float(out.min()) >= -2.2 and float(out.max()) <= 2.7


def test_val_preset_resizes_then_center_crops():
    batch = position_batch(b=2, h=16, w=32)
    out = T.val(14, resize=16)(batch)  # already 16 on the short side: a pure center crop
    expected = T.Normalize()(batch[:, :, 1:15, 9:23])
    assert torch.allclose(out, expected, atol=1e-5)


def test_compose_accepts_plain_callables():
    out = T.Compose([T.CenterCrop(4), lambda x: x + 1])(torch.zeros(1, 3, 8, 8, dtype=torch.uint8))
    assert out.shape == (1, 3, 4, 4) and int(out.min()) == 1


def test_a_per_image_transform_that_fails_is_told_the_dtype_of_the_image_it_got():
    from torchvision.transforms import ToTensor  # takes PIL images and arrays, not tensors

    with pytest.raises(TypeError, match=r"failed on one float64 \[C,H,W\] image of shape \(3, 8, 8\)") as caught:
        T.Compose([T.ToFloat(torch.float64), ToTensor()])(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
    assert "uint8" not in str(caught.value) and "pf.transforms.WithLabels" in str(caught.value)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gathered_crops_equal_the_per_sample_windows(layout):
    batch = position_batch()
    if layout == "channels_last":
        batch = batch.contiguous(memory_format=torch.channels_last)
    crop = T.RandomCrop((8, 10))
    tops, lefts = crop.get_params(8, 20, 30, gen(3))
    assert torch.equal(T.gathered_crops(batch, tops, lefts, (8, 10)), crop(batch, generator=gen(3)))


@pytest.mark.parametrize("antialias", [True, False], ids=["antialias", "plain"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32], ids=["uint8", "float"])
def test_batched_resized_crops_equal_per_sample_interpolate(dtype, antialias):
    """The matrix form the GPU uses gives the CPU's crop-then-interpolate, up- and downscaling."""
    batch = torch.randint(0, 256, (16, 3, 64, 80), generator=gen(), dtype=torch.uint8)
    batch = batch.contiguous(memory_format=torch.channels_last)
    if dtype == torch.float32:
        batch = batch.float() / 255
    crop = T.RandomResizedCrop((40, 48), scale=(0.05, 1.0), antialias=antialias)
    boxes = crop.get_params(16, 64, 80, gen(1))
    assert bool((boxes[2] < 40).any() and (boxes[2] > 40).any())  # both directions are exercised
    batched, per_sample = T.resized_crops(batch, boxes, (40, 48), antialias), crop(batch, generator=gen(1))
    assert batched.dtype == dtype and batched.is_contiguous(memory_format=torch.channels_last)
    if dtype == torch.uint8:  # the CPU resizes uint8 in fixed point: rounding may differ by one
        assert int((batched.int() - per_sample.int()).abs().max()) <= 1
    else:
        assert torch.allclose(batched, per_sample, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transforms_on_cuda_match_the_cpu_ones():
    batch = torch.randint(0, 256, (8, 3, 32, 32), generator=gen(), dtype=torch.uint8)
    cpu = T.RandomCrop(16)(batch, generator=gen(7))
    cuda = T.RandomCrop(16)(batch.cuda(), generator=gen(7))
    assert torch.equal(cpu, cuda.cpu())
    cpu, cuda = T.train(16)(batch, generator=gen(7)), T.train(16)(batch.cuda(), generator=gen(7))
    assert cuda.device.type == "cuda" and cuda.shape == (8, 3, 16, 16)
    assert float((cpu - cuda.cpu()).abs().max()) <= 1.01 / 255 / min(T.IMAGENET_STD)  # uint8 rounding at most
    val_cpu, val_cuda = T.val(16)(batch), T.val(16)(batch.cuda())
    assert float((val_cpu - val_cuda.cpu()).abs().max()) <= 1.01 / 255 / min(T.IMAGENET_STD)


def one_by_one(transforms, batch, generator):
    for t in transforms:
        batch = t(batch, generator=generator)
    return batch


def forbid_forward(monkeypatch, *classes):
    """Make ``forward`` of ``classes`` fail, so a test sees whether the fused op still runs them itself."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__}.forward ran: CropFlipNormalize did not fuse it")

    for cls in classes:
        monkeypatch.setattr(cls, "forward", refuse)


@pytest.mark.parametrize("size", [16, (12, 20), (24, 10)], ids=["square", "wide", "tall"])
@pytest.mark.parametrize("tail", ["normalize", "to_float"])
@pytest.mark.parametrize("flip", [True, False], ids=["flip", "no_flip"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_fused_crop_flip_normalize_equals_the_modules_one_by_one(monkeypatch, layout, flip, tail, size):
    batch = torch.randint(0, 256, (24, 3, 40, 56), generator=gen(), dtype=torch.uint8)
    if layout == "channels_last":  # as make_loader hands batches over: a view of an NHWC buffer
        batch = batch.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    fused = T.CropFlipNormalize(
        T.RandomResizedCrop(size), T.RandomHorizontalFlip() if flip else None,
        T.Normalize() if tail == "normalize" else T.ToFloat(),
    )
    assert len(fused.transforms) == 2 + flip
    expected = one_by_one(fused.transforms, batch, gen(4))
    forbid_forward(monkeypatch, T.RandomResizedCrop, T.RandomHorizontalFlip, T.Normalize, T.ToFloat)
    out = fused(batch, generator=gen(4))
    assert torch.equal(out, expected)
    assert out.is_contiguous()  # what models and DDP expect, turned per sample while in cache


@pytest.mark.parametrize("tail", ["normalize", "to_float"])
@pytest.mark.parametrize("flip", [True, False], ids=["flip", "no_flip"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_fused_flip_normalize_equals_the_modules_one_by_one(monkeypatch, layout, flip, tail):
    # what is left of train() and val() once an encoded archive has cropped at decode
    batch = torch.randint(0, 256, (24, 3, 20, 28), generator=gen(), dtype=torch.uint8)
    if layout == "channels_last":
        batch = batch.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    fused = T.FlipNormalize(T.RandomHorizontalFlip() if flip else None, T.Normalize() if tail == "normalize"
                            else T.ToFloat())
    expected = one_by_one(fused.transforms, batch, gen(4))
    unflipped = one_by_one(fused.transforms[-1:], batch, None)
    forbid_forward(monkeypatch, T.RandomHorizontalFlip, T.Normalize, T.ToFloat)
    out = fused(batch, generator=gen(4))
    assert torch.equal(out, expected) and out.is_contiguous()
    flipped = [torch.equal(o, u.flip(2)) and not torch.equal(o, u) for o, u in zip(out, unflipped)]
    assert (any(flipped) and not all(flipped)) if flip else not any(flipped)


def test_fused_op_inside_a_longer_compose_uses_each_modules_own_generator(monkeypatch):
    batch = torch.randint(0, 256, (16, 3, 48, 48), generator=gen(), dtype=torch.uint8)
    transforms = [
        T.CenterCrop(40),
        T.RandomResizedCrop(16, generator=gen(1)),
        T.RandomHorizontalFlip(generator=gen(2)),
        T.Normalize(),
        lambda x: x * 2,
    ]
    expected = transforms[-1](one_by_one(transforms[:-1], batch, None))
    # the same modules again, their generators fresh
    transforms[1].generator, transforms[2].generator = gen(1), gen(2)
    forbid_forward(monkeypatch, T.RandomHorizontalFlip)
    composed = T.Compose([transforms[0], T.CropFlipNormalize(*transforms[1:4]), transforms[4]])
    assert torch.equal(composed(batch), expected)


def test_train_preset_fuses_on_cpu_uint8_batches(monkeypatch):
    batch = torch.randint(0, 256, (8, 32, 32, 3), generator=gen(), dtype=torch.uint8).permute(0, 3, 1, 2)
    expected = one_by_one(T.train(16).transforms, batch, gen(6))
    forbid_forward(monkeypatch, T.RandomResizedCrop, T.RandomHorizontalFlip, T.Normalize)
    assert torch.equal(T.train(16)(batch, generator=gen(6)), expected)


def test_float_batches_take_the_modules_one_by_one():
    batch = torch.rand(4, 3, 20, 20, generator=gen())
    train = T.train(8)
    assert torch.equal(train(batch, generator=gen(3)), one_by_one(train.transforms, batch, gen(3)))


def test_fused_op_reports_a_channel_mismatch_like_normalize():
    with pytest.raises(ValueError, match="batch has 4 channels"):
        T.train(8)(torch.zeros(2, 4, 16, 16, dtype=torch.uint8), generator=gen())


def test_fused_op_takes_only_its_own_parts():
    with pytest.raises(TypeError, match="RandomResizedCrop"):
        T.CropFlipNormalize(T.RandomCrop(8), None, T.Normalize())


def test_compose_runs_each_op_itself():
    calls = []

    class Spy(T.BatchTransform):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, batch, generator=None, allocate=None):
            calls.append(type(self.op).__name__)
            return self.op(batch, generator=generator, allocate=allocate)

    batch = torch.randint(0, 256, (4, 3, 20, 20), generator=gen(), dtype=torch.uint8)
    ops = [T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.Normalize()]
    out = T.Compose([Spy(op) for op in ops])(batch, generator=gen(1))
    assert calls == ["RandomResizedCrop", "RandomHorizontalFlip", "Normalize"]
    assert torch.equal(out, T.train(8)(batch, generator=gen(1)))


# ---- allocate: where an op puts its result ----------------------------------------------------------


class Allocator:
    """An ``allocate`` that records what it hands out (None: it declines every request)."""

    def __init__(self, decline=False):
        self.given, self.decline, self.buffers = [], decline, memory.ReusedBuffers()

    def __call__(self, shape, dtype, memory_format):
        if self.decline:
            self.given.append(None)
            return None
        self.given.append(self.buffers.take(shape, dtype, memory_format))
        return self.given[-1]


@pytest.mark.parametrize(
    "transform",
    [
        T.train(8),
        T.Compose([T.RandomCrop(12), T.RandomHorizontalFlip(), T.Normalize()]),
        T.Compose([T.RandomResizedCrop(8), T.ToFloat()]),
        T.RandomCrop(8),
        T.RandomResizedCrop(8),
        T.RandomHorizontalFlip(),
        T.Normalize(),
        T.ToFloat(),
    ],
    ids=["train", "compose_normalize", "compose_to_float", "crop", "resized_crop", "flip", "normalize", "to_float"],
)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_result_is_placed_where_allocate_says_and_only_the_result(transform, layout):
    batch = torch.randint(0, 256, (4, 3, 16, 16), generator=gen(), dtype=torch.uint8)
    if layout == "channels_last":
        batch = batch.contiguous(memory_format=torch.channels_last)
    expected = transform(batch, generator=gen(1))
    allocate = Allocator()
    out = transform(batch, generator=gen(1), allocate=allocate)
    assert len(allocate.given) == 1 and out.data_ptr() == allocate.given[0].data_ptr()
    assert torch.equal(out, expected) and out.stride() == expected.stride()
    declined = Allocator(decline=True)
    assert torch.equal(transform(batch, generator=gen(1), allocate=declined), expected) and declined.given == [None]


def test_views_and_kernel_results_ignore_allocate():
    batch = position_batch()
    allocate = Allocator()
    assert T.CenterCrop(4)(batch, allocate=allocate).untyped_storage().data_ptr() == batch.data_ptr()
    T.Resize(10)(batch, allocate=allocate)
    assert allocate.given == []


def test_a_batch_transform_without_allocate_still_runs_last_in_a_compose():
    class Doubled(T.BatchTransform):
        def forward(self, batch, generator=None):
            return batch * 2

    batch = position_batch()
    out = T.Compose([T.CenterCrop(4), Doubled()])(batch, generator=gen(), allocate=Allocator())
    assert torch.equal(out, T.CenterCrop(4)(batch) * 2)
    assert torch.equal(T.apply_transform(Doubled(), batch, gen(), Allocator()), batch * 2)


# ---- how transforms print
def example_transforms():
    """One instance of every public transform class, its arguments away from their defaults, and the
    ``name=value`` texts its repr must hold."""
    crop = T.RandomResizedCrop((24, 32), scale=(0.3, 0.9), ratio=(0.5, 2.0), antialias=False)
    crop_texts = ["size=(24, 32)", "scale=(0.3, 0.9)", "ratio=(0.5, 2.0)", "interpolation=bilinear", "antialias=False"]
    flip = T.RandomHorizontalFlip(p=0.25)
    normalize = T.Normalize((0.1, 0.2, 0.3), (0.4, 0.5, 0.6), dtype=torch.float64, memory_format=torch.channels_last)
    normalize_texts = ["mean=(0.1, 0.2, 0.3)", "std=(0.4, 0.5, 0.6)", "dtype=torch.float64",
                       "memory_format=torch.channels_last"]
    return {
        T.BatchTransform: (T.BatchTransform(), []),
        T.Batched: (T.Batched(abs), ["abs"]),
        T.CenterCrop: (T.CenterCrop((24, 32)), ["size=(24, 32)"]),
        T.Compose: (T.Compose([T.CenterCrop(7), flip]), ["CenterCrop(size=(7, 7))", "RandomHorizontalFlip(p=0.25)"]),
        T.CropFlipNormalize: (T.CropFlipNormalize(crop, flip, normalize, batchwise=True),
                              crop_texts + ["p=0.25"] + normalize_texts + ["batchwise=True"]),
        T.FlipNormalize: (T.FlipNormalize(flip, normalize, batchwise=True), ["p=0.25"] + normalize_texts
                          + ["batchwise=True"]),
        T.Normalize: (normalize, normalize_texts),
        T.RandAugment: (T.RandAugment(num_ops=3, magnitude=5, num_magnitude_bins=11, interpolation="bilinear",
                                      fill=[1.0, 2.0, 3.0]),
                        ["num_ops=3", "magnitude=5", "num_magnitude_bins=11", "interpolation=bilinear",
                         "fill=[1.0, 2.0, 3.0]"]),
        T.RandomCrop: (T.RandomCrop((24, 32)), ["size=(24, 32)"]),
        T.RandomErasing: (T.RandomErasing(p=0.7, scale=(0.1, 0.2), ratio=(0.5, 1.5), value="random"),
                          ["p=0.7", "scale=(0.1, 0.2)", "ratio=(0.5, 1.5)", "value='random'"]),
        T.RandomHorizontalFlip: (flip, ["p=0.25"]),
        T.RandomResizedCrop: (crop, crop_texts),
        T.Resize: (T.Resize(40, antialias=False), ["size=40", "interpolation=bilinear", "antialias=False"]),
        T.ToFloat: (T.ToFloat(torch.float16, memory_format=torch.channels_last),
                    ["dtype=torch.float16", "memory_format=torch.channels_last"]),
        T.TrivialAugmentWide: (T.TrivialAugmentWide(num_magnitude_bins=7, interpolation="bilinear", fill=9.0),
                               ["num_magnitude_bins=7", "interpolation=bilinear", "fill=9.0"]),
        T.WithLabels: (T.WithLabels(divmod), ["divmod"]),
    }


def test_every_public_transform_prints_its_name_and_arguments():
    examples = example_transforms()
    public = {getattr(T, name) for name in T.__all__ if isinstance(getattr(T, name), type)}
    assert public == set(examples)  # a new transform class needs an example here
    for kind, (transform, texts) in examples.items():
        text = repr(transform)
        assert text.startswith(f"{kind.__name__}("), text
        assert [t for t in texts if t not in text] == [], text


def test_a_compose_prints_one_transform_a_line_indented_as_torchvision_does():
    inner = T.Compose([T.CenterCrop(7), T.ToFloat()])
    assert repr(T.Compose([inner, T.RandomHorizontalFlip()])) == "\n".join([
        "Compose(",
        "    Compose(",
        "        CenterCrop(size=(7, 7))",
        "        ToFloat(dtype=torch.float32)",
        "    )",
        "    RandomHorizontalFlip(p=0.5)",
        ")",
    ])


def test_the_recipes_print_their_sizes_and_settings():
    train = repr(T.train(224, scale=(0.35, 1.0)))
    assert "RandomResizedCrop(size=(224, 224), scale=(0.35, 1.0), ratio=(0.75, 1.3333)" in train
    assert "RandomHorizontalFlip(p=0.5)" in train and "Normalize(mean=(0.485, 0.456, 0.406)" in train
    val = repr(T.val(224))
    assert "Resize(size=256, interpolation=bilinear, antialias=True)" in val and "CenterCrop(size=(224, 224))" in val
