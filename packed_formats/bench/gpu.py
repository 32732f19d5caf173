"""The GPU benchmark (``tools/bench_gpu.sh``): what feeds a GPU, cell by cell, into one JSON file.

Cells, each images/s (median of 3 timed epochs after an untimed warm-up epoch):

- ``h2d_pinned``: pinned uint8 [B,3,256,256] batches copied to the device (the link's limit);
- ``raw_{memmap,lmdb,zip}_none_w{0,N}``: raw archives (256x256) with no transform, at 0 and N
  workers (N: CPUs - 2); ``raw_memmap_train224_wN``: the same with ``train(224)`` on the device;
- ``decode_batched``: torchvision's batched JPEG decode on the device alone (nvJPEG on CUDA);
  ``decode_resize256_per_image``: that and a per-image antialiased resize to 256x256;
  ``decode_resize256_batched``: that and the batched resize of ``device_decode.resample``;
- ``zip_workers_{none256,train224}_wN``: an encoded ZIP decoded in the workers (``size=256`` with
  no transform, or ``train(224)``), batches on the device;
- ``zip_device_{none256,train224}_wN``: the same with ``decode="device"``;
- ``imagefolder_train224_wN``: torchvision's ImageFolder pipeline (RandomResizedCrop, flip,
  ToTensor, Normalize; pin_memory), copied to the device: the baseline.

The data is made here (no photographs are needed offline): ``synthetic.make_photo_folder``'s
photographic JPEGs at ImageNet-like sizes, packed raw at 256x256 (memmap, LMDB, ZIP) and encoded
(ZIP).  ``--cpu`` runs every cell on the CPU; ``--quick`` with small counts (a test runs both).
CUDA cells are timed with CUDA events after a synchronize, loaders by ``measure.time_epoch``
(which synchronizes on each batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from ..loading import device_decode
from ..synthetic import make_photo_folder
from .environment import describe_environment
from .loaders import ToDevice, torchvision_transform
from .measure import summarise, time_epoch

RAW_FORMATS = ("memmap", "lmdb", "zip")


def cell_names(workers: int) -> List[str]:
    """Every cell the benchmark measures, for ``workers`` workers: what its JSON holds."""
    w = f"w{workers}"
    names = ["h2d_pinned"]
    names += [f"raw_{fmt}_none_{n}" for fmt in RAW_FORMATS for n in ("w0", w)]
    names += [f"raw_memmap_train224_{w}", "decode_batched", "decode_resize256_per_image", "decode_resize256_batched"]
    names += [f"zip_{where}_{pipeline}_{w}" for where in ("workers", "device") for pipeline in ("none256", "train224")]
    names += [f"imagefolder_train224_{w}"]
    return names


# ---- data ----
def make_data(folder: str, images: int, sizes: Sequence[int], log: Callable[[str], None]) -> Dict[str, str]:
    """The photographs and their archives under ``folder`` (made once, reused after)."""
    from ..writing.convert import convert

    photos = os.path.join(folder, "photos")
    if not os.path.isdir(photos):
        log(f"making {images} photographic JPEGs in {photos}")
        make_photo_folder(photos, images_per_class=images // 4, sizes=(sizes[0], sizes[1]), seed=0)
    paths = {"photos": photos, "encoded_zip": os.path.join(folder, "encoded.zip")}
    paths.update({f"raw_{fmt}": os.path.join(folder, f"raw.{fmt}") for fmt in RAW_FORMATS})
    for name, path in paths.items():
        if name != "photos" and not os.path.exists(path):
            log(f"packing {path}")
            raw = name.startswith("raw_")
            convert(photos, path, mode="raw" if raw else "encoded", size=(256, 256) if raw else None, quiet=True)
    return paths


# ---- timing ----
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(run: Callable[[], int], device: torch.device, repeats: int) -> Dict[str, Any]:
    """images/s of ``run()`` (it returns how many images it made): one untimed warm-up run, then
    ``repeats`` timed ones (CUDA events on a GPU, between synchronizes)."""
    run()
    synchronize(device)
    rates = []
    for _ in range(repeats):
        if device.type == "cuda":  # the end recorded once the whole device is idle: the decoder's own stream too
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            count = run()
            torch.cuda.synchronize(device)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            count = run()
            seconds = time.perf_counter() - began
        rates.append(count / seconds if seconds > 0 else None)
    return {"images_per_s": summarise(rates)}


def timed_loader(make: Callable[[], Iterable], repeats: int) -> Dict[str, Any]:
    """images/s of a loader: one untimed warm-up epoch, then ``repeats`` timed epochs (the first batch
    of each left out: ``measure.time_epoch``)."""
    loader = make()
    time_epoch(loader, warmup=0)
    records = [time_epoch(loader, warmup=1) for _ in range(repeats)]
    return {"images_per_s": summarise([r["images_per_s"] for r in records]), "epochs": records}


# ---- cells ----
def h2d_rate(device: torch.device, batch: int, repeats: int, copies: int) -> Dict[str, Any]:
    """Pinned uint8 [batch,3,256,256] host batches copied to ``device``, ``copies`` per run."""
    host = torch.randint(0, 256, (batch, 3, 256, 256), dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    target = torch.empty_like(host, device=device)

    def run() -> int:
        for _ in range(copies):
            target.copy_(host, non_blocking=True)
        return copies * batch

    result = timed_runs(run, device, repeats)
    rate = result["images_per_s"]["median"]
    result["gb_per_s"] = rate * host[0].numel() / 1e9 if rate else None
    return result


def jpeg_batches(path: str, batch: int) -> List[List[torch.Tensor]]:
    """The encoded archive's JPEG bytes, as lists of 1-D uint8 CPU tensors of ``batch`` images."""
    from ..archives import open_archive

    with open_archive(path) as reader:
        blobs = [torch.frombuffer(bytearray(reader.read(i)), dtype=torch.uint8) for i in range(len(reader))]
    return [blobs[k : k + batch] for k in range(0, len(blobs), batch)]


