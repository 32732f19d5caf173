"""tools/slurm/README.md's commands for a one-node Slurm, run as written under tools/slurm/local_cluster.sh.

The blocks of the README's "Trying them on this machine" section are read from the file and run by
bash, so the documentation and this test cannot drift: the data block once, then each batch
script's block, in a directory laid out as the repository's root (``tools`` linked).  The cluster is
the session's one (test_slurm_cluster's fixture); the tests skip, saying why, where it cannot start.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

import pytest

from .test_slurm_cluster import (
    CLUSTER,
    EXAMPLES,
    assert_same_model,
    contents,
    job,
    losses,
    reference_run,
    slurm,  # noqa: F401 (the session's cluster, a fixture)
)

ROOT = Path(__file__).resolve().parent.parent
README = Path(EXAMPLES) / "README.md"
SECTION = "## Trying them on this machine"


def section() -> str:
    """The README's section on the local cluster, up to the next ``## `` heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else len(text)]


def blocks() -> List[str]:
    """The section's ```bash blocks, as written."""
    return re.findall(r"```bash\n(.*?)```", section(), flags=re.S)


def block(mentioning: str) -> str:
    """The one block of the section that mentions ``mentioning``."""
    found = [b for b in blocks() if mentioning in b]
    assert len(found) == 1, f"tools/slurm/README.md: {len(found)} blocks mention {mentioning}, not one"
    return found[0]


