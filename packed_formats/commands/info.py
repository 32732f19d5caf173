"""``packed-formats info``: what an archive holds, or what convert would make of a dataset."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Sequence

import numpy as np

from .. import storage
from ..archives import open_archive
from ..errors import printable
from ..sources import detect_source, open_source
from ..sources.base import describe_skipped
from ..sources.layout import DATASET_JSON
from ..space import disk_usage, human_bytes
from .convert import add_source_arguments, one_line_warnings, source_argument, source_options

HELP = (
    "show an archive's format, mode, sample count, classes with counts, shape or encoding, size and origin; "
    "or what convert would make of a dataset in its container"
)
EXAMPLES = """examples:
  packed-formats info train.zip
  packed-formats info images/              # a plain ImageFolder tree works too
  packed-formats info train.h5 --all-classes
  packed-formats info train.lmdb --json
  packed-formats info dataset.tar.gz --subdir train   # a dataset's container: what convert would make of it"""

_SHOWN_CLASSES = 20
_SHOWN_SKIPPED = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", nargs="+", help="archive, image folder or dataset to describe")
    parser.add_argument("--all-classes", action="store_true", help=f"list every class (default {_SHOWN_CLASSES})")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_source_arguments(parser)


def describe(path: "str | Sequence[str]", **options: Any) -> Dict[str, Any]:
    """The facts ``info`` prints, as a dict: an archive's (or ImageFolder's), else the source's as convert reads it.

    ``options``: how to read a source (subdir, source_format, label_key, image_key, allow_pickle).
    """
    given = {name: value for name, value in options.items() if value not in (None, False)}
    if isinstance(path, str) and storage.is_remote(path):
        return describe_archive(path)
    if isinstance(path, str) and not given and detect_source(path, deep=False) in ("packed", "folder"):
        if _has_labels(path):
            return describe_source(path)
        return describe_archive(path)
    return describe_source(path, **given)


def describe_source(path: "str | Sequence[str]", **options: Any) -> Dict[str, Any]:
    """What ``convert`` would read from a dataset (kind, layout, samples, classes with counts), without converting."""
    with open_source(path, **options) as source:
        counts = np.bincount(source.labels[source.labels >= 0], minlength=len(source.classes))  # -1: no label
        return {
            "path": path if isinstance(path, str) else list(path),
            "source": source.kind,
            "layout": source.layout,
            "samples": len(source),
            "shape": None if source.raw_shape is None else list(source.raw_shape),
            "skipped": source.skipped,
            "skipped_names": source.skipped_names,
            "failed": source.failed,
            "reading": source.notes(),
            "classes": {name: int(counts[c]) for c, name in enumerate(source.classes)},
            **({"labelled": False} if not source.labelled else {}),
            **({"fields": [spec.describe() for spec in source.fields]} if source.fields else {}),
        }


def _has_labels(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DATASET_JSON))


def describe_archive(path: str) -> Dict[str, Any]:
    """The facts ``info`` prints about an archive (or a plain ImageFolder tree), as a dict."""
    with open_archive(path, verify=False) as reader:
        m = reader.manifest
        labels = np.asarray(reader.labels) if m.labelled else np.zeros(0, np.int64)  # without labels: all -1
        counts = np.bincount(labels, minlength=len(m.classes)) if len(labels) else np.zeros(len(m.classes))
        facts = {
            "path": storage.clean_url(path) if storage.is_remote(path) else path,  # a URL's credentials hidden
            "format": m.format,
            "mode": m.mode,
            "samples": m.count,
            "shape": None if m.shape is None else list(m.shape),
            "encoding": m.encoding,
            "checksum": m.checksum,
            "bytes": remote_bytes(reader) if storage.is_remote(path) else disk_usage(path),
            "created_with": m.created_with,
            "created_at": m.created_at,
            "classes": {name: int(counts[c]) for c, name in enumerate(m.classes)},
        }
        if not m.labelled:
            facts["labelled"] = False
        if m.fields:
            facts["fields"] = [spec.describe() for spec in m.fields]
        if m.raw_layout != "hwc":  # left out for interleaved pixels, as every archive before version 6 stores them
            facts["raw_layout"] = m.raw_layout
        parts = getattr(reader.backend, "parts", None)
        if isinstance(reader.backend, storage.RemoteSetBackend):
            facts["parts"] = [{"path": p.url, "format": reader.backend.part_format, "samples": p.count}
                              for p in reader.backend.remote_parts]
        elif parts:
            facts["parts"] = [{"path": p.path, "format": p.manifest.format, "samples": len(p)} for p in parts]
    return facts


