"""A mixture of two archives measured: its proportions, its speed against its sources', and the peers'.

``tools/bench_mixture.sh OUT`` runs it in FFCV's virtual environment (where litdata is, and mosaic's
streaming where it installs without changing torch); ``python -m packed_formats.bench.mixture --work
DIR`` anywhere.  Two synthetic ImageFolders of ``--count`` JPEGs each (``--side`` pixels square, so every
contender stores the very same bytes and decodes them at their own size) are written, then:

- **Proportions.** One epoch of ``Mixture({a: w, b: 1 - w})`` with ``return_index``: each source's
  share of the epoch (exact by construction) and of every batch, whose spread a binomial draw bounds
  (``|count - B w| / sqrt(B w (1 - w))``: the largest such z over the epoch's batches, and the
  fraction of batches within 3); with ``batches="per-source"``, each source's share of the batches.
- **Speed against the sources.** Each source read alone, then the mixture, each an epoch of
  ``make_loader(..., num_workers=--workers)`` (raw: zip archives of pixels; encoded: zip archives of
  the JPEGs, decoded in the workers), in rounds that rotate which goes first.  A mixture that costs
  nothing of its own reads at the weighted harmonic mean of its sources' speeds
  (``1 / (w / r_a + (1 - w) / r_b)``: its time is the time of each source's share); the figure is
  the mixture's images/s over that mean, its median over the rounds (goal: >= 0.9), for batches
  mixed sample by sample and for whole batches per source (``batches="per-source"``).
- **Beside the peers.** mosaic's ``Stream(proportion=...)`` + ``StreamingDataset`` and litdata's
  ``CombinedStreamingDataset(weights=...)`` over the same two sets, each written by its own writer
  (the JPEG bytes as they are; raw: the decoded pixels), read as uint8 [B,C,H,W] batches of the same
  batch size at the same workers (encoded: decoded by ``torchvision.io.decode_jpeg`` in the workers),
  ``--peer-batches`` batches each after a warm-up, in the same rounds as ours.  A peer that does not
  import is reported absent with the reason; ours is still measured.

Speeds are compared only within one run: only ratios measured side by side mean anything.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

MODES = ("raw", "encoded")
PEERS = ("litdata", "mosaic")
IMPORTS = {"litdata": "litdata", "mosaic": "streaming"}
DISTRIBUTIONS = {"litdata": "litdata", "mosaic": "mosaicml-streaming"}


# ---- the sets -------------------------------------------------------------------------------------------
def make_sets(work: str, count: int, side: int) -> Dict[str, Any]:
    """Two ImageFolders of ``count`` JPEGs each (other seeds, so other pixels) and our archives of each:
    ``{"images": [a, b], "raw": [a.zip, b.zip], "encoded": [a.zip, b.zip]}``, reused when present."""
    import packed_formats as pf
    from packed_formats.synthetic import CLASSES, make_image_folder

    made: Dict[str, Any] = {"images": [], "raw": [], "encoded": []}
    for k, name in enumerate(("a", "b")):
        images = os.path.join(work, "images", name)
        if not os.path.isdir(images):
            make_image_folder(images, max(1, count // len(CLASSES)), sizes=(side, side), seed=k)
        made["images"].append(images)
        for mode in MODES:
            path = os.path.join(work, "ours", mode, f"{name}.zip")
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                pf.convert(images, path, format="zip", mode=mode, size=side if mode == "raw" else None, workers=1,
                           quiet=True)
            made[mode].append(path)
    return made


# ---- ours -----------------------------------------------------------------------------------------------
def our_loader(source: Any, mode: str, side: int, batch_size: int, workers: int, **options: Any) -> Any:
    import packed_formats as pf

    return pf.make_loader(source, batch_size=batch_size, num_workers=workers, seed=0,
                          **({"size": side} if mode == "encoded" else {}), **options)


def epoch_rate(loader: Iterable, max_batches: Optional[int] = None, warmup: int = 1) -> float:
    """Images/s of one pass of ``loader`` after ``warmup`` batches (its workers started before the clock)."""
    images, started = 0, None
    for k, batch in enumerate(loader):
        if k == warmup:
            started = time.perf_counter()
        if k >= warmup:
            images += len(batch[0])
        if max_batches is not None and k + 1 >= max_batches + warmup:
            break
    if started is None or images == 0:
        raise ValueError("an epoch of fewer batches than the warm-up: give more samples or a smaller batch")
    return images / (time.perf_counter() - started)


def harmonic_mean(rates: Sequence[float], weights: Sequence[float]) -> float:
    """The speed of reading each source's share at its own speed: 1 / sum(p_k / r_k), p the weights
    made to add up to 1."""
    total = sum(weights)
    return 1.0 / sum(w / total / r for w, r in zip(weights, rates))


def proportions(paths: Sequence[str], weights: Sequence[float], batch_size: int, **options: Any) -> Dict[str, Any]:
    """One epoch of the mixture of ``paths`` by ``weights``: each source's share of the epoch, and of its
    batches against a binomial draw (``max_z``, ``within_3_sigma``); per-source: its share of the batches."""
    import packed_formats as pf

    p = weights[0] / sum(weights)
    loader = pf.make_loader(pf.Mixture(dict(zip(paths, weights))), batch_size=batch_size, num_workers=0,
                            return_index=True, seed=0, **options)
    counts, z = np.zeros(len(paths), dtype=np.int64), []
    for _, _, index in loader:
        first = int((index[:, 0] == 0).sum())
        counts += np.bincount(index[:, 0].numpy(), minlength=len(paths))
        if len(index) == batch_size:
            z.append(abs(first - batch_size * p) / math.sqrt(batch_size * p * (1 - p)))
    whole = pf.make_loader(pf.Mixture(dict(zip(paths, weights)), batches="per-source"), batch_size=batch_size,
                           num_workers=0, return_index=True, seed=0, **options)
    per_source = np.zeros(len(paths), dtype=np.int64)
    for _, _, index in whole:
        per_source[int(index[0, 0])] += 1
    return {"weights": [w / sum(weights) for w in weights], "epoch_share": (counts / counts.sum()).tolist(),
            "batches": len(z), "max_z": max(z) if z else 0.0,
            "within_3_sigma": float(np.mean(np.array(z) <= 3)) if z else 1.0,
            "per_source_batch_share": (per_source / per_source.sum()).tolist()}


# ---- the peers ------------------------------------------------------------------------------------------
def peer_status(name: str) -> Dict[str, Any]:
    """``{"available": True, "version"}`` or ``{"available": False, "reason"}``."""
    try:
        __import__(IMPORTS[name])
        return {"available": True, "version": importlib.metadata.version(DISTRIBUTIONS[name])}
    except Exception as exc:  # noqa: BLE001 - any failure to import is the peer's absence, reported
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def peer_record(item: Tuple[str, int], mode: str) -> Dict[str, Any]:
    """What a peer stores of one image: its JPEG bytes as they are, or (raw) its decoded pixels, HxWxC."""
    path, label = item
    with open(path, "rb") as file:
        data = file.read()
    if mode == "encoded":
        return {"image": data, "label": label}
    from PIL import Image

    with Image.open(path) as image:
        return {"image": np.ascontiguousarray(np.asarray(image.convert("RGB"))), "label": label}


class LitdataRecord:
    """litdata's ``fn`` (picklable): an (image path, label) to its record."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, item: Tuple[str, int]) -> Dict[str, Any]:
        return peer_record(item, self.mode)


