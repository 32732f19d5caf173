"""Where the samples are in a list of container member names: an ImageFolder tree, or a dataset.json.

Shared by the ZIP and tar sources, so that a container converts exactly as
its extracted folder does: the same classes, keys, labels and order.

* ImageFolder: leading directories that hold every image are skipped (a ZIP
  of ``dataset/train/<class>/<image>`` has its root at ``dataset/train`` if it
  holds one split; ``subdir`` picks one when it holds several); classes are
  the sorted directory names below the root, keys the paths from the root.
* dataset.json (the stylegan2-ada ``dataset_tool`` layout): every image below
  the folder holding ``dataset.json``, labelled by its
  ``{"labels": [[path, label], ...]}`` (null labels: all 0).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from typing import Dict, List, Optional, Sequence, Tuple

from ..backends.folder import SKIPPED_NAMES_KEPT, is_image_file
from ..errors import InvalidSourceError
from .base import classes_and_labels, folder_order, in_folder_order, is_junk

DATASET_JSON = "dataset.json"


@dataclasses.dataclass
class Layout:
    """The samples found: ``members[i]`` (an index into the names given) is sample i."""

    classes: Tuple[str, ...]
    members: List[int]
    keys: List[str]
    labels: List[int]
    skipped: int
    description: str
    skipped_names: List[str] = dataclasses.field(default_factory=list)  # the first skipped files' names


def dataset_json_member(names: Sequence[str], subdir: Optional[str]) -> Optional[int]:
    """The index of the dataset.json that labels the samples, if there is one.

    With ``subdir``: the one in that folder (from the top, or below the
    folder every file shares).  Otherwise the shallowest one; several at the
    same depth (one per split) need ``subdir``.
    """
    found = {name: j for j, name in enumerate(names) if posixpath.basename(name) == DATASET_JSON and not is_junk(name)}
    if not found:
        return None
    if subdir is not None:
        top = _common_directory([n for n in names if not is_junk(n)])
        for folder in (subdir, posixpath.join(top, subdir)):
            j = found.get(posixpath.join(folder, DATASET_JSON))
            if j is not None:
                return j
        return None
    depth = min(name.count("/") for name in found)
    shallowest = sorted(name for name in found if name.count("/") == depth)
    if len(shallowest) > 1:
        return -1  # ambiguous: the caller asks for subdir
    return found[shallowest[0]]


def dataset_json_layout(path: str, names: Sequence[str], where: int, content: bytes) -> Layout:
    """Samples labelled by the dataset.json ``names[where]`` (its bytes: ``content``)."""
    json_name = names[where]
    root = posixpath.dirname(json_name)
    prefix = root + "/" if root else ""
    by_key: Dict[str, int] = {}
    skipped: List[str] = []
    for j, name in enumerate(names):
        if j == where or not name or not name.startswith(prefix) or is_junk(name):
            continue
        if is_image_file(name):
            by_key[name[len(prefix):]] = j
        else:
            skipped.append(name)
    labelled = read_dataset_json(f"{path}:{json_name}", content)
    found = list(by_key)
    keys = [found[j] for j in folder_order_with_root_files(found)]
    if labelled is None:
        values: List[int] = [0] * len(keys)
    else:
        missing = [k for k in keys if k not in labelled]
        if missing:
            raise InvalidSourceError(
                f"{path}:{json_name}", f"has no label for {len(missing)} images, e.g. {missing[0]!r}"
            )
        absent = sorted(set(labelled) - set(by_key))
        if absent:
            raise InvalidSourceError(
                f"{path}:{json_name}", f"labels {len(absent)} images that are not there, e.g. {absent[0]!r}",
                hint="the container is incomplete",
            )
        values = [labelled[k] for k in keys]
    classes, labels = classes_and_labels(f"{path}:{json_name}", values)
    where_text = f" in {root}/" if root else ""
    return Layout(classes, [by_key[k] for k in keys], keys, labels, len(skipped),
                  f"stylegan2-ada dataset.json{where_text}", skipped[:SKIPPED_NAMES_KEPT])


def read_dataset_json(where: str, content: bytes) -> Optional[Dict[str, int]]:
    """{relative image path: label} from a dataset.json, or None when its labels are null."""
    try:
        document = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidSourceError(where, f"is not valid JSON ({exc})") from None
    if not isinstance(document, dict) or "labels" not in document:
        raise InvalidSourceError(where, 'has no "labels": expected {"labels": [["path", label], ...]}')
    rows = document["labels"]
    if rows is None:
        return None
    out: Dict[str, int] = {}
    for row in rows if isinstance(rows, list) else [rows]:
        if not (isinstance(row, (list, tuple)) and len(row) == 2 and isinstance(row[0], str)):
            raise InvalidSourceError(where, f"has a label entry that is not [path, label]: {row!r}")
        label = row[1]
        if isinstance(label, bool) or not isinstance(label, int):
            raise InvalidSourceError(where, f"label of {row[0]!r} is {label!r}; only integer class labels convert")
        out[posixpath.normpath(row[0].replace("\\", "/"))] = label
    return out


def looks_like_dataset_json(content: bytes) -> bool:
    """Whether a dataset.json has the stylegan2-ada shape ({"labels": [...] or null})."""
    try:
        document = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(document, dict) and "labels" in document and isinstance(document["labels"], (list, type(None)))


def folder_order_with_root_files(keys: Sequence[str]) -> List[int]:
    """Walk order of relative paths: the root's own files first (sorted), then as ``folder_order``."""
    top = sorted((j for j, k in enumerate(keys) if "/" not in k), key=lambda j: keys[j])
    below = [j for j in range(len(keys)) if "/" in keys[j]]
    return top + [below[j] for j in folder_order([keys[j] for j in below])]


