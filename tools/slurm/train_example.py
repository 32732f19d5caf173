"""A tiny image classifier trained from a packed archive with pf.make_loader.

Runs anywhere: on the CPU, on one GPU, or on many under torchrun or srun (one
process per GPU; torch.distributed is set up from torchrun's variables, or from
Slurm's SLURM_PROCID / SLURM_LOCALID under srun, and make_loader splits the
samples over the ranks).

    python tools/slurm/train_example.py train.zip --epochs 2
    torchrun --nproc-per-node 4 tools/slurm/train_example.py /tmp/train.zip --stage-to $TMPDIR

With --stage-to, every rank calls pf.stage(): the first one on each node copies
and verifies the archive, the others wait and then read the same local copy.

With --checkpoint FILE, a run starts from FILE when it exists and continues the
interrupted epoch exactly where it stopped (the loader's state_dict).  FILE is
written at the end of every epoch and when a stop is asked for: SIGUSR1, or
--stop-file appearing (the batch scripts create it when Slurm sends them
SIGUSR1 ahead of the time limit, ``#SBATCH --signal=B:USR1@120``).  The model's
initial weights are seeded, so a resumed run equals an uninterrupted one.  Then every rank stops
at the same step, rank 0 saves model, optimizer and loader state (to a temporary
file, then os.replace: a crash leaves the old checkpoint or the new one, never
half of one), requeues the job under Slurm (``scontrol requeue``) and all exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import packed_formats as pf
from packed_formats.doctor import processes_per_node, suggested_num_workers
from packed_formats.writing.parallel import available_cores


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
    parser.add_argument("--pace", type=float, default=0.0, metavar="SECONDS", help="wait this long after each step "
                        "(demonstrations and tests: stretches a tiny run past the time limit's signal)")
    parser.add_argument("--checkpoint", metavar="FILE", help="resume from FILE if it exists; save to it at the "
                        "end of each epoch, and on SIGUSR1 or --stop-file (then requeue under Slurm and exit)")
    parser.add_argument("--stop-file", metavar="FILE", help="stop as on SIGUSR1 when FILE appears (a batch script "
                        "touches it: torchrun does not pass SIGUSR1 on to its processes)")
    return parser.parse_args(argv)


class StopRequest:
    """Whether this run was asked to checkpoint and stop: by SIGUSR1, or by ``stop_file`` appearing."""

    def __init__(self, stop_file: Optional[str] = None) -> None:
        self.stop_file, self.asked, self._looked = stop_file, False, 0.0
        signal.signal(signal.SIGUSR1, self._on_signal)  # at once: SIGUSR1's default action ends the process

    def _on_signal(self, signum, frame) -> None:
        self.asked = True  # acted on at the next step, outside the handler

    def here(self) -> bool:
        """Asked of this process (the stop file is looked for at most once a second)."""
        if not self.asked and self.stop_file and time.monotonic() - self._looked >= 1.0:
            self._looked = time.monotonic()
            self.asked = os.path.exists(self.stop_file)
        return self.asked

    def anywhere(self, device: torch.device) -> bool:
        """Asked of any rank: every rank calls this at every step, so all stop after the same one."""
        if not dist.is_initialized():
            return self.here()
        flag = torch.tensor([int(self.here())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, loader, totals: dict,
                    epoch: int | None = None) -> None:
    """Model, optimizer and loader state (and the running totals of ``epoch``, by default the loader's) to
    ``path``, atomically."""
    model = getattr(model, "module", model)  # DDP's wrapped model
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict(),
             "totals": totals, "epoch": loader.epoch if epoch is None else epoch}  # the epoch the totals are of
    temp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, temp)
    with open(temp, "rb") as file:
        os.fsync(file.fileno())  # on disk before it replaces the last good checkpoint
    os.replace(temp, path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, loader, device) -> dict:
    """Restore what ``save_checkpoint`` saved; return the interrupted epoch's running totals."""
    state = torch.load(path, map_location=device, weights_only=True)
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    return dict(state["totals"], epoch=state.get("epoch", loader.epoch))


def requeue() -> None:
    """Put this Slurm job back in the queue (it restarts from the checkpoint); outside Slurm, say how to resume."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        print("not under Slurm: run the same command again to resume", flush=True)
        return
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    print(f"requeued Slurm job {job}" if done.returncode == 0 else f"scontrol requeue {job} failed: {done.stderr}",
          flush=True)


def ranks_from_srun() -> None:
    """Under ``srun`` (one task per process, no torchrun), set the variables torch.distributed reads from
    Slurm's: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (MASTER_ADDR and MASTER_PORT come from the
    batch script).  Variables a launcher already set are kept."""
    if "WORLD_SIZE" in os.environ or "SLURM_STEP_NUM_TASKS" not in os.environ:
        return  # torchrun's, or not a task of an srun step (the batch script itself)
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1")  # e.g. "4", "4(x2)" or "4,3"
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_STEP_NUM_TASKS"],
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", per_node.split("(")[0].split(",")[0]),
    )


def setup_distributed() -> torch.device:
    """Join the process group when launched by torchrun or srun with WORLD_SIZE > 1; pick the device."""
    ranks_from_srun()
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
    workers = args.workers
    if workers is None:
        workers = suggested_num_workers(available_cores(), processes_per_node())
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
        memory_format=torch.channels_last,  # the model below is channels-last too
    )


def train(argv=None) -> float:
    """Train for --epochs (the rest of them when resuming); return the last epoch's mean loss."""
    args = parse_args(argv)
    stop = StopRequest(args.stop_file)
    device = setup_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = pf.stage(args.archive, args.stage_to) if args.stage_to else args.archive
    loader = make_train_loader(path, args, device)
    if len(loader) == 0:
        raise SystemExit(f"{path}: too few samples for one batch of {args.batch_size} per process")
    torch.manual_seed(0)  # the same initial weights in every run: a resumed run equals an uninterrupted one
    model = tiny_cnn(len(loader.classes)).to(device, memory_format=torch.channels_last)
    if dist.is_initialized():
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    totals = {"loss": 0.0, "batches": 0}  # of the epoch in progress, kept across a resume
    if args.checkpoint and os.path.exists(args.checkpoint):
        totals = load_checkpoint(args.checkpoint, model, optimizer, loader, device)
        saved_epoch = totals.pop("epoch")
        if rank == 0:
            print(f"resumed from {args.checkpoint}: epoch {saved_epoch}, {totals['batches']} batches done",
                  flush=True)
        if loader.epoch > saved_epoch and totals["batches"]:  # stopped after its last batch: report that epoch
            if dist.is_initialized():
                print(f"rank {rank} of {dist.get_world_size()}: epoch {saved_epoch}: {totals['batches']} batches",
                      flush=True)
            if rank == 0:
                print(f"epoch {saved_epoch}: loss {totals['loss'] / max(1, totals['batches']):.3f}", flush=True)
            totals = {"loss": 0.0, "batches": 0}
    if rank == 0 and args.checkpoint:
        print(f"process {os.getpid()}: SIGUSR1 saves {args.checkpoint} and stops", flush=True)
    mean_loss = float("nan")
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)  # the resumed epoch keeps its place
        started, images = time.perf_counter(), 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            totals = {"loss": totals["loss"] + loss.item(), "batches": totals["batches"] + 1}
            images += len(y)
            time.sleep(args.pace)
            if stop.anywhere(device):
                checkpoint_and_exit(args, rank, model, optimizer, loader, totals)
            if args.max_batches and totals["batches"] >= args.max_batches:
                break
        mean_loss = totals["loss"] / max(1, totals["batches"])
        if dist.is_initialized():  # each rank's share of the epoch (across a resume too)
            print(f"rank {rank} of {dist.get_world_size()}: epoch {epoch}: {totals['batches']} batches", flush=True)
        totals = {"loss": 0.0, "batches": 0}
        if rank == 0:
            rate = images / (time.perf_counter() - started)
            print(f"epoch {epoch}: loss {mean_loss:.3f}, {rate:.0f} images/s per process on {device}", flush=True)
            if args.checkpoint and not args.max_batches:  # the loader's state: the start of the next epoch
                save_checkpoint(args.checkpoint, model, optimizer, loader, totals, epoch=epoch + 1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return mean_loss


def checkpoint_and_exit(args, rank: int, model, optimizer, loader, totals: dict) -> None:
    """Save (rank 0), wait for every rank, requeue under Slurm (rank 0), and end this process."""
    if rank == 0:
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, optimizer, loader, totals)
            print(f"saved {args.checkpoint}: epoch {loader.epoch}, {totals['batches']} batches done", flush=True)
        else:
            print("asked to stop, but no --checkpoint to save to", flush=True)
        if args.stop_file and os.path.exists(args.stop_file):
            os.remove(args.stop_file)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0 and args.checkpoint:
        requeue()
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(0)


if __name__ == "__main__":
    train()
