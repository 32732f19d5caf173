"""The shipped batch scripts, unmodified, under a real one-node Slurm (tools/slurm/local_cluster.sh).

Limits are overridden on the sbatch command line only, as a user on a CPU node would: no GPUs,
little memory, a short time limit.  Skipped, saying why, where the cluster cannot start (not
root, or the packages munge, slurmctld, slurmd and slurm-client are not installed).  tools/slurm/README.md's
single-GPU demo (signal, checkpoint, requeue, exact resume) runs in test_slurm_recipes.py, under the
same cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import packed_formats as pf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "tools", "slurm")
CLUSTER = os.path.join(EXAMPLES, "local_cluster.sh")
# a small run: 24 samples in batches of 4, 6 steps an epoch, 2 epochs; --pace makes it outlast the signal
TRAIN = ["--epochs", "2", "--batch-size", "4", "--size", "16", "--workers", "0"]
CPU_NODE = ["--gpus=0", "--mem=1G", "--cpus-per-task=1"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The environment for sbatch & co. with a one-node Slurm running; stopped at the end of the session.

    One cluster a session: its directory is the session's, so that another module using this fixture
    finds it running (``local_cluster.sh start`` says so and leaves it be) instead of starting another."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (slurmd starts jobs as their users)")
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install munge slurmctld "
                    "slurmd slurm-client, as .ci/run does")
    state = tmp_path_factory.getbasetemp() / "slurm"
    state.mkdir(exist_ok=True)
    env = {**os.environ, "PF_SLURM_DIR": str(state), "PF_SLURMCTLD_PORT": "16917", "PF_SLURMD_PORT": "16918"}
    started = subprocess.run([CLUSTER, "start"], capture_output=True, text=True, env=env, timeout=120)
    if started.returncode != 0:
        pytest.fail(f"local_cluster.sh start failed: {started.stderr}")
    env.update(
        SLURM_CONF=str(state / "slurm.conf"),
        PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",  # python, packed-formats
        CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
    )
    try:
        yield env
    finally:
        subprocess.run([CLUSTER, "stop"], capture_output=True, env=env, timeout=120)


def sbatch(env, *arguments) -> str:
    done = subprocess.run(["sbatch", "--parsable", *arguments], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job(env, job_id: str) -> dict:
    """``scontrol show job``'s fields (JobState, Restarts, ExitCode, Reason...)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stderr
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_for(env, job_id: str, done, what: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job(env, job_id)
        if done(fields):
            return fields
        assert not finished(fields), f"job {job_id} ended before it could {what}: {fields}"
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not {what} within {timeout:.0f} s: {fields}")


def finished(fields: dict) -> bool:
    return fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for_requeue(env, job_id: str) -> None:
    """Until the job has stopped and is back in the queue."""
    wait_for(env, job_id, lambda f: f["JobState"] == "PENDING" and int(f["Restarts"]) >= 1, "requeue itself")


def start_now(env, job_id: str) -> None:
    """A requeued job waits for its begin time (two minutes later): start it now, with more time, so that
    the signal does not come again before it ends.

    Not ``StartTime=now``: slurmd remembers the second in which it stopped the job's last run, and turns
    away a launch of that job whose credential is not newer, and slurmctld then ends the job FAILED
    (exit code 1, restarts 1, the log's last line slurmstepd's "CANCELLED ... DUE TO JOB REQUEUE").  A
    requeue seen at once and started at once fell in the same second in about one run of two.  Two
    seconds on, the credential is newer than the stop."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2", "TimeLimit=10"], check=True,
                   env=env)


def run_again_now(env, job_id: str) -> None:
    wait_for_requeue(env, job_id)
    start_now(env, job_id)


def reference_run(archive: str, tmp_path) -> dict:
    """An uninterrupted run of the same training: its final checkpoint."""
    checkpoint = tmp_path / "reference.pt"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_example.py"), archive,
                           "--checkpoint", str(checkpoint), *TRAIN], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return {"losses": losses(done.stdout), "state": torch.load(checkpoint, weights_only=True)}


def losses(text: str) -> list:
    return re.findall(r"epoch (\d+): loss ([0-9.]+)", text)


def assert_same_model(checkpoint, reference: dict) -> None:
    state = torch.load(checkpoint, weights_only=True)
    assert state["loader"]["epoch"] == reference["state"]["loader"]["epoch"] == 2
    for name, value in reference["state"]["model"].items():
        assert torch.equal(state["model"][name], value), name


def test_a_job_killed_after_a_checkpoint_and_submitted_again_resumes(slurm, archives, tmp_path):
    archive = archives[("zip", "raw")]
    checkpoint, log = tmp_path / "checkpoint.pt", tmp_path / "job.out"
    env = {**slurm, "CHECKPOINT": str(checkpoint), "TMPDIR": str(tmp_path)}
    script = os.path.join(EXAMPLES, "train_single_gpu.sbatch")
    first = sbatch(env, *CPU_NODE, "--time=5", f"--output={log}", script, archive, *TRAIN, "--pace", "1")
    deadline = time.monotonic() + 180
    while "epoch 0: loss" not in (log.read_text() if log.exists() else ""):  # the end of epoch 0's checkpoint
        assert time.monotonic() < deadline and not finished(job(env, first)), log.read_text()
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=KILL", "--full", first], check=True, env=env)
    assert wait_for(env, first, finished, "end")["JobState"] in ("CANCELLED", "FAILED")
    second = sbatch(env, *CPU_NODE, "--time=5", f"--output={log}", script, archive, *TRAIN)
    fields = wait_for(env, second, finished, "end")
    out = log.read_text()
    assert fields["JobState"] == "COMPLETED", out
    assert not list(tmp_path.glob(f"*-{second}")), "the job left its staged copy"
    assert re.search(rf"resumed from {re.escape(str(checkpoint))}: epoch 1, \d+ batches done", out), out
    reference = reference_run(archive, tmp_path)
    assert losses(out)[-1] == reference["losses"][-1]
    assert_same_model(checkpoint, reference)


def reference_two_ranks(archive: str, tmp_path) -> dict:
    """An uninterrupted two-process run (torchrun, gloo): its final checkpoint."""
    checkpoint = tmp_path / "reference.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29731", os.path.join(EXAMPLES, "train_example.py"), archive, "--checkpoint",
                           str(checkpoint), *TRAIN], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return {"losses": losses(done.stdout), "state": torch.load(checkpoint, weights_only=True)}


# Over 60 s (30-110 s): slurmctld checks time limits every 30 s, so --signal comes 10-40 s into the job,
# which must still be training then (paced), and the requeued job waits for Slurm to start it again.  No
# setting of slurmctld's shortens that check; the test runs beside the others, where it costs no CPU.
def test_two_ranks_started_by_srun_stop_together_requeue_and_resume_exactly(slurm, archives, tmp_path):
    archive = archives[("zip", "raw")]
    checkpoint, log = tmp_path / "checkpoint.pt", tmp_path / "job.out"
    env = {**slurm, "CHECKPOINT": str(checkpoint), "STOP_FILE": str(tmp_path / "stop"), "TMPDIR": str(tmp_path)}
    job_id = sbatch(env, "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--mem=2G",
                    "--time=1", "--signal=B:USR1@50", f"--output={log}",
                    os.path.join(EXAMPLES, "train_multi_gpu.sbatch"), archive, *TRAIN, "--pace", "8")
    # slurmctld looks at time limits every 30 s, so the signal comes 10-40 s into the job: 6 steps of 8 s
    # are still under way then, however fast the machine (at a pace of 2.5 s the job once ended first)
    run_again_now(env, job_id)
    fields = wait_for(env, job_id, finished, "end")
    out = log.read_text()
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0"), out
    assert f"requeued Slurm job {job_id}" in out, out
    assert not list(tmp_path.glob(f"*-{job_id}")), "the job left its staged copy"
    # the last checkpoint before the requeue is the signal's (an epoch's end also saves one; on a loaded
    # machine the signal may come after the first epoch's)
    saves = re.findall(r"saved \S+: epoch (\d+), (\d+) batches done", out.split(f"requeued Slurm job {job_id}")[0])
    assert saves, out
    assert "resumed from {}: epoch {}, {} batches done".format(checkpoint, *saves[-1]) in out, out
    # each rank read its half of every epoch (24 samples, 2 ranks, batches of 4), across the restart
    for rank in (0, 1):
        assert re.findall(rf"rank {rank} of 2: epoch (\d+): (\d+) batches", out) == [("0", "3"), ("1", "3")], out
    reference = reference_two_ranks(archive, tmp_path)
    assert losses(out) == reference["losses"]
    assert_same_model(checkpoint, reference)


def contents(path) -> tuple:
    """An archive's classes, and each sample's key, label and stored bytes."""
    with pf.open_archive(str(path)) as reader:
        samples = [(reader.key(i), int(reader.labels[i]), np.asarray(reader.read(i)).tobytes())
                   for i in range(len(reader))]
        return tuple(reader.classes), samples


def wait_for_array(env, array_id: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", array_id], capture_output=True, text=True, env=env).stdout.strip():
        assert time.monotonic() < deadline, f"array {array_id} did not end within {timeout:.0f} s"
        time.sleep(1)


def test_conversion_as_an_array_of_four_with_one_task_cancelled_and_submitted_again(slurm, image_folder, tmp_path):
    from packed_formats.errors import IncompleteArchiveError
    from packed_formats.writing import parts
    from packed_formats.writing.convert import convert

    (tmp_path / "set").mkdir()
    (tmp_path / "one").mkdir()
    dst, one = tmp_path / "set" / "train.zip", tmp_path / "one" / "train.zip"
    options = ["--mode", "raw", "--size", "16", "--shard-size", "3", "--workers", "1", "--quiet"]  # 8 parts
    script = os.path.join(EXAMPLES, "convert_array.sbatch")
    limits = ["--cpus-per-task=1", "--mem=1G", "--time=5", f"--output={tmp_path}/%x-%A_%a.out"]
    array = sbatch(slurm, *limits, "--array=0-3", script, image_folder, str(dst), *options)
    subprocess.run(["scancel", f"{array}_3"], check=True, env=slurm)  # pending: 2 CPUs run two tasks at a time
    wait_for_array(slurm, array)
    assert all(job(slurm, f"{array}_{t}")["JobState"] == "COMPLETED" for t in range(3))
    assert not dst.exists()
    with pytest.raises(IncompleteArchiveError, match=r"train-00006\.zip is missing: re-run task 3 of 4"):
        parts.join(str(dst))

    again = sbatch(slurm, *limits, "--array=3", script, image_folder, str(dst), *options)  # the cancelled task alone
    wait_for_array(slurm, again)
    assert job(slurm, f"{again}_3")["JobState"] == "COMPLETED"
    assert dst.exists()  # it was the last: it joined the set

    convert(image_folder, str(one), mode="raw", size=16, shard_size=3, workers=1, quiet=True)
    names = sorted(os.listdir(one.parent))
    assert sorted(f for f in os.listdir(dst.parent) if not f.startswith(".")) == names
    for name in names:  # the same samples in each part (the set's id, drawn for each set, differs)
        if not name.endswith("-samples.npz"):  # the sample index beside them: no archive, checked by opening
            assert contents(one.parent / name) == contents(dst.parent / name), name
    assert pf.verify_archive(str(dst)).ok  # the sample index the tasks' join wrote agrees with the parts

    before = {name: os.stat(dst.parent / name).st_mtime_ns for name in names}
    rerun = sbatch(slurm, *limits, "--array=1", script, image_folder, str(dst), *options)  # a finished task
    wait_for_array(slurm, rerun)
    assert job(slurm, f"{rerun}_1")["JobState"] == "COMPLETED"
    assert {name: os.stat(dst.parent / name).st_mtime_ns for name in names} == before
