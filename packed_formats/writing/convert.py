"""The conversion pipeline: a source -> parallel decode/resize/encode -> one writer -> an atomic archive.

Worker processes prepare samples (prepare.Recipe) in chunks; the main process
appends them to a single Writer in source order, so the same input gives a
byte-identical archive whatever the number of workers and whenever it runs
(no wall-clock time is stored).  Before writing, the destination's file system
must have room for the estimated output.  The archive is written under a
temporary name and moved into place only once sealed and spot-checked; an
error, Ctrl-C, SIGTERM or SIGHUP removes every temporary file and leaves the
destination as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from .. import codecs, storage
from ..backends import EXTENSIONS, PACKED_FORMATS, open_writer
from ..backends.files import remove_path
from ..backends.set_samples import samples_name
from ..backends.sharded import ShardedWriter, existing_set_files, part_name
from ..errors import (
    ArchiveExistsError,
    ConversionFailedError,
    CorruptSampleError,
    DestinationError,
    InsufficientSpaceError,
    InvalidSourceError,
    PackedFormatError,
    RemoteNotFoundError,
)
from ..fields import BOX_FORMATS, FieldSpec, FieldValueError
from ..handles import pid_alive
from ..manifest import MODES, RAW_LAYOUTS
from ..policy import RESIZE_MODES
from ..sources import Source, SourcePath, open_source
from ..sources.base import SourceWarning, describe_skipped
from ..space import archive_bytes, check_free_space, disk_usage, human_bytes
from .parallel import WorkerDiedError, available_cores, ordered_map
from .prepare import Recipe, parse_size
from .python_tasks import as_python_source, open_python, worker_task

ON_ERROR = ("raise", "skip")
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.pf-tmp-(?P<pid>\d+)-[0-9a-f]{8}(-old)?$")
_SIZED_FILES = 1000  # source files whose sizes are read to estimate a large folder's bytes
_SIZED_FIELDS = 16  # samples whose fields are read to estimate the bytes of every sample's fields
_REENCODED_RATIO = 20  # a re-encoded image is assumed to take at least 1/20 of its pixels' bytes
_AS_STORED = (".jpg", ".jpeg", ".png")  # encoded mode keeps these files' own bytes


class ConversionInterrupted(KeyboardInterrupt):
    """The conversion was stopped by a signal (SIGINT, SIGTERM, SIGHUP); nothing was written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion did.

    Args:
        source, destination: the paths read and written.
        format, mode: the archive's format and mode ("raw" or "encoded").
        samples, classes: how many samples and classes were packed.
        skipped: files of the source left out, no image of a kind read (``skipped_names``: the first of them).
        failed: unreadable images skipped with ``on_error="skip"``, as "path: problem".
        bytes: the size on disk of everything written.
        seconds: how long the conversion took (``samples_per_second`` follows).
        layout: what a sample is, such as "raw 128x128x3" or "encoded jpeg".
        parts: the shard files of a sharded archive (empty when not sharded).
        note: what else happened (for a part of a set: which parts, and whether the set was joined).
    """

    source: str
    destination: str
    format: str
    mode: str
    samples: int
    classes: int
    skipped: int  # non-image files left out of the source
    failed: List[str]  # unreadable images skipped with on_error="skip", as "path: problem"
    bytes: int  # size on disk of everything written
    seconds: float
    layout: str  # "raw 128x128x3" or "encoded jpeg"
    parts: List[str] = dataclasses.field(default_factory=list)  # shard files (empty when not sharded)
    note: str = ""  # what else happened (a part of a set: which parts, and whether the set was joined)
    skipped_names: List[str] = dataclasses.field(default_factory=list)  # the first files left out, to name them

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    def line(self, verbose: bool = False) -> str:
        """The one-line summary the command line prints: the first files skipped named (``verbose``: all kept)."""
        shards = f" in {len(self.parts)} parts" if self.parts else ""
        skipped = describe_skipped(self.skipped, self.skipped_names, None if verbose else 5, "--verbose lists them")
        return (
            f"wrote {self.destination} ({self.format}, {self.layout}{shards}): {self.samples} samples, "
            f"{self.classes} classes, {len(self.failed)} bad images skipped, "
            f"{human_bytes(self.bytes)}, {self.seconds:.1f} s ({self.samples_per_second:.0f} samples/s); {skipped}"
            + (f"; {self.note}" if self.note else "")
        )


def convert(
    src: "SourcePath | Any",
    dst: "str | os.PathLike[str]",
    *,
    format: Optional[str] = None,
    mode: str = "encoded",
    size: "int | str | Tuple[int, int] | None" = None,
    resize_mode: str = "stretch",
    quality: int = 90,
    encoding: str = "jpeg",
    labels: "str | os.PathLike[str] | None" = None,
    workers: Optional[int] = None,
    shard_size: Optional[int] = None,
    overwrite: bool = False,
    on_error: str = "raise",
    quiet: bool = False,
    subdir: Optional[str] = None,
    source_format: Optional[str] = None,
    label_key: Optional[str] = None,
    image_key: Optional[str] = None,
    allow_pickle: bool = False,
    part: Optional[Tuple[int, Optional[int]]] = None,
    fields: Sequence[Any] = (),
    boxes: "Mapping[str, str] | Sequence[str]" = (),
    unscaled: Sequence[str] = (),
    inputs: Optional[Sequence[Any]] = None,
    classes: Optional[Sequence[str]] = None,
    raw_layout: str = "hwc",
) -> ConvertSummary:
    """Pack ``src`` into ``dst``, reading ``src`` where it is (nothing is extracted).

    ``src`` is an ImageFolder tree, a flat folder + ``labels`` file, an
    archive of ours, or a dataset in the container it came in: a ZIP or tar
    (.tar, .tar.gz, .tar.bz2, .tar.xz) of an ImageFolder tree or with a
    stylegan2-ada dataset.json, a tar of per-class tars, webdataset shards (a
    list or a brace pattern such as ``shards-{000..009}.tar``), an HDF5 file
    of images + labels, an LMDB of pickled records, or a CSV/JSON list of
    ``path,label``.  The kind is found from the content (see
    ``packed_formats.sources``); samples, keys and labels are those of the
    extracted folder.  ``src`` may also be Python code's samples: a map-style
    dataset (a torch or torchvision dataset, a ``datasets.Dataset``, a list),
    ``fn`` with ``inputs`` (``fn(input)`` makes a sample, or None to leave the
    input out), or a ``sources.python.PythonSource`` (see there for the items).

    Args:
        format: zip, hdf5, lmdb or memmap (default: from dst's extension).
        mode: "raw" (decoded pixels of ``size``, required unless src is raw) or
            "encoded" (the source files' own bytes; resized and re-encoded
            with ``encoding``/``quality`` when ``size`` is given).
        size: N or "HxW" or (H, W); ``resize_mode`` "stretch" or "shorter-side-center-crop".
        labels: label file for a flat folder: one integer per line (sorted file
            order) or CSV ``filename,label``.
        workers: processes that decode/resize/encode (default: available cores).
        shard_size: write parts of this many samples plus an index at ``dst``.
        on_error: "raise" stops at the first unreadable image; "skip" leaves it out.
        quiet: no progress bar.
        subdir: the folder (split) to read inside a folder, ZIP or tar, or the group of an HDF5 file.
        source_format: read ``src`` as this kind instead of detecting it (``sources.source_formats()``).
        label_key, image_key: where labels and images are: webdataset member extensions
            (default ``cls``; ``jpg,jpeg,png,webp``), HDF5 dataset names (``labels``, ``images``)
            or the fields of pickled records.
        allow_pickle: read an LMDB of pickled records; unpickling runs code from the file.
        part: (I, N): write only task I's parts of N tasks of a sharded set (``shard_size``
            decides the split, the same for every N), then its index if every part is sealed;
            N None: from the set's plan, or the Slurm array (``parts.parse_part("auto")``).
            See ``packed_formats.parts``.
        overwrite: replace an archive already at ``dst`` (else ArchiveExistsError).
        fields: the fields to pack with each sample (``FieldSpec``s or ``NAME=KIND`` strings, as
            ``--field``), "auto" among them for those the source finds in every sample too, or
            ``["none"]`` for none (not even an archive's own).  A resize (``size``) takes image fields
            along (nearest neighbour) and the boxes of ``boxes``, and refuses other array fields.  Each
            part of a set (``shard_size``, ``part``) holds its samples' fields.
        boxes: the array fields (``[N,4]`` or ``[4]``) that hold boxes, and their format: ``{"boxes":
            "XYXY"}`` or ``["boxes=XYXY"]`` (XYXY, XYWH or CXCYWH, in pixels of the source image, as
            ``--boxes``).  A resize moves, scales and clamps them with the image.
        unscaled: array fields whose values do not depend on where things are in the image (per-box
            labels, scores, ids; ``--unscaled``): a resize keeps them as they are.
        inputs: what ``src``, a function, is called with (one sample each).
        classes: a Python source's class names, in label order (default: its ``classes`` attribute, a
            ``datasets`` ClassLabel's names, else the sorted label values).
        raw_layout: how a raw archive stores each image's pixels: "hwc" (interleaved, the default: what
            archives have always held, read by every packed_formats and shown as [N,H,W,C] by standard
            tools) or "chw" (planar: a loader's default contiguous NCHW batch is then a plain copy of
            the stored bytes).  With the package's C module built, either layout reads into either
            memory format at the speed of a copy; without it, moving the channels costs ~3x the copy
            (numpy), and "chw" is worth it for NCHW training.  Only for mode="raw".

    Raises:
        PackedFormatError (bad source, destination inside the source or
        existing, not enough free space, a write failure naming the
        destination, bad image), ValueError (bad option),
        ConversionInterrupted / KeyboardInterrupt.
    """
    fields, box_formats, unscaled = tuple(fields), parse_boxes(boxes), tuple(unscaled)
    _check_extension(os.fspath(dst), format)
    python = as_python_source(src, inputs, classes)  # None: src is a path (or paths)
    if python is not None and storage.is_remote(os.fspath(dst)):
        raise ValueError("a Python dataset is packed into a local archive, so far: upload it after "
                         "(packed_formats.storage.upload)")
    if python is None and (_any_remote(src) or storage.is_remote(os.fspath(dst))):
        if fields or box_formats or unscaled:
            raise ValueError("fields are packed from local sources into local archives, so far")
        options = dict(format=format, mode=mode, size=size, resize_mode=resize_mode, quality=quality,
                       encoding=encoding, labels=labels, workers=workers, shard_size=shard_size, overwrite=overwrite,
                       on_error=on_error, quiet=quiet, subdir=subdir, source_format=source_format,
                       label_key=label_key, image_key=image_key, allow_pickle=allow_pickle, raw_layout=raw_layout)
        if part is not None:
            raise ValueError("part= writes parts on a shared file system: convert the set's parts there, join "
                             "them, then upload the set (packed_formats.storage.upload)")
        return _convert_remote(src, os.fspath(dst), options)
    started = time.perf_counter()
    dst = os.fspath(dst)
    format = _check_options(dst, format, mode, resize_mode, quality, encoding, on_error, shard_size)
    _check_raw_layout(mode, raw_layout)
    workers = available_cores() if workers is None else int(workers)
    if workers < (0 if python is not None else 1):  # a Python source's 0: its items made in this process
        raise ValueError(f"workers must be at least 1, got {workers}")
    shown = python.path if python is not None else _shown(src)
    if part is not None:
        _check_part_options(dst, shard_size, overwrite)
    for path in _source_paths(src) if python is None else [None]:  # a Python source: the destination alone
        _check_destination(path, dst, overwrite or part is not None)
    if part is None:  # a task of a set cleans only its own parts' (another node's writers may be alive)
        clean_stale_temp_files(dst)
    replaced_parts = existing_set_files(dst) if overwrite else []  # its parts and sample index
    source = open_python(python, fields, on_error, mode, size, part) if python is not None else open_source(
        src, labels, subdir=subdir, source_format=source_format, label_key=label_key, image_key=image_key,
        allow_pickle=allow_pickle, on_error=on_error, fields=fields,
    )
    try:
        _check_fields_fit(shown, source.fields, size, box_formats, unscaled)
        recipe = dataclasses.replace(_recipe(source, mode, size, resize_mode, encoding, quality), boxes=box_formats,
                                     raw_layout=raw_layout)
        if part is not None:
            with _signals_interrupt():
                return _convert_part(source, shown, dst, format, recipe, part, int(shard_size or 0), workers,
                                     on_error, quiet, started)
        check_free_space(
            os.path.dirname(os.path.abspath(dst)), estimated_archive_bytes(source, recipe, format, shard_size),
            f"write {dst}", hint="free space there or choose another destination",
        )
        with _signals_interrupt():
            written, failed, parts = _run(source, dst, format, recipe, workers, shard_size, overwrite, on_error, quiet)
    except PackedFormatError:
        raise
    except OSError as exc:
        raise _write_error(dst, exc) from None
    finally:
        source.close()
    kept = set(parts) | ({os.path.join(os.path.dirname(os.path.abspath(dst)), samples_name(os.path.basename(dst)))}
                         if parts else set())  # a new set's parts and its sample index
    for stale in set(replaced_parts) - kept:
        remove_path(stale)  # files of a sharded archive this conversion replaced
    return ConvertSummary(
        source=shown,
        destination=dst,
        format=format,
        mode=recipe.mode,
        samples=written,
        classes=len(source.classes),
        skipped=source.skipped,
        skipped_names=source.skipped_names,
        failed=failed,
        bytes=disk_usage(dst),
        seconds=time.perf_counter() - started,
        layout=_layout_label(recipe),
        parts=parts,
    )


def _check_part_options(dst: str, shard_size: Optional[int], overwrite: bool) -> None:
    if not shard_size:
        raise ValueError("--part needs --shard-size: the size of the parts decides how the source is split")
    if overwrite:
        raise ValueError("--part cannot --overwrite (other tasks write the same set): remove the set's parts "
                         "and index first")
    from .parts import read_plan

    if os.path.lexists(dst) and read_plan(dst) is None:
        raise ArchiveExistsError(dst, "already exists and is not a set written with --part",
                                 hint="choose another destination, or remove it first")


def _convert_part(source: Source, shown: str, dst: str, format: str, recipe: Recipe, part, shard_size: int,
                  workers: int, on_error: str, quiet: bool, started: float) -> ConvertSummary:
    """Write one task's parts of a sharded set (see ``packed_formats.parts``), then join the set if it is
    complete."""
    from . import parts

    task, tasks = part
    tasks = parts.resolve_tasks(task, tasks, parts.read_plan(dst))
    plan = parts.ensure_plan(dst, parts.make_plan(source, format, recipe, on_error, shard_size, tasks))
    slots = parts.task_slots(task, tasks, plan["slots"])
    check_free_space(
        os.path.dirname(os.path.abspath(dst)),
        estimated_archive_bytes(source, recipe, format, shard_size) * len(slots) // plan["slots"],
        f"write {dst}", hint="free space there or choose another destination",
    )

    def write(view: Source, path: str) -> Tuple[int, List[str]]:
        written, failed, _ = _run(view, path, format, recipe, workers, None, True, on_error, quiet)
        return written, failed

    try:
        written, failed, done, kept = parts.write_slots(source, dst, plan, task, tasks, write)
    except OSError as exc:
        raise _write_error(dst, exc) from None
    joined = parts.join(dst, require_all=False)
    which = f"part(s) {slots.start}-{slots.stop - 1}" if len(slots) else "no parts"
    note = f"task {task} of {tasks}: {which} of {plan['slots']}"
    if kept:
        note += f", {len(kept)} already sealed and left as they were"
    note += "; every part sealed: the set is joined" if joined else "; the set is joined once every part is sealed"
    return ConvertSummary(
        source=shown, destination=dst, format=format, mode=recipe.mode, samples=written,
        classes=len(source.classes), skipped=source.skipped, skipped_names=source.skipped_names, failed=failed,
        bytes=sum(disk_usage(p) for p in done), seconds=time.perf_counter() - started,
        layout=_layout_label(recipe),
        parts=done, note=note,
    )


def _run(source, dst, format, recipe, workers, shard_size, overwrite, on_error, quiet) -> Tuple[int, List[str], list]:
    """Prepare every sample in parallel and append them in order; publish; (written, failed, parts).

    A random-access source is read by the workers themselves (sample i by
    index); any other is read here, in one ordered pass, and its samples'
    bytes are handed to the workers.
    """
    for failure in source.failed:  # samples the source left out while listing (on_error="skip")
        tqdm.write(f"skipped: {failure}", file=sys.stderr)
    python = worker_task(source, workers)  # a Python source's items: each sample's label comes with it
    if python is not None:
        mapped = ordered_map(python[0], (source, recipe), len(source), workers, start_method=python[1])
    elif source.random_access:
        mapped = ordered_map(_prepare_sample, (source, recipe), len(source), workers, runs=source.runs())
    else:
        mapped = ordered_map(_prepare_item, (recipe, source.fields), len(source), workers, items=_payloads(source))
    with mapped as results:
        output = _open_output(dst, format, recipe, source, shard_size, overwrite, on_error)
        total = getattr(source, "known_length", len(source))  # None: an iterable's, counted up
        with output, tqdm(total=total, unit="img", desc="converting", disable=quiet, smoothing=0.05) as bar:
            failed = source.failed + _append_all(results, source, output, on_error, bar)
            if len(output) == 0:
                raise InvalidSourceError(source.path, "no image could be converted", hint="see the errors above")
            written = len(output)
    return written, failed, getattr(output, "paths", [])[:-1]


def _append_all(results: Iterator[Any], source: Source, output: Any, on_error: str, bar: Any) -> List[str]:
    failed: List[str] = []
    alpha, first_alpha = 0, ""  # a count and one key: never a list as long as the dataset
    try:
        for i, (ok, value, dropped_alpha, *label) in enumerate(results):  # a Python source's label follows
            bar.update(1)
            if ok is None:  # a Python function left this input out
                continue
            if dropped_alpha:
                first_alpha = first_alpha if alpha else source.key(i)
                alpha += 1
            if ok:
                number = int(label[0] if label else source.labels[i])
                if source.fields:  # (stored image, {field: value})
                    output.add(value[0], number, source.key(i), fields=value[1])
                else:
                    output.add(value, number, source.key(i))
            elif on_error == "raise":
                raise value
            else:  # skipped as asked: the error's advice (fix it, or skip it) is moot
                failed.append(value.without_hint() if isinstance(value, PackedFormatError) else str(value))
                tqdm.write(f"skipped: {failed[-1]}", file=sys.stderr)
    except WorkerDiedError as exc:
        raise ConversionFailedError(source.path, str(exc), hint="retry with fewer --workers") from None
    if alpha:
        warnings.warn(
            SourceWarning(
                f"{source.path}: {alpha} image(s) have a transparency (alpha) channel, dropped: the archive "
                f"holds RGB (first: {first_alpha!r}); --mode encoded without --size keeps each file as it is"
            ),
            stacklevel=3,
        )
    return failed


def parse_boxes(boxes: "Mapping[str, str] | Sequence[str]") -> Tuple[Tuple[str, str], ...]:
    """((field, box format), ...) of ``{"boxes": "XYXY"}`` or ``["boxes=XYXY"]``; ValueError naming a bad one."""
    pairs = list(boxes.items()) if isinstance(boxes, Mapping) else [str(b).partition("=")[::2] for b in boxes]
    parsed = []
    for name, fmt in pairs:
        if not name or str(fmt).upper() not in BOX_FORMATS:
            raise ValueError(f"boxes are given as NAME=FORMAT, FORMAT one of {', '.join(BOX_FORMATS)} (as "
                             f"boxes=XYXY); got {name}={fmt}" if name else f"boxes: no field name in {fmt!r}")
        parsed.append((str(name), str(fmt).upper()))
    return tuple(parsed)


def _check_fields_fit(shown: str, fields: Sequence[FieldSpec], size: Any, boxes: Tuple[Tuple[str, str], ...],
                      unscaled: Tuple[str, ...]) -> None:
    """ValueError when the source's fields cannot go where the options send them: boxes that name no array
    field of [N,4] or [4], unscaled fields that name no array field or are boxes too, or an array field a
    resize cannot take along (image fields, masks, are resized with the image; the fields of ``boxes`` are
    moved with it, those of ``unscaled`` kept as they are)."""
    by_name, box_names = {f.name: f for f in fields}, dict(boxes)
    described = ", ".join(f.describe() for f in fields) or "none"
    for name in unscaled:
        spec = by_name.get(name)
        if spec is None or spec.kind != "array" or name in box_names:
            found = "boxes too" if name in box_names else spec.describe() if spec is not None else "no such field"
            raise ValueError(f"{shown}: unscaled {name!r} must be an array field that is not boxes ({found}; the "
                             f"fields: {described})")
    for name, _ in boxes:
        spec = by_name.get(name)
        if spec is None or spec.kind != "array" or not spec.shape or spec.shape[-1] != 4 or len(spec.shape) > 2:
            found = spec.describe() if spec is not None else "no such field"
            raise ValueError(f"{shown}: boxes {name!r} must be an array field of [N,4] or [4] ({found}; the "
                             f"fields: {described})")
    kept = set(box_names) | set(unscaled)
    arrays = [f.describe() for f in fields if f.kind == "array" and f.name not in kept]
    if size is not None and arrays:
        raise ValueError(f"{shown} has the array field {arrays[0]}, which a resize of the images may have to change: "
                         "say what it holds, --boxes NAME=XYXY (XYWH, CXCYWH) to move boxes with the images or "
                         "--unscaled NAME to keep values that do not depend on where things are (per-box labels), "
                         "or convert without size (image fields, masks, are resized with the images)")


def _prepare_sample(context: Tuple[Source, Recipe], i: int) -> Tuple[bool, Any, bool]:
    """(True, stored sample, alpha dropped) or (False, CorruptSampleError naming the file, False); runs in a
    worker."""
    source, recipe = context
    loaded: List[Any] = []  # the image as the source stores it, kept for boxes that follow a resize

    def load() -> Any:
        loaded.append(source.load(i))
        return loaded[-1]

    prepared = _prepare(recipe, load, i, lambda: source.key(i), lambda: source.location(i))
    return _with_fields(recipe, source.fields, prepared, lambda: source.load_fields(i), i, source.key(i),
                        source.location(i), lambda: loaded[-1])


def _with_fields(recipe: Recipe, fields: Sequence[FieldSpec], prepared: Tuple[bool, Any, bool],
                 load: Callable[[], Dict[str, Any]], i: int, key: str, location: str, stored: Callable[[], Any]
                 ) -> Tuple[bool, Any, bool]:
    """A prepared sample with its fields as the destination stores them: (True, (stored image, {field:
    value}), alpha dropped), or (False, the error naming the sample) when a field cannot be had.  ``stored()``:
    the sample's image as the source stores it (read only when boxes follow a resize)."""
    if not fields or not prepared[0]:
        return prepared
    try:
        values = load()
        for spec in fields:
            values[spec.name] = recipe.field(spec, values[spec.name], stored)
        return True, (prepared[1], values), prepared[2]
    except PackedFormatError as exc:
        return False, exc, False
    except codecs.DecodeError as exc:
        return False, CorruptSampleError(location, f"a field does not decode: {exc}", index=i, key=key), False


