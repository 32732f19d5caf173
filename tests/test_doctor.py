"""doctor: file system detection, machine checks, advice, and the command's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

import packed_formats as pf
from packed_formats import cli, native
from packed_formats.doctor import (
    advise,
    filesystem_kind,
    filesystem_of,
    format_report,
    processes_per_node,
    suggested_num_workers,
)

REPORT_KEYS = {"path", "filesystem", "archive", "cpu", "jpeg", "pixels", "shm", "memory", "torch", "tempdir", "advice"}


def write_mounts(tmp_path, *entries) -> str:
    """A mount table file in /proc/mounts syntax from (device, mount point, fstype) triples."""
    path = tmp_path / "mounts"
    path.write_text("".join(f"{dev} {point} {fstype} rw,relatime 0 0\n" for dev, point, fstype in entries))
    return os.fspath(path)


def mounted_as(tmp_path, fstype: str) -> str:
    """A mount table where tmp_path's real location is a mount of type fstype."""
    return write_mounts(tmp_path, ("/dev/vda", "/", "ext4"), ("server:/x", os.path.realpath(tmp_path), fstype))


def advice_on(report, topic):
    return [item for item in report["advice"] if item["topic"] == topic]


def real_mount_type(point: str):
    with open("/proc/mounts") as file:
        types = [line.split()[2] for line in file if line.split()[1] == point]
    return types[-1] if types else None


@pytest.mark.parametrize(
    "fstype, kind",
    [
        ("lustre", "lustre"), ("gpfs", "gpfs"), ("nfs", "nfs"), ("nfs4", "nfs"), ("beegfs", "network"),
        ("fuse.sshfs", "network"), ("ext4", "local"), ("xfs", "local"), ("btrfs", "local"), ("tmpfs", "tmpfs"),
        ("overlay", "overlay"), ("proc", "unknown"),
    ],
)
def test_file_system_types_are_classified(fstype, kind):
    assert filesystem_kind(fstype) == kind


def test_the_longest_mount_point_holding_the_path_wins(tmp_path):
    mounts = write_mounts(
        tmp_path,
        ("/dev/vda", "/", "ext4"),
        ("mds@tcp:/scratch", "/scratch", "lustre"),
        ("nas:/scratch2", "/scratch2", "nfs4"),
        ("/dev/nvme0n1", "/scratch/local", "xfs"),
    )
    assert filesystem_of("/scratch/me/train.zip", mounts)["fstype"] == "lustre"
    assert filesystem_of("/scratch2/me/train.zip", mounts)["fstype"] == "nfs4"
    assert filesystem_of("/scratch/local/train.zip", mounts)["mount_point"] == "/scratch/local"
    assert filesystem_of("/home/me", mounts)["fstype"] == "ext4"


