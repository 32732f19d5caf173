"""A seeded fuzz of hostile inputs, drawn afresh each run: what a careless or crafted source, a mismatched
set or a killed job does, where a wrong sample would be served without a word or a job would hang.

Each kind of case draws its trials from the run's seed:

* short images at conversion: a PNG whose image data holds fewer rows than its header says, or a JPEG
  cut inside its scan with its end marker put back, as a sample's image or its mask;
* hostile Hub datasets: a label of a huge value, a bad array cell, a card of YAML aliases or deep
  nesting, JSON nested deep, a bad class name, an image path that is a FIFO;
* two conversions of sources that list the same names with other pixels, a part of one put into the
  other's set;
* a stretch of damaged samples a batch or more long, read with ``on_error="skip"`` through workers;
* a main process killed while its workers fill batch slots: no slot file and no worker outlives it.

Allowed: the intact data, or a ``PackedFormatError`` that names what was wrong (a skipped sample is
listed where ``on_error="skip"`` asks for it).  Forbidden: other data, another exception, a hang.  Each
trial runs in a forked child under a time limit.  ``PF_FUZZ_SEED`` replays a run (the seed is printed
with every failure), ``PF_FUZZ_HOSTILE_TRIALS`` sets the trials per kind.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import shutil
import traceback
from typing import Callable, List, Optional, Tuple

import numpy as np
import pytest
from PIL import Image

import packed_formats as pf
from packed_formats.synthetic import draw_image
from packed_formats.writing.convert import convert

from .test_short_images import short_png


def setting(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


SEED = setting("PF_FUZZ_SEED", random.SystemRandom().randrange(2**32))
TRIALS = setting("PF_FUZZ_HOSTILE_TRIALS", 6)
TIMEOUT = setting("PF_FUZZ_TIMEOUT", 60)  # seconds a trial may take in its child before it is a hang

pytestmark = pytest.mark.slow


def rng_of(kind: str, number: int) -> random.Random:
    """The generator of one trial: the same seed, kind and number always draw the same case."""
    return random.Random(f"packed-formats-hostile/{SEED}/{kind}/{number}")


# ---- a trial in a child ----------------------------------------------------------------------------------
def _child(connection, trial: Callable[[], str]) -> None:
    try:
        verdict = trial()
    except pf.PackedFormatError as error:
        verdict = f"refused: {error}"
    except BaseException as error:  # noqa: BLE001 (the verdict names it: anything else is a finding)
        verdict = f"raw {type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
    connection.send(verdict)
    connection.close()


def isolated(trial: Callable[[], str], timeout: float = TIMEOUT) -> str:
    """``trial()``'s verdict from a forked child: "refused: <message>" for a PackedFormatError, "raw ..." for
    anything else, "hang" when it says nothing within ``timeout`` seconds, "died ..." when it ends unheard."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, trial))  # not a daemon: a loader starts workers
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            return f"hang: nothing said in {timeout} s"
        return receive.recv()
    except EOFError:
        child.join(10)
        return f"died with exit code {child.exitcode}"
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
        receive.close()


def report(findings: List[str]) -> None:
    assert not findings, f"seed {SEED} (PF_FUZZ_SEED={SEED} replays it):\n" + "\n".join(findings)


# ---- short images at conversion ----------------------------------------------------------------------------
def photo(rng: random.Random, size: Tuple[int, int]) -> Image.Image:
    return draw_image(rng.choice(["boxes", "circles", "stripes"]), size, np.random.default_rng(rng.randrange(2**32)))


def cut_jpeg(rng: random.Random, data: bytes) -> bytes:
    """``data`` cut somewhere inside its scan, its end-of-image marker put back."""
    scan = data.index(b"\xff\xda") + 16
    return data[: rng.randrange(scan, max(scan + 1, int(len(data) * 0.9)))] + b"\xff\xd9"


