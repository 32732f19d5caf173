"""Segmentation loading measured side by side: image + PNG mask through ``make_loader`` against a
torchvision ``Dataset`` reading the same files with the same v2 transforms.

    python -m packed_formats.bench.segmentation [--images 1024] [--workers 2] [--out seg.json]

The set is real photographs (``synthetic.make_photo_folder``: crops of a photograph shipped with
matplotlib; drawn shapes where none is installed, said so in the output), each with a mask of the kind a
segmentation set has: a few classes in flat regions, here the photograph's blurred brightness cut into
five levels, stored as an 8-bit PNG beside the image (``<name>.mask.png``).  The same files are
packed with ``--field mask=image`` twice: into an encoded ZIP archive (the same JPEG and PNG bytes), and
into a raw one (decoded once, at conversion: each image's centre at ``--raw-size`` pixels square, its
mask cut and resized alike by nearest neighbour).

Both read with 2 workers (by default) and the same transform, drawn per sample: torchvision v2's
``RandomResizedCrop`` then ``RandomHorizontalFlip``, given the image and the mask together, so the
mask is cut and flipped as its image is.

* The reference is PyTorch's fastest way to read such a set from files: its libjpeg-turbo and libpng
  decoders (TorchCodec's, else ``torchvision.io``'s: ``image_decode``) straight into tensors (no PIL
  image), the v2 transform on the ``tv_tensors`` pair, DataLoader's default collate, persistent workers.
* Ours is ``make_loader(archive, fields={"mask": "mask"}, transform=...)``.  On the encoded archive the
  crop is cut while decoding (the JPEG decoded at the least DCT scale that covers it, the mask cut
  from the same box), the flip per sample, whole batches sent in shared memory: the same pixels as the
  reference's.  On the raw archive nothing is decoded but the mask's small PNG, and the crop is drawn
  in the stored square, not in the original photograph: the pipeline a raw archive is made for, as
  in the classification benchmark.

Each runs ``--epochs`` epochs after one warm-up epoch (the page cache warm, the workers started);
the figure is the median epoch's images per second.  The goal, checked in the same run for each of
ours: at least ``--goal`` (2x) the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from .. import image_decode

GOAL = 2.0


def make_segmentation_folder(root: str, images: int, sizes=(360, 640), seed: int = 0) -> Dict[str, Any]:
    """An ImageFolder tree of ``images`` JPEGs (real photographs where installed), each with a mask
    ``<name>.mask.png`` beside it; returns what it made."""
    from PIL import Image, ImageFilter

    from .. import synthetic

    per_class = max(1, images // 4)
    photos = bool(synthetic.sample_photographs())
    if photos:
        synthetic.make_photo_folder(root, images_per_class=per_class, sizes=sizes, seed=seed)
    else:
        synthetic.make_image_folder(root, images_per_class=per_class, classes=("a", "b", "c", "d"), sizes=sizes,
                                    seed=seed)
    count = 0
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if not name.endswith(".jpg"):
                continue
            with Image.open(os.path.join(folder, name)) as image:
                brightness = image.convert("L").filter(ImageFilter.GaussianBlur(6))
            levels = (np.asarray(brightness, dtype=np.uint16) * 5 // 256).astype(np.uint8)  # classes 0-4
            Image.fromarray(levels).save(os.path.join(folder, name[:-4] + ".mask.png"))
            count += 1
    return {"root": root, "images": count, "photographs": photos, "sizes": list(sizes)}


class FilesWithMasks(torch.utils.data.Dataset):
    """The reference: each image and its mask read from their files and decoded by PyTorch's decoder
    (``image_decode``), the v2 ``transform`` given both; items are (image, mask) tensors."""

    def __init__(self, root: str, transform: Callable) -> None:
        self.items = sorted(
            (os.path.join(folder, name), os.path.join(folder, name[:-4] + ".mask.png"))
            for folder, _, names in os.walk(root) for name in names if name.endswith(".jpg")
        )
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from torchvision import tv_tensors

        image, mask = image_decode.decode([_read(path) for path in self.items[i]], "UNCHANGED")
        image, mask = tv_tensors.Image(image), tv_tensors.Mask(mask[0])
        image, mask = self.transform(image, mask)
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)


def _read(path: str) -> torch.Tensor:
    """A file's bytes as a 1-D uint8 tensor."""
    with open(path, "rb") as file:
        return torch.frombuffer(bytearray(file.read()), dtype=torch.uint8)


