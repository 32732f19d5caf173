"""PackedLoader in place of a DataLoader: attributes, set_epoch, NCHW batches, indices, reference loops, Lightning.

Run as a script (``python tests/test_loader_parity.py lightning ARCHIVE OUT``) it is
the Lightning DDP program that ``test_lightning_ddp_*`` start and read back.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import packed_formats as pf
from packed_formats import memory
from packed_formats.loading.sampling import shard_indices

NUMBERED = 32  # samples of the numbered archives: 2 ranks x 4 batches of 4
HERE = os.path.abspath(__file__)


def write_numbered(path, mode: str) -> str:
    """An 8x8 archive whose sample i is filled with the value i (so pixels name their sample), label i % 3."""
    with pf.open_writer(path, format="memmap", mode=mode, shape=(8, 8, 3), classes=("a", "b", "c")) as writer:
        for i in range(NUMBERED):
            pixels = np.full((8, 8, 3), i, np.uint8)
            writer.add(pixels if mode == "raw" else pf.codecs.encode(pixels, "png"), i % 3, f"{i:02d}.png")
    return os.fspath(path)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """{"raw": path, "encoded": path} of numbered archives (PNG keeps the numbers exact)."""
    root = tmp_path_factory.mktemp("numbered")
    return {mode: write_numbered(root / f"numbered-{mode}.memmap", mode) for mode in ("raw", "encoded")}


def numbers(images: torch.Tensor) -> list:
    """The sample each image of a numbered archive's batch is."""
    return images[:, 0, 0, 0].long().tolist()


def epoch_indices(loader) -> list:
    return [int(i) for _, _, indices in loader for i in indices]


# ---- DataLoader's attributes --------------------------------------------------------------------
def test_loader_has_the_attributes_of_a_dataloader(numbered):
    loader = pf.make_loader(numbered["raw"], batch_size=5, num_workers=0, drop_last=True)
    plain = torch.utils.data.DataLoader(pf.PackedDataset(numbered["raw"], output="tensor"), batch_size=5,
                                        drop_last=True)
    assert len(loader) == len(plain) == NUMBERED // 5
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (plain.batch_size, True, 0)
    assert isinstance(loader.dataset, pf.PackedDataset) and len(loader.dataset) == NUMBERED
    assert loader.dataset.classes == plain.dataset.classes == ["a", "b", "c"]
    assert list(loader.dataset.targets) == list(plain.dataset.targets) == [i % 3 for i in range(NUMBERED)]
    assert callable(loader.sampler.set_epoch)


def test_dataset_is_the_one_given_and_counts_every_rank(numbered):
    dataset = pf.PackedDataset(numbered["raw"], output="tensor")
    loader = pf.make_loader(dataset, batch_size=4, num_workers=0, rank=1, world_size=2)
    assert loader.dataset is dataset
    assert len(loader.dataset) == NUMBERED and len(loader) == NUMBERED // 2 // 4


# ---- sampler.set_epoch ---------------------------------------------------------------------------
def test_sampler_set_epoch_gives_the_order_of_that_epoch(numbered):
    counted = pf.make_loader(numbered["raw"], batch_size=4, num_workers=0, return_index=True)
    orders = [epoch_indices(counted) for _ in range(3)]  # epochs 0, 1, 2 by the loader's own count
    assert len({tuple(order) for order in orders}) == 3
    loader = pf.make_loader(numbered["raw"], batch_size=4, num_workers=0, return_index=True)
    for epoch in (2, 0, 1, 1):
        loader.sampler.set_epoch(epoch)
        assert epoch_indices(loader) == orders[epoch]
    assert epoch_indices(loader) == orders[2]  # and the count goes on from the epoch set


def test_set_epoch_between_iter_and_the_first_batch_counts(numbered):
    # Lightning calls iter(loader) before sampler.set_epoch when it starts or resumes training
    counted = pf.make_loader(numbered["raw"], batch_size=4, num_workers=0, return_index=True)
    orders = [epoch_indices(counted) for _ in range(2)]
    loader = pf.make_loader(numbered["raw"], batch_size=4, num_workers=0, return_index=True)
    batches = iter(loader)
    loader.sampler.set_epoch(1)
    assert [int(i) for _, _, indices in batches for i in indices] == orders[1]


