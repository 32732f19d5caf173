"""Resuming mid-epoch: a new process continues an interrupted epoch sample for sample, pixel for pixel."""

from __future__ import annotations

import collections
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import packed_formats as pf
from packed_formats.loading.resume import STATE_VERSION
from packed_formats.loading.sampling import epoch_order, split_order

from .resume_worker import loader_for, record, transform

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")


def unique_archive(path, n: int, seed: int = 0, labels=None) -> str:
    """A raw memmap archive whose sample i has label i (labels tell samples apart) and random pixels."""
    rng = np.random.default_rng(seed)
    labels = list(range(n)) if labels is None else labels
    with pf.open_writer(path, format="memmap", mode="raw", shape=(6, 6, 3), classes=[str(i) for i in range(n)]) as w:
        for i in range(n):
            w.add(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8), labels[i], f"s{i}")
    return os.fspath(path)


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    return unique_archive(tmp_path_factory.mktemp("resume") / "unique.memmap", 29)


def run_python(*args, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, **kwargs)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def epochs_of(loader, count: int) -> list:
    return [[record(x, y) for x, y in loader] for _ in range(count)]


# ---- one process interrupted, a new one resumes --------------------------------------------------------
def random_cases(count: int, seed: int) -> list:
    """(N, batch size, workers, drop_last, shuffle, epoch of the stop, batches before the stop)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n, batch_size, drop_last = rng.randint(3, 29), rng.randint(1, 8), rng.random() < 0.4
        per_epoch = n // batch_size if drop_last else math.ceil(n / batch_size)
        cases.append(dict(n=n, batch_size=batch_size, workers=rng.choice([0, 2]), drop_last=drop_last,
                          shuffle=rng.random() < 0.8, stop_epoch=rng.randint(0, 1), k=rng.randint(0, per_epoch)))
    return cases


def check_resumed_runs_match_uninterrupted(tmp_path, cases) -> None:
    jobs, expected = [], []
    for i, case in enumerate(cases):
        path = unique_archive(tmp_path / f"c{i}.memmap", case["n"], seed=i)
        options = dict(batch_size=case["batch_size"], num_workers=case["workers"], drop_last=case["drop_last"],
                       shuffle=case["shuffle"], seed=11 + i)
        full = epochs_of(loader_for(path, dict(options)), 4)
        interrupted = loader_for(path, dict(options))
        for _ in range(case["stop_epoch"]):
            list(interrupted)
        batches = iter(interrupted)
        got = [record(*next(batches)) for _ in range(case["k"])]
        state = json.loads(json.dumps(interrupted.state_dict()))
        del batches
        assert got == full[case["stop_epoch"]][: case["k"]]
        jobs.append(dict(archive=path, options=options, state=state, passes=2))
        expected.append((case, got, full))
    (tmp_path / "cases.json").write_text(json.dumps(jobs))
    run_python("cases", str(tmp_path / "cases.json"), str(tmp_path / "out.json"))
    for (case, got, full), passes in zip(expected, json.load(open(tmp_path / "out.json"))):
        stop = case["stop_epoch"]
        (first_epoch, first), (second_epoch, second) = passes
        if case["k"] == len(full[stop]):  # saved after the last batch: the next epoch starts
            assert (first_epoch, first, second_epoch, second) == (stop + 1, full[stop + 1], stop + 2, full[stop + 2])
        else:
            assert first_epoch == stop and got + first == full[stop], case
            assert second_epoch == stop + 1 and second == full[stop + 1], case


def test_a_new_process_resumes_exactly(tmp_path):
    cases = random_cases(4, seed=1)
    cases[0].update(workers=2, k=1)  # workers have prefetched batches that were not handed out
    check_resumed_runs_match_uninterrupted(tmp_path, cases)


@pytest.mark.slow
def test_a_new_process_resumes_exactly_in_many_random_cases(tmp_path):
    check_resumed_runs_match_uninterrupted(tmp_path, random_cases(24, seed=2))


def test_persistent_workers_resume_mid_epoch_in_the_same_process(archive):
    options = dict(batch_size=4, num_workers=2, persistent_workers=True, seed=3, transform=transform())
    full = epochs_of(pf.make_loader(archive, **options), 2)
    loader = pf.make_loader(archive, **options)
    batches = iter(loader)
    head = [record(*next(batches)) for _ in range(3)]
    state = loader.state_dict()
    del batches
    loader.load_state_dict(state)
    assert head + epochs_of(loader, 1)[0] == full[0]
    assert epochs_of(loader, 1)[0] == full[1]


def test_the_state_is_small_and_counts_handed_out_batches(archive):
    loader = pf.make_loader(archive, batch_size=4, num_workers=2, seed=3)
    batches = iter(loader)
    for _ in range(2):
        next(batches)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"], state["version"]) == (0, 2, STATE_VERSION)
    assert len(json.dumps(state)) < 600
    for _ in batches:
        pass
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (1, 0)


def test_breaking_out_of_an_epoch_keeps_its_position(archive):
    loader = pf.make_loader(archive, batch_size=4, num_workers=2)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (0, 2)  # the rest of epoch 0
    for _ in zip(range(3), loader):  # a new pass starts the next epoch, as it always has
        pass
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (1, 3)
    loader.set_epoch(2)  # moving on drops the position
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (2, 0)


def damage_samples(path: str, indices) -> None:
    """Flip a byte of each of these samples of a raw memmap archive, as a bad stretch of disk would."""
    with pf.open_archive(path) as reader:
        nbytes = reader.manifest.sample_nbytes
    with open(os.path.join(path, "images.npy"), "r+b") as file:
        for i in indices:
            file.seek(128 + nbytes * int(i) + 5)  # past the .npy header
            byte = file.read(1)
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::packed_formats.SkippedSampleWarning")
def test_workers_skip_a_whole_damaged_batch_and_resume_around_it_exactly(tmp_path):
    options = dict(batch_size=4, num_workers=2, seed=5, on_error="skip", multiprocessing_context="fork")
    path = unique_archive(tmp_path / "damaged.memmap", 29)
    bad = epoch_order(29, epoch=0, seed=5)[8:12].tolist()  # every sample of epoch 0's third batch
    damage_samples(path, bad)
    full = epochs_of(loader_for(path, dict(options)), 2)
    assert len(full[0]) == 7 and sorted([s for labels, _ in full[0] for s in labels] + bad) == list(range(29))
    for k in (2, 3):  # stopped before the empty batch (it is made again), and after it
        interrupted = loader_for(path, dict(options))
        batches = iter(interrupted)
        head = [record(*next(batches)) for _ in range(k)]
        state = json.loads(json.dumps(interrupted.state_dict()))
        del batches, interrupted
        assert state["batches"] == k + (k > 2)  # the empty batch counts as done once a later one is handed out
        resumed = loader_for(path, dict(options))
        resumed.load_state_dict(state)
        assert head + epochs_of(resumed, 1)[0] == full[0], k
        assert epochs_of(resumed, 1)[0] == full[1], k


def test_set_epoch_to_another_epoch_drops_the_resume(archive):
    options = dict(batch_size=4, num_workers=0, seed=3)
    loader = pf.make_loader(archive, **options)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    again = pf.make_loader(archive, **options)
    again.load_state_dict(state)
    again.set_epoch(0)  # the same epoch: still resumed
    assert len(list(again)) == len(loader) - 1
    again.load_state_dict(state)
    again.set_epoch(4)
    fresh = pf.make_loader(archive, **options)
    fresh.set_epoch(4)
    assert epochs_of(again, 1) == epochs_of(fresh, 1)


# ---- another number of ranks ------------------------------------------------------------------------
def loader_on_rank(path, rank: int, world: int, **options) -> pf.PackedLoader:
    return pf.make_loader(path, rank=rank, world_size=world, **options)


def labels_of(batches) -> list:
    return [int(i) for _, labels in batches for i in labels]


def test_each_rank_continues_its_own_share_on_as_many_ranks(archive):
    options = dict(batch_size=2, num_workers=0, seed=9, transform=transform())
    state = None
    for rank in range(3):  # 29 samples on 3 ranks: padded, so that re-splitting the rest would differ
        full = epochs_of(loader_on_rank(archive, rank, 3, **options), 2)
        loader = loader_on_rank(archive, rank, 3, **options)
        batches = iter(loader)
        head = [record(*next(batches)) for _ in range(4)]
        state = state or json.loads(json.dumps(loader.state_dict()))  # rank 0's, loaded by every rank
        again = loader_on_rank(archive, rank, 3, **options)
        again.load_state_dict(state)
        assert head + epochs_of(again, 1)[0] == full[0] and epochs_of(again, 1)[0] == full[1]


@pytest.mark.parametrize("old, new, drop_last", [(2, 1, False), (1, 2, False), (3, 2, False), (2, 3, True),
                                                 (4, 3, False)])
def test_another_world_size_gets_every_remaining_sample_once(tmp_path, old, new, drop_last):
    n, batch_size, k = 29, 3, 2
    path = unique_archive(tmp_path / "a.memmap", n)
    options = dict(batch_size=batch_size, num_workers=0, seed=4, drop_last=drop_last)
    done, states = [], []
    for rank in range(old):
        loader = loader_on_rank(path, rank, old, **options)
        batches = iter(loader)
        done += labels_of(next(batches) for _ in range(k))
        states.append(json.loads(json.dumps(loader.state_dict())))
    assert all(s == {**states[0], "rank": s["rank"]} for s in states)  # the ranks agree but for their number
    resumed = {}
    for rank in range(new):
        loader = loader_on_rank(path, rank, new, **options)
        loader.load_state_dict(states[0])
        resumed[rank] = [labels_of(loader), labels_of(loader)]
    order = epoch_order(n, epoch=0, seed=4).tolist()
    assert sorted(done) == sorted(order[: k * batch_size * old])  # the first k*B*W positions are done
    remaining = order[k * batch_size * old :]
    # the rest is split over the new ranks as DistributedSampler splits an epoch
    for rank in range(new):
        share = split_order(np.array(remaining), rank=rank, world_size=new, drop_last=drop_last).tolist()
        if drop_last:
            share = share[: len(share) // batch_size * batch_size]
        assert resumed[rank][0] == share
        fresh = loader_on_rank(path, rank, new, **options)
        fresh.set_epoch(1)
        assert resumed[rank][1] == labels_of(fresh)  # the next epoch: as on `new` ranks from the start
    seen = collections.Counter(done + [i for rank in range(new) for i in resumed[rank][0]])
    if drop_last:
        assert max(seen.values()) == 1
    else:
        padding = -len(remaining) % new
        assert set(seen) == set(range(n)) and sum(seen.values()) == n + padding
        assert sum(c - 1 for c in seen.values()) == padding  # only the padding repeats, at most new-1 samples


def test_a_second_change_of_world_size_within_an_epoch(tmp_path):
    n, batch_size = 29, 2
    path = unique_archive(tmp_path / "a.memmap", n)
    options = dict(batch_size=batch_size, num_workers=0, seed=6)
    seen = []
    state = None
    for world, steps in [(2, 2), (3, 1), (1, None)]:
        for rank in range(world):
            loader = loader_on_rank(path, rank, world, **options)
            if state is not None:
                loader.load_state_dict(state)
            batches = iter(loader)
            seen += labels_of(batches if steps is None else (next(batches) for _ in range(steps)))
            saved = loader.state_dict()
        state = saved
    counts = collections.Counter(seen)
    assert set(counts) == set(range(n)) and sum(counts.values()) - n <= 2  # padding of the 3-rank split


@pytest.fixture(scope="module")
def torchrun():
    path = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip("torchrun is not installed")
    return path


def run_ranks(torchrun, world: int, archive: str, options: dict, out, state=None) -> list:
    out.mkdir()
    (out / "options.json").write_text(json.dumps(options))
    args = ["ranks", archive, str(out / "options.json"), str(out)] + ([str(state)] if state else [])
    if world > 1:
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        command = [torchrun, "--standalone", "--nproc_per_node", str(world), WORKER, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        run_python(*args)
    return [json.load(open(out / f"rank{r}.json")) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("old, new", [(2, 1), (1, 2)])
def test_resuming_on_another_number_of_gloo_ranks(torchrun, tmp_path, archive, old, new):
    options = dict(batch_size=3, num_workers=2, seed=8, transform=False)
    before = run_ranks(torchrun, old, archive, {**options, "stop_after": 2}, tmp_path / "before")
    after = run_ranks(torchrun, new, archive, options, tmp_path / "after", state=tmp_path / "before" / "state.json")
    assert all(r["world_size"] == w for rs, w in ((before, old), (after, new)) for r in rs)
    done = [i for r in before for i in r["labels"]]
    rest = [i for r in after for i in r["labels"]]
    assert len(done) == 2 * 3 * old and not set(done) & set(rest)
    padding = -(29 - len(done)) % new
    assert set(done) | set(rest) == set(range(29)) and len(rest) == 29 - len(done) + padding


# ---- a killed process -------------------------------------------------------------------------------
def test_a_process_killed_after_a_checkpoint_resumes_and_sees_every_sample_once(tmp_path, archive):
    checkpoint = tmp_path / "checkpoint.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    child = subprocess.Popen([sys.executable, WORKER, "train", archive, str(checkpoint), "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.strip() == "saved", child.stderr.read()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    assert child.returncode == -signal.SIGKILL
    assert len(json.load(open(checkpoint))["seen"]) == 4 * 3
    done = run_python("train", archive, str(checkpoint), "0")
    result = json.loads(done.stdout.split("done", 1)[1])
    assert result["epoch"] == 0 and sorted(result["seen"]) == list(range(29))


# ---- refusals -----------------------------------------------------------------------------------------
def test_a_state_of_another_archive_is_refused(tmp_path, archive):
    state = pf.make_loader(archive, batch_size=4, num_workers=0).state_dict()
    relabelled = unique_archive(tmp_path / "b.memmap", 29, labels=[(i + 1) % 29 for i in range(29)])
    with pytest.raises(ValueError, match="another archive.*labels_crc32"):
        pf.make_loader(relabelled, batch_size=4, num_workers=0).load_state_dict(state)
    smaller = unique_archive(tmp_path / "c.memmap", 20)
    with pytest.raises(ValueError, match="another archive.*20 samples"):
        pf.make_loader(smaller, batch_size=4, num_workers=0).load_state_dict(state)


def test_a_copy_of_the_archive_under_another_name_is_accepted(tmp_path, archive):
    state = pf.make_loader(archive, batch_size=4, num_workers=0).state_dict()
    copy = shutil.copytree(archive, tmp_path / "renamed.memmap") if os.path.isdir(archive) else \
        shutil.copy(archive, tmp_path / "renamed.memmap")
    pf.make_loader(copy, batch_size=4, num_workers=0).load_state_dict(state)


@pytest.mark.parametrize("change, match", [
    (dict(batch_size=5), "batch_size=4.*batch_size=5"),
    (dict(seed=1), "seed=0.*seed=1"),
    (dict(shuffle=False), "shuffle"),
    (dict(drop_last=True), "drop_last"),
])
def test_a_state_of_other_settings_is_refused(archive, change, match):
    state = pf.make_loader(archive, batch_size=4, num_workers=0).state_dict()
    options = dict(dict(batch_size=4, num_workers=0), **change)
    with pytest.raises(ValueError, match=match):
        pf.make_loader(archive, **options).load_state_dict(state)


def test_a_state_of_a_newer_version_or_another_kind_is_refused(archive):
    loader = pf.make_loader(archive, batch_size=4, num_workers=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=f"version {STATE_VERSION + 1}.*newer"):
        loader.load_state_dict({**state, "version": STATE_VERSION + 1})
    with pytest.raises(ValueError, match="not a PackedLoader state"):
        loader.load_state_dict(pf.ResumableSampler(29).state_dict())
    with pytest.raises(ValueError, match="lacks batches"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "batches"})


# ---- ResumableSampler ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n, world, drop_last, shuffle", [(10, 1, False, True), (10, 4, False, True),
                                                         (10, 4, True, True), (23, 3, False, False)])
def test_resumable_sampler_gives_distributed_samplers_order(n, world, drop_last, shuffle):
    from torch.utils.data import DistributedSampler

    for rank in range(world):
        ours = pf.ResumableSampler(n, shuffle=shuffle, seed=5, rank=rank, world_size=world, drop_last=drop_last)
        theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5,
                                    drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
        assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


def test_resumable_sampler_resumes_a_plain_dataloader_with_workers(archive):
    def loader(sampler):
        dataset = pf.PackedDataset(archive, output="tensor")
        return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)

    def labels(sampler, stop=None) -> list:
        out, taken = [], 0
        for k, (_, y) in enumerate(loader(sampler)):
            out += y.tolist()
            taken += len(y)
            if k + 1 == stop:
                break
        return out, taken

    full = pf.ResumableSampler(pf.PackedDataset(archive), seed=2)
    epoch0, _ = labels(full)
    full.set_epoch(1)
    epoch1, _ = labels(full)

    first = pf.ResumableSampler(pf.PackedDataset(archive), seed=2)
    head, taken = labels(first, stop=3)
    assert first.state_dict()["consumed"] > taken  # the workers took indices ahead: hence consumed=
    state = json.loads(json.dumps(first.state_dict(consumed=taken)))
    second = pf.ResumableSampler(pf.PackedDataset(archive), seed=2)
    second.load_state_dict(state)
    assert second.epoch == 0
    tail, _ = labels(second)
    assert head + tail == epoch0
    assert second.state_dict(consumed=len(tail)) == {**state, "epoch": 1, "consumed": 0}
    second.set_epoch(1)
    assert labels(second)[0] == epoch1


def test_resumable_sampler_on_another_number_of_ranks(tmp_path):
    n, old, new, consumed = 31, 2, 3, 5
    first = pf.ResumableSampler(n, seed=1, rank=0, world_size=old)
    iter(first)
    state = first.state_dict(consumed=consumed)
    resumed = []
    for rank in range(new):
        sampler = pf.ResumableSampler(n, seed=1, rank=rank, world_size=new)
        sampler.load_state_dict(state)
        resumed += list(sampler)
    order = epoch_order(n, epoch=0, seed=1).tolist()
    remaining = order[consumed * old :]
    assert sorted(resumed) == sorted(remaining + remaining[: -len(remaining) % new])


def test_resumable_sampler_refuses_other_datasets_and_settings(tmp_path, archive):
    state = pf.ResumableSampler(pf.PackedDataset(archive), seed=2).state_dict()
    relabelled = unique_archive(tmp_path / "b.memmap", 29, labels=[(i + 1) % 29 for i in range(29)])
    with pytest.raises(ValueError, match="another archive"):
        pf.ResumableSampler(pf.PackedDataset(relabelled), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="samples=29.*samples=30"):
        pf.ResumableSampler(30, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        pf.ResumableSampler(29, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="newer"):
        pf.ResumableSampler(29, seed=2).load_state_dict({**state, "version": STATE_VERSION + 1})
    with pytest.raises(ValueError, match="consumed must be"):
        sampler = pf.ResumableSampler(29, seed=2)
        iter(sampler)
        sampler.state_dict(consumed=30)


def test_resumable_sampler_with_torchdata_stateful_dataloader(archive):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        dataset = pf.PackedDataset(archive, output="tensor")
        return stateful.StatefulDataLoader(dataset, batch_size=4, sampler=pf.ResumableSampler(dataset, seed=2),
                                           num_workers=2)

    full = [y.tolist() for _, y in loader()]
    first = loader()
    batches = iter(first)
    head = [next(batches)[1].tolist() for _ in range(3)]
    state = first.state_dict()
    assert "'kind': 'ResumableSampler'" in repr(state)  # the sampler's own state, not a fast-forward count
    del batches
    second = loader()
    second.load_state_dict(state)
    assert head + [y.tolist() for _, y in second] == full


# ---- a CUDA device: the transform runs there, seeded by the batch numbers ------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resuming_on_cuda_keeps_the_transform_draws(archive):
    options = dict(batch_size=4, num_workers=2, seed=3, device="cuda", transform=transform(), prefetch=3)

    def run(loader, count):
        return [[(y.tolist(), x.cpu()) for x, y in loader] for _ in range(count)]

    full = run(pf.make_loader(archive, **options), 2)
    loader = pf.make_loader(archive, **options)
    batches = iter(loader)
    head = [(y.tolist(), x.cpu()) for x, y in (next(batches) for _ in range(2))]
    state = loader.state_dict()  # the prefetcher has copied batches ahead: they are not counted
    assert state["batches"] == 2
    del batches
    again = pf.make_loader(archive, **options)
    again.load_state_dict(state)
    rest = run(again, 2)
    for (la, a), (lb, b) in zip(head + rest[0] + rest[1], full[0] + full[1]):
        assert la == lb and torch.equal(a, b)
