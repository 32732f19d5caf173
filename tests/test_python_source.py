"""convert from Python code: a map-style dataset, or a function over inputs (sources.python.PythonSource)."""

from __future__ import annotations

import filecmp
import io
import os
import subprocess
import sys

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.writing.convert import convert
from tests import python_datasets as data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw(dataset, dst, **options):
    return convert(dataset, str(dst), mode="raw", quiet=True, **{"workers": 0, **options})


def same_bytes(a, b) -> bool:
    return filecmp.cmp(str(a), str(b), shallow=False)


def samples(path):
    with pf.open_archive(str(path)) as reader:
        return tuple(reader.classes), [(reader.key(i), int(reader.labels[i]), np.asarray(reader.read(i)).tobytes())
                                for i in range(len(reader))]


def test_a_dataset_packs_in_index_order_with_its_classes(tmp_path):
    summary = raw(data.ArrayDataset(10), tmp_path / "a.zip")
    assert (summary.samples, summary.classes, summary.layout) == (10, 3, "raw 16x16x3")
    classes, items = samples(tmp_path / "a.zip")
    assert classes == ("cat", "dog", "fox")
    assert [label for _, label, _ in items] == [i % 3 for i in range(10)]
    assert items[7][2] == data.pixels(7).tobytes() and items[0][0] == "00000000"


def test_items_as_users_have_them(tmp_path):
    dataset = data.MixedDataset(str(tmp_path), count=12)
    convert(dataset, str(tmp_path / "m.zip"), classes=data.CLASSES, workers=0, quiet=True)
    with pf.open_archive(str(tmp_path / "m.zip")) as reader:
        assert [int(x) for x in reader.labels] == [i % 3 for i in range(12)]
        assert reader.read(3) == data.jpeg(3)  # encoded bytes are kept as they are
        assert reader.read(4) == data.jpeg(4)  # a path: the file's bytes
    convert(dataset, str(tmp_path / "r.zip"), classes=data.CLASSES, mode="raw", workers=0, quiet=True)
    _, items = samples(tmp_path / "r.zip")
    for i in (0, 1, 2, 5):  # PIL image, HxWxC array, CxHxW tensor, a dict's image: the same pixels
        assert items[i][2] == data.pixels(i).tobytes()


def test_a_16_bit_image_is_scaled_not_clipped(tmp_path):
    from PIL import Image

    ramp = Image.fromarray(np.arange(0, 65536, 256, dtype=np.uint16).reshape(16, 16))  # mode I;16
    raw([(ramp, 0)], tmp_path / "g.zip", classes=["ramp"])
    pixels = np.frombuffer(samples(tmp_path / "g.zip")[1][0][2], np.uint8)
    assert pixels.min() == 0 and 120 < pixels.mean() < 135  # Pillow's convert("RGB") makes it almost white


def test_classes_from_the_labels_when_the_dataset_names_none(tmp_path):
    pairs = [(data.pixels(i), ["zebra", "ant"][i % 2]) for i in range(6)]  # a list is a map-style dataset
    raw(pairs, tmp_path / "l.zip")
    classes, items = samples(tmp_path / "l.zip")
    assert classes == ("ant", "zebra") and [label for _, label, _ in items] == [1, 0, 1, 0, 1, 0]

    class Features(dict):
        pass

    class Named:
        names = ["left", "right"]

    class Hub(list):  # as a datasets.Dataset says its classes: a ClassLabel feature
        features = Features(label=Named())

    raw(Hub((data.pixels(i), i % 2) for i in range(4)), tmp_path / "h.zip")
    assert samples(tmp_path / "h.zip")[0] == ("left", "right")


def test_the_labels_are_the_items_own_where_targets_are_listed(tmp_path):
    raw(data.MappedTargets(9), tmp_path / "t.zip")  # targets give the classes; each label is its item's
    classes, items = samples(tmp_path / "t.zip")
    assert classes == ("0", "1", "2") and [label for _, label, _ in items] == [2 - i % 3 for i in range(9)]


def test_a_function_over_inputs_leaves_out_what_it_returns_none_for(tmp_path):
    def make(n):
        return None if n == 3 else {"image": data.pixels(n), "label": n % 2, "name": f"input {n}"}

    summary = raw(make, tmp_path / "f.zip", inputs=range(6), classes=["even", "odd"], fields=["auto"])
    assert summary.samples == 5
    _, items = samples(tmp_path / "f.zip")
    assert [key for key, _, _ in items] == ["00000000", "00000001", "00000002", "00000004", "00000005"]


def generated(count, bad=None):
    for i in range(count):
        if i == bad:
            yield "not an item"
        else:
            yield data.pixels(i), data.CLASSES[i % 3]


