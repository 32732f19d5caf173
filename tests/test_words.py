"""Words that mislead a new user: each command's message on files the test writes says what happened and
what to do, and no advice that does not apply (a raw archive, a list file, a missing field member)."""

from __future__ import annotations

import csv
import inspect
import io
import os
import re
import runpy
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

import packed_formats as pf
from packed_formats import cli

ROOT = Path(__file__).resolve().parent.parent


def jpeg(color: int = 90) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 12), (color, 30, 200)).save(out, format="JPEG")
    return out.getvalue()


def write_folder(root: Path, classes=("cat", "dog"), per_class: int = 3) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"{i:04d}.jpg").write_bytes(jpeg(40 * c + i))
    return root


def run_cli(capsys, *args) -> "tuple[int, str, str]":
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- doctor -------------------------------------------------------------------------------------
@pytest.mark.slow  # a doctor process pinned to one CPU
@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_doctor_advises_a_raw_archive_only_for_an_archive_that_is_not_one(tmp_path, mode):
    src = write_folder(tmp_path / "images")
    archive = tmp_path / f"data-{mode}.zip"
    pf.convert(src, archive, mode=mode, size=16, workers=1, quiet=True)
    cpu = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-m", "packed_formats", "doctor", os.fspath(archive)], capture_output=True, text=True,
        timeout=300, cwd=ROOT, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),  # decoding's bottleneck
    )
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "Only 1 CPU(s)" in text
    if mode == "raw":
        assert "raw-mode archive" not in text and "raw archive" in text and "needs no decoding" in text
    else:
        assert "use a raw-mode archive" in text


