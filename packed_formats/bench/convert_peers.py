"""Conversion beside FFCV and litdata: the same Python datasets packed by each at 2 workers, in one run.

Users whose data sits behind Python code pack it with ``pf.convert(dataset, dst, workers=N)``; FFCV's
users with ``DatasetWriter(path, fields, num_workers=N).from_indexed_dataset(dataset)``; litdata's with
``optimize(fn, inputs, output_dir, num_workers=N)``.  This module times the three on the same dataset
objects, in ONE process, round after round (each round rotates which goes first), and reports each
peer's seconds over ours per round: a ratio above 1.0 is ours faster.  Speeds are never compared across
runs or machines; only ratios measured side by side are.  ``tools/bench_convert.sh OUT`` runs it in
FFCV's virtual environment (``tools/bench_ffcv.sh`` builds it) with litdata added.

Cells (each peer given the very same dataset object; ours writes a zip when encoded, a memmap when raw):

- ``photos-encoded``: torchvision's ``ImageFolder`` over the photographs.  Ours keeps each JPEG's bytes
  (a plain ImageFolder's files are read as they are, as a conversion of the folder reads them); FFCV
  decodes (in the dataset) and re-encodes at ``--quality`` (``RGBImageField(write_mode="jpg")``: it has
  no way to keep the bytes); litdata encodes at ``--quality`` (``LitdataItem`` says how).
- ``photos-raw``: ``ImageFolder(transform=Resize((S, S)))``, ``--side`` S: pixels, all of one size
  (ours ``mode="raw"``, FFCV ``write_mode="raw"``, litdata the PIL image, which it stores as pixels).
- ``arrays-encoded``: an in-memory dataset of ``(uint8 SxSx3 array, label)`` (the photographs' pixels),
  encoded as JPEG at ``--quality`` by each.
- ``arrays-raw``: the same arrays stored as pixels by each.
- litdata twice in each of these: with its default workers (spawn: each imports torch and receives the
  dataset pickled) and as ``litdata-fork`` (``start_method="fork"``, its default in a notebook).
- ``imagefolder-vs-folder``: ``convert(ImageFolder(root))`` against our own ``convert(root)`` (the
  ``folder`` contender; the issue's target is 0.9x).

Every output is checked to hold every sample (ours: the summary; FFCV: its reader's count; litdata: its
index), so that a peer that wrote nothing is never reported fast.  A peer that does not import here is
reported as absent, with the reason, and ours is still measured.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

WORKERS = 2
PEERS = ("ffcv", "litdata")
RIVALS = ("ffcv", "litdata", "litdata-fork")  # a peer, or a peer run another way: its name, a dash, how
INSTALL = {"ffcv": "tools/bench_ffcv.sh OUT (builds FFCV's own venv), then tools/bench_convert.sh OUT",
           "litdata": "pip install litdata (tools/bench_convert.sh adds it to FFCV's venv)"}


@dataclass(frozen=True)
class Cell:
    """One thing to time: a dataset (``photos`` or ``arrays``), a mode, and who is timed against ours."""

    name: str
    dataset: str  # "photos" (ImageFolder) or "arrays" (in-memory uint8 arrays)
    mode: str  # "encoded" or "raw"
    against: Tuple[str, ...] = RIVALS


CELLS = (
    Cell("photos-encoded", "photos", "encoded"),
    Cell("photos-raw", "photos", "raw"),
    Cell("arrays-encoded", "arrays", "encoded"),
    Cell("arrays-raw", "arrays", "raw"),
    Cell("imagefolder-vs-folder", "photos", "encoded", ("folder",)),
)
CELL_NAMES = tuple(cell.name for cell in CELLS)


def peer_status(name: str) -> Dict[str, Any]:
    """Whether a peer imports here: ``{"installed": bool, "version" or "error", "install"}``."""
    module = {"ffcv": "ffcv.writer", "litdata": "litdata"}[name]
    try:
        importlib.import_module(module)
        version = importlib.metadata.version(name)
    except Exception as exc:  # a C extension that fails to load raises ImportError or OSError
        return {"installed": False, "error": f"{type(exc).__name__}: {exc}", "install": INSTALL[name]}
    return {"installed": True, "version": version, "install": INSTALL[name]}


# --- datasets ----------------------------------------------------------------------------------------------

class Arrays:
    """An in-memory map-style dataset: ``(uint8 SxSx3 array, label)``, the photographs' pixels at S x S."""

    def __init__(self, root: str, side: int) -> None:
        import numpy as np
        from PIL import Image
        from torchvision.datasets import ImageFolder

        folder = ImageFolder(root)
        self.classes = folder.classes
        self.items = [(np.asarray(Image.open(path).convert("RGB").resize((side, side))), int(label))
                      for path, label in folder.samples]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        return self.items[i]