def png_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def short_image_case(rng: random.Random, root: str) -> dict:
    """Two classes of good samples and one damaged file, written twice: ``src`` (damaged) and ``intact``."""
    height, width = rng.randrange(24, 80), rng.randrange(24, 80)
    role = rng.choice(["image", "mask"])
    kind = "png" if role == "mask" else rng.choice(["png", "jpeg"])
    case = {"role": role, "kind": kind, "src": os.path.join(root, "src"), "intact": os.path.join(root, "intact"),
            "options": rng.choice([{"mode": "encoded"}, {"mode": "raw", "size": 16},
                                   {"mode": "encoded", "size": 16}]),
            "on_error": rng.choice(["raise", "skip"])}
    for tree in (case["src"], case["intact"]):
        for name in ("a", "b"):
            os.makedirs(os.path.join(tree, name))
    for name in ("a", "b"):
        for i in range(2):
            image = photo(rng, (width, height))
            mask = np.array([[(x // 4 + y // 4 + i) % 3 for x in range(width)] for y in range(height)], np.uint8)
            for tree in (case["src"], case["intact"]):
                image.save(os.path.join(tree, name, f"{name}{i}.png"))
                if role == "mask":
                    with open(os.path.join(tree, name, f"{name}{i}.seg.png"), "wb") as f:
                        f.write(png_bytes(mask))
    if kind == "jpeg":
        buffer = io.BytesIO()
        photo(rng, (width, height)).save(buffer, "JPEG", quality=rng.randrange(60, 96))
        intact = buffer.getvalue()
        damaged, file = cut_jpeg(rng, intact), "bad.jpg"
    else:
        rows = rng.randrange(0, height)
        channels = 1 if role == "mask" else rng.choice([1, 3])
        intact, damaged = short_png(height, width, height, channels), short_png(height, width, rows, channels)
        file = "bad.png"
    if role == "mask":
        for tree, mask in ((case["src"], damaged), (case["intact"], intact)):
            photo(rng, (width, height)).save(os.path.join(tree, "a", "bad.png"))
            with open(os.path.join(tree, "a", "bad.seg.png"), "wb") as f:
                f.write(mask)
    else:
        for tree, data in ((case["src"], damaged), (case["intact"], intact)):
            with open(os.path.join(tree, "a", file), "wb") as f:
                f.write(data)
    case["file"] = file
    return case


def contents_of(path: str) -> dict:
    """{key: (sample bytes or pixels, label, mask or None)} of the archive at ``path``."""
    out = {}
    with pf.open_archive(path) as reader:
        for i in range(len(reader)):
            mask = reader.read_field(i, "seg") if reader.fields else None
            out[reader.key(i)] = (np.asarray(reader.read(i)), int(reader.labels[i]),
                                  None if mask is None else np.asarray(mask))
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        for x, y in zip(a[key], b[key]):
            if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
                return False
    return True


def short_image_trial(case: dict, out: str) -> Callable[[], str]:
    fields = {"fields": ["seg=image"]} if case["role"] == "mask" else {}

    def trial() -> str:
        options = dict(case["options"], workers=1, quiet=True, on_error=case["on_error"], **fields)
        summary = convert(case["src"], os.path.join(out, "got.zip"), **options)
        convert(case["intact"], os.path.join(out, "intact.zip"), **dict(options, on_error="raise"))
        got, intact = contents_of(os.path.join(out, "got.zip")), contents_of(os.path.join(out, "intact.zip"))
        if same(got, intact):
            return "intact"
        bad = [key for key in intact if key.endswith("bad.png") or key.endswith(case["file"])]
        if summary.failed and got.keys() == intact.keys() - set(bad) \
                and all(same({k: got[k]}, {k: intact[k]}) for k in got):
            return "skipped: " + "; ".join(summary.failed)
        return f"served other data ({len(got)} samples, failed {summary.failed})"
    return trial


def short_image_verdict_allowed(case: dict, verdict: str) -> bool:
    name = "bad.png" if case["role"] == "mask" else case["file"]
    if verdict == "intact":
        return True
    if verdict.startswith("refused: "):
        return case["on_error"] == "raise" and name in verdict and (case["role"] != "mask" or "'seg'" in verdict)
    if verdict.startswith("skipped: "):
        return case["on_error"] == "skip" and name in verdict
    return False


def test_short_images_are_refused_or_skipped_naming_them_never_filled(tmp_path):
    findings = []
    for number in range(TRIALS):
        root = str(tmp_path / f"short{number}")
        case = short_image_case(rng_of("short", number), root)
        verdict = isolated(short_image_trial(case, root))
        if not short_image_verdict_allowed(case, verdict):
            findings.append(f"short image trial {number} ({case['kind']} as {case['role']}, {case['options']}, "
                            f"on_error={case['on_error']}): {verdict}")
        shutil.rmtree(root, ignore_errors=True)
    report(findings)


# ---- hostile Hub datasets ------------------------------------------------------------------------------------
HUB_CASES = ("huge-label", "array-cell", "alias-bomb", "deep-yaml", "deep-json", "class-name", "fifo")


def alias_bomb(rng: random.Random) -> str:
    width, depth = rng.randrange(2, 3000), rng.randrange(2, 5)
    lines = ["          - &a0 [" + ", ".join(["x"] * width) + "]\n"]
    for level in range(1, depth):
        lines.append(f"          - &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]\n")
    return "".join(lines)


def array_cell(rng: random.Random, pa, row: int):
    """(column, declaration, what the error must say) of one bad cell at ``row``."""
    good_float, good_int = [1.0, 2.0, 3.0, 4.0], [1, 2, 3, 4]
    cases = [
        ([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0]], pa.float64(), good_float, "float32[N,4]", "ragged"),
        ([[1.0, None, 3.0, 4.0]], pa.float64(), good_float, "float32[N,4]", "null"),
        ([[rng.randrange(128, 2**40), 0, 0, 0]], pa.int64(), good_int, "int8[N,4]", "out of the range"),
        ([[-rng.randrange(1, 2**40), 0, 0, 0]], pa.int64(), good_int, "uint16[N,4]", "out of the range"),
        ([[10.0 ** rng.randrange(39, 308), 0.0, 0.0, 0.0]], pa.float64(), good_float, "float32[N,4]",
         "out of the range"),
        ([[rng.choice([float("nan"), float("inf"), -float("inf")]), 0.0, 0.0, 0.0]], pa.float64(), good_float,
         rng.choice(["float32[N,4]", "float64[N,4]"]), "not finite"),
        ([[rng.randrange(1, 100) + 0.5, 0.0, 0.0, 0.0]], pa.float64(), good_float, "int32[N,4]", "no whole number"),
    ]
    bad, kind, good, declared, problem = rng.choice(cases)
    column = pa.array([bad if r == row else [list(good)] for r in range(24)], pa.list_(pa.list_(kind)))
    return column, declared, problem


def hub_case(rng: random.Random, root: str, image_folder: str) -> Tuple[str, dict, Optional[str], str]:
    """(source path, convert options, what the error must name, the case's kind) of one hostile Hub dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .test_hub_sources import bad_rows, hub_with_card, image_table, plain_parquet, sample_rows, write_saved

    kind = rng.choice(HUB_CASES)
    tmp = _Path(root)
    os.makedirs(root, exist_ok=True)
    row = rng.randrange(24)
    if kind == "huge-label":
        label = 10 ** rng.randrange(6, 16)
        src = plain_parquet(tmp / "x.parquet", bad_rows(image_folder, row, label=label))
        return str(src), {}, f"x.parquet:row {row}", kind
    if kind == "array-cell":
        column, declared, problem = array_cell(rng, pa, row)
        table = image_table(sample_rows(image_folder), extra={"boxes": column}).replace_schema_metadata(None)
        src = tmp / "x.parquet"
        pq.write_table(table, src, row_group_size=rng.randrange(1, 24))
        return str(src), {"fields": [f"boxes=array:{declared}"], "on_error": rng.choice(["raise", "skip"])}, \
            f"x.parquet:row {row}, column 'boxes'", kind
    if kind == "alias-bomb":
        return str(hub_with_card(tmp, image_folder, alias_bomb(rng))), {}, "README.md", kind
    if kind == "deep-yaml":
        depth = rng.randrange(65, 20000)
        return str(hub_with_card(tmp, image_folder, "          - " + "[" * depth + "]" * depth + "\n")), {}, \
            "README.md", kind
    if kind == "deep-json":
        depth = rng.randrange(2000, 200_000)
        where = rng.choice(["state.json", "dataset_info.json"])
        folder = tmp / "saved"
        write_saved(folder, sample_rows(image_folder), files=1)
        (folder / where).write_text("[" * depth + "]" * depth)
        return str(folder), {}, where, kind
    if kind == "class-name":
        name = rng.choice(["''", "../x", "/abs", "x/../../y", "'..'", "a", "'\\t'"])
        names = "          - a\n          - " + name + "\n          - c\n"
        return str(hub_with_card(tmp, image_folder, names)), {}, "README.md", kind
    src = tmp / "fifo"
    from .test_hub_sources import write_hub

    write_hub(src, bad_rows(image_folder, row, image=(None, "pipe.jpg")))
    os.mkfifo(src / "pipe.jpg")
    return str(src), {"on_error": rng.choice(["raise", "skip"])}, "pipe.jpg", kind


def _Path(root: str):
    import pathlib

    return pathlib.Path(root)


def hub_trial(src: str, out: str, options: dict) -> Callable[[], str]:
    def trial() -> str:
        summary = convert(src, os.path.join(out, "out.zip"), workers=1, quiet=True, **options)
        return "skipped: " + "; ".join(summary.failed) if summary.failed else f"converted {summary.samples}"
    return trial


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_hostile_hub_datasets_are_refused_naming_the_file_never_hang(tmp_path, image_folder):
    pytest.importorskip("pyarrow")
    findings = []
    for number in range(TRIALS):
        root = str(tmp_path / f"hub{number}")
        src, options, named, kind = hub_case(rng_of("hub", number), root, image_folder)
        verdict = isolated(hub_trial(src, root, options))
        refused = verdict.startswith("refused: ") and named in verdict
        skipped = options.get("on_error") == "skip" and verdict.startswith("skipped: ") and named in verdict
        if not (refused or skipped):
            findings.append(f"hub trial {number} ({kind}, {options}): {verdict[:2000]}")
        shutil.rmtree(root, ignore_errors=True)
    report(findings)


# ---- a main process killed while its workers fill batch slots -------------------------------------------
def test_a_main_process_killed_at_a_drawn_moment_leaves_no_slot_file_and_no_worker(tmp_path):
    """SIGKILL of the main process after a drawn number of batches and a drawn delay, under a drawn start
    method, batch size and kind of batch: in a private tmpfs folder no slot file is left, and no worker
    outlives it."""
    from .test_loader_fields import SIZES, write_ramps
    from .test_slots import kill_mid_epoch

    ramps = os.fspath(tmp_path / "ramps.zip")
    write_ramps(ramps, sizes=SIZES * 4)
    raw = os.fspath(tmp_path / "raw.memmap")
    with pf.open_writer(raw, format="memmap", mode="raw", shape=(32, 32, 3), classes=["a", "b"]) as writer:
        generator = np.random.default_rng(SEED % 2**32)
        for i in range(64):
            writer.add(generator.integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 2, key=f"s{i}")
    findings = []
    for number in range(max(1, TRIALS // 2)):
        rng = rng_of("kill", number)
        case = {"method": rng.choice(["fork", "spawn", "forkserver"]), "fields": rng.random() < 0.3,
                "take": rng.randrange(1, 4), "batch_size": rng.choice([2, 4, 8])}
        delay = rng.uniform(0, 0.5)
        left, running, _ = kill_mid_epoch(ramps if case["fields"] else raw, case,
                                          os.fspath(tmp_path / f"stderr{number}.txt"), delay)
        if left or running:
            findings.append(f"kill trial {number} ({case}, killed {delay:.2f} s after ready): "
                            f"slot files left {left}, workers running {running}")
    report(findings)


# ---- a damaged stretch a batch or more long, skipped through workers ---------------------------------------
def skip_case(rng: random.Random) -> dict:
    n, batch_size = rng.randrange(12, 48), rng.randrange(1, 7)
    length = min(n - 1, rng.randrange(batch_size, 3 * batch_size + 1))
    start = rng.randrange(0, n - length + 1)
    return {"n": n, "bad": list(range(start, start + length)), "stop": rng.randrange(1, 6),
            "options": dict(batch_size=batch_size, num_workers=rng.choice([0, 1, 2]), seed=rng.randrange(1000),
                            shuffle=rng.random() < 0.7, drop_last=rng.random() < 0.3, on_error="skip",
                            multiprocessing_context="fork")}  # a trial runs in a forked child of the test
    # process, which may hold a forkserver already: its copy of that server is not the child's to use


def skip_trial(path: str, case: dict) -> Callable[[], str]:
    import json
    import warnings

    from .resume_worker import loader_for, record
    from .test_resume import epochs_of

    def trial() -> str:
        warnings.simplefilter("ignore", pf.SkippedSampleWarning)
        full = epochs_of(loader_for(path, dict(case["options"])), 2)
        alone = dict(case["options"], num_workers=0)
        if full != epochs_of(loader_for(path, alone), 2):
            return "the workers served other batches than one process"
        for epoch in full:
            seen = sorted(label for labels, _ in epoch for label in labels)
            if set(seen) & set(case["bad"]) or len(seen) != len(set(seen)):
                return f"served a damaged or repeated sample: {seen}"
            if not case["options"]["drop_last"] and seen != sorted(set(range(case["n"])) - set(case["bad"])):
                return f"left out a good sample: {seen}"
        interrupted = loader_for(path, dict(case["options"]))
        batches = iter(interrupted)
        head = [record(*batch) for _, batch in zip(range(case["stop"]), batches)]
        state = json.loads(json.dumps(interrupted.state_dict()))
        del batches, interrupted
        resumed = loader_for(path, dict(case["options"]))
        resumed.load_state_dict(state)
        rest = epochs_of(resumed, 1)[0]
        if head == full[0]:  # the whole epoch was handed out: what is left of it (nothing), or the next epoch
            if rest not in ([], full[1]):
                return f"resumed after the whole epoch ({len(head)} batches) into another epoch than the next"
        elif head + rest != full[0]:
            return f"resumed after {len(head)} batches into other batches"
        return "intact"
    return trial


def test_a_damaged_stretch_a_batch_or_more_long_is_skipped_exactly_and_resumes(tmp_path):
    from .test_resume import damage_samples, unique_archive

    findings = []
    for number in range(TRIALS):
        case = skip_case(rng_of("skip", number))
        path = unique_archive(tmp_path / f"skip{number}.memmap", case["n"], seed=number)
        damage_samples(path, case["bad"])
        verdict = isolated(skip_trial(path, case))
        if verdict != "intact":
            findings.append(f"skip trial {number} ({case}): {verdict[:2000]}")
    report(findings)


# ---- two conversions by one plan: a part of the one put into the other -------------------------------------
SET_FORMATS = {"zip": ".zip", "memmap": ".memmap", "lmdb": ".lmdb", "hdf5": ".h5"}


def set_case(rng: random.Random, root: str) -> dict:
    """Two sets by one plan (the same names, other pixels; for "masks", the same images and other masks) and
    the part of B copied over A's: which, how, and where."""
    from packed_formats.backends.sharded import ShardedWriter

    fmt = rng.choice(sorted(SET_FORMATS))
    count, shard = rng.randrange(4, 13), rng.randrange(1, 5)
    kind = rng.choice(["pixels", "masks", "labels"])
    shape = (rng.randrange(4, 12), rng.randrange(4, 12), 3)
    paths = []
    other = rng.randrange(1, 250)
    other += (kind == "labels" and other % 2 == 0) or (kind == "masks" and other % shape[0] == 0)  # differ
    for name, variant in (("a", 0), ("b", other)):
        os.makedirs(os.path.join(root, name))
        path = os.path.join(root, name, "set" + SET_FORMATS[fmt])
        fields = {"fields": ["mask=image"]} if kind == "masks" else {}
        with ShardedWriter(path, fmt, shard, set_id="00c0ffee00c0ffee", mode="raw", shape=shape, classes=["x", "y"],
                           **fields) as writer:
            for i in range(count):
                pixels = np.full(shape, (i * 7 + (variant if kind == "pixels" else 0)) % 256, np.uint8)
                label = (i + (variant if kind == "labels" else 0)) % 2
                extra = {}
                if kind == "masks":
                    mask = np.zeros(shape[:2], np.uint8)
                    mask[: 1 + (i + variant) % shape[0]] = 1
                    extra = {"fields": {"mask": mask}}
                writer.add(pixels, label, key=f"k/{i}", **extra)
        paths.append(path)
    parts_count = -(-count // shard)
    return {"fmt": fmt, "kind": kind, "a": paths[0], "b": paths[1], "part": rng.randrange(parts_count),
            "count": count, "shard": shard, "read": rng.choice(["open", "dataset", "verify"])}


def set_trial(case: dict) -> Callable[[], str]:
    from packed_formats.writing import parts

    def trial() -> str:
        name = parts.part_name(case["a"], case["part"])
        source = os.path.join(os.path.dirname(case["b"]), name)
        target = os.path.join(os.path.dirname(case["a"]), name)
        if os.path.isdir(target):
            shutil.rmtree(target)
            shutil.copytree(source, target)
        else:
            shutil.copyfile(source, target)
        if case["read"] == "verify":
            report = pf.verify_archive(case["a"], decode=True)
            return "verified OK" if report.ok else "refused: " + "; ".join(bad.problem for bad in report.bad)
        if case["read"] == "dataset":
            dataset = pf.PackedDataset(case["a"])
            [dataset[i] for i in range(len(dataset))]
            return f"served {len(dataset)} samples"
        with pf.open_archive(case["a"]) as reader:
            reader.read_many(np.arange(len(reader)))
            return f"served {len(reader)} samples"
    return trial


def test_a_part_of_another_conversion_by_the_same_plan_is_refused_naming_it(tmp_path):
    findings = []
    for number in range(TRIALS):
        root = str(tmp_path / f"sets{number}")
        case = set_case(rng_of("sets", number), root)
        verdict = isolated(set_trial(case))
        if not (verdict.startswith("refused: ") and "holds other samples" in verdict):
            findings.append(f"set trial {number} ({case['fmt']}, other {case['kind']}, part {case['part']} of "
                            f"{case['count']} samples in parts of {case['shard']}, read by {case['read']}): "
                            f"{verdict[:2000]}")
        shutil.rmtree(root, ignore_errors=True)
    report(findings)
