"""Transforms of a batch *and its labels*: MixUp, CutMix and the like.

A transform that mixes samples must mix their labels the same way, so it takes
``(images, labels)`` and gives both back (labels then become soft float
targets [B, num_classes]).  It says so with ``takes_labels = True``;
``WithLabels(fn)`` marks any callable.  torchvision's ``MixUp`` and ``CutMix``
are recognised as they are, alone or in a torchvision ``RandomChoice``,
``RandomApply`` or ``Compose`` of only such transforms (one that also holds
per-image transforms is refused: on a whole batch they would draw once).

Given where only images are expected, such a transform raises
(``check_images_only``): applied to the images alone it would mix the pixels
and leave each sample its own label, a silent error in the targets.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

Batch = Tuple[torch.Tensor, torch.Tensor]  # (images, labels)


class WithLabels:
    """Marks a callable as taking and returning ``(images, labels)`` for whole batches.

    ``make_loader(transform=Compose([Normalize(), WithLabels(fn)]))`` calls
    ``fn(images, labels)`` on every batch, after the steps before it.  Draws
    from torch's global CPU generator follow the loader's seed: it is seeded
    from the batch's generator for the call, so they are the same with any
    number of workers, and whether the batch is on the CPU or a GPU.

    Args:
        function: the callable, ``function(images, labels) -> (images, labels)``.
    """

    takes_labels = True
    is_batch_transform = True

    def __init__(self, function: Callable[[torch.Tensor, torch.Tensor], Batch]) -> None:
        self.function = function

    def __call__(self, images: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Batch:
        if labels is None:
            raise TypeError(images_only_error(self))
        return self.function(images, labels)

    def __repr__(self) -> str:
        return f"WithLabels({self.function!r})"


def takes_labels(transform: Any) -> bool:
    """Whether ``transform`` takes ``(images, labels)``: marked ``takes_labels = True`` (``WithLabels``,
    a ``Compose`` holding one), or torchvision's MixUp/CutMix, alone or in a torchvision container."""
    if getattr(transform, "takes_labels", False) is True:
        return True
    return any(_is_torchvision_mixer(t) for t in _torchvision_leaves(transform))


def check_images_only(transform: Any) -> None:
    """TypeError if ``transform`` takes labels: the caller has only images to give it."""
    if takes_labels(transform):
        raise TypeError(images_only_error(transform))


def images_only_error(transform: Any) -> str:
    return (
        f"{transform!r} mixes samples and their labels, so it takes (images, labels), but was given images only: "
        "give it to make_loader's transform= (alone, or in a pf.transforms.Compose after Normalize or ToFloat), "
        "or call pf.transforms.apply_with_labels(transform, images, labels)"
    )


def mix(transform: Callable, images: torch.Tensor, labels: torch.Tensor,
        generator: Optional[torch.Generator] = None) -> Batch:
    """``transform(images, labels)``, with torch's global CPU generator seeded from ``generator`` for the call.

    torchvision's mixers draw from the global generator; seeding it from the
    batch's generator makes their draws follow the loader's seed wherever the
    batch is made (a worker, the main process, a GPU), and leaves the caller's
    global state as it was.
    """
    _check_torchvision_container(transform)
    _check_float_for_mixup(transform, images)
    if labels.numel() and int(labels.min()) < 0:  # one_hot would only say "Class values must be non-negative"
        raise ValueError(f"{type(transform).__name__} mixes the batch's labels, but the batch has samples without "
                         f"a label (-1, at places {torch.nonzero(labels < 0).flatten().tolist()} of the batch)")
    with _global_rng_from(generator):
        result = transform(images, labels)
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(r, torch.Tensor) for r in result)):
        raise TypeError(f"{transform!r} takes labels, so it must return (images, labels) tensors, "
                        f"got {type(result).__name__}")
    return result[0], result[1]


@contextlib.contextmanager
def _global_rng_from(generator: Optional[torch.Generator]) -> Iterator[None]:
    if generator is None:
        yield
        return
    seed = int(torch.randint(2**62, (), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ---- torchvision's mixers ---------------------------------------------------------------------------
def _torchvision_v2() -> Any:
    """torchvision.transforms.v2 if something has imported it (a torchvision object exists only then)."""
    return sys.modules.get("torchvision.transforms.v2")


def _is_torchvision_mixer(transform: Any) -> bool:
    v2 = _torchvision_v2()
    return v2 is not None and isinstance(transform, (v2.MixUp, v2.CutMix))


def _torchvision_leaves(transform: Any) -> List[Any]:
    """The transforms inside a torchvision container (Compose, RandomChoice, RandomApply, ...) or a
    ``WithLabels``, recursively; ``[transform]`` for anything else."""
    if isinstance(transform, WithLabels):
        return _torchvision_leaves(transform.function)
    v2 = _torchvision_v2()
    inner = getattr(transform, "transforms", None)
    if v2 is None or not isinstance(transform, v2.Transform) or inner is None:
        return [transform]
    return [leaf for t in inner for leaf in _torchvision_leaves(t)]


def _check_torchvision_container(transform: Any) -> None:
    """ValueError for a torchvision container mixing MixUp/CutMix with other transforms: applied to
    a whole batch, those would draw their random parameters once for all its images."""
    leaves = _torchvision_leaves(transform)
    others = [t for t in leaves if not _is_torchvision_mixer(t)]
    if len(leaves) > 1 and others and len(others) < len(leaves):
        raise ValueError(
            f"{transform!r} holds MixUp/CutMix and other transforms ({', '.join(repr(t) for t in others)}); "
            "it is applied to whole batches, so those would draw once per batch: give "
            "pf.transforms.Compose([<per-image pipeline>, <MixUp/CutMix or a RandomChoice of them>])"
        )


def _check_float_for_mixup(transform: Any, images: torch.Tensor) -> None:
    """ValueError when torchvision's MixUp would blend integer pixels (it fails on them)."""
    v2 = _torchvision_v2()
    if v2 is None or images.is_floating_point():
        return
    if any(isinstance(t, v2.MixUp) for t in _torchvision_leaves(transform)):
        raise ValueError(
            f"{transform!r} blends the pixels of two images, so it needs float images, got {images.dtype}: "
            "put it after pf.transforms.Normalize or ToFloat, e.g. Compose([train(224), MixUp(...)])"
        )
