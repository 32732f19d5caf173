"""FFCV beside packed_formats on the CPU: the same photographs, the same cells, alternated rounds.

FFCV is a peer many users come from.  This module times both libraries in ONE process, on the
same JPEGs, cell by cell, and reports ours/FFCV per cell.  FFCV lives in its own virtual
environment (it builds a C extension against the system's OpenCV and libjpeg-turbo and pulls in
numba), never in the library's; ``tools/bench_ffcv.sh OUT`` builds that environment once and
runs this module in it.  By hand (Debian/Ubuntu)::

    apt-get install -y libopencv-dev libturbojpeg0-dev pkg-config
    python3 -m venv ffcv-venv
    ffcv-venv/bin/pip install setuptools wheel torch torchvision numba opencv-python-headless matplotlib \\
        terminaltables pytorch_pfn_extras fastargs assertpy tqdm psutil
    ffcv-venv/bin/pip install --no-build-isolation --no-deps ffcv==1.0.2   # or a source checkout
    ffcv-venv/bin/pip install -e .                                          # packed_formats itself
    ffcv-venv/bin/python -m packed_formats.bench.ffcv_peer --json ffcv.json --table ffcv.txt

(``--no-deps``: FFCV asks for ``opencv-python``, whose GUI build needs X libraries; the headless
build serves.  cupy is only for FFCV's GPU operations and is not needed here.)

One run:

1. draws ``--count`` photographic JPEGs (``synthetic.make_photo_folder``, sides of
   ``--sizes``) or takes an ImageFolder tree (``--images``), and writes them as our encoded zip
   (bytes unchanged) and raw memmap (``--raw-size`` square, stretched), and as FFCV ``.beton``
   files: ``RGBImageField(write_mode="jpg")`` from the zip's images (FFCV re-encodes every image,
   at quality ``--quality``; it has no way to keep the bytes) and ``write_mode="raw"`` from the
   memmap's pixels, so both raw sets hold the same pixels;
2. for each cell (``CELLS``) and layout (``LAYOUTS``) builds one loader of each library:
   ``make_loader(num_workers=W, batch_size=B, shuffle=True, drop_last=False)`` with the batch
   transform below, and FFCV's ``Loader(num_workers=W, batch_size=B, order=OrderOption.RANDOM,
   os_cache=True, drop_last=False)`` with the matching decoder and operations;
3. runs one untimed epoch of each (our workers start, FFCV's numba code compiles), then
   ``--rounds`` timed epochs of each, alternating which goes first; each epoch touches every
   batch (its first element) and counts its images;
4. reports the median images/s of each library per cell and their ratio, as JSON and a table.

Cells (FFCV's operations in brackets):

- ``jpeg-rrc-flip-uint8``: RandomResizedCrop(224) + flip, uint8
  (``RandomResizedCropRGBImageDecoder``, ``RandomHorizontalFlip``);
- ``jpeg-rrc-flip-float``: the same, then normalised to float32 (``pf.transforms.train``;
  FFCV ``NormalizeImage`` on the CPU);
- ``jpeg-center-float``: centre crop 224 of the shorter side scaled to 256, normalised
  (``pf.transforms.val``; ``CenterCropRGBImageDecoder(ratio=224/256)``);
- ``raw-none``: the raw 256x256 images, no transform (``SimpleRGBImageDecoder``).

Layouts: ``nchw`` (contiguous [B,C,H,W]; ``ToTorchImage(channels_last=False)``) and
``channels_last`` (``memory_format=torch.channels_last``; ``ToTorchImage(channels_last=True)``).

FFCV's workers are threads of this process (numba); ours are processes, started with
``--start-method`` (forkserver by default: the process holds numba's threads once FFCV has run).
Where FFCV is not installed, ours is still measured; the report then says FFCV is not installed
and how to install it, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
LAYOUTS = ("nchw", "channels_last")
INSTALL = "tools/bench_ffcv.sh OUT  (builds FFCV's own venv; see packed_formats/bench/ffcv_peer.py for the steps)"


@dataclass(frozen=True)
class Cell:
    """One thing to time: which archive (``jpeg`` or ``raw``) and which pipeline."""

    name: str
    source: str  # "jpeg" or "raw"
    pipeline: str  # "rrc-flip-uint8", "rrc-flip-float", "center-float" or "none"


CELLS = (
    Cell("jpeg-rrc-flip-uint8", "jpeg", "rrc-flip-uint8"),
    Cell("jpeg-rrc-flip-float", "jpeg", "rrc-flip-float"),
    Cell("jpeg-center-float", "jpeg", "center-float"),
    Cell("raw-none", "raw", "none"),
)
CELL_NAMES = tuple(cell.name for cell in CELLS)


def ffcv_status() -> Dict[str, Any]:
    """Whether FFCV imports here: ``{"installed": bool, "version" or "error", "install"}``."""
    try:
        importlib.import_module("ffcv.loader")
        version = importlib.metadata.version("ffcv")  # ffcv.__version__ is stale in its releases
    except Exception as exc:  # an import that fails in its C extension raises ImportError or OSError
        return {"installed": False, "error": f"{type(exc).__name__}: {exc}", "install": INSTALL}
    return {"installed": True, "version": version, "install": INSTALL}


# --- data --------------------------------------------------------------------------------------------

def prepare(work: str, images: Optional[str], count: int, sizes: Tuple[int, int], raw_size: int,
            quality: int, with_ffcv: bool) -> Dict[str, str]:
    """Write (or reuse) the photographs and every archive under ``work``; return their paths by name."""
    from ..writing.convert import convert

    os.makedirs(work, exist_ok=True)
    paths = {"images": images or os.path.join(work, "photos"),
             "zip": os.path.join(work, "photos.zip"),
             "memmap": os.path.join(work, f"photos-raw{raw_size}.memmap"),
             "beton-jpg": os.path.join(work, "photos-jpg.beton"),
             "beton-raw": os.path.join(work, f"photos-raw{raw_size}.beton")}
    if images is None and not os.path.isdir(paths["images"]):
        from ..synthetic import make_photo_folder

        per_class = -(-count // 4)
        make_photo_folder(paths["images"], per_class, sizes=sizes, quality=quality)
    if not os.path.exists(paths["zip"]):
        convert(paths["images"], paths["zip"], format="zip", quiet=True)
    if not os.path.exists(paths["memmap"]):
        convert(paths["images"], paths["memmap"], format="memmap", mode="raw", size=raw_size, quiet=True)
    if with_ffcv:
        if not os.path.exists(paths["beton-jpg"]):
            write_beton(paths["zip"], paths["beton-jpg"], "jpg", quality)
        if not os.path.exists(paths["beton-raw"]):
            write_beton(paths["memmap"], paths["beton-raw"], "raw", quality)
    return paths


class _Pixels:
    """An archive's samples as FFCV's writer takes them: ``(uint8 HxWx3 array, label)`` by index."""

    def __init__(self, path: str) -> None:
        from ..loading.dataset import PackedDataset

        self.dataset = PackedDataset(path, output="numpy")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        image, label = self.dataset[i]
        return image, int(label)


def write_beton(archive: str, beton: str, write_mode: str, quality: int) -> None:
    """Write ``archive``'s samples to an FFCV ``.beton`` (``RGBImageField(write_mode)``, ``IntField``)."""
    from ffcv.fields import IntField, RGBImageField  # type: ignore[import-not-found, unused-ignore]
    from ffcv.writer import DatasetWriter  # type: ignore[import-not-found, unused-ignore]

    fields = {"image": RGBImageField(write_mode=write_mode, jpeg_quality=quality), "label": IntField()}
    partial = beton + ".partial"
    DatasetWriter(partial, fields, num_workers=2).from_indexed_dataset(_Pixels(archive))
    os.replace(partial, beton)