def _payloads(source: Source) -> Iterator[Tuple[int, str, str, Any, Any]]:
    """(index, key, location, stored data or its error, its fields' values) of each sample, read in order in
    this process."""
    for i, sample in enumerate(source):
        yield i, sample.key, source.location(i), sample.data, sample.fields


def _prepare_item(context: Tuple[Recipe, Tuple[FieldSpec, ...]], payload: Tuple[int, str, str, Any, Any]
                  ) -> Tuple[bool, Any, bool]:
    """_prepare_sample for a sample this process read (a payload of ``_payloads``); runs in a worker."""
    recipe, fields = context
    i, key, location, data, values = payload
    if isinstance(data, PackedFormatError):
        return False, data, False
    prepared = _prepare(recipe, lambda: data, i, lambda: key, lambda: location)
    return _with_fields(recipe, fields, prepared, lambda: dict(values), i, key, location, lambda: data)


def _prepare(
    recipe: Recipe, load: Callable[[], Any], i: int, key: Callable[[], str], location: Callable[[], str]
) -> Tuple[bool, Any, bool]:
    try:
        stored = load()
        return True, recipe.apply(stored), recipe.drops_alpha(stored)
    except codecs.DecodeError as exc:
        problem = str(exc)
    except PackedFormatError as exc:
        return False, exc, False
    except Exception as exc:  # a decoder or resize failure we did not foresee: still name the file
        problem = f"cannot prepare the image: {exc!r}"
    error = CorruptSampleError(location(), problem, index=i, key=key(), hint="fix or remove it, or use --on-error skip")
    return False, error, False


