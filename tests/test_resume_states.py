"""Resume states are checked field by field: a tampered or mistaken state is refused, naming the field;
every state the library saves (also after a JSON or torch.save round trip) is accepted."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch

import packed_formats as pf

N, BATCH = 29, 4  # 8 batches an epoch


def unique_archive(path, n: int = N) -> str:
    rng = np.random.default_rng(0)
    with pf.open_writer(path, format="memmap", mode="raw", shape=(4, 4, 3), classes=[str(i) for i in range(n)]) as w:
        for i in range(n):
            w.add(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8), i, f"s{i}")
    return str(path)


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    return unique_archive(tmp_path_factory.mktemp("states") / "unique.memmap")


def loader_of(archive, **options) -> pf.PackedLoader:
    return pf.make_loader(archive, **dict(dict(batch_size=BATCH, num_workers=0, seed=3), **options))


@pytest.fixture(scope="module")
def good_state(archive) -> dict:
    """A loader's state after two batches of epoch 0."""
    loader = loader_of(archive)
    batches = iter(loader)
    next(batches), next(batches)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 2)
    return state


def without(state: dict, name: str) -> dict:
    return {k: v for k, v in state.items() if k != name}


def json_round_trip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def torch_round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---- tampered states: (what is changed, what the error must say) ------------------------------------------
FIELD_VALUES = [
    # the count of batches done: an int from 0 to the batches of the epoch (8)
    ("batches", "2", "batches must be an integer"), ("batches", 2.0, "batches must be an integer"),
    ("batches", 1.9, "batches must be an integer"), ("batches", True, "batches must be an integer"),
    ("batches", None, "batches must be an integer"), ("batches", [2], "batches must be an integer"),
    ("batches", -1, "batches must be an integer from 0 to 8"), ("batches", 9, "batches must be an integer from 0 to 8"),
    ("batches", 10**9, "batches must be an integer from 0 to 8"), ("batches", 2**70, "batches"),
    ("epoch", "0", "epoch must be an integer"), ("epoch", 0.0, "epoch must be an integer"),
    ("epoch", False, "epoch must be an integer"), ("epoch", -1, "epoch must be an integer from 0"),
    ("epoch", 2**64, "epoch must be an integer from 0"),
    ("start", -1, "start must be an integer from 0 to 29"), ("start", 30, "start must be an integer from 0 to 29"),
    ("start", 1.5, "start"), ("start", "0", "start"),
    ("world_size", 0, "world_size must be an integer from 1 to 29"), ("world_size", -2, "world_size"),
    ("world_size", 30, "world_size must be an integer from 1 to 29"), ("world_size", 10**9, "world_size"),
    ("world_size", True, "world_size"), ("world_size", 1.0, "world_size"), ("world_size", "1", "world_size"),
    ("first_batch", -1, "first_batch must be an integer from 0 to 0"), ("first_batch", 3, "first_batch"),
    ("first_batch", "0", "first_batch"),
    ("rank", -1, "rank must be an integer from 0 to 0"), ("rank", 1, "rank must be an integer from 0 to 0"),
    ("rank", 10**6, "rank"), ("rank", True, "rank"), ("rank", "0", "rank"), ("rank", None, "rank"),
    ("version", True, "no valid version"), ("version", "1", "no valid version"), ("version", 1.0, "no valid version"),
    ("version", 0, "no valid version"), ("version", None, "no valid version"),
    ("kind", "ResumableSampler", "not a PackedLoader state"), ("kind", None, "not a PackedLoader state"),
    ("seed", "3", "seed must be an integer"), ("seed", 3.0, "seed must be an integer"),
    ("samples", 29.0, "samples must be an integer"), ("samples", "29", "samples must be an integer"),
    ("batch_size", 4.0, "batch_size must be an integer"), ("batch_size", True, "batch_size must be an integer"),
    ("shuffle", 1, "shuffle must be True or False"), ("shuffle", "True", "shuffle must be True or False"),
    ("drop_last", 0, "drop_last must be True or False"), ("drop_last", None, "drop_last must be True or False"),
    ("archive", None, "archive is None"), ("archive", "x", "archive must be a dict.*got str 'x'"),
    ("archive", [], "archive must be a dict"), ("archive", {}, "archive must be a dict.*lacks name"),
    ("archive", 29, "archive must be a dict"),
]

