"""``packed-formats bench --scale N``: the costs that grow with the number of samples.

For each format, N tiny raw samples (4x4x3 uint8, so that per-sample costs and
not pixel bytes dominate) are written with the library's own Writer, and every
measurement then runs in a fresh child process of its own, so that one
format's memory never pollutes another's.  The columns:

- write s / write MiB: seconds to write and seal the archive (spot check and
  publication included), and the writer process's peak RSS (VmHWM) over the
  write; ``peak_growth_bytes`` in the JSON is that peak less the RSS the
  process had before writing (interpreter and imports).
- open s / open +MiB: seconds for ``open_archive`` plus the first read (which
  opens the per-process handle), and how much RSS that adds to the process.
  The JSON splits the time and gives the anonymous (heap) and file-backed
  parts of the growth and the peak during opening.
- index MiB: the bytes of the archive's index arrays (labels, keys, checksums,
  offsets, positions), for reference: what a process holds or maps per
  archive.  For a sharded set, the joined index of the whole set.
- 1st batch s: seconds from building the loader to holding its first batch, in
  a fresh process (opening, worker start-up and their imports included), for
  ``dataset`` (a plain torch DataLoader over PackedDataset) and ``make_loader``,
  with W workers, per start method.
- above the table, for reference: how long torch's own ``RandomSampler`` takes
  to give its first index of N.  Every map-style dataset under
  ``DataLoader(shuffle=True)`` pays it before its first batch, so it is the
  floor of the DL columns; ``make_loader`` draws its order without it.
- worker MiB: private memory (Private_Dirty of /proc/PID/smaps_rollup: the
  pages that are this process's own copy) of the most expensive DataLoader
  worker after a few batches, same loaders and start methods: what each extra
  worker costs.  Pages of a mapped index that only one worker has read count
  as Private_Clean, not here: they are the page cache's, shared by every
  process that maps the file, not a copy.
- fds main/worker: the peak number of open file descriptors (/proc/PID/fd) of
  the measuring process and of its busiest worker, sampled after every batch
  of a full shuffled epoch through ``make_loader`` (first start method).  With
  ``--shards P`` the archive is a sharded set of P parts; with ``--classes K``
  the samples are labelled with K classes (10 by default), whose names every
  manifest lists (every part's, in a sharded set).

Only the public API is used (``open_writer``, ``ShardedWriter``,
``open_archive``, ``PackedDataset``, ``make_loader``), so the tool measures the
backends as they are.  Linux only (/proc).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

SHAPE = (4, 4, 3)
CLASSES = 10  # classes of the samples written, by default (``--classes K``)
LOADERS = ("dataset", "make_loader")
RESULT_MARK = "packed-formats-scale-result "
MIB = 2**20


@dataclasses.dataclass
class ScaleConfig:
    """What ``run_scale`` measures; see ``packed-formats bench --help``."""

    count: int
    formats: Sequence[str] = ()  # empty: every packed format
    workers: int = 2
    batch_size: int = 64
    start_methods: Sequence[str] = ("fork", "spawn")
    shards: Optional[int] = None
    classes: int = CLASSES
    directory: Optional[str] = None  # where to write; None: a temporary directory
    keep: bool = False
    few_batches: int = 4  # batches read before worker memory is measured
    shape: Tuple[int, int, int] = SHAPE
    probe_timeout: float = 3600.0

    def check(self) -> None:
        """ValueError naming the first bad setting."""
        from ..backends import PACKED_FORMATS

        if self.count < 1:
            raise ValueError("--scale needs at least 1 sample")
        bad = [f for f in self.formats if f not in PACKED_FORMATS]
        if bad:
            raise ValueError(f"cannot write format {bad[0]!r}; choose from {', '.join(PACKED_FORMATS)}")
        if self.workers < 1:
            raise ValueError("--scale measures DataLoader workers: give --workers of at least 1")
        if self.batch_size < 1:
            raise ValueError("batch-size must be at least 1")
        if self.classes < 1:
            raise ValueError("--classes must be at least 1")
        if self.shards is not None and not 1 <= self.shards <= self.count:
            raise ValueError(f"--shards must be between 1 and the number of samples ({self.count})")
        if self.directory is not None and not os.path.isdir(self.directory):
            raise ValueError(f"--dir {self.directory}: no such directory")

    def chosen_formats(self) -> List[str]:
        from ..backends import PACKED_FORMATS

        return list(self.formats or PACKED_FORMATS)


# ---- the parent: one child process per measurement ----------------------------------------------
def run_scale(config: ScaleConfig, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
              ) -> Dict[str, Any]:
    """Measure every format of ``config``; return the results as one dict (see the module docstring)."""
    config.check()
    from .environment import describe_environment

    results: Dict[str, Any] = {
        "schema": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": dataclasses.asdict(config),
        "environment": describe_environment(),
        "rows": [],
        "errors": [],
    }
    log("torch's RandomSampler: first index")
    results["sampler"] = _measured(results, "sampler", "sampler", {"count": config.count}, config)
    root = tempfile.mkdtemp(prefix="pf-scale-", dir=config.directory)
    try:
        for fmt in config.chosen_formats():
            results["rows"].append(measure_format(fmt, os.path.join(root, fmt), config, log))
    finally:
        if config.keep:
            results["directory"] = root
        else:
            shutil.rmtree(root, ignore_errors=True)
    return results


def measure_format(fmt: str, directory: str, config: ScaleConfig, log: Callable[[str], None]) -> Dict[str, Any]:
    """Write one archive, then measure opening and loading it; a failed probe is recorded, not raised."""
    from ..backends import spec

    os.makedirs(directory)
    path = os.path.join(directory, f"scale-{config.count}{spec(fmt).extensions[0]}")
    row: Dict[str, Any] = {"format": fmt, "count": config.count, "parts": config.shards or 1, "path": path,
                           "errors": [], "loaders": {name: {} for name in LOADERS}}
    log(f"{fmt}: writing {config.count} samples" + (f" in {config.shards} parts" if config.shards else ""))
    row["write"] = _measured(row, "write", "write", {"format": fmt, "path": path, "count": config.count,
                                                     "shape": list(config.shape), "shards": config.shards,
                                                     "classes": config.classes}, config)
    if row["write"] is None:
        return row
    log(f"{fmt}: opening")
    row["open"] = _measured(row, "open", "open", {"path": path}, config)
    row["index_bytes"] = (row["open"] or {}).get("index_bytes")
    for loader in LOADERS:
        for method in config.start_methods:
            full_read = loader == "make_loader" and method == config.start_methods[0]
            log(f"{fmt}: {loader}, {config.workers} workers, {method}" + (", full epoch" if full_read else ""))
            probe = {"path": path, "loader": loader, "start_method": method, "workers": config.workers,
                     "batch_size": config.batch_size, "few_batches": config.few_batches, "full_read": full_read}
            measured = _measured(row, f"{loader}/{method}", "loader", probe, config)
            if measured is not None and full_read:
                row["full_read"] = measured.pop("full_read")
            row["loaders"][loader][method] = measured
    if not config.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return row


def _measured(row: Dict[str, Any], what: str, kind: str, args: Dict[str, Any], config: ScaleConfig
              ) -> Optional[Dict[str, Any]]:
    """The result of one probe, or None with the error (named ``what``) added to the row."""
    try:
        return run_probe(kind, args, config.probe_timeout)
    except ProbeFailed as exc:
        row["errors"].append(f"{what}: {exc}")
        row.setdefault("error_output", {})[what] = exc.output
        return None


class ProbeFailed(RuntimeError):
    """A probe process that failed: the message is its last line of output, ``output`` the tail of it."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