def test_an_iterable_is_drawn_once_and_counted_up(tmp_path, capsys):
    convert(generated(20), str(tmp_path / "g.zip"), mode="raw", classes=data.CLASSES, workers=0, quiet=False)
    assert "20img" in capsys.readouterr().err.replace(" ", "")  # no total known: the bar counts up
    raw(data.ArrayDataset(20), tmp_path / "a.zip")
    assert same_bytes(tmp_path / "g.zip", tmp_path / "a.zip")  # the same items as a dataset: the same archive
    with pytest.raises(pf.InvalidSampleError, match=r"sample index 7\b.*an item of type str"):
        raw(generated(20, bad=7), tmp_path / "b.zip", classes=data.CLASSES)
    assert not os.path.exists(tmp_path / "b.zip")
    assert raw(generated(20, bad=7), tmp_path / "b.zip", classes=data.CLASSES, on_error="skip").samples == 19
    with pytest.raises(pf.InvalidSourceError, match="classes must be known before"):
        raw(generated(3), tmp_path / "c.zip")
    with pytest.raises(ValueError, match="an iterable has none"):
        raw(generated(3), tmp_path / "c.zip", classes=data.CLASSES, shard_size=2, part=(0, 2))


def test_fields_declared_or_inferred_and_an_item_that_disagrees_is_named(tmp_path, capsys):
    convert(data.FieldsDataset(6), str(tmp_path / "f.zip"), mode="raw", workers=0, quiet=True, fields=["auto"])
    assert "caption=text" in capsys.readouterr().out
    with pf.open_archive(str(tmp_path / "f.zip")) as reader:
        assert {f.name for f in reader.fields} == {"caption", "boxes"}
    with pytest.raises(pf.InvalidSampleError, match=r"sample index 4.*no field 'caption'"):
        convert(data.FieldsDataset(6, odd=4), str(tmp_path / "g.zip"), mode="raw", workers=0, quiet=True,
                fields=["auto"])
    assert not os.path.exists(tmp_path / "g.zip")


BAD = {
    "type": r"an item of type str: expected an \(image, label\) pair",
    "shape": r"an item of type tuple of 3 values",
    "image": r"the image is a float: expected a PIL image",
    "size": r"the image is 20x20, item 0's is 16x16.*--size",
    "label": r"the label 7 is none of the classes \(cat, dog, fox\)",
    "raises": r"__getitem__\(5\) raised KeyError: 'no record 5'",
}


@pytest.mark.parametrize("how", sorted(BAD))
def test_a_bad_item_is_named_by_index_or_skipped(tmp_path, how):
    dst = tmp_path / "bad.zip"
    with pytest.raises(pf.PackedFormatError, match=r"sample index 5\b") as caught:
        raw(data.BadDataset(how), dst)
    assert caught.match(BAD[how])
    if how == "raises":
        assert isinstance(caught.value.__cause__, KeyError)  # the dataset's own error, chained
    assert not os.path.exists(dst) and not [f for f in os.listdir(tmp_path) if ".pf-tmp-" in f]
    summary = raw(data.BadDataset(how), dst, on_error="skip")
    assert summary.samples == 11 and len(summary.failed) == 1 and "sample index 5" in summary.failed[0]


def test_the_destination_is_checked_as_for_a_folder(tmp_path):
    (tmp_path / "mine.zip").write_text("mine")
    with pytest.raises(pf.ArchiveExistsError, match="already exists"):
        raw(data.ArrayDataset(4), tmp_path / "mine.zip")
    assert (tmp_path / "mine.zip").read_text() == "mine"
    with pytest.raises(pf.DestinationError, match="directory .* does not exist"):
        raw(data.ArrayDataset(4), tmp_path / "nowhere" / "x.zip")


def test_an_unpicklable_dataset_is_named_with_both_ways_out(tmp_path):
    with pytest.raises(pf.InvalidSourceError, match=r"attribute 'guard' \(lock\) cannot be pickled") as caught:
        raw(data.LockedDataset(), tmp_path / "u.zip", workers=2)
    assert caught.match("workers=0") and caught.match("factory")
    assert not os.path.exists(tmp_path / "u.zip")
    assert raw(data.LockedDataset(), tmp_path / "u.zip").samples == 12


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_start_method_gives_the_one_process_bytes(tmp_path, method):
    one = raw(data.ArrayDataset(), tmp_path / "one.zip")
    many = raw(pf.PythonSource(data.ArrayDataset(), start_method=method), tmp_path / "many.zip", workers=2)
    assert one.samples == many.samples == 48 and same_bytes(tmp_path / "one.zip", tmp_path / "many.zip")
    # a factory: each worker makes the dataset (here one holding a lock) itself
    made = pf.PythonSource.from_factory(data.make_train_set, {"count": 48}, start_method=method)
    raw(made, tmp_path / "made.zip", workers=2)
    assert same_bytes(tmp_path / "one.zip", tmp_path / "made.zip")


