"""Disk space: how much is free where an archive is written, and byte counts for people."""

from __future__ import annotations

import shutil
from typing import Optional

from .errors import PackedFormatError


def human_bytes(n: Optional[float]) -> str:
    """``1.5 GiB``-style text (binary units); "unknown" for None."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def free_bytes(directory: str) -> Optional[int]:
    """Bytes this user may still write in ``directory``'s file system (None: it reports no size, e.g. sysfs)."""
    usage = shutil.disk_usage(directory)
    return usage.free if usage.total else None


def check_free_space(directory: str, needed: int, purpose: str, hint: Optional[str] = None) -> None:
    """Raise PackedFormatError naming ``directory`` when it has fewer than ``needed`` bytes free."""
    free = free_bytes(directory)
    if free is not None and free < needed:
        raise PackedFormatError(
            directory,
            f"not enough space to {purpose}: needs about {human_bytes(needed)} ({needed} bytes), "
            f"{human_bytes(free)} ({free} bytes) free",
            hint=hint,
        )
