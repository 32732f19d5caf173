"""``packed-formats bench``: compare the loading speed of archives and image folders, or (``--scale N``)
measure what grows with the number of samples."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import tempfile
from typing import Iterator, List

from ..bench import LOADERS, PIPELINES
from ..errors import DestinationError

HELP = ("measure images/s of archives and ImageFolders at several worker counts, against limits and baselines; "
        "or, with --scale N, what writing, opening and loading N samples costs in each format")
EXAMPLES = """\
examples:
  packed-formats bench data/images data/train.zip data/train-raw.memmap
  packed-formats bench data/*.h5 --workers 0,2,4 --pipeline none,train --size 224 --out r.json --plot r.png
  packed-formats bench data/train.lmdb --cold --epochs 3 --warmup 2
  packed-formats bench data/train-raw.memmap --device cuda --pipeline train --workers 0,4
  packed-formats bench --scale 1000000 --formats zip,memmap --shards 8 --json
  packed-formats bench s3://bucket/train.zip --cache-limit 50GB --workers 8 --epochs 2

Targets are archives of any format, or an ImageFolder tree (timed with
torchvision.datasets.ImageFolder and its standard transforms: the baseline).
Each epoch is timed separately after WARMUP batches; img/s is the median over
epochs of samples delivered / time.  Reference points measured in the same run:
the copy-bound limit for raw archives (also measured beside each epoch, in a
process of its own: a raw run's "vs limit" is against those spans) and the bare
decode rate for encoded ones.

A URL (s3://, gs://, https://) is read through a fresh node-local cache
(--cache-limit bounds it): each epoch's images/s, the first from an empty
cache, and the bytes downloaded over the set's size, in the window shuffle
(--order window, half the parts the cache holds) or a global one.

--scale N writes N tiny raw samples in each format and, each in a fresh
process, times writing, opening and the first batch (plain DataLoader over
PackedDataset, and make_loader, under fork and spawn), and reports peak and
per-worker memory, index bytes and open file descriptors: the costs that grow
with the number of samples.
"""


def _counts(text: str) -> List[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated worker counts, got {text!r}") from None
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return counts


def _pipelines(text: str) -> List[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PIPELINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"pipelines are {', '.join(PIPELINES)}; got {text!r}")
    return names


def _formats(text: str) -> List[str]:
    from ..backends import PACKED_FORMATS

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PACKED_FORMATS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"formats are {', '.join(PACKED_FORMATS)}; got {text!r}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="ARCHIVE_OR_FOLDER", help="archives and/or ImageFolder trees")
    parser.add_argument("--workers", type=_counts, default=None,
                        help="DataLoader worker counts (0,1,2,4; with --scale one count, 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch (64)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per measurement (3)")
    parser.add_argument("--warmup", type=int, default=2, help="batches excluded at the start of each epoch (2)")
    parser.add_argument("--max-batches", type=int, default=None, help="stop each epoch after this many batches")
    parser.add_argument("--pipeline", type=_pipelines, default=["none"],
                        help="none (decoded uint8), val (resize/centre crop + normalise), train (random crop + "
                             "flip + normalise); comma-separated for several (none)")
    parser.add_argument("--size", type=int, default=224, help="crop size of the val/train pipelines (224)")
    parser.add_argument("--decode-size", type=int, default=None,
                        help="square size make_loader decodes encoded archives to (SIZE*256/224)")
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default=None,
                        help="how DataLoader workers start (the platform default)")
    parser.add_argument("--cold", action="store_true",
                        help="evict the archive from the page cache before each epoch (posix_fadvise DONTNEED)")
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="read in order")
    parser.add_argument("--loader", choices=LOADERS, default="auto",
                        help="for archives: make_loader (the fast path), dataset (PackedDataset in a DataLoader) "
                             "or auto (make_loader where available)")
    parser.add_argument("--no-references", dest="references", action="store_false",
                        help="skip the copy-bound and bare-decode reference points")
    parser.add_argument("--no-tensordict-baseline", dest="tensordict_baseline", action="store_false",
                        help="skip the tensordict-style memmap loader (a baseline) on raw memmap archives")
    parser.add_argument("--reference-seconds", type=float, default=1.0,
                        help="seconds spent measuring each reference point (1.0); also the longest span of "
                             "the copy-bound limit beside an epoch")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda[:N]: make_loader copies pinned batches to the GPU ahead of use and "
                             "transforms them there; each archive is also timed with a plain .to(device) (cpu)")
    parser.add_argument("--layout", choices=("channels-last", "nchw"), default="channels-last",
                        help="memory layout of make_loader's untransformed (--pipeline none) batches: channels-last, "
                             "as stored (the default), or nchw, make_loader's own default (contiguous [B,C,H,W])")
    parser.add_argument("--source", default=None, help="the source ImageFolder, to compare archive sizes with")
    parser.add_argument("--out", default=None, help="write every measurement to this JSON file")
    parser.add_argument("--plot", default=None, help="save a PNG plot of images/s here (needs matplotlib)")
    remote = parser.add_argument_group("sets in object storage (s3://, gs://, https:// paths)")
    remote.add_argument("--cache-limit", default=None, help="the node-local cache's bound, e.g. 2GB (none)")
    remote.add_argument("--cache-dir", default=None, help="the cache folder (a fresh temporary one: a cold start)")
    remote.add_argument("--order", choices=("window", "global"), default="window",
                        help="window shuffle (half the parts the cache holds) or a global shuffle (window)")
    remote.add_argument("--window", type=_positive, default=None, help="parts per window (from the cache)")
    scale = parser.add_argument_group("at scale (--scale N instead of paths)")
    scale.add_argument("--scale", type=_positive, default=None, metavar="N",
                       help="write N raw 4x4x3 samples per format and measure what grows with N")
    scale.add_argument("--formats", type=_formats, default=None, help="comma-separated formats (all packed formats)")
    scale.add_argument("--shards", type=_positive, default=None, metavar="P",
                       help="write each archive as a sharded set of P parts")
    scale.add_argument("--classes", type=_positive, default=None, metavar="K",
                       help="label the samples with K classes (10), listed in every manifest")
    scale.add_argument("--dir", default=None, help="write the archives under this directory (a temporary one)")
    scale.add_argument("--keep", action="store_true", help="keep the archives written (removed otherwise)")
    scale.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    _check_mode(args)
    if args.scale is not None:
        return _run_at_scale(args)
    from .. import storage

    if any(storage.is_remote(p) for p in args.paths):
        return _run_remote(args)
    from ..bench import BenchConfig, format_table, plot, run_benchmark, write_json

    _check_outputs(args)  # before the benchmark: a bad --out must not cost a whole run
    config = BenchConfig(
        workers=args.workers or [0, 1, 2, 4], batch_size=args.batch_size, epochs=args.epochs, warmup=args.warmup,
        max_batches=args.max_batches, pipelines=args.pipeline, size=args.size, start_method=args.start_method,
        cold=args.cold, shuffle=args.shuffle, loader=args.loader, references=args.references,
        tensordict_baseline=args.tensordict_baseline, source=args.source, decode_size=args.decode_size,
        reference_seconds=args.reference_seconds, device=args.device, layout=args.layout,
    )
    results = run_benchmark(args.paths, config)
    print(format_table(results))
    if args.out:
        with _writing(args.out):
            write_json(results, args.out)
        print(f"\nwrote {args.out}")
    if args.plot:
        with _writing(args.plot):
            plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(r.get("error") for r in results["runs"]) else 0


def _run_remote(args: argparse.Namespace) -> int:
    """``bench s3://...``: each epoch's images/s and bytes downloaded through a bounded cache."""
    from .. import storage
    from ..bench.remote import RemoteBenchConfig, bench_remote, format_remote_table

    local = [p for p in args.paths if not storage.is_remote(p)]
    if local:
        raise ValueError(f"give either URLs or local paths, not both (local: {', '.join(local)})")
    _check_outputs(args)
    config = RemoteBenchConfig(
        workers=args.workers or [2], batch_size=args.batch_size, epochs=args.epochs, size=args.size,
        cache_limit=args.cache_limit, cache_dir=args.cache_dir, shuffle=args.order, window=args.window,
        start_method=args.start_method,
    )
    rows = bench_remote(args.paths, config)
    print(format_remote_table(rows))
    if args.out:
        with _writing(args.out), open(args.out, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


def _check_mode(args: argparse.Namespace) -> None:
    """Paths or --scale, never both, and the --scale options only with --scale (ValueError otherwise)."""
    if args.scale is None:
        if not args.paths:
            raise ValueError("give the archives or ImageFolder trees to time, or --scale N")
        given = [f"--{name}" for name in ("formats", "shards", "classes", "dir") if getattr(args, name) is not None]
        given += [f"--{name}" for name in ("keep", "json") if getattr(args, name)]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --scale N")
        return
    if args.paths:
        raise ValueError("--scale writes its own archives: give no paths with it")
    if args.plot:
        raise ValueError("--plot does not apply with --scale")
    if args.workers is not None and len(args.workers) != 1:
        raise ValueError("--scale takes one worker count, e.g. --workers 2")


def _run_at_scale(args: argparse.Namespace) -> int:
    """``bench --scale N``: the table (or JSON) of ``bench.scale``; 1 if any measurement failed."""
    from ..bench import scale as scale_defaults
    from ..bench.scale import ScaleConfig, format_scale_table, run_scale

    _check_outputs(args)
    config = ScaleConfig(
        count=args.scale, formats=args.formats or (), workers=args.workers[0] if args.workers else 2,
        batch_size=args.batch_size, shards=args.shards, classes=args.classes or scale_defaults.CLASSES,
        directory=args.dir, keep=args.keep,
        start_methods=(args.start_method,) if args.start_method else ("fork", "spawn"),
    )
    results = run_scale(config)
    print(json.dumps(results, indent=1) if args.json else format_scale_table(results))
    if args.out:
        with _writing(args.out), open(args.out, "w") as file:
            json.dump(results, file, indent=1)
    return 1 if any(row["errors"] for row in results["rows"]) else 0


def _check_outputs(args: argparse.Namespace) -> None:
    """--plot needs matplotlib; --out and --plot need a directory we can write to."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError("--plot needs matplotlib", name="matplotlib")
    for path in filter(None, (args.out, args.plot)):
        with _writing(path), tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))):
            pass


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """Turn an OSError while writing ``path`` (permission denied, disk full...) into an error naming it."""
    try:
        yield
    except OSError as exc:
        raise DestinationError(path, f"cannot write it: {exc.strerror or exc}", hint="choose another path") from None
