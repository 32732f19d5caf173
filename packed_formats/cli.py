"""The ``packed-formats`` command: one sub-command per module in ``commands/``.

Each command module defines ``HELP`` (one line), ``EXAMPLES`` (text),
``add_arguments(parser)`` and ``run(args) -> int``.  Every user-facing
failure (PackedFormatError, bad option values, an OSError such as a
permission denied or a full disk, a missing optional package) prints one line
``packed-formats COMMAND: error: ...`` without a traceback and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, NoReturn, Optional

from . import __version__
from .errors import PackedFormatError, printable

COMMANDS = ("convert", "join", "info", "verify", "bench", "doctor", "stage", "upload")
# module -> (pip package, extra of packed_formats that installs it)
OPTIONAL_PACKAGES = {
    "matplotlib": ("matplotlib", "plot"),
    "nbclient": ("nbclient", "notebooks"),
    "PIL": ("pillow", None),
    "pyarrow": ("pyarrow", "hub"),
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}; see {self.prog} --help\n")


def _load(name: str):
    return importlib.import_module(f"packed_formats.commands.{name}")


def build_parser(available: Optional[List[str]] = None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="packed-formats",
        description="Pack image datasets into archives and load them into PyTorch fast and safely.",
    )
    parser.add_argument("--version", action="version", version=f"packed-formats {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in available if available is not None else COMMANDS:
        try:
            module = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name == f"packed_formats.commands.{name}":
                continue  # command not installed in this build
            raise
        command = sub.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=getattr(module, "EXAMPLES", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"packed-formats {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as other commands do
        return _closed_pipe()
    except Exception as exc:
        message = user_error(exc)
        if message is None:
            raise  # a bug: the traceback is what a report needs
        print(f"packed-formats {args.command}: error: {message}", file=sys.stderr)
        return 2


def _closed_pipe() -> int:
    """Point stdout at /dev/null (so the final flush cannot fail again) and return 128 + SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def user_error(exc: BaseException) -> Optional[str]:
    """The one-line message for a failure the user can act on, or None for a bug."""
    if isinstance(exc, PackedFormatError):
        return one_line(str(exc))
    if isinstance(exc, OSError):
        return one_line(describe_os_error(exc))
    if isinstance(exc, ImportError) and not (exc.name or "").startswith(__package__):
        return one_line(describe_import_error(exc))
    if isinstance(exc, ValueError):
        return one_line(str(exc))
    return None


def describe_os_error(exc: OSError) -> str:
    """``FILE: reason`` (``FILE -> OTHER: reason`` for renames), or the bare reason if no file is known."""
    reason = exc.strerror or str(exc)
    names = [os.fsdecode(n) if isinstance(n, (str, bytes, os.PathLike)) else str(n)
             for n in (exc.filename, exc.filename2) if n is not None]
    return f"{' -> '.join(names)}: {reason}" if names else reason


def describe_import_error(exc: ImportError) -> str:
    """Which package to install (or upgrade) for a failed import."""
    module = (exc.name or "").split(".")[0]
    if not module:
        return str(exc)
    package, extra = OPTIONAL_PACKAGES.get(module, (module, None))
    also = f", or the {extra!r} extra: pip install '.[{extra}]' in packed_formats' folder" if extra else ""
    if isinstance(exc, ModuleNotFoundError):
        return f"this needs {package}, which is not installed: pip install {package}{also}"
    return f"{exc}: upgrade it with pip install -U {package}"


def one_line(text: str) -> str:
    """``text`` on one line, a character that does not print (a part name's escape sequence) escaped."""
    return printable(" ".join(text.split()))


if __name__ == "__main__":
    sys.exit(main())
