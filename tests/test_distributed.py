"""make_loader under torchrun: 2 ranks x 2 workers on gloo split every archive's samples."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest

import packed_formats as pf
from packed_formats.loading.loader import shard_indices

from .conftest import ALL_KINDS, RAW_SHAPE, expected_samples, write_archive

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def test_shard_indices_pads_like_distributed_sampler():
    from torch.utils.data import DistributedSampler

    for n, world, drop_last in [(10, 4, False), (10, 4, True), (24, 2, False), (7, 3, False)]:
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=3, drop_last=drop_last)
            sampler.set_epoch(2)
            ours = shard_indices(n, epoch=2, seed=3, rank=rank, world_size=world, drop_last=drop_last)
            assert list(ours) == list(sampler)


@pytest.fixture(scope="module")
def torchrun_result(archives, image_folder, tmp_path_factory):
    """Run dist_worker.py once over every archive kind plus an odd-sized one (padding)."""
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("torchrun is not installed")
    root = tmp_path_factory.mktemp("dist")
    odd = write_archive(root / "odd.memmap", "memmap", "raw", expected_samples(image_folder, "raw")[:23])
    jobs = [(archives[k], None if k[1] == "raw" else list(RAW_SHAPE[:2])) for k in ALL_KINDS] + [(odd, None)]
    (root / "archives.json").write_text(json.dumps(jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2",
        WORKER, str(root / "archives.json"), str(root),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, odd


@pytest.mark.slow
@pytest.mark.parametrize("kind", ALL_KINDS, ids="-".join)
def test_ranks_split_each_epoch_disjointly_and_cover_the_archive(torchrun_result, archives, kind):
    ranks, _ = torchrun_result
    path = archives[kind]
    n = len(pf.open_archive(path))
    for epoch in (0, 1):
        a, b = (set(r[path]["epochs"][epoch]) for r in ranks)
        assert not a & b and a | b == set(range(n))
        assert len(ranks[0][path]["epochs"][epoch]) == n // 2
    assert ranks[0][path]["epochs"][0] != ranks[0][path]["epochs"][1]  # reshuffled per epoch
    assert ranks[0][path]["len"] == math.ceil(n / 2 / 5)


@pytest.mark.slow
def test_a_loader_built_before_the_process_group_is_sharded_when_it_iterates(torchrun_result, archives):
    ranks, _ = torchrun_result
    path = archives[ALL_KINDS[0]]
    for epoch in (0, 1):
        early = [r[path + "#built-early"]["epochs"][epoch] for r in ranks]
        assert early == [r[path]["epochs"][epoch] for r in ranks]  # as if built after init_process_group
        assert not set(early[0]) & set(early[1])
    assert ranks[0][path + "#built-early"]["len"] == ranks[0][path]["len"]


def test_under_a_launcher_without_a_process_group_the_loader_warns_once(uniform_archives, monkeypatch):
    from packed_formats.loading import sampling

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sampling, "_warned_unsharded", False)
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=8, num_workers=0)
    with pytest.warns(sampling.UnshardedWarning, match="WORLD_SIZE=2"):
        list(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sampling.UnshardedWarning)
        list(loader)  # once per process


@pytest.mark.slow
def test_an_odd_count_is_padded_with_the_first_shuffled_sample(torchrun_result):
    ranks, odd = torchrun_result
    for epoch in (0, 1):
        a, b = (r[odd]["epochs"][epoch] for r in ranks)
        assert len(a) == len(b) == 12 and set(a) | set(b) == set(range(23))
        assert set(a) & set(b) == {int(shard_indices(23, epoch=epoch, seed=7)[0])}