def _open_output(dst: str, format: str, recipe: Recipe, source: Source, shard_size, overwrite: bool,
                 on_error: str) -> Any:
    options: Dict[str, Any] = dict(
        mode=recipe.mode,
        shape=None if recipe.mode != "raw" else _raw_size(recipe) + (3,),
        classes=source.classes,
        encoding=recipe.encoding,
        quality=recipe.quality,
    )
    if source.fields:
        options["fields"] = source.fields
    if not source.labelled:
        options["labelled"] = False
    if recipe.raw_layout != "hwc":
        options["raw_layout"] = recipe.raw_layout
    if shard_size:  # the set's id is its plan's, as the tasks of a --part conversion derive it: the same parts
        from . import parts

        plan = parts.make_plan(source, format, recipe, on_error, int(shard_size), 1)
        return ShardedWriter(dst, format, int(shard_size), overwrite=overwrite, set_id=parts.set_id(plan), **options)
    return open_writer(dst, format=format, overwrite=overwrite, **options)


def _raw_size(recipe: Recipe) -> Tuple[int, int]:
    """(height, width) of a raw conversion's samples (_recipe never makes a raw recipe without it)."""
    if recipe.size is None:
        raise ValueError("raw mode needs --size (e.g. --size 256 or --size 256x192)")
    return recipe.size


