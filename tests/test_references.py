"""torchvision's detection and segmentation references, run through ``make_loader``: their default transforms
(written here from ``torchvision.transforms.v2``'s public API, scaled down to tiny images) and their collate
functions give what the same pipelines give on the original files and annotations, read by a plain Dataset.

The sets are written here in COCO's layout (PNG images of three aspect ratios, instance masks as RLE) and
in VOC's (JPEG images, palette masks with VOC's 255 border), and converted in encoded mode.  The training
pipelines are random; compared with the files, each sample's draws are pinned by seeding torch from its own
pixels first (the same pixels on both sides), so the real pipelines, every random class in them, run on
each side alike.  Unpinned, an epoch through ``make_loader`` with ``GroupByAspectRatio`` keeps the
references' invariants, is the same for 0 and 2 workers, and resumes exactly.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import packed_formats as pf
from tests.test_coco_source import counts_of

v2 = pytest.importorskip("torchvision.transforms.v2")
tv_tensors = pytest.importorskip("torchvision.tv_tensors")

SIZES = ((30, 40), (40, 30), (24, 48))  # (height, width): three aspect-ratio bins
CATEGORIES = ((3, "car"), (8, "truck"))  # COCO ids, not contiguous: labels are their index + 1
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
COCO_FIELDS = {"boxes": "boxes:XYXY", "labels": "value", "image_id": "value", "masks": "instances"}


# ---- the sets, written as the originals are laid out ----------------------------------------------------------
def write_coco_layout(root: str, count: int = 12) -> str:
    """``count`` noise PNGs (``SIZES`` in turn) with 0-3 boxes each, a rectangle mask (uncompressed RLE) per box:
    cars at least 4 pixels wide, trucks 1 pixel wide (a box the multiscale pipeline may shrink away)."""
    rng = np.random.default_rng(0)
    images, annotations = [], []
    os.makedirs(os.path.join(root, "annotations"))
    os.makedirs(os.path.join(root, "train2017"))
    for i in range(count):
        height, width = SIZES[i % 3]
        image_id = 500 + 7 * i
        name = f"{i:012d}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            os.path.join(root, "train2017", name))
        images.append({"id": image_id, "file_name": name, "height": height, "width": width})
        for k in range(i % 4):  # image 0 has none: evaluation keeps it
            thin = k == 2
            x0, y0 = int(rng.integers(0, width - 5)), int(rng.integers(0, height - 5))
            x1 = x0 + 1 if thin else int(rng.integers(x0 + 4, width + 1))
            y1 = int(rng.integers(y0 + 2, height + 1))
            mask = np.zeros((height, width), bool)
            mask[y0:y1, x0:x1] = True
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": CATEGORIES[1 if thin else 0][0], "iscrowd": 0,
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": float(mask.sum()),
                                "segmentation": {"size": [height, width], "counts": counts_of(mask)}})
    with open(os.path.join(root, "annotations", "instances_train2017.json"), "w") as file:
        json.dump({"images": images, "annotations": annotations,
                   "categories": [{"id": c, "name": n} for c, n in CATEGORIES]}, file)
    return root


def write_voc_layout(root: str, count: int = 9) -> str:
    """VOC2012's JPEGImages and SegmentationClass: ``count`` noise JPEGs, palette masks of classes 0-3 with a
    255 border row."""
    rng = np.random.default_rng(1)
    voc = os.path.join(root, "VOC2012")
    for folder in ("JPEGImages", "SegmentationClass"):
        os.makedirs(os.path.join(voc, folder))
    for i in range(count):
        height, width = SIZES[i % 3]
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            os.path.join(voc, "JPEGImages", f"2007_{i:06d}.jpg"), quality=90)
        mask = rng.integers(0, 4, (height, width)).astype(np.uint8)
        mask[0] = 255
        palette = Image.fromarray(mask, "P")
        palette.putpalette([v for k in range(256) for v in (k, 255 - k, k // 2)])
        palette.save(os.path.join(voc, "SegmentationClass", f"2007_{i:06d}.png"))
    return root


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict:
    """{"coco": (layout, archive), "voc": (layout, archive)}, each converted once for the module."""
    base = tmp_path_factory.mktemp("references")
    made = {}
    for kind, write in (("coco", write_coco_layout), ("voc", write_voc_layout)):
        root = write(str(base / kind))
        out = str(base / f"{kind}.zip")
        pf.convert(root, out, mode="encoded", quiet=True, workers=1)
        made[kind] = (root, out)
    return made


# ---- the reference's way: a plain Dataset over the files ------------------------------------------------------
def rle_decode(counts, height: int, width: int) -> np.ndarray:
    """COCO's uncompressed RLE: runs down each column, from background."""
    flat = np.repeat(np.arange(len(counts)) % 2, counts).astype(np.uint8)
    return flat.reshape(width, height).T


