"""A format is one module plus one registration line: the registry, detection and the shared suite follow."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import packed_formats as pf
from packed_formats import backends
from packed_formats.backends.base import Backend, Handle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_spec_is_reachable_by_name_detection_and_extension():
    for spec in backends.SPECS:
        assert backends.spec(spec.name) is spec
        for ext in spec.extensions:
            assert backends.EXTENSIONS[ext] == spec.name
    assert set(pf.PACKED_FORMATS) == {s.name for s in backends.SPECS if s.writer is not None}


def test_a_backend_missing_a_method_fails_when_it_is_made():
    class Incomplete(Backend):  # no open() nor read()
        format_name = "incomplete"

        @classmethod
        def read_metadata(cls, path):
            raise NotImplementedError

    with pytest.raises(TypeError, match="abstract"):
        Incomplete("x", None, None)  # type: ignore[abstract, arg-type]
    with pytest.raises(TypeError, match="abstract"):
        type("NoClose", (Handle,), {})()


def test_registering_a_format_makes_it_writable_readable_and_detected(tmp_path, monkeypatch):
    snapshot = list(backends.SPECS)
    from . import tiny_format  # registers "tiny" on import

    try:
        backends.register(tiny_format.SPEC)
        assert "tiny" in pf.PACKED_FORMATS and backends.EXTENSIONS[".tiny"] == "tiny"
        path = tmp_path / "a.tiny"
        pixels = [np.full((4, 5, 3), k, dtype=np.uint8) for k in range(3)]
        with pf.open_writer(path, format="tiny", mode="raw", shape=(4, 5, 3), classes=["a", "b"]) as writer:
            for k, image in enumerate(pixels):
                writer.add(image, k % 2, f"k{k}")
        assert pf.detect_format(path) == "tiny"
        dataset = pf.PackedDataset(path)
        assert [int(dataset[k][1]) for k in range(3)] == [0, 1, 0]
        np.testing.assert_array_equal(dataset.reader.read_many([2, 0])[0], pixels[2])
        dataset.close()
    finally:
        backends.unregister("tiny")
    assert backends.SPECS == snapshot and "tiny" not in pf.PACKED_FORMATS


@pytest.mark.slow
def test_the_shared_suite_passes_on_a_format_defined_outside_the_library():
    """The parametrised tests pick the registered format up on their own: a new format inherits them."""
    env = dict(os.environ, PF_TEST_EXTRA_FORMAT="tests.tiny_format")
    files = ["tests/test_roundtrip.py", "tests/test_dataloader.py", "tests/test_bad_input.py"]
    # left out: the tests that rewrite a manifest in place (they must know where each format keeps it)
    # and the killed-writer test (its fresh interpreter has not registered the format)
    selected = "tiny and not manifest and not newer_format_version and not killed_writer"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", selected, *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = int(result.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 30, result.stdout[-2000:]
