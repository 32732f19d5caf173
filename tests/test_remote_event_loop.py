"""Reading a store from code that runs inside an event loop: a Jupyter cell, an asyncio application.

A notebook's cells run while the kernel's event loop is running, so the library's synchronous
calls (``open_archive("s3://...")``, a loader's reads) must not start a loop of their own there.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("s3fs", reason="s3:// needs s3fs")

from packed_formats.storage import Store  # noqa: E402


def test_a_store_is_read_from_inside_a_running_event_loop(s3_env):
    url = s3_env.put(f"s3://{s3_env.bucket()}/data/object.bin", b"x" * 100)

    async def cell() -> int:  # a synchronous call made while a loop runs, as in a notebook cell
        return Store().info(url).size

    assert asyncio.run(cell()) == 100
    assert Store().info(url).size == 100  # and outside any loop, as before
