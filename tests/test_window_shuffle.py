"""shuffle="window": parts shuffled, then the samples of each window of parts, so that a cache of
``window`` parts fetches each part once an epoch; the DDP split and exact resume are kept."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends.sharded import ShardedWriter
from packed_formats.loading.sampling import (
    epoch_order,
    part_windows,
    parts_in_order,
    shard_indices,
    split_order,
    window_order,
)

N, SHARD = 29, 3  # 10 parts: nine of 3 samples and one of 2
STARTS = np.array([0, 5, 5, 9, 30, 31, 40, 52, 52, 60, 61, 75, 80], dtype=np.int64)  # uneven, with empty parts


def part_of_each(order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, order, side="right") - 1


def window_of_each_position(starts: np.ndarray, windows: list) -> np.ndarray:
    """For each position of an epoch's order, the number of the window it lies in."""
    sizes = [int(np.diff(starts)[parts].sum()) for parts in windows]
    return np.repeat(np.arange(len(windows)), sizes)


def sharded_zip(path, n: int = N, shard_size: int = SHARD) -> str:
    """A sharded raw ZIP set whose sample i has label i (labels tell samples apart)."""
    with ShardedWriter(str(path), "zip", shard_size=shard_size, mode="raw", shape=(2, 2, 1),
                       classes=[str(i) for i in range(n)]) as writer:
        for i in range(n):
            writer.add(np.full((2, 2, 1), i % 256, dtype=np.uint8), i)
    return str(path)


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> str:
    return sharded_zip(tmp_path_factory.mktemp("window") / "set.zip")


def loader_of(archive, **options) -> pf.PackedLoader:
    defaults = dict(batch_size=4, num_workers=0, seed=3, shuffle="window", window=2)
    return pf.make_loader(archive, **{**defaults, **options})


def labels_of(batches) -> list:
    return [int(i) for batch in batches for i in batch[1]]


# ---- the order ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [1, 2, 3, 5, 11, 12, 100])
def test_the_order_is_a_permutation(window):
    order = window_order(STARTS, epoch=2, seed=7, window=window)
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(STARTS[-1]))


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_each_window_holds_exactly_its_parts_samples(window):
    order = window_order(STARTS, epoch=1, seed=4, window=window)
    windows = part_windows(len(STARTS) - 1, epoch=1, seed=4, window=window)
    assert sorted(np.concatenate(windows).tolist()) == list(range(len(STARTS) - 1))  # every part, once
    position = 0
    for parts in windows:
        samples = np.concatenate([np.arange(STARTS[p], STARTS[p + 1]) for p in parts])
        assert sorted(order[position : position + len(samples)].tolist()) == sorted(samples.tolist())
        position += len(samples)
    assert position == STARTS[-1]


@pytest.mark.parametrize("window", [1, 2, 4])
def test_each_part_is_read_within_one_window(window):
    order = window_order(STARTS, epoch=0, seed=1, window=window)
    windows = part_windows(len(STARTS) - 1, epoch=0, seed=1, window=window)
    seen = collections.defaultdict(set)
    for part, number in zip(part_of_each(order, STARTS), window_of_each_position(STARTS, windows)):
        seen[int(part)].add(int(number))
    assert all(len(numbers) == 1 for numbers in seen.values())


def test_windows_mix_their_parts():
    order = window_order(STARTS, epoch=0, seed=1, window=4)
    runs = np.count_nonzero(np.diff(part_of_each(order, STARTS))) + 1
    assert runs > len(STARTS)  # not merely parts in a shuffled order: the parts of a window interleave


def test_a_window_of_one_reads_each_part_whole_before_the_next():
    order = window_order(STARTS, epoch=3, seed=0, window=1)
    parts = part_of_each(order, STARTS)
    runs = np.count_nonzero(np.diff(parts)) + 1
    assert runs == np.count_nonzero(np.diff(STARTS))  # one run per non-empty part
    nonempty = [p for p in part_windows(len(STARTS) - 1, epoch=3, seed=0, window=1) if STARTS[p[0] + 1] > STARTS[p[0]]]
    assert parts_in_order(order, STARTS).tolist() == [int(p[0]) for p in nonempty]


def test_the_order_is_seeded_by_seed_and_epoch():
    same = [window_order(STARTS, epoch=1, seed=5, window=3) for _ in range(2)]
    assert np.array_equal(*same)
    assert not np.array_equal(same[0], window_order(STARTS, epoch=2, seed=5, window=3))
    assert not np.array_equal(same[0], window_order(STARTS, epoch=1, seed=6, window=3))