def image_folder_layout(path: str, names: Sequence[str], dirs: Sequence[str], subdir: Optional[str]) -> Layout:
    """Samples of the ImageFolder tree among file ``names`` (``dirs``: directory entries, for empty classes)."""
    wanted = [j for j, name in enumerate(names) if not is_junk(name)]
    images = [names[j] for j in wanted if is_image_file(names[j])]
    top = _class_root(images)
    root = top
    if subdir is not None:
        root = _find_subdir(path, [names[j] for j in wanted] + list(dirs), top, subdir)
        below = [n[len(root) + 1:] for n in images if n.startswith(root + "/")]
        inner = _class_root(below)
        root = posixpath.join(root, inner) if inner else root
    prefix = root + "/" if root else ""
    classes = set()
    for name, is_dir in [(d, True) for d in dirs if not is_junk(d + "/")] + [(names[j], False) for j in wanted]:
        rest = name[len(prefix):] if name.startswith(prefix) else None
        if rest and ("/" in rest or is_dir) and not rest.startswith("."):
            classes.add(rest.split("/", 1)[0])
    sorted_classes = tuple(sorted(classes))
    lookup = {name: c for c, name in enumerate(sorted_classes)}
    chosen: List[int] = []
    keys: List[str] = []
    skipped: List[str] = []
    for j in wanted:
        name = names[j]
        if not name.startswith(prefix) or "/" not in name[len(prefix):]:
            continue
        key = name[len(prefix):]
        if key.split("/", 1)[0] not in lookup:
            continue  # a hidden class directory
        if is_image_file(name):
            chosen.append(j)
            keys.append(key)
        else:
            skipped.append(name)
    keys, members, labels = in_folder_order(keys, chosen, lookup)
    description = f"ImageFolder tree under {root}/" if root else "ImageFolder tree"
    return Layout(sorted_classes, members, keys, labels, len(skipped), description, skipped[:SKIPPED_NAMES_KEPT])


def _common_directory(names: Sequence[str]) -> str:
    """The directory every name is inside of ("" when none)."""
    if not names:
        return ""
    parts = [n.split("/")[:-1] for n in names]
    common: List[str] = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return "/".join(common)


def _class_root(images: Sequence[str]) -> str:
    """The deepest directory holding every image that still leaves each image a class directory."""
    if not images:
        return ""
    common = _common_directory(images)
    depth = min(name.count("/") for name in images) - 1  # levels that may be skipped
    if depth <= 0:
        return ""
    return "/".join(common.split("/")[:depth]) if common else ""


def _find_subdir(path: str, names: Sequence[str], top: str, subdir: str) -> str:
    subdir = subdir.strip("/")
    base = posixpath.dirname(top) if top else ""
    for candidate in dict.fromkeys((subdir, posixpath.join(top, subdir), posixpath.join(base, subdir))):
        if any(n.startswith(candidate + "/") for n in names):
            return candidate
    shown = sorted({n[len(top) + 1:].split("/", 1)[0] if top else n.split("/", 1)[0]
                    for n in names if "/" in (n[len(top) + 1:] if top else n)})
    raise InvalidSourceError(
        path, f"has no folder {subdir!r}",
        hint=f"its folders{' under ' + top if top else ''} are: {', '.join(shown[:10]) or 'none'}",
    )