def test_sampler_set_epoch_holds_after_pickling(numbered):
    counted = pf.make_loader(numbered["raw"], batch_size=4, num_workers=0, return_index=True)
    first = epoch_indices(counted)
    copy = pickle.loads(pickle.dumps(counted))  # after an epoch: its own count says epoch 1 next
    copy.sampler.set_epoch(0)
    assert epoch_indices(copy) == first


def test_a_dropped_loader_goes_at_once(numbered):
    # its sampler must not keep it alive (a cycle lives on until the garbage collector runs, persistent
    # workers with it, and may then be collected in a worker forked for another loader)
    loader = pf.make_loader(numbered["raw"], batch_size=4, num_workers=0)
    gone = weakref.ref(loader)
    del loader
    assert gone() is None


# ---- memory layout -------------------------------------------------------------------------------
TRANSFORMS = {
    "none": lambda: None,
    "train": lambda: pf.transforms.train(16),
    "val": lambda: pf.transforms.val(16, resize=20),
    "per-image": lambda: per_image_pipeline(),
}


def per_image_pipeline():
    """A torchvision pipeline, which make_loader runs on each image and stacks (deterministic, to compare runs)."""
    v2 = pytest.importorskip("torchvision.transforms.v2")
    return v2.Compose([v2.CenterCrop(16), v2.ToDtype(torch.float32, scale=True)])


def check_nchw(images: torch.Tensor) -> None:
    assert images.is_contiguous()
    assert images.view(images.shape[0], -1).shape[1] == images[0].numel()  # what a flattening head does


@pytest.mark.parametrize("transform", TRANSFORMS, ids=str)
@pytest.mark.parametrize("kind", [("memmap", "raw"), ("zip", "encoded")], ids="-".join)
def test_batches_are_contiguous_nchw(uniform_archives, kind, transform):
    loader = pf.make_loader(uniform_archives[kind], batch_size=5, num_workers=0, transform=TRANSFORMS[transform](),
                            return_index=True)
    dataset = pf.PackedDataset(uniform_archives[kind], output="tensor")
    for images, _, indices in loader:
        check_nchw(images)
        if transform == "none":
            assert torch.equal(images, torch.stack([dataset[int(i)][0] for i in indices]))


@pytest.mark.parametrize("transform", ["none", "train"])
@pytest.mark.parametrize("kind", [("memmap", "raw"), ("zip", "encoded")], ids="-".join)
@pytest.mark.skipif(not memory.storage_lifetime_is_tracked(), reason="batch slot pooling is off on this torch")
def test_worker_batches_are_contiguous_nchw_in_their_slots(uniform_archives, kind, transform):
    options = dict(batch_size=5, seed=4, transform=TRANSFORMS[transform]())
    expected = [images.clone() for images, _ in pf.make_loader(uniform_archives[kind], num_workers=0, **options)]
    # worker processes (raw batches with no transform would otherwise be gathered by threads: test_threads.py)
    loader = pf.make_loader(uniform_archives[kind], num_workers=2, multiprocessing_context="fork", **options)
    loader.batch_reader.pool.min_bytes = 0  # send even these tiny batches in shared-memory slots
    got = list(loader)
    assert int((loader.batch_reader.pool.states == 1).sum()) > 0  # the batches we hold arrived in slots
    for (images, _), want in zip(got, expected):
        check_nchw(images)
        assert torch.equal(images, want)
    assert len(got) == len(expected)


@pytest.mark.parametrize("transform", ["none", "train", "per-image"])
def test_channels_last_is_opt_in(uniform_archives, transform):
    path = uniform_archives[("memmap", "raw")]
    loader = pf.make_loader(path, batch_size=5, num_workers=0, transform=TRANSFORMS[transform](), seed=2,
                            memory_format=torch.channels_last)
    contiguous = pf.make_loader(path, batch_size=5, num_workers=0, transform=TRANSFORMS[transform](), seed=2)
    for (images, _), (same, _) in zip(loader, contiguous):
        assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
        assert torch.equal(images, same)


