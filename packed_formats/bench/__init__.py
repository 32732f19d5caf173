"""The benchmark harness: images/s of every archive format against baselines and limits.

``run_benchmark(paths, BenchConfig(...))`` times each archive or ImageFolder
at each worker count and pipeline (see ``measure`` for how timing is done),
adds the torchvision ImageFolder and tensordict-style memmap baselines and the
copy-bound / bare-decode reference points, and returns one dict;
``format_table``, ``write_json`` and ``plot`` turn it into a report.
"""

from .report import format_table, plot, write_json
from .runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "format_table", "plot", "run_benchmark", "write_json"]
