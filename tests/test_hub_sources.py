"""Datasets as the Hugging Face Hub hands them out: parquet shards with their dataset card, and the Arrow
folders ``datasets``' save_to_disk writes, read with pyarrow alone (no ``datasets`` library)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import cli
from packed_formats.sources import detect_source, open_source
from packed_formats.writing.convert import convert

from .conftest import CLASSES, PER_CLASS
from .test_sources import contents, folder_samples

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = len(CLASSES) * PER_CLASS
FEATURES = {"image": {"_type": "Image"}, "label": {"names": list(CLASSES), "_type": "ClassLabel"}}


# ---- writing the two layouts ---------------------------------------------------------------------------
def image_table(rows, image="image", label="label", extra=None):
    """A table of (bytes or None, path or None, label) rows: an Image struct column and an int64 label column,
    with the features ``datasets`` keeps in the schema metadata."""
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": b, "path": p} for b, p, _ in rows], type=struct)
    labels = pa.array([y for _, _, y in rows], type=pa.int64())
    columns = {image: images, label: labels, **(extra or {})}
    metadata = {b"huggingface": json.dumps({"info": {"features": {image: FEATURES["image"],
                                                                   label: FEATURES["label"]}}}).encode()}
    return pa.table(columns).replace_schema_metadata(metadata)


def sample_rows(image_folder):
    return [(data, key.rsplit("/", 1)[-1], label) for key, label, data in folder_samples(image_folder)]


def card(names=CLASSES, mapping=True, splits=("train",)):
    """A dataset card whose YAML front matter has the class_label names and the configs' data_files."""
    listed = "".join(f"          '{c}': {n}\n" if mapping else f"          - {n}\n" for c, n in enumerate(names))
    files = "".join(f"  - split: {s}\n    path: data/{s}-*\n" for s in splits)
    return ("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n  - name: label\n    dtype:\n"
            f"      class_label:\n        names:\n{listed}configs:\n- config_name: default\n  data_files:\n{files}"
            "---\n\n# A dataset\n")


def write_hub(root, rows, shards=3, split="train", with_card=True, row_group_size=5, names=CLASSES):
    """``data/<split>-0000k-of-0000n.parquet`` shards (rows in order) and README.md, as the Hub has them."""
    os.makedirs(root / "data", exist_ok=True)
    per = -(-len(rows) // shards)
    paths = []
    for s in range(shards):
        path = root / "data" / f"{split}-{s:05d}-of-{shards:05d}.parquet"
        pq.write_table(image_table(rows[s * per:(s + 1) * per]), path, row_group_size=row_group_size)
        paths.append(path)
    if with_card:
        (root / "README.md").write_text(card(names))
    return paths


def write_saved(folder, rows, files=2, split="train", batch=4, features=FEATURES):
    """A save_to_disk folder: data-0000k-of-0000n.arrow streams, dataset_info.json and state.json."""
    os.makedirs(folder, exist_ok=True)
    per = -(-len(rows) // files)
    names = []
    for f in range(files):
        names.append(f"data-{f:05d}-of-{files:05d}.arrow")
        table = image_table(rows[f * per:(f + 1) * per])
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for chunk in table.to_batches(max_chunksize=batch):
                writer.write_batch(chunk)
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": features,
                                                          "homepage": "", "license": ""}))
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": split,
    }))
    return [folder / n for n in names]


def folder_bytes(image_folder):
    return [data for _, _, data in folder_samples(image_folder)]


def folder_labels(image_folder):
    return [label for _, label, _ in folder_samples(image_folder)]


# ---- converting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_encoded_samples_are_the_columns_bytes_with_the_cards_classes(tmp_path, image_folder, layout):
    rows = sample_rows(image_folder)
    src = tmp_path / "dataset"
    write_hub(src, rows) if layout == "hub" else write_saved(src, rows)
    assert detect_source(src) == ("parquet" if layout == "hub" else "arrow")
    summary = convert(src, tmp_path / "out.zip", workers=2, quiet=True)
    keys, labels, classes, stored = contents(tmp_path / "out.zip")
    assert summary.samples == N and summary.failed == []
    assert stored == folder_bytes(image_folder)  # byte-identical: no decode and re-encode
    assert labels == folder_labels(image_folder) and classes == list(CLASSES)
    assert keys == [f"{i:08d}" for i in range(N)]