class CocoFiles(torch.utils.data.Dataset):
    """Each image file (by id, as the archive orders them) as a ``tv_tensors.Image`` (or the PIL image) with
    its target made from the annotation file, ``transforms`` given ``(image, target)``."""

    def __init__(self, root: str, transforms=None, pil: bool = False) -> None:
        with open(os.path.join(root, "annotations", "instances_train2017.json")) as file:
            data = json.load(file)
        self.root, self.transforms, self.pil = root, transforms, pil
        self.images = sorted(data["images"], key=lambda image: image["id"])
        self.annotations = data["annotations"]
        self.label = {c: k + 1 for k, c in enumerate(sorted(c["id"] for c in data["categories"]))}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        info = self.images[i]
        height, width = info["height"], info["width"]
        image = Image.open(os.path.join(self.root, "train2017", info["file_name"])).convert("RGB")
        mine = [a for a in self.annotations if a["image_id"] == info["id"]]
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in mine)],
                             dtype=torch.float32).reshape(-1, 4)
        masks = np.stack([rle_decode(a["segmentation"]["counts"], height, width) for a in mine]) if mine else \
            np.zeros((0, height, width), np.uint8)
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
                  "labels": torch.tensor([self.label[a["category_id"]] for a in mine], dtype=torch.int64),
                  "image_id": info["id"], "masks": tv_tensors.Mask(torch.from_numpy(masks))}
        picture = image if self.pil else v2.functional.to_image(image)
        return self.transforms(picture, target) if self.transforms else (picture, target)


class VocFiles(torch.utils.data.Dataset):
    """Each VOC image and its palette mask's indices, ``transforms`` given ``(image, mask)``."""

    def __init__(self, root: str, transforms=None, pil: bool = False) -> None:
        self.voc = os.path.join(root, "VOC2012")
        self.stems = sorted(name[:-4] for name in os.listdir(os.path.join(self.voc, "JPEGImages")))
        self.transforms, self.pil = transforms, pil

    def __len__(self) -> int:
        return len(self.stems)

    def __getitem__(self, i: int):
        image = Image.open(os.path.join(self.voc, "JPEGImages", self.stems[i] + ".jpg")).convert("RGB")
        mask = tv_tensors.Mask(torch.from_numpy(np.array(
            Image.open(os.path.join(self.voc, "SegmentationClass", self.stems[i] + ".png")))))
        picture = image if self.pil else v2.functional.to_image(image)
        return self.transforms(picture, mask) if self.transforms else (picture, mask)


# ---- the references' pipelines and collate functions (scaled to the tiny images) ------------------------------
class SeededByPixels:
    """A first step that seeds torch from the sample's uint8 image, so the random steps after it draw alike for
    the same sample wherever it runs (a make_loader dict, or the files' ``(image, target)``)."""

    def __call__(self, *inputs):
        first = inputs[0]
        image = first["image"] if isinstance(first, dict) else first
        torch.manual_seed(int(image.as_subclass(torch.Tensor).to(torch.int64).sum()))
        return inputs if len(inputs) > 1 else first