def test_memory_format_must_be_an_image_layout(uniform_archives):
    with pytest.raises(ValueError, match="memory_format"):
        pf.make_loader(uniform_archives[("memmap", "raw")], memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("transform", ["none", "train"])
def test_batches_copied_to_another_device_are_contiguous_there(uniform_archives, transform):
    # "meta" tensors carry shapes and strides but no data: the device path's layout, without a GPU
    loader = pf.make_loader(uniform_archives[("memmap", "raw")], batch_size=5, num_workers=0, device="meta",
                            transform=TRANSFORMS[transform]())
    for images, _ in loader:
        assert images.device.type == "meta" and images.is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("transform", ["none", "train"])
def test_cuda_batches_are_in_the_asked_layout(uniform_archives, transform, layout):
    path = uniform_archives[("memmap", "raw")]
    for workers in (0, 2):
        loader = pf.make_loader(path, batch_size=5, num_workers=workers, device="cuda", memory_format=layout,
                                transform=TRANSFORMS[transform]())
        for images, _ in loader:
            assert images.is_cuda and images.is_contiguous(memory_format=layout)


# ---- return_index --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raw", "encoded"])
def test_indices_name_each_batchs_samples_on_every_rank(numbered, mode):
    targets = pf.PackedDataset(numbered[mode], output="tensor").targets
    seen = []
    for rank in (0, 1):
        loader = pf.make_loader(numbered[mode], batch_size=3, num_workers=2, rank=rank, world_size=2, seed=5,
                                return_index=True)
        loader.set_epoch(3)
        for images, labels, indices in loader:
            assert indices.dtype == torch.int64 and numbers(images) == indices.tolist()
            assert labels.tolist() == [int(targets[i]) for i in indices.tolist()]
            seen.extend(indices.tolist())
    assert sorted(seen) == list(range(NUMBERED))


def test_indices_continue_a_resumed_epoch(numbered):
    def loader():
        return pf.make_loader(numbered["raw"], batch_size=3, num_workers=1, seed=6, return_index=True)

    whole = epoch_indices(loader())
    first = loader()
    batches = iter(first)
    head = [int(i) for _ in range(4) for i in next(batches)[2]]
    state = first.state_dict()
    del batches
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [(numbers(images), indices.tolist()) for images, _, indices in resumed]
    assert all(pixels == indices for pixels, indices in rest)
    assert head + [i for _, indices in rest for i in indices] == whole


# ---- code written for a DataLoader ---------------------------------------------------------------
class FlatClassifier(nn.Module):
    """A linear classifier that flattens with ``view``, as many models' heads do (it needs contiguous input)."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.float().view(x.shape[0], -1) / 255)


def train_one_epoch_like_torchvision(model, criterion, optimizer, data_loader, device, epoch):
    """Shaped like the training step of torchvision's classification reference: the loader attributes it touches."""
    data_loader.sampler.set_epoch(epoch)  # what the reference does to its DistributedSampler
    model.train()
    for image, target in data_loader:
        image, target = image.to(device), target.to(device)
        loss = criterion(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def evaluate_like_torchvision(model, criterion, data_loader, device):
    """Shaped like torchvision's reference ``evaluate()``: len() for its progress, ``data_loader.dataset``
    to check that every sample was used."""
    model.eval()
    steps, batches, processed, correct, loss_sum = len(data_loader), 0, 0, 0, 0.0
    with torch.inference_mode():
        for image, target in data_loader:
            image = image.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(image)
            batch_size = image.shape[0]
            loss_sum += criterion(output, target).item() * batch_size
            correct += int((output.argmax(1) == target).sum())
            processed += batch_size
            batches += 1
    if hasattr(data_loader.dataset, "__len__") and len(data_loader.dataset) != processed:
        warnings.warn(f"the dataset has {len(data_loader.dataset)} samples, but {processed} were used", stacklevel=2)
    assert batches == steps
    return correct / processed, loss_sum / processed


def test_torchvision_reference_loops_run_unmodified(uniform_archives):
    path = uniform_archives[("memmap", "raw")]
    loader = pf.make_loader(path, batch_size=5, num_workers=0, shuffle=False)
    test_loader = torch.utils.data.DataLoader(pf.PackedDataset(path, output="tensor"), batch_size=5)
    features = int(np.prod(loader.reader.manifest.shape))
    model = FlatClassifier(features, len(loader.dataset.classes))
    criterion, optimizer = nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        train_one_epoch_like_torchvision(model, criterion, optimizer, loader, "cpu", epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ours = evaluate_like_torchvision(model, criterion, loader, "cpu")
    theirs = evaluate_like_torchvision(model, criterion, test_loader, "cpu")
    assert ours[0] == theirs[0] and ours[1] == pytest.approx(theirs[1], rel=1e-6)


# ---- Lightning -----------------------------------------------------------------------------------
PLACEMENTS = ("inside", "before", "plain")


@pytest.fixture(scope="module")
def lightning_run(numbered, tmp_path_factory):
    """Each rank's record of a 2-process CPU DDP ``Trainer.fit`` in every placement (one launch for all)."""
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning")
    done = subprocess.run([sys.executable, HERE, "lightning", numbered["raw"], os.fspath(out)],
                          capture_output=True, text=True, timeout=540, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {(p, r): json.loads((out / f"{p}-{r}.json").read_text()) for p in PLACEMENTS for r in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_lightning_ddp_gives_each_rank_its_share(lightning_run, placement):
    ranks = [lightning_run[(placement, r)] for r in (0, 1)]
    if placement != "plain":  # Lightning left our loader as it is: no DistributedSampler put in
        assert all(rank["loader"] == "PackedLoader" for rank in ranks)
    assert all(rank["batches"] == NUMBERED // 2 // 4 for rank in ranks)  # len() per rank, at setup
    for epoch in ("0", "1"):
        shares = [rank["seen"][epoch] for rank in ranks]
        assert sorted(shares[0] + shares[1]) == list(range(NUMBERED))
        for r, share in enumerate(shares):  # DistributedSampler's order for this epoch, set by Lightning
            assert share == shard_indices(NUMBERED, epoch=int(epoch), rank=r, world_size=2).tolist()


def run_lightning(path: str, out: str) -> None:
    """Fit a tiny model with 2-process CPU DDP for 2 epochs per placement of the loader; each rank
    writes what it saw to OUT/<placement>-<rank>.json."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self, make_loader=None):
            super().__init__()
            self.model, self.make_loader, self.seen = FlatClassifier(8 * 8 * 3, 3), make_loader, {}

        def train_dataloader(self):
            return self.make_loader()

        def training_step(self, batch, batch_idx):
            images, labels, *indices = batch
            if indices:
                assert indices[0].tolist() == numbers(images)
            self.seen.setdefault(str(self.current_epoch), []).extend(numbers(images))
            return nn.functional.cross_entropy(self.model(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    before = pf.make_loader(path, batch_size=4, num_workers=1, return_index=True)  # before any process group
    placements = {
        "inside": lambda: (Net(lambda: pf.make_loader(path, batch_size=4, num_workers=0, return_index=True)), None),
        "before": lambda: (Net(), before),
        "plain": lambda: (Net(lambda: torch.utils.data.DataLoader(pf.PackedDataset(path, output="tensor"),
                                                                   batch_size=4, shuffle=True)), None),
    }
    for name, build in placements.items():
        net, loader = build()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(net, train_dataloaders=loader)
        record = {"seen": net.seen, "batches": trainer.num_training_batches,
                  "loader": type(trainer.train_dataloader).__name__}
        with open(os.path.join(out, f"{name}-{trainer.global_rank}.json"), "w") as file:
            json.dump(record, file)


if __name__ == "__main__" and sys.argv[1:2] == ["lightning"]:
    run_lightning(sys.argv[2], sys.argv[3])