@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_raw_conversion_gives_the_folders_pixels(tmp_path, image_folder, layout):
    src = tmp_path / "dataset"
    write_hub(src, sample_rows(image_folder)) if layout == "hub" else write_saved(src, sample_rows(image_folder))
    convert(src, tmp_path / "out.memmap", mode="raw", size=(24, 32), workers=2, quiet=True)
    convert(image_folder, tmp_path / "folder.memmap", mode="raw", size=(24, 32), workers=1, quiet=True)
    ours, theirs = contents(tmp_path / "out.memmap"), contents(tmp_path / "folder.memmap")
    assert ours[1] == theirs[1]
    assert all(np.array_equal(a, b) for a, b in zip(ours[3], theirs[3]))


@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_any_number_of_workers_writes_the_same_archive(tmp_path, image_folder, layout):
    src = tmp_path / "dataset"
    write_hub(src, sample_rows(image_folder)) if layout == "hub" else write_saved(src, sample_rows(image_folder))
    convert(src, tmp_path / "one.zip", workers=1, quiet=True)
    convert(src, tmp_path / "three.zip", workers=3, quiet=True)
    assert (tmp_path / "one.zip").read_bytes() == (tmp_path / "three.zip").read_bytes()


@pytest.mark.slow
def test_each_row_group_is_read_by_one_worker(tmp_path, image_folder, monkeypatch):
    """Workers are handed whole row groups: none reads a group another worker reads too (with chunks cut
    across groups, every worker read nearly every group: the parquet import's cost at photo sizes)."""
    from packed_formats.sources.hub import ParquetSource

    src, log = tmp_path / "dataset", tmp_path / "reads.log"
    write_hub(src, sample_rows(image_folder), shards=2, row_group_size=4)
    read = ParquetSource._read

    def logged(self, g, local):  # the real read, with which process read which group written down
        with open(log, "a") as file:
            file.write(f"{os.getpid()} {g}\n")
        return read(self, g, local)

    monkeypatch.setattr(ParquetSource, "_read", logged)
    convert(src, tmp_path / "two.zip", workers=2, quiet=True)
    readers = {}
    for line in log.read_text().splitlines():
        pid, group = line.split()
        if int(pid) != os.getpid():  # the main process reads a few samples to size the output
            readers.setdefault(int(group), set()).add(pid)
    assert len(readers) == 6 and all(len(pids) == 1 for pids in readers.values()), readers
    convert(src, tmp_path / "one.zip", workers=1, quiet=True)
    assert (tmp_path / "one.zip").read_bytes() == (tmp_path / "two.zip").read_bytes()