def decode_rate(batches: List[List[torch.Tensor]], device: torch.device, resize: Optional[str],
                repeats: int) -> Dict[str, Any]:
    """The batched decode on ``device`` alone (``resize`` None), or with each image resized to 256x256
    one by one ("per_image", torchvision's antialiased resize) or all at once ("batched")."""
    from torchvision.transforms.v2 import functional as tvf

    def run() -> int:
        count = 0
        for blobs in batches:
            images = device_decode.decode_jpegs(blobs, device)
            if resize == "per_image":
                torch.stack([tvf.resize(image, [256, 256], antialias=True) for image in images])
            elif resize == "batched":
                out = torch.empty((len(images), 3, 256, 256), dtype=torch.uint8, device=device)
                boxes = np.array([[0, 0, image.shape[1], image.shape[2]] for image in images])
                device_decode.resample(images, boxes, (256, 256), out, list(range(len(images))))
            count += len(images)
        return count

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return timed_runs(run, device, repeats)


def imagefolder(path: str, batch: int, workers: int, device: torch.device) -> Iterable:
    """The baseline: torchvision's ImageFolder, RandomResizedCrop(224) + flip + ToTensor + Normalize
    per image in the workers, pinned batches (on CUDA) copied to ``device``."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(path, transform=torchvision_transform("train", 224))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                         pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    return ToDevice(loader, str(device))


def run(options: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    """Every cell of ``cell_names``, as one dict (see the module)."""
    import packed_formats as pf
    from packed_formats import transforms as T

    device = torch.device("cpu" if options.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu")
    quick = options.quick
    images = options.images or (64 if quick else 2000)
    batch = options.batch_size or (16 if quick else 256)
    sizes = (64, 128) if quick else (250, 500)
    workers = options.workers if options.workers is not None else max(1, (os.cpu_count() or 2) - 2)
    repeats = 3
    paths = make_data(options.data or os.path.join(options.out, "data"), images, sizes, log)
    cells: Dict[str, Any] = {}

    def loader(path: str, n: int, **kwargs: Any) -> Callable[[], Iterable]:
        return lambda: pf.make_loader(path, batch_size=batch, num_workers=n, device=device, **kwargs)

    plan: Dict[str, Callable[[], Dict[str, Any]]] = {
        "h2d_pinned": lambda: h2d_rate(device, batch, repeats, copies=4 if quick else 32),
    }
    def loader_cell(path: str, n: int, **kwargs: Any) -> Callable[[], Dict[str, Any]]:
        return lambda: timed_loader(loader(path, n, **kwargs), repeats)

    for fmt in RAW_FORMATS:
        for n in (0, workers):
            plan[f"raw_{fmt}_none_w{n}"] = loader_cell(paths[f"raw_{fmt}"], n)
    plan[f"raw_memmap_train224_w{workers}"] = loader_cell(paths["raw_memmap"], workers, transform=T.train(224))
    jpegs = jpeg_batches(paths["encoded_zip"], batch)
    plan["decode_batched"] = lambda: decode_rate(jpegs, device, None, repeats)
    plan["decode_resize256_per_image"] = lambda: decode_rate(jpegs, device, "per_image", repeats)
    plan["decode_resize256_batched"] = lambda: decode_rate(jpegs, device, "batched", repeats)
    for where in ("workers", "device"):
        for pipeline, kwargs in (("none256", dict(size=256)), ("train224", dict(transform=T.train(224)))):
            plan[f"zip_{where}_{pipeline}_w{workers}"] = loader_cell(paths["encoded_zip"], workers, decode=where,
                                                                     **kwargs)
    plan[f"imagefolder_train224_w{workers}"] = lambda: timed_loader(
        lambda: imagefolder(paths["photos"], batch, workers, device), repeats)

    for name in cell_names(workers):
        log(f"measuring {name}")
        began = time.perf_counter()
        try:
            cells[name] = plan[name]()
        except Exception as exc:  # one failing cell is reported, the others still run
            cells[name] = {"error": f"{type(exc).__name__}: {exc}", "images_per_s": summarise([])}
        cells[name]["seconds"] = time.perf_counter() - began
        log(f"  {name}: {_rate(cells[name])}")
    return {
        "environment": describe_environment(str(device)),
        "config": {"device": str(device), "images": images, "batch_size": batch, "workers": workers,
                   "image_sizes": list(sizes), "repeats": repeats, "quick": quick},
        "cells": cells,
    }


def _rate(cell: Dict[str, Any]) -> str:
    median = cell["images_per_s"]["median"]
    return cell.get("error", "") if median is None else f"{median:,.0f} images/s"


def table(results: Dict[str, Any]) -> str:
    """The cells as lines of text: name, median images/s and spread."""
    lines = []
    for name, cell in results["cells"].items():
        spread = cell["images_per_s"].get("spread")
        lines.append(f"{name:36s} {_rate(cell):>22s}" + (f"  (spread {spread:.0%})" if spread is not None else ""))
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/bench_gpu.sh", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder the JSON (gpu.json) is written to; its data/ holds the generated data")
    parser.add_argument("--cpu", action="store_true", help="run every cell on the CPU (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="small counts: 64 small images, batches of 16")
    parser.add_argument("--data", help="where the data is made and kept (default: OUT/data)")
    parser.add_argument("--images", type=int, help="images generated (default 2000; 64 with --quick)")
    parser.add_argument("--batch-size", type=int, help="default 256; 16 with --quick")
    parser.add_argument("--workers", type=int, help="the many-worker count (default: CPUs - 2)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    options = parse_args(argv)
    os.makedirs(options.out, exist_ok=True)
    results = run(options, lambda line: print(line, file=sys.stderr, flush=True))
    path = os.path.join(options.out, "gpu.json")
    with open(path, "w") as file:
        json.dump(results, file, indent=1, default=str)
    print(table(results))
    print(f"wrote {path}", file=sys.stderr)
    return 0 if all("error" not in cell for cell in results["cells"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
