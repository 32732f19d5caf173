"""coco: COCO's layout, ``annotations/instances_<split>.json`` and its image folder, or a ZIP file of them.

The annotation file is found as ``annotations/instances_<split>.json`` (or ``instances_<split>.json``) at
the top of the folder or ZIP file, or below one folder every member shares; ``subdir`` (``--subdir``)
names the split (``val2017``) when there are several.  Its images are looked up, by each image's
``file_name``, in ``<split>/``, ``images/<split>/``, ``images/`` or the top, the first that holds them.
Samples are the file's images in order of their ids (as torchvision's ``CocoDetection``), keyed by
``file_name``; an image without annotations is a sample with none.

COCO has no class per image: every sample's label is 0, the class ``__background__``, and the classes are
``__background__`` then the categories' names in order of their ids, so that the per-box ``labels`` index
them (torchvision's detection models take 0 as background, and ``num_classes=len(classes)``).  Each
sample's annotations become fields, all of them unless some are named (``--field NAME=KIND`` as listed
below) or ``--field none`` leaves them out:

* ``image_id`` int64[1]: the image's COCO id.
* ``boxes`` float32[N,4]: the boxes as XYXY corners in pixels (COCO's ``[x, y, w, h]`` turned, as
  torchvision's references do); ``--boxes boxes=XYXY`` moves them with a resize.
* ``labels`` int64[N]: each box's class, its index in ``classes``; ``category_id`` int64[N]: its COCO id.
* ``iscrowd`` int64[N] (0 when an annotation does not say) and ``area`` float32[N] (COCO's, in source pixels).
* ``masks`` (image, an 8-bit PNG; 16-bit when an image has over 255 annotations): the instances' masks in
  one map, 0 where none is and k + 1 where the image's k-th box's instance is (where two overlap, the
  smaller); polygons rasterised with PIL, RLE (lists of counts or pycocotools' compressed strings) decoded,
  without pycocotools.  Only when every annotation has a segmentation.  ``masks == k + 1`` is box k's mask.

Everything in the annotation file is checked before it is believed: its shape, each image's id, size and
``file_name`` (a relative path inside the image folder: no '..', not absolute), each annotation's image,
category, box (finite, inside its image, 1 pixel of slack clamped), area, ``iscrowd`` and polygons (finite,
inside the image); an RLE is checked as it is decoded (its size the image's, its counts summing to its
pixels).  Each problem is an InvalidSourceError (CorruptSampleError once converting) naming the file, the
image id and the annotation id; with on_error="skip" the image is left out instead.  An image whose file
is of another size than the annotation file says is refused too: its boxes and masks would not fit it.
"""

from __future__ import annotations

import io
import json
import math
import os
import posixpath
import re
import zipfile
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CorruptSampleError, InvalidSourceError
from ..fields import FieldSpec
from .base import Data, Source, SourceOptions, UnsafeName, member_path
from .coco_masks import MaskError, check_polygons, instance_map, polygon_mask, rle_mask
from .zip import ZipSource, truncated_zip_error

_ANNOTATIONS = re.compile(r"(?:([^/]+)/)?(?:annotations/)?instances_([^/]+)\.json\Z")
_MAX_JSON = 4 << 30  # bytes of an annotation file read at most (COCO's largest is under 500 MB)
_MAX_SIDE = 1 << 16  # an image's width or height at most
SLACK = 1.0  # pixels a box or polygon may reach past its image's edge (rounding in exports); clamped
BACKGROUND = "__background__"
FIELDS = (
    FieldSpec("image_id", "array", "int64", (1,)),
    FieldSpec("boxes", "array", "float32", (None, 4)),
    FieldSpec("labels", "array", "int64", (None,)),
    FieldSpec("category_id", "array", "int64", (None,)),
    FieldSpec("iscrowd", "array", "int64", (None,)),
    FieldSpec("area", "array", "float32", (None,)),
    FieldSpec("masks", "image"),
)