class ToTensor:
    """A peer's record to (uint8 CxHxW tensor, label): JPEG bytes decoded, pixels transposed."""

    def __call__(self, sample: Dict[str, Any]) -> Tuple[torch.Tensor, int]:
        image = sample["image"]
        if isinstance(image, (bytes, bytearray, memoryview)):
            from torchvision.io import ImageReadMode, decode_jpeg

            tensor = decode_jpeg(torch.frombuffer(bytearray(image), dtype=torch.uint8), mode=ImageReadMode.RGB)
        else:
            tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # its own copy: a peer's may be read-only
        return tensor, int(sample["label"])


def collate(samples: Sequence[Tuple[torch.Tensor, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([image for image, _ in samples]), torch.tensor([label for _, label in samples])


def peer_write(peer: str, images: str, out: str, mode: str, side: int) -> None:
    """``images`` (an ImageFolder) written by the peer's own writer into ``out`` (kept when present)."""
    from .peers import list_images

    if os.path.exists(os.path.join(out, "index.json")):
        return
    items, _ = list_images(images)
    shard = 1 << 22
    if peer == "litdata":
        import multiprocessing

        import litdata  # type: ignore[import-not-found, unused-ignore]

        start_method = multiprocessing.get_start_method(allow_none=True)
        litdata.optimize(fn=LitdataRecord(mode), inputs=items, output_dir=out, chunk_bytes=shard, num_workers=1,
                         mode="overwrite")
        multiprocessing.set_start_method(start_method, force=True)  # optimize sets spawn for good
    else:
        from streaming import MDSWriter  # type: ignore[import-not-found, unused-ignore]

        column = "bytes" if mode == "encoded" else f"ndarray:uint8:{side},{side},3"
        with MDSWriter(out=out, columns={"image": column, "label": "int"}, size_limit=shard) as writer:
            for item in items:
                writer.write(peer_record(item, mode))


def mosaic_dataset(**options: Any) -> Any:
    """mosaic's StreamingDataset of ``options`` whose samples come out as ``ToTensor`` makes them, in the
    DataLoader's workers (forked: the class needs no pickling)."""
    from streaming import StreamingDataset  # type: ignore[import-not-found, unused-ignore]

    class Decoded(StreamingDataset):  # type: ignore[misc, unused-ignore]
        def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
            return ToTensor()(super().__getitem__(i))

    return Decoded(**options)


def peer_loader(peer: str, dirs: Sequence[str], weights: Sequence[float], batch_size: int, workers: int,
                samples: int) -> Any:
    """The peer's weighted mixture of ``dirs`` in a DataLoader of uint8 [B,C,H,W] batches."""
    total = sum(weights)
    if peer == "litdata":
        import litdata  # type: ignore[import-not-found, unused-ignore]

        sets = [litdata.StreamingDataset(d, shuffle=True, seed=0, transform=ToTensor()) for d in dirs]
        combined = litdata.CombinedStreamingDataset(sets, seed=0, weights=[w / total for w in weights],
                                                    iterate_over_all=False)
        return litdata.StreamingDataLoader(combined, batch_size=batch_size, num_workers=workers, collate_fn=collate)
    from streaming import Stream  # type: ignore[import-not-found, unused-ignore]
    from streaming.base.util import clean_stale_shared_memory  # type: ignore[import-not-found, unused-ignore]

    clean_stale_shared_memory()
    streams = [Stream(local=d, proportion=w / total) for d, w in zip(dirs, weights)]
    dataset = mosaic_dataset(streams=streams, shuffle=True, shuffle_seed=0, batch_size=batch_size,
                             epoch_size=samples, num_canonical_nodes=1)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate)


# ---- the run --------------------------------------------------------------------------------------------
def run(work: str, count: int = 2048, side: int = 128, batch_size: int = 64, workers: int = 2,
        weight: float = 0.7, rounds: int = 5, modes: Sequence[str] = MODES, peers: Sequence[str] = PEERS,
        peer_batches: int = 0, say: Callable[[str], None] = print) -> Dict[str, Any]:
    """The measurements (see the module's docstring) as a JSON-able report."""
    import packed_formats as pf

    sets = make_sets(work, count, side)
    weights = (weight, 1.0 - weight)
    samples = 2 * count
    report: Dict[str, Any] = {
        "config": {"count": count, "side": side, "batch_size": batch_size, "workers": workers, "weights": weights,
                   "rounds": rounds, "torch": torch.__version__, "python": sys.version.split()[0],
                   "cpus": os.cpu_count()},
        "proportions": proportions(sets["raw"], weights, batch_size),
        "peers": {p: peer_status(p) for p in peers}, "modes": {},
    }
    say(f"proportions: {json.dumps(report['proportions'])}")
    for mode in modes:
        dirs = {}
        for peer in peers:
            if report["peers"][peer]["available"]:
                dirs[peer] = [os.path.join(work, peer, mode, name) for name in ("a", "b")]
                for images, out in zip(sets["images"], dirs[peer]):
                    peer_write(peer, images, out, mode, side)
        paths = sets[mode]
        contenders: Dict[str, Callable[[], Any]] = {
            "source a": functools.partial(our_loader, paths[0], mode, side, batch_size, workers),
            "source b": functools.partial(our_loader, paths[1], mode, side, batch_size, workers),
            "mixture": functools.partial(our_loader, pf.Mixture(dict(zip(paths, weights))), mode, side, batch_size,
                                         workers),
            "per-source": functools.partial(our_loader, pf.Mixture(dict(zip(paths, weights)), batches="per-source"),
                                            mode, side, batch_size, workers),
        }
        for peer, d in dirs.items():
            contenders[peer] = functools.partial(peer_loader, peer, d, weights, batch_size, workers, samples)
        rates: Dict[str, List[float]] = {name: [] for name in contenders}
        batches = peer_batches or samples // batch_size - 1
        for r in range(rounds):
            names = list(contenders)
            names = names[r % len(names):] + names[: r % len(names)]
            for name in names:
                loader = contenders[name]()
                rate = epoch_rate(loader, max_batches=batches)
                del loader
                rates[name].append(rate)
                say(f"{mode} round {r}: {name} {rate:,.0f} images/s")
        median = {name: statistics.median(values) for name, values in rates.items()}
        expected = harmonic_mean([median["source a"], median["source b"]], weights)
        means = [harmonic_mean([a, b], weights) for a, b in zip(rates["source a"], rates["source b"])]
        report["modes"][mode] = {
            "rates": rates, "median": median, "harmonic_mean": expected,
            "mixture_over_harmonic_mean": statistics.median(m / h for m, h in zip(rates["mixture"], means)),
            "per_source_over_harmonic_mean": statistics.median(m / h for m, h in zip(rates["per-source"], means)),
            "peers_over_ours": {p: median[p] / median["mixture"] for p in dirs},
        }
    return report


def format_table(report: Dict[str, Any]) -> str:
    lines = [f"{'mode':8} {'contender':10} {'images/s':>10}  note"]
    for mode, result in report["modes"].items():
        for name, rate in result["median"].items():
            note = ""
            if name in ("mixture", "per-source"):
                ratio = result["mixture_over_harmonic_mean" if name == "mixture" else "per_source_over_harmonic_mean"]
                note = f"{ratio:.2f}x the sources' weighted harmonic mean ({result['harmonic_mean']:,.0f}), " \
                       "median of the rounds' ratios"
            elif name in result["peers_over_ours"]:
                note = f"{result['peers_over_ours'][name]:.2f}x ours"
            lines.append(f"{mode:8} {name:10} {rate:>10,.0f}  {note}")
    for peer, status in report["peers"].items():
        if not status["available"]:
            lines.append(f"{peer}: absent ({status['reason']})")
    share = report["proportions"]
    lines.append(f"epoch share {['%.3f' % s for s in share['epoch_share']]} of weights "
                 f"{['%.3f' % w for w in share['weights']]}; batches within 3 sigma: {share['within_3_sigma']:.3f} "
                 f"(max z {share['max_z']:.2f}); per-source batch share "
                 f"{['%.3f' % s for s in share['per_source_batch_share']]}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="folder for the images and every contender's sets (reused)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--count", type=int, default=2048, help="images in each of the two sets")
    parser.add_argument("--side", type=int, default=128, help="the images' side, in pixels")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--weight", type=float, default=0.7, help="the first set's weight (the second's: 1 - it)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--peers", default=",".join(PEERS), help="peers to run ('' for none)")
    parser.add_argument("--peer-batches", type=int, default=0,
                        help="batches timed of every contender (0: an epoch of the two sets' samples)")
    options = parser.parse_args(argv)
    report = run(options.work, options.count, options.side, options.batch_size, options.workers, options.weight,
                 options.rounds, [m for m in options.modes.split(",") if m],
                 [p for p in options.peers.split(",") if p], options.peer_batches)
    print(format_table(report))
    if options.json:
        with open(options.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
