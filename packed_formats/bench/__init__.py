"""The benchmark harness: images/s of every archive format against baselines and limits.

``run_benchmark(paths, BenchConfig(...))`` times each archive or ImageFolder
at each worker count and pipeline (see ``measure`` for how timing is done),
adds the torchvision ImageFolder and tensordict-style memmap baselines and the
copy-bound / bare-decode reference points, and returns one dict;
``format_table``, ``write_json`` and ``plot`` turn it into a report.
"""

from typing import Any

__all__ = ["BenchConfig", "format_table", "plot", "run_benchmark", "write_json"]

PIPELINES = ("none", "val", "train")  # here, not in .loaders, so that the command line can offer them without torch
LOADERS = ("auto", "make_loader", "dataset")

# Loaded on first use: the runner imports torch, and ``bench.scale``'s probes (fresh processes that
# import this package first) measure writers, which must be measured without it.
_LAZY = {"BenchConfig": ".runner", "run_benchmark": ".runner",
         "format_table": ".report", "plot": ".report", "write_json": ".report"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