class CocoSource(Source):
    """The images of one COCO annotation file, with their annotations as fields."""

    kind = "coco"
    random_access = True
    reads_fields = True
    image_labels = False
    label_advice = "COCO images have no class of their own: each box's class is in the labels field"

    def __init__(self, path: str, classes: Sequence[str], keys: Sequence[str], images: List["_Image"],
                 folder: Optional[str], zipped: Optional[ZipSource], failed: Sequence[str], layout: str) -> None:
        super().__init__(path, classes, keys, [0] * len(keys), failed=failed, layout=layout)
        self.images = images
        self.folder = folder  # the image folder, or None for a ZIP file (``zipped`` reads its members)
        self.zipped = zipped
        self.annotation_file = path  # where the annotations are (set once listed), as errors name it
        # 8-bit masks unless an image has more than 255 instances: one dtype for the whole archive (16-bit
        # tensors do not cross a DataLoader's worker processes in torch's shared memory, so far)
        most = max((len(image.ann_ids) for image in images), default=0)
        self.mask_dtype = np.uint8 if most <= 255 else np.uint16

    @classmethod
    def sniff(cls, path: str, head: bytes) -> bool:
        if os.path.isdir(path):
            return bool(_annotation_files(_folder_names(path)))
        if head[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
            return False
        try:
            with zipfile.ZipFile(path) as archive:
                return bool(_annotation_files(archive.namelist()))
        except (zipfile.BadZipFile, OSError, ValueError):
            return False

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "CocoSource":
        if options.label_key is not None or options.image_key is not None or options.labels is not None:
            raise InvalidSourceError(path, "a COCO layout takes no labels, label_key or image_key option")
        specs = _chosen_fields(path, options)
        if os.path.isdir(path):
            names = _folder_names(path)
            json_name, prefix, split = _choose(path, names, options.subdir)
            json_path = os.path.join(path, json_name)
            content = _read_file(json_path)
            return _build(cls, path, json_path, content, prefix, split, specs, options,
                          lambda name: os.path.isfile(os.path.join(path, name)), None)
        try:
            with zipfile.ZipFile(path) as archive:
                infos: Dict[str, zipfile.ZipInfo] = {}
                for info in archive.infolist():
                    try:
                        infos.setdefault(member_path(info.filename), info)
                    except UnsafeName:
                        continue  # never an annotation file or an image of it (file names are checked too)
                json_name, prefix, split = _choose(path, list(infos), options.subdir)
                with archive.open(infos[json_name]) as member:
                    content = member.read(_MAX_JSON + 1)
        except zipfile.BadZipFile as exc:
            raise truncated_zip_error(path, exc) from None
        if len(content) > _MAX_JSON:
            raise InvalidSourceError(f"{path}:{json_name}", f"is over {_MAX_JSON} bytes: no annotation file")
        return _build(cls, path, f"{path}:{json_name}", content, prefix, split, specs, options,
                      lambda name: name in infos and not infos[name].is_dir(), infos)

    def location(self, i: int) -> str:
        if self.zipped is not None:
            return self.zipped.location(i)
        assert self.folder is not None
        return os.path.join(self.folder, self.key(i))

    def load(self, i: int) -> Data:
        if self.zipped is not None:
            data = self.zipped.load(i)
        else:
            try:
                with open(self.location(i), "rb") as file:
                    data = file.read()
            except OSError as exc:
                raise CorruptSampleError(self.location(i), f"cannot read it: {exc.strerror}", index=i,
                                         key=self.key(i)) from None
        _check_size(self, i, data)
        return data

    def load_fields(self, i: int) -> Dict[str, Any]:
        image = self.images[i]
        values = {"image_id": np.asarray([image.id], dtype=np.int64), "boxes": image.boxes,
                  "labels": image.labels, "category_id": image.category_ids, "iscrowd": image.iscrowd,
                  "area": image.area}
        if any(spec.name == "masks" for spec in self.fields):
            values["masks"] = self._masks(i)
        return {spec.name: values[spec.name] for spec in self.fields}

    def _masks(self, i: int) -> np.ndarray:
        """Sample i's instance map (``instance_map``), each annotation's mask decoded in turn."""
        image = self.images[i]
        try:
            return instance_map(self._each_mask(i), image.height, image.width, self.mask_dtype)
        except MaskError as exc:
            raise CorruptSampleError(self.annotation_file, f"image {image.id}: masks: {exc}", index=i,
                                     key=self.key(i)) from None

    def _each_mask(self, i: int) -> Iterator[np.ndarray]:
        image = self.images[i]
        for ann_id, segmentation in zip(image.ann_ids, image.segmentations):
            try:
                if isinstance(segmentation, dict):
                    yield rle_mask(segmentation, image.height, image.width)
                else:
                    yield polygon_mask(segmentation, image.height, image.width)
            except MaskError as exc:
                raise CorruptSampleError(self.annotation_file,
                                         f"image {image.id}, annotation {ann_id}: segmentation: {exc}",
                                         index=i, key=self.key(i),
                                         hint="fix the annotation, leave masks out (--field none, or name the "
                                              "other fields), or --on-error skip") from None

    def stored_size(self, i: int) -> Optional[int]:
        if self.zipped is not None:
            return self.zipped.stored_size(i)
        try:
            return os.path.getsize(self.location(i))
        except OSError:
            return 0  # reported by the conversion itself

    def close(self) -> None:
        if self.zipped is not None:
            self.zipped.close()


class _Image:
    """One image of the annotation file, its annotations checked, as arrays."""

    __slots__ = ("id", "file_name", "height", "width", "ann_ids", "boxes", "labels", "category_ids", "iscrowd",
                 "area", "segmentations")

    def __init__(self, id: int, file_name: str, height: int, width: int) -> None:
        self.id, self.file_name, self.height, self.width = id, file_name, height, width
        self.ann_ids: List[int] = []
        self.segmentations: List[Any] = []
        self.boxes: Any = []
        self.labels: Any = []
        self.category_ids: Any = []
        self.iscrowd: Any = []
        self.area: Any = []

    def seal(self) -> None:
        """Its annotations' lists as the fields' arrays."""
        self.boxes = np.asarray(self.boxes, dtype=np.float32).reshape(-1, 4)
        self.labels = np.asarray(self.labels, dtype=np.int64)
        self.category_ids = np.asarray(self.category_ids, dtype=np.int64)
        self.iscrowd = np.asarray(self.iscrowd, dtype=np.int64)
        self.area = np.asarray(self.area, dtype=np.float32)


class _Bad(Exception):
    """A problem found in the annotation file, with the image (and annotation) it is about."""

    def __init__(self, problem: str, image_id: Any = None, ann_id: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.image_id, self.ann_id = problem, image_id, ann_id

    def error(self, where: str, key: Optional[str] = None) -> InvalidSourceError:
        about = []
        if self.image_id is not None:
            about.append(f"image {self.image_id!r:.40}")
        if self.ann_id is not None:
            about.append(f"annotation {self.ann_id!r:.40}")
        lead = f"{', '.join(about)}: " if about else ""
        return InvalidSourceError(where, lead + self.problem, key=key,
                                  hint="fix the annotation file, or --on-error skip to leave such images out"
                                  if self.image_id is not None else "fix the annotation file")


def _folder_names(path: str) -> List[str]:
    """The names at the top of a folder and in its ``annotations/`` folder, relative to it."""
    try:
        names = sorted(os.listdir(path))
        if os.path.isdir(os.path.join(path, "annotations")):
            names += ["annotations/" + n for n in sorted(os.listdir(os.path.join(path, "annotations")))]
    except OSError:
        return []
    return names


def _annotation_files(names: Sequence[str]) -> Dict[str, Tuple[str, str]]:
    """{annotation file name: (the folder it is below, its split)}: ``instances_<split>.json`` at the top,
    in ``annotations/``, or either below one folder (a ZIP file's single top folder)."""
    found = {}
    for name in names:
        match = _ANNOTATIONS.fullmatch(name)
        if match is not None:
            prefix = match.group(1) or ""
            if prefix == "annotations" and name.startswith("annotations/instances_"):
                prefix = ""  # the regex's folder took the annotations folder itself
            found[name] = (prefix, match.group(2))
    return found


def _choose(path: str, names: Sequence[str], subdir: Optional[str]) -> Tuple[str, str, str]:
    """(annotation file name, the folder it is below, its split): the one of split ``subdir``, or the only one."""
    found = _annotation_files(names)
    if subdir is not None:
        found = {n: v for n, v in found.items() if v[1] == subdir}
    splits = sorted({split for _, split in found.values()})
    if not found:
        raise InvalidSourceError(path, f"has no annotations/instances_{subdir}.json",
                                 hint="--subdir names a split (val2017 for instances_val2017.json)")
    if len(found) > 1:
        raise InvalidSourceError(path, f"has annotation files of several splits ({', '.join(splits)}) or folders",
                                 hint=f"choose one with --subdir (subdir=), e.g. --subdir {splits[0]}")
    name, (prefix, split) = next(iter(found.items()))
    return name, prefix, split


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            content = file.read(_MAX_JSON + 1)
    except OSError as exc:
        raise InvalidSourceError(path, f"cannot read it: {exc.strerror}") from None
    if len(content) > _MAX_JSON:
        raise InvalidSourceError(path, f"is over {_MAX_JSON} bytes: no annotation file")
    return content


def _chosen_fields(path: str, options: SourceOptions) -> Tuple[FieldSpec, ...]:
    """The fields to read: all (none with "none"), or those named, each as ``FIELDS`` declares it."""
    if options.no_fields:
        return ()
    declared = options.declared_fields
    if not declared or options.auto_fields:
        return FIELDS
    listed = ", ".join(spec.describe() for spec in FIELDS)
    for spec in declared:
        if spec not in FIELDS:
            raise InvalidSourceError(path, f"a COCO layout has no field {spec.describe()} (its fields: {listed})",
                                     hint="name some of them as listed, or leave --field out for all")
    return declared


def _build(cls, path: str, where: str, content: bytes, prefix: str, split: str, specs: Tuple[FieldSpec, ...],
           options: SourceOptions, exists, infos: Optional[Dict[str, zipfile.ZipInfo]]) -> CocoSource:
    """The source of the annotation file ``content`` (at ``where``), its images looked up with ``exists``."""
    try:
        data = json.loads(content.decode("utf-8"), parse_constant=float)  # NaN read, to be refused where it is
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidSourceError(where, f"is no JSON annotation file: {exc}", hint="fix or download it again") from None
    try:
        classes, label_of = _categories(data)
        if specs is FIELDS and not all(isinstance(a, dict) and a.get("segmentation") for a in data["annotations"]):
            specs = FIELDS[:-1]  # a detection set: masks only when every annotation has its segmentation
        images, failed = _images(data, where, options.on_error)
        by_id = {image.id: image for image in images}
        masks = any(spec.name == "masks" for spec in specs)
        bad = _annotations(data, by_id, label_of, where, options.on_error, masks, failed)
    except _Bad as exc:
        raise exc.error(where) from None
    images = [image for image in sorted(images, key=lambda image: image.id) if image.id not in bad]
    folder = _image_folder(prefix, split, [image.file_name for image in images], exists)
    kept: List[_Image] = []
    for image in images:
        name = posixpath.join(folder, image.file_name) if folder else image.file_name
        if not exists(name):
            error = InvalidSourceError(where, f"image {image.id}: its file {image.file_name!r} is not in "
                                              f"{folder or 'the top folder'}", key=image.file_name,
                                       hint="check the image folder, or --on-error skip to leave it out")
            if options.on_error == "raise":
                raise error
            failed.append(str(error))
            continue
        image.seal()
        kept.append(image)
    keys = [image.file_name for image in kept]
    described = ", ".join(spec.name for spec in specs) or "no fields"
    layout = f"COCO {split}: {len(kept)} images, {len(classes) - 1} categories, fields {described}"
    zipped = None
    if infos is not None:
        chosen = [infos[posixpath.join(folder, key) if folder else key] for key in keys]
        zipped = ZipSource(path, classes, keys, [0] * len(keys), chosen, 0, [], layout)
    source = cls(path, classes, keys, kept, os.path.join(path, folder) if infos is None else None, zipped, failed,
                 layout)
    source.fields, source.annotation_file = specs, where
    return source


def _categories(data: Any) -> Tuple[List[str], Dict[int, int]]:
    """(classes: background then the names by id, {category id: label})."""
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "annotations",
                                                                                     "categories")):
        raise _Bad("an annotation file is an object with the lists 'images', 'annotations' and 'categories'")
    categories = data["categories"]
    for category in categories:
        if not isinstance(category, dict) or not _is_int(category.get("id")) or not isinstance(
                category.get("name"), str) or not category["name"]:
            raise _Bad(f"a category is an object with an integer 'id' and a 'name', got {category!r:.100}")
    ids = [c["id"] for c in categories]
    names = [c["name"] for c in categories]
    twice = sorted({i for i in ids if ids.count(i) > 1}) or sorted({n for n in names + [BACKGROUND]
                                                                   if (names + [BACKGROUND]).count(n) > 1})
    if twice:
        raise _Bad(f"the category ids or names {twice[:5]} come more than once (or a category is named {BACKGROUND})")
    ordered = sorted(categories, key=lambda c: c["id"])
    return [BACKGROUND] + [c["name"] for c in ordered], {c["id"]: k + 1 for k, c in enumerate(ordered)}