def _recipe(source: Source, mode: str, size, resize_mode: str, encoding: str, quality: int) -> Recipe:
    hw = None if size is None else parse_size(size)
    if mode == "raw" and hw is None:
        if source.raw_shape is None:
            raise ValueError("raw mode needs --size (e.g. --size 256 or --size 256x192)")
        hw = source.raw_shape[:2]
    return Recipe(mode=mode, size=hw, resize_mode=resize_mode, encoding=encoding, quality=quality)


def _layout_label(recipe: Recipe) -> str:
    """What a sample is, for the summary: "raw 256x256x3" (", stored planar"), or "encoded ..."."""
    if recipe.mode != "raw":
        return f"encoded {_encoding_label(recipe)}"
    h, w = recipe.size or (0, 0)
    return f"raw {h}x{w}x3" + (", stored planar" if recipe.raw_layout == "chw" else "")


def _encoding_label(recipe: Recipe) -> str:
    if recipe.size is None:
        return "as in the source"
    h, w = recipe.size
    return f"{recipe.encoding} {h}x{w}"


def _check_extension(dst: str, format: Optional[str]) -> None:
    """ValueError when ``dst``'s extension is that of another format than ``format`` (``x.zip`` for hdf5): an
    archive named as another format misleads every tool and person who meets it later."""
    extension = os.path.splitext(dst.rstrip("/"))[1].lower()
    named = EXTENSIONS.get(extension)
    if format is None or named is None or named == format:
        return
    theirs = [e for e, f in EXTENSIONS.items() if f == format]
    stem = os.path.splitext(os.path.basename(dst.rstrip("/")))[0]
    suggested = f"name it {stem}{theirs[0]}" if theirs else "give it another extension"
    raise ValueError(f"{dst}: {extension} names a {named} archive, but the format asked is {format} (--format "
                     f"{format}): {suggested} to write {format}, or leave out --format to write {named}")


