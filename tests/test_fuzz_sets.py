"""A seeded fuzz of what describes a set rather than a sample: a sharded set's index, the parts it
lists, a remote set's sample index and its store listing.  Each trial damages one of them (by
bytes, or by a plausible edit sealed again as a writer would seal it: a checksum anyone can
recompute is no defence), then reads the whole set.  Allowed: the intact set's samples, labels and
classes, or a ``PackedFormatError``.  Forbidden: anything else read back, another exception, a
file written outside the cache.

The seed is drawn afresh each run and printed with every failure; ``PF_FUZZ_SEED`` replays one,
``PF_FUZZ_SET_TRIALS`` sets the trials per format (local) and per kind of damage (remote).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import zlib
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.backends.sharded import ShardedWriter, index_text
from packed_formats.errors import PackedFormatError

SHAPE, PER_PART, PARTS = (6, 6, 3), 3, 3
CLASSES = ["a", "b", "c"]


def setting(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


SEED = setting("PF_FUZZ_SEED", random.SystemRandom().randrange(2**32))
TRIALS = setting("PF_FUZZ_SET_TRIALS", 40)


def write_set(path: str, fmt: str, first: int = 0) -> str:
    """A raw set of ``PARTS`` parts of ``PER_PART`` samples; sample i is filled with ``first + i``."""
    with ShardedWriter(path, fmt, shard_size=PER_PART, mode="raw", shape=SHAPE, classes=CLASSES) as writer:
        for i in range(PER_PART * PARTS):
            writer.add(np.full(SHAPE, first + i, dtype=np.uint8), i % len(CLASSES), f"s{first + i}.png")
    return path


def content(path: str, **options) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """Every sample of the set at ``path``, its labels and classes, read with checksums on."""
    with pf.open_archive(path, **options) as reader:
        return reader.read_many(np.arange(len(reader))), np.array(reader.index.labels), list(reader.classes)


def outcome(path: str, intact, **options) -> str:
    """"intact", "refused" (a named error) or what went wrong, reading the set at ``path``."""
    try:
        got = content(path, **options)
    except PackedFormatError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - any other exception is what the fuzz looks for
        return f"raised {type(exc).__name__}: {exc}"
    same = (got[0].shape == intact[0].shape and np.array_equal(got[0], intact[0])
            and np.array_equal(got[1], intact[1]) and got[2] == intact[2])
    return "intact" if same else "read back something else"


def resealed(spec: dict) -> str:
    """``spec`` written as a writer writes an index, with a fresh seal over whatever it now says."""
    extra = {k: v for k, v in spec.items() if k not in ("packed_formats_shards", "format", "set_id", "parts", "crc32")}
    parts = [(p["name"], p["count"], p.get("content", "")) for p in spec["parts"]]
    return index_text(spec["format"], parts, spec.get("set_id"), **extra)


# ---- damage to a local set: its index's bytes, plausible edits sealed again, parts moved on disk ----------
def flip_a_bit(rng, text: bytes, spec: dict, folder: str) -> bytes:
    data = bytearray(text)
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def overwrite_bytes(rng, text: bytes, spec: dict, folder: str) -> bytes:
    data, start = bytearray(text), rng.randrange(len(text))
    data[start:start + rng.randint(1, 8)] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(data)


def truncate(rng, text: bytes, spec: dict, folder: str) -> bytes:
    return text[:rng.randrange(len(text))]


def swap_two_names(rng, text: bytes, spec: dict, folder: str) -> bytes:
    a, b = rng.sample(range(len(spec["parts"])), 2)
    parts = spec["parts"]
    parts[a]["name"], parts[b]["name"] = parts[b]["name"], parts[a]["name"]
    return resealed(spec).encode()


def list_a_part_twice(rng, text: bytes, spec: dict, folder: str) -> bytes:
    a, b = rng.sample(range(len(spec["parts"])), 2)
    spec["parts"][a]["name"] = spec["parts"][b]["name"]
    return resealed(spec).encode()


def change_a_count(rng, text: bytes, spec: dict, folder: str) -> bytes:
    part = rng.choice(spec["parts"])
    part["count"] = max(0, part["count"] + rng.choice((-2, -1, 1, 2)))
    return resealed(spec).encode()


def drop_a_part(rng, text: bytes, spec: dict, folder: str) -> bytes:
    del spec["parts"][rng.randrange(len(spec["parts"]))]
    return resealed(spec).encode()


def is_leading_parts(damage: Callable, damaged: bytes) -> bool:
    """Whether ``damage`` left a sealed index of the set's first parts, in place: such a set reads as the
    shorter set those parts make (a part names its set and place, not how many parts the set has)."""
    if damage is not drop_a_part:
        return False
    names = [p["name"] for p in json.loads(damaged)["parts"]]
    return names == [f"set-{k:05d}{os.path.splitext(n)[1]}" for k, n in enumerate(names)]


def reverse_the_parts(rng, text: bytes, spec: dict, folder: str) -> bytes:
    spec["parts"].reverse()
    return resealed(spec).encode()


def another_set_id(rng, text: bytes, spec: dict, folder: str) -> bytes:
    spec["set_id"] = f"{rng.getrandbits(64):016x}"
    return resealed(spec).encode()


def another_format(rng, text: bytes, spec: dict, folder: str) -> bytes:
    spec["format"] = rng.choice([f for f in pf.PACKED_FORMATS if f != spec["format"]])
    return resealed(spec).encode()


def copy_a_part_over_another(rng, text: bytes, spec: dict, folder: str) -> bytes:
    a, b = rng.sample([p["name"] for p in spec["parts"]], 2)
    _replace(os.path.join(folder, a), os.path.join(folder, b))
    return text


def swap_two_parts_on_disk(rng, text: bytes, spec: dict, folder: str) -> bytes:
    a, b = rng.sample([os.path.join(folder, p["name"]) for p in spec["parts"]], 2)
    os.rename(a, a + ".moving")
    os.rename(b, a)
    os.rename(a + ".moving", b)
    return text


def _replace(source: str, target: str) -> None:
    (shutil.rmtree if os.path.isdir(target) else os.remove)(target)
    (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, target)


LOCAL_DAMAGE = [flip_a_bit, overwrite_bytes, truncate, swap_two_names, list_a_part_twice, change_a_count, drop_a_part,
                reverse_the_parts, another_set_id, another_format, copy_a_part_over_another, swap_two_parts_on_disk]


@pytest.fixture(scope="module")
def local_sets(tmp_path_factory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz-sets")
    return {fmt: write_set(os.fspath(root / fmt / f"set.{fmt}"), fmt) for fmt in pf.PACKED_FORMATS
            if not os.makedirs(root / fmt)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", pf.PACKED_FORMATS)
def test_a_damaged_or_resealed_set_index_reads_intact_or_is_refused(fmt, local_sets, tmp_path):
    intact, rng, bad = content(local_sets[fmt]), random.Random(f"{SEED}-{fmt}"), []
    for trial in range(TRIALS):
        folder = tmp_path / str(trial)
        shutil.copytree(os.path.dirname(local_sets[fmt]), folder)
        index = os.fspath(folder / os.path.basename(local_sets[fmt]))
        with open(index, "rb") as file:
            text = file.read()
        damage = LOCAL_DAMAGE[trial % len(LOCAL_DAMAGE)]
        damaged = damage(rng, text, json.loads(text), os.fspath(folder))
        with open(index, "wb") as file:
            file.write(damaged)
        expected = intact
        if is_leading_parts(damage, damaged):
            kept = PER_PART * len(json.loads(damaged)["parts"])
            expected = (intact[0][:kept], intact[1][:kept], intact[2])
        verdict = outcome(index, expected)
        if verdict not in ("intact", "refused"):
            bad.append(f"trial {trial} ({damage.__name__}): {verdict}; index now {damaged[:300]!r}")
        if damage in (swap_two_names, list_a_part_twice, another_set_id, copy_a_part_over_another,
                      swap_two_parts_on_disk) and verdict == "intact":
            bad.append(f"trial {trial} ({damage.__name__}): read as intact, which it cannot be")
        shutil.rmtree(folder)
    assert not bad, f"seed {SEED} (PF_FUZZ_SEED={SEED} replays it):\n" + "\n".join(bad)


# ---- damage to a remote set: its sample index and its listing ------------------------------------------------
def sample_arrays(local: str) -> Dict[str, np.ndarray]:
    with pf.open_archive(local) as reader:
        return {"labels": np.asarray(reader.index.labels, dtype=np.int64),
                "keys": np.asarray(reader.index.keys).astype(f"S{reader.index.keys.dtype.itemsize}"),
                "crc32": np.asarray(reader.index.crc32, dtype=np.uint32),
                "counts": np.full(PARTS, PER_PART, dtype=np.int64)}


def npz(arrays: Dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def damaged_sample_index(rng: random.Random, arrays: Dict[str, np.ndarray]) -> Tuple[str, bytes]:
    """One kind of damage to the sample index, drawn by ``rng``: (its name, the new npz bytes)."""
    arrays = {k: v.copy() for k, v in arrays.items()}
    n = len(arrays["labels"])
    kind = rng.choice(["labels", "keys", "crc32", "counts", "missing", "dtype", "bytes", "truncated"])
    if kind == "labels":
        for i in rng.sample(range(n), rng.randint(1, 3)):
            arrays["labels"][i] = (arrays["labels"][i] + rng.randint(1, 2)) % len(CLASSES)
    elif kind == "keys":
        i, j = rng.sample(range(n), 2)
        arrays["keys"][[i, j]] = arrays["keys"][[j, i]]
    elif kind == "crc32":
        arrays["crc32"][rng.randrange(n)] ^= 1 << rng.randrange(32)
    elif kind == "counts":
        a, b = rng.sample(range(PARTS), 2)
        arrays["counts"][a] += 1
        arrays["counts"][b] -= 1
    elif kind == "missing":
        del arrays[rng.choice(sorted(arrays))]
    elif kind == "dtype":
        name = rng.choice(["labels", "crc32", "counts"])
        arrays[name] = arrays[name].astype(rng.choice([np.float32, np.int16, np.uint64]))
    data = npz(arrays)
    if kind == "bytes":
        data = bytearray(data)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        data = bytes(data)
    elif kind == "truncated":
        data = data[:rng.randrange(len(data))]
    return kind, data


HOSTILE_NAMES = ["..", ".", "", "/", "//", "\\", "sp ace", "é", "\x00", "a" * 300, "~", "$HOME", "*", "%2e%2e"]


def hostile_key(rng: random.Random) -> str:
    """A relative key a store may list under a folder part: a few components, some of them hostile."""
    parts = [rng.choice(HOSTILE_NAMES + ["x", "data.npy", "manifest.json"]) for _ in range(rng.randint(1, 4))]
    return "/".join(parts).lstrip("/") or "x"


def files_outside(root, cache) -> List[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if not os.path.join(d, f).startswith(os.fspath(cache)))


@pytest.mark.timeout(900)
def test_a_damaged_sample_index_or_listing_reads_intact_or_is_refused_and_writes_only_in_the_cache(
        s3_env, tmp_path):
    pytest.importorskip("s3fs")
    from packed_formats import storage

    rng, bad = random.Random(f"{SEED}-remote"), []
    sources = {fmt: write_set(os.fspath(tmp_path / "sources" / fmt / f"set.{fmt}"), fmt)
               for fmt in ("zip", "memmap") if not os.makedirs(tmp_path / "sources" / fmt)}
    intact = {fmt: content(path) for fmt, path in sources.items()}
    for trial in range(TRIALS):
        fmt = "memmap" if trial % 2 else "zip"
        url = f"s3://{s3_env.bucket()}/set.{fmt}"
        storage.upload(sources[fmt], url)
        spec = json.loads(s3_env.fs().cat_file(url))
        if trial % 4 == 3:  # memmap: an object listed beside a folder part's files
            part = rng.choice(spec["parts"])["name"]
            key = hostile_key(rng)
            what = f"listing {part}/{key!r}"
            try:
                s3_env.put(f"{url.rsplit('/', 1)[0]}/{part}/{key}", b"\x00" * rng.randint(0, 64))
            except Exception:  # noqa: BLE001 - a key the store itself refuses is no trial
                continue
        else:
            what, data = damaged_sample_index(rng, sample_arrays(sources[fmt]))
            s3_env.put(f"{url.rsplit('/', 1)[0]}/{spec['samples']['name']}", data)
            spec["samples"].update(size=len(data), crc32=zlib.crc32(data))
            s3_env.put(url, resealed(spec).encode())
        cache = tmp_path / "runs" / str(trial) / "cache"
        os.makedirs(cache)
        verdict = outcome(url, intact[fmt], cache_dir=cache)
        if verdict not in ("intact", "refused"):
            bad.append(f"trial {trial} ({fmt}, {what}): {verdict}")
        escaped = files_outside(tmp_path / "runs", cache)
        if escaped:
            bad.append(f"trial {trial} ({fmt}, {what}): wrote outside the cache: {escaped}")
        shutil.rmtree(tmp_path / "runs" / str(trial))
    assert not bad, f"seed {SEED} (PF_FUZZ_SEED={SEED} replays it):\n" + "\n".join(bad)
