"""The command line end to end: convert (every format and mode, interrupted, killed), info, verify, errors."""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import lmdb
import numpy as np
import psutil
import pytest

import packed_formats as pf
from packed_formats import cli, errors
from packed_formats.synthetic import make_image_folder

from .conftest import ARCHIVE_KINDS, CLASSES, PER_CLASS, kind_id

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = len(CLASSES) * PER_CLASS


def run_cli(*args, env=None, cwd=None, timeout=180):
    """``python -m packed_formats ARGS`` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "packed_formats", *map(str, args)],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
    )


def temp_files(directory):
    return [name for name in os.listdir(directory) if ".pf-tmp-" in name]


def sample_byte_position(path, fmt, i, k):
    """(file, position) of byte k of sample i's stored payload, found through the archive's own index."""
    with pf.open_archive(path) as reader:
        m, index = reader.manifest, reader.index
        start = i * m.sample_nbytes if m.mode == "raw" else int(index.offsets[i])
        if fmt == "zip":
            return path, int(index.positions[i]) + k
        if fmt == "memmap":
            name = os.path.join(path, "images.npy" if m.mode == "raw" else "data.npy")
            return name, np.load(name, mmap_mode="r").offset + start + k
    if fmt == "hdf5":
        with h5py.File(path, "r") as file:
            data = file["images"] if m.mode == "raw" else file["data"]
            chunk = data.chunks[0] if m.mode == "encoded" else 1
            first = (start + k) // (chunk if m.mode == "encoded" else m.sample_nbytes)
            coord = (first * chunk,) + (0,) * (data.ndim - 1)
            within = (start + k) - first * (chunk if m.mode == "encoded" else m.sample_nbytes)
            return path, data.id.get_chunk_info_by_coord(coord).byte_offset + within
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    try:
        with env.begin(buffers=True) as txn:
            value = txn.get(b"%010d" % i)
            return path, mapped_file_position(path, np.frombuffer(value, dtype=np.uint8).ctypes.data) + k
    finally:
        env.close()


def mapped_file_position(path, address):
    """The file position behind ``address`` in this process's memory map of ``path`` (Linux)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if len(fields) >= 6 and os.path.realpath(fields[5]) == real and start <= address < end:
                return address - start + int(fields[2], 16)
    raise AssertionError(f"{path} is not mapped at {address:#x}")


def copy_archive(path, directory):
    target = os.path.join(directory, os.path.basename(path))
    (shutil.copytree if os.path.isdir(path) else shutil.copy2)(path, target)
    return target