def _images(data: Dict[str, Any], where: str, on_error: str) -> Tuple[List[_Image], List[str]]:
    images: List[_Image] = []
    failed: List[str] = []
    seen_ids, seen_names = set(), set()
    for entry in data["images"]:
        image_id: Any = entry.get("id") if isinstance(entry, dict) else None
        try:
            if not isinstance(entry, dict) or not _is_int(image_id):
                raise _Bad(f"an image is an object with an integer 'id', got {entry!r:.100}")
            name = entry.get("file_name")
            if not isinstance(name, str):
                raise _Bad("has no 'file_name' string", image_id)
            try:
                name = member_path(name)
            except UnsafeName:
                raise _Bad(f"file_name {name!r:.200} is no relative path inside the image folder (absolute, "
                           "with '..' or a control character): refused", image_id) from None
            height: Any = entry.get("height")
            width: Any = entry.get("width")
            if not (_is_int(height) and _is_int(width) and 0 < height <= _MAX_SIDE and 0 < width <= _MAX_SIDE):
                raise _Bad(f"width and height are integers from 1 to {_MAX_SIDE}, got {width!r:.40} x "
                           f"{height!r:.40}", image_id)
            if image_id in seen_ids or name in seen_names:
                raise _Bad(f"its id or file_name {name!r} comes twice", image_id)
        except _Bad as exc:
            if exc.image_id is None or on_error == "raise":
                raise
            failed.append(str(exc.error(where)))
            continue
        seen_ids.add(image_id)
        seen_names.add(name)
        images.append(_Image(image_id, name, height, width))
    return images, failed


