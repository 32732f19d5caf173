"""The Slurm examples in tools/slurm keep working with the library's API."""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "tools", "slurm")


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(EXAMPLES, "*.sbatch"))), ids=os.path.basename)
def test_batch_scripts_are_valid_bash(script):
    run = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_training_example_stages_and_trains_on_the_cpu(archives, tmp_path, mode):
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(EXAMPLES, "train_example.py"),
            archives[("zip", mode)],
            "--stage-to",
            str(tmp_path),
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--size",
            "16",
            "--workers",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert run.returncode == 0, run.stderr
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    name = os.path.basename(archives[("zip", mode)])
    # the copy, its lock and its verification stamp; no temp files
    assert sorted(os.listdir(tmp_path)) == sorted([name, f".{name}.pf-stage.lock", f".{name}.pf-staged"])