def run_block(text: str, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a README block with bash, stopping at the first command that fails."""
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def job_ids(output: str) -> List[str]:
    """The jobs (array tasks included) that ``local_cluster.sh wait`` reported ended."""
    return sorted(set(re.findall(r"^job (\S+): (?:COMPLETED|FAILED|CANCELLED|TIMEOUT)", output, flags=re.M)))


DATA = "packed-formats convert images/ train.zip"  # what the README's data block holds


def recipe_folder() -> str:
    """The folder of its own that the README's data block makes and enters (``cd NAME``)."""
    found = re.findall(r"\bcd (\S+)$", block(DATA), flags=re.M)
    assert len(found) == 1, "tools/slurm/README.md's data block does not enter a folder of its own"
    return found[0]


@pytest.fixture(scope="module")
def workdir(slurm, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """The README's folder of its own, made by its data block run in a directory laid out as the repository's
    root, and holding what that block makes; the later blocks run in it, as a user's shell stays there."""
    where = tmp_path_factory.mktemp("recipes")
    (where / "tools").symlink_to(ROOT / "tools", target_is_directory=True)
    made = run_block(block(DATA), slurm, where)
    assert made.returncode == 0, made.stderr
    folder = where / recipe_folder()
    assert sorted(os.listdir(where)) == sorted(["tools", recipe_folder()]), "the data block wrote beside its folder"
    assert (folder / "train.zip").is_file() and (folder / "tools" / "slurm").is_dir()
    return folder


def staged_copies(tmp: Path, job_id: str) -> List[Path]:
    """What a job staged under ``tmp`` (its ``<user>-<jobid>`` folder), if still there."""
    return list(tmp.glob(f"*-{job_id}"))


# Over 60 s (55-90 s): as the two-rank test in test_slurm_cluster.py, the signal comes with slurmctld's
# 30-s time-limit check and the requeued job starts again after it; it runs beside the others, waiting.
@pytest.mark.slow
def test_single_gpu_recipe_checkpoints_requeues_once_and_resumes_exactly(slurm, workdir, tmp_path):  # noqa: F811
    started = time.monotonic()
    done = run_block(block("train_single_gpu.sbatch"), {**slurm, "TMPDIR": str(tmp_path)}, workdir)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    (job_id,) = job_ids(done.stdout)
    assert not staged_copies(tmp_path, job_id), "the job left its staged copy"
    fields = job(slurm, job_id)
    log = (workdir / f"pf-train-{job_id}.out").read_text()
    # one requeue: the restart's longer limit lets it finish (minutes, not one allocation a batch)
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0"), log
    before, requeued, after = log.partition(f"requeued Slurm job {job_id}")
    saved = re.findall(r"saved \S+: epoch (\d+), (\d+) batches done", before)
    assert requeued and len(saved) == 1, log
    checkpoint = workdir / f"checkpoint-{job_id}.pt"
    assert "resumed from {}: epoch {}, {} batches done".format(checkpoint, *saved[0]) in after, log
    reference = reference_run(str(workdir / "train.zip"), tmp_path)
    epoch = int(saved[0][0])
    assert losses(before) == reference["losses"][:epoch], log  # the epochs that ended before the stop
    assert losses(after) == reference["losses"][epoch:], log  # the others, each once, with the same losses
    assert_same_model(checkpoint, reference)
    print(f"the single-GPU recipe took {took:.0f} s")


@pytest.mark.slow
def test_multi_gpu_recipe_runs_two_ranks_on_the_one_node(slurm, workdir, tmp_path):  # noqa: F811
    done = run_block(block("train_multi_gpu.sbatch"), {**slurm, "TMPDIR": str(tmp_path)}, workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    (job_id,) = job_ids(done.stdout)
    assert job(slurm, job_id)["JobState"] == "COMPLETED"
    assert not staged_copies(tmp_path, job_id), "the job left its staged copy"
    assert not list(workdir.glob(f".stop-{job_id}")), "the job left its stop file"
    log = (workdir / f"pf-train-ddp-{job_id}.out").read_text()
    for rank in (0, 1):  # 24 samples, 2 ranks, batches of 4
        assert re.findall(rf"rank {rank} of 2: epoch (\d+): (\d+) batches", log) == [("0", "3"), ("1", "3")], log


@pytest.mark.slow
def test_conversion_array_recipe_writes_the_set_one_process_writes(slurm, workdir):  # noqa: F811
    done = run_block(block("convert_array.sbatch"), slurm, workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    tasks = job_ids(done.stdout)
    assert len(tasks) == 4 and all(job(slurm, task)["JobState"] == "COMPLETED" for task in tasks), done.stdout
    (workdir / "one").mkdir()
    one = subprocess.run(["packed-formats", "convert", "images/", "one/train.zip", "--mode", "raw", "--size", "16",
                          "--shard-size", "3", "--quiet"], capture_output=True, text=True, env=slurm, cwd=workdir)
    assert one.returncode == 0, one.stderr
    names = sorted(os.listdir(workdir / "one"))
    assert sorted(f for f in os.listdir(workdir / "set") if not f.startswith(".")) == names
    for name in names:  # each part the same samples (the set's id, drawn for each set, differs)
        if name != "train.zip" and not name.endswith("-samples.npz"):  # the sample index: checked by opening
            assert contents(workdir / "set" / name) == contents(workdir / "one" / name), name
    assert contents(workdir / "set" / "train.zip") == contents(workdir / "one" / "train.zip")



@pytest.mark.slow
def test_a_requeued_job_started_again_by_the_readmes_command_runs(slurm):  # noqa: F811
    # slurmd turns away a job started again in the second it stopped it (the job then ends FAILED): the
    # README's restart must not fall in that second, however soon after the requeue it is typed
    restart = [line for line in block("train_single_gpu.sbatch").splitlines() if line.startswith("scontrol update")]
    assert len(restart) == 1
    for _ in range(6):  # about one in two falls in that second when the restart is "now"
        job_id = sbatch_sleeping(slurm)
        try:
            while job(slurm, job_id)["JobState"] != "RUNNING":
                time.sleep(0.2)
            time.sleep(1 - time.time() % 1)  # the requeue's kill at the start of a second: the worst case
            subprocess.run(["scontrol", "requeue", job_id], check=True, env=slurm)
            while job(slurm, job_id)["JobState"] != "PENDING":
                time.sleep(0.05)
            subprocess.run(["bash", "-c", restart[0]], check=True, env={**slurm, "JOB": job_id})
            deadline = time.monotonic() + 30
            while (fields := job(slurm, job_id))["JobState"] == "PENDING" and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1)  # a launch slurmd turned away ends the job a moment after it shows RUNNING
            fields = job(slurm, job_id)
            assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "1"), fields
        finally:
            subprocess.run(["scancel", job_id], env=slurm)


def sbatch_sleeping(env: dict) -> str:
    """A job that sleeps, and may be requeued."""
    done = subprocess.run(["sbatch", "--parsable", "--requeue", "--cpus-per-task=1", "--mem=100M", "--output=/dev/null",
                           "--wrap", "sleep 300"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow
def test_waiting_for_a_job_that_cannot_start_here_says_why_at_once(slurm):  # noqa: F811
    # no GPUs and one CPU a rank, but the script's two nodes: more than this one node
    command = ["sbatch", "--parsable", "--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1", "--mem=2G",
               os.path.join(EXAMPLES, "train_multi_gpu.sbatch"), "train.zip"]
    submitted = subprocess.run(command, capture_output=True, text=True, env=slurm, cwd=ROOT, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        waited = subprocess.run([CLUSTER, "wait", job_id], capture_output=True, text=True, env=slurm, timeout=60)
    finally:
        subprocess.run(["scancel", job_id], env=slurm)
    assert waited.returncode == 1
    assert f"job {job_id} cannot start on this one-node cluster: PENDING (PartitionConfig)" in waited.stderr


def test_the_recipes_folder_of_their_own_is_ignored_by_git():
    """Made from the repository's top folder as the README says, it leaves ``git status`` clean."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    folder = recipe_folder()
    done = subprocess.run(["git", "check-ignore", f"{folder}/train.zip"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{folder}/ would show in git status: add it to .gitignore"


def test_the_readme_starts_the_cluster_without_sudo():
    start = block("local_cluster.sh start")
    assert re.search(r"^tools/slurm/local_cluster\.sh start\b", start, flags=re.M), start
    assert "sudo" not in start


def readable_by_everyone(folder: str) -> bool:
    """Every folder from the root down to ``folder`` may be entered by other users."""
    path = Path(folder).resolve()
    return all(os.stat(p).st_mode & 0o001 for p in (path, *path.parents))


def as_nobody(script: str, programs: dict) -> Tuple[subprocess.CompletedProcess, str]:
    """Run ``bash script start`` as the user nobody, with a PATH of ``programs`` only ({name: path or script
    text}), from a fresh folder of mode 755 that holds a copy of ``script``: the clone may lie under a folder
    other users cannot enter (a home of mode 700, ``mktemp -d``), where nobody could not read the script.
    Returns what the run gave and the copy's resolved path."""
    with tempfile.TemporaryDirectory() as tmp:
        if not readable_by_everyone(os.path.dirname(tmp)):  # TMPDIR private too: nowhere to put the copy
            pytest.skip(f"{os.path.dirname(tmp)} cannot be entered by other users: set TMPDIR to a folder that can")
        bin_dir, copy = Path(tmp, "bin"), Path(tmp, os.path.basename(script))
        bin_dir.mkdir()
        for folder in (tmp, bin_dir):
            os.chmod(folder, 0o755)
        shutil.copyfile(script, copy)
        os.chmod(copy, 0o755)
        for name, what in programs.items():
            if what.startswith("#!"):
                Path(bin_dir, name).write_text(what)
                os.chmod(Path(bin_dir, name), 0o755)
            else:
                os.symlink(what, Path(bin_dir, name))
        ran = subprocess.run(["/bin/bash", str(copy), "start"], capture_output=True, text=True, timeout=60,
                             user="nobody", cwd=tmp, env={"PATH": str(bin_dir), "PF_SLURM_DIR": "/tmp/pf-slurm-nobody"})
        return ran, os.path.realpath(copy)


def basic_programs() -> dict:
    return {name: shutil.which(name) for name in ("hostname", "id", "readlink")}


@pytest.mark.skipif(os.geteuid() != 0, reason="running the script as another user needs root")
def test_start_by_another_user_without_sudo_says_it_needs_root():
    ran, _ = as_nobody(CLUSTER, basic_programs())
    assert ran.returncode == 3
    assert "start needs root (slurmd starts jobs as their users): run it as root, or install sudo" in ran.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="running the script as another user needs root")
def test_start_by_another_user_runs_itself_again_with_sudo():
    # a stand-in for sudo that prints the command it was given (a real one asks for a password)
    printing_sudo = '#!/bin/bash\nprintf "%s\\n" "$@"\n'
    ran, script = as_nobody(CLUSTER, {**basic_programs(), "sudo": printing_sudo})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [  # the script's own path, resolved: the copy nobody ran
        "env", "PF_SLURM_DIR=/tmp/pf-slurm-nobody", "PF_SLURMCTLD_PORT=16817", "PF_SLURMD_PORT=16818",
        "bash", script, "start",
    ]
    assert "start needs root: running it with sudo" in ran.stderr

