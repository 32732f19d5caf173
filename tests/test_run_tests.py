"""tools/run_tests.py, make test's runner: its streams cover the suite once, its times add up, its status is honest."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("run_tests", os.path.join(ROOT, "tools", "run_tests.py"))
run_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_tests)

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.test_a" name="test_two[zip-raw]" time="2.0"/>
<testcase classname="tests.test_b.TestGroup" name="test_three" time="0.25"/>
<testcase classname="tests.test_b" name="test_four" time="0.75"><skipped/></testcase>
</testsuite></testsuites>
"""


def test_file_times_add_up_per_test_file_classes_included(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    assert run_tests.file_times(str(report)) == {"tests/test_a.py": (3.5, 2), "tests/test_b.py": (1.0, 2)}
    assert run_tests.file_times(str(tmp_path / "absent.xml")) == {}


def test_the_summary_names_the_slowest_files_and_each_streams_time(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    text = run_tests.summary({"parallel": 120.0, "serial": 30.0}, [("parallel", str(report))], rows=1)
    assert "tests/test_a.py  (parallel)" in text and "test_b" not in text
    assert "parallel 2.0 min, serial 0.5 min" in text


@pytest.mark.parametrize("statuses,expected", [
    ([0, 0, 0], 0), ([0, 1, 0], 1), ([2, 1, 0], 2), ([5, 0, 0], 0), ([0, 5, 1], 1), ([5, 5, 5], 5),
])
def test_the_status_is_the_first_failures_and_no_test_at_all_is_a_failure(statuses, expected):
    assert run_tests.overall_status(statuses) == expected


MARKS_DUMP = """
import json, os
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    with open(os.environ["PF_MARKS_DUMP"], "w") as out:
        json.dump({item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items}, out)
"""


def test_the_streams_select_every_test_exactly_once(tmp_path):
    """The marker expressions of the three streams split the collected suite, and its quick tier, without
    overlap or gap (one collection, its markers read by a plugin, the expressions evaluated as pytest does)."""
    from _pytest.mark.expression import Expression

    (tmp_path / "marks_dump.py").write_text(MARKS_DUMP)
    dump = tmp_path / "marks.json"
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = dict(os.environ, PF_MARKS_DUMP=str(dump), PYTHONPATH=path)
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "marks_dump", "tests"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    marks = json.loads(dump.read_text())
    assert len(marks) > 1000
    for fast in (False, True):
        wanted = {n for n, m in marks.items() if not (fast and "slow" in m)}
        chosen = [{n for n, m in marks.items() if Expression.compile(expression).evaluate(m.__contains__)
                   and any(n == p or n.startswith(p.rstrip("/") + ("::" if p.endswith(".py") else "/"))
                           for p in options if p.startswith("tests"))}
                  for _, expression, options in run_tests.streams(fast)]
        assert all(chosen), f"a stream selects nothing (fast={fast})"
        assert sum(len(c) for c in chosen) == len(wanted) and set().union(*chosen) == wanted
    from .conftest import SLOW_FOR_THE_QUICK_TIER

    def function(nodeid: str) -> str:  # "tests/test_x.py::test_y[a]" -> "test_x::test_y"
        return nodeid.split("::")[0].rsplit("/", 1)[-1][:-3] + "::" + nodeid.split("::")[-1].split("[")[0]

    assert not SLOW_FOR_THE_QUICK_TIER - {function(n) for n in marks}, "names no test has"
    assert all("slow" in m for n, m in marks.items() if function(n) in SLOW_FOR_THE_QUICK_TIER)
