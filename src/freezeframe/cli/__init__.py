"""The ``freezeframe`` command: its parser, its subcommands' registration, and its exit codes.

Each subcommand is one module of this package (``config``, ``demo``, ``bench``, ``cache``,
``plan``), registered in :data:`SUBCOMMANDS` as ``(name, "module[:function]")``; the function
(default ``add_parser``) receives argparse's subparsers object, adds its parser and sets ``func``
(``handler(args) -> int`` exit code) with ``set_defaults``. A module is imported only when its
command runs (or for ``--help``), and a module that does not exist yet is skipped, so one
command's missing or heavy dependencies never break another. Keep module-level imports of such
modules light (import torch inside the handler). :mod:`freezeframe.cli.files` reads the files a
command is given and checks the ones it will write.

Every error a user can cause is one line on stderr, ``freezeframe COMMAND: error: ...``:

* a bad argument (wrong type, out of range, unknown choice) — argparse's error, without the
  usage block — exits 2;
* :class:`~freezeframe.errors.ConfigError` raised by a command (a bad config, a device that is
  not there, an output directory that cannot be written) exits 2;
* any other :class:`~freezeframe.errors.FreezeframeError` (compiling or capturing failed) exits 1;
* Ctrl-C exits 130;
* a closed stdout (``freezeframe demo | head -1``) ends the command quietly with 141, the status
  of a command that SIGPIPE ended (what ``seq 100000 | head -1`` leaves in ``PIPESTATUS``).

``freezeframe --debug COMMAND ...`` or ``FREEZEFRAME_DEBUG=1`` prints the traceback above that
line. Any other exception is a bug in freezeframe and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from freezeframe.errors import ConfigError, FreezeframeError

__all__ = ["DEBUG_ENV", "SUBCOMMANDS", "build_parser", "int_at_least", "int_list", "main"]

SUBCOMMANDS: list[tuple[str, str]] = [
    ("config", "freezeframe.cli.config"),
    ("demo", "freezeframe.cli.demo"),
    ("bench", "freezeframe.cli.bench"),
    ("cache", "freezeframe.cli.cache"),
    ("plan", "freezeframe.cli.plan"),
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE (13), as a shell reports a command a closed pipe ended
DEBUG_ENV = "FREEZEFRAME_DEBUG"


# -- argument parsing -------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (see 'PROG --help')``, exit 2."""

    def error(self, message: str) -> Any:  # argparse declares NoReturn
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting an int ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def int_list(minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` for ``"1,2,4"``: at least one int, each ``>= minimum``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints >= {minimum}, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"give at least one value, each >= {minimum}; got {text!r}")
        return values

    parse.__name__ = "comma-separated ints"
    return parse


# -- registration -----------------------------------------------------------------------------


def _load_registrar(target: str) -> Callable[[Any], Any] | None:
    module_name, _, func_name = target.partition(":")
    try:
        module: ModuleType = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "this command's module is not there (yet)" is tolerated; a missing dependency
        # *inside* an existing module is a real error and propagates.
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise
    registrar = getattr(module, func_name or "add_parser", None)
    return registrar if callable(registrar) else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only`` set, just that subcommand's module is imported."""
    parser = _Parser(
        prog="freezeframe",
        description="Trace once, split, compile per shape and capture graphs per padded batch "
                    "size, for any nn.Module.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")
    # Subcommand parsers are _Parser too (argparse uses the parent's class).
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, target in SUBCOMMANDS:
        if only is not None and name != only:
            continue
        registrar = _load_registrar(target)
        if registrar is not None:
            registrar(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        # The reader went away (``| head``): nothing more can be shown, and that is no error
        # of ours. Pointing stdout at devnull lets the interpreter's final flush of what is
        # still buffered succeed instead of printing a second BrokenPipeError.
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    return code


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (replaced, or closed)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _run(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    names = {name for name, _ in SUBCOMMANDS}
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(only=first if first in names else None)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: --help (0) or a one-line usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s: %(message)s", stream=sys.stderr)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = args.debug or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")
    prog = f"freezeframe {args.command}"
    try:
        return int(func(args) or 0)
    except FreezeframeError as exc:
        code = EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
        if debug:
            traceback.print_exc(file=sys.stderr)
        hint = ("" if debug or code == EXIT_USAGE
                else f" (rerun with freezeframe --debug or {DEBUG_ENV}=1 for the traceback)")
        print(f"{prog}: error: {_one_line(str(exc))}{hint}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc(file=sys.stderr)
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
