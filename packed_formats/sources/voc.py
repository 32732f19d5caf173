"""voc: Pascal VOC's layout, ``JPEGImages/`` with ``SegmentationClass/`` masks and ``Annotations/`` XML boxes.

The folder given is the VOC one (``VOC2012``), or holds it (``VOCdevkit/VOC2012``).  ``subdir``
(``--subdir``) names a split: the images listed in ``ImageSets/Segmentation/<split>.txt`` when masks are
read, else ``ImageSets/Main/<split>.txt``; without it, every image that has each field's file.  Keys are
``JPEGImages/`` file names.

VOC has no class per image: every sample's label is 0, the class ``background``, and the classes are
VOC's 21 (background then aeroplane ... tvmonitor, the indices its masks hold), then any other object name
the XML files use, sorted.  Fields, all those the folders hold unless some are named (``--field NAME=KIND``
as listed here) or ``--field none`` leaves them out:

* ``mask`` (image): ``SegmentationClass/<stem>.png`` as it is, a palette PNG whose indices are the classes
  (255: the border VOC leaves out of its scores).
* ``boxes`` float32[N,4]: each object's ``bndbox`` as XYXY, the numbers of the XML (VOC counts pixels from
  1); ``--boxes boxes=XYXY`` moves them with a resize.
* ``labels`` int64[N]: each box's class, its index in ``classes``; ``difficult`` int64[N] (0 when not said).

The XML files are untrusted: one with a DOCTYPE (entities) is refused unread, and each object's name and
box (finite, ordered, inside the image its ``size`` says, 1 pixel of slack clamped) is checked.  A problem
is an InvalidSourceError naming the file and the object (or the image is left out with on_error="skip");
a mask or image of another size than the XML's ``size`` or each other is refused when converting.
"""

from __future__ import annotations

import math
import os
import re
import xml.etree.ElementTree as ElementTree
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CorruptSampleError, InvalidSourceError
from ..fields import FieldSpec
from .base import Data, Source, SourceOptions

VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")
MASK = FieldSpec("mask", "image")
BOX_FIELDS = (FieldSpec("boxes", "array", "float32", (None, 4)), FieldSpec("labels", "array", "int64", (None,)),
              FieldSpec("difficult", "array", "int64", (None,)))
SLACK = 1.0  # pixels a box may reach past its image's edge; clamped
_MAX_XML = 4 << 20  # bytes of one annotation file read at most
_STEM = re.compile(r"(?!\.{1,2}\Z)[^/\\\x00-\x1f\x7f]{1,255}\Z")  # an image's name in a split file: one plain name


class VocSource(Source):
    """The images of a VOC folder, with their masks and boxes as fields."""

    kind = "voc"
    random_access = True
    reads_fields = True
    image_labels = False
    label_advice = "VOC images have no class of their own: the mask and labels fields hold the classes"

    def __init__(self, root: str, classes: Sequence[str], keys: Sequence[str], objects: List["_Objects"],
                 failed: Sequence[str], layout: str) -> None:
        super().__init__(root, classes, keys, [0] * len(keys), failed=failed, layout=layout)
        self.root = root
        self.objects = objects  # per sample: its boxes, labels and difficult flags (empty without boxes)

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        return os.path.isdir(path) and bool(_voc_roots(path))

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "VocSource":
        if options.label_key is not None or options.image_key is not None or options.labels is not None:
            raise InvalidSourceError(path, "a VOC layout takes no labels, label_key or image_key option")
        roots = _voc_roots(path)
        if len(roots) != 1:
            listed = ", ".join(os.path.relpath(r, path) for r in roots)
            raise InvalidSourceError(path, f"holds several VOC folders ({listed})" if roots else
                                     "has no JPEGImages folder beside Annotations or SegmentationClass",
                                     hint="give the path of one" if roots else None)
        root = roots[0]
        specs = _chosen_fields(root, options)
        masks = MASK in specs
        boxes = any(spec in BOX_FIELDS for spec in specs)
        stems, failed = _stems(root, options.subdir, masks, boxes, options.on_error)
        kept: List[str] = []
        objects: List[_Objects] = []
        extra: set = set()
        for stem in stems:
            try:
                found = _read_xml(os.path.join(root, "Annotations", stem + ".xml")) if boxes else _Objects()
            except InvalidSourceError as exc:
                if options.on_error == "raise":
                    raise
                failed.append(str(exc))
                continue
            extra.update(name for name in found.names if name not in VOC_CLASSES)
            kept.append(stem)
            objects.append(found)
        classes = VOC_CLASSES + tuple(sorted(extra))
        index = {name: k for k, name in enumerate(classes)}
        for found in objects:
            found.seal(index)
        described = ", ".join(spec.name for spec in specs) or "no fields"
        split = f" {options.subdir}" if options.subdir else ""
        source = cls(root, classes, [stem + ".jpg" for stem in kept], objects, failed,
                     f"VOC{split}: {len(kept)} images, fields {described}")
        source.fields = specs
        return source

    def location(self, i: int) -> str:
        return os.path.join(self.root, "JPEGImages", self.key(i))

    def load(self, i: int) -> Data:
        try:
            with open(self.location(i), "rb") as file:
                data = file.read()
        except OSError as exc:
            raise CorruptSampleError(self.location(i), f"cannot read it: {exc.strerror}", index=i,
                                     key=self.key(i)) from None
        return data

    def load_fields(self, i: int) -> Dict[str, Any]:
        found = self.objects[i]
        values: Dict[str, Any] = {"boxes": found.boxes, "labels": found.labels, "difficult": found.difficult}
        image_size = _size_of(self.location(i))
        if found.size is not None and image_size is not None and image_size != found.size:
            raise CorruptSampleError(self.location(i), f"the image is {image_size[0]} x {image_size[1]} pixels, but "
                                     f"its annotation says {found.size[0]} x {found.size[1]}: its boxes would not "
                                     "fit it", index=i, key=self.key(i), hint="fix the XML's size, or --on-error skip")
        if MASK in self.fields:
            path = os.path.join(self.root, "SegmentationClass", os.path.splitext(self.key(i))[0] + ".png")
            try:
                with open(path, "rb") as file:
                    values["mask"] = MASK.from_file(file.read())
            except (OSError, ValueError) as exc:
                raise CorruptSampleError(path, f"field 'mask': cannot read it: {exc}", index=i, key=self.key(i),
                                         hint="fix the mask, or --on-error skip") from None
            mask_size = _size_of(path)
            if None not in (mask_size, image_size) and mask_size != image_size:
                raise CorruptSampleError(path, f"the mask is {_shown(mask_size)} pixels, its image "
                                         f"{_shown(image_size)}: a mask is its image's size", index=i,
                                         key=self.key(i), hint="fix the mask, or --on-error skip")
        return {spec.name: values[spec.name] for spec in self.fields}

    def stored_size(self, i: int) -> Optional[int]:
        try:
            return os.path.getsize(self.location(i))
        except OSError:
            return 0  # reported by the conversion itself


