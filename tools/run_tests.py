#!/usr/bin/env python3
"""``make test``'s runner: the whole suite in three streams, the time of each test file, the wall time last.

1. The parallel pass: every test not marked ``serial`` or ``beside``, on two pytest-xdist workers, the
   longest first (``tests/conftest.py``).
2. Then the serial pass: the tests that need the whole machine, one at a time.
3. Beside both, from the start, the ``beside`` stream, one at a time: the tests that mostly wait (Slurm
   jobs paced past a signal; store servers' stalls, retries and backoff) and use a service that exists
   once per machine (the local Slurm cluster).  They cost the other streams little CPU.

Every stream always runs; the exit status is the first failure's.  Each writes a JUnit report under
``test-results/`` (the folder is emptied first); the end prints the slowest test files, each stream's
time and the wall time.

    python tools/run_tests.py                # what make test runs (after lint and type check)
    python tools/run_tests.py --fast         # the tests not marked slow (make test-fast)
    python tools/run_tests.py --shuffle 7    # every stream in a random order drawn from seed 7
    python tools/run_tests.py -- -x -k hdf5  # more pytest options, for every stream
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "test-results")


def streams(fast: bool) -> List[Tuple[str, str, List[str]]]:
    """(name, marker expression, pytest options) of each stream, in the order they start.  The serial pass
    collects only its modules (collecting the whole suite takes 10 s)."""
    only = "not slow and " if fast else ""
    return [
        ("parallel", f"{only}not serial and not beside", ["-n", "2", "--dist", "worksteal", "--durations=25",
                                                          "tests"]),
        ("beside", f"{only}beside", ["--durations=15", "-p", "no:cacheprovider", "tests"]),
        ("serial", f"{only}serial", ["--durations=15", *serial_modules()]),
    ]


def serial_modules() -> List[str]:
    """The files of ``tests/conftest.py``'s SERIAL_MODULES (a literal there, read without importing it)."""
    with open(os.path.join(ROOT, "tests", "conftest.py"), encoding="utf-8") as source:
        tree = ast.parse(source.read())
    names = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "SERIAL_MODULES" for t in node.targets))
    return [f"tests/{name}.py" for name in sorted(names)]


def command(name: str, marks: str, options: Sequence[str], extra: Sequence[str]) -> List[str]:
    """The pytest command of a stream: its options (paths last) after the extra ones."""
    paths = [o for o in options if o.startswith("tests")]
    flags = [o for o in options if not o.startswith("tests")]
    return [sys.executable, "-m", "pytest", "-q", "-m", marks, *flags,
            f"--junitxml={os.path.join(RESULTS, name + '.xml')}", *extra, *paths]


def file_times(report: str) -> Dict[str, Tuple[float, int]]:
    """{test file: (seconds, tests)} from a JUnit report (the time pytest measured, setup and teardown in)."""
    if not os.path.exists(report):
        return {}
    out: Dict[str, Tuple[float, int]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(name) if part.startswith("test_")), len(name) - 1)
        path = "/".join(name[:module + 1]) + ".py"
        seconds, count = out.get(path, (0.0, 0))
        out[path] = (seconds + float(case.get("time") or 0.0), count + 1)
    return out


def summary(seconds: Dict[str, float], reports: Sequence[Tuple[str, str]], rows: int = 15) -> str:
    """The slowest test files of every stream, then each stream's wall time."""
    files: List[Tuple[float, int, str, str]] = []
    for name, report in reports:
        files += [(t, n, path, name) for path, (t, n) in file_times(report).items()]
    lines = [f"== the {rows} slowest test files (seconds of test time, tests, stream)"]
    lines += [f"{t:8.1f} s {n:5d}  {path}  ({name})" for t, n, path, name in sorted(files, reverse=True)[:rows]]
    lines.append("== wall time per stream: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="leave out the tests marked slow")
    parser.add_argument("--shuffle", metavar="SEED", help="run each stream in a random order from SEED ('random': "
                                                          "a fresh seed, printed)")
    parser.add_argument("--label", default="make test", help="what the last line names")
    parser.add_argument("pytest_options", nargs="*", help="more pytest options (after --)")
    args = parser.parse_args(argv)
    extra = list(args.pytest_options) + (["--shuffle", args.shuffle] if args.shuffle else [])
    if args.shuffle == "random":  # one seed for all streams, printed by each
        import random

        extra[-1] = str(random.SystemRandom().randrange(1 << 32))

    shutil.rmtree(RESULTS, ignore_errors=True)
    os.makedirs(RESULTS)
    start = time.monotonic()
    (parallel, marks_p, options_p), (beside, marks_b, options_b), (serial, marks_s, options_s) = streams(args.fast)
    seconds: Dict[str, float] = collections.OrderedDict()
    statuses: List[int] = []

    # the beside stream writes to a file, shown at the end (two streams on one terminal would interleave)
    with tempfile.TemporaryFile("w+") as log:
        # in the quick tier at a lower priority: it mostly waits, the CPU it does use (a store server's) would
        # be taken from the other two, which use all of it, and it still ends first (1.5 of 2.5 min); in the
        # whole suite its Slurm jobs must end within the others' 16 minutes, so it keeps its priority there
        nice = 10 if args.fast else 0
        waiting = subprocess.Popen(command(beside, marks_b, options_b, extra), cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(nice))
        def time_beside() -> None:  # when the beside stream ends, not when it is asked after the serial pass
            waiting.wait()
            seconds[beside] = time.monotonic() - start

        ended = threading.Thread(target=time_beside, daemon=True)
        ended.start()
        try:
            print(f"== {parallel} pass ({marks_p}); the {beside} stream ({marks_b}) runs beside it and the "
                  f"{serial} pass", flush=True)
            statuses.append(subprocess.call(command(parallel, marks_p, options_p, extra), cwd=ROOT))
            seconds[parallel] = time.monotonic() - start
            print(f"== {serial} pass ({marks_s})", flush=True)
            statuses.append(subprocess.call(command(serial, marks_s, options_s, extra), cwd=ROOT))
            seconds[serial] = time.monotonic() - start - seconds[parallel]
            statuses.append(waiting.wait())
            ended.join()
        finally:
            if waiting.poll() is None:  # interrupted: the beside stream goes too
                waiting.terminate()
                waiting.wait()
        log.seek(0)
        print(f"== {beside} stream ({marks_b}), run beside the others", flush=True)
        sys.stdout.write(log.read())

    print(summary(seconds, [(name, os.path.join(RESULTS, f"{name}.xml")) for name in (parallel, serial, beside)]))
    wall = time.monotonic() - start
    print(f"{args.label}: {wall:.0f} s of wall time ({wall / 60:.1f} min)", flush=True)
    return overall_status(statuses)


def overall_status(statuses: Sequence[int]) -> int:
    """The first failure's status.  pytest's 5 is "no test collected": a stream that selects nothing (a
    filter given after --) is no failure, but a run in which no stream collected anything is."""
    if all(s == 5 for s in statuses):
        return 5
    return next((s for s in statuses if s not in (0, 5)), 0)


if __name__ == "__main__":
    sys.exit(main())
