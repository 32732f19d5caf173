"""A seeded corruption fuzz: damaged archives give the intact data or a PackedFormatError, never anything else.

Each trial copies a known-good archive, damages one of its files once (a bit
flip, a few random bytes, 512 zero bytes or a truncation, at a random offset,
half of the time within the first or last 4 KiB of the file), then reads the
copy through ``PackedDataset[i]``, a plain 2-worker ``DataLoader``,
``make_loader`` and ``verify_archive(decode=True)``, each in a forked child
under a time limit (``fuzz_helpers``).  Forbidden: data that differs from
the intact archive's, an exception outside ``PackedFormatError``, a hang, a
crash, and a verify that passes an archive the other paths cannot read back.

The quick tier runs a few trials per format and mode, each read path in its
own forked child.  The slow tier runs ``SLOW_TRIALS`` trials per format (split
over its modes) under a seed drawn afresh each run and printed; its trials run
in batches, each batch in its own process (two at a time), the read paths of
a trial in that process (the 2-worker DataLoader, which starts two processes,
in every fourth trial; the other three in every trial: ``fuzz_helpers.
DATALOADER_EVERY``): a read that is silent for ``PF_FUZZ_TIMEOUT``
seconds is a hang, and its batch is killed (the rest go on in a new batch).
A third of the aimed damage lands near a structure (a manifest's text, an
HDF5 object, a ZIP header, an LMDB page start).  ``PF_FUZZ_SEED`` replaces
both tiers' seed (to replay a run), ``PF_FUZZ_TRIALS`` the slow tier's number
of trials per format, ``PF_FUZZ_TIMEOUT`` the seconds a read path may take
(e.g. ``PF_FUZZ_SEED=7 PF_FUZZ_TRIALS=50 pytest -m slow tests/test_fuzz.py``).
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import time

import pytest

import packed_formats as pf

from . import fuzz_helpers as fuzz
from .conftest import ARCHIVE_KINDS, kind_id

QUICK_SEED, QUICK_TRIALS = 0, 4
SLOW_TRIALS = 200  # per format, split over its modes (about 3 minutes on 2 shared cores)
SLOW_BATCH = 50  # trials a batch process runs (one process start per batch, not per read)


def setting(name: str, default: int) -> int:
    """An integer from the environment variable ``name``, or ``default``."""
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


TIMEOUT = setting("PF_FUZZ_TIMEOUT", 15)  # seconds per read path: a trial (4 paths) hangs after 60 s
SLOW_COUNT = setting("PF_FUZZ_TRIALS", SLOW_TRIALS)


def time_limit(trials: int) -> pytest.MarkDecorator:
    """pytest-timeout's limit for a test of ``trials`` trials: room for every read path to hang."""
    return pytest.mark.timeout(60 + trials * len(fuzz.READ_PATHS) * TIMEOUT)


@pytest.fixture(scope="module")
def references(uniform_archives):
    """{kind: (Reference, [(file, size)])} of the intact uniform archives, read once."""
    return {
        kind: (fuzz.reference_of(path, kind[1]), fuzz.archive_files(path))
        for kind, path in uniform_archives.items()
    }


def run_fuzz(uniform_archives, references, tmp_path, kind, seed: int, trials: int) -> None:
    """Run ``trials`` trials on ``kind`` and fail with every bad outcome's reproduction."""
    fmt, mode = kind
    ref, files = references[kind]
    done = [
        fuzz.run_trial(uniform_archives[kind], str(tmp_path), seed, n, fmt, mode, ref, files, TIMEOUT)
        for n in range(trials)
    ]
    bad = [trial.reproduction(path, outcome) for trial in done for path, outcome in trial.bad()]
    summary = ", ".join(f"{verdict} {count}" for verdict, count in sorted(fuzz.tally(done).items()))
    print(f"{fmt}/{mode} seed {seed}: {trials} trials: {summary}")  # shown with -s or -rP
    for trial in done:
        print(f"  trial {trial.number}: {trial.damage.describe()}: "
              + "; ".join(f"{p} {o.verdict}" for p, o in trial.outcomes.items()))
    assert not bad, f"{len(bad)} bad outcomes in {trials} trials ({summary}):\n" + "\n".join(bad)


