"""Whether DataLoader workers can hand shared memory over from this process's temporary folder.

A worker sends a tensor (or ``make_loader`` a batch slot) by passing its file descriptor through an
AF_UNIX socket that multiprocessing binds under the temporary folder (``$TMPDIR``):
``<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX``.  A socket's path holds at most 107 bytes on Linux (103 on
macOS and the BSDs), so under a folder deeper than about 75 bytes, common for job scratch folders on
clusters, the bind fails, in a worker thread whose error nobody sees: torch's DataLoader then waits
for the batch forever.  ``check`` raises ``TempDirTooDeepError`` in that case instead, before any
batch is sent.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from typing import Any, Dict, Optional

from ..errors import TempDirTooDeepError

SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103  # sun_path's bytes, less its NUL
TEMP_DIR_NAME = len("/pymp-") + 8  # multiprocessing.util.get_temp_dir: mkdtemp(prefix="pymp-")
SOCKET_NAME = len("/listener-") + 8  # multiprocessing.connection.arbitrary_address: mktemp(prefix="listener-")
SOCKET_BELOW_TEMP_DIR = TEMP_DIR_NAME + SOCKET_NAME


def _made_folder() -> Optional[str]:
    """This process's multiprocessing folder, once made (a forked worker inherits its parent's)."""
    config = getattr(multiprocessing.current_process(), "_config", None)
    made = config.get("tempdir") if isinstance(config, dict) else None
    return made if isinstance(made, str) else None


def socket_path_bytes() -> int:
    """The length in bytes of the path of the socket through which this process would pass descriptors."""
    made = _made_folder()
    if made is not None:
        return len(os.fsencode(made)) + SOCKET_NAME
    return len(os.fsencode(tempfile.gettempdir())) + SOCKET_BELOW_TEMP_DIR


def describe() -> Dict[str, Any]:
    """The temporary folder, the socket path's length under it and the limit (``doctor``'s report)."""
    return {"path": _made_folder() or tempfile.gettempdir(), "socket_path_bytes": socket_path_bytes(),
            "limit": SOCKET_PATH_MAX, "applies": sys.platform != "win32"}


def problem() -> Optional[str]:
    """Why workers could not pass descriptors from here (a sentence naming the folder), or None."""
    found = describe()
    if not found["applies"] or found["socket_path_bytes"] <= SOCKET_PATH_MAX:
        return None
    return (f"the temporary folder {found['path']!r} is too deep for DataLoader workers: the socket through "
            f"which they hand over shared memory would have a path of {found['socket_path_bytes']} bytes, "
            f"over the {SOCKET_PATH_MAX} a socket path may have; set TMPDIR to a folder of at most "
            f"{SOCKET_PATH_MAX - SOCKET_BELOW_TEMP_DIR} bytes (export TMPDIR=/tmp) before starting Python")


_checked_in: Optional[int] = None


def check(tensors_only: bool = False) -> None:
    """Raise ``TempDirTooDeepError`` where workers could not pass descriptors; once per process.
    ``tensors_only``: for a process that sends nothing but tensors, which pass no descriptor under torch's
    "file_system" sharing strategy."""
    global _checked_in
    if _checked_in == os.getpid():
        return
    if tensors_only:
        import torch.multiprocessing

        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return
    found = problem()
    if found is not None:
        raise TempDirTooDeepError(message=found)
    _checked_in = os.getpid()
