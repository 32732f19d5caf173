"""packed_formats: pack image datasets into ZIP, HDF5, LMDB or memmap archives and
load them into PyTorch fast and safely with any number of DataLoader workers."""

__version__ = "0.1.0"

from .backends import FORMATS, PACKED_FORMATS, detect_format, open_archive, open_writer
from .backends.base import Reader, Writer
from .convert import ConvertSummary, convert
from .doctor import diagnose
from .errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    ArchiveNotFoundError,
    ClosedArchiveError,
    CorruptArchiveError,
    CorruptSampleError,
    FormatMismatchError,
    IncompleteArchiveError,
    InvalidSampleError,
    PackedFormatError,
    SampleIndexError,
    UnknownFormatError,
    UnsupportedVersionError,
)
from .manifest import ArchiveManifest
from .stage import stage

__all__ = [
    "FORMATS",
    "PACKED_FORMATS",
    "ArchiveChangedError",
    "ArchiveExistsError",
    "ArchiveManifest",
    "ArchiveNotFoundError",
    "ClosedArchiveError",
    "ConvertSummary",
    "CorruptArchiveError",
    "CorruptSampleError",
    "FormatMismatchError",
    "IncompleteArchiveError",
    "InvalidSampleError",
    "PackedDataset",
    "PackedFormatError",
    "Reader",
    "SampleIndexError",
    "UnknownFormatError",
    "UnsupportedVersionError",
    "Writer",
    "convert",
    "detect_format",
    "diagnose",
    "make_loader",
    "open_archive",
    "open_writer",
    "stage",
    "transforms",
]

# torch takes seconds to import: what needs it loads on first use, so that
# `import packed_formats` and `packed-formats info/verify/convert` start quickly.
_LAZY = {
    "PackedDataset": ".dataset",
    "make_loader": ".loader",
    "transforms": ".transforms",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        value = module if name == "transforms" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
