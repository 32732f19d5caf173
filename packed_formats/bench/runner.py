"""Runs the benchmark: every target x pipeline x worker count, the baselines and the reference points."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..archives import open_archive
from ..backends import detect_format
from ..errors import PackedFormatError
from . import environment, loaders, measure, references
from .tensordict_memmap import tutorial_loader

START_METHODS = ("fork", "spawn", "forkserver")
BESIDE_SECONDS = 0.15  # the shortest span of the copy-bound limit beside an epoch (each way a third of it)


@dataclasses.dataclass
class BenchConfig:
    """What to run.  See ``packed-formats bench --help`` for the meaning of each field."""

    workers: Sequence[int] = (0, 1, 2, 4)
    batch_size: int = 64
    epochs: int = 3
    warmup: int = 2
    max_batches: Optional[int] = None
    pipelines: Sequence[str] = ("none",)
    size: int = 224
    start_method: Optional[str] = None  # None: the platform's default
    cold: bool = False
    shuffle: bool = True
    loader: str = "auto"
    references: bool = True
    tensordict_baseline: bool = True
    decode_size: Optional[int] = None  # None: round(size * 256 / 224), the usual resize before a crop
    source: Optional[str] = None
    reference_seconds: float = 1.0
    device: str = "cpu"  # "cuda": make_loader copies to the GPU and transforms there
    layout: str = "channels-last"  # of make_loader's untransformed batches: "channels-last" or "nchw"

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def decode_to(self) -> int:
        """The square size encoded archives are decoded to by make_loader (and by the decode reference)."""
        return int(self.decode_size or round(self.size * 256 / 224))

    def check(self) -> None:
        """ValueError naming the first bad setting."""
        if not self.workers or any(int(w) < 0 for w in self.workers):
            raise ValueError("workers must be a non-empty list of counts >= 0")
        for name in ("batch_size", "epochs", "size", "decode_size"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.warmup < 0 or (self.max_batches is not None and self.max_batches <= self.warmup):
            raise ValueError("warmup must be >= 0 and max-batches larger than warmup")
        bad = [p for p in self.pipelines if p not in loaders.PIPELINES]
        if bad or not self.pipelines:
            raise ValueError(f"pipeline must be one of {', '.join(loaders.PIPELINES)}, got {bad or 'nothing'}")
        if self.start_method is not None and self.start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start method {self.start_method!r} is not available here; "
                             f"choose one of {', '.join(multiprocessing.get_all_start_methods())}")
        if self.loader not in loaders.LOADERS:
            raise ValueError(f"loader must be one of {', '.join(loaders.LOADERS)}")
        if self.layout not in ("channels-last", "nchw"):
            raise ValueError(f"layout must be channels-last or nchw, got {self.layout!r}")
        if self.device != "cpu" and not self.on_cuda:
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.on_cuda:
            from ..loading.loader import resolve_device

            resolve_device(self.device)  # ValueError when there is no GPU


def describe_target(path: str, source_bytes: Optional[int]) -> Dict[str, Any]:
    """Format, layout, size on disk and file system of one archive or ImageFolder."""
    path = os.fspath(path)
    fmt = detect_format(path)
    with open_archive(path, verify=False) as reader:
        manifest = reader.manifest
    size: Dict[str, float] = dict(environment.size_on_disk(path))
    if source_bytes and fmt != "folder":
        size["source_bytes"] = source_bytes
        size["vs_source"] = size["bytes_on_disk"] / source_bytes
    return {
        "name": _short_name(path),
        "path": os.path.abspath(path),
        "format": fmt,
        "mode": manifest.mode,
        "shape": list(manifest.shape) if manifest.shape else None,
        "raw_layout": manifest.raw_layout if manifest.mode == "raw" else None,  # how its pixels are stored
        "encoding": manifest.encoding,
        "count": manifest.count,
        "classes": len(manifest.classes),
        "size": size,
        "filesystem": environment.filesystem_type(path),
    }


def _short_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or path


DEVICE_DECODE = "make_loader-decode-on-device"  # make_loader(decode="device"): encoded targets on CUDA


def _loader_name(target: Dict[str, Any], config: BenchConfig) -> str:
    if target["format"] == "folder":
        return "torchvision-imagefolder"
    if config.loader == "auto":
        return "make_loader" if loaders.fast_path() is not None else "dataset"
    return config.loader


def build_loader(target: Dict[str, Any], loader: str, pipeline: str, workers: int, config: BenchConfig):
    """The DataLoader-like iterable for one measurement."""
    common = (pipeline, config.size, config.batch_size, workers, config.shuffle, config.start_method)
    if loader == "torchvision-imagefolder":
        built = loaders.imagefolder_loader(target["path"], *common)
    elif loader == "tensordict-memmap":
        return tutorial_loader(target["path"], pipeline, config.size, config.batch_size, workers,
                               config.shuffle, config.start_method, device=config.device)
    elif loader in ("make_loader", DEVICE_DECODE):
        decode = "device" if loader == DEVICE_DECODE else "workers"
        return loaders.make_loader_loader(target["path"], target["mode"], *common, decode_size=config.decode_to,
                                          device=config.device, decode=decode, layout=config.layout)
    elif loader == "plain-to-device":
        return loaders.PlainCopyLoader(target["path"], target["mode"], *common, decode_size=config.decode_to,
                                       device=config.device)
    else:
        built = loaders.dataset_loader(target["path"], target["mode"], *common)
    return loaders.ToDevice(built, config.device) if config.on_cuda else built


def measure_one(target: Dict[str, Any], loader: str, pipeline: str, workers: int, config: BenchConfig,
                role: str = "target", bound: Optional[references.BoundBeside] = None) -> Dict[str, Any]:
    """Time one (target, loader, pipeline, workers) combination; an error is recorded, not raised.

    ``bound``: the copy-bound limit of a raw target, measured beside each epoch (as long as the epoch was
    timed, each way a third of it) and kept as the run's ``limit_beside``, the limit its ratio is taken to.
    """
    row: Dict[str, Any] = {
        "target": target["name"] if role == "target" else f"{loader} ({target['name']})",
        "path": target["path"], "role": role, "loader": loader, "format": target["format"],
        "mode": target["mode"], "shape": target["shape"], "raw_layout": target.get("raw_layout"),
        "pipeline": pipeline, "workers": workers,
        "batch_size": config.batch_size, "start_method": config.start_method or multiprocessing.get_start_method(),
        "cold": config.cold, "error": None,
    }
    try:
        with loaders.default_start_method(config.start_method if workers else None):
            row.update(measure.time_loader(lambda: build_loader(target, loader, pipeline, workers, config),
                                           config.epochs, config.warmup, config.max_batches,
                                           cold_path=target["path"] if config.cold else None,
                                           warm_path=None if config.cold else target["path"], beside=bound))
    except (PackedFormatError, RuntimeError, ValueError, OSError, TypeError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    if bound is not None and not row["error"]:
        spans = [epoch["beside"] for epoch in row["epochs"]]
        way, images_per_s = references.fastest({way: [span[way] for span in spans] for way in spans[0]})
        row["limit_beside"] = {"name": "copy-bound", "processes": 1, "way": way, "images_per_s": images_per_s,
                               "spans": len(spans)}
    return row


def measure_references(targets: List[Dict[str, Any]], config: BenchConfig, log: Callable[[str], None]) -> List[Dict]:
    """Copy-bound limits (one per raw shape) and bare decode rates (per encoded content and process count)."""
    out: List[Dict[str, Any]] = []
    seen: Set[Tuple[Any, ...]] = set()  # ("copy", shape, count) and (decode fingerprint, processes, size)
    processes = sorted({max(1, int(w)) for w in config.workers})
    for target in targets:
        if target["mode"] == "raw":
            key = ("copy", tuple(target["shape"]), target["count"])
            if key not in seen:
                seen.add(key)
                log(f"reference: copy-bound limit for {target['shape']}")
                ref = references.copy_bound_rate(target["shape"], target["count"], config.batch_size,
                                                 config.reference_seconds)
                out.append(dict(ref, key=f"copy:{'x'.join(map(str, target['shape']))}:{target['count']}"))
            continue
        with open_archive(target["path"], verify=False) as reader:
            blobs, fingerprint = references.decode_sample(reader)
        target["decode_key"] = f"decode:{fingerprint}"
        sizes: List[Optional[int]] = [config.decode_to]
        if not config.on_cuda and any(p != "none" for p in config.pipelines):
            # train/val crop at decode: their limit is the decode alone, the resize is only the crop's
            target["decode_only_key"] = f"decode-only:{fingerprint}"
            sizes.append(None)
        for p in processes:
            for size in sizes:
                if (fingerprint, p, size) in seen:
                    continue
                seen.add((fingerprint, p, size))
                what = f"to {size}x{size}" if size else "alone"
                log(f"reference: bare decode ({what}) of {target['name']} in {p} process(es)")
                ref = references.bare_decode_rate(blobs, p, config.start_method or multiprocessing.get_start_method(),
                                                  config.reference_seconds, size=size)
                key = target["decode_key"] if size else target["decode_only_key"]
                out.append(dict(ref, key=key, source=target["name"]))
    return out


def _source_bytes(paths: Sequence[str], config: BenchConfig) -> Optional[int]:
    source = config.source
    if source is None:
        folders = [p for p in paths if os.path.isdir(p) and detect_format(p) == "folder"]
        source = folders[0] if len(folders) == 1 else None
    return environment.size_on_disk(source)["bytes_on_disk"] if source else None


def run_benchmark(paths: Sequence[str], config: Optional[BenchConfig] = None,
                  log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Dict[str, Any]:
    """Benchmark every archive or ImageFolder in ``paths``; return every measurement as a dict.

    Raises PackedFormatError for a path that is not an archive or ImageFolder,
    ValueError for a bad setting.
    """
    config = config or BenchConfig()
    config.check()
    source_bytes = _source_bytes(paths, config)
    targets = [describe_target(p, source_bytes) for p in paths]
    results: Dict[str, Any] = {
        "schema": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": dataclasses.asdict(config),
        "environment": dict(environment.describe_environment(config.device),
                            filesystems={t["name"]: t["filesystem"] for t in targets}),
        "timing": measure.__doc__.strip().split("\n\n")[1].replace("\n", " "),
        "targets": targets,
        "runs": [],
        "references": [],
    }
    results["config"]["start_method"] = config.start_method or multiprocessing.get_start_method()
    results["config"]["decode_size"] = config.decode_to
    with _Bounds(config) as bounds:
        _measure_runs(results["runs"], targets, config, bounds, log)
    if config.references:
        results["references"] = measure_references(targets, config, log)
    from .report import add_ratios

    add_ratios(results)
    return results


class _Bounds:
    """The copy-bound limit of each raw target's shape, made when first asked for (one at a time: its
    data is up to ``COPY_MEMORY_CAP`` of memory), measured beside each epoch of the target's runs; None
    without references."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._key: Optional[Tuple[Tuple[int, ...], int]] = None
        self._bound: Optional[references.BoundBeside] = None

    def of(self, target: Dict[str, Any]) -> Optional[references.BoundBeside]:
        if not self.config.references or target["mode"] != "raw" or not target["shape"]:
            return None
        key = (tuple(target["shape"]), target["count"])
        if key != self._key:
            self.close()
            self._key, self._bound = key, references.BoundBeside(
                target["shape"], target["count"], self.config.batch_size, self.config.warmup, BESIDE_SECONDS,
                max(BESIDE_SECONDS, self.config.reference_seconds))
        return self._bound

    def __enter__(self) -> "_Bounds":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._bound is not None:
            self._bound.close()
        self._key, self._bound = None, None


