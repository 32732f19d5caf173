"""Run by tests/test_slots.py in a process of its own, to be killed with SIGKILL mid-epoch.

    python tests/killed_loader.py ARCHIVE SLOT_DIRECTORY CASE_JSON

The case ({"method": a start method, "fields": bool, and optionally "take": the
batches taken, 2 by default, "batch_size": 4 by default}) says how the loader is
made: persistent workers (the default) that send their batches in slots made
in SLOT_DIRECTORY, and with "fields" the archive's mask and boxes under a
torchvision v2 transform.  It takes ``take`` batches and keeps them, waits until
the workers have made the batches they make ahead (sent in slots; with fields,
whose small batches travel in their messages, for a few seconds), prints
"ready" and waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time

import packed_formats as pf
from packed_formats.loading.slots import BatchSlots
from packed_formats.memory import SENT


def main() -> None:
    archive, directory, case = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    options = dict(batch_size=case.get("batch_size", 4), num_workers=2, multiprocessing_context=case["method"],
                   shuffle=False)
    if case["fields"]:
        from torchvision.transforms import v2

        options.update(fields={"mask": "mask", "boxes": "boxes:XYXY"},
                       transform=v2.Compose([v2.RandomResizedCrop(64), v2.RandomHorizontalFlip()]))
    loader = pf.make_loader(archive, **options)
    pool = loader.batch_reader.pool = BatchSlots(2, path=loader.reader.path, directory=directory)
    batches = iter(loader)
    kept = [next(batches) for _ in range(case.get("take", 2))]
    deadline = time.monotonic() + (3 if case["fields"] else 60)
    while int((pool.states == SENT).sum()) < len(kept) + 4 and time.monotonic() < deadline:  # 2 ahead per worker
        time.sleep(0.05)
    print("ready", flush=True)
    time.sleep(3600)
    del kept


if __name__ == "__main__":
    main()