def detection_train(augmentation: str = "multiscale", flip: float = 0.5, seeded: bool = False):
    """The detection reference's training preset ("multiscale": sizes from 16 to 64, max 80)."""
    steps = [SeededByPixels()] if seeded else []
    if augmentation == "multiscale":
        steps.append(v2.RandomShortestSize(min_size=(16, 24, 32, 40, 48, 56, 64), max_size=80))
    steps += [v2.RandomHorizontalFlip(p=flip), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
              v2.ConvertBoundingBoxFormat("XYXY"), v2.SanitizeBoundingBoxes(), v2.ToPureTensor()]
    return v2.Compose(steps)


def detection_eval():
    return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.ToPureTensor()])


def segmentation_train(base: int = 32, crop: int = 28, seeded: bool = False):
    """The segmentation reference's training preset: shorter side from base/2 to 2 base, flip, a crop padded
    with 0 (image) and 255 (mask), float, normalised."""
    steps = [SeededByPixels()] if seeded else []
    steps += [v2.RandomResize(base // 2, 2 * base), v2.RandomHorizontalFlip(0.5),
              v2.RandomCrop(crop, pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
              v2.ToImage(), v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64,
                                        "others": None}, scale=True),
              v2.Normalize(mean=MEAN, std=STD), v2.ToPureTensor()]
    return v2.Compose(steps)


def segmentation_eval(base: int = 32):
    return v2.Compose([v2.Resize(base), v2.ToImage(),
                       v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64, "others": None},
                                  scale=True),
                       v2.Normalize(mean=MEAN, std=STD), v2.ToPureTensor()])


def detection_collate(batch):
    return tuple(zip(*batch))