def _measure_runs(runs: List[Dict[str, Any]], targets: List[Dict[str, Any]], config: BenchConfig, bounds: _Bounds,
                  log: Callable[[str], None]) -> None:
    """Every run of the benchmark, appended to ``runs``."""
    for pipeline in config.pipelines:
        for target in targets:
            loader = _loader_name(target, config)
            role = "baseline" if loader == "torchvision-imagefolder" else "target"
            for workers in config.workers:
                log(f"{pipeline:5} {target['name']} via {loader}, {workers} workers")
                runs.append(measure_one(target, loader, pipeline, int(workers), config, role, bounds.of(target)))
            if config.on_cuda and loader == "make_loader" and target["mode"] == "encoded":
                for workers in config.workers:
                    log(f"{pipeline:5} {target['name']} decoded on {config.device}, {workers} workers")
                    runs.append(measure_one(target, DEVICE_DECODE, pipeline, int(workers), config))
            if config.on_cuda and loader == "make_loader":
                for workers in config.workers:
                    log(f"{pipeline:5} {target['name']} via a plain .to({config.device}), {workers} workers")
                    runs.append(measure_one(target, "plain-to-device", pipeline, int(workers), config, "baseline",
                                            bounds.of(target)))
            if config.tensordict_baseline and target["format"] == "memmap" and target["mode"] == "raw":
                # the tutorial moves batches to the GPU in its collate_fn: in the main process only
                for workers in [w for w in config.workers if not (config.on_cuda and int(w))]:
                    log(f"{pipeline:5} tensordict-memmap loader on {target['name']}, {workers} workers")
                    runs.append(measure_one(target, "tensordict-memmap", pipeline, int(workers), config, "baseline",
                                            bounds.of(target)))
