"""convert --part I/N writes one task's parts of a sharded set; join (or the last task) writes its index."""

from __future__ import annotations

import fcntl
import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.cli import main
from packed_formats.writing import parts
from packed_formats.writing.convert import convert

SHARD = 5  # 24 samples: slots of 5, 5, 5, 5, 4


def one_process(image_folder, dst, fmt="zip", **options):
    convert(image_folder, dst, format=fmt, mode="raw", size=16, shard_size=SHARD, workers=1, quiet=True, **options)
    return sorted(os.listdir(os.path.dirname(dst)))


def task(image_folder, dst, part, fmt="zip", **options):
    options = {"mode": "raw", "size": 16, **options}
    return convert(image_folder, dst, format=fmt, shard_size=SHARD, workers=1, quiet=True, part=part, **options)


def visible(directory):
    return sorted(f for f in os.listdir(directory) if not f.startswith("."))


def assert_same_set(a, b):
    with pf.open_archive(a) as x, pf.open_archive(b) as y:
        assert len(x) == len(y) and x.classes == y.classes
        assert np.array_equal(np.asarray(x.labels), np.asarray(y.labels))
        assert [x.key(i) for i in range(len(x))] == [y.key(i) for i in range(len(y))]
        for i in range(len(x)):
            assert np.array_equal(np.asarray(x.read(i)), np.asarray(y.read(i)))


def test_the_split_does_not_depend_on_the_number_of_tasks():
    for slots in (1, 5, 50):
        for tasks in (1, 2, 3, 4, 7, 60):
            covered = [s for t in range(tasks) for s in parts.task_slots(t, tasks, slots)]
            assert covered == list(range(slots))
            assert all(parts.task_of_slot(s, tasks, slots) in range(tasks) for s in range(slots))


@pytest.mark.parametrize("fmt", ["zip", "hdf5", "lmdb", "memmap"])
def test_parts_written_by_separate_tasks_equal_a_one_process_conversion(image_folder, tmp_path, fmt):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    ext = {"zip": ".zip", "hdf5": ".h5", "lmdb": ".lmdb", "memmap": ".memmap"}[fmt]
    one, many = str(tmp_path / "one" / f"train{ext}"), str(tmp_path / "many" / f"train{ext}")
    files = one_process(image_folder, one, fmt)
    summaries = [task(image_folder, many, (i, 3), fmt) for i in (2, 0, 1)]  # in any order
    assert "the set is joined once every part is sealed" in summaries[0].line()
    assert "every part sealed: the set is joined" in summaries[-1].line()
    assert visible(tmp_path / "many") == files  # the same parts and the index, nothing else visible
    for name in files:  # byte for byte: the tasks derive the set's id from the plan, as one process does
        left, right = tmp_path / "one" / name, tmp_path / "many" / name
        if left.is_dir():
            assert not filecmp.dircmp(left, right).diff_files and sorted(os.listdir(left)) == sorted(os.listdir(right))
        else:
            assert filecmp.cmp(left, right, shallow=False), name
    assert_same_set(one, many)
    assert not [f for f in os.listdir(tmp_path / "many") if ".pf-tmp-" in f]


def test_join_refuses_a_missing_part_then_finishes_once_the_task_is_rerun(image_folder, tmp_path):
    dst = str(tmp_path / "train.zip")
    for i in (0, 1, 3):
        task(image_folder, dst, (i, 4))
    assert not os.path.exists(dst)
    with pytest.raises(pf.IncompleteArchiveError, match=r"part train-00002\.zip is missing: re-run task 2 of 4"):
        parts.join(dst)
    assert not os.path.exists(dst)
    task(image_folder, dst, (2, 4))  # the failed task alone: it joins the set
    assert os.path.exists(dst)
    assert parts.join(dst) == dst  # joining again changes nothing
    one_process(image_folder, str(tmp_path / "ref.zip"))
    assert_same_set(dst, str(tmp_path / "ref.zip"))


def test_rerunning_a_finished_task_changes_nothing(image_folder, tmp_path):
    dst = str(tmp_path / "train.zip")
    for i in range(2):
        task(image_folder, dst, (i, 2))
    state = parts.state_dir(dst)

    def files():
        listed = [str(tmp_path / f) for f in visible(tmp_path)] + [os.path.join(state, f) for f in os.listdir(state)]
        return {f: os.stat(f).st_mtime_ns for f in listed if not f.endswith(".lock")}

    before = files()
    again = task(image_folder, dst, (1, 2))
    assert again.samples == 0 and "already sealed and left as they were" in again.line()
    assert files() == before


def parts_without_index(image_folder, tmp_path, tasks: int) -> str:
    """Every task of a ``tasks``-way conversion run, then the set's index removed: the parts as ``join``
    finds them; the destination's path."""
    dst = str(tmp_path / "train.zip")
    for i in range(tasks):
        task(image_folder, dst, (i, tasks))
    os.remove(dst)
    return dst