def test_escaped_spaces_in_mount_points_are_understood(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nnas:/d /mnt/my\\040data nfs rw 0 0\n")
    found = filesystem_of("/mnt/my data/train.zip", os.fspath(mounts))
    assert (found["mount_point"], found["kind"]) == ("/mnt/my data", "nfs")


@pytest.mark.parametrize("fstype", ["lustre", "gpfs", "nfs4"])
def test_shared_file_systems_get_advice_to_stage(tmp_path, fstype):
    report = pf.diagnose(tmp_path, mounts=mounted_as(tmp_path, fstype))
    [item] = advice_on(report, "filesystem")
    assert item["level"] == "warning"
    assert f"packed-formats stage {report['path']}" in item["message"]
    assert {"HDF5", "LMDB"} <= {item["message"].split(":")[0] for item in advice_on(report, "locking")}


def test_local_disks_need_no_staging(tmp_path):
    report = pf.diagnose(tmp_path, mounts=mounted_as(tmp_path, "ext4"))
    [item] = advice_on(report, "filesystem")
    assert item["level"] == "ok"
    assert "stage" not in item["message"]
    assert advice_on(report, "locking") == []


@pytest.mark.parametrize("fmt, setting", [("hdf5", "takes no file lock"), ("lmdb", "lock=False")])
def test_locking_advice_says_what_our_readers_already_do(archives, fmt, setting):
    report = pf.diagnose(archives[(fmt, "raw")])
    assert any(setting in item["message"] for item in advice_on(report, "locking"))


def test_doctor_json_on_a_tmpfs_directory(capsys):
    if real_mount_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs mount here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        assert cli.main(["doctor", directory, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    assert set(report) == REPORT_KEYS
    assert report["filesystem"]["kind"] == "tmpfs"
    assert report["archive"] is None


def test_doctor_json_structure_on_a_local_directory(tmp_path):
    command = [sys.executable, "-m", "packed_formats", "doctor", os.fspath(tmp_path), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == REPORT_KEYS
    assert report["path"] == os.fspath(tmp_path)
    assert report["filesystem"]["fstype"] == real_mount_type(report["filesystem"]["mount_point"])
    assert report["cpu"]["usable"] == len(os.sched_getaffinity(0))
    assert isinstance(report["cpu"]["suggested_num_workers"], int)
    assert isinstance(report["jpeg"]["pillow_libjpeg_turbo"], bool)
    assert isinstance(report["jpeg"]["torchvision_decode_jpeg"], bool)
    assert report["shm"]["free_bytes"] <= report["shm"]["total_bytes"]
    assert 0 < report["memory"]["available_bytes"] <= report["memory"]["total_bytes"]
    assert isinstance(report["torch"]["cuda_available"], bool)
    for item in report["advice"]:
        assert set(item) == {"topic", "level", "message"} and item["level"] in ("ok", "info", "warning")


def test_doctor_summarises_an_archive(archives, packed_kind):
    path = archives[packed_kind]
    report = pf.diagnose(path)
    with pf.open_archive(path) as reader:
        expected = {"format": reader.format_name, "mode": reader.mode, "count": len(reader)}
    assert {k: report["archive"][k] for k in expected} == expected
    assert report["archive"]["classes"] == 3
    assert report["memory"]["archive_bytes"] == report["archive"]["bytes"] > 0


def test_doctor_advises_converting_an_image_folder(image_folder):
    report = pf.diagnose(image_folder)
    assert report["archive"]["format"] == "folder"
    assert "packed-formats convert" in advice_on(report, "archive")[0]["message"]


def test_doctor_reports_a_damaged_archive_instead_of_failing(archives, tmp_path):
    damaged = tmp_path / "damaged.zip"
    damaged.write_bytes(open(archives[("zip", "raw")], "rb").read()[:-200])
    report = pf.diagnose(damaged)
    assert os.fspath(damaged) in report["archive"]["error"]
    assert advice_on(report, "archive")[0]["level"] == "warning"


def test_doctor_on_a_missing_path_prints_one_line_and_exits_2(tmp_path, capsys):
    assert cli.main(["doctor", os.fspath(tmp_path / "missing.zip")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.zip" in err


def test_text_report_covers_every_topic(archives, capsys):
    assert cli.main(["doctor", archives[("memmap", "raw")]]) == 0
    text = capsys.readouterr().out
    for heading in ("file system", "archive", "CPUs", "JPEG", "/dev/shm", "memory", "torch", "Advice:"):
        assert f"\n  {heading}" in text or f"\n{heading}" in text


@pytest.mark.parametrize("cpus, processes, workers", [(1, 1, 0), (2, 1, 1), (8, 1, 7), (32, 4, 7), (128, 1, 16)])
def test_suggested_workers_leave_one_core_per_training_process(cpus, processes, workers):
    assert suggested_num_workers(cpus, processes) == workers


@pytest.mark.parametrize(
    "env, expected", [({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4), ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2)]
)
def test_processes_per_node_come_from_torchrun_or_slurm(monkeypatch, env, expected):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert processes_per_node() == expected


def test_shared_memory_too_small_for_worker_batches_is_a_warning(tmp_path):
    report = pf.diagnose(tmp_path)
    if report["cpu"]["suggested_num_workers"] == 0 or report["shm"]["free_bytes"] is None:
        pytest.skip("no DataLoader workers suggested here, so no shared memory is needed")
    sample_bytes = report["shm"]["batch_bytes"] // 256
    too_many = report["shm"]["free_bytes"] // sample_bytes + 1
    report = pf.diagnose(tmp_path, batch_size=too_many)
    [item] = advice_on(report, "shm")
    assert item["level"] == "warning" and "Bus error" in item["message"]


def test_an_archive_larger_than_free_memory_is_a_warning(archives):
    report = pf.diagnose(archives[("hdf5", "encoded")])
    assert advice_on(report, "memory")[0]["level"] == "ok"
    report["memory"]["available_bytes"] = report["memory"]["archive_bytes"] // 2
    [item] = [item for item in advise(report) if item["topic"] == "memory"]
    assert item["level"] == "warning" and "Stage it" in item["message"]


def test_format_report_wraps_every_advice_item(tmp_path):
    report = pf.diagnose(tmp_path)
    text = format_report(report)
    assert text.count("\n  [") == len(report["advice"])


def _heavy_imports(args, cwd):
    """The heavy packages ``packed-formats ARGS`` imports (read from ``python -X importtime``)."""
    command = [sys.executable, "-X", "importtime", "-m", "packed_formats", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    return imported & {"torch", "torchvision", "h5py", "lmdb", "fsspec", "aiohttp"}


@pytest.mark.parametrize("args", [["--help"], ["info", "{raw}"], ["doctor", "{raw}"]], ids=["help", "info", "doctor"])
def test_help_info_and_doctor_on_a_raw_archive_do_not_import_torchvision(args, archives):
    raw = archives[("memmap", "raw")]
    heavy = _heavy_imports([a.format(raw=raw) for a in args], cwd=os.path.dirname(raw))
    assert "torchvision" not in heavy  # seconds to import, and nothing a raw archive needs
    if args[0] != "doctor":  # doctor asks torch which GPUs it sees
        assert "torch" not in heavy


def test_doctor_on_a_raw_archive_leaves_the_decoder_unchecked_and_says_so(archives, capsys):
    report = pf.diagnose(archives[("memmap", "raw")])
    assert report["jpeg"]["torchvision_decode_jpeg"] is None
    assert report["jpeg"]["torchvision_version"]  # still named, from the installed package's metadata
    assert not any("torchvision cannot" in item["message"] for item in report["advice"])
    assert cli.main(["doctor", archives[("memmap", "raw")]]) == 0
    assert "not checked: a raw archive is never decoded" in capsys.readouterr().out


def test_doctor_on_an_encoded_archive_checks_the_decoder(archives):
    assert isinstance(pf.diagnose(archives[("zip", "encoded")])["jpeg"]["torchvision_decode_jpeg"], bool)


@pytest.mark.parametrize("built", [True, False])
def test_doctor_says_what_parts_channels_and_warns_for_a_raw_archive_without_the_c_module(archives, capsys,
                                                                                          monkeypatch, built):
    if not built:
        monkeypatch.setattr(native, "_pixels", None)
    elif native.planar_copy() != "native":
        pytest.skip("the C module is not built here")
    for kind, level in ((("memmap", "raw"), "warning"), (("zip", "encoded"), "info")):
        report = pf.diagnose(archives[kind])
        assert report["pixels"] == {"channels_parted_by": "native" if built else "numpy"}
        advice = [item for item in report["advice"] if item["topic"] == "pixels"]
        assert advice == [] if built else [item["level"] for item in advice] == [level]
        if not built:
            assert "pip install --no-deps --force-reinstall ." in advice[0]["message"]
    assert cli.main(["doctor", archives[("memmap", "raw")]]) == 0
    out = capsys.readouterr().out
    assert ("by the C module" if built else "by numpy: the C module is not built") in out