ARCHIVE_VALUES = [  # one entry of the archive identity changed
    ("count", "29", "archive must be a dict.*count"), ("count", 29.0, "archive must be a dict.*count"),
    ("count", True, "count"), ("count", -1, "count"), ("classes", None, "classes"),
    ("labels_crc32", 2**32, "labels_crc32"), ("labels_crc32", "0", "labels_crc32"),
    ("classes_crc32", 1.5, "classes_crc32"), ("name", 5, "its name is 5"), ("name", None, "its name"),
]


@pytest.mark.parametrize("name, value, match", FIELD_VALUES, ids=[f"{n}={v!r}" for n, v, _ in FIELD_VALUES])
def test_a_state_with_a_wrong_field_is_refused_naming_it(archive, good_state, name, value, match):
    with pytest.raises(ValueError, match=match):
        loader_of(archive).load_state_dict({**good_state, name: value})


@pytest.mark.parametrize("name, value, match", ARCHIVE_VALUES, ids=[f"{n}={v!r}" for n, v, _ in ARCHIVE_VALUES])
def test_a_state_with_a_wrong_archive_identity_is_refused_naming_it(archive, good_state, name, value, match):
    with pytest.raises(ValueError, match=match):
        loader_of(archive).load_state_dict({**good_state, "archive": {**good_state["archive"], name: value}})


@pytest.mark.parametrize("name", ["kind", "version", "epoch", "start", "world_size", "first_batch", "batches",
                                  "samples", "batch_size", "shuffle", "seed", "drop_last", "rank", "archive"])
def test_a_state_without_a_field_is_refused_naming_it(archive, good_state, name):
    match = "not a PackedLoader state" if name == "kind" else "no valid version" if name == "version" else \
        f"lacks {name}"
    with pytest.raises(ValueError, match=match):
        loader_of(archive).load_state_dict(without(good_state, name))


def test_unknown_fields_are_refused_naming_them(archive, good_state):
    with pytest.raises(ValueError, match="unknown field.*'consumed'"):
        loader_of(archive).load_state_dict({**good_state, "consumed": 3})
    with pytest.raises(ValueError, match="archive must be a dict.*unknown 'path'"):
        loader_of(archive).load_state_dict({**good_state, "archive": {**good_state["archive"], "path": "/x"}})


@pytest.mark.parametrize("state", [None, [], "state", 3])
def test_something_else_than_a_state_is_refused(archive, state):
    with pytest.raises(ValueError, match="not a PackedLoader state"):
        loader_of(archive).load_state_dict(state)


def test_a_huge_world_size_is_not_taken_as_the_end_of_the_epoch(archive, good_state):
    with pytest.raises(ValueError, match="world_size"):
        loader_of(archive).load_state_dict({**good_state, "world_size": 10**9, "batches": 1})


def test_a_refused_state_leaves_the_loader_as_it_was(archive, good_state):
    loader = loader_of(archive)
    loader.load_state_dict(good_state)
    with pytest.raises(ValueError):
        loader.load_state_dict({**good_state, "batches": 1.9})
    assert loader.state_dict() == good_state


# ---- every state the library saves is accepted ------------------------------------------------------------
def saved_loader_states(archive) -> list:
    """States at the start, in the middle and at the end of epochs, on one and on several ranks,
    and after a resume on another number of ranks."""
    states = []
    loader = loader_of(archive)
    states.append(loader.state_dict())
    for stop in (1, 8):
        for k, _ in enumerate(loader):
            if k + 1 == stop:
                break
        states.append(loader.state_dict())
    for world, drop_last in ((3, False), (4, True), (40, False)):
        ranked = loader_of(archive, rank=world - 1, world_size=world, drop_last=drop_last)
        next(iter(ranked))
        states.append(ranked.state_dict())
    moved = loader_of(archive, rank=1, world_size=2)
    moved.load_state_dict(states[1])  # saved on one rank, resumed on two: a new split from position 4 on
    next(iter(moved))
    states.append(moved.state_dict())
    assert states[-1]["start"] == 4 and states[-1]["first_batch"] == 1
    return states