@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_the_harness_reads_an_intact_copy_as_the_intact_data(uniform_archives, references, tmp_path, kind):
    """Control: with no damage every read path gives the reference, so a difference found is the damage's."""
    ref, _ = references[kind]
    copy = fuzz.copy_archive(uniform_archives[kind], str(tmp_path / os.path.basename(uniform_archives[kind])))
    outcomes = {name: fuzz.run_isolated(fuzz.READERS[name], copy, ref, kind[1], TIMEOUT) for name in fuzz.READ_PATHS}
    assert all(o.verdict == fuzz.SAME for o in outcomes.values()), outcomes


def sleep_forever(path, ref, mode):
    time.sleep(3600)


def segfault(path, ref, mode):
    faulthandler.disable()  # a real crash's traceback helps; this one's is noise
    os.kill(os.getpid(), signal.SIGSEGV)


def raise_value_error(path, ref, mode):
    raise ValueError("not from the tree")


def raise_corrupt_sample(path, ref, mode):
    raise pf.CorruptSampleError(path, "checksum mismatch", index=0)


def differ(path, ref, mode):
    return "sample 0 pixels: 3 values differ"


@pytest.mark.parametrize("read, verdict", [
    (sleep_forever, fuzz.HANG), (segfault, fuzz.CRASH), (raise_value_error, fuzz.FOREIGN),
    (raise_corrupt_sample, fuzz.NAMED), (differ, fuzz.WRONG),
])
def test_the_harness_tells_every_outcome_apart(tmp_path, read, verdict):
    outcome = fuzz.run_isolated(read, str(tmp_path), None, "raw", timeout=2)
    assert outcome.verdict == verdict, outcome


@time_limit(QUICK_TRIALS)
@pytest.mark.parametrize("kind", ARCHIVE_KINDS, ids=kind_id)
def test_a_damaged_archive_reads_intact_or_raises_a_named_error(uniform_archives, references, tmp_path, kind):
    run_fuzz(uniform_archives, references, tmp_path, kind, setting("PF_FUZZ_SEED", QUICK_SEED), QUICK_TRIALS)


def fresh_seed() -> int:
    """``PF_FUZZ_SEED``, else a seed no run chose before (printed, to replay the run)."""
    return setting("PF_FUZZ_SEED", random.SystemRandom().randrange(1 << 32))


# Over 60 s (about 4.5 min): 1,000 trials of 3-4 read paths each, in long-lived batch processes (one start per
# 50 trials, forked from a forkserver that imported torch once), two at a time.  The count is the point.
@pytest.mark.slow
@pytest.mark.timeout(60 + 2 * SLOW_COUNT * TIMEOUT)
def test_many_damaged_archives_read_intact_or_raise_a_named_error(uniform_archives, references, tmp_path):
    """``SLOW_COUNT`` fresh trials per format, over every mode and read path: no hang, no crash, no silent
    wrong result, no exception outside the error tree, no verify that passes what cannot be read."""
    seed = fresh_seed()
    print(f"fuzz seed {seed} (replay with PF_FUZZ_SEED={seed}), {SLOW_COUNT} trials per format")
    jobs = []
    for kind in ARCHIVE_KINDS:
        fmt, mode = kind
        per_mode = -(-SLOW_COUNT // sum(1 for f, _ in ARCHIVE_KINDS if f == fmt))
        ref, files = references[kind]
        landmarks = fuzz.landmarks_of(uniform_archives[kind], files)
        for start in range(0, per_mode, SLOW_BATCH):
            numbers = tuple(range(start, min(per_mode, start + SLOW_BATCH)))
            jobs.append(fuzz.Job(uniform_archives[kind], str(tmp_path), seed, fmt, mode, numbers, ref,
                                 tuple(files), landmarks))
    done = fuzz.run_jobs(jobs, TIMEOUT, processes=2)
    bad = [trial.reproduction(path, outcome) for trial in done for path, outcome in trial.bad()]
    for fmt, mode in ARCHIVE_KINDS:
        of_kind = [t for t in done if (t.fmt, t.mode) == (fmt, mode)]
        summary = ", ".join(f"{verdict} {count}" for verdict, count in sorted(fuzz.tally(of_kind).items()))
        print(f"{fmt}/{mode} seed {seed}: {len(of_kind)} trials: {summary}")
    assert not bad, f"seed {seed}: {len(bad)} bad outcomes in {len(done)} trials:\n" + "\n".join(bad)
