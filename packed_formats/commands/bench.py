"""``packed-formats bench``: compare the loading speed of archives and image folders."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import tempfile
from typing import Iterator, List

from ..bench.loaders import LOADERS, PIPELINES
from ..errors import DestinationError

HELP = "measure images/s of archives and ImageFolders at several worker counts, against limits and baselines"
EXAMPLES = """\
examples:
  packed-formats bench data/images data/train.zip data/train-raw.memmap
  packed-formats bench data/*.h5 --workers 0,2,4 --pipeline none,train --size 224 --out r.json --plot r.png
  packed-formats bench data/train.lmdb --cold --epochs 3 --warmup 2
  packed-formats bench data/train-raw.memmap --device cuda --pipeline train --workers 0,4

Targets are archives of any format, or an ImageFolder tree (timed with
torchvision.datasets.ImageFolder and its standard transforms: the baseline).
Each epoch is timed separately after WARMUP batches; img/s is the median over
epochs of samples delivered / time.  Reference points measured in the same run:
the copy-bound limit for raw archives and the bare decode rate for encoded ones.
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="ARCHIVE_OR_FOLDER", help="archives and/or ImageFolder trees")
    parser.add_argument("--workers", type=_counts, default=[0, 1, 2, 4], help="DataLoader worker counts (0,1,2,4)")
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
                        help="seconds spent measuring each reference point (1.0)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda[:N]: make_loader copies pinned batches to the GPU ahead of use and "
                             "transforms them there; each archive is also timed with a plain .to(device) (cpu)")
    parser.add_argument("--source", default=None, help="the source ImageFolder, to compare archive sizes with")
    parser.add_argument("--out", default=None, help="write every measurement to this JSON file")
    parser.add_argument("--plot", default=None, help="save a PNG plot of images/s here (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchConfig, format_table, plot, run_benchmark, write_json

    _check_outputs(args)  # before the benchmark: a bad --out must not cost a whole run
    config = BenchConfig(
        workers=args.workers, batch_size=args.batch_size, epochs=args.epochs, warmup=args.warmup,
        max_batches=args.max_batches, pipelines=args.pipeline, size=args.size, start_method=args.start_method,
        cold=args.cold, shuffle=args.shuffle, loader=args.loader, references=args.references,
        tensordict_baseline=args.tensordict_baseline, source=args.source, decode_size=args.decode_size,
        reference_seconds=args.reference_seconds, device=args.device,
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