@pytest.mark.parametrize("trip", [lambda s: s, json_round_trip, torch_round_trip], ids=["as-is", "json", "torch"])
def test_every_saved_loader_state_is_accepted(archive, trip):
    for state in saved_loader_states(archive):
        loader = loader_of(archive, rank=state["rank"], world_size=state["world_size"],
                           drop_last=state["drop_last"])
        loader.load_state_dict(trip(state))
        assert loader.state_dict() == state


def test_numpy_integers_are_integers(archive, good_state):
    loader = loader_of(archive)
    loader.load_state_dict({**good_state, "batches": np.int64(2), "epoch": np.int32(0)})
    assert loader.state_dict() == good_state


# ---- ResumableSampler -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampler_state(archive) -> dict:
    sampler = pf.ResumableSampler(pf.PackedDataset(archive), seed=2)
    iter(sampler)
    return sampler.state_dict(consumed=5)


SAMPLER_VALUES = [
    ("consumed", 1.9, "consumed must be an integer"), ("consumed", "5", "consumed must be an integer"),
    ("consumed", True, "consumed must be an integer"), ("consumed", 30, "consumed must be an integer from 0 to 29"),
    ("consumed", 10**9, "consumed"), ("rank", 5, "rank must be an integer from 0 to 0"),
    ("world_size", 10**9, "world_size"), ("epoch", 0.5, "epoch"), ("shuffle", 1, "shuffle must be True or False"),
    ("archive", None, "archive is None"), ("archive", "x", "archive must be a dict"),
    ("batches", 1, "unknown field.*'batches'"),
]


@pytest.mark.parametrize("name, value, match", SAMPLER_VALUES, ids=[f"{n}={v!r}" for n, v, _ in SAMPLER_VALUES])
def test_a_sampler_state_with_a_wrong_field_is_refused_naming_it(archive, sampler_state, name, value, match):
    with pytest.raises(ValueError, match=match):
        pf.ResumableSampler(pf.PackedDataset(archive), seed=2).load_state_dict({**sampler_state, name: value})


@pytest.mark.parametrize("consumed", [2.5, 2.0, True, False, "3", float("nan"), float("inf"), np.float64(3.0), [3]],
                         ids=repr)
def test_a_consumed_count_that_is_no_integer_is_refused_naming_it(archive, consumed):
    """``state_dict(consumed=...)`` takes an integer (Python's or numpy's), never a bool, a float however
    round, or a string: never coerced to another count, and never an error that names nothing."""
    sampler = pf.ResumableSampler(pf.PackedDataset(archive), seed=2)
    for iterated in (False, True):
        if iterated:
            iter(sampler)
        with pytest.raises(ValueError, match=r"consumed must be an integer .*, got " + re.escape(repr(consumed))):
            sampler.state_dict(consumed=consumed)
    assert sampler.state_dict(consumed=np.int64(3))["consumed"] == 3 and type(sampler.state_dict(consumed=3)[
        "consumed"]) is int


def test_a_sampler_over_a_length_checks_the_shape_of_the_archive_field(sampler_state):
    over_length = pf.ResumableSampler(N, seed=2)
    over_length.load_state_dict(sampler_state)  # an identity it cannot check, but well formed
    over_length.load_state_dict({**sampler_state, "archive": None})
    with pytest.raises(ValueError, match="archive must be a dict"):
        over_length.load_state_dict({**sampler_state, "archive": "x"})
    with pytest.raises(ValueError, match="lacks archive"):
        over_length.load_state_dict(without(sampler_state, "archive"))


@pytest.mark.parametrize("trip", [json_round_trip, torch_round_trip], ids=["json", "torch"])
def test_every_saved_sampler_state_is_accepted(archive, trip):
    dataset = pf.PackedDataset(archive)
    for world, consumed in ((1, 0), (1, 5), (1, 29), (3, 4), (40, 1)):
        sampler = pf.ResumableSampler(dataset, seed=2, rank=world - 1, world_size=world)
        iter(sampler)
        state = sampler.state_dict(consumed=consumed)
        again = pf.ResumableSampler(dataset, seed=2, rank=world - 1, world_size=world)
        again.load_state_dict(trip(state))
        assert again.state_dict() == state