# ---- convert, end to end ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", [k if k == ("zip", "raw") else pytest.param(k, marks=pytest.mark.slow) for k in ARCHIVE_KINDS], ids=kind_id
)
def test_convert_command_writes_a_complete_archive(tmp_path, image_folder, kind):
    fmt, mode = kind
    dst = tmp_path / f"out.{fmt}"
    size = ["--size", "24x32"] if mode == "raw" else []
    done = run_cli("convert", image_folder, dst, "--format", fmt, "--mode", mode, *size, "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert f"{N} samples, {len(CLASSES)} classes" in done.stdout
    source = pf.open_archive(image_folder)
    with pf.open_archive(dst) as reader:
        assert (reader.manifest.format, reader.mode, len(reader)) == (fmt, mode, N)
        assert list(reader.labels) == list(source.labels)
        if mode == "raw":
            assert reader.read_many(range(N)).shape == (N, 24, 32, 3)
        else:
            assert [reader.read(i) for i in range(N)] == [source.read(i) for i in range(N)]
    assert temp_files(tmp_path) == []


@pytest.mark.slow
def test_tools_convert_script_writes_the_same_archive_as_the_command(tmp_path, image_folder):
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    options = ["--format", "zip", "--mode", "raw", "--size", "16", "--quiet"]
    by_script = subprocess.run(
        [sys.executable, "tools/convert.py", image_folder, tmp_path / "a.zip", *options],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=180,
    )
    by_command = run_cli("convert", image_folder, tmp_path / "b.zip", *options, env=env)
    assert by_script.returncode == 0 and by_command.returncode == 0, by_script.stderr + by_command.stderr
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()


@pytest.mark.parametrize("command", ["convert", "info", "verify"])
def test_help_shows_examples(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "examples:" in out and f"packed-formats {command} " in out.split("examples:")[1]


# ---- interruption ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory):
    """300 images: enough work that a conversion can be interrupted part-way."""
    root = tmp_path_factory.mktemp("big") / "images"
    return make_image_folder(root, images_per_class=100, classes=CLASSES, sizes=(180, 260), seed=3)


def start_slow_conversion(src, dst, format="zip"):
    """A conversion that takes a few seconds (PNG re-encoding), in its own session."""
    return subprocess.Popen(
        [sys.executable, "-m", "packed_formats", "convert", str(src), str(dst), "--format", format,
         "--mode", "encoded", "--size", "160", "--encoding", "png", "--workers", "2", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def wait_until_writing(process, directory, timeout=120):
    """Return the conversion's worker processes once its temporary archive exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if temp_files(directory):
            return psutil.Process(process.pid).children(recursive=True)
        assert process.poll() is None, "the conversion ended before it could be interrupted"
        time.sleep(0.005)
    raise AssertionError("no temporary archive appeared")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_conversion_removes_its_temp_files_and_exits_nonzero(tmp_path, big_folder, how):
    dst = tmp_path / "out.zip"
    process = start_slow_conversion(big_folder, dst)
    workers = wait_until_writing(process, tmp_path)
    if how == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)  # a terminal sends it to the whole process group
    else:
        process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == (130 if how == "ctrl-c" else 143), err
    assert "interrupted" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []
    assert psutil.wait_procs(workers, timeout=10)[1] == []


@pytest.mark.slow
def test_existing_destination_survives_an_interrupted_overwrite(tmp_path, big_folder):
    dst = tmp_path / "out.zip"
    dst.write_bytes(b"precious")
    process = subprocess.Popen(
        [sys.executable, "-m", "packed_formats", "convert", str(big_folder), str(dst), "--mode", "encoded",
         "--size", "160", "--encoding", "png", "--workers", "2", "--quiet", "--overwrite"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_until_writing(process, tmp_path)
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode == 130
    assert os.listdir(tmp_path) == ["out.zip"] and dst.read_bytes() == b"precious"


def tree_bytes(path) -> dict:
    """{relative file name: content} of an archive (a file, or a directory's files)."""
    if not os.path.isdir(path):
        return {"": open(path, "rb").read()}
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


@pytest.mark.slow
@pytest.mark.parametrize("fmt,moment", [("zip", 0.0), ("hdf5", 0.3), ("lmdb", 0.6), ("memmap", 0.9)])
def test_killed_conversion_leaves_no_archive_and_a_rerun_is_byte_identical(tmp_path, big_folder, fmt, moment):
    dst = tmp_path / f"out.{fmt}"
    process = start_slow_conversion(big_folder, dst, fmt)
    workers = wait_until_writing(process, tmp_path)
    time.sleep(moment)  # at another moment of the conversion for each format
    process.kill()
    process.communicate(timeout=60)
    assert not dst.exists()
    assert psutil.wait_procs(workers, timeout=10)[1] == [], "orphaned workers must exit by themselves"
    options = ["--format", fmt, "--mode", "raw", "--size", "16", "--quiet"]
    rerun = run_cli("convert", big_folder, dst, *options)
    assert rerun.returncode == 0, rerun.stderr
    assert len(pf.open_archive(dst)) == 3 * 100 and pf.verify_archive(dst).ok
    assert temp_files(tmp_path) == [], "the dead conversion's temporary file is cleaned up"
    reference = tmp_path / "reference" / f"out.{fmt}"
    reference.parent.mkdir()
    assert run_cli("convert", big_folder, reference, *options).returncode == 0
    assert tree_bytes(dst) == tree_bytes(reference)


@pytest.mark.slow
def test_a_killed_worker_fails_the_conversion_with_a_clear_error(tmp_path, big_folder):
    dst = tmp_path / "out.zip"
    process = start_slow_conversion(big_folder, dst)
    workers = wait_until_writing(process, tmp_path)
    workers[0].kill()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    assert "worker process died" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


# ---- info and verify ------------------------------------------------------------------


def test_info_describes_the_archive(capsys, archives, image_folder):
    assert cli.main(["info", archives[("hdf5", "raw")]]) == 0
    out = capsys.readouterr().out
    source = pf.open_archive(image_folder)
    counts = np.bincount(source.labels)
    assert "hdf5" in out and "raw" in out and f"samples     {N}" in out and "24x32x3" in out
    assert f"packed_formats {pf.__version__}" in out and "KiB on disk" in out
    for c, name in enumerate(CLASSES):
        assert re.search(rf"^ +{c} +{name} +{counts[c]}$", out, re.MULTILINE), name


def test_info_shows_the_encoding_of_an_encoded_archive(capsys, archives):
    assert cli.main(["info", archives[("lmdb", "encoded")]]) == 0
    assert "encoding    jpeg" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_verify_passes_an_intact_archive(capsys, archives, kind):
    assert cli.main(["verify", archives[kind], "--quiet"]) == 0
    assert f"{N} samples, checksums checked: OK" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_verify_reports_a_flipped_byte_inside_a_sample(tmp_path, capsys, archives, kind):
    path = copy_archive(archives[kind], tmp_path)
    with pf.open_archive(path) as reader:
        payload, key = reader.read_bytes(5), reader.key(5)
    name, position = sample_byte_position(path, kind[0], 5, len(payload) // 2)
    with open(name, "r+b") as file:
        file.seek(position)
        original = file.read(1)
        assert original == payload[len(payload) // 2 : len(payload) // 2 + 1]
        file.seek(position)
        file.write(bytes([original[0] ^ 0x01]))
    assert cli.main(["verify", path, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"sample index 5, key {key!r}" in out and "checksum mismatch" in out and "FAILED: 1 bad" in out


def test_verify_decode_catches_a_sample_that_does_not_decode(tmp_path, capsys, image_folder):
    source = pf.open_archive(image_folder)
    path = tmp_path / "cut.zip"
    with pf.open_writer(path, format="zip", mode="encoded", classes=source.classes) as writer:
        for i in range(3):
            data = source.read(i)
            writer.add(data[: len(data) // 2] if i == 1 else data, int(source.labels[i]), source.key(i))
    assert cli.main(["verify", str(path), "--quiet"]) == 0  # the checksums are right...
    capsys.readouterr()
    assert cli.main(["verify", str(path), "--decode", "--quiet"]) == 1  # ...but the image is cut short
    assert f"sample index 1, key {source.key(1)!r}" in capsys.readouterr().out


def test_a_part_name_with_control_characters_is_printed_escaped_by_info_and_verify(tmp_path, capsys, image_folder):
    """A set's part names come from its index: one with a terminal's escape sequence in it is shown as Python
    writes it (``\\x1b``), as a key is, in what ``info`` and ``verify`` print, and in their errors."""
    stem = "set\x1b[31mRED\x1b[0m"  # a sealed index names its parts after it: set\x1b[31mRED\x1b[0m-00000.zip
    index = tmp_path / f"{stem}.zip"
    pf.convert(image_folder, index, format="zip", shard_size=10, quiet=True, workers=1)
    assert (tmp_path / f"{stem}-00001.zip").exists()
    escaped = r"set\x1b[31mRED\x1b[0m"
    for command in (["info", str(index)], ["info", "--json", str(index)], ["verify", "--quiet", str(index)]):
        assert cli.main(command) == 0
        out, err = capsys.readouterr()
        assert "\x1b" not in out + err and "RED" in out, command
    assert f"{tmp_path}/{escaped}.zip: {N} samples, checksums checked: OK" in out  # verify's verdict
    shutil.copyfile(tmp_path / f"{stem}-00000.zip", tmp_path / f"{stem}-00001.zip")  # part 0 where 1 should be
    for command in (["info", str(index)], ["verify", "--quiet", str(index)]):
        assert cli.main(command) == 2
        out, err = capsys.readouterr()
        assert "\x1b" not in out + err and f"{tmp_path}/{escaped}-00001.zip" in err, (command, err)


# ---- user mistakes --------------------------------------------------------------------


@pytest.fixture
def mistakes(tmp_path, image_folder):
    (tmp_path / "notes.txt").write_text("not an archive")
    (tmp_path / "exists.zip").write_bytes(b"x")
    t = str(tmp_path)
    return {
        "missing-source": ["convert", f"{t}/nope", f"{t}/o.zip"],
        "existing-destination": ["convert", image_folder, f"{t}/exists.zip"],
        "unknown-extension": ["convert", image_folder, f"{t}/o.weird"],
        "raw-without-size": ["convert", image_folder, f"{t}/o.zip", "--mode", "raw"],
        "bad-size": ["convert", image_folder, f"{t}/o.zip", "--size", "big"],
        "bad-format": ["convert", image_folder, f"{t}/o.zip", "--format", "tar"],
        "bad-workers": ["convert", image_folder, f"{t}/o.zip", "--workers", "0"],
        "info-missing": ["info", f"{t}/nope"],
        "info-not-an-archive": ["info", f"{t}/notes.txt"],
        "verify-missing": ["verify", f"{t}/nope"],
    }


@pytest.mark.parametrize(
    "case",
    ["missing-source", "existing-destination", "unknown-extension", "raw-without-size", "bad-size", "bad-format",
     "bad-workers", "info-missing", "info-not-an-archive", "verify-missing"],
)
def test_user_mistakes_give_a_one_line_error_and_exit_2(capsys, mistakes, case):
    try:
        code = cli.main(mistakes[case])
    except SystemExit as exc:  # argparse rejects bad option values itself
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"packed-formats {mistakes[case][0]}: error: ")


def test_a_bad_option_value_is_one_line_naming_the_option(capsys, image_folder, tmp_path):
    with pytest.raises(SystemExit) as exit:
        cli.main(["convert", image_folder, str(tmp_path / "o.zip"), "--format", "tar"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "packed-formats convert: error: argument --format: invalid choice: 'tar' "
        "(choose from 'zip', 'hdf5', 'lmdb', 'memmap'); see packed-formats convert --help"
    ]


def test_an_unknown_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["pack"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("packed-formats: error: argument COMMAND: invalid choice: 'pack'")


def test_an_os_error_is_one_line_with_the_file_and_the_reason(capsys, monkeypatch):
    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/train.zip")

    monkeypatch.setattr("packed_formats.commands.info.describe", denied)
    assert cli.main(["info", "/data/train.zip"]) == 2
    assert capsys.readouterr().err.splitlines() == ["packed-formats info: error: /data/train.zip: Permission denied"]


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs Linux's read-only /sys")
def test_an_unwritable_destination_is_one_line_naming_it(capsys, image_folder):
    assert cli.main(["convert", image_folder, "/sys/x.zip", "--workers", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("packed-formats convert: error: /sys/x.zip: cannot write the archive: ")


ERROR_CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.PackedFormatError)),
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_fields_and_prints_as_one_line(cls):
    error = cls("/data/train.zip", "went wrong", index=3, key="cats/1.jpg", hint="do this")
    copy = pickle.loads(pickle.dumps(error))  # as it crosses a DataLoader worker boundary
    assert type(copy) is cls
    assert (copy.path, copy.problem, copy.index, copy.key, copy.hint) == (
        "/data/train.zip", "went wrong", 3, "cats/1.jpg", "do this"
    )
    expected = "/data/train.zip [sample index 3, key 'cats/1.jpg']: went wrong (do this)"
    assert cli.user_error(copy) == str(error) == expected


def test_a_missing_optional_package_says_what_to_install(capsys, monkeypatch):
    def needs_matplotlib(path):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr("packed_formats.commands.info.describe", needs_matplotlib)
    assert cli.main(["info", "x.zip"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "pip install matplotlib" in err and "'.[plot]'" in err


@pytest.fixture
def no_benchmark(monkeypatch):
    """Fail the test if bench gets as far as benchmarking."""
    def run_benchmark(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("packed_formats.bench.run_benchmark", run_benchmark)


def test_bench_plot_without_matplotlib_fails_before_benchmarking(capsys, monkeypatch, archives, tmp_path, no_benchmark):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert cli.main(["bench", archives[("zip", "raw")], "--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("packed-formats bench: error: ") and "pip install matplotlib" in err


def test_bench_out_in_a_missing_directory_fails_before_benchmarking(capsys, archives, tmp_path, no_benchmark):
    out = tmp_path / "no-such-dir" / "r.json"
    assert cli.main(["bench", archives[("zip", "raw")], "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"packed-formats bench: error: {out}: cannot write it: No such file or directory (choose another path)"
    ]


@pytest.mark.slow
def test_command_line_errors_print_no_traceback(tmp_path):
    done = run_cli("convert", tmp_path / "nope", tmp_path / "out.zip")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"packed-formats convert: error: {tmp_path / 'nope'}: no such file or directory (check the source path)"
    ]


def test_info_counts_the_parts_of_a_sharded_archive(tmp_path, capsys, image_folder):
    pf.convert(image_folder, tmp_path / "data.zip", shard_size=10, workers=1, quiet=True)
    assert cli.main(["info", str(tmp_path / "data.zip")]) == 0
    out = capsys.readouterr().out
    assert "sharded (3 zip parts)" in out and f"samples     {N}" in out


def test_a_reader_that_stops_early_gets_no_broken_pipe_noise(tmp_path):
    path = os.fspath(tmp_path / "many.memmap")
    classes = [f"class-{i:05d}" for i in range(6000)]  # more text than a pipe's buffer holds
    with pf.open_writer(path, format="memmap", mode="raw", shape=(2, 2, 3), classes=classes) as writer:
        for i in range(len(classes)):
            writer.add(np.zeros((2, 2, 3), np.uint8), i, f"k{i}")
    for extra in ([], ["--json"]):
        shell = f"{sys.executable} -m packed_formats info {path} --all-classes {' '.join(extra)} | head -n 1"
        done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=300)
        assert done.stdout.count("\n") == 1
        assert done.stderr == "", done.stderr