def padded(tensors, fill) -> torch.Tensor:
    """The tensors in one batch, each in the top-left of the largest size, the rest ``fill``."""
    shape = [max(sizes) for sizes in zip(*(t.shape for t in tensors))]
    out = tensors[0].new_full((len(tensors), *shape), fill)
    for place, tensor in zip(out, tensors):
        place[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def segmentation_collate(batch):
    """The segmentation reference's batching: images padded with 0, masks with 255, to the batch's largest."""
    images, masks = zip(*batch)
    return padded(images, 0), padded(masks, 255)


# ---- comparing ----------------------------------------------------------------------------------------------
def plain(x):
    return x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x


def assert_detection_batch(batch: dict, expected: list, masks: bool) -> None:
    """A make_loader batch against the files' ``(image, target)`` pairs of the same samples."""
    assert len(batch["image"]) == len(expected)
    for k, (image, target) in enumerate(expected):
        assert torch.equal(plain(batch["image"][k]), plain(image))
        assert torch.equal(plain(batch["boxes"][k]), plain(target["boxes"]))
        assert torch.equal(batch["labels"][k], target["labels"])
        assert int(batch["image_id"][k]) == target["image_id"]
        if masks:
            assert_masks(plain(batch["masks"][k]), plain(target["masks"]))


def assert_masks(got: torch.Tensor, want: torch.Tensor) -> None:
    """The archive's instance masks against the annotation file's: equal where one instance is; where
    instances overlap, the instance map keeps one of them (the smaller), so each such pixel is in one mask."""
    assert got.shape == want.shape and got.dtype == want.dtype
    overlap = want.sum(dim=0) > 1
    assert torch.equal(got[:, ~overlap], want[:, ~overlap])
    assert bool((got.sum(dim=0)[overlap] == 1).all() and (got <= want).all())


def loader_options(workers: int) -> dict:
    return dict(batch_size=4, num_workers=workers, shuffle=False, size="own", return_index=True)


# ---- evaluation: deterministic, every batch equals the files --------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_detection_evaluation_through_make_loader_equals_the_files(sets, workers):
    root, archive = sets["coco"]
    files = CocoFiles(root, transforms=detection_eval())
    transform = detection_eval()
    batches = list(pf.make_loader(archive, fields=COCO_FIELDS, transform=transform, **loader_options(workers)))
    assert [b["index"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for batch in batches:
        assert_detection_batch(batch, [files[i] for i in batch["index"].tolist()], masks=True)
        assert [tuple(image.shape[1:]) for image in batch["image"]] == [SIZES[i % 3] for i in batch["index"]]
    assert len(batches[0]["boxes"][0]) == 0 and batches[0]["masks"][0].shape == (0, 30, 40)  # kept, no boxes


@pytest.mark.parametrize("workers", [0, 2])
def test_segmentation_evaluation_through_make_loader_equals_the_files_and_pads_as_the_reference(sets, workers):
    root, archive = sets["voc"]
    files = VocFiles(root, transforms=segmentation_eval())
    batches = list(pf.make_loader(archive, fields={"mask": "mask"}, transform=segmentation_eval(),
                                  **loader_options(workers)))
    assert sum(len(b["image"]) for b in batches) == len(files) == 9
    for batch in batches:
        expected = [files[i] for i in batch["index"].tolist()]
        pairs = list(zip(batch["image"], batch["mask"]))
        for (image, mask), (want_image, want_mask) in zip(pairs, expected):
            assert torch.equal(plain(image), want_image) and torch.equal(plain(mask), want_mask)
            assert min(image.shape[1:]) == 32 and mask.dtype == torch.int64
        images, masks = segmentation_collate([(plain(i), plain(m)) for i, m in pairs])
        want_images, want_masks = segmentation_collate(expected)
        assert torch.equal(images, want_images) and torch.equal(masks, want_masks)
        assert (masks == 255).any()  # VOC's border row, and the padding


# ---- training: the real random pipelines, each sample's draws pinned, equal the files --------------------------
@pytest.mark.parametrize("augmentation, flip", [("multiscale", 0.5), ("hflip", 0.5), ("multiscale", 1.0)])
def test_detection_training_with_pinned_draws_equals_the_files(sets, augmentation, flip):
    root, archive = sets["coco"]
    files = CocoFiles(root, transforms=detection_train(augmentation, flip, seeded=True))
    transform = detection_train(augmentation, flip, seeded=True)
    for batch in pf.make_loader(archive, fields=COCO_FIELDS, transform=transform, **loader_options(0)):
        assert_detection_batch(batch, [files[i] for i in batch["index"].tolist()], masks=True)


def test_segmentation_training_with_pinned_draws_equals_the_files(sets):
    root, archive = sets["voc"]
    files = VocFiles(root, transforms=segmentation_train(seeded=True))
    loader = pf.make_loader(archive, fields={"mask": "mask"}, transform=segmentation_train(seeded=True),
                            batch_size=4, num_workers=0, shuffle=True, return_index=True)
    for batch in loader:  # one crop size: stacked batches, as the reference's collate gives them
        want_images, want_masks = segmentation_collate([files[i] for i in batch["index"].tolist()])
        assert torch.equal(batch["image"], want_images) and torch.equal(batch["mask"], want_masks)
        assert batch["image"].shape[1:] == (3, 28, 28)


# ---- training unpinned: an epoch grouped by aspect ratio keeps the invariants ----------------------------------
def test_detection_training_grouped_by_aspect_ratio_keeps_the_invariants_for_any_workers_and_resumes(sets):
    root, archive = sets["coco"]
    sizes = {i: SIZES[i % 3] for i in range(12)}
    options = dict(batch_size=2, size="own", fields=COCO_FIELDS, seed=4, return_index=True,
                   transform=detection_train(), shuffle=pf.GroupByAspectRatio(k=3))
    runs = [list(pf.make_loader(archive, num_workers=workers, **options)) for workers in (0, 2)]
    dropped = 0
    for batch in runs[0]:
        index = batch["index"].tolist()
        assert len({sizes[i][1] / sizes[i][0] for i in index}) == 1  # one aspect ratio: one bin
        for k, i in enumerate(index):
            image, boxes, labels, masks = batch["image"][k], batch["boxes"][k], batch["labels"][k], batch["masks"][k]
            height, width = image.shape[1:]
            scale = width / sizes[i][1]
            assert image.dtype == torch.float32 and 16 <= min(height, width) and max(height, width) <= 80
            assert masks.shape == (len(boxes), height, width) and len(labels) == len(boxes)
            assert tuple(boxes.canvas_size) == (height, width)
            assert bool((boxes[:, 0] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 1] >= 0).all()
                        and (boxes[:, 3] <= height).all())
            assert bool(((boxes[:, 2] - boxes[:, 0]) >= 1).all() and ((boxes[:, 3] - boxes[:, 1]) >= 1).all())
            thin = (boxes[:, 2] - boxes[:, 0]) < 2.5 * scale  # trucks are 1 pixel wide in the source
            assert (labels == 2).tolist() == thin.tolist()  # each label still its own box's
            for box, mask in zip(boxes.tolist(), masks):  # each mask inside its own box
                ys, xs = torch.nonzero(mask, as_tuple=True)
                if len(ys):
                    assert box[0] - 1 <= xs.min() and xs.max() < box[2] + 1
                    assert box[1] - 1 <= ys.min() and ys.max() < box[3] + 1
            dropped += (i % 4 == 3 and not thin.any())
    assert dropped  # a truck scaled under a pixel wide went, with its label and mask
    for a, b in zip(*runs):
        assert a["index"].tolist() == b["index"].tolist()
        for name in ("image", "boxes", "labels", "masks"):
            assert all(torch.equal(plain(x), plain(y)) for x, y in zip(a[name], b[name])), name
    assert len(runs[0]) == len(runs[1]) == 6
    first = pf.make_loader(archive, num_workers=0, **options)
    taken = [batch["index"].tolist() for _, batch in zip(range(2), first)]
    resumed = pf.make_loader(archive, num_workers=2, **options)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert taken + [b["index"].tolist() for b in rest] == [b["index"].tolist() for b in runs[0]]
    for a, b in zip(rest, runs[0][2:]):
        assert all(torch.equal(plain(x), plain(y)) for x, y in zip(a["image"], b["image"]))


# ---- the references' collate functions over PackedDataset --------------------------------------------------------
def test_the_references_collate_functions_batch_packed_dataset_items_as_the_files(sets):
    root, archive = sets["coco"]
    dataset = pf.PackedDataset(archive, target="coco", transforms=detection_eval())  # PIL images, as the reference
    files = CocoFiles(root, transforms=detection_eval(), pil=True)
    loaders = [torch.utils.data.DataLoader(d, batch_size=3, collate_fn=detection_collate) for d in (dataset, files)]
    for (images, targets), (want_images, want_targets) in zip(*loaders):
        assert len(images) == len(targets) == 3
        for image, target, want_image, want_target in zip(images, targets, want_images, want_targets):
            assert torch.equal(image, want_image) and target["image_id"] == want_target["image_id"]
            for name in ("boxes", "labels"):
                assert torch.equal(plain(target[name]), plain(want_target[name])), name
            assert_masks(plain(target["masks"]), plain(want_target["masks"]))
    root, archive = sets["voc"]
    pairs = v2.Compose([segmentation_eval(), lambda sample: (sample["image"], sample["mask"])])
    dataset = pf.PackedDataset(archive, fields={"mask": "mask"}, transform=pairs)
    files = VocFiles(root, transforms=segmentation_eval(), pil=True)
    loaders = [torch.utils.data.DataLoader(d, batch_size=4, collate_fn=segmentation_collate) for d in (dataset, files)]
    batches = list(zip(*loaders))
    assert len(batches) == 3
    for (images, masks), (want_images, want_masks) in batches:
        assert torch.equal(images, want_images) and torch.equal(masks, want_masks)
        assert images.dtype == torch.float32 and masks.dtype == torch.int64
