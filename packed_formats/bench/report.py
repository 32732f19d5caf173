"""Turning measurements into ratios, a terminal table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from .pagecache import eviction_note

# The speed goals, checked as ratios measured in one run: (what is compared, make_loader rows
# as (format, mode, pipeline), the ratio, the least ratio that meets the goal).
GOALS = (
    ("raw memmap, no transform vs copy-bound limit", ("memmap", "raw", "none"), "vs_limit", 0.7),
    ("raw memmap, no transform vs tensordict-style memmap loader", ("memmap", "raw", "none"), "vs_tensordict", 4.0),
    ("raw memmap, train vs tensordict-style memmap loader", ("memmap", "raw", "train"), "vs_tensordict", 5.0),
    ("raw memmap, train vs torchvision ImageFolder", ("memmap", "raw", "train"), "vs_imagefolder", 10.0),
    ("raw zip/hdf5/lmdb vs raw memmap", ("*", "raw", "*"), "vs_raw_memmap", 0.5),
    ("encoded vs bare decode", ("*", "encoded", "none"), "vs_limit", 0.85),
    ("encoded, train vs bare decode", ("*", "encoded", "train"), "vs_limit", 0.8),
    ("encoded, train vs torchvision ImageFolder", ("*", "encoded", "train"), "vs_imagefolder", 3.0),
    ("encoded, train decoded on the GPU vs in the workers", ("*", "encoded", "train"), "vs_worker_decode", 3.0),
)

COLD = "cold (page cache evicted before each epoch)"
WARM = "warm page cache (each target read once before timing)"


def rate(row: Dict[str, Any]) -> Optional[float]:
    """The median images/s of a run, or None if it failed."""
    if row.get("error"):
        return None
    return (row.get("images_per_s") or {}).get("median")


def _limit_for(row: Dict[str, Any], target: Dict[str, Any], refs: List[Dict[str, Any]]) -> Optional[Dict]:
    key: Optional[str]
    if row["mode"] == "raw":
        key = f"copy:{'x'.join(map(str, target['shape']))}:{target['count']}"
        processes = 1
    else:  # train/val on the CPU crop at decode: compared with the decode alone where it was measured
        key, processes = target.get("decode_key"), max(1, row["workers"])
        if row["pipeline"] != "none" and target.get("decode_only_key"):
            key = target["decode_only_key"]
    for ref in refs:
        if ref.get("key") == key and ref["processes"] == processes:
            return ref
    return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def add_ratios(results: Dict[str, Any]) -> None:
    """Give every run its ratios to the references and baselines of the same pipeline and worker count."""
    runs, refs = results["runs"], results["references"]
    targets = {t["path"]: t for t in results["targets"]}
    by_kind: Dict[Tuple, float] = {}
    for row in runs:
        r = rate(row)
        if r is None:
            continue
        at = (row["pipeline"], row["workers"])
        if row["loader"] in ("torchvision-imagefolder", "tensordict-memmap"):
            by_kind.setdefault((row["loader"],) + at, r)
        elif row["loader"] == "plain-to-device":
            by_kind.setdefault((row["loader"], row["path"]) + at, r)
        elif row["format"] == "memmap" and row["mode"] == "raw":
            by_kind.setdefault(("memmap", row["loader"], tuple(row["shape"])) + at, r)
        if row["loader"] == "make_loader":  # the workers' decode, against which decoding on the device is measured
            by_kind.setdefault((row["loader"], row["path"]) + at, r)
    for row in runs:
        r, at, ratios = rate(row), (row["pipeline"], row["workers"]), {}
        limit = row.get("limit_beside") or _limit_for(row, targets[row["path"]], refs)
        if limit is not None:
            row["limit"] = {"name": limit["name"], "processes": limit["processes"],
                            "images_per_s": limit["images_per_s"], "beside_epochs": limit is row.get("limit_beside")}
            ratios["vs_limit"] = _ratio(r, limit["images_per_s"])
        if row["loader"] != "torchvision-imagefolder":
            ratios["vs_imagefolder"] = _ratio(r, by_kind.get(("torchvision-imagefolder",) + at))
        if row["mode"] == "raw" and row["role"] == "target":
            ratios["vs_tensordict"] = _ratio(r, by_kind.get(("tensordict-memmap",) + at))
            if row["format"] != "memmap":
                ratios["vs_raw_memmap"] = _ratio(r, by_kind.get(("memmap", row["loader"], tuple(row["shape"])) + at))
        if row["loader"] == "make_loader":
            ratios["vs_plain_copy"] = _ratio(r, by_kind.get(("plain-to-device", row["path"]) + at))
        if row["loader"] == "make_loader-decode-on-device":
            ratios["vs_worker_decode"] = _ratio(r, by_kind.get(("make_loader", row["path"]) + at))
        row["ratios"] = {k: v for k, v in ratios.items() if v is not None}
    results["goals"] = check_goals(runs)


def check_goals(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The speed goals for every make_loader run they apply to, with the measured ratio."""
    out = []
    for what, (fmt, mode, pipeline), ratio, goal in GOALS:
        for row in runs:
            if not row["loader"].startswith("make_loader") or row["mode"] != mode:
                continue
            if (fmt != "*" and row["format"] != fmt) or (pipeline != "*" and row["pipeline"] != pipeline):
                continue
            value = row.get("ratios", {}).get(ratio)
            if value is None:
                continue
            out.append({"goal": what, "target": row["target"], "pipeline": row["pipeline"],
                        "workers": row["workers"], "ratio": value, "at_least": goal, "met": value >= goal})
    return out


