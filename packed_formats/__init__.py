"""packed_formats: pack image datasets into ZIP, HDF5, LMDB or memmap archives and
load them into PyTorch fast and safely with any number of DataLoader workers."""

__version__ = "0.1.0"

from .backends import FORMATS, PACKED_FORMATS, detect_format, open_archive, open_writer
from .backends.base import Reader, Writer
from .dataset import PackedDataset
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
)
from .manifest import ArchiveManifest

__all__ = [
    "FORMATS",
    "PACKED_FORMATS",
    "ArchiveChangedError",
    "ArchiveExistsError",
    "ArchiveManifest",
    "ArchiveNotFoundError",
    "ClosedArchiveError",
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
    "Writer",
    "detect_format",
    "open_archive",
    "open_writer",
]