class _Objects:
    """One image's objects as its XML lists them (names, boxes, difficult flags), then as the fields' arrays."""

    def __init__(self, size: Optional[Tuple[int, int]] = None) -> None:
        self.size = size  # (width, height) as the XML says
        self.names: List[str] = []
        self.boxes: Any = []
        self.difficult: Any = []
        self.labels: Any = []

    def seal(self, index: Dict[str, int]) -> None:
        self.labels = np.asarray([index[name] for name in self.names], dtype=np.int64)
        self.boxes = np.asarray(self.boxes, dtype=np.float32).reshape(-1, 4)
        self.difficult = np.asarray(self.difficult, dtype=np.int64)


def _voc_roots(path: str) -> List[str]:
    """The VOC folders: ``path`` itself, or its ``VOC*`` and ``VOCdevkit/VOC*`` folders."""
    def fits(folder: str) -> bool:
        return os.path.isdir(os.path.join(folder, "JPEGImages")) and any(
            os.path.isdir(os.path.join(folder, name)) for name in ("Annotations", "SegmentationClass"))

    if fits(path):
        return [path]
    found = []
    for parent in (path, os.path.join(path, "VOCdevkit")):
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            continue
        found += [os.path.join(parent, n) for n in names if n.startswith("VOC") and fits(os.path.join(parent, n))]
    return found


def _chosen_fields(root: str, options: SourceOptions) -> Tuple[FieldSpec, ...]:
    """The fields to read: those the folders hold (none with "none"), or those named, as declared here."""
    if options.no_fields:
        return ()
    held = ((MASK,) if os.path.isdir(os.path.join(root, "SegmentationClass")) else ()) + (
        BOX_FIELDS if os.path.isdir(os.path.join(root, "Annotations")) else ())
    declared = options.declared_fields
    if not declared or options.auto_fields:
        return held
    listed = ", ".join(spec.describe() for spec in held) or "none"
    for spec in declared:
        if spec not in held:
            raise InvalidSourceError(root, f"this VOC folder has no field {spec.describe()} (its fields: {listed})",
                                     hint="name some of them as listed, or leave --field out for all")
    return declared