# ---- terminal table ------------------------------------------------------------------------------

def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _run_cells(row: Dict[str, Any]) -> List[str]:
    kind = f"{row['format']}/{row['mode']}" + (" chw" if row.get("raw_layout") == "chw" else "")  # planar pixels
    workers = str(row["workers"]) + (" thr" if row.get("worker_kind") == "threads" else "")  # threads of this process
    head = [row["pipeline"], row["target"], row["loader"], kind, workers]
    if row.get("error"):
        return head + ["FAILED"] + [""] * (len(HEADER) - len(head) - 1)
    ips, first, mem, ratios = row["images_per_s"], row["first_batch_s"], row["memory"], row.get("ratios", {})
    spread = f"{_fmt(ips['min'], ',.0f')}-{_fmt(ips['max'], ',.0f')}"
    return head + [
        _fmt(ips["median"], ",.0f"), spread, _fmt(first["median"], ".2f", "s"),
        f"{mem['peak_main_mib']:.0f}/{mem['peak_workers_total_mib']:.0f}",
        _fmt(ratios.get("vs_limit"), ".2f", "x"), _fmt(ratios.get("vs_imagefolder"), ".1f", "x"),
        _fmt(ratios.get("vs_tensordict"), ".1f", "x"), _fmt(ratios.get("vs_raw_memmap"), ".2f", "x"),
        _fmt(ratios.get("vs_plain_copy"), ".2f", "x"),
    ]


HEADER = ["pipeline", "target", "loader", "format", "workers", "img/s", "min-max", "1st batch",
          "MiB main/workers", "vs limit", "vs folder", "vs tensordict", "vs memmap", "vs plain .to"]


def _grid(rows: List[List[str]], header: List[str]) -> List[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i >= 4 else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


CHANNELS_PARTED_BY = {"native": "the C module", "numpy": "numpy (the C module is not built: ~3x slower)"}


def format_table(results: Dict[str, Any]) -> str:
    """The whole report as text: runs, references, targets on disk, goals, notes."""
    config, env = results["config"], results["environment"]
    lines = [
        f"packed-formats bench: batch {config['batch_size']}, {config['epochs']} epochs, "
        f"{config['warmup']} warm-up batches per epoch excluded, start method {config['start_method']} "
        f"(\"thr\": threads of the main process), "
        f"{COLD if config['cold'] else WARM}, "
        f"{'shuffled' if config['shuffle'] else 'in order'}",
        f"environment: {env['cpus']['usable'] or env['cpus']['logical']} CPUs, torch {env['versions']['torch']}, "
        f"torchvision {env['versions']['torchvision']}, libjpeg-turbo in Pillow: "
        f"{'yes' if env['jpeg']['pillow_libjpeg_turbo'] else 'no'}, channels parted by "
        f"{CHANNELS_PARTED_BY.get(env.get('channels_parted_by', ''), 'an unknown copy')}",
        _device_line(env),
        f"img/s = median over epochs; memory = peak {_memory_metric(results).upper()} of the main process / "
        "sum over worker processes",
    ]
    if any(run.get("limit_beside") for run in results["runs"]):
        lines.append("vs limit (raw) = against the copy-bound limit measured beside each epoch of the run, in a "
                     "process of its own (the fastest way's median over those spans)")
    lines += [""]
    lines += _grid([_run_cells(r) for r in results["runs"]], HEADER)
    lines += ["", "reference points (same run):"]
    for ref in results["references"]:
        to = f"to {ref['decode_size']}px" if ref.get("decode_size") else "alone (the limit of crops at decode)"
        what = (f"copy-bound limit, gather {'x'.join(map(str, ref['shape']))} batches in memory"
                if ref["name"] == "copy-bound" else f"bare decode of {ref.get('source')} {to}")
        line = f"  {what}, {ref['processes']} process(es): {ref['images_per_s']:,.0f} img/s"
        if ref.get("ways"):  # the copy bound: the faster way, and the other's rate
            others = ", ".join(f"{way} {rate:,.0f}" for way, rate in ref["ways"].items() if way != ref["way"])
            line += f" by {ref['way']}" + (f" ({others})" if others else "")
        if ref.get("one_buffer"):  # what the cache gives a gather into one buffer, which no loader can be
            line += f"; into one buffer {ref['one_buffer']:,.0f}"
        lines.append(line)
    lines += ["", "archives:"]
    for t in results["targets"]:
        size = t["size"]
        vs = f" ({size['vs_source']:.2f}x the source folder)" if "vs_source" in size else ""
        layout = "x".join(map(str, t["shape"])) if t["shape"] else t["encoding"]
        if t["shape"] and t.get("raw_layout"):  # what a batch in the loader's layout copies from
            layout += f" stored {t['raw_layout']}"
        lines.append(f"  {t['name']}: {t['format']}/{t['mode']} {layout}, {t['count']} samples, "
                     f"{size['bytes_on_disk'] / 2**20:.1f} MiB on disk in {size['files']} file(s){vs}, "
                     f"file system {t['filesystem']}")
    if results.get("goals"):
        lines += ["", "speed goals (ratios measured in this run):"]
        for g in results["goals"]:
            lines.append(f"  {'ok  ' if g['met'] else 'MISS'} {g['goal']}: {g['target']} {g['pipeline']} "
                         f"{g['workers']} workers {g['ratio']:.2f}x (goal >= {g['at_least']}x)")
    notes = notes_for(results)
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)


