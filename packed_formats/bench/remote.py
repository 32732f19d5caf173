"""``packed-formats bench s3://...``: a set in object storage read through a fresh node-local cache.

Each epoch is timed whole (the first from an empty cache: cold), and the bytes the cache
downloaded during it are read from the cache's own log (``PartCache.downloads``), so the cost of
a reading order shows as "downloaded / set" next to its speed.  The default order is the window
shuffle with a window of half the parts the cache holds (the order that fits a bounded cache);
``shuffle="global"`` measures what a global shuffle costs with the same cache.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence


@dataclasses.dataclass
class RemoteBenchConfig:
    """What ``bench_remote`` measures: worker counts, batch size, epochs, the decode size of encoded
    samples, the cache's bound and folder (None: a fresh temporary one per run), and the order."""

    workers: Sequence[int] = (2,)
    batch_size: int = 64
    epochs: int = 2
    size: Optional[int] = 224
    cache_limit: Any = None
    cache_dir: Optional[str] = None
    shuffle: str = "window"
    window: Optional[int] = None
    start_method: Optional[str] = None


def bench_remote(urls: Sequence[str], config: RemoteBenchConfig) -> List[Dict[str, Any]]:
    """One row per URL, worker count and epoch: images/s, and bytes downloaded over the set's size."""
    import packed_formats as pf

    rows: List[Dict[str, Any]] = []
    for url in urls:
        for workers in config.workers:
            cache_dir = config.cache_dir or tempfile.mkdtemp(prefix="packed_formats-bench-cache-")
            try:
                with pf.open_archive(url, cache_dir=cache_dir, cache_limit=config.cache_limit, verify=False) as r:
                    backend: Any = r.backend
                    set_bytes = sum(p.info.size for p in backend.remote_parts)
                    fits = backend.parts_that_fit()
                    window = config.window or max(1, (fits or len(backend.remote_parts)) // 2)
                    raw = r.mode == "raw"
                loader = pf.make_loader(
                    url, batch_size=config.batch_size, num_workers=workers, size=None if raw else config.size,
                    shuffle="window" if config.shuffle == "window" else True, window=window, cache_dir=cache_dir,
                    cache_limit=config.cache_limit, multiprocessing_context=config.start_method if workers else None)
                cache = backend.cache
                for epoch in range(1, config.epochs + 1):
                    began, start, samples = time.time(), time.perf_counter(), 0
                    for _, labels in loader:
                        samples += len(labels)
                    seconds = time.perf_counter() - start
                    downloaded = sum(d["bytes"] for d in cache.downloads(since=began))
                    rows.append({"url": url, "workers": workers, "epoch": epoch, "shuffle": config.shuffle,
                                 "window": window if config.shuffle == "window" else None, "samples": samples,
                                 "seconds": round(seconds, 3), "images_per_s": round(samples / seconds, 1),
                                 "downloaded_bytes": downloaded, "set_bytes": set_bytes, "cache_limit": cache.limit,
                                 "downloaded_over_set": round(downloaded / set_bytes, 3)})
                del loader
            finally:
                if config.cache_dir is None:
                    shutil.rmtree(cache_dir, ignore_errors=True)
    return rows


def format_remote_table(rows: List[Dict[str, Any]]) -> str:
    """The rows as a text table."""
    lines = [f"{'set':40} {'workers':>7} {'epoch':>5} {'order':>10} {'img/s':>8} {'downloaded/set':>14}"]
    for row in rows:
        order = f"window {row['window']}" if row["window"] else "global"
        lines.append(f"{os.path.basename(row['url'])[:40]:40} {row['workers']:>7} {row['epoch']:>5} {order:>10} "
                     f"{row['images_per_s']:>8.1f} {row['downloaded_over_set']:>14.2f}")
    return "\n".join(lines)