def _stems(root: str, split: Optional[str], masks: bool, boxes: bool, on_error: str) -> Tuple[List[str], List[str]]:
    """(the images' stems, the samples left out): those of the split file, or those with every field's file."""
    needed = [folder for folder, wanted in (("SegmentationClass", masks), ("Annotations", boxes)) if wanted]
    suffix = {"SegmentationClass": ".png", "Annotations": ".xml"}
    failed: List[str] = []
    if split is None:
        stems = sorted(os.path.splitext(n)[0] for n in os.listdir(os.path.join(root, "JPEGImages"))
                       if n.endswith(".jpg"))
        for folder in needed:
            names = os.listdir(os.path.join(root, folder))
            there = {os.path.splitext(n)[0] for n in names if n.endswith(suffix[folder])}
            stems = [s for s in stems if s in there]
        return stems, failed
    listing = os.path.join(root, "ImageSets", "Segmentation" if masks else "Main", f"{split}.txt")
    try:
        with open(listing, "rb") as file:
            lines = file.read(64 << 20).decode("utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSourceError(listing, f"cannot read the split's list of images: {exc}",
                                 hint="--subdir names a split that ImageSets lists (train, val, trainval)") from None
    stems = []
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        stem = words[0]
        files = [os.path.join(root, "JPEGImages", stem + ".jpg")] + [os.path.join(root, f, stem + suffix[f])
                                                                     for f in needed]
        problem = None
        if not _STEM.match(stem):
            problem = f"line {number}: {stem!r:.80} is no image name (a path, or a control character): refused"
        elif not all(os.path.isfile(f) for f in files):
            problem = f"line {number}: image {stem!r} lacks {next(f for f in files if not os.path.isfile(f))}"
        if problem is not None:
            error = InvalidSourceError(listing, problem, hint="fix the list, or --on-error skip to leave it out")
            if on_error == "raise":
                raise error
            failed.append(str(error))
            continue
        stems.append(stem)
    return stems, failed


def _read_xml(path: str) -> _Objects:
    """An image's objects from its VOC XML file (an InvalidSourceError naming the file and object when it is
    no such file)."""
    try:
        with open(path, "rb") as file:
            content = file.read(_MAX_XML + 1)
    except OSError as exc:
        raise InvalidSourceError(path, f"cannot read it: {exc.strerror}") from None

    def bad(problem: str) -> InvalidSourceError:
        return InvalidSourceError(path, problem, hint="fix the annotation, or --on-error skip to leave the image out")

    if len(content) > _MAX_XML:
        raise bad(f"is over {_MAX_XML} bytes: no VOC annotation")
    if b"<!DOCTYPE" in content or b"<!ENTITY" in content:
        raise bad("has a DOCTYPE (entities, which may expand without end): refused unread")
    try:
        top = ElementTree.fromstring(content)
    except ElementTree.ParseError as exc:
        raise bad(f"is no XML file: {exc}") from None
    width, height = _integer(top.findtext("size/width")), _integer(top.findtext("size/height"))
    found = _Objects(None if width is None or height is None else (width, height))
    objects = top.findall("object")
    if objects and found.size is None:
        raise bad("has objects but no size (width and height, whole numbers from 1): its boxes cannot be checked")
    for k, item in enumerate(objects):
        name = (item.findtext("name") or "").strip()
        if not name or re.search(r"[\x00-\x1f\x7f]", name):
            raise bad(f"object {k}: its name {name!r:.80} is empty or has a control character")
        corners = [_number(item.findtext(f"bndbox/{c}")) for c in ("xmin", "ymin", "xmax", "ymax")]
        if any(v is None for v in corners):
            raise bad(f"object {k} ({name}): its bndbox is xmin, ymin, xmax, ymax, finite numbers")
        x0, y0, x1, y1 = (float(v) for v in corners)  # type: ignore[arg-type]
        w, h = found.size  # type: ignore[misc]
        if not (-SLACK <= x0 <= x1 <= w + SLACK and -SLACK <= y0 <= y1 <= h + SLACK):
            raise bad(f"object {k} ({name}): bndbox [{x0:g}, {y0:g}, {x1:g}, {y1:g}] is not inside the image's "
                      f"{w} x {h} pixels (width x height), or not in order")
        difficult = _integer(item.findtext("difficult") or "0", lowest=0)
        if difficult not in (0, 1):
            raise bad(f"object {k} ({name}): difficult is 0 or 1")
        found.names.append(name)
        found.boxes.append([min(max(v, 0.0), limit) for v, limit in zip((x0, y0, x1, y1), (w, h, w, h))])
        found.difficult.append(difficult)
    return found


def _integer(text: Optional[str], lowest: int = 1) -> Optional[int]:
    text = (text or "").strip()
    return int(text) if text.isascii() and text.isdigit() and lowest <= int(text) <= 1 << 16 else None


def _number(text: Optional[str]) -> Optional[float]:
    try:
        value = float((text or "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _size_of(path: str) -> Optional[Tuple[int, int]]:
    """An image file's (width, height) from its header, None when PIL cannot tell (the conversion says why)."""
    from PIL import Image

    try:
        with Image.open(path) as opened:
            return opened.size
    except Exception:  # noqa: BLE001 - not an image PIL reads: the conversion reports it, naming the file
        return None


def _shown(size: Optional[Tuple[int, int]]) -> str:
    return "of unknown size" if size is None else f"{size[0]} x {size[1]}"
