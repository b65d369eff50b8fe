"""The files a command line names: read a config or an input file it is given, and check before
the work that an output file it will write can be written. Every failure is a
:class:`~freezeframe.errors.ConfigError` naming the argument, the path and the fix."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from freezeframe.errors import ConfigError

__all__ = ["check_output_file", "read_config_text", "read_file"]


def read_config_text(source: str) -> str:
    """The text of a config argument: ``-`` reads stdin, ``@FILE`` the file, anything else is
    the text itself."""
    if source == "-":
        return sys.stdin.read()
    if source.startswith("@"):
        path = Path(source[1:])
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at "
                              f"byte {exc.start}); give a JSON file") from None
    return source


def read_file(path: str, argument: str) -> str:
    """The UTF-8 text of the file ``path`` given as ``argument`` (named in the error)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{argument}: cannot read {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{argument}: {path!r} is not UTF-8 text; give a JSON file") from None


def check_output_file(path: str, flag: str, example: str) -> None:
    """Raise :class:`ConfigError` naming ``flag``, ``path`` and the fix unless a file can be
    written at ``path``: checked before a command's work, not when it writes its result. An
    existing file is opened for appending (nothing is written to it); for a new one, a probe
    file is created and removed next to it."""
    target = Path(path)
    prefix = f"{flag}: cannot write {path!r}"
    if target.is_dir():
        raise ConfigError(f"{prefix}: Is a directory; give a file path such as "
                          f"{str(target / example)!r}")
    parent = target.parent
    if not parent.is_dir():
        blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():  # a file where a directory is due
            raise ConfigError(f"{prefix}: Not a directory ({str(blocker)!r} is a file); choose "
                              "a path inside a directory")
        raise ConfigError(f"{prefix}: No such file or directory (directory {str(parent)!r} "
                          "does not exist); create it first or choose another path")
    try:
        if target.exists():
            with target.open("a", encoding="utf-8"):
                pass
        else:
            fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=parent)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{prefix}: {exc.strerror or exc}; choose a writable location") \
            from None
