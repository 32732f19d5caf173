"""packed_formats: pack image datasets into ZIP, HDF5, LMDB or memmap archives and
load them into PyTorch fast and safely with any number of DataLoader workers."""

__version__ = "0.1.0"

from . import backends as _backends
from .archives import open_archive
from .backends import detect_format, open_writer
from .backends.base import FormatSpec
from .backends.reader import Reader
from .backends.writer import Writer
from .doctor import diagnose
from .errors import (
    ArchiveChangedError,
    ArchiveExistsError,
    ArchiveInUseError,
    ArchiveNotFoundError,
    ArchivePermissionError,
    ClosedArchiveError,
    ConversionFailedError,
    CorruptArchiveError,
    CorruptSampleError,
    DataLoaderWorkerError,
    DestinationError,
    FormatMismatchError,
    IncompleteArchiveError,
    InsufficientSpaceError,
    InvalidSampleError,
    InvalidSourceError,
    MissingDependencyError,
    MixtureError,
    PackedFormatError,
    RemoteAccessError,
    RemoteChangedError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    SampleIndexError,
    TempDirTooDeepError,
    TooManyOpenFilesError,
    UnknownFormatError,
    UnsupportedVersionError,
)
from .manifest import ArchiveManifest
from .stage import stage
from .verify import VerifyReport, verify_archive
from .writing.convert import ConvertSummary, convert

__all__ = [
    "FORMATS",
    "PACKED_FORMATS",
    "ArchiveChangedError",
    "ArchiveExistsError",
    "ArchiveInUseError",
    "ArchiveManifest",
    "ArchiveNotFoundError",
    "ArchivePermissionError",
    "ClosedArchiveError",
    "ConversionFailedError",
    "ConvertSummary",
    "CorruptArchiveError",
    "CorruptSampleError",
    "DataLoaderWorkerError",
    "TempDirTooDeepError",
    "DestinationError",
    "FormatMismatchError",
    "FormatSpec",
    "GroupByAspectRatio",
    "IncompleteArchiveError",
    "InsufficientSpaceError",
    "InvalidSampleError",
    "InvalidSourceError",
    "PackedDataset",
    "MissingDependencyError",
    "Mixture",
    "MixtureError",
    "PackedFormatError",
    "PackedLoader",
    "PythonSource",
    "Reader",
    "RemoteAccessError",
    "RemoteChangedError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteUnavailableError",
    "ResumableSampler",
    "SampleIndexError",
    "SkippedSampleWarning",
    "SourceWarning",
    "TooManyOpenFilesError",
    "UnknownFormatError",
    "UnpicklingWarning",
    "UnsupportedVersionError",
    "VerifyReport",
    "Writer",
    "convert",
    "detect_format",
    "diagnose",
    "make_loader",
    "open_archive",
    "open_writer",
    "stage",
    "transforms",
    "verify_archive",
]

# torch takes seconds to import: what needs it loads on first use, so that
# `import packed_formats` and `packed-formats info/verify/convert` start quickly.
_LAZY = {
    "GroupByAspectRatio": ".loading.aspect_groups",
    "PackedDataset": ".loading.dataset",
    "Mixture": ".loading.mixture",
    "PackedLoader": ".loading.loader",
    "PythonSource": ".sources.python",
    "ResumableSampler": ".loading.resume",
    "SkippedSampleWarning": ".loading.loader",
    "SourceWarning": ".sources.base",
    "UnpicklingWarning": ".sources.base",
    "make_loader": ".loading.loader",
    "transforms": ".transforms",
}


def __getattr__(name: str):
    if name in ("FORMATS", "PACKED_FORMATS"):  # live: formats can be registered at run time
        return getattr(_backends, name)
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        value = module if name == "transforms" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"FORMATS", "PACKED_FORMATS"})
