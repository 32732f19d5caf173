"""torchvision's detection and segmentation references' input pipelines, measured three ways on one set.

    python -m packed_formats.bench.detection [--images 256] [--workers 2] [--rounds 2] [--out det.json]

The set is real photographs of mixed sizes (``synthetic.make_photo_folder``: crops of a photograph shipped
with matplotlib; drawn shapes where none is installed, said so in the output), laid out twice as the
references read them: COCO's (``train2017/`` and ``annotations/instances_train2017.json``, 1-6 random
boxes of 3 categories per image) for detection, VOC's (``JPEGImages/`` and ``SegmentationClass/``, an
8-bit palette mask per image: its blurred brightness in five classes, VOC's 255 at their borders) for
segmentation.  Each is converted once, in encoded mode (the same JPEG and PNG bytes).

Four pipelines, the references' defaults written with ``torchvision.transforms.v2`` (sizes times
``--scale``), each drawn per sample:

* detection training ("multiscale"): ``RandomShortestSize(min_size=(480, ..., 800), max_size=1333)``,
  ``RandomHorizontalFlip``, ``ToImage``, ``ToDtype(float32)``, ``SanitizeBoundingBoxes``; targets of boxes,
  labels and image id (Faster R-CNN's);
* detection evaluation: ``ToImage``, ``ToDtype(float32)``, images of their own sizes;
* segmentation training: ``RandomResize(260, 1040)``, ``RandomHorizontalFlip``, ``RandomCrop(480)`` padded
  with 0 (image) and 255 (mask), ``ToDtype``, ``Normalize``;
* segmentation evaluation: ``Resize(520)`` (the shorter side), ``ToDtype``, ``Normalize``.

Each runs three ways, ``--workers`` DataLoader workers each, persistent:

* files: a plain ``Dataset`` over the image files and the annotations, the references' way (PIL images,
  the v2 transforms on them, then tensors), in a DataLoader with the reference's collate (a tuple of
  images and one of targets for detection; images padded with 0 and masks with 255 to the batch's
  largest for segmentation);
* ``PackedDataset``: the archive, ``target="coco"`` for detection (``fields={"mask": "mask"}`` for
  segmentation), in the same DataLoader with the same collate;
* ``make_loader``: the archive, ``size="own"`` (images of their own sizes, as lists), the transform run
  in the workers on each sample's tensors, ``shuffle=GroupByAspectRatio(k=3)`` for detection training;
  a segmentation batch is padded as the reference's collate pads it, in this process.

The two DataLoaders shuffle training plainly (the reference's grouping sampler orders, it reads
nothing).  Each loader runs one warm-up epoch (the page cache warm, the workers started), then
``--rounds`` timed ones; the figure is the median epoch's images per second, each way's ratio to the
files' in the same run.  The ways take their timed epochs in turn (the first way's, then the second's
and the third's, then again), so that a load that comes and goes on a shared machine falls on each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

CATEGORIES = ((1, "person"), (3, "car"), (18, "dog"))  # COCO's ids for them
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PIPELINES = ("detection-train", "detection-eval", "segmentation-train", "segmentation-eval")
FILES, DATASET, LOADER = "files (plain Dataset)", "PackedDataset", "make_loader(size='own')"


# ---- the set -----------------------------------------------------------------------------------------------
def make_reference_sets(root: str, images: int, sizes=(360, 640), seed: int = 0) -> Dict[str, Any]:
    """``images`` photographs laid out as COCO (``root/coco``) and VOC (``root/voc/VOC2012``); returns
    what it made."""
    from PIL import Image, ImageFilter

    from .. import synthetic

    photos = bool(synthetic.sample_photographs())
    made = os.path.join(root, "photos")
    if photos:
        synthetic.make_photo_folder(made, images_per_class=images, classes=("all",), sizes=sizes, seed=seed)
    else:
        synthetic.make_image_folder(made, images_per_class=images, classes=("all",), sizes=sizes, seed=seed)
    names = sorted(os.listdir(os.path.join(made, "all")))
    coco, voc = os.path.join(root, "coco"), os.path.join(root, "voc", "VOC2012")
    for folder in (os.path.join(coco, "train2017"), os.path.join(coco, "annotations"),
                   os.path.join(voc, "JPEGImages"), os.path.join(voc, "SegmentationClass")):
        os.makedirs(folder)
    rng = np.random.default_rng(seed)
    entries: List[Dict[str, Any]] = []
    annotations: List[Dict[str, Any]] = []
    for n, name in enumerate(names):
        path = os.path.join(made, "all", name)
        stem = f"{n:012d}"
        shutil.copyfile(path, os.path.join(coco, "train2017", stem + ".jpg"))
        shutil.copyfile(path, os.path.join(voc, "JPEGImages", stem + ".jpg"))
        with Image.open(path) as image:
            width, height = image.size
            brightness = image.convert("L").filter(ImageFilter.GaussianBlur(6))
        levels = (np.asarray(brightness, dtype=np.uint16) * 5 // 256).astype(np.uint8)
        edges = np.zeros(levels.shape, bool)  # VOC's 255 between the regions
        edges[1:] |= levels[1:] != levels[:-1]
        edges[:, 1:] |= levels[:, 1:] != levels[:, :-1]
        mask = Image.fromarray(np.where(edges, 255, levels).astype(np.uint8), "P")
        mask.putpalette([v for k in range(256) for v in (k * 50 % 256, k * 90 % 256, k * 20 % 256)])
        mask.save(os.path.join(voc, "SegmentationClass", stem + ".png"))
        entries.append({"id": n + 1, "file_name": stem + ".jpg", "width": width, "height": height})
        for _ in range(int(rng.integers(1, 7))):
            w, h = (int(v) for v in rng.integers(8, [width // 2, height // 2]))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            annotations.append({"id": len(annotations) + 1, "image_id": n + 1, "iscrowd": 0, "area": float(w * h),
                                "category_id": CATEGORIES[int(rng.integers(len(CATEGORIES)))][0],
                                "bbox": [x, y, w, h]})
    with open(os.path.join(coco, "annotations", "instances_train2017.json"), "w", encoding="utf-8") as file:
        json.dump({"images": entries, "annotations": annotations,
                   "categories": [{"id": c, "name": name} for c, name in CATEGORIES]}, file)
    shutil.rmtree(made)
    return {"coco": coco, "voc": os.path.dirname(voc), "images": len(names), "boxes": len(annotations),
            "photographs": photos, "sizes": list(sizes)}


class CocoFiles(torch.utils.data.Dataset):
    """The reference's way: each image file opened with PIL, its target (boxes, labels, image id) made from
    the annotation file, ``transforms`` given ``(image, target)``."""

    def __init__(self, root: str, transforms: Callable) -> None:
        with open(os.path.join(root, "annotations", "instances_train2017.json"), encoding="utf-8") as file:
            data = json.load(file)
        self.folder, self.transforms = os.path.join(root, "train2017"), transforms
        self.images = sorted(data["images"], key=lambda image: image["id"])
        self.label = {c: k + 1 for k, c in enumerate(sorted(c["id"] for c in data["categories"]))}
        self.of_image: Dict[int, List[Dict[str, Any]]] = {}
        for annotation in data["annotations"]:
            self.of_image.setdefault(annotation["image_id"], []).append(annotation)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        from PIL import Image
        from torchvision import tv_tensors

        info = self.images[i]
        image = Image.open(os.path.join(self.folder, info["file_name"])).convert("RGB")
        mine = self.of_image.get(info["id"], [])
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in mine)],
                             dtype=torch.float32).reshape(-1, 4)
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(image.height, image.width)),
                  "labels": torch.tensor([self.label[a["category_id"]] for a in mine], dtype=torch.int64),
                  "image_id": info["id"]}
        return self.transforms(image, target)


class VocFiles(torch.utils.data.Dataset):
    """The reference's way: each VOC image and its palette mask opened with PIL (the mask's indices a
    ``Mask``), ``transforms`` given ``(image, mask)``."""

    def __init__(self, root: str, transforms: Callable) -> None:
        self.voc, self.transforms = os.path.join(root, "VOC2012"), transforms
        self.stems = sorted(name[:-4] for name in os.listdir(os.path.join(self.voc, "JPEGImages")))

    def __len__(self) -> int:
        return len(self.stems)

    def __getitem__(self, i: int):
        from PIL import Image
        from torchvision import tv_tensors

        image = Image.open(os.path.join(self.voc, "JPEGImages", self.stems[i] + ".jpg")).convert("RGB")
        with Image.open(os.path.join(self.voc, "SegmentationClass", self.stems[i] + ".png")) as mask:
            target = tv_tensors.Mask(torch.from_numpy(np.array(mask)))
        return self.transforms(image, target)


# ---- the references' pipelines and collate functions -----------------------------------------------------------
def pipeline(name: str, scale: float = 1.0) -> Callable:
    """One of ``PIPELINES``, the reference's default sizes times ``scale``."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    def px(n: int) -> int:
        return max(1, round(n * scale))

    to_float = v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64, "others": None},
                          scale=True)
    if name == "detection-train":
        steps = [v2.RandomShortestSize(min_size=tuple(px(s) for s in range(480, 801, 32)), max_size=px(1333)),
                 v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                 v2.SanitizeBoundingBoxes()]
    elif name == "detection-eval":
        steps = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    elif name == "segmentation-train":
        steps = [v2.RandomResize(px(260), px(1040)), v2.RandomHorizontalFlip(),
                 v2.RandomCrop(px(480), pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
                 v2.ToImage(), to_float, v2.Normalize(mean=MEAN, std=STD)]
    elif name == "segmentation-eval":
        steps = [v2.Resize(px(520)), v2.ToImage(), to_float, v2.Normalize(mean=MEAN, std=STD)]
    else:
        raise ValueError(f"no pipeline {name!r}: one of {PIPELINES}")
    return v2.Compose([*steps, v2.ToPureTensor()])


def detection_collate(batch: Sequence[Any]) -> Tuple[Any, ...]:
    """The detection reference's batching: a tuple of the images and one of the targets."""
    return tuple(zip(*batch))


def padded(tensors: Sequence[torch.Tensor], fill: int) -> torch.Tensor:
    """The tensors in one batch, each in the top-left corner of the largest size, the rest ``fill``."""
    shape = [max(sizes) for sizes in zip(*(t.shape for t in tensors))]
    out = tensors[0].new_full((len(tensors), *shape), fill)
    for place, tensor in zip(out, tensors):
        place[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def segmentation_collate(batch: Sequence[Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The segmentation reference's batching: images padded with 0, masks with 255, to the batch's largest."""
    images, masks = zip(*batch)
    return padded(images, 0), padded(masks, 255)


def _pairs(sample: Dict[str, Any]) -> Tuple[Any, Any]:
    return sample["image"], sample["mask"]


# ---- running -------------------------------------------------------------------------------------------------
def loaders(name: str, sets: Dict[str, str], *, workers: int, batch_size: int,
            scale: float) -> Dict[str, Tuple[Any, Callable[[Any], Any]]]:
    """{way: (loader, consume)} for pipeline ``name``: ``consume`` takes a batch as the training loop would
    (a make_loader segmentation batch padded as the reference's collate pads it) and returns its size."""
    from torchvision.transforms import v2

    import packed_formats as pf

    transform, training = pipeline(name, scale), name.endswith("-train")
    options: Dict[str, Any] = dict(batch_size=batch_size, shuffle=training, num_workers=workers,
                                   persistent_workers=workers > 0)
    if name.startswith("detection"):
        files: torch.utils.data.Dataset = CocoFiles(sets["coco_root"], transform)
        packed: torch.utils.data.Dataset = pf.PackedDataset(sets["coco"], target="coco",
                                                            fields=["boxes", "labels", "image_id"],
                                                            transforms=transform)
        collate: Callable = detection_collate
        fields: Dict[str, str] = {"boxes": "boxes:XYXY", "labels": "value", "image_id": "value"}
        archive = sets["coco"]
    else:
        files = VocFiles(sets["voc_root"], transform)
        packed = pf.PackedDataset(sets["voc"], fields={"mask": "mask"}, transform=v2.Compose([transform, _pairs]))
        collate, fields, archive = segmentation_collate, {"mask": "mask"}, sets["voc"]
    shuffle: Any = pf.GroupByAspectRatio(k=3) if name == "detection-train" else training
    ours = pf.make_loader(archive, batch_size=batch_size, shuffle=shuffle, num_workers=workers, size="own",
                          fields=fields, transform=transform)

    def count(batch: Any) -> int:
        return len(batch[0])

    def consume(batch: Dict[str, Any]) -> int:
        if "mask" in batch:
            segmentation_collate(list(zip(batch["image"], batch["mask"])))
        return len(batch["image"])

    return {FILES: (torch.utils.data.DataLoader(files, collate_fn=collate, **options), count),
            DATASET: (torch.utils.data.DataLoader(packed, collate_fn=collate, **options), count),
            LOADER: (ours, consume)}


def epoch_rate(loader: Any, count: Callable[[Any], int]) -> float:
    """Images per second of one epoch of ``loader``, each batch taken by ``count``."""
    start, seen = time.perf_counter(), 0
    for batch in loader:
        seen += count(batch)
    return seen / (time.perf_counter() - start)


def run(sets: Dict[str, str], *, workers: int, batch_size: int, rounds: int, scale: float,
        pipelines: Sequence[str] = PIPELINES) -> Dict[str, Dict[str, Any]]:
    """{pipeline: {way: {"rates": [...], "median": images/s, "ratio": to the files'}}}."""
    torch.set_num_threads(1)
    out: Dict[str, Dict[str, Any]] = {}
    for name in pipelines:
        ways = loaders(name, sets, workers=workers, batch_size=batch_size, scale=scale)
        rates: Dict[str, List[float]] = {way: [] for way in ways}
        for loader, count in ways.values():
            epoch_rate(loader, count)  # the warm-up epoch
        for _ in range(rounds):  # the ways in turn, round after round: a load that comes and goes hits each alike
            for way, (loader, count) in ways.items():
                rates[way].append(epoch_rate(loader, count))
        medians = {way: statistics.median(rates[way]) for way in ways}
        out[name] = {way: {"rates": [round(r, 1) for r in rates[way]], "median": round(medians[way], 1),
                           "ratio": round(medians[way] / medians[FILES], 3)} for way in ways}
        del ways  # their workers go before the next pipeline's start
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256, help="photographs in the set (default 256)")
    parser.add_argument("--sizes", default="360-640", help="their widths and heights, drawn from this range "
                                                           "(default 360-640, about COCO's)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of each (default 2)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="timed epochs after one warm-up (default 2)")
    parser.add_argument("--scale", type=float, default=1.0, help="the references' sizes times this (default 1)")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help=f"some of {', '.join(PIPELINES)}")
    parser.add_argument("--dir", help="where to make the set and its archives (default: a temporary folder)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in PIPELINES]
    if unknown:
        parser.error(f"no pipeline {unknown[0]!r}: choose from {', '.join(PIPELINES)}")

    import packed_formats as pf

    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        low, _, high = args.sizes.partition("-")
        made = make_reference_sets(work, args.images, sizes=(int(low), int(high or low)))
        sets = {"coco_root": made["coco"], "voc_root": made["voc"], "coco": os.path.join(work, "coco.zip"),
                "voc": os.path.join(work, "voc.zip")}
        for kind in ("coco", "voc"):
            pf.convert(made[kind], sets[kind], mode="encoded", quiet=True)
        results = run(sets, workers=args.workers, batch_size=args.batch_size, rounds=args.rounds,
                      scale=args.scale, pipelines=chosen)
    what = "real photographs" if made["photographs"] else "drawn shapes (no sample photograph installed)"
    print(f"{made['images']} {what}, {made['sizes'][0]}-{made['sizes'][1]} px, {made['boxes']} boxes; batch "
          f"{args.batch_size}, {args.workers} workers, sizes x{args.scale:g}; median of {args.rounds} epochs "
          "(images/s, ratio to the files'):")
    for name, ways in results.items():
        cells = "   ".join(f"{way} {r['median']:>7,.1f} ({r['ratio']:.2f}x)" for way, r in ways.items())
        print(f"  {name:<19} {cells}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({"set": {k: v for k, v in made.items() if k not in ("coco", "voc")},
                       "batch_size": args.batch_size, "workers": args.workers, "rounds": args.rounds,
                       "scale": args.scale, "results": results}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