# ---- files skipped ------------------------------------------------------------------------------
def test_convert_names_the_files_it_skips_and_says_a_gif_is_never_read(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    Image.new("RGB", (8, 8)).save(src / "cat" / "anim.gif")
    (src / "dog" / "notes.txt").write_text("not an image")
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out.zip", "--workers", "1")
    assert code == 0, err
    assert "6 samples" in out and "2 files skipped" in out
    assert "cat/anim.gif, dog/notes.txt" in out
    assert ".gif images are never read" in out and "convert them to PNG" in out


def test_convert_names_the_first_files_skipped_and_verbose_all(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    for i in range(8):
        (src / "dog" / f"caption{i}.txt").write_text("a dog")
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out.zip", "--workers", "1")
    assert code == 0, err
    assert "8 files skipped" in out and "dog/caption4.txt and 3 more (--verbose lists them)" in out
    assert "caption5" not in out and "never read" not in out
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "all.zip", "--workers", "1", "--verbose")
    assert code == 0, err
    assert ", ".join(f"dog/caption{i}.txt" for i in range(8)) in out and "more" not in out


def test_skipped_names_that_do_not_print_are_shown_escaped(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    (src / "cat" / "two\nlines.txt").write_text("x")
    with open(os.path.join(os.fsencode(src / "dog"), b"caf\xe9.txt"), "w") as file:  # not UTF-8
        file.write("x")
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out.zip", "--workers", "1")
    assert code == 0, err
    assert out.count("\n") == 1 and "2 files skipped" in out
    assert "cat/two\\nlines.txt" in out and "dog/caf\\xe9.txt" in out


def test_info_names_the_files_a_container_would_skip(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    Image.new("RGB", (8, 8)).save(src / "dog" / "old.gif")
    with tarfile.open(tmp_path / "data.tar", "w") as tar:
        tar.add(src, arcname="images")
    code, out, err = run_cli(capsys, "info", tmp_path / "data.tar")
    assert code == 0, err
    assert "1 file (no image of a kind read" in out and "images/dog/old.gif" in out and ".gif images" in out


# ---- fields -------------------------------------------------------------------------------------
def test_a_field_without_its_equals_sign_is_told_the_kinds(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out.zip", "--field", "seg:image")
    assert code == 2
    assert "'seg:image'" in err and "seg=image" in err
    for kind in ("image", "array:DTYPE[", "bytes", "text", "json"):
        assert kind in err
    assert not (tmp_path / "out.zip").exists()


def test_an_unknown_field_kind_is_told_the_kinds(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out.zip", "--field", "seg=mask")
    assert code == 2
    assert "'mask'" in err and "image, array:DTYPE[D0,...], bytes, text or json" in err


def write_shard(path: Path, samples) -> Path:
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for extension, data in members.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_a_missing_field_member_is_told_about_the_field_not_the_keys(tmp_path, capsys):
    shard = write_shard(tmp_path / "shard-000.tar", [
        ("s0", {"jpg": jpeg(), "cls": b"0", "seg.png": b""}),
        ("s1", {"jpg": jpeg(), "cls": b"1"}),
    ])
    code, _, err = run_cli(capsys, "convert", shard, tmp_path / "out.zip", "--field", "seg=image")
    assert code == 2
    assert "shard-000.tar" in err and "'s1'" in err and "field 'seg'" in err
    assert "--label-key" not in err and "--image-key" not in err
    assert "--on-error skip" in err and "--field seg" in err


def test_a_missing_label_member_is_told_the_label_key(tmp_path, capsys):
    shard = write_shard(tmp_path / "shard-000.tar", [("s0", {"jpg": jpeg(), "cls": b"0"}), ("s1", {"jpg": jpeg()})])
    code, _, err = run_cli(capsys, "convert", shard, tmp_path / "out.zip")
    assert code == 2
    assert "'s1'" in err and "no .cls label member" in err and "--label-key" in err and "--image-key" not in err


# ---- destination --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, name, suggested", [("hdf5", "x.zip", "x.h5"), ("zip", "x.lmdb", "x.zip"),
                                                  ("memmap", "x.hdf5", "x.memmap")])
def test_a_format_that_does_not_match_the_extension_is_refused(tmp_path, capsys, fmt, name, suggested):
    src = write_folder(tmp_path / "images")
    dst = tmp_path / name
    code, out, err = run_cli(capsys, "convert", src, dst, "--format", fmt, "--workers", "1")
    assert code == 2 and out == ""
    assert os.fspath(dst) in err and f"--format {fmt}" in err and suggested in err
    assert not dst.exists() and sorted(os.listdir(tmp_path)) == ["images"]
    with pytest.raises(ValueError, match=re.escape(suggested)):
        pf.convert(src, dst, format=fmt, quiet=True)


def test_a_format_matching_the_extension_or_an_unknown_extension_converts(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    for fmt, name in (("hdf5", "x.h5"), ("hdf5", "x.hdf5"), ("lmdb", "x.data")):
        code, _, err = run_cli(capsys, "convert", src, tmp_path / name, "--format", fmt, "--workers", "1", "--quiet")
        assert code == 0, err
        assert pf.detect_format(tmp_path / name) == fmt


def test_stage_to_a_folder_that_does_not_exist_says_it_made_it(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    archive = tmp_path / "train.zip"
    pf.convert(src, archive, workers=1, quiet=True)
    to = tmp_path / "node" / "local"
    code, out, err = run_cli(capsys, "stage", archive, "--to", to)
    assert code == 0, err
    assert out.strip() == os.fspath(to / "train.zip")
    assert f"{to} did not exist: it was created" in err
    code, out, err = run_cli(capsys, "stage", archive, "--to", to)  # there now: nothing to say about it
    assert code == 0 and "created" not in err


# ---- labels -------------------------------------------------------------------------------------
def test_a_one_class_list_file_is_told_to_check_its_labels_not_subdir(tmp_path, capsys):
    src = write_folder(tmp_path / "images")
    listing = tmp_path / "train.csv"
    with open(listing, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["path", "label"])
        writer.writerows([f"images/{p.parent.name}/{p.name}", "animal"] for p in sorted(src.glob("*/*.jpg")))
    code, _, err = run_cli(capsys, "info", listing)
    assert code == 0, err
    [warning] = [line for line in err.splitlines() if "warning" in line]
    assert "train.csv" in warning and "1 class found ('animal')" in warning
    assert "--subdir" not in warning and "dataset.json" not in warning
    assert "label" in warning.split("1 class found", 1)[1]


def test_a_one_class_folder_is_still_told_about_subdir(tmp_path, capsys):
    src = write_folder(tmp_path / "images", classes=("train",))
    code, _, err = run_cli(capsys, "info", src, "--source-format", "folder")
    assert code == 0, err
    assert "1 class found ('train')" in err and "--subdir" in err


# ---- the API reference --------------------------------------------------------------------------
def napoleon_text(obj) -> str:
    """``obj``'s docstring as the reference renders it: through napoleon with docs/conf.py's settings."""
    napoleon = pytest.importorskip("sphinx.ext.napoleon")
    settings = runpy.run_path(os.fspath(ROOT / "docs" / "conf.py"))
    config = napoleon.Config(**{k: v for k, v in settings.items() if k.startswith("napoleon_")})
    return str(napoleon.GoogleDocstring(inspect.getdoc(obj) or "", config, what="class"))


GROUPED = re.compile(r"^ +(\w+(?:, \w+)+): (\S.*)$", re.MULTILINE)  # "a, b: what both are"


@pytest.mark.parametrize("obj", [pf.PackedDataset, pf.convert, pf.make_loader, pf.ConvertSummary],
                         ids=lambda obj: obj.__name__)
def test_the_reference_describes_grouped_arguments_once(obj):
    groups = GROUPED.findall(inspect.getdoc(obj) or "")
    if not groups:
        pytest.skip("no grouped arguments here")
    text = napoleon_text(obj)
    for names, description in groups:
        assert text.count(description) == 1, names


def test_the_reference_says_target_transform_gets_the_label_only():
    text = " ".join(napoleon_text(pf.PackedDataset).split())
    assert "applied to the image and the label" not in text
    assert re.search(r"target_transform\W+(\w+ ){0,6}(applied to|gets) the label", text), text
