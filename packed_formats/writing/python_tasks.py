"""How a conversion runs over a Python source (sources.python): its items prepared in the workers, labels along.

A PythonSource's labels come with its items, so its worker function hands
each sample's label back with the prepared sample (a fourth value after
convert's ``(ok, sample, alpha dropped)``); ``ok`` None says the function left
that input out.  Before any worker starts, the dataset must pickle (it is sent
to each worker, whatever the start method, so a conversion behaves alike on
every platform); when it does not, the error names what in it does not.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Optional, Sequence, Tuple

from ..errors import InvalidSourceError, PackedFormatError
from ..sources.base import Source, SourceOptions
from ..sources.python import PythonSource, is_map_style, is_python_source
from ..sources.python_iterable import IterableSource

_SHOWN_ATTRIBUTES = 3


def as_python_source(src: Any, inputs: Optional[Sequence[Any]], classes: Optional[Sequence[Any]]
                     ) -> "PythonSource | IterableSource | None":
    """``src`` as a PythonSource when it is a Python object (a dataset, or a function with ``inputs``), as an
    IterableSource when it is an iterable or a generator, else None (a path)."""
    if isinstance(src, IterableSource) or (not is_python_source(src, inputs) and _is_iterable(src)):
        if inputs is not None:
            raise ValueError("inputs= goes with a function that makes a sample of each input, not an iterable")
        if classes is not None and isinstance(src, IterableSource):
            raise ValueError("give classes= to the IterableSource itself")
        return src if isinstance(src, IterableSource) else IterableSource(src, classes=classes)
    if not is_python_source(src, inputs):
        if classes is not None:
            raise ValueError("classes= goes with a Python dataset; a path's classes come from the source")
        return None
    if isinstance(src, PythonSource):
        if inputs is not None or classes is not None:
            raise ValueError("give inputs= and classes= to the PythonSource itself")
        return src
    return PythonSource(src, inputs, classes=classes)


def _is_iterable(value: Any) -> bool:
    """An iterable or a generator to read in one pass (not a path, a list of paths, or a map-style dataset)."""
    if isinstance(value, (str, bytes, os.PathLike)) or is_map_style(value):
        return False
    return hasattr(value, "__iter__") and not isinstance(value, (list, tuple))


def open_python(source: "PythonSource | IterableSource", fields: Sequence[Any], on_error: str, mode: str,
                size: Any, part: Any) -> "PythonSource | IterableSource":
    """The source listed for a conversion with these options: a raw conversion without a size takes item 0's
    for every item (another is an error, never a silent resize); an encoded one of a plain ImageFolder keeps
    its files' bytes (``PythonSource.keep_files``)."""
    if isinstance(source, IterableSource) and part is not None:
        raise ValueError("part= splits a dataset by index: an iterable has none; convert a map-style dataset "
                         "(__len__ and __getitem__) in parts")
    source.listed(SourceOptions(on_error=on_error, fields=tuple(fields)))
    if len(source) == 0:
        raise InvalidSourceError(source.path, "no items", hint="check the dataset")
    source.one_size = mode == "raw" and size is None
    if isinstance(source, PythonSource):  # a plain ImageFolder's JPEGs and PNGs kept as they are, as a folder's
        source.keep_files = mode == "encoded"
    return source


def python_of(source: Source) -> Tuple[Optional[PythonSource], int]:
    """(the PythonSource under ``source``, the index of ``source``'s sample 0 in it): a part's range of it too;
    (None, 0) for any other source."""
    base, offset = getattr(source, "source", None), getattr(source, "start", 0)
    if isinstance(source, PythonSource):
        return source, 0
    if isinstance(base, PythonSource):
        return base, int(offset)
    return None, 0


def worker_task(source: Source, workers: int) -> Optional[Tuple[Callable[[Any, int], Any], Optional[str]]]:
    """(the worker function, the start method) for a Python source, checked to pickle when ``workers`` > 1;
    None for any other source."""
    base, _ = python_of(source)
    if base is None:
        return None
    if workers > 1:
        check_pickles(base)
    return prepare_python_sample, base.start_method


def prepare_python_sample(context: Tuple[Source, Any], i: int) -> Tuple[Optional[bool], Any, bool, int]:
    """convert's ``_prepare_sample`` with the item's label after it; (None, None, False, -1) for an input the
    function left out.  Runs in a worker."""
    from .convert import _prepare_sample  # not at import: convert imports this module

    source, recipe = context
    base, offset = python_of(source)
    assert base is not None, "worker_task gives this function to Python sources only"
    try:
        label = base.label_at(offset + i)
    except PackedFormatError as exc:
        return False, exc, False, -1
    if label is None:
        return None, None, False, -1
    if base.one_size:
        try:  # a size taken from item 0: another size is an error, never a silent resize
            base.check_shape(offset + i)
        except PackedFormatError as exc:
            return False, exc, False, -1
    ok, value, alpha = _prepare_sample(context, i)
    return ok, value, alpha, label


def check_pickles(source: PythonSource) -> None:
    """InvalidSourceError naming what in the dataset cannot be pickled, and the ways out, when it cannot."""
    what = source.factory if source.factory is not None else (source.data, source.inputs)
    try:  # into nothing: an in-memory dataset's pickle would be a second copy of it, made only to be dropped
        pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(what)
        return
    except Exception as exc:  # PicklingError, TypeError, AttributeError...: anything pickle raises
        problem = f"{type(exc).__name__}: {exc}"
    culprits = _unpicklable_attributes(source.data if source.factory is None else source.factory[0])
    where = f"its attribute {', '.join(culprits)} cannot be pickled" if culprits else "it cannot be pickled"
    raise InvalidSourceError(
        source.path, f"the dataset is sent to each worker process, but {where} ({problem})",
        hint="convert with workers=0 (every item made in this process), or make the dataset in each worker "
             "with a factory: PythonSource.from_factory(make_dataset) or --python MODULE:FUNCTION on the command "
             "line (or open what it holds lazily, in __getitem__, as a DataLoader with spawn needs)",
    )


class _Discard:
    """A file that keeps nothing written to it (a pickle's bytes and buffers)."""

    def write(self, data: Any) -> None:
        pass


def _unpicklable_attributes(obj: Any) -> list:
    """``name (type)`` of the attributes of ``obj`` that do not pickle (the first few)."""
    found = []
    for name, value in sorted(getattr(obj, "__dict__", {}).items()):
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            found.append(f"{name!r} ({type(value).__name__})")
        if len(found) == _SHOWN_ATTRIBUTES:
            break
    return found


__all__ = ["as_python_source", "check_pickles", "open_python", "prepare_python_sample", "worker_task"]