def _check_options(dst, format, mode, resize_mode, quality, encoding, on_error, shard_size) -> str:
    if format is None:
        format = EXTENSIONS.get(os.path.splitext(dst)[1].lower())
        if format is None:
            raise ValueError(f"give --format ({', '.join(PACKED_FORMATS)}): cannot tell it from {dst!r}")
    checks = [
        ("format", format, PACKED_FORMATS),
        ("mode", mode, MODES),
        ("resize mode", resize_mode, RESIZE_MODES),
        ("encoding", encoding, codecs.ENCODINGS),
        ("on_error", on_error, ON_ERROR),
    ]
    for name, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"quality must be between 1 and 100, got {quality}")
    if shard_size is not None and int(shard_size) < 1:
        raise ValueError(f"shard size must be at least 1, got {shard_size}")
    return format


def _check_raw_layout(mode: str, raw_layout: str) -> None:
    """ValueError unless ``raw_layout`` is a layout, and planar only for a raw conversion."""
    if raw_layout not in RAW_LAYOUTS:
        raise ValueError(f"raw layout must be one of {', '.join(RAW_LAYOUTS)}, got {raw_layout!r}")
    if raw_layout != "hwc" and mode != "raw":
        raise ValueError(f"raw layout {raw_layout!r} is for raw archives (--mode raw): an encoded archive stores "
                         "image files")