# --- loaders -----------------------------------------------------------------------------------------

def memory_format(layout: str) -> torch.memory_format:
    """``torch.channels_last`` for "channels_last", contiguous NCHW for "nchw"."""
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def our_transform(pipeline: str, size: int) -> Optional[Callable]:
    """The batch transform of a pipeline, from ``packed_formats.transforms``."""
    from .. import transforms as T

    if pipeline == "rrc-flip-uint8":
        return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()])
    if pipeline == "rrc-flip-float":
        return T.train(size)
    if pipeline == "center-float":
        return T.val(size)
    return None


def our_loader(path: str, cell: Cell, layout: str, size: int, batch_size: int, workers: int,
               start_method: Optional[str], seed: int) -> Any:
    """``make_loader`` for one cell and layout."""
    from ..loading.loader import make_loader

    return make_loader(path, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=False,
                       seed=seed, transform=our_transform(cell.pipeline, size), memory_format=memory_format(layout),
                       multiprocessing_context=start_method if workers else None)


def ffcv_loader(path: str, cell: Cell, layout: str, size: int, batch_size: int, workers: int, seed: int) -> Any:
    """FFCV's ``Loader`` for one cell and layout (operations as listed in the module's docstring)."""
    import numpy as np
    from ffcv.fields.basics import IntDecoder  # type: ignore[import-not-found, unused-ignore]
    from ffcv.fields.rgb_image import (  # type: ignore[import-not-found, unused-ignore]
        CenterCropRGBImageDecoder,
        RandomResizedCropRGBImageDecoder,
        SimpleRGBImageDecoder,
    )
    from ffcv.loader import Loader, OrderOption  # type: ignore[import-not-found, unused-ignore]
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage  # type: ignore[import-not-found, unused-ignore]

    normalize = NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255, np.float32)
    image: List[Any]
    if cell.pipeline == "rrc-flip-uint8":
        image = [RandomResizedCropRGBImageDecoder((size, size)), RandomHorizontalFlip()]
    elif cell.pipeline == "rrc-flip-float":
        image = [RandomResizedCropRGBImageDecoder((size, size)), RandomHorizontalFlip(), normalize]
    elif cell.pipeline == "center-float":
        image = [CenterCropRGBImageDecoder((size, size), ratio=224 / 256), normalize]
    else:
        image = [SimpleRGBImageDecoder()]
    image += [ToTensor(), ToTorchImage(channels_last=layout == "channels_last")]
    return Loader(path, batch_size=batch_size, num_workers=workers, order=OrderOption.RANDOM, os_cache=True,
                  drop_last=False, seed=seed, pipelines={"image": image, "label": [IntDecoder(), ToTensor()]})


