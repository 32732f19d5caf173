"""A worker whose main process was killed before the worker started watching it must still end.

A killed process stays a zombie until its parent reaps it (``subprocess`` reaps only when asked), and
a worker forked just before the kill may start its watcher only after it: its parent is then already
the reaper, and the main process it was told to watch still answers ``kill(pid, 0)``.  The worker
must see the main process as gone, or it lives on holding the pipes its caller waits on (a caller
that reads the main process's output to its end then waits forever).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from packed_formats import handles

MAIN = textwrap.dedent("""
    import os, sys, time
    from packed_formats.handles import leave_with_parent
    main = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker: starts watching only once its main process has been killed
        while os.getppid() == main:
            time.sleep(0.01)
        leave_with_parent(main)
        time.sleep(60)
        os._exit(3)
    print(pid, flush=True)
    time.sleep(60)
""")


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc"), reason="needs fork and /proc")
def test_a_worker_that_starts_watching_after_its_main_process_was_killed_ends():
    main = subprocess.Popen([sys.executable, "-c", MAIN], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(main.stdout.readline())
        os.kill(main.pid, signal.SIGKILL)  # not reaped: a zombie while the test runs
        deadline = time.monotonic() + 15
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(worker), "the worker kept running after its main process was killed"
    finally:
        main.kill()
        main.wait(timeout=10)


def test_a_zombie_is_not_running(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while not gone(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert handles.pid_alive(child.pid)  # kill(pid, 0) still answers for a zombie
    assert not handles.running(child.pid)
    child.wait()
    assert not handles.running(child.pid) and handles.running(os.getpid())
