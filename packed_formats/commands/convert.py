"""``packed-formats convert``: pack an image folder or archive into an archive."""

from __future__ import annotations

import argparse
import ast
import contextlib
import sys
import warnings
from typing import Any, Dict, Iterator, List, Union

from .. import codecs
from ..backends import PACKED_FORMATS
from ..manifest import MODES, RAW_LAYOUTS
from ..policy import RESIZE_MODES
from ..sources import source_formats
from ..sources.python import PythonSource
from ..storage.urls import redact
from ..writing.convert import ON_ERROR, ConversionInterrupted, ConvertSummary, convert
from ..writing.parts import parse_part
from ..writing.prepare import parse_size

HELP = "pack an image dataset (a folder, or the zip/tar/HDF5/... it came in) into a zip/hdf5/lmdb/memmap archive"
EXAMPLES = """examples:
  packed-formats convert images/ train.zip --format zip --mode raw --size 128
  packed-formats convert images/ train.h5 --format hdf5 --mode encoded          # keeps the JPEG bytes as they are
  packed-formats convert images/ train.lmdb --format lmdb --mode encoded --size 256x256 --quality 90
  packed-formats convert val/ val.memmap --format memmap --mode raw --size 224 \\
      --resize-mode shorter-side-center-crop --labels val_labels.txt
  packed-formats convert train.zip train-raw.memmap --format memmap --mode raw --size 64 --workers 8
  packed-formats convert images/ train.zip --format zip --shard-size 100000   # train-00000.zip ... + index train.zip
  packed-formats convert dataset.tar.gz train.zip --subdir train              # read in place, never extracted
  packed-formats convert ILSVRC2012_img_train.tar train.lmdb --mode raw --size 64   # a tar of per-class tars
  packed-formats convert 'shards-{000..009}.tar' train.zip --label-key cls    # webdataset shards
  packed-formats convert data.h5 train.memmap --mode raw --image-key images --label-key labels
  packed-formats convert cifar10/ train.zip --split train   # Hub parquet shards (hf download)
  packed-formats convert saved/ train.zip --split train --image-column img --label-column fine_label   # save_to_disk
  packed-formats convert images/ train.zip --shard-size 50000 --part 3/50   # task 3 of 50: its parts only
  packed-formats convert images/ train.zip --shard-size 50000 --part auto   # in a Slurm array job (--array=0-49)
  packed-formats join train.zip                                             # the index, once every part is sealed
  packed-formats convert --python mypkg.data:make_train_set train.zip --python-arg split=train \
      --shard-size 10000 --part $SLURM_ARRAY_TASK_ID/16        # a Python dataset: make_train_set(split="train")

sources (found from the content; --source-format names one): root/<class>/<image> (classes = sorted
folder names); a flat folder with --labels FILE (one integer per line in sorted file order, or CSV
filename,label); a .zip or .tar(.gz/.bz2/.xz) of such a tree (--subdir picks a split) or with a
stylegan2-ada dataset.json; a tar of per-class tars; webdataset shards; an HDF5 file of images +
labels; an LMDB of pickled records (--allow-pickle); Hugging Face parquet shards or save_to_disk
folders (pyarrow: the 'hub' extra); a CSV/JSON list of path,label; or any archive this tool writes.
Keys, labels and order are those of the extracted folder.
Files that are no jpg/png/ppm/bmp/pgm/tif/webp image (a GIF, a text file) are skipped: the summary names
the first ones, --verbose all; a corrupt image stops the conversion unless --on-error skip.
Nothing appears at DST until the archive is complete and checked; Ctrl-C leaves DST untouched."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", nargs="*", help="dataset to read (several: webdataset shards; none "
                        "with --python)")
    parser.add_argument("dst", metavar="DST", help="archive to write (with --shard-size: the index)")
    parser.add_argument("--format", choices=PACKED_FORMATS, help="archive format (default: from DST's extension)")
    parser.add_argument("--mode", choices=MODES, default="encoded", help="raw pixels or encoded bytes")
    parser.add_argument("--size", type=_size, metavar="N|HxW", help="resize to this size (required for raw)")
    parser.add_argument("--resize-mode", choices=RESIZE_MODES, default="stretch", help="how to resize for --size")
    parser.add_argument("--raw-layout", choices=RAW_LAYOUTS, default="hwc",
                        help="how --mode raw stores pixels: hwc (interleaved, default) or chw (planar). Either reads "
                             "into NCHW or channels_last batches at copy speed where the package's C module is "
                             "built (packed-formats doctor says); without it, chw for NCHW training")
    parser.add_argument("--boxes", action="append", metavar="NAME=FORMAT", default=[],
                        help="an array field of boxes (XYXY, XYWH or CXCYWH, in the source image's pixels) that "
                             "--size moves, scales and clamps with the image; repeatable")
    parser.add_argument("--unscaled", action="append", metavar="NAME", default=[],
                        help="an array field whose values do not depend on where things are in the image (per-box "
                             "labels, scores) and that --size keeps as it is; repeatable")
    parser.add_argument("--quality", type=_quality, default=90, help="JPEG quality when re-encoding (default 90)")
    parser.add_argument("--encoding", choices=codecs.ENCODINGS, default="jpeg", help="format when re-encoding")
    parser.add_argument("--labels", metavar="FILE", help="label file for a flat folder of images")
    parser.add_argument("--workers", type=_positive, help="worker processes (default: available cores)")
    parser.add_argument("--shard-size", type=_positive, metavar="N", help="split into parts of N samples plus an index")
    parser.add_argument("--part", type=_part, metavar="I/N|auto",
                        help="write only task I's parts of N tasks of a --shard-size set (auto: from the Slurm "
                        "array task); the last task to finish writes the index (or: packed-formats join DST)")
    parser.add_argument("--on-error", choices=ON_ERROR, default="raise", help="on an unreadable image (default raise)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    parser.add_argument("--verbose", action="store_true", help="name every file skipped in the summary line")
    add_source_arguments(parser)
    group = parser.add_argument_group("a Python dataset instead of SRC")
    group.add_argument("--python", metavar="MODULE:FUNCTION", help="read the map-style dataset FUNCTION() returns "
                       "(imported from MODULE, and made again in each worker process)")
    group.add_argument("--python-arg", action="append", metavar="KEY=VALUE", default=[],
                       help="a keyword argument of --python's FUNCTION, repeatable (VALUE a Python literal, else a "
                       "string)")


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say how to read a source (shared with ``info``)."""
    group = parser.add_argument_group("reading the source")
    group.add_argument("--subdir", "--split", metavar="DIR", help="the folder (split) to read in a folder, zip or "
                       "tar; HDF5 group; the split of Hugging Face parquet or save_to_disk files (train, test...)")
    group.add_argument("--source-format", choices=source_formats(), help="read SRC as this kind (default: detected)")
    group.add_argument("--label-key", "--label-column", metavar="NAME", help="webdataset label extension (cls; "
                       "none: shards without labels), HDF5 labels dataset, pickled record field, or parquet/arrow "
                       "label column")
    group.add_argument("--image-key", "--image-column", metavar="NAME", help="webdataset image extension(s) "
                       "(jpg,jpeg,png,webp), HDF5 images dataset, pickled record field, or parquet/arrow image column")
    group.add_argument("--field", action="append", metavar="NAME=KIND", help="a field to pack with each sample, "
                       "repeatable: NAME=image, text, json, bytes or array:DTYPE[N,4] (N: any number of rows); "
                       "'auto': each other member every webdataset sample has (seg.png: seg=image); 'none': no "
                       "field, not even those an archive being converted has")
    group.add_argument("--allow-pickle", action="store_true",
                       help="read an LMDB of pickled records: unpickling runs code from the file, trust it first")