def time_epoch(loader: Iterable) -> Tuple[float, int]:
    """(seconds, images) of one pass over ``loader``, reading one value of each batch."""
    images = 0
    start = time.perf_counter()
    for batch in loader:
        float(batch[0][0, 0, 0, 0])
        images += len(batch[0])
    return time.perf_counter() - start, images


def warm_up(loader: Iterable, name: str, layout: str) -> Dict[str, Any]:
    """One untimed pass; the first batch's shape and dtype, checked to be in ``layout``."""
    first: Optional[torch.Tensor] = None
    for batch in loader:
        if first is None:
            first = batch[0]
    if first is None:
        raise RuntimeError(f"{name} gave no batch")
    channels_last = first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()
    if (layout == "channels_last") != channels_last:
        raise RuntimeError(f"{name} gave batches that are not {layout}: strides {first.stride()}")
    return {"shape": list(first.shape), "dtype": str(first.dtype).replace("torch.", "")}


# --- the comparison ----------------------------------------------------------------------------------

def measure_cell(loaders: Dict[str, Any], layout: str, rounds: int) -> Dict[str, Dict[str, Any]]:
    """One untimed epoch of each loader, then ``rounds`` timed epochs of each, alternating which goes first."""
    names = list(loaders)
    batches = {name: warm_up(loaders[name], name, layout) for name in names}
    runs: Dict[str, List[float]] = {name: [] for name in names}
    counts: Dict[str, int] = {}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, counts[name] = time_epoch(loaders[name])
            runs[name].append(counts[name] / seconds)
    return {name: {"images_per_s": statistics.median(runs[name]), "rounds": [round(x, 1) for x in runs[name]],
                   "images": counts[name], **batches[name]} for name in names}


