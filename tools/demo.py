#!/usr/bin/env python3
"""The demo: generate an image folder, pack it into every format and mode, compare them.

    make demo                       # or: python tools/demo.py [--images-per-class 50] [--workers 2]

Prints one row per archive: format, mode, size on disk, and images/s over one
shuffled epoch read through a DataLoader with 2 workers (decoded uint8
tensors), next to the plain image folder it came from.  The epoch timed is the
second of two, so worker start-up is not counted.  Every archive also shows the
batched fast path (``pf.make_loader``: one read per batch, no per-sample
Python objects); encoded archives are decoded there to the raw archives' size
(shorter side, centre crop), the same images the raw archives hold.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import Optional, Tuple

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import packed_formats as pf  # noqa: E402
from packed_formats.space import disk_usage  # noqa: E402
from packed_formats.synthetic import CLASSES, make_image_folder  # noqa: E402
from packed_formats.writing.prepare import parse_size  # noqa: E402

EXTENSION = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}


def keep_as_list(batch):
    return batch


def timed_second_epoch(loader) -> float:
    """images/s of the second pass over ``loader`` (the first one starts the workers)."""
    rate = 0.0
    for _ in range(2):
        start = time.perf_counter()
        count = sum(len(batch[1]) if isinstance(batch, tuple) else len(batch) for batch in loader)
        rate = count / (time.perf_counter() - start)
    return rate


def dataset_rate(path: str, workers: int, batch_size: int) -> float:
    with pf.PackedDataset(path, output="tensor") as dataset:
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            collate_fn=keep_as_list,
            persistent_workers=workers > 0,
        )
        return timed_second_epoch(loader)


def fast_path_rate(path: str, workers: int, batch_size: int, size: Optional[Tuple[int, int]]) -> float:
    """images/s of ``pf.make_loader``; with ``size``, an encoded archive's images of many sizes decoded to it."""
    options = {} if size is None else dict(size=size, resize_mode="shorter-side-center-crop")
    return timed_second_epoch(
        pf.make_loader(path, batch_size=batch_size, shuffle=True, num_workers=workers, **options)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="demo_data", help="where to put the generated data (default: demo_data)")
    parser.add_argument("--images-per-class", type=int, default=50)
    parser.add_argument("--size", default="128", help="raw archives' image size (default: 128)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default: 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    size = parse_size(args.size)
    source = os.path.join(args.root, "images")
    if not os.path.isdir(source):
        print(f"generating {args.images_per_class * len(CLASSES)} images in {source} ...", flush=True)
        make_image_folder(source, images_per_class=args.images_per_class)
    rows = [("folder", "encoded", source)]
    for fmt in pf.PACKED_FORMATS:
        for mode in ("raw", "encoded"):
            destination = os.path.join(args.root, f"demo-{mode}{EXTENSION[fmt]}")
            summary = pf.convert(
                source,
                destination,
                format=fmt,
                mode=mode,
                size=args.size if mode == "raw" else None,
                resize_mode="shorter-side-center-crop",
                overwrite=True,
                quiet=True,
            )
            print(summary.line(), flush=True)
            rows.append((fmt, mode, destination))

    print(
        f"\nimages/s over one shuffled epoch (the second), batch {args.batch_size}, {args.workers} DataLoader workers,"
        f" decoded uint8 images; 'batched' = pf.make_loader (encoded: decoded to {size[0]}x{size[1]})"
    )
    header = ("format", "mode", "layout", "on disk", "PackedDataset", "batched", "vs folder")
    print("{:<8} {:<8} {:<12} {:>10} {:>14} {:>9} {:>10}".format(*header))
    baseline = None
    for fmt, mode, path in rows:
        manifest = pf.open_archive(path).manifest
        layout = "x".join(map(str, manifest.shape)) if manifest.shape else f"{manifest.encoding} files"
        rate = dataset_rate(path, args.workers, args.batch_size)
        decode_size = size if mode == "encoded" else None
        fast = None if fmt == "folder" else fast_path_rate(path, args.workers, args.batch_size, decode_size)
        baseline = baseline or rate
        best = max(rate, fast or 0)
        print(
            f"{fmt:<8} {mode:<8} {layout:<12} {disk_usage(path) / 2**20:>6.1f} MiB {rate:>14.0f} "
            f"{'-' if fast is None else f'{fast:.0f}':>9} {best / baseline:>9.1f}x",
            flush=True,
        )
    print("\nnext, honest repeated measurements of these archives (see docs/benchmarks.rst):")
    print(f"  {bench_command(args.root, args.batch_size)}")
    return 0


def bench_command(root: str, batch_size: int) -> str:
    """The ``packed-formats bench`` command line that measures the demo's folder and two of its archives.

    It names the command as this interpreter's environment installed it (``.venv/bin/packed-formats`` after
    ``make demo``), so it can be pasted as printed, with or without the environment activated.
    """
    installed = os.path.join(os.path.dirname(sys.executable), "packed-formats")
    program = "packed-formats"
    if os.path.exists(installed):
        relative = os.path.relpath(installed)
        program = installed if relative.startswith(os.pardir) else relative
    targets = [os.path.join(root, name) for name in ("images", "demo-raw.memmap", "demo-encoded.zip")]
    return shlex.join([program, "bench", *targets, "--workers", "0,2", "--batch-size", str(batch_size)])


if __name__ == "__main__":
    sys.exit(main())