def remote_bytes(reader: Any) -> int:
    """Bytes a remote set's parts hold in the store."""
    return sum(p.info.size for p in reader.backend.remote_parts)


def run(args: argparse.Namespace) -> int:
    given = {name: value for name, value in source_options(args).items() if value not in (None, False)}
    with one_line_warnings("info"):
        facts = describe(source_argument(args.path), **given)
    if args.json:
        print(json.dumps(facts, indent=1))  # JSON escapes what does not print
    else:  # names read from the archive (parts, classes) with what does not print escaped, as keys are
        lines = _source_lines(facts, args.all_classes) if "source" in facts else _lines(facts, args.all_classes)
        print("\n".join(printable(line) for line in lines))
    return 0


def _source_lines(f: Dict[str, Any], all_classes: bool) -> List[str]:
    path = f["path"] if isinstance(f["path"], str) else f"{f['path'][0]} (+{len(f['path']) - 1} more)"
    lines = [
        f"path        {path}",
        f"source      {f['source']}: {f['layout']}",
        f"samples     {f['samples']}",
    ]
    if f["shape"]:
        lines.append(f"shape       {'x'.join(map(str, f['shape']))} (HxWxC uint8)")
    lines += [f"reading     {note}" for note in f["reading"]]
    lines.append(f"skipped     {describe_skipped(f['skipped'], f['skipped_names'], _SHOWN_SKIPPED, verb='')}; "
                 f"{len(f['failed'])} unusable samples")
    lines += [f"  {failure}" for failure in f["failed"][:_SHOWN_CLASSES]]
    return lines + _class_lines(f, all_classes)


def _lines(f: Dict[str, Any], all_classes: bool) -> List[str]:
    layout = (
        f"shape       {'x'.join(map(str, f['shape']))} (HxWxC uint8)" if f["shape"] else f"encoding    {f['encoding']}"
    )
    if f.get("raw_layout") == "chw":
        layout += ", stored planar (CxHxW: raw_layout chw)"
    parts = f" ({len(f['parts'])} {f['parts'][0]['format']} parts)" if "parts" in f else ""
    lines = [
        f"path        {f['path']}",
        f"format      {f['format']}{parts}",
        f"mode        {f['mode']}",
        f"samples     {f['samples']}",
        layout,
        f"checksums   {f['checksum'] or 'none'}",
        f"size        {human_bytes(f['bytes'])} on disk",
        f"created     {f['created_with'] or 'unknown'}" + (f" at {f['created_at']}" if f["created_at"] else ""),
    ]
    if f.get("fields"):
        lines.append(f"fields      {', '.join(f['fields'])}")
    return lines + _class_lines(f, all_classes)


def _class_lines(f: Dict[str, Any], all_classes: bool) -> List[str]:
    if f.get("labelled") is False:  # declared: no class names, every label -1
        return ["labels      none (declared: every label -1)"]
    lines = [f"classes     {len(f['classes'])}"]
    items = list(f["classes"].items())
    shown = items if all_classes else items[:_SHOWN_CLASSES]
    width = max([len(name) for name, _ in shown] + [1])
    lines += [f"  {c:>4}  {name:<{width}}  {count}" for c, (name, count) in enumerate(shown)]
    if len(shown) < len(items):
        lines.append(f"  ... {len(items) - len(shown)} more (--all-classes lists them)")
    return lines
