"""The Slurm examples in tools/slurm keep working with the library's API."""

from __future__ import annotations

import glob
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "tools", "slurm")


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(EXAMPLES, "*.sbatch"))), ids=os.path.basename)
def test_batch_scripts_are_valid_bash(script):
    run = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.slow
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


# ---- checkpoint on SIGUSR1, requeue, resume ---------------------------------------------------------------
TRAIN_OPTIONS = ["--epochs", "2", "--batch-size", "4", "--size", "16", "--workers", "0"]


def fake_slurm(tmp_path, job_id: str = "4242") -> dict:
    """An environment whose `scontrol` (and `srun`, `torchrun`, `packed-formats`, `python`) are stand-ins:
    scontrol logs its arguments, the launchers run their command in this process."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    skip_options = 'while [ "${1#-}" != "$1" ]; do shift; done\n'
    scripts = {
        "scontrol": '[ "$1" = show ] && { echo localhost; exit 0; }\necho "$@" >> "$SCONTROL_LOG"\n',
        "srun": skip_options + 'exec "$@"\n',
        "torchrun": skip_options + 'exec python "$@"\n',
        "packed-formats": '[ "$1" = stage ] && echo "$2"\nexit 0\n',
        "python": f'exec "{sys.executable}" "$@"\n',
    }
    for name, body in scripts.items():
        (stubs / name).write_text("#!/bin/bash\n" + body)
        (stubs / name).chmod(0o755)
    return {
        **os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        "SLURM_JOB_ID": job_id, "SLURM_SUBMIT_DIR": ROOT, "SLURM_TMPDIR": str(tmp_path), "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_GPUS_ON_NODE": "1", "USER": "tester", "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }


def signal_when_ready(command: list, env: dict, send, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``command``; once training says SIGUSR1 would save, call ``send(process)``; return its outcome."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "SIGUSR1 saves" in line:
                send(process)
                break
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(command, process.returncode, "".join(lines) + out, err)


def saved_at(stdout: str):
    """(epoch, batches done) of the checkpoint a run says it saved on the stop request."""
    found = re.search(r"saved \S+: epoch (\d+), (\d+) batches done", stdout)
    assert found, stdout
    return int(found.group(1)), int(found.group(2))


def epochs_trained(stdout: str) -> list:
    return [int(e) for e in re.findall(r"epoch (\d+): loss [0-9.]+", stdout)]


def test_training_example_checkpoints_on_sigusr1_requeues_and_resumes(archives, tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    checkpoint.parent.mkdir()
    env = fake_slurm(tmp_path)
    command = [sys.executable, os.path.join(EXAMPLES, "train_example.py"), archives[("zip", "raw")],
               "--checkpoint", str(checkpoint), *TRAIN_OPTIONS]
    stopped = signal_when_ready(command, env, lambda p: p.send_signal(signal.SIGUSR1))
    assert stopped.returncode == 0, stopped.stderr
    epoch, batches = saved_at(stopped.stdout)
    assert "requeued Slurm job 4242" in stopped.stdout
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert os.listdir(checkpoint.parent) == ["checkpoint.pt"]  # no temporary file left
    assert epochs_trained(stopped.stdout) == list(range(epoch))

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint}: epoch {epoch}, {batches} batches done" in resumed.stdout
    assert epochs_trained(resumed.stdout) == list(range(epoch, 2))
    assert torch.load(checkpoint, weights_only=True)["loader"]["epoch"] == 2
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # not requeued again

    again = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and epochs_trained(again.stdout) == []  # nothing left to train


def losses(stdout: str) -> list:
    return re.findall(r"epoch \d+: loss [0-9.]+", stdout)


@pytest.mark.slow
def test_training_example_stopped_after_an_epochs_last_step_resumes_at_the_next_epoch_exactly(archives, tmp_path):
    # one step an epoch (a batch of all 24 samples): the stop comes after an epoch's last step, never mid-epoch
    options = ["--epochs", "2", "--batch-size", "24", "--size", "16", "--workers", "0"]
    checkpoint, reference_checkpoint = tmp_path / "run" / "checkpoint.pt", tmp_path / "reference.pt"
    checkpoint.parent.mkdir()
    env = fake_slurm(tmp_path)

    def train(saving_to, *more) -> list:
        return [sys.executable, os.path.join(EXAMPLES, "train_example.py"), archives[("zip", "raw")],
                "--checkpoint", str(saving_to), *options, *more]

    command = train(checkpoint)
    stopped = signal_when_ready(train(checkpoint, "--pace", "2"), env, lambda p: p.send_signal(signal.SIGUSR1))
    assert stopped.returncode == 0, stopped.stderr
    epoch, batches = saved_at(stopped.stdout)
    assert batches == 1 and epochs_trained(stopped.stdout) == list(range(epoch)), stopped.stdout
    state = torch.load(checkpoint, weights_only=True)
    assert (state["loader"]["epoch"], state["loader"]["batches"]) == (epoch + 1, 0)  # the next epoch's start

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint}: epoch {epoch}, 1 batches done" in resumed.stdout
    reference = subprocess.run(train(reference_checkpoint), capture_output=True, text=True, timeout=300, env=env)
    assert reference.returncode == 0, reference.stderr
    assert losses(stopped.stdout) + losses(resumed.stdout) == losses(reference.stdout)  # each epoch once
    final, expected = (torch.load(c, weights_only=True) for c in (checkpoint, reference_checkpoint))
    assert final["loader"]["epoch"] == expected["loader"]["epoch"] == 2
    for name, value in expected["model"].items():
        assert torch.equal(final["model"][name], value), name


@pytest.mark.slow
def test_training_example_stops_when_the_stop_file_appears(archives, tmp_path):
    checkpoint, stop_file = tmp_path / "checkpoint.pt", tmp_path / "stop"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    command = [sys.executable, os.path.join(EXAMPLES, "train_example.py"), archives[("zip", "raw")],
               "--checkpoint", str(checkpoint), "--stop-file", str(stop_file), *TRAIN_OPTIONS]
    stopped = signal_when_ready(command, {**env, "CUDA_VISIBLE_DEVICES": ""}, lambda p: stop_file.touch())
    assert stopped.returncode == 0, stopped.stderr
    saved_at(stopped.stdout)
    assert "not under Slurm: run the same command again to resume" in stopped.stdout
    assert checkpoint.exists() and not stop_file.exists()  # removed, or the next run would stop at once


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_single_gpu.sbatch", "train_multi_gpu.sbatch"])
def test_batch_script_passes_sigusr1_on_and_the_job_resumes(archives, tmp_path, script):
    env = fake_slurm(tmp_path, job_id="77")
    env["CHECKPOINT"] = str(tmp_path / "checkpoint.pt")
    env["STOP_FILE"] = str(tmp_path / "stop")
    command = ["bash", os.path.join(EXAMPLES, script), archives[("zip", "raw")], *TRAIN_OPTIONS]
    # paced to outlast the signal: the multi-GPU script passes it on as a stop file, looked for once a second,
    # and unpaced the 12 steps took ~70 ms (the run once ended, both epochs done, before the file was seen)
    stopped = signal_when_ready([*command, "--pace", "0.5"], env, lambda p: p.send_signal(signal.SIGUSR1))
    assert stopped.returncode == 0, stopped.stderr
    epoch, batches = saved_at(stopped.stdout)
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)  # the requeued job
    assert resumed.returncode == 0, resumed.stderr
    assert f"epoch {epoch}, {batches} batches done" in resumed.stdout
    assert epochs_trained(resumed.stdout) == list(range(epoch, 2))
