"""Procedurally drawn image datasets for demos, tests, benchmarks and notebooks.

No downloads: each class is a kind of drawing (circles, boxes, stripes, ...)
over a noisy gradient, at varied, realistic image sizes, saved as JPEG (or PNG)
in an ImageFolder tree.  The same seed gives the same files.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circles", "boxes", "stripes", "triangles", "rings", "dots")


def draw_image(kind: str, size: Tuple[int, int], rng: np.random.Generator) -> Image.Image:
    """One RGB image of the given class kind and (width, height)."""
    w, h = size
    base = rng.integers(0, 256, size=3)
    ramp = np.linspace(0, 1, w, dtype=np.float32)[None, :, None] * rng.integers(-80, 80, size=3)
    noise = rng.normal(0, 12, size=(h, w, 3))
    pixels = np.clip(base + ramp + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(2, 7))):
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        x0, y0 = int(rng.integers(0, w * 3 // 4)), int(rng.integers(0, h * 3 // 4))
        x1 = x0 + int(rng.integers(w // 8, w // 2))
        y1 = y0 + int(rng.integers(h // 8, h // 2))
        if kind == "circles":
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind == "boxes":
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        elif kind == "stripes":
            step = max(4, w // int(rng.integers(6, 20)))
            for x in range(x0 % step, w, step):
                draw.line((x, 0, x + h // 3, h), fill=colour, width=max(1, step // 3))
        elif kind == "triangles":
            draw.polygon((x0, y1, (x0 + x1) // 2, y0, x1, y1), fill=colour)
        elif kind == "rings":
            draw.ellipse((x0, y0, x1, y1), outline=colour, width=max(2, w // 40))
        else:
            for _ in range(30):
                cx, cy, r = int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(2, 8))
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    return image


def make_image_folder(
    root: "str | os.PathLike[str]",
    images_per_class: int = 50,
    classes: Sequence[str] = CLASSES,
    sizes: Tuple[int, int] = (160, 500),
    seed: int = 0,
    encoding: str = "jpeg",
    quality: int = 90,
) -> str:
    """Write an ImageFolder tree root/<class>/<class>_<n>.jpg; return root.

    Widths and heights are drawn independently from ``sizes`` (inclusive range).
    """
    root = os.fspath(root)
    rng = np.random.default_rng(seed)
    extension = "jpg" if encoding == "jpeg" else "png"
    for kind in classes:
        directory = os.path.join(root, kind)
        os.makedirs(directory, exist_ok=True)
        for n in range(images_per_class):
            w, h = (int(x) for x in rng.integers(sizes[0], sizes[1] + 1, size=2))
            image = draw_image(kind if kind in CLASSES else CLASSES[hash(kind) % len(CLASSES)], (w, h), rng)
            options: Dict[str, Any] = {"quality": quality} if encoding == "jpeg" else {}
            image.save(os.path.join(directory, f"{kind}_{n:05d}.{extension}"), **options)
    return root


def sample_photographs() -> List[str]:
    """Paths of real photographs shipped inside installed packages (matplotlib's sample data: a
    public-domain portrait), or an empty list where none is installed."""
    try:
        import matplotlib
    except ImportError:
        return []
    folder = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data")
    return [path for path in [os.path.join(folder, "grace_hopper.jpg")] if os.path.isfile(path)]


def make_photo_folder(
    root: "str | os.PathLike[str]",
    images_per_class: int = 50,
    classes: Sequence[str] = ("a", "b", "c", "d"),
    sizes: Tuple[int, int] = (200, 480),
    seed: int = 0,
    quality: int = 90,
) -> str:
    """Write an ImageFolder tree of photographic JPEGs; return root.

    Drawn shapes compress and decode unlike photographs (flat areas, sharp
    edges, little texture).  These are crops of real photographs shipped with
    an installed package (``sample_photographs``): a random region, only ever
    scaled down to a width and height drawn from ``sizes``, flipped at random,
    re-encoded at ``quality``: the textures, noise and chroma of a camera
    image.  Classes are arbitrary (the crops are not about anything).
    Raises RuntimeError when no sample photograph is installed (matplotlib).
    """
    photos = [Image.open(path).convert("RGB") for path in sample_photographs()]
    if not photos:
        raise RuntimeError("no sample photographs installed: pip install matplotlib")
    root = os.fspath(root)
    rng = np.random.default_rng(seed)
    for kind in classes:
        directory = os.path.join(root, kind)
        os.makedirs(directory, exist_ok=True)
        for n in range(images_per_class):
            photo = photos[int(rng.integers(len(photos)))]
            w, h = (int(x) for x in rng.integers(sizes[0], sizes[1] + 1, size=2))
            grow = rng.uniform(1.0, min(photo.width / w, photo.height / h)) if photo.width >= w and photo.height >= h \
                else min(photo.width / w, photo.height / h)
            crop_w, crop_h = max(1, int(w * grow)), max(1, int(h * grow))
            left, top = int(rng.integers(0, photo.width - crop_w + 1)), int(rng.integers(0, photo.height - crop_h + 1))
            image = photo.crop((left, top, left + crop_w, top + crop_h)).resize((w, h), Image.Resampling.BILINEAR)
            if rng.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            image.save(os.path.join(directory, f"{kind}_{n:05d}.jpg"), quality=quality)
    return root