def make_datasets(root: str, side: int) -> Dict[Tuple[str, str], Any]:
    """The dataset of each (dataset, mode): ImageFolders (resized for raw) and the arrays (both modes)."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    arrays = Arrays(root, side)
    return {("photos", "encoded"): ImageFolder(root),
            ("photos", "raw"): ImageFolder(root, transform=transforms.Resize((side, side))),
            ("arrays", "encoded"): arrays, ("arrays", "raw"): arrays}


# --- contenders: each writes ``dataset`` under ``out`` and returns the samples written ----------------------

def run_ours(dataset: Any, out: str, mode: str, quality: int) -> int:
    from ..writing.convert import convert

    dst = os.path.join(out, "ours.zip" if mode == "encoded" else "ours.memmap")
    return convert(dataset, dst, mode=mode, quality=quality, workers=WORKERS, quiet=True).samples


def run_folder(root: str, out: str, mode: str, quality: int) -> int:
    """Our own conversion of the folder the ImageFolder reads (the baseline of ``imagefolder-vs-folder``)."""
    from ..writing.convert import convert

    return convert(root, os.path.join(out, "folder.zip"), mode=mode, quality=quality, workers=WORKERS,
                   quiet=True).samples


def run_ffcv(dataset: Any, out: str, mode: str, quality: int) -> int:
    from ffcv.fields import IntField, RGBImageField  # type: ignore[import-not-found, unused-ignore]
    from ffcv.reader import Reader  # type: ignore[import-not-found, unused-ignore]
    from ffcv.writer import DatasetWriter  # type: ignore[import-not-found, unused-ignore]

    path = os.path.join(out, "ffcv.beton")
    fields = {"image": RGBImageField(write_mode="jpg" if mode == "encoded" else "raw", jpeg_quality=quality),
              "label": IntField()}
    DatasetWriter(path, fields, num_workers=WORKERS).from_indexed_dataset(dataset)
    return int(Reader(path).num_samples)


class LitdataItem:
    """litdata's ``fn``: input i -> ``{"image", "label"}`` of ``dataset[i]``.  Encoded, the image is litdata's
    own ``Jpeg(array=pixels, quality=Q)``, encoded once in its workers (a PIL image or an array alone it
    stores as pixels; ``Jpeg(image=...)`` of a decoded image, it writes as PNG; a ``JpegImageFile``
    without a file, it encodes again at PIL's default quality)."""

    def __init__(self, dataset: Any, mode: str, quality: int) -> None:
        self.dataset, self.mode, self.quality = dataset, mode, quality

    def __call__(self, i: int) -> Dict[str, Any]:
        image, label = self.dataset[i]
        if self.mode == "encoded":
            import numpy as np
            from litdata.types import Jpeg  # type: ignore[import-not-found, unused-ignore]

            image = Jpeg(array=np.asarray(image), quality=self.quality)
        return {"image": image, "label": int(label)}


def run_litdata(dataset: Any, out: str, mode: str, quality: int, start_method: Optional[str] = None) -> int:
    """litdata's ``optimize``, its workers started by its default (spawn) or by ``start_method``."""
    from litdata import optimize  # type: ignore[import-not-found, unused-ignore]

    path = os.path.join(out, "litdata")
    method = multiprocessing.get_start_method(allow_none=True)
    try:  # litdata starts its workers with its default, spawn, which it sets for the whole process
        optimize(fn=LitdataItem(dataset, mode, quality), inputs=list(range(len(dataset))), output_dir=path,
                 chunk_bytes="64MB", num_workers=WORKERS, start_method=start_method)
    finally:  # the next contender (FFCV's pool) starts its workers as it would have
        multiprocessing.set_start_method(method, force=True)
    with open(os.path.join(path, "index.json")) as file:
        return sum(int(chunk["chunk_size"]) for chunk in json.load(file)["chunks"])


def run_litdata_fork(dataset: Any, out: str, mode: str, quality: int) -> int:
    """litdata with forked workers, as in a notebook: neither the dataset pickled nor torch imported again."""
    return run_litdata(dataset, out, mode, quality, start_method="fork")


CONTENDERS: Dict[str, Callable[[Any, str, str, int], int]] = {
    "ours": run_ours, "folder": run_folder, "ffcv": run_ffcv, "litdata": run_litdata,
    "litdata-fork": run_litdata_fork}


# --- the run -----------------------------------------------------------------------------------------------

def time_once(name: str, source: Any, work: str, mode: str, quality: int, count: int) -> float:
    """Seconds of one conversion by ``name`` into a fresh folder (removed after); RuntimeError when it did not
    write every sample."""
    out = os.path.join(work, f"out-{name}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    try:
        start = time.perf_counter()
        written = CONTENDERS[name](source, out, mode, quality)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if written != count:
        raise RuntimeError(f"{name} wrote {written} samples of {count}")
    return seconds


def run(work: str, images: Optional[str] = None, count: int = 1000, side: int = 256, quality: int = 90,
        rounds: int = 3, cells: Sequence[str] = CELL_NAMES, peers: Sequence[str] = PEERS,
        log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Time every cell ``rounds`` times; return the report (``summarise``'s, plus the run's settings)."""
    from ..synthetic import make_photo_folder

    root = images or os.path.join(work, "photos")
    if images is None and not os.path.isdir(root):
        make_photo_folder(root, -(-count // 4), sizes=(160, 320), quality=quality)
    status = {name: peer_status(name) for name in peers}
    datasets = make_datasets(root, side)
    count = len(datasets[("photos", "encoded")])
    chosen = [cell for cell in CELLS if cell.name in cells]
    seconds: Dict[str, Dict[str, List[float]]] = {cell.name: {} for cell in chosen}
    for r in range(rounds):
        for cell in chosen:
            names = ["ours"] + [n for n in cell.against
                                if n == "folder" or status.get(n.partition("-")[0], {}).get("installed")]
            names = names[r % len(names):] + names[:r % len(names)]  # who goes first rotates
            for name in names:
                source = root if name == "folder" else datasets[(cell.dataset, cell.mode)]
                took = time_once(name, source, work, cell.mode, quality, count)
                seconds[cell.name].setdefault(name, []).append(took)
                log(f"round {r + 1}/{rounds} {cell.name} {name}: {took:.2f} s")
    report = summarise(seconds, count)
    report.update(count=count, side=side, quality=quality, rounds=rounds, workers=WORKERS, peers=status,
                  images="photographic JPEGs (synthetic.make_photo_folder)" if images is None else images,
                  python=sys.version.split()[0], cpus=os.cpu_count(), load=_load())
    return report


def summarise(seconds: Dict[str, Dict[str, List[float]]], count: int) -> Dict[str, Any]:
    """Per cell: each contender's seconds and median samples/s, and per peer the ratios (its seconds over
    ours, round by round) with their median, least and most."""
    cells: Dict[str, Any] = {}
    for cell, timed in seconds.items():
        ours = timed["ours"]
        entry: Dict[str, Any] = {"seconds": timed,
                                 "samples_per_s": {n: count / statistics.median(s) for n, s in timed.items()},
                                 "ratios": {}}
        for name, theirs in timed.items():
            if name != "ours":
                ratios = [t / o for t, o in zip(theirs, ours)]
                entry["ratios"][name] = {"rounds": ratios, "median": statistics.median(ratios),
                                         "min": min(ratios), "max": max(ratios)}
        cells[cell] = entry
    return {"cells": cells}


def _load() -> Optional[Tuple[float, float, float]]:
    try:
        return os.getloadavg()
    except OSError:
        return None


def format_table(report: Dict[str, Any]) -> str:
    """One line per cell and peer: the median ratio (ours faster above 1.0x), its spread, and the speeds."""
    lines = [f"{report['count']} samples, {report['rounds']} rounds, {report['workers']} workers; ratio = the "
             "peer's seconds / ours (above 1.0x: ours faster)",
             f"{'cell':<24}{'against':<10}{'ratio':>8}{'spread':>16}{'ours/s':>10}{'theirs/s':>10}"]
    for cell, entry in report["cells"].items():
        for name, ratio in entry["ratios"].items():
            spread = f"{ratio['min']:.2f}-{ratio['max']:.2f}x"
            lines.append(f"{cell:<24}{name:<10}{ratio['median']:>7.2f}x{spread:>16}"
                         f"{entry['samples_per_s']['ours']:>10.0f}{entry['samples_per_s'][name]:>10.0f}")
    for name, status in report["peers"].items():
        if not status["installed"]:
            lines.append(f"{name}: not installed ({status['error']}); {status['install']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m packed_formats.bench.convert_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="folder for the photographs and the outputs")
    parser.add_argument("--images", help="an ImageFolder tree of photographs (default: drawn into WORK/photos)")
    parser.add_argument("--count", type=int, default=1000, help="photographs to draw (default 1000)")
    parser.add_argument("--side", type=int, default=256, help="the side of raw images and arrays (default 256)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of every encoder (default 90)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cells", default=",".join(CELL_NAMES), help="comma-separated, of: " + ", ".join(CELL_NAMES))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = run(args.work, args.images, args.count, args.side, args.quality, args.rounds,
                 args.cells.split(","), [p for p in args.peers.split(",") if p])
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    print(format_table(report))
    return 0 if all(status["installed"] for status in report["peers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