def run_probe(kind: str, args: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Run one probe in a fresh Python process and return what it measured (ProbeFailed if it failed)."""
    command = [sys.executable, "-m", __name__, kind, json.dumps(args)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"took more than {timeout:.0f} s") from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK) and done.returncode == 0:
            return json.loads(line[len(RESULT_MARK):])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise ProbeFailed(f"exit status {done.returncode}: {last}", done.stderr[-4000:])


# ---- what /proc says about a process ------------------------------------------------------------------
def status_bytes(field: str, pid: "int | str" = "self") -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile) in bytes."""
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no {field}")


def peak_rss(*seen: int) -> int:
    """This process's peak RSS since ``reset_peak``: VmHWM, but never less than an RSS read since (the
    kernel folds RSS into VmHWM lazily, so a VmHWM read can trail an earlier VmRSS by a few pages)."""
    return max([status_bytes("VmHWM"), status_bytes("VmRSS"), *seen])


def reset_peak() -> bool:
    """Restart this process's VmHWM at its current RSS, so a peak measures what follows (False if refused)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def private_bytes(pid: int) -> Optional[int]:
    """Private_Dirty of a process (smaps_rollup): its own copies, not file pages only it has read.
    None if unreadable."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                if line.startswith("Private_Dirty:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return None
    return total


def open_fds(pid: int) -> Optional[int]:
    """How many file descriptors a process has open, or None if it has gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _children() -> Dict[int, List[int]]:
    """Parent pid -> child pids, from every /proc/PID/stat."""
    tree: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as file:
                stat = file.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
        tree.setdefault(ppid, []).append(int(name))
    return tree


def worker_pids(root: int) -> List[int]:
    """The DataLoader workers below process ``root``: its descendants that have no children of their
    own (that leaves out a forkserver) and are not multiprocessing's resource tracker."""
    tree = _children()
    found, stack = [], list(tree.get(root, []))
    while stack:
        pid = stack.pop()
        stack += tree.get(pid, [])
        if pid not in tree and "resource_tracker" not in _cmdline(pid):
            found.append(pid)
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---- the probes, each run in a child process of its own ----------------------------------------------
def synthetic_samples(count: int, shape: Sequence[int], chunk: int = 8192) -> Iterator[np.ndarray]:
    """``count`` random uint8 images, drawn a chunk at a time so that the generator costs no memory."""
    rng = np.random.default_rng(0)
    for start in range(0, count, chunk):
        yield from rng.integers(0, 256, size=(min(chunk, count - start), *shape), dtype=np.uint8)


def class_names(count: int) -> Tuple[str, ...]:
    """The names of ``count`` classes: class0, class1..."""
    return tuple(f"class{k}" for k in range(count))


def open_output(fmt: str, path: str, count: int, shape: Sequence[int], shards: Optional[int],
                classes: Sequence[str] = class_names(CLASSES)):
    """The library's writer for a raw archive (a sharded set of ``shards`` parts when given)."""
    from ..backends import open_writer
    from ..backends.sharded import ShardedWriter

    options: Dict[str, Any] = {"mode": "raw", "shape": tuple(shape), "classes": tuple(classes)}
    if shards:
        return ShardedWriter(path, fmt, shard_size=math.ceil(count / shards), **options)
    return open_writer(path, fmt, **options)


def probe_write(args: Dict[str, Any]) -> Dict[str, Any]:
    """Write ``count`` samples; the time and the writer's peak RSS."""
    count = args["count"]
    reset = reset_peak()  # first: the peak is then at least every RSS after it, the baseline included
    baseline = status_bytes("VmRSS")
    started = time.perf_counter()
    names = class_names(args.get("classes", CLASSES))
    with open_output(args["format"], args["path"], count, args["shape"], args["shards"], names) as writer:
        for i, image in enumerate(synthetic_samples(count, args["shape"])):
            label = i % len(names)
            writer.add(image, label, f"{names[label]}/img_{i:08d}.png")
    seconds = time.perf_counter() - started
    peak = peak_rss(baseline)
    return {"seconds": seconds, "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
            "peak_growth_bytes": peak - baseline if reset else None}


def probe_open(args: Dict[str, Any]) -> Dict[str, Any]:
    """Open the archive and read one sample; the time, the memory it adds and the index's size."""
    from ..archives import open_archive

    reset = reset_peak()
    before = {field: status_bytes(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    started = time.perf_counter()
    reader = open_archive(args["path"])
    opened = time.perf_counter()
    reader.read(0)
    read = time.perf_counter()
    after = {field: status_bytes(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    result = {
        "open_s": opened - started, "first_read_s": read - opened, "seconds": read - started,
        "rss_growth_bytes": after["VmRSS"] - before["VmRSS"], "anon_growth_bytes": after["RssAnon"] - before["RssAnon"],
        "file_growth_bytes": after["RssFile"] - before["RssFile"],
        "peak_growth_bytes": peak_rss(before["VmRSS"], after["VmRSS"]) - before["VmRSS"] if reset else None,
        "index_bytes": sum(int(a.nbytes) for a in reader.index.arrays().values()),
        "count": len(reader), "files": len(reader.files()),
    }
    reader.close()
    return result


def build_loader(args: Dict[str, Any]):
    """A plain DataLoader over PackedDataset, or make_loader, as the probe asks."""
    import torch

    from .. import PackedDataset, make_loader

    common = {"batch_size": args["batch_size"], "num_workers": args["workers"], "shuffle": True,
              "multiprocessing_context": args["start_method"]}
    if args["loader"] == "make_loader":
        return make_loader(args["path"], **common)
    return torch.utils.data.DataLoader(PackedDataset(args["path"], output="tensor"), **common)


def probe_sampler(args: Dict[str, Any]) -> Dict[str, Any]:
    """Seconds for torch's own RandomSampler to give the first index of ``count``: every map-style
    dataset under ``DataLoader(shuffle=True)`` pays it before its first batch (it draws the whole
    permutation and makes it a Python list), so it is the floor of the DL columns."""
    import torch

    started = time.perf_counter()
    next(iter(torch.utils.data.RandomSampler(range(args["count"]))))
    return {"seconds": time.perf_counter() - started}


def probe_loader(args: Dict[str, Any]) -> Dict[str, Any]:
    """Time to the first batch, the workers' private memory after a few, and optionally a full epoch."""
    from .. import PackedDataset, make_loader  # noqa: F401 - imported before the clock starts, as in a training script

    started = time.perf_counter()
    loader = build_loader(args)
    batches = iter(loader)
    seen = len(next(batches)[1])
    first_batch_s = time.perf_counter() - started
    for _ in range(min(args["few_batches"], len(loader)) - 1):
        seen += len(next(batches)[1])
    workers = worker_pids(os.getpid())
    result: Dict[str, Any] = {
        "first_batch_s": first_batch_s,
        "worker_private_bytes": [private_bytes(pid) for pid in workers],
        "main_private_bytes": private_bytes(os.getpid()),
    }
    if args["full_read"]:
        result["full_read"] = read_to_the_end(batches, seen, workers, started)
    del batches
    return result


def read_to_the_end(batches: Iterator, seen: int, workers: List[int], started: float) -> Dict[str, Any]:
    """Read the rest of the epoch, counting the open descriptors of this process and its workers after
    every batch; peaks per process, samples delivered and seconds since ``started``."""
    me = os.getpid()
    peaks = {pid: 0 for pid in [me] + workers}

    def sample() -> None:
        for pid in peaks:
            peaks[pid] = max(peaks[pid], open_fds(pid) or 0)

    sample()
    for batch in batches:
        seen += len(batch[1])
        sample()
    return {"samples": seen, "epoch_s": time.perf_counter() - started,
            "peak_fds_main": peaks.pop(me), "peak_fds_workers": list(peaks.values())}


PROBES: Dict[str, Callable[[Dict[str, Any]], Dict[str, Any]]] = {
    "write": probe_write, "open": probe_open, "loader": probe_loader, "sampler": probe_sampler,
}


# ---- the report ------------------------------------------------------------------------------------------
def _num(value: Optional[float], scale: float = 1.0) -> str:
    """A number to three significant digits (no exponent), or '-' when not measured."""
    if value is None:
        return "-"
    value /= scale
    digits = max(0, 2 - int(math.floor(math.log10(abs(value))))) if value else 1
    return f"{value:,.{min(digits, 3)}f}"


def _loader_cells(row: Dict[str, Any], methods: Sequence[str]) -> Tuple[List[str], List[str]]:
    """First-batch seconds and the largest worker's private MiB, per loader and start method."""
    firsts, memory = [], []
    for loader in LOADERS:
        for method in methods:
            measured = row["loaders"][loader].get(method) or {}
            firsts.append(_num(measured.get("first_batch_s")))
            sizes = [b for b in measured.get("worker_private_bytes", []) if b is not None]
            memory.append(_num(max(sizes), MIB) if sizes else "-")
    return firsts, memory


def _row_cells(row: Dict[str, Any], methods: Sequence[str]) -> List[str]:
    write, opened, full = row.get("write") or {}, row.get("open") or {}, row.get("full_read") or {}
    firsts, memory = _loader_cells(row, methods)
    workers = full.get("peak_fds_workers") or []
    fds = f"{full['peak_fds_main']}/{max(workers) if workers else '-'}" if full else "-"
    return [row["format"], f"{row['count']:,}", str(row["parts"]), _num(write.get("seconds")),
            _num(write.get("peak_rss_bytes"), MIB), _num(write.get("peak_growth_bytes"), MIB),
            _num(opened.get("seconds")), _num(opened.get("rss_growth_bytes"), MIB), _num(row.get("index_bytes"), MIB),
            *firsts, *memory, fds]


def _header(methods: Sequence[str]) -> List[Tuple[str, str]]:
    """(group, column) of every column of the table."""
    kinds = [f"{'DL' if loader == 'dataset' else 'ML'}/{method}" for loader in LOADERS for method in methods]
    return ([("", "format"), ("", "samples"), ("", "parts"), ("write", "s"), ("write", "MiB"), ("write", "+MiB"),
             ("open", "s"), ("open", "+MiB"), ("index", "MiB")]
            + [("first batch s", k) for k in kinds] + [("worker private MiB", k) for k in kinds]
            + [("fds", "main/worker")])


def _grid(header: List[Tuple[str, str]], rows: List[List[str]]) -> List[str]:
    """Columns padded to their widest cell (the first left-aligned), under a line of group names."""
    widths = [max(len(cell) for cell in column) for column in zip([name for _, name in header], *rows)]
    groups: List[Tuple[str, List[int]]] = []
    for k, (group, _) in enumerate(header):
        if groups and groups[-1][0] == group:
            groups[-1][1].append(k)
        else:
            groups.append((group, [k]))
    for group, columns in groups:  # a group name wider than its columns widens the last one
        span = sum(widths[k] for k in columns) + 2 * (len(columns) - 1)
        widths[columns[-1]] += max(0, len(group) - span)

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))

    top = "  ".join(group.ljust(sum(widths[k] for k in columns) + 2 * (len(columns) - 1)) for group, columns in groups)
    return [top.rstrip(), line([name for _, name in header]), line(["-" * w for w in widths])] + [line(r) for r in rows]


def format_scale_table(results: Dict[str, Any]) -> str:
    """One row per format, the columns the module docstring describes, and any errors below."""
    config = results["config"]
    methods = list(config["start_methods"])
    lines = [
        f"packed-formats bench --scale {config['count']:,}: raw {'x'.join(map(str, config['shape']))} uint8 samples, "
        f"{config['workers']} DataLoader worker{'s' if config['workers'] != 1 else ''}, batch {config['batch_size']}",
        "DL: DataLoader over PackedDataset; ML: make_loader; write MiB: peak RSS, +MiB: above the RSS before "
        "writing; worker MiB: the largest worker's private memory; fds: peak during a full make_loader epoch",
        "",
    ]
    sampler = results.get("sampler")
    if sampler:
        lines[-1:-1] = [f"torch's RandomSampler alone takes {_num(sampler['seconds'])} s to give its first index "
                        f"of {config['count']:,}: every DataLoader(shuffle=True) pays it before its first batch"]
    lines += _grid(_header(methods), [_row_cells(row, methods) for row in results["rows"]])
    errors = [f"  {error}" for error in results.get("errors", [])]
    errors += [f"  {row['format']}: {error}" for row in results["rows"] for error in row["errors"]]
    if errors:
        lines += ["", "errors:"] + errors
    if results.get("directory"):
        lines += ["", f"archives kept in {results['directory']}"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Child-process entry point: ``python -m packed_formats.bench.scale PROBE JSON_ARGS``."""
    kind, args = (argv if argv is not None else sys.argv[1:])[:2]
    result = PROBES[kind](json.loads(args))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