def _check_destination(src: Optional[str], dst: str, overwrite: bool) -> None:
    """Refuse to write over the source (or a folder holding it), inside it, or over anything without overwrite
    (``src`` None: a source with no path, a Python dataset)."""
    real_src, real_dst = None if src is None else os.path.realpath(src), os.path.realpath(dst)
    if real_src is not None and (real_src == real_dst or real_src.startswith(real_dst.rstrip(os.sep) + os.sep)):
        raise DestinationError(dst, "the destination is the source (or contains it)", hint="choose another path")
    if real_src is not None and real_dst.startswith(real_src.rstrip(os.sep) + os.sep):
        raise DestinationError(
            dst, f"the destination is inside the source {src}: it would be read as part of it",
            hint="write it outside the source folder",
        )
    if os.path.lexists(dst) and not overwrite:
        raise ArchiveExistsError(dst, "already exists", hint="pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise DestinationError(dst, f"the destination directory {parent} does not exist")


def estimated_output_bytes(source: Source, recipe: Recipe) -> int:
    """A low estimate of the bytes the converted samples take (headers and index not counted).

    raw: exactly count x H x W x 3.  encoded as stored: the source's bytes
    (from the sizes of up to _SIZED_FILES evenly spread files of a large
    folder).  Re-encoded: 1/_REENCODED_RATIO of the pixels' bytes.
    """
    if recipe.mode == "raw":
        h, w = _raw_size(recipe)
        return len(source) * h * w * 3
    raw_shape = source.raw_shape
    if recipe.size is not None:
        h, w = recipe.size
    elif raw_shape is not None:
        h, w = raw_shape[:2]
    else:
        return _source_bytes(source)
    return len(source) * h * w * 3 // _REENCODED_RATIO


def estimated_archive_bytes(source: Source, recipe: Recipe, fmt: str, shard_size: Optional[int] = None) -> int:
    """The disk space a conversion of ``source`` into format ``fmt`` checks for: the samples' bytes
    (``estimated_output_bytes``) with what the format adds to them (``space.archive_bytes``)."""
    n = len(source)
    picks = _spread(n, _SIZED_FILES)
    key_bytes = max((len(source.key(i).encode("utf-8", "surrogateescape")) for i in picks), default=0)
    sample_bytes = None
    if recipe.mode == "raw":
        h, w = _raw_size(recipe)
        sample_bytes = h * w * 3
    return archive_bytes(
        fmt, recipe.mode, n, estimated_output_bytes(source, recipe), sample_bytes=sample_bytes,
        key_bytes=2 * key_bytes + 8,  # keys are stored at the longest one's width: the picks may miss it
        class_bytes=sum(len(c.encode()) + 8 for c in source.classes),
        parts=1 if not shard_size else -(-n // int(shard_size)),
        fields=len(source.fields), field_payload=_field_bytes(source),
    )


def _field_bytes(source: Source) -> int:
    """A low estimate of the bytes the samples' fields take as stored: their values in up to _SIZED_FIELDS
    evenly spread samples of a random-access source, as the source holds them (0 when its samples are read
    in one ordered pass, or none of those can be read: the conversion reports those)."""
    n = len(source)
    if not source.fields or not source.random_access or n == 0:
        return 0
    picks = _spread(n, _SIZED_FIELDS)
    total = 0
    for i in picks:
        try:
            values = source.load_fields(i)
            total += sum(len(spec.encode(values[spec.name])) for spec in source.fields)
        except (PackedFormatError, FieldValueError, KeyError):
            continue
    return total * n // len(picks)


def _spread(n: int, most: int) -> List[int]:
    """Up to ``most`` of the indices 0..n-1, evenly spread (all of them when there are no more)."""
    return list(range(n)) if n <= most else np.linspace(0, n - 1, most).astype(np.int64).tolist()


def _source_bytes(source: Source) -> int:
    n = len(source)
    if n == 0 or source.stored_size(0) is None:  # sizes unknown without reading: the files' size on disk
        return sum(disk_usage(path) for path in _source_paths(source.path))
    picks = _spread(n, _SIZED_FILES)
    total = 0
    for i in picks:
        size = source.stored_size(i) or 0  # an unreadable file is reported by the conversion itself
        total += size if source.key(i).lower().endswith(_AS_STORED) else size // _REENCODED_RATIO
    return total * n // len(picks)


def _any_remote(src: SourcePath) -> bool:
    return any(storage.is_remote(p) for p in _source_paths(src))


def _convert_remote(src: SourcePath, dst: str, options: Dict[str, Any]) -> ConvertSummary:
    """convert() where the source or the destination is in a store: the source's objects (a tar,
    webdataset shards, a ZIP; brace patterns expanded) are downloaded into a scratch folder first;
    the destination is written there, then uploaded (parts, the set's sample index, its index
    last: the set appears at ``dst`` whole or not at all).  The scratch folder is removed at the end."""
    import shutil
    import tempfile

    from ..sources.webdataset import expand_shards

    scratch = tempfile.mkdtemp(prefix="packed_formats-convert-")
    try:
        local_src: SourcePath = src
        if _any_remote(src):
            urls = expand_shards(_source_paths(src)) if len(_source_paths(src)) > 1 or "{" in _shown(src) \
                else _source_paths(src)
            store, local = storage.Store(), []
            for k, url in enumerate(urls):
                target = os.path.join(scratch, "source", f"{k:05d}-{storage.urls.basename(url)}")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                store.download(url, target, store.info(url))
                local.append(target)
            local_src = local[0] if len(local) == 1 else local
        local_dst = dst
        if storage.is_remote(dst):
            if not options["overwrite"] and _remote_exists(dst):
                raise ArchiveExistsError(storage.clean_url(dst), "already exists in the store",
                                         hint="pass overwrite=True (--overwrite) to replace it")
            local_dst = os.path.join(scratch, "out", storage.urls.basename(dst))
            os.makedirs(os.path.dirname(local_dst))
        summary = convert(local_src, local_dst, **options)
        if local_dst != dst:
            storage.upload(local_dst, dst)
        if storage.is_remote(dst):
            return dataclasses.replace(summary, source=_shown(src), destination=storage.clean_url(dst),
                                       parts=[storage.urls.join(dst, os.path.basename(p)) for p in summary.parts])
        return dataclasses.replace(summary, source=_shown(src))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _remote_exists(url: str) -> bool:
    try:
        storage.Store().info(url)
    except RemoteNotFoundError:
        return storage.Store().is_directory(url)
    return True


def _source_paths(src: SourcePath) -> List[str]:
    """The file or folder paths of a source (each shard of a list)."""
    if isinstance(src, (str, os.PathLike)):
        return [os.fspath(src)]
    return [os.fspath(p) for p in src]


def _shown(src: SourcePath) -> str:
    paths = _source_paths(src)
    return paths[0] if len(paths) == 1 else ", ".join(paths)


def _write_error(dst: str, exc: OSError) -> DestinationError:
    """An OSError met while converting (permission denied, disk full...) as an error naming ``dst``."""
    name = None if exc.filename is None else os.fsdecode(exc.filename)
    where = f" ({name})" if name and name != dst and not _TEMP_NAME.match(os.path.basename(name)) else ""
    hints = {
        errno.ENOSPC: f"free space in {os.path.dirname(os.path.abspath(dst))} or choose another destination",
        errno.EDQUOT: "your disk quota is used up: free space or choose another destination",
        errno.EACCES: "choose a destination directory you can write to",
        errno.EPERM: "choose a destination directory you can write to",
        errno.EROFS: "the file system is read-only: choose another destination",
    }
    hint = None if exc.errno is None else hints.get(exc.errno)
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    error = InsufficientSpaceError if full else DestinationError
    return error(dst, f"cannot write the archive: {exc.strerror or exc}{where}", hint=hint)


def clean_stale_temp_files(dst: "str | os.PathLike[str]") -> List[str]:
    """Remove temporary files left beside ``dst`` by conversions whose process is gone; return them.

    Only names of this destination (and its parts) whose writer pid no longer
    runs on this machine are removed.
    """
    dst = os.path.abspath(os.fspath(dst))
    directory, name = os.path.split(dst)
    stem, ext = os.path.splitext(name)
    part = re.compile(re.escape(stem) + r"-\d{5}" + re.escape(ext))
    removed = []
    with os.scandir(directory) as listing:
        entries = list(listing)
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match and (match["name"] == name or part.fullmatch(match["name"])) and not pid_alive(int(match["pid"])):
            remove_path(entry.path)
            removed.append(entry.path)
    return removed


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into ConversionInterrupted (once: cleanup then runs undisturbed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", "SIGTERM", "SIGHUP")
    signals = [getattr(signal, n) for n in names if hasattr(signal, n)]
    owner = os.getpid()

    def interrupt(signum, _frame):
        if os.getpid() != owner:  # a worker forked from here, hit before its own handlers are set (a Ctrl-C
            if signum != signal.SIGINT:  # reaches the whole process group): SIGINT it ignores, as its
                signal.signal(signum, signal.SIG_DFL)  # initializer says; the others end it as they would
                os.kill(os.getpid(), signum)
            return
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise ConversionInterrupted(signum)

    previous = {s: signal.signal(s, interrupt) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = [
    "ConversionInterrupted", "ConvertSummary", "clean_stale_temp_files", "convert",
    "estimated_output_bytes", "part_name",
]