@pytest.mark.slow
def test_one_and_two_workers_write_the_same_bytes_encoded(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    dataset = data.MixedDataset(str(tmp_path), count=24)
    for workers in (1, 2):
        convert(dataset, str(tmp_path / f"{workers}.h5"), classes=data.CLASSES, size=12, workers=workers,
                quiet=True)
        convert(iter(dataset[i] for i in range(24)), str(tmp_path / f"{workers}-iterable.h5"),
                classes=data.CLASSES, size=12, workers=workers, quiet=True)
        convert(data.FieldsDataset(24), str(tmp_path / f"{workers}-fields.h5"), fields=["auto"], size=12,
                boxes=["boxes=XYXY"], workers=workers, quiet=True)
        convert(torchvision.datasets.FakeData(size=24, image_size=(3, 20, 20), num_classes=4),
                str(tmp_path / f"{workers}-torchvision.h5"), workers=workers, quiet=True)  # PIL images, no classes
    for name in ("", "-iterable", "-fields", "-torchvision"):
        assert same_bytes(tmp_path / f"1{name}.h5", tmp_path / f"2{name}.h5")
    assert same_bytes(tmp_path / "1.h5", tmp_path / "1-iterable.h5")


@pytest.mark.slow
def test_parts_and_join_equal_one_process(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one, many = tmp_path / "one" / "s.zip", tmp_path / "many" / "s.zip"
    raw(data.ArrayDataset(23), one, shard_size=5, workers=2)
    for task in (2, 0, 1):
        raw(data.ArrayDataset(23), many, shard_size=5, part=(task, 3), workers=2)
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(f for f in os.listdir(tmp_path / "many") if not f.startswith("."))
    assert all(same_bytes(tmp_path / "one" / n, tmp_path / "many" / n) for n in names)
    assert samples(one) == samples(many)


@pytest.mark.slow
def test_a_worker_that_dies_is_named_with_the_index_it_held(tmp_path):
    with pytest.raises(pf.ConversionFailedError, match=r"worker process died while it held one of samples \d+-\d+"):
        raw(data.BadDataset("kill", index=20, count=40), tmp_path / "k.zip", workers=2)
    assert not os.path.exists(tmp_path / "k.zip")


@pytest.mark.slow
def test_the_command_line_makes_the_dataset_with_a_factory_per_task(tmp_path):
    dst = tmp_path / "t.zip"
    for task in (1, 0):
        done = subprocess.run(
            [sys.executable, "-m", "packed_formats", "convert", "--python", "tests.python_datasets:make_train_set",
             str(dst), "--python-arg", "count=12", "--mode", "raw", "--shard-size", "5", "--part", f"{task}/2",
             "--workers", "2", "--quiet"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    raw(data.ArrayDataset(12), tmp_path / "one.zip", shard_size=5)
    assert samples(dst) == samples(tmp_path / "one.zip")
    wrong = subprocess.run([sys.executable, "-m", "packed_formats", "convert", "--python",
                            "tests.python_datasets:nothing", str(tmp_path / "x.zip")], cwd=ROOT, capture_output=True,
                           text=True)
    assert wrong.returncode != 0 and "has no function nothing" in wrong.stderr and "Traceback" not in wrong.stderr
    broken = subprocess.run([sys.executable, "-m", "packed_formats", "convert", "--python",
                             "tests.python_datasets:broken_factory", "--python-arg", "count=3",
                             str(tmp_path / "x.zip")], cwd=ROOT, capture_output=True, text=True)
    assert broken.returncode != 0 and "Traceback" not in broken.stderr
    assert "the factory raised RuntimeError: no database for 3 items" in broken.stderr


def test_a_plain_image_folder_keeps_its_files_as_a_folder_conversion_does(tmp_path):
    from PIL import Image
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    from packed_formats.synthetic import make_photo_folder

    root = make_photo_folder(str(tmp_path / "photos"), 3, classes=("a", "b"), sizes=(24, 40))
    convert(root, str(tmp_path / "folder.zip"), workers=1, quiet=True)
    convert(ImageFolder(root), str(tmp_path / "dataset.zip"), workers=0, quiet=True)
    (classes, items), (folder_classes, folder_items) = (samples(tmp_path / "dataset.zip"),
                                                        samples(tmp_path / "folder.zip"))
    assert classes == folder_classes and len(items) == 6
    assert [item[1:] for item in items] == [item[1:] for item in folder_items]  # labels, and the JPEGs' own bytes
    # a transform (or a loader, or a __getitem__ of its own) is the user's: the items are read as it makes them
    convert(ImageFolder(root, transform=transforms.Resize((8, 8))), str(tmp_path / "t.zip"), workers=0, quiet=True)
    with pf.open_archive(str(tmp_path / "t.zip")) as reader:
        assert Image.open(io.BytesIO(reader.read(0))).size == (8, 8)


def test_the_pickle_check_makes_no_copy_of_the_dataset():
    import tracemalloc

    from packed_formats.sources.python import PythonSource
    from packed_formats.writing.python_tasks import check_pickles

    dataset = [(np.full((512, 512, 3), i, np.uint8), 0) for i in range(64)]  # 48 MiB of pixels in memory
    source = PythonSource(dataset, classes=["grey"])
    tracemalloc.start()
    try:
        check_pickles(source)  # that it would pickle is checked, and the pickle is never held
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
