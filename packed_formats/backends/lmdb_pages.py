"""Where an LMDB data file keeps a record's value, found by walking its B-tree.

py-lmdb hands out a value's bytes, never their place in the file, and an
index mapped from the file needs that place.  The layout read here is LMDB's
on-disk format version 1 as a 64-bit build writes it: pages 0 and 1 are meta
pages, and the one with the higher transaction id holds the main database's
root page; branch pages lead to the leaf page with the key, whose node holds
the value right after the key or, for a value too large for the leaf
("F_BIGDATA"), the number of the first of the overflow pages it sits on: it
starts right after that page's 16-byte header.

Only the pages on one key's path are read (``depth`` of them).  Nothing here
is trusted on its own: whatever does not look as described returns None, and
callers compare what they find with LMDB's own statistics and with the
record read through lmdb before they use it.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Dict, List, Optional, Tuple

PAGE_HEADER = struct.Struct("<QHHHH")  # page number, pad, flags, lower (end of node pointers), upper
_DB = ("pad", "flags", "depth", "branch_pages", "leaf_pages", "overflow_pages", "entries", "root")
META = struct.Struct("<IIQQ" + 2 * "IHHQQQQQ" + "QQ")  # after a page header
META_FIELDS = (
    ("magic", "version", "address", "map_size")
    + tuple("free_" + name for name in _DB)  # the free DB's pad is the page size
    + _DB  # the main DB
    + ("last_page", "txnid")
)
# lo, hi (leaf: data size; branch: page number), flags (branch: the page number's top 16 bits), key size
NODE = struct.Struct("<HHHH")
MAGIC, VERSION = 0xBEEFC0DE, 1
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01  # a leaf node whose value is on overflow pages
NO_PAGE = 0xFFFFFFFFFFFFFFFF  # the root of an empty database
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 512, 1 << 16


@dataclasses.dataclass(frozen=True)
class MainTree:
    """The main database as the newer meta page describes it."""

    page_size: int
    root: int
    depth: int
    entries: int
    txnid: int


def read_main_tree(fd: int) -> Optional[MainTree]:
    """The main database of the file ``fd``, from its newer meta page (None if there is no such page)."""
    first = _meta(_read(fd, PAGE_HEADER.size + META.size, 0))
    if first is None:
        return None
    page_size = first["free_pad"]
    if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        return None
    second = _meta(_read(fd, PAGE_HEADER.size + META.size, page_size))
    newer = second if second is not None and second["txnid"] > first["txnid"] else first  # as LMDB picks it
    return MainTree(page_size, newer["root"], newer["depth"], newer["entries"], newer["txnid"])


def _meta(head: bytes) -> Optional[Dict[str, int]]:
    """A meta page's fields by name, None if the bytes are no meta page of format version 1."""
    if len(head) < PAGE_HEADER.size + META.size:
        return None
    meta = dict(zip(META_FIELDS, META.unpack_from(head, PAGE_HEADER.size)))
    return meta if meta["magic"] == MAGIC and meta["version"] == VERSION else None


def value_position(fd: int, tree: MainTree, key: bytes) -> Optional[Tuple[int, int]]:
    """(file offset, size) of ``key``'s value; None when the key is not found or a page does not
    read as expected."""
    if tree.root == NO_PAGE:
        return None
    number = tree.root
    for _ in range(tree.depth):
        page = _read(fd, tree.page_size, number * tree.page_size)
        if len(page) < tree.page_size:
            return None
        own_number, _, flags, lower, _ = PAGE_HEADER.unpack_from(page)
        nodes = _nodes(page, lower)
        if own_number != number or not nodes:
            return None
        if flags & P_BRANCH:
            number = _child(page, nodes, key)
        elif flags & P_LEAF:
            return _value(fd, tree.page_size, number, page, nodes, key)
        else:
            return None
    return None


def _nodes(page: bytes, lower: int) -> Optional[List[Tuple[int, int, int, int, bytes]]]:
    """The page's nodes as (lo, hi, flags, key start, key), None if one lies outside the page."""
    count = (lower - PAGE_HEADER.size) // 2
    if count < 0 or lower > len(page):
        return None
    nodes = []
    for pointer in struct.unpack_from(f"<{count}H", page, PAGE_HEADER.size):
        if pointer + NODE.size > len(page):
            return None
        lo, hi, flags, key_size = NODE.unpack_from(page, pointer)
        start = pointer + NODE.size
        if start + key_size > len(page):
            return None
        nodes.append((lo, hi, flags, start, page[start : start + key_size]))
    return nodes


def _child(page: bytes, nodes: list, key: bytes) -> int:
    """The page a branch follows for ``key``: the last node whose key is <= it (node 0's key is
    empty, lower than any); keys compare as LMDB's default, bytes by bytes."""
    chosen = nodes[0]
    for node in nodes[1:]:
        if node[4] > key:
            break
        chosen = node
    lo, hi, top = chosen[0], chosen[1], chosen[2]
    return lo | hi << 16 | top << 32


def _value(
    fd: int, page_size: int, leaf: int, page: bytes, nodes: list, key: bytes
) -> Optional[Tuple[int, int]]:
    """Where the value of ``key`` lies: in the leaf page right after its key, or on overflow pages."""
    for lo, hi, flags, start, node_key in nodes:
        if node_key != key:
            continue
        size, data = lo | hi << 16, start + len(node_key)
        if not flags:  # a plain value, in the leaf
            return (leaf * page_size + data, size) if data + size <= page_size else None
        if flags != F_BIGDATA or data + 8 > page_size:  # a sub-database or duplicates: not a plain value
            return None
        (number,) = struct.unpack_from("<Q", page, data)
        header = _read(fd, PAGE_HEADER.size, number * page_size)
        if len(header) < PAGE_HEADER.size:
            return None
        own_number, _, page_flags, _, _ = PAGE_HEADER.unpack_from(header)
        if own_number != number or not page_flags & P_OVERFLOW:
            return None
        return number * page_size + PAGE_HEADER.size, size
    return None


def _read(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes of the file at ``offset``: fewer, or none, past its end or at an offset no file has."""
    try:
        return os.pread(fd, size, offset)
    except (OSError, OverflowError):
        return b""