@pytest.mark.parametrize("starts, window", [([0, 40], 8), (STARTS, 12), (STARTS, 50)], ids=["one-part", "all", "more"])
def test_one_part_or_a_window_of_every_part_is_the_global_shuffle(starts, window):
    n = int(starts[-1])
    assert np.array_equal(window_order(starts, epoch=4, seed=2, window=window), epoch_order(n, epoch=4, seed=2))
    assert part_windows(len(starts) - 1, epoch=4, seed=2, window=window)[0].tolist() == list(range(len(starts) - 1))


def test_parts_in_order_lists_the_parts_a_slice_reads_as_first_read():
    assert parts_in_order(np.array([61, 9, 62, 0, 10, 5]), STARTS).tolist() == [10, 3, 0, 2]
    assert parts_in_order(np.array([], dtype=np.int64), STARTS).tolist() == []


# ---- the split over ranks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world, drop_last", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_the_ranks_shares_partition_the_window_order(world, drop_last):
    n = int(STARTS[-1])  # 80: 3 ranks need padding (81) or drop a tail (78)
    order = window_order(STARTS, epoch=1, seed=2, window=2)
    shares = [shard_indices(n, epoch=1, seed=2, shuffle="window", rank=r, world_size=world, drop_last=drop_last,
                            starts=STARTS, window=2) for r in range(world)]
    assert all(np.array_equal(s, split_order(order, rank=r, world_size=world, drop_last=drop_last))
               for r, s in enumerate(shares))
    interleaved = np.stack(shares, axis=1).reshape(-1)  # at step i the ranks read positions i*W .. i*W+W-1
    kept = n // world * world if drop_last else n
    assert np.array_equal(interleaved[:kept], order[:kept])
    assert np.array_equal(interleaved[kept:], order[: len(interleaved) - kept])  # the padding repeats the head


# ---- the loader -------------------------------------------------------------------------------------------
def test_part_starts_are_the_parts_boundaries(archive, tmp_path):
    with pf.open_archive(archive) as reader:
        assert reader.part_starts.tolist() == list(range(0, N, SHARD)) + [N]
    with pf.open_writer(tmp_path / "one.zip", mode="raw", shape=(2, 2, 1), classes=["a"]) as writer:
        writer.add(np.zeros((2, 2, 1), np.uint8), 0)
    with pf.open_archive(tmp_path / "one.zip") as reader:
        assert reader.part_starts.tolist() == [0, 1]


def test_the_loader_follows_the_window_order(archive):
    loader = loader_of(archive)
    starts = np.arange(0, N + SHARD, SHARD).clip(max=N)
    for epoch in range(2):
        assert labels_of(loader) == window_order(starts, epoch=epoch, seed=3, window=2).tolist()


def test_a_single_file_archive_is_shuffled_whole(tmp_path):
    path = tmp_path / "one.zip"
    with pf.open_writer(path, mode="raw", shape=(2, 2, 1), classes=[str(i) for i in range(N)]) as writer:
        for i in range(N):
            writer.add(np.zeros((2, 2, 1), np.uint8), i)
    assert labels_of(loader_of(path)) == labels_of(loader_of(path, shuffle=True)) == epoch_order(N, seed=3).tolist()


@pytest.mark.parametrize("options, match", [
    (dict(shuffle="foo"), "shuffle must be"), (dict(shuffle=None), "shuffle must be"),
    (dict(shuffle=1), "shuffle must be"), (dict(window=0), "window must be"), (dict(window=-2), "window must be"),
    (dict(window="3"), "window must be"), (dict(window=True), "window must be"), (dict(window=2.0), "window must be"),
])
def test_bad_shuffle_or_window_is_refused_naming_it(archive, options, match):
    with pytest.raises(ValueError, match=match):
        loader_of(archive, **options)
    with pytest.raises(ValueError, match=match):
        pf.ResumableSampler(N, **{"shuffle": "window", **options})


# ---- resuming ---------------------------------------------------------------------------------------------
def test_the_state_records_the_mode_window_and_parts(archive):
    state = loader_of(archive).state_dict()
    assert (state["shuffle"], state["window"], type(state["parts_crc32"])) == ("window", 2, int)
    plain = loader_of(archive, shuffle=True).state_dict()
    assert "window" not in plain and "parts_crc32" not in plain  # as older versions saved it


def test_a_state_of_the_same_samples_cut_into_other_parts_is_refused(archive, tmp_path):
    loader = loader_of(archive)
    next(iter(loader))
    recut = sharded_zip(tmp_path / "set.zip", shard_size=SHARD + 1)  # the same samples: the same archive identity
    with pytest.raises(ValueError, match="saved with parts_crc32="):
        loader_of(recut).load_state_dict(loader.state_dict())
    loader_of(recut, shuffle=True).load_state_dict(loader_of(archive, shuffle=True).state_dict())


