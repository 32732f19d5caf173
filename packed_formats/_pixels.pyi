# The C module _pixels.c (built at install where a C compiler is; see packed_formats.native).
from typing import Any

def gather(src: Any, starts: Any, dst: Any, places: Any, nbytes: int, channels: int, planar: bool, /) -> None: ...