def _annotations(data: Dict[str, Any], by_id: Dict[int, _Image], label_of: Dict[int, int], where: str,
                 on_error: str, masks: bool, failed: List[str]) -> set:
    """Each annotation checked and added to its image; the ids of the images left out (on_error="skip")."""
    bad: set = set()
    seen = set()
    for ann in data["annotations"]:
        ann_id: Any = ann.get("id") if isinstance(ann, dict) else None
        image_id: Any = ann.get("image_id") if isinstance(ann, dict) else None
        try:
            if not isinstance(ann, dict) or not _is_int(ann_id) or not _is_int(image_id):
                raise _Bad(f"an annotation is an object with integer 'id' and 'image_id', got {ann!r:.100}")
            image = by_id.get(image_id)
            if image is None:
                raise _Bad("its image_id is no image of the file", image_id, ann_id)
            if ann_id in seen:
                raise _Bad("its id comes twice", image_id, ann_id)
            seen.add(ann_id)
            _add(image, ann, label_of, masks)
        except _Bad as exc:
            if exc.image_id is None or image_id not in by_id or on_error == "raise":
                raise
            bad.add(image_id)
            failed.append(str(exc.error(where, by_id[image_id].file_name)))
    return bad


def _add(image: _Image, ann: Dict[str, Any], label_of: Dict[int, int], masks: bool) -> None:
    """One annotation of ``image``, checked (a _Bad naming it when it does not fit)."""
    ids = (image.id, ann["id"])
    category = ann.get("category_id")
    if not _is_int(category) or category not in label_of:
        raise _Bad(f"category_id {category!r:.40} is no category of the file", *ids)
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) and math.isfinite(v) for v in box)):
        raise _Bad(f"bbox is [x, y, width, height] of finite numbers, got {box!r:.100}", *ids)
    x, y, w, h = box
    if w < 0 or h < 0 or x < -SLACK or y < -SLACK or x + w > image.width + SLACK or y + h > image.height + SLACK:
        raise _Bad(f"bbox {box} is not inside the image's {image.width} x {image.height} pixels (width x height)",
                   *ids)
    area: Any = ann.get("area")
    if not (_is_number(area) and math.isfinite(area) and area >= 0):
        raise _Bad(f"area is a finite number >= 0, got {area!r:.40}", *ids)
    crowd = ann.get("iscrowd", 0)
    if crowd not in (0, 1) or isinstance(crowd, bool):
        raise _Bad(f"iscrowd is 0 or 1, got {crowd!r:.40}", *ids)
    segmentation = ann.get("segmentation")
    if masks:
        if isinstance(segmentation, list):
            try:
                check_polygons(segmentation, image.height, image.width, SLACK)
            except MaskError as exc:
                raise _Bad(f"segmentation: {exc}", *ids) from None
        elif not isinstance(segmentation, dict):
            raise _Bad("has no segmentation (polygons or RLE) for the masks field",
                       *ids) from None
    x0, y0 = min(max(x, 0.0), image.width), min(max(y, 0.0), image.height)
    x1, y1 = min(max(x + w, 0.0), image.width), min(max(y + h, 0.0), image.height)
    image.ann_ids.append(ann["id"])
    image.segmentations.append(segmentation)
    image.boxes.append((x0, y0, x1, y1))
    image.labels.append(label_of[category])
    image.category_ids.append(category)
    image.iscrowd.append(crowd)
    image.area.append(area)


def _image_folder(prefix: str, split: str, names: Sequence[str], exists) -> str:
    """Where the images are: the first of ``<split>/``, ``images/<split>/``, ``images/`` and the top (below
    ``prefix``) that holds the first image."""
    candidates = [split, f"images/{split}", "images", ""]
    paths = [posixpath.join(prefix, c) if prefix else c for c in candidates]
    for folder in paths:
        if names and exists(posixpath.join(folder, names[0]) if folder else names[0]):
            return folder.rstrip("/")
    return paths[0]


def _check_size(source: CocoSource, i: int, data: bytes) -> None:
    """CorruptSampleError when the image file is of another size than the annotation file says (its boxes and
    masks would not fit it); a file PIL cannot tell the size of is left to the conversion to report."""
    from PIL import Image

    image = source.images[i]
    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
    except Exception:  # noqa: BLE001 - not an image PIL reads: the conversion says so, naming the file
        return
    if (width, height) != (image.width, image.height):
        raise CorruptSampleError(source.location(i), f"image {image.id} is {width} x {height} pixels, but the "
                                 f"annotation file says {image.width} x {image.height}: its boxes and masks would "
                                 "not fit it", index=i, key=source.key(i),
                                 hint="fix the annotation file's width and height, or --on-error skip")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