def run(work: str, images: Optional[str] = None, count: int = 2000, sizes: Tuple[int, int] = (256, 480),
        raw_size: int = 256, quality: int = 90, size: int = 224, batch_size: int = 64, workers: int = 2,
        rounds: int = 7, cells: Sequence[str] = CELL_NAMES, layouts: Sequence[str] = LAYOUTS,
        start_method: Optional[str] = "forkserver", seed: int = 0, progress: Callable[[str], None] = print,
        ) -> Dict[str, Any]:
    """Write the data, time every cell and layout, and return the report (see ``format_table``)."""
    status = ffcv_status()
    with_ffcv = status["installed"]
    paths = prepare(work, images, count, sizes, raw_size, quality, with_ffcv)
    report: Dict[str, Any] = {
        "ffcv": status, "torch": torch.__version__, "cpus": os.cpu_count(),
        "config": {"count": count, "sizes": list(sizes), "raw_size": raw_size, "quality": quality, "size": size,
                   "batch_size": batch_size, "workers": workers, "rounds": rounds, "start_method": start_method},
        "bytes": {name: _size(path) for name, path in paths.items() if name != "images" and os.path.exists(path)},
        "cells": [],
    }
    for cell in CELLS:
        if cell.name not in cells:
            continue
        for layout in layouts:
            progress(f"{cell.name} {layout}")
            ours = our_loader(paths["zip" if cell.source == "jpeg" else "memmap"], cell, layout, size, batch_size,
                              workers, start_method, seed)
            loaders = {"packed_formats": ours}
            if with_ffcv:
                beton = paths["beton-jpg" if cell.source == "jpeg" else "beton-raw"]
                loaders["ffcv"] = ffcv_loader(beton, cell, layout, size, batch_size, workers, seed)
            timed = measure_cell(loaders, layout, rounds)
            ratio = timed["packed_formats"]["images_per_s"] / timed["ffcv"]["images_per_s"] if with_ffcv else None
            report["cells"].append({"cell": cell.name, "layout": layout, **timed, "ours_over_ffcv": ratio})
            del loaders, ours  # our workers end with the loader
    return report


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def format_table(report: Dict[str, Any]) -> str:
    """The report as a text table: images/s of each library per cell and layout, and ours/FFCV."""
    config = report["config"]
    lines = [f"{config['count']} photographs, batch {config['batch_size']}, {config['workers']} workers, "
             f"median of {config['rounds']} alternated rounds, {report['cpus']} CPUs"]
    status = report["ffcv"]
    if status["installed"]:
        lines.append(f"FFCV {status['version']}, torch {report['torch']}")
    else:
        lines.append(f"FFCV not installed ({status['error']}); install: {status['install']}")
    rows = [("cell", "layout", "packed_formats img/s", "FFCV img/s", "ours/FFCV")]
    for entry in report["cells"]:
        ffcv = entry.get("ffcv")
        rows.append((entry["cell"], entry["layout"], f"{entry['packed_formats']['images_per_s']:.0f}",
                     f"{ffcv['images_per_s']:.0f}" if ffcv else "-",
                     f"{entry['ours_over_ffcv']:.2f}x" if entry["ours_over_ffcv"] else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rule = "  ".join("=" * w for w in widths)
    body = ["  ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + [rule, body[0], rule] + body[1:] + [rule]) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: run the comparison, write ``--json`` and ``--table``, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="bench_data/ffcv", help="folder for the photographs and archives")
    parser.add_argument("--images", help="an ImageFolder tree of JPEGs (default: draw --count photographs)")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs=2, default=(256, 480), metavar=("MIN", "MAX"))
    parser.add_argument("--raw-size", type=int, default=256)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--size", type=int, default=224, help="the crops' side")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cells", nargs="+", choices=CELL_NAMES, default=list(CELL_NAMES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--start-method", default="forkserver", help="our workers' start method")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--table", help="write the table here")
    args = parser.parse_args(argv)
    report = run(args.work, args.images, args.count, tuple(args.sizes), args.raw_size, args.quality, args.size,
                 batch_size=args.batch_size, workers=args.workers, rounds=args.rounds, cells=args.cells,
                 layouts=args.layouts, start_method=args.start_method,
                 progress=lambda text: print(text, file=sys.stderr, flush=True))
    table = format_table(report)
    for path, text in ((args.json, json.dumps(report, indent=1) + "\n"), (args.table, table)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    print(table, end="")
    return 0 if report["ffcv"]["installed"] else 1


if __name__ == "__main__":
    sys.exit(main())
