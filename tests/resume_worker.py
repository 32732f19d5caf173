"""Run by tests/test_resume.py in processes of their own: resume a loader from a saved state.

    python tests/resume_worker.py cases CASES_JSON OUT_JSON
        For each case (archive, make_loader options, state): a new loader loads
        the state and runs ``passes`` passes; writes each pass's epoch and
        batches (labels, sha1 of the pixels).
    [torchrun --nproc_per_node W] python tests/resume_worker.py ranks ARCHIVE OPTIONS_JSON OUT_DIR [STATE_JSON]
        On every rank (torch.distributed when launched by torchrun): load
        STATE_JSON if given, then run ``stop_after`` batches (OPTIONS_JSON) and save
        rank 0's state to OUT_DIR/state.json, or (no stop_after) finish the epoch;
        writes the labels each rank got to OUT_DIR/rank{r}.json.
    python tests/resume_worker.py train ARCHIVE CHECKPOINT KILL_AT
        A training loop that saves a checkpoint (loader state and the labels seen)
        after every batch, atomically; after batch KILL_AT it prints "saved" and
        waits to be killed.  Started again, it resumes from the checkpoint and
        finishes the epoch, then prints "done".
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

import packed_formats as pf
from packed_formats import transforms as T


def transform() -> torch.nn.Module:
    """The random transform the tests compare pixel for pixel."""
    return T.Compose([T.RandomResizedCrop(4, scale=(0.3, 1.0)), T.RandomHorizontalFlip()])


def record(images: torch.Tensor, labels: torch.Tensor) -> list:
    """A batch as [labels, sha1 of its pixels]."""
    return [labels.tolist(), hashlib.sha1(images.contiguous().numpy().tobytes()).hexdigest()]


def loader_for(archive: str, options: dict) -> pf.PackedLoader:
    return pf.make_loader(archive, transform=transform() if options.pop("transform", True) else None, **options)


def resume_cases(cases_json: str, out_json: str) -> None:
    results = []
    for case in json.load(open(cases_json)):
        loader = loader_for(case["archive"], dict(case["options"]))
        loader.load_state_dict(case["state"])
        passes = []
        for _ in range(case["passes"]):
            batches = [record(images, labels) for images, labels in loader]
            passes.append([loader.epoch, batches])
        results.append(passes)
    json.dump(results, open(out_json, "w"))


def ranks(archive: str, options_json: str, out_dir: str, state_json: str = "") -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("gloo")
    options = json.load(open(options_json))
    stop_after = options.pop("stop_after", None)
    loader = loader_for(archive, options)
    if state_json:
        loader.load_state_dict(json.load(open(state_json)))
    labels = []
    for k, (_, y) in enumerate(loader):
        labels.extend(y.tolist())
        if stop_after is not None and k + 1 == stop_after:
            break
    rank = loader.sampler.rank
    if stop_after is not None and rank == 0:
        json.dump(loader.state_dict(), open(os.path.join(out_dir, "state.json"), "w"))
    json.dump({"labels": labels, "world_size": loader.sampler.world_size, "epoch": loader.epoch},
              open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def save_atomically(obj: dict, path: str) -> None:
    temp = f"{path}.tmp"
    with open(temp, "w") as file:
        json.dump(obj, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, path)


def train(archive: str, checkpoint: str, kill_at: str) -> None:
    loader = pf.make_loader(archive, batch_size=3, num_workers=2, seed=5, transform=transform())
    seen: list = []
    if os.path.exists(checkpoint):
        saved = json.load(open(checkpoint))
        loader.load_state_dict(saved["loader"])
        seen = saved["seen"]
    epoch = loader.epoch
    for k, (_, labels) in enumerate(loader):
        seen.extend(labels.tolist())
        save_atomically({"loader": loader.state_dict(), "seen": seen}, checkpoint)
        if k + 1 == int(kill_at):
            print("saved", flush=True)
            time.sleep(600)  # killed here
    print("done", json.dumps({"epoch": epoch, "seen": seen}), flush=True)


if __name__ == "__main__":
    commands = {"cases": resume_cases, "ranks": ranks, "train": train}
    commands[sys.argv[1]](*sys.argv[2:])