def test_a_resume_on_as_many_ranks_continues_each_share(archive):
    for rank in range(3):
        full = labels_of(loader_of(archive, rank=rank, world_size=3))
        loader = loader_of(archive, rank=rank, world_size=3)
        batches = iter(loader)
        head = labels_of(next(batches) for _ in range(2))
        state = json.loads(json.dumps(loader.state_dict()))
        again = loader_of(archive, rank=rank, world_size=3)
        again.load_state_dict(state)
        assert head + labels_of(again) == full


@pytest.mark.parametrize("old, new, drop_last", [(1, 2, False), (2, 3, False), (3, 2, True)])
def test_a_resume_on_another_world_size_gives_exactly_the_rest(archive, old, new, drop_last):
    k, batch_size = 1, 4
    options = dict(batch_size=batch_size, drop_last=drop_last)
    done, states = [], []
    for rank in range(old):
        loader = loader_of(archive, rank=rank, world_size=old, **options)
        batches = iter(loader)
        done += labels_of(next(batches) for _ in range(k))
        states.append(json.loads(json.dumps(loader.state_dict())))
    order = window_order(pf.open_archive(archive).part_starts, epoch=0, seed=3, window=2).tolist()
    assert sorted(done) == sorted(order[: k * batch_size * old])
    remaining = np.array(order[k * batch_size * old :])
    for rank in range(new):
        loader = loader_of(archive, rank=rank, world_size=new, **options)
        loader.load_state_dict(states[0])
        share = split_order(remaining, rank=rank, world_size=new, drop_last=drop_last).tolist()
        if drop_last:
            share = share[: len(share) // batch_size * batch_size]
        assert labels_of(loader) == share


@pytest.mark.parametrize("options, match", [
    (dict(window=3), "saved with window=2"), (dict(shuffle=True), "saved with shuffle='window'"),
    (dict(shuffle=False), "saved with shuffle='window'"),
])
def test_a_state_of_another_mode_or_window_is_refused(archive, options, match):
    loader = loader_of(archive)
    next(iter(loader))
    with pytest.raises(ValueError, match=match):
        loader_of(archive, **options).load_state_dict(loader.state_dict())


def test_a_state_with_a_bad_window_field_is_refused_naming_it(archive):
    state = loader_of(archive).state_dict()
    for value in ("2", 0, 2.0, True):
        with pytest.raises(ValueError, match="window must be None or an integer from 1"):
            loader_of(archive).load_state_dict({**state, "window": value})


def test_a_state_saved_without_windows_loads_and_is_refused_by_a_window_loader(archive):
    old = loader_of(archive, shuffle=True)  # an older version's state: a boolean shuffle, no window field
    next(iter(old))
    state = json.loads(json.dumps(old.state_dict()))
    resumed = loader_of(archive, shuffle=True)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    with pytest.raises(ValueError, match="saved with shuffle=True"):
        loader_of(archive).load_state_dict(state)


def test_the_resumable_sampler_shuffles_by_window_and_resumes(archive):
    dataset = pf.PackedDataset(archive)
    sampler = pf.ResumableSampler(dataset, shuffle="window", window=2, seed=1, rank=1, world_size=2)
    sampler.set_epoch(1)
    full = list(sampler)
    assert full == shard_indices(N, epoch=1, seed=1, shuffle="window", rank=1, world_size=2,
                                 starts=dataset.reader.part_starts, window=2).tolist()
    iter(sampler)
    state = json.loads(json.dumps(sampler.state_dict(consumed=5)))
    again = pf.ResumableSampler(dataset, shuffle="window", window=2, seed=1, rank=1, world_size=2)
    again.load_state_dict(state)
    assert list(again) == full[5:]
    with pytest.raises(ValueError, match="saved with window=2"):
        pf.ResumableSampler(dataset, shuffle="window", window=4, seed=1, rank=1, world_size=2).load_state_dict(state)


@pytest.mark.slow
def test_workers_deliver_the_batches_in_window_order(tmp_path):
    path = sharded_zip(tmp_path / "set.zip", n=120, shard_size=10)
    loader = pf.make_loader(path, batch_size=8, num_workers=2, shuffle="window", window=3, seed=5,
                            return_index=True)
    starts = pf.open_archive(path).part_starts
    for epoch in range(2):
        order = window_order(starts, epoch=epoch, seed=5, window=3)
        batches = list(loader)
        assert all(np.array_equal(index.numpy(), labels.numpy()) for _, labels, index in batches)
        assert np.concatenate([index.numpy() for _, _, index in batches]).tolist() == order.tolist()
