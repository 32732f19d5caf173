"""Run by tests/test_lifetimes.py in a process of its own, with the garbage collector off.

    python tests/lifetime_worker.py ARCHIVE CASES_JSON

For each case ({"loader": "make_loader" or "plain", "workers": n, "keep": bool}):
iterate a loader over ARCHIVE (damaged: its first batch fails with a
CorruptSampleError in a worker), catch the error (and keep it, if asked),
drop the loader, and report as one JSON line: the worker pids seen at the
error, those still alive 5 s after the drop, the library and torch objects
left over, and the error's path and index.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

import packed_formats as pf
from packed_formats.backends.reader import Reader

TRACKED = (Reader, pf.PackedDataset, pf.PackedLoader, torch.utils.data.DataLoader)


def workers_of_this_process() -> list:
    """The pids of this process's live child processes (its DataLoader workers)."""
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def left_over() -> list:
    """The names of the loader-side objects the garbage collector still tracks."""
    return sorted(type(o).__name__ for o in gc.get_objects()
                  if isinstance(o, TRACKED) or type(o).__name__.endswith("DataLoaderIter"))


def run(archive: str, case: dict) -> dict:
    workers = case["workers"]
    context = "fork" if workers else None
    if case["loader"] == "make_loader":
        loader = pf.make_loader(archive, batch_size=8, shuffle=False, num_workers=workers,
                                multiprocessing_context=context)  # persistent workers, the default
    else:
        loader = torch.utils.data.DataLoader(pf.PackedDataset(archive, output="tensor"), batch_size=8,
                                             num_workers=workers, multiprocessing_context=context)
    kept, pids = None, []
    try:
        for _ in loader:
            pass
    except pf.CorruptSampleError as error:
        pids = workers_of_this_process()
        if case["keep"]:
            kept = error
    del loader
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"case": case, "workers_seen": len(pids), "workers_alive": [p for p in pids if alive(p)],
            "objects": left_over(), "error": None if kept is None else [kept.path, kept.index]}


def main() -> None:
    archive, cases = sys.argv[1], json.loads(sys.argv[2])
    gc.disable()
    for case in cases:
        print(json.dumps(run(archive, case)), flush=True)


if __name__ == "__main__":
    main()
