"""A tiny image classifier trained from a packed archive with pf.make_loader.

Runs anywhere: on the CPU, on one GPU, or on many under torchrun / srun (one
process per GPU; torch.distributed is set up from the usual environment
variables and make_loader splits the samples over the ranks).

    python tools/slurm/train_example.py train.zip --epochs 2
    torchrun --nproc-per-node 4 tools/slurm/train_example.py /tmp/train.zip --stage-to $TMPDIR

With --stage-to, every rank calls pf.stage(): the first one on each node copies
and verifies the archive, the others wait and then read the same local copy.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import packed_formats as pf
from packed_formats.doctor import processes_per_node, suggested_num_workers, usable_cpus


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive", help="a packed archive (packed-formats convert ...)")
    parser.add_argument("--stage-to", metavar="DIR", help="copy the archive to this node-local directory first")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--size", type=int, default=64, help="training crop size")
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: as doctor suggests)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-batches", type=int, default=None, help="stop each epoch early (smoke tests)")
    return parser.parse_args(argv)


def setup_distributed() -> torch.device:
    """Join the process group when launched by torchrun/srun with WORLD_SIZE > 1; pick the device."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def tiny_cnn(classes: int) -> nn.Module:
    def block(c_in: int, c_out: int) -> nn.Sequential:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        return nn.Sequential(conv, nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2))

    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes)]
    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), *head)


def make_train_loader(path: str, args: argparse.Namespace, device: torch.device):
    workers = args.workers if args.workers is not None else suggested_num_workers(usable_cpus(), processes_per_node())
    with pf.open_archive(path, verify=False) as reader:
        encoded = reader.mode == "encoded"  # encoded images vary in size: resize them at decode
    return pf.make_loader(
        path,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=workers,
        device=device,
        transform=pf.transforms.train(args.size, scale=(0.35, 1.0)),
        drop_last=True,
        seed=0,
        size=(args.size + args.size // 4,) * 2 if encoded else None,
    )


def train(argv=None) -> float:
    """Train for --epochs; return the last epoch's mean loss."""
    args = parse_args(argv)
    device = setup_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = pf.stage(args.archive, args.stage_to) if args.stage_to else args.archive
    loader = make_train_loader(path, args, device)
    if len(loader) == 0:
        raise SystemExit(f"{path}: too few samples for one batch of {args.batch_size} per process")
    model = tiny_cnn(len(loader.classes)).to(device, memory_format=torch.channels_last)
    if dist.is_initialized():
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    mean_loss = float("nan")
    for epoch in range(args.epochs):
        started, total, batches, images = time.perf_counter(), 0.0, 0, 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, batches, images = total + loss.item(), batches + 1, images + len(y)
            if args.max_batches and batches >= args.max_batches:
                break
        mean_loss = total / max(1, batches)
        if rank == 0:
            rate = images / (time.perf_counter() - started)
            print(f"epoch {epoch}: loss {mean_loss:.3f}, {rate:.0f} images/s per process on {device}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return mean_loss


if __name__ == "__main__":
    train()