def _device_line(env: Dict[str, Any]) -> str:
    gpu = env.get("gpu")
    if not gpu:
        return "device: cpu (transforms run in the loader's workers)"
    return (f"device: {env['device']}, {gpu['name']} ({gpu['memory_gib']} GiB, CUDA {gpu['cuda']}); make_loader pins "
            "batches, copies them on a side stream and transforms on the GPU; 'plain-to-device' rows read the same "
            "batches and copy them with a plain .to()")


def _memory_metric(results: Dict[str, Any]) -> str:
    return next((r["memory"]["metric"] for r in results["runs"] if "memory" in r), "pss")


def notes_for(results: Dict[str, Any]) -> List[str]:
    """Errors, epochs too short for the read-ahead of the workers, and cold-run eviction problems, one line each."""
    notes = []
    for row in results["runs"]:
        tag = f"{row['pipeline']} {row['target']} {row['workers']} workers"
        if row.get("error"):
            notes.append(f"{tag}: {row['error']}")
            continue
        timed = min(e["batches"] - e["warmup_batches"] for e in row["epochs"])
        ahead = 2 * row["workers"]  # DataLoader's default prefetch_factor
        if timed < 2 * ahead:
            notes.append(f"{tag}: only {timed} timed batches per epoch while workers keep {ahead} in flight: "
                         "batches read ahead during warm-up inflate this rate (use more samples or fewer workers)")
        if row.get("cold"):
            note = eviction_note([e["eviction"] for e in row["epochs"] if "eviction" in e])
            if note:
                notes.append(f"{tag}: {note}")
    return notes


# ---- files ------------------------------------------------------------------------------------------

def write_json(results: Dict[str, Any], path: str) -> None:
    """Every measurement as indented JSON (written to a temporary name, then moved into place)."""
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w") as file:
        json.dump(results, file, indent=1, sort_keys=False, default=str)
        file.write("\n")
    os.replace(temp, path)


def plot(results: Dict[str, Any], path: str) -> None:
    """Images/s per target and worker count (log scale), one panel per pipeline; baselines hatched."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    pipelines = list(dict.fromkeys(r["pipeline"] for r in results["runs"]))
    workers = sorted({r["workers"] for r in results["runs"]})
    fig, axes = plt.subplots(len(pipelines), 1, figsize=(12, 4.2 * len(pipelines)), squeeze=False)
    for ax, pipeline in zip(axes[:, 0], pipelines):
        _plot_panel(ax, [r for r in results["runs"] if r["pipeline"] == pipeline], workers, results["references"])
        ax.set_title(f"pipeline: {pipeline}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_panel(ax, runs: List[Dict[str, Any]], workers: List[int], refs: List[Dict[str, Any]]) -> None:
    names = list(dict.fromkeys(r["target"] for r in runs))
    width = 0.8 / max(1, len(names))
    colours = [f"C{i % 10}" for i in range(len(names))]
    for n, name in enumerate(names):
        rows = {r["workers"]: r for r in runs if r["target"] == name}
        baseline = next(iter(rows.values()))["role"] == "baseline"
        xs = [i + (n - (len(names) - 1) / 2) * width for i, w in enumerate(workers) if w in rows]
        ys = [rate(rows[w]) or 0 for w in workers if w in rows]
        ax.bar(xs, ys, width, color=colours[n], hatch="//" if baseline else None, edgecolor="black",
               linewidth=0.6, label=f"{name} (baseline)" if baseline else name)
    for i, w in enumerate(workers):
        for ref in refs:
            if ref["processes"] == (1 if ref["name"] == "copy-bound" else max(1, w)):
                style = "-" if ref["name"] == "copy-bound" else "--"
                ax.hlines(ref["images_per_s"], i - 0.45, i + 0.45, colors="black", linestyles=style, linewidth=1.2)
    ax.plot([], [], "k-", label="copy-bound limit (raw)")
    ax.plot([], [], "k--", label="bare decode rate (encoded)")
    ax.set_xticks(range(len(workers)), [f"{w} workers" for w in workers])
    ax.set_ylabel("images/s (log)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