def transform(size: int) -> Callable:
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def timed_epochs(loader: Iterable[Any], epochs: int, count: Callable[[Any], int]) -> List[float]:
    """Images per second of each of ``epochs`` epochs after one warm-up epoch."""
    for _ in loader:
        pass
    rates = []
    for _ in range(epochs):
        start, seen = time.perf_counter(), 0
        for batch in loader:
            seen += count(batch)
        rates.append(seen / (time.perf_counter() - start))
    return rates


REFERENCE = "torchvision Dataset (files, PyTorch's decoders, v2)"


def run(root: str, archives: Dict[str, str], *, workers: int, batch_size: int, size: int,
        epochs: int) -> Dict[str, Any]:
    """The reference over the files and make_loader over each of ``archives`` ({target name: path}):
    {target: {"rates": [...], "median": images/s}}, the reference first."""
    import packed_formats as pf

    torch.set_num_threads(1)
    dataset = FilesWithMasks(root, transform(size))
    reference = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                            persistent_workers=workers > 0, drop_last=False)
    targets: List[Any] = [(REFERENCE, reference, lambda b: len(b[0]))]
    for name, archive in archives.items():
        ours = pf.make_loader(archive, batch_size=batch_size, num_workers=workers, transform=transform(size),
                              fields={"mask": "mask"})
        targets.append((name, ours, lambda b: len(b["label"])))
    out: Dict[str, Any] = {}
    for name, loader, count in targets:
        rates = timed_epochs(loader, epochs, count)
        out[name] = {"rates": [round(r, 1) for r in rates], "median": round(statistics.median(rates), 1)}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024, help="images in the set (default 1024)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of each (default 2)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--size", type=int, default=224, help="the crop's output size (default 224)")
    parser.add_argument("--raw-size", type=int, default=256, help="the raw archive's square (default 256)")
    parser.add_argument("--sizes", default="360-640", help="the photographs' widths and heights, drawn from "
                                                           "this range (default 360-640)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after one warm-up (default 3)")
    parser.add_argument("--goal", type=float, default=GOAL, help="ours over the reference, at least (default 2)")
    parser.add_argument("--dir", help="where to make the set and its archive (default: a temporary folder)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    import packed_formats as pf

    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        root = os.path.join(work, "set")
        low, _, high = args.sizes.partition("-")
        made = make_segmentation_folder(root, args.images, sizes=(int(low), int(high or low)))
        encoded, raw = os.path.join(work, "encoded.zip"), os.path.join(work, "raw.zip")
        pf.convert(root, encoded, mode="encoded", fields=["mask=image"], quiet=True)
        pf.convert(root, raw, mode="raw", size=args.raw_size, resize_mode="shorter-side-center-crop",
                   fields=["mask=image"], quiet=True)
        archives = {"make_loader, encoded archive (crop at decode)": encoded,
                    f"make_loader, raw archive ({args.raw_size}x{args.raw_size})": raw}
        results = run(root, archives, workers=args.workers, batch_size=args.batch_size, size=args.size,
                      epochs=args.epochs)
    what = "real photographs" if made["photographs"] else "drawn shapes (no sample photograph installed)"
    print(f"{made['images']} {what}, {made['sizes'][0]}-{made['sizes'][1]} px, each with a PNG mask; "
          f"batch {args.batch_size}, {args.workers} workers, RandomResizedCrop({args.size}) + flip; "
          f"median of {args.epochs} epochs (images/s):")
    reference = results[REFERENCE]["median"]
    for name, result in results.items():
        line = f"  {name:<50} {result['median']:>9,.0f}   epochs: {', '.join(f'{r:,.0f}' for r in result['rates'])}"
        if name != REFERENCE:
            result["ratio"] = round(result["median"] / reference, 3)
            result["goal_met"] = result["ratio"] >= args.goal
            line += f"   {result['ratio']:.2f}x the reference (goal {args.goal:g}x: " \
                    f"{'ok' if result['goal_met'] else 'MISS'})"
        print(line)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({"set": made, "batch_size": args.batch_size, "workers": args.workers, "size": args.size,
                       "raw_size": args.raw_size, "epochs": args.epochs, "goal": args.goal, "reference": REFERENCE,
                       "decoder": image_decode.describe(), "results": results}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
