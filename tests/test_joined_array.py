"""JoinedArray: a sharded archive's index arrays, its parts' own arrays end to end, read as one."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from packed_formats.checksum import array_crc32
from packed_formats.index import JoinedArray, chunks


class _Parts:
    """A picklable source of the parts (as a sharded archive's is)."""

    def __init__(self, arrays):
        self.arrays = arrays
        self.asked = 0

    def __call__(self):
        self.asked += 1
        return self.arrays


PARTS = {
    "labels": [np.arange(5, dtype=np.int64), np.arange(0, dtype=np.int64), np.arange(100, 107, dtype=np.int64),
               np.array([-1], dtype=np.int64)],
    "keys": [np.array([b"a", b"bc"]), np.array([b"defgh", b"i", b"jk"]), np.array([b"lmnopqrstu"])],
}


@pytest.fixture(params=sorted(PARTS))
def pair(request):
    """(the joined array, the concatenation it must read as)."""
    arrays = PARTS[request.param]
    return JoinedArray.of(_Parts(arrays)), np.concatenate(arrays)


def test_it_has_the_concatenations_length_dtype_and_bytes(pair):
    joined, whole = pair
    assert len(joined) == len(whole) and joined.shape == whole.shape and joined.size == whole.size
    assert joined.dtype == whole.dtype and joined.nbytes == whole.nbytes and joined.ndim == 1
    assert np.array_equal(np.asarray(joined), whole) and np.asarray(joined).dtype == whole.dtype
    assert list(joined) == list(whole) and joined.tolist() == whole.tolist()


def test_every_kind_of_index_reads_as_in_the_concatenation(pair):
    joined, whole = pair
    n = len(whole)
    for i in list(range(-n, n)):
        assert joined[i] == whole[i] and joined[np.int64(i)] == whole[i]
    rng = np.random.default_rng(0)
    for key in ([], [0], [n - 1, 0, 3, 3], rng.integers(-n, n, 40), np.arange(n)[::-1], rng.random(n) < 0.5,
                slice(None), slice(2, -1), slice(None, None, -2), slice(n + 5, n + 9)):
        got, want = joined[key], whole[key]
        assert got.dtype == want.dtype and np.array_equal(got, want), key


@pytest.mark.parametrize("key", [10**6, -(10**6)])
def test_an_index_out_of_range_raises_index_error(pair, key):
    joined, _ = pair
    with pytest.raises(IndexError):
        joined[key]
    with pytest.raises(IndexError):
        joined[np.array([0, key])]


def test_its_checksum_and_chunks_are_those_of_the_concatenation(pair):
    joined, whole = pair
    assert array_crc32(joined) == array_crc32(whole)
    assert b"".join(c.tobytes() for c in chunks(joined)) == whole.tobytes()


def test_it_asks_its_source_once_and_pickles_without_the_parts_arrays(pair):
    joined, whole = pair
    joined[0], joined[[0, 1]], np.asarray(joined)
    assert joined.source.asked == 1
    state = joined.__getstate__()
    assert state["_parts"] is None  # pickled, the parts come from the source again where it is unpickled
    copy = pickle.loads(pickle.dumps(joined))
    assert np.array_equal(np.asarray(copy), whole)


def test_comparisons_operators_and_ufuncs_work_on_the_concatenation(pair):
    joined, whole = pair
    other = whole[0]
    assert np.array_equal(joined == other, whole == other) and np.array_equal(joined != other, whole != other)
    assert np.array_equal(joined >= other, whole >= other) and np.array_equal(other < joined, other < whole)
    if whole.dtype.kind == "i":
        assert np.array_equal(joined + 1, whole + 1) and np.array_equal(np.maximum(joined, 3), np.maximum(whole, 3))
        assert int(np.sum(joined == 4)) == int(np.sum(whole == 4))
        assert np.bincount(joined - whole.min()).sum() == len(whole)
        with pytest.raises(ValueError, match="read-only"):
            np.negative(whole, out=joined)
    with pytest.raises(TypeError):
        joined[0] = whole[0]
