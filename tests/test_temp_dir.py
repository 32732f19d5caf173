"""A temporary folder too deep for a socket: DataLoader workers hand shared memory over through an AF_UNIX
socket that multiprocessing makes under it, and past the socket path's limit (107 bytes on Linux) the
worker's hand-over fails in a thread nobody watches: torch's DataLoader then waits forever.  Reading a
PackedDataset or a make_loader in workers must say so at once instead, and ``doctor`` must warn."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import doctor
from packed_formats.loading import temp_dir

READ = textwrap.dedent("""
    import sys, torch, packed_formats as pf
    if sys.argv[2] == "dataset":
        dataset = pf.PackedDataset(sys.argv[1], output="tensor")
        batches = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    else:  # worker processes ("threads" gathers the raw batches in this process, through no socket)
        context = None if sys.argv[2] == "threads" else "fork"
        batches = pf.make_loader(sys.argv[1], batch_size=4, num_workers=2, shuffle=False,
                                 multiprocessing_context=context)
        assert batches.worker_kind == ("threads" if context is None else "processes")
    print("read", sum(len(labels) for _, labels in batches))
""")


@pytest.fixture(scope="module")
def raw_archive(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("deep") / "train.memmap"
    with pf.open_writer(path, format="memmap", mode="raw", shape=(8, 8, 3), classes=["a"]) as writer:
        for i in range(8):
            writer.add(np.full((8, 8, 3), i, np.uint8), 0, f"{i}.png")
    return str(path)


def deep_folder(tmp_path, total: int) -> str:
    """A folder whose path is ``total`` bytes long (made under tmp_path)."""
    folder = str(tmp_path)
    while len(folder) < total:
        folder = os.path.join(folder, "d" * min(40, max(1, total - len(folder) - 1)))
    os.makedirs(folder, exist_ok=True)
    assert len(folder) == total, folder
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["dataset", "loader"])
def test_workers_under_a_temporary_folder_too_deep_for_a_socket_say_so(raw_archive, tmp_path, reader):
    env = dict(os.environ, TMPDIR=deep_folder(tmp_path, 100))
    done = subprocess.run([sys.executable, "-c", READ, raw_archive, reader], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0, done.stdout
    assert "TempDirTooDeepError" in done.stderr and "TMPDIR" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_raw_batches_gathered_by_threads_need_no_socket(raw_archive, tmp_path):
    env = dict(os.environ, TMPDIR=deep_folder(tmp_path, 100))
    done = subprocess.run([sys.executable, "-c", READ, raw_archive, "threads"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "read 8" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_workers_under_a_temporary_folder_just_short_enough_read_everything(raw_archive, tmp_path):
    folder = deep_folder(tmp_path, temp_dir.SOCKET_PATH_MAX - temp_dir.SOCKET_BELOW_TEMP_DIR)
    done = subprocess.run([sys.executable, "-c", READ, raw_archive, "dataset"], env=dict(os.environ, TMPDIR=folder),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "read 8" in done.stdout, done.stderr[-3000:]


def test_the_socket_path_is_counted_from_the_temporary_folder(tmp_path, monkeypatch):
    folder = deep_folder(tmp_path, 90)
    monkeypatch.setattr("tempfile.tempdir", folder)
    monkeypatch.delitem(temp_dir.multiprocessing.current_process()._config, "tempdir", raising=False)
    assert temp_dir.socket_path_bytes() == 90 + temp_dir.SOCKET_BELOW_TEMP_DIR
    assert "TMPDIR" in temp_dir.problem()
    advice = [a for a in doctor.diagnose(str(tmp_path))["advice"] if a["topic"] == "tempdir"]
    assert [a["level"] for a in advice] == ["warning"] and folder in advice[0]["message"]