@pytest.mark.slow
def test_a_parts_task_hands_out_its_own_slice_of_the_row_groups(tmp_path, image_folder):
    from packed_formats.writing.parts import SourceRange

    src = tmp_path / "dataset"
    write_hub(src, sample_rows(image_folder), shards=2, row_group_size=4)  # groups start at rows 0, 4, ... 20
    with open_source(src) as source:
        assert source.runs().tolist() == [0, 4, 8, 12, 16, 20]
        assert SourceRange(source, 6, 19).runs().tolist() == [0, 2, 6, 10]  # rows 6-7, 8-11, 12-15, 16-18
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    convert(src, tmp_path / "one" / "set.zip", shard_size=5, workers=1, quiet=True)
    for i in range(2):
        convert(src, tmp_path / "two" / "set.zip", shard_size=5, workers=2, quiet=True, part=(i, 2))
    made = sorted(os.listdir(tmp_path / "one"))
    assert made == sorted(n for n in os.listdir(tmp_path / "two") if not n.startswith("."))  # parts and index
    for name in made:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_one_parquet_file_and_one_arrow_file_are_read_alone(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    [parquet] = write_hub(tmp_path / "hub", rows, shards=1)
    [arrow] = write_saved(tmp_path / "saved", rows, files=1)
    for path, kind in ((parquet, "parquet"), (arrow, "arrow")):
        assert detect_source(path) == kind
        with open_source(path) as source:  # class names from the features the file itself carries
            assert source.classes == CLASSES and [source.load(i) for i in range(N)] == folder_bytes(image_folder)


def test_a_row_group_larger_than_the_batch_is_read_a_slice_at_a_time(tmp_path, image_folder, monkeypatch):
    from packed_formats.sources import hub

    [path] = write_hub(tmp_path / "hub", sample_rows(image_folder), shards=1, row_group_size=N)
    monkeypatch.setattr(hub, "_BATCH_BYTES", 1)  # one row at a time
    with open_source(path) as source:
        order = [5, 6, 7, 2, 23, 0]  # forward in the same group, then back, then jumps
        got = [source.load(i) for i in order]
        assert source._window[2] == 1
    assert got == [folder_bytes(image_folder)[i] for i in order]


def test_the_split_is_chosen_and_several_need_one(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    src = tmp_path / "hub"
    write_hub(src, rows[:15], split="train", with_card=False)
    write_hub(src, rows[15:], shards=1, split="test", with_card=False)
    (src / "README.md").write_text(card(splits=("train", "test")))
    with pytest.raises(pf.InvalidSourceError, match=r"several splits \(test, train\).*--split"):
        open_source(src)
    with open_source(src, subdir="test") as source:
        assert len(source) == N - 15 and source.load(0) == rows[15][0]
    with pytest.raises(pf.InvalidSourceError, match="has no split 'valid'.*test, train"):
        open_source(src, subdir="valid")


def test_config_split_folders_of_the_parquet_conversion_are_splits(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    for split, part in (("train", rows[:20]), ("test", rows[20:])):
        os.makedirs(tmp_path / "hub" / "default" / split)
        pq.write_table(image_table(part), tmp_path / "hub" / "default" / split / "0000.parquet")
    with open_source(tmp_path / "hub", subdir="train") as source:
        assert len(source) == 20 and "default/train" in source.layout


def test_a_dataset_dict_folder_is_read_by_split(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    write_saved(tmp_path / "dd" / "train", rows[:12], split="train")
    write_saved(tmp_path / "dd" / "test", rows[12:], files=1, split="test")
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with open_source(tmp_path / "dd", subdir="test") as source:
        assert len(source) == N - 12 and source.classes == CLASSES


@pytest.mark.parametrize("mapping", [True, False], ids=["mapping", "list"])
def test_class_names_come_from_the_card(tmp_path, image_folder, mapping):
    src = tmp_path / "hub"
    table = image_table(sample_rows(image_folder)).replace_schema_metadata(None)
    os.makedirs(src / "data")
    pq.write_table(table, src / "data" / "train-00000-of-00001.parquet")
    (src / "README.md").write_text(card(names=("a", "b", "c"), mapping=mapping))
    with open_source(src) as source:
        assert source.classes == ("a", "b", "c")


def test_without_names_the_classes_are_the_label_values(tmp_path, image_folder):
    path = tmp_path / "x.parquet"
    pq.write_table(image_table(sample_rows(image_folder)).replace_schema_metadata(None), path)
    with open_source(path) as source:
        assert source.classes == ("0", "1", "2")


def test_a_class_name_with_a_control_character_is_refused(tmp_path, image_folder):
    src = tmp_path / "hub"
    write_hub(src, sample_rows(image_folder), names=("boxes", '"cir\\ncles"', "stripes"))
    with pytest.raises(pf.InvalidSourceError, match=r"class name 'cir\\ncles' has a control character"):
        open_source(src)


# ---- columns --------------------------------------------------------------------------------------------
def test_columns_are_named_when_they_cannot_be_told_apart(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    extra = {"coarse": pa.array([0] * N, type=pa.int64())}
    path = tmp_path / "x.parquet"
    pq.write_table(image_table(rows, label="fine", extra=extra).replace_schema_metadata(None), path)
    with pytest.raises(pf.InvalidSourceError, match=r"several label columns \(fine, coarse\).*--label-column.*"
                       r"image \(struct<bytes: binary, path: string>\)"):
        open_source(path)
    with open_source(path, label_key="fine") as source:
        assert list(source.labels) == folder_labels(image_folder)
    with pytest.raises(pf.InvalidSourceError, match="has no image column 'img'.*its columns: image"):
        open_source(path, label_key="fine", image_key="img")


def test_the_column_options_on_the_command_line(tmp_path, image_folder, capsys):
    path = tmp_path / "x.parquet"
    table = image_table(sample_rows(image_folder), image="img", label="fine",
                        extra={"coarse": pa.array([0] * N, type=pa.int64())})
    pq.write_table(table.replace_schema_metadata(None), path)
    out = tmp_path / "out.zip"
    args = ["convert", str(path), str(out), "--quiet", "--workers", "1"]
    assert cli.main(args) != 0 and "--label-column" in capsys.readouterr().err
    assert cli.main(args + ["--image-column", "img", "--label-column", "fine"]) == 0
    assert contents(out)[3] == folder_bytes(image_folder)


def test_a_shard_without_the_label_column_is_refused_naming_it(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    paths = write_hub(tmp_path / "hub", rows)
    pq.write_table(image_table(rows[16:], label="target"), paths[2])
    with pytest.raises(pf.InvalidSourceError, match="has no column 'label'") as error:
        convert(tmp_path / "hub", tmp_path / "out.zip", quiet=True)
    assert str(paths[2]) in str(error.value) and "target (int64)" in str(error.value)
    assert not (tmp_path / "out.zip").exists()


def test_a_shard_whose_image_column_is_of_another_type_is_refused_naming_it(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    paths = write_hub(tmp_path / "hub", rows)
    pq.write_table(pa.table({"image": pa.array([p for _, p, _ in rows[16:]]),
                             "label": pa.array([y for _, _, y in rows[16:]], pa.int64())}), paths[2])
    with pytest.raises(pf.InvalidSourceError, match="has column 'image' of type string") as error:
        open_source(tmp_path / "hub")
    assert str(paths[2]) in str(error.value)


def test_a_missing_shard_is_refused(tmp_path, image_folder):
    paths = write_hub(tmp_path / "hub", sample_rows(image_folder))
    os.remove(paths[1])
    with pytest.raises(pf.InvalidSourceError, match="train-00001-of-00003.parquet: is missing.*incomplete"):
        open_source(tmp_path / "hub")


# ---- bad rows and files ------------------------------------------------------------------------------------
KEEP = object()


def bad_rows(image_folder, row, image=KEEP, label=KEEP):
    """The folder's rows with row ``row``'s image (bytes, path) or label replaced."""
    rows = sample_rows(image_folder)
    data, path, old = rows[row]
    rows[row] = (data, path, old) if image is KEEP else (image[0], image[1], old)
    if label is not KEEP:
        rows[row] = rows[row][:2] + (label,)
    return rows


@pytest.mark.parametrize("layout", ["hub", "saved"])
@pytest.mark.parametrize("image, problem", [
    ((None, None), "its image has neither bytes nor a path"),
    ((b"not an image at all", "x.jpg"), "not a recognisable image"),
    ((None, "/etc/hostname"), "'/etc/hostname' is outside the dataset's folder"),
    ((None, "../outside.jpg"), "'../outside.jpg' is outside the dataset's folder"),
    ((None, "missing.jpg"), "'missing.jpg' cannot be read"),
], ids=["empty", "undecodable", "absolute-path", "climbing-path", "missing-path"])
def test_a_bad_image_is_named_by_file_and_row_or_skipped(tmp_path, image_folder, layout, image, problem):
    rows = bad_rows(image_folder, 17, image=image)
    src = tmp_path / "dataset"
    files = write_hub(src, rows) if layout == "hub" else write_saved(src, rows, files=2)
    where = f"{files[2]}:row 1" if layout == "hub" else f"{files[1]}:row 5"
    dst = tmp_path / "out.zip"
    with pytest.raises(pf.CorruptSampleError) as error:
        convert(src, dst, workers=2, quiet=True)
    assert where in str(error.value) and problem in str(error.value) and "00000017" in str(error.value)
    assert not dst.exists() and not [n for n in os.listdir(tmp_path) if ".pf-tmp-" in n]
    summary = convert(src, dst, workers=2, on_error="skip", quiet=True)
    assert summary.samples == N - 1 and len(summary.failed) == 1 and where in summary.failed[0]


def test_a_null_image_struct_is_no_image_whatever_its_children_hold(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    children = [pa.array([b for b, _, _ in rows], pa.binary()), pa.array([p for _, p, _ in rows], pa.string())]
    images = pa.StructArray.from_arrays(children, names=["bytes", "path"], mask=pa.array([i == 4 for i in range(N)]))
    table = pa.table({"image": images, "label": pa.array([y for _, _, y in rows], pa.int64())})
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)  # Arrow keeps the children's values under a null struct (parquet does not)
    with open_source(tmp_path / "x.arrow") as source:
        with pytest.raises(pf.CorruptSampleError, match="x.arrow:row 4 .*neither bytes nor a path"):
            source.load(4)
        assert source.load(5) == rows[5][0]


def test_an_image_by_relative_path_inside_the_folder_is_read(tmp_path, image_folder):
    data = folder_bytes(image_folder)[3]
    rows = bad_rows(image_folder, 3, image=(None, "extracted/train/three.jpg"))
    write_hub(tmp_path / "hub", rows)
    os.makedirs(tmp_path / "hub" / "extracted" / "train")
    (tmp_path / "hub" / "extracted" / "train" / "three.jpg").write_bytes(data)
    with open_source(tmp_path / "hub") as source:
        assert source.load(3) == data


@pytest.mark.parametrize("layout", ["hub", "saved"])
@pytest.mark.parametrize("label, problem", [(3, "has label 3, outside the 3 class names"), (-1, "has label -1"),
                                            (None, "has no label")], ids=["too-big", "negative", "null"])
def test_a_bad_label_is_named_by_file_and_row_or_skipped(tmp_path, image_folder, layout, label, problem):
    rows = bad_rows(image_folder, 9, label=label)
    src = tmp_path / "dataset"
    files = write_hub(src, rows) if layout == "hub" else write_saved(src, rows, files=2)
    where = f"{files[1]}:row 1" if layout == "hub" else f"{files[0]}:row 9"
    with pytest.raises(pf.InvalidSourceError, match=problem) as error:
        convert(src, tmp_path / "out.zip", workers=1, quiet=True)
    assert where in str(error.value)
    summary = convert(src, tmp_path / "out.zip", workers=2, on_error="skip", quiet=True)
    assert summary.samples == N - 1 and where in summary.failed[0]
    kept = [d for i, d in enumerate(folder_bytes(image_folder)) if i != 9]
    assert contents(tmp_path / "out.zip")[3] == kept


@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_a_truncated_file_is_refused_naming_it_and_nothing_is_written(tmp_path, image_folder, layout):
    src = tmp_path / "dataset"
    rows = sample_rows(image_folder)
    files = write_hub(src, rows) if layout == "hub" else write_saved(src, rows)
    os.truncate(files[1], os.path.getsize(files[1]) * 2 // 3)
    with pytest.raises(pf.CorruptArchiveError, match="truncated or damaged") as error:
        convert(src, tmp_path / "out.zip", workers=2, quiet=True)
    assert str(files[1]) in str(error.value)
    assert os.listdir(tmp_path) == ["dataset"]


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/data.arrow"])
def test_state_json_naming_a_file_outside_its_folder_is_refused(tmp_path, image_folder, name):
    folder = tmp_path / "saved"
    write_saved(folder, sample_rows(image_folder), files=1)
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": name}]
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(pf.InvalidSourceError, match="which is not a file of its folder: refused"):
        open_source(folder)


def test_without_pyarrow_the_command_names_the_extra(tmp_path, image_folder, monkeypatch, capsys):
    import sys

    path = tmp_path / "x.parquet"
    pq.write_table(image_table(sample_rows(image_folder)), path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert cli.main(["convert", str(path), str(tmp_path / "out.zip"), "--quiet"]) != 0
    assert "pip install '.[hub]'" in capsys.readouterr().err


def test_info_describes_a_hub_folder(tmp_path, image_folder, capsys):
    write_hub(tmp_path / "hub", sample_rows(image_folder))
    assert cli.main(["info", str(tmp_path / "hub"), "--split", "train"]) == 0
    out = capsys.readouterr().out
    assert "parquet" in out and "images 'image', labels 'label'" in out


# ---- classes the card or the label values make -----------------------------------------------------------
def plain_parquet(path, rows, labels=None, **columns):
    """One parquet file of ``rows`` with no features (the classes come from the label values), ``labels``
    instead of the rows' labels, and further ``columns``."""
    table = image_table(rows, extra=columns).replace_schema_metadata(None)
    if labels is not None:
        table = table.set_column(1, "label", labels)
    pq.write_table(table, path, row_group_size=5)
    return path


@pytest.mark.parametrize("label", [10**12, 5000, "1000000000000"], ids=["huge", "an-id", "huge-text"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_classes_made_from_the_label_values_are_bounded(tmp_path, image_folder, label, on_error):
    rows = bad_rows(image_folder, 7, label=0 if isinstance(label, str) else label)
    labels = pa.array([label if r == 7 else str(y) for r, (_, _, y) in enumerate(rows)]) \
        if isinstance(label, str) else None
    path = plain_parquet(tmp_path / "x.parquet", rows, labels=labels)
    with pytest.raises(pf.InvalidSourceError, match=rf"x.parquet:row 7, column 'label'.*label {label}.*"
                                                    rf"{int(label) + 1} classes.*more than the {N} rows") as error:
        open_source(path, on_error=on_error, label_key="label")
    assert "--label-column" in str(error.value)


def test_label_values_may_name_more_classes_than_rows_up_to_a_few(tmp_path, image_folder):
    rows = bad_rows(image_folder, 7, label=999)  # a few rows of a dataset of a thousand classes
    with open_source(plain_parquet(tmp_path / "x.parquet", rows)) as source:
        assert len(source.classes) == 1000 and source.labels[7] == 999


def hub_with_card(tmp_path, image_folder, names_yaml):
    """A Hub folder whose card's ClassLabel ``names:`` is the YAML text ``names_yaml`` (indented under it)."""
    src = tmp_path / "hub"
    write_hub(src, sample_rows(image_folder))
    text = card()
    start = text.index("        names:\n") + len("        names:\n")
    end = text.index("configs:")
    (src / "README.md").write_text(text[:start] + names_yaml + text[end:])
    return src


@pytest.mark.parametrize("names, problem", [
    ("          - a\n          - b\n          - a\n", "class name 'a' is given twice"),
    ("          - a\n          - ''\n          - c\n", "class name '' is empty"),
    ("          - a\n          - ../x\n          - c\n", "class name '../x' is a path"),
    ("          - a\n          - /abs\n          - c\n", "class name '/abs' is a path"),
    ("          - a\n          - b/../../c\n          - c\n", "class name 'b/../../c' is a path"),
    ("          - a\n          - '..'\n          - c\n", "class name '..' is a path"),
    ("          - a\n          - yes\n          - c\n", "class name True .*is no string.*quote"),
    ("          - a\n          -\n          - c\n", "class name None .*is no string"),
    ("          '0': a\n          '2': '1'\n", "class 1 has no name.*its number '1' is the name of class 2"),
    ("          '0': a\n          '1': b\n          '01': c\n", "class number 1 is given twice"),
    ("          '0': a\n          '1_0': b\n          '2': c\n", "'1_0' is no class number"),
], ids=["twice", "empty", "climbing", "absolute", "slash", "dots", "boolean", "null", "gap", "number-twice",
        "underscore"])
def test_bad_class_names_in_the_card_are_refused_naming_it(tmp_path, image_folder, names, problem):
    src = hub_with_card(tmp_path, image_folder, names)
    with pytest.raises(pf.InvalidSourceError, match=problem) as error:
        open_source(src)
    assert str(src / "README.md") in str(error.value) and "'label'" in str(error.value)


@pytest.mark.parametrize("names", [["a", "b", "a"], ["a", "", "c"], ["a", "../x", "c"], ["/abs", "b", "c"],
                                   ["a", "b", "c\0"]], ids=["twice", "empty", "climbing", "absolute", "nul"])
def test_bad_class_names_in_dataset_info_are_refused_naming_it(tmp_path, image_folder, names):
    folder = tmp_path / "saved"
    write_saved(folder, sample_rows(image_folder), features={**FEATURES, "label": {"names": names,
                                                                                  "_type": "ClassLabel"}})
    with pytest.raises(pf.InvalidSourceError, match="class name") as error:
        open_source(folder)
    assert "dataset_info.json" in str(error.value) and "'label'" in str(error.value)


@pytest.mark.parametrize("value", ["", "../x", "/abs"], ids=["empty", "climbing", "absolute"])
def test_bad_class_names_among_text_labels_are_refused_naming_the_row(tmp_path, image_folder, value):
    rows = sample_rows(image_folder)
    labels = pa.array([value if r == 11 else CLASSES[y] for r, (_, _, y) in enumerate(rows)])
    path = plain_parquet(tmp_path / "x.parquet", rows, labels=labels)
    with pytest.raises(pf.InvalidSourceError, match=f"x.parquet:row 11, column 'label'.*class name {value!r}"):
        open_source(path, label_key="label")


def test_more_class_names_than_the_limit_are_refused(tmp_path, image_folder, monkeypatch):
    from packed_formats.sources import hub_checks

    monkeypatch.setattr(hub_checks, "_MOST_CLASSES", 100)  # the limit is millions: a file of that many is slow
    folder = tmp_path / "saved"
    names = [f"c{k}" for k in range(101)]
    write_saved(folder, sample_rows(image_folder), features={**FEATURES, "label": {"names": names,
                                                                                  "_type": "ClassLabel"}})
    with pytest.raises(pf.InvalidSourceError, match=r"dataset_info.json.*101 class names, more than the 100"):
        open_source(folder)
    with pytest.raises(pf.InvalidSourceError, match=r"x.parquet:row 7, column 'label'.*more than the 100"):
        open_source(plain_parquet(tmp_path / "x.parquet", bad_rows(image_folder, 7, label=100)))


# ---- array fields over list columns ---------------------------------------------------------------------
def boxes_column(bad, kind=pa.float64(), good=(1.0, 2.0, 3.0, 4.0)):
    """A list<list<kind>> column of N rows of one box each, row 10 ``bad``."""
    return pa.array([bad if r == 10 else [list(good)] for r in range(N)], pa.list_(pa.list_(kind)))


@pytest.mark.parametrize("column, declared, problem", [
    (lambda: boxes_column([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0]]), "float32[N,4]", "ragged"),
    (lambda: boxes_column([[1.0, None, 3.0, 4.0]]), "float32[N,4]", "a null value"),
    (lambda: boxes_column([None]), "float32[N,4]", "a null value"),
    (lambda: boxes_column([[1, None, 3, 4]], pa.int64(), (1, 2, 3, 4)), "int32[N,4]", "a null value"),
    (lambda: boxes_column([[300, 0, 0, 0]], pa.int64(), (1, 2, 3, 4)), "int8[N,4]", "300 .*out of the range of int8"),
    (lambda: boxes_column([[-1, 0, 0, 0]], pa.int64(), (1, 2, 3, 4)), "uint8[N,4]", "-1 .*out of the range of uint8"),
    (lambda: boxes_column([[1e300, 0.0, 0.0, 0.0]]), "float32[N,4]", "out of the range of float32"),
    (lambda: boxes_column([[float("nan"), 0.0, 0.0, 0.0]]), "float32[N,4]", "not finite"),
    (lambda: boxes_column([[float("inf"), 0.0, 0.0, 0.0]]), "float64[N,4]", "not finite"),
    (lambda: boxes_column([[1.5, 0.0, 0.0, 0.0]]), "int32[N,4]", "1.5 is no whole number"),
    (lambda: boxes_column([["1.5", "0", "0", "0"]], pa.string(), ("1", "2", "3", "4")), "float32[N,4]",
     "string values, not numbers"),
    (lambda: boxes_column([[70000, 0, 0, 0]], pa.int64(), (1, 2, 3, 4)), "float16[N,4]", "out of the range of float16"),
    (lambda: boxes_column([[2, 0, 0, 0]], pa.int64(), (1, 0, 1, 0)), "bool[N,4]", "value 2 is no bool"),
], ids=["ragged", "null-float", "null-row", "null-int", "int-too-big", "int-negative", "float-too-big", "nan", "inf",
        "fraction", "strings", "int-as-float16", "int-as-bool"])
@pytest.mark.parametrize("layout", ["parquet", "arrow"])
def test_a_bad_array_cell_is_named_by_file_row_and_column_or_skipped(tmp_path, image_folder, column, declared,
                                                                     problem, layout):
    rows = sample_rows(image_folder)
    table = image_table(rows, extra={"boxes": column()}).replace_schema_metadata(None)
    src = tmp_path / f"x.{layout}"
    if layout == "parquet":
        pq.write_table(table, src, row_group_size=5)
    else:
        with pa.OSFile(str(src), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for chunk in table.to_batches(max_chunksize=4):
                writer.write_batch(chunk)
    bad_row = 0 if problem.startswith("string") else 10
    where = f"x.{layout}:row {bad_row}, column 'boxes'"
    fields = [f"boxes=array:{declared}"]
    with pytest.raises(pf.CorruptSampleError, match=problem) as error:
        convert(src, tmp_path / "out.zip", fields=fields, workers=1, quiet=True)
    assert where in str(error.value) and not (tmp_path / "out.zip").exists()
    if bad_row:
        summary = convert(src, tmp_path / "out.zip", fields=fields, workers=1, on_error="skip", quiet=True)
        assert summary.samples == N - 1 and len(summary.failed) == 1 and where in summary.failed[0]
        with pf.open_archive(tmp_path / "out.zip") as reader:
            assert np.array_equal(reader.read_field(0, "boxes"), np.array(column()[0].as_py(), declared.split("[")[0]))


def test_array_cells_the_dtype_holds_as_they_are_convert(tmp_path, image_folder):
    rows = sample_rows(image_folder)
    columns = {"whole": boxes_column([[0.0, 255.0, 3.0, 4.0]]),  # floats of whole numbers as uint8
               "wide": boxes_column([[-128, 127, 0, 1]], pa.int64(), (1, 2, 3, 4)),  # int64 in int8's range
               "flags": boxes_column([[0, 1, 1, 0]], pa.int64(), (1, 0, 1, 0)),
               "empty": pa.array([[] for _ in range(N)], pa.list_(pa.list_(pa.float64())))}
    path = plain_parquet(tmp_path / "x.parquet", rows, **columns)
    fields = ["whole=array:uint8[N,4]", "wide=array:int8[N,4]", "flags=array:bool[N,4]", "empty=array:float32[N,2]"]
    convert(path, tmp_path / "out.zip", fields=fields, workers=1, quiet=True)
    with pf.open_archive(tmp_path / "out.zip") as reader:
        assert reader.read_field(10, "whole").tolist() == [[0, 255, 3, 4]]
        assert reader.read_field(10, "wide").tolist() == [[-128, 127, 0, 1]]
        assert reader.read_field(10, "flags").tolist() == [[False, True, True, False]]
        assert reader.read_field(10, "empty").shape == (0, 2)


# ---- what describes the dataset: the card, state.json, dataset_info.json, the files' metadata -------------
def test_a_card_with_yaml_aliases_is_refused_not_expanded(tmp_path, image_folder, capsys):
    names = "          - &a [" + ", ".join(["x"] * 3000) + "]\n" \
            "          - &b [" + ", ".join(["*a"] * 3000) + "]\n" \
            "          - [" + ", ".join(["*b"] * 3000) + "]\n"
    src = hub_with_card(tmp_path, image_folder, names)
    with pytest.raises(pf.InvalidSourceError, match="README.md.*YAML alias"):
        open_source(src)
    assert cli.main(["info", str(src)]) != 0 and "YAML alias" in capsys.readouterr().err


def test_a_card_nested_too_deeply_is_refused(tmp_path, image_folder):
    src = hub_with_card(tmp_path, image_folder, "          - " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(pf.InvalidSourceError, match="README.md.*nest"):
        open_source(src)


@pytest.mark.parametrize("where", ["state.json", "dataset_info.json", "dataset_dict.json", "metadata"])
def test_json_nested_too_deeply_is_refused_naming_the_file(tmp_path, image_folder, where):
    deep = "[" * 200_000 + "]" * 200_000
    folder = tmp_path / "saved"
    files = write_saved(folder, sample_rows(image_folder), files=1)
    if where == "metadata":
        table = image_table(sample_rows(image_folder)).replace_schema_metadata({b"huggingface": deep.encode()})
        files = [tmp_path / "x.parquet"]
        pq.write_table(table, files[0])
        target = files[0]
    else:
        (folder / where).write_text(deep)
        target = folder
    with pytest.raises(pf.InvalidSourceError, match="nest") as error:
        open_source(target)
    assert (str(files[0]) if where == "metadata" else where) in str(error.value)


@pytest.mark.parametrize("name", ["T - shirt / top", "n02085620/Chihuahua", "a.b", "...", "C:x"])
def test_class_names_that_climb_nowhere_are_kept(name):
    """Fashion-MNIST's "T - shirt / top" and WordNet-style names hold a '/' that leads nowhere: only a name that
    starts at a root or holds a '.' or '..' part is refused as a path."""
    from packed_formats.sources import hub_checks

    assert hub_checks.name_problem(name) is None