def test_a_part_left_unsealed_is_refused_and_rewritten_by_the_rerun(image_folder, tmp_path):
    dst = parts_without_index(image_folder, tmp_path, 3)
    seal = parts.seal_path(dst, "train-00004.zip")
    os.remove(seal)  # as if its task was killed after writing the part, before sealing it
    with pytest.raises(pf.IncompleteArchiveError, match=r"train-00004\.zip is not sealed .*--part 2/3"):
        parts.join(dst)
    assert not os.path.exists(dst)
    task(image_folder, dst, (2, 3))
    assert os.path.exists(seal) and os.path.exists(dst)


@pytest.mark.parametrize(
    "change, what",
    [({"size": 8}, "size"), ({"mode": "encoded", "size": None}, "mode"), ("version", "library version"),
     ("source", "source listing")],
)
def test_a_task_of_another_conversion_is_refused_before_it_writes(image_folder, tmp_path, change, what):
    dst = str(tmp_path / "train.zip")
    task(image_folder, dst, (0, 2))
    src = image_folder
    if change == "version":  # the plan says another version wrote the first part
        plan_file = os.path.join(parts.state_dir(dst), "plan.json")
        plan = json.load(open(plan_file))
        plan["version"] = "0.0.1"
        json.dump(plan, open(plan_file, "w"))
        change = {}
    elif change == "source":
        src = str(tmp_path / "other")
        pf.synthetic.make_image_folder(src, images_per_class=8, classes=("a", "b", "c"), sizes=(40, 90), seed=2)
        change = {}
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(pf.CorruptArchiveError, match=f"another {what}"):
        task(src, dst, (1, 2), **change)
    assert sorted(os.listdir(tmp_path)) == before and not os.path.exists(dst)


def test_join_refuses_a_part_from_another_conversion_and_two_parts_claiming_one_slot(image_folder, tmp_path):
    dst = parts_without_index(image_folder, tmp_path, 2)
    seal_file = parts.seal_path(dst, "train-00001.zip")
    seal = json.load(open(seal_file))
    json.dump({**seal, "plan": "0" * 16}, open(seal_file, "w"))
    with pytest.raises(pf.CorruptArchiveError, match=r"part train-00001\.zip was written by another conversion"):
        parts.join(dst)
    json.dump({**seal, "slot": 3}, open(seal_file, "w"))  # a copy that says it is part 3
    with pytest.raises(pf.CorruptArchiveError, match="two parts claim slot 3"):
        parts.join(dst)
    json.dump(seal, open(seal_file, "w"))
    with open(tmp_path / "train-00001.zip", "ab") as file:
        file.write(b"x")
    with pytest.raises(pf.CorruptArchiveError, match=r"train-00001\.zip changed after it was sealed"):
        parts.join(dst)
    assert not os.path.exists(dst)


def test_a_second_writer_of_the_same_part_is_refused_and_says_who_writes_it(image_folder, tmp_path):
    dst = str(tmp_path / "train.zip")
    task(image_folder, dst, (0, 2))
    holder = parts.PartLock(dst, "train-00003.zip")
    with holder:  # another task writes slot 3 (task 1 of 2's first) right now
        busy = rf"part train-00003\.zip is being written by process {os.getpid()}"
        with pytest.raises(pf.ArchiveInUseError, match=busy):
            task(image_folder, dst, (1, 2))
        assert not os.path.exists(tmp_path / "train-00003.zip")
    lock = os.open(holder.path, os.O_RDWR)  # and the lock is free again once its holder is gone
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(lock)


def test_part_auto_reads_the_array_task_and_a_rerun_alone_keeps_the_split(monkeypatch, image_folder, tmp_path):
    dst = str(tmp_path / "train.zip")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert parts.parse_part("auto") == (0, None)
    task(image_folder, dst, parts.parse_part("auto"))
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "1")  # sbatch --array=2: an array of one
    summary = task(image_folder, dst, parts.parse_part("auto"))
    assert "task 2 of 3: part(s) 3-4 of 5" in summary.line()
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_ID"):
        parts.parse_part("auto")


@pytest.mark.parametrize("text", ["3/3", "1", "a/b", "-1/2", "0/0"])
def test_a_bad_part_is_refused(text):
    with pytest.raises(ValueError, match="I/N"):
        parts.parse_part(text)


def test_the_command_line_converts_parts_and_joins(image_folder, tmp_path, capsys):
    dst = str(tmp_path / "train.zip")
    common = [image_folder, dst, "--mode", "raw", "--size", "16", "--shard-size", "5", "--workers", "1", "--quiet"]
    assert main(["convert", *common, "--part", "0/2"]) == 0
    assert main(["join", dst]) == 2
    assert "error: " in capsys.readouterr().err and not os.path.exists(dst)
    assert main(["convert", *common, "--part", "1/2"]) == 0
    assert main(["join", dst]) == 0 and f"joined {dst}" in capsys.readouterr().out
    unsharded = [image_folder, str(tmp_path / "x.zip"), "--mode", "raw", "--size", "16", "--part", "0/2"]
    assert main(["convert", *unsharded]) == 2
    assert "--part needs --shard-size" in capsys.readouterr().err
    run = subprocess.run([sys.executable, "-m", "packed_formats.cli", "convert", *common, "--part", "2/2"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "0 <= I < N" in run.stderr
