"""The manifest's JSON: the same canonical text, checked and written without re-encoding it in Python
(a sharded set of ImageNet-21k parts repeats 21,841 class names in each part's manifest)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import manifest as manifest_module
from packed_formats.backends.sharded import ShardedWriter
from packed_formats.errors import CorruptArchiveError
from packed_formats.manifest import ArchiveManifest, canonical_json, new_manifest


def _manifests():
    rng = random.Random(0)
    for n in (0, 1, 2, 63, 64, 500):
        for alphabet in ("abc", 'aé中"\\\n\t\x00/ ', "x"):
            classes = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(n)]
            yield new_manifest("zip", "raw", 10, classes, (4, 4, 3), None, [("labels", 5), ("keys", 7)])


@pytest.mark.parametrize("data", [
    {"classes": ["a", 1, None], "x": 2},
    {"classes": [["a"], "b"]},
    {"classes": ["a"], "encoding": "\0classes\0"},  # the mark itself in another field
    {"classes": [], "count": 3},
    {"classes": "abc"},
    {"count": 1},
])
def test_canonical_json_is_jsons_own_indented_sorted_text(data):
    assert canonical_json(data) == json.dumps(data, indent=1, sort_keys=True)


def test_to_json_and_its_checksum_are_those_of_jsons_own_text():
    for m in _manifests():
        text = m.to_json()
        data = json.loads(text)
        assert text == json.dumps(data, indent=1, sort_keys=True)
        stored = data.pop("manifest_crc32")
        assert stored == manifest_module.crc32(json.dumps(data, indent=1, sort_keys=True).encode())
        assert ArchiveManifest.from_json(text) == m and ArchiveManifest.from_json(text.encode()) == m


def test_a_manifest_laid_out_otherwise_is_still_read_and_a_changed_one_is_refused():
    m = new_manifest("zip", "raw", 10, [f"n{k:08d}" for k in range(100)], (4, 4, 3), None)
    data = json.loads(m.to_json())
    assert ArchiveManifest.from_json(json.dumps(data, indent=4)) == m  # other layout, same content
    for changed in (m.to_json().replace("n00000042", "n00000043"), json.dumps(dict(data, count=11))):
        with pytest.raises(CorruptArchiveError, match="manifest is damaged"):
            ArchiveManifest.from_json(changed, path="a.zip")


def test_equal_long_class_lists_are_held_once():
    classes = [f"n{k:08d}" for k in range(1000)]
    a, b = (ArchiveManifest.from_json(new_manifest("zip", "raw", k, classes, (4, 4, 3), None).to_json())
            for k in (1, 2))
    assert a.classes == tuple(classes) and a.classes is b.classes


def test_opening_a_sharded_set_reencodes_no_manifest_and_shares_its_classes(tmp_path, monkeypatch):
    classes = [f"n{k:08d}" for k in range(300)]
    path = str(tmp_path / "set.zip")
    with ShardedWriter(path, "zip", shard_size=3, mode="raw", shape=(2, 2, 1), classes=classes) as writer:
        for i in range(30):
            writer.add(np.full((2, 2, 1), i, dtype=np.uint8), i % 300)
    encoded = []
    monkeypatch.setattr(manifest_module, "canonical_json", lambda data: encoded.append(1) or json.dumps(data))
    with pf.open_archive(path) as reader:
        parts = reader.backend.parts
        assert len(parts) == 10 and not encoded  # each part's stored text is checked as it lies
        assert all(part.manifest.classes is parts[0].manifest.classes for part in parts)
        assert reader.classes == classes and int(reader.read(29)[0, 0, 0]) == 29


def test_class_lists_that_differ_only_at_the_end_read_back_as_their_own():
    base = [f"n{k:08d}" for k in range(200)]
    variants = [base, base[:-1] + ["n99999999"], base + ["extra"], base[:-1], base, ["n00000000"] + base[1:]]
    for text_type in (str, bytes):
        for classes in variants:
            text = new_manifest("zip", "raw", 3, classes, (2, 2, 1), None).to_json()
            parsed = ArchiveManifest.from_json(text if text_type is str else text.encode())
            assert parsed.classes == tuple(classes)
