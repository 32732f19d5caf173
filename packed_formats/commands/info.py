"""``packed-formats info``: what an archive holds."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List

import numpy as np

from ..backends import open_archive
from ..space import disk_usage, human_bytes

HELP = "show an archive's format, mode, sample count, classes with counts, shape or encoding, size and origin"
EXAMPLES = """examples:
  packed-formats info train.zip
  packed-formats info images/              # a plain ImageFolder tree works too
  packed-formats info train.h5 --all-classes
  packed-formats info train.lmdb --json"""

_SHOWN_CLASSES = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="archive (or image folder) to describe")
    parser.add_argument("--all-classes", action="store_true", help=f"list every class (default {_SHOWN_CLASSES})")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def describe(path: str) -> Dict[str, Any]:
    """The facts ``info`` prints, as a dict."""
    with open_archive(path, verify=False) as reader:
        m = reader.manifest
        counts = np.bincount(reader.labels, minlength=len(m.classes)) if len(reader) else np.zeros(len(m.classes))
        facts = {
            "path": path,
            "format": m.format,
            "mode": m.mode,
            "samples": m.count,
            "shape": None if m.shape is None else list(m.shape),
            "encoding": m.encoding,
            "checksum": m.checksum,
            "bytes": disk_usage(path),
            "created_with": m.created_with,
            "created_at": m.created_at,
            "classes": {name: int(counts[c]) for c, name in enumerate(m.classes)},
        }
        parts = getattr(reader.backend, "parts", None)
        if parts:
            facts["parts"] = [{"path": p.path, "format": p.manifest.format, "samples": len(p)} for p in parts]
    return facts


def run(args: argparse.Namespace) -> int:
    facts = describe(args.path)
    if args.json:
        print(json.dumps(facts, indent=1))
    else:
        print("\n".join(_lines(facts, args.all_classes)))
    return 0


def _lines(f: Dict[str, Any], all_classes: bool) -> List[str]:
    layout = (
        f"shape       {'x'.join(map(str, f['shape']))} (HxWxC uint8)" if f["shape"] else f"encoding    {f['encoding']}"
    )
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
        f"classes     {len(f['classes'])}",
    ]
    items = list(f["classes"].items())
    shown = items if all_classes else items[:_SHOWN_CLASSES]
    width = max([len(name) for name, _ in shown] + [1])
    lines += [f"  {c:>4}  {name:<{width}}  {count}" for c, (name, count) in enumerate(shown)]
    if len(shown) < len(items):
        lines.append(f"  ... {len(items) - len(shown)} more (--all-classes lists them)")
    return lines
