"""The ``packed-formats`` command: one sub-command per module in ``commands/``.

Each command module defines ``HELP`` (one line), ``EXAMPLES`` (text),
``add_arguments(parser)`` and ``run(args) -> int``.  User mistakes
(PackedFormatError, bad option values) print one line without a traceback
and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from . import __version__
from .errors import PackedFormatError

COMMANDS = ("convert", "info", "verify", "bench", "doctor", "stage")


def _load(name: str):
    return importlib.import_module(f"packed_formats.commands.{name}")


def build_parser(available: Optional[List[str]] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    except PackedFormatError as exc:
        print(f"packed-formats {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        print(f"packed-formats {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"packed-formats {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
