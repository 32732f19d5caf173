"""Errors that do not keep alive what raised them.

A traceback holds every frame it passed through, and each frame its local
variables: an archive error kept by its catcher (``except ... as e`` stored,
``sys.exc_info()``, a notebook's last error, a logger's record) would hold the
Reader, dataset or loader that raised it, and with them an open HDF5 file or
LMDB environment (which the format's own tools then cannot open in the same
process) or a DataLoader's worker processes, after their user dropped them.

The library's entry points that read (``Reader.read`` and the like, a
dataset's items, a loader's batches) let their errors out through
``drops_frames`` or ``release_frames``: the frames the error left behind, all
finished, forget their variables (the traceback's file, line and function
names stay, so it prints as before; a post-mortem debugger finds those frames'
variables empty).
"""

from __future__ import annotations

import functools
import traceback
from typing import Any, Callable, Optional, TypeVar, cast

from .errors import PackedFormatError

F = TypeVar("F", bound=Callable[..., Any])


def release_frames(error: Optional[BaseException]) -> None:
    """Clear the variables of the finished frames in ``error``'s traceback and in those of the
    errors it was raised from or while handling (frames still running are left as they are)."""
    seen, pending = set(), [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def drops_frames(method: F) -> F:
    """``method``, its ``PackedFormatError``s let out with ``release_frames`` done and without this
    call's own arguments (``self`` among them) in the frame they leave through."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except PackedFormatError as error:
            release_frames(error)
            del args, kwargs
            raise

    return cast(F, call)
