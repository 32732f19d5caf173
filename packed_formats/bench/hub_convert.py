"""Converting a Hugging Face parquet set against converting the same images from their folder, measured in
one run.

    python -m packed_formats.bench.hub_convert [--images 400] [--sizes 300-500] [--workers 2] [--runs 3]

The set is photographs (``synthetic.make_photo_folder``: crops of a photograph shipped with matplotlib;
drawn shapes where none is installed, said so in the output) in an ImageFolder tree, and the same files
as the Hub serves such a set: parquet shards of ``--rows-per-group`` rows per row group (the Hub's 100 for
image sets), an Image struct column ``{bytes, path}``, a ClassLabel column, the dataset card.  Each is
converted with ``--workers`` workers, encoded and raw at ``--size``, folder and parquet in turn ``--runs``
times (the page cache warm after the first).  The figures: the images/s ``convert`` reports (the source's
listing included; pyarrow is imported before the first run, as a long conversion pays it once), the
parquet rate over the folder's (median of the runs' ratios), and the same by CPU time (this process's and
its workers'), which a loaded machine disturbs less.  The goal, checked in the same run: at least
``--goal`` (0.9x).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

GOAL = 0.9
SHARDS = 2


def make_sets(work: str, images: int, sizes: Tuple[int, int], rows_per_group: int, seed: int = 0) -> Dict[str, Any]:
    """A folder of ``images`` photographs and the same files as parquet shards with a card; what it made."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .. import synthetic
    from ..sources import open_source

    folder, hub = os.path.join(work, "photos"), os.path.join(work, "hub")
    photographs = bool(synthetic.sample_photographs())
    per_class = max(1, images // 4)
    if photographs:
        synthetic.make_photo_folder(folder, images_per_class=per_class, sizes=sizes, seed=seed)
    else:
        synthetic.make_image_folder(folder, images_per_class=per_class, classes=("a", "b", "c", "d"), sizes=sizes,
                                    seed=seed)
    with open_source(folder) as source:
        rows = [(source.load(i), source.key(i), int(source.labels[i])) for i in range(len(source))]
        classes = list(source.classes)
    os.makedirs(os.path.join(hub, "data"))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    per = -(-len(rows) // SHARDS)
    for s in range(SHARDS):
        part = rows[s * per:(s + 1) * per]
        table = pa.table({"image": pa.array([{"bytes": b, "path": k} for b, k, _ in part], image),
                          "label": pa.array([y for _, _, y in part], pa.int64())})
        pq.write_table(table, os.path.join(hub, "data", f"train-{s:05d}-of-{SHARDS:05d}.parquet"),
                       row_group_size=rows_per_group)
    names = "".join(f"          '{c}': {n}\n" for c, n in enumerate(classes))
    with open(os.path.join(hub, "README.md"), "w", encoding="utf-8") as card:
        card.write("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n  - name: label\n"
                   f"    dtype:\n      class_label:\n        names:\n{names}---\n")
    return {"folder": folder, "hub": hub, "images": len(rows), "photographs": photographs, "sizes": list(sizes),
            "bytes": sum(len(b) for b, _, _ in rows), "rows_per_group": rows_per_group}


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the conversion's workers)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def convert_once(source: str, destination: str, workers: int, **options: Any) -> Tuple[float, float]:
    """(images/s as ``convert`` reports it, CPU seconds) of one conversion."""
    import packed_formats as pf

    before = _cpu_seconds()
    summary = pf.convert(source, destination, workers=workers, overwrite=True, quiet=True, **options)
    return summary.samples / summary.seconds, _cpu_seconds() - before


def run(made: Dict[str, Any], work: str, *, workers: int, runs: int, size: int) -> Dict[str, Any]:
    """{mode: {"folder": [images/s...], "parquet": [...], "ratio": ..., "cpu_ratio": ...}}, each mode
    converted folder then parquet, ``runs`` times."""
    import pyarrow.parquet  # noqa: F401 - imported once, before the first run, as a long conversion pays it

    modes = {f"encoded {size}x{size}": dict(mode="encoded", size=size),
             f"raw {size}x{size}": dict(mode="raw", size=size)}
    out: Dict[str, Any] = {}
    for name, options in modes.items():
        found: Dict[str, List[Tuple[float, float]]] = {"folder": [], "parquet": []}
        for _ in range(runs):
            for kind, source in (("folder", made["folder"]), ("parquet", made["hub"])):
                found[kind].append(convert_once(source, os.path.join(work, f"out-{kind}.zip"), workers, **options))
        pairs = list(zip(found["folder"], found["parquet"]))
        out[name] = {
            "folder": [round(r, 1) for r, _ in found["folder"]],
            "parquet": [round(r, 1) for r, _ in found["parquet"]],
            "ratio": round(statistics.median(p[0] / f[0] for f, p in pairs), 3),
            "cpu_ratio": round(statistics.median(f[1] / p[1] for f, p in pairs), 3),
        }
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400, help="images in the set (default 400)")
    parser.add_argument("--sizes", default="300-500", help="the photographs' widths and heights, drawn from "
                                                           "this range (default 300-500)")
    parser.add_argument("--workers", type=int, default=2, help="conversion workers (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="conversions of each source per mode (default 3)")
    parser.add_argument("--size", type=int, default=224, help="the archives' image size (default 224)")
    parser.add_argument("--rows-per-group", type=int, default=100, help="rows per parquet row group "
                                                                         "(default 100, as the Hub writes)")
    parser.add_argument("--goal", type=float, default=GOAL, help="parquet over folder, at least (default 0.9)")
    parser.add_argument("--dir", help="where to make the sets and archives (default: a temporary folder)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    low, _, high = args.sizes.partition("-")
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        made = make_sets(work, args.images, (int(low), int(high or low)), args.rows_per_group)
        results = run(made, work, workers=args.workers, runs=args.runs, size=args.size)
    what = "photographs" if made["photographs"] else "drawn shapes (no sample photograph installed)"
    print(f"{made['images']} {what}, {made['sizes'][0]}-{made['sizes'][1]} px ({made['bytes'] / 1e6:.0f} MB), "
          f"parquet row groups of {args.rows_per_group}; {args.workers} workers, {args.runs} runs; "
          f"median images/s:")
    for name, result in results.items():
        result["goal_met"] = result["ratio"] >= args.goal
        print(f"  {name:<16} folder {statistics.median(result['folder']):>7,.0f}   parquet "
              f"{statistics.median(result['parquet']):>7,.0f}   {result['ratio']:.2f}x (by CPU time "
              f"{result['cpu_ratio']:.2f}x; goal {args.goal:g}x: {'ok' if result['goal_met'] else 'MISS'})")
    if args.out:
        made = {k: v for k, v in made.items() if k not in ("folder", "hub")}
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({"set": made, "workers": args.workers, "runs": args.runs, "size": args.size, "goal": args.goal,
                       "results": results}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