def source_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The source options given on the command line, as keyword arguments."""
    options = dict(
        subdir=args.subdir, source_format=args.source_format, label_key=args.label_key, image_key=args.image_key,
        allow_pickle=args.allow_pickle,
    )
    if args.field:
        options["fields"] = tuple(args.field)
    return options


def source_argument(paths: List[str]) -> Union[str, List[str]]:
    """One path as itself; several (webdataset shards) as the list."""
    return paths[0] if len(paths) == 1 else paths


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Print each warning as one line ``packed-formats COMMAND: warning: ...`` (no file and line)."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"packed-formats {command}: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def run(args: argparse.Namespace) -> int:
    try:
        with one_line_warnings("convert"):
            summary = _convert(args)
    except ConversionInterrupted as exc:
        print(f"packed-formats convert: {exc}; nothing was written to {redact(str(args.dst))}", file=sys.stderr)
        return 128 + exc.signum
    if not args.quiet:
        print(summary.line(verbose=args.verbose))
    return 0


def _convert(args: argparse.Namespace) -> ConvertSummary:
    return convert(
        _python_source(args) if args.python else source_argument(_paths(args.src)),
        args.dst,
        format=args.format,
        mode=args.mode,
        size=args.size,
        resize_mode=args.resize_mode,
        quality=args.quality,
        encoding=args.encoding,
        labels=args.labels,
        workers=args.workers,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
        on_error=args.on_error,
        quiet=args.quiet,
        part=args.part,
        boxes=args.boxes,
        unscaled=args.unscaled,
        raw_layout=args.raw_layout,
        **source_options(args),
    )


def _paths(paths: List[str]) -> List[str]:
    if not paths:
        raise ValueError("give the dataset to read (SRC), or --python MODULE:FUNCTION")
    return paths


def _python_source(args: argparse.Namespace) -> PythonSource:
    """The dataset of ``--python MODULE:FUNCTION``, made with the ``--python-arg``s."""
    if args.src:
        raise ValueError(f"--python reads a Python dataset: give no SRC ({args.src[0]})")
    kwargs: Dict[str, Any] = {}
    for text in args.python_arg:
        key, equals, value = text.partition("=")
        if not equals or not key.isidentifier():
            raise ValueError(f"--python-arg takes KEY=VALUE (as split=train), got {text!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return PythonSource.from_spec(args.python, kwargs)


def _part(text: str):
    try:
        return parse_part(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str):
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _quality(text: str) -> int:
    value = _positive(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be between 1 and 100, got {text!r}")
    return value
