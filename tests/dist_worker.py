"""Run by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo backend).

For every archive in the JSON list it loads two epochs with make_loader
(2 workers, distributed auto-detected) and writes, per rank, the sample index
of every image it got: ``{path: [[epoch 0 indices], [epoch 1 indices]]}``.
The first archive is also loaded by a loader built *before* the process group
exists (at module level, or handed to Lightning before ``fit``), under
``path + "#built-early"``: it must be sharded all the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import packed_formats as pf


def digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def lookup(path: str, size) -> dict:
    """sha1 of each sample as this loader decodes it -> its index (read in order, one process)."""
    loader = pf.make_loader(path, batch_size=1, shuffle=False, num_workers=0, size=size, distributed=False)
    return {digest(images[0]): i for i, (images, _) in enumerate(loader)}


def main(archives_json: str, out_dir: str) -> None:
    jobs = json.load(open(archives_json))
    first, first_size = jobs[0]
    early = pf.make_loader(first, batch_size=5, shuffle=True, num_workers=2, seed=7, size=first_size)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    index = lookup(first, first_size)
    result = {
        first + "#built-early": {
            "epochs": [[index[digest(image)] for images, _ in early for image in images] for _ in range(2)],
            "len": len(early),
        }
    }
    for path, size in jobs:
        index = lookup(path, size)
        loader = pf.make_loader(path, batch_size=5, shuffle=True, num_workers=2, seed=7, size=size)
        epochs = []
        for _ in range(2):
            epochs.append([index[digest(image)] for images, _ in loader for image in images])
        assert loader.sampler.world_size == 2 and loader.sampler.rank == rank
        result[path] = {"epochs": epochs, "len": len(loader)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
