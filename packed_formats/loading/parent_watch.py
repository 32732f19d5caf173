"""DataLoader workers end as soon as their main process is gone.

torch's workers look for their parent only between batches, and then leave
the ordinary way, which waits for each queue's feeder thread.  When the main
process is killed, a feeder may be blocked for good writing a batch into the
results pipe: full, with no main process left to empty it, and its read end
held open by the sibling workers, which wait the same way.  Such workers stay
orphans, with their memory, until someone kills them.  Each of the loader's
workers therefore watches its parent (and the main process, a forkserver's
workers' grandparent) from a thread of its own, and once it is gone ends at
once, waiting for nothing (``os._exit``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Optional

INTERVAL = 0.2  # seconds between two looks at the parent

_watched_in: Optional[int] = None  # the process whose watcher runs (a forked child starts its own)


def leave_with_parent(interval: float = INTERVAL) -> None:
    """Start this process's watcher of its parent and main process, once per process (a worker calls it
    as it starts)."""
    global _watched_in
    if _watched_in == os.getpid():
        return
    _watched_in = os.getpid()
    creator = multiprocessing.parent_process()  # the process that made this one: the main process
    parent = os.getppid()
    owner = parent if creator is None or creator.pid is None else creator.pid
    threading.Thread(target=_watch, args=(parent, owner, interval), name="packed_formats-parent-watch",
                     daemon=True).start()


def _watch(parent: int, owner: int, interval: float) -> None:
    while os.getppid() == parent and _alive(owner):
        time.sleep(interval)
    os._exit(0)  # no parent to report to: the ordinary exit could wait forever on a feeder thread


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, under another user
        return True
    return True
