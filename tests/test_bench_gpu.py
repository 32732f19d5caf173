"""tools/bench_gpu.sh runs on the CPU in quick mode and writes every cell of its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from packed_formats.bench.gpu import cell_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_benchmark_writes_every_cell_in_quick_cpu_mode(tmp_path):
    command = [os.path.join(ROOT, "tools", "bench_gpu.sh"), str(tmp_path / "out"), "--cpu", "--quick",
               "--images", "16", "--batch-size", "8", "--workers", "1"]
    done = subprocess.run(command, env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "out" / "gpu.json") as file:
        results = json.load(file)
    assert list(results["cells"]) == cell_names(1)
    for name, cell in results["cells"].items():
        assert "error" not in cell, (name, cell["error"])
        assert cell["images_per_s"]["median"] > 0 and cell["images_per_s"]["n"] == 3, name
    assert results["config"]["device"] == "cpu" and results["config"]["batch_size"] == 8
    assert os.path.isdir(tmp_path / "out" / "data" / "photos")
