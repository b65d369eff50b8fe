"""``freezeframe cache list|info|clear``: look at and manage the on-disk compile cache.

Registered by :mod:`freezeframe.cli` through :func:`add_parser`; it imports nothing heavy, so
``freezeframe cache list`` starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from freezeframe.cache import store as _cache
from freezeframe.errors import ConfigError

__all__ = ["add_parser", "main"]


def _root(args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir).expanduser()
    return _cache.resolve_cache_root(None)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _cmd_list(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = _cache.list_entries(root)
    state = "off" if not _cache.cache_enabled(None) else "on"
    print(f"cache root: {root} (cache {state} by environment)")
    if not entries:
        print("no entries")
        return 0
    print(f"{'key':<18}{'pieces':>7}{'trace':>7}{'size':>12}  {'modified':<20} model")
    for e in entries:
        model = e.factors.get("factors", {}).get("model", "?")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.modified))
        print(f"{e.key:<18}{e.num_artifacts:>7}{'yes' if e.has_trace else 'no':>7}"
              f"{_human(e.size_bytes):>12}  {stamp:<20} {model}")
    total = sum(e.size_bytes for e in entries)
    inductor = _cache.inductor_cache_path(root)
    kernels = _cache._dir_size(inductor) if inductor.is_dir() else 0
    print(f"{len(entries)} entries, {_human(total)}; Inductor kernel cache {_human(kernels)}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = {e.key: e for e in _cache.list_entries(root)}
    wanted = args.key or list(entries)
    if not wanted:
        print(f"cache root: {root}: no entries")
        return 0
    _refuse_unknown([k for k in wanted if k not in entries], root, "")
    status = 0
    for key in wanted:
        entry = entries[key]
        index: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError, AttributeError):
            index = json.loads((entry.path / "index.json").read_text()).get("artifacts", {})
        print(f"entry {entry.key}  ({entry.path})")
        print(f"  size: {_human(entry.size_bytes)}; saved trace: "
              f"{'yes' if entry.has_trace else 'no'}")
        print("  key factors:")
        for line in json.dumps(entry.factors, indent=2, sort_keys=True,
                               default=repr).splitlines():
            print(f"    {line}")
        print(f"  artifacts ({len(index)}):")
        for name, rec in sorted(index.items()):
            print(f"    {name}: {rec.get('bytes', '?')} bytes, compiler={rec.get('compiler')}")
    return status


def _refuse_unknown(unknown: list[str], root: Path, consequence: str) -> None:
    if unknown:
        raise ConfigError(
            f"no cache entr{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(map(repr, unknown))} under {root}{consequence} (see `freezeframe "
            "cache list` for the keys)")


def _cmd_clear(args: argparse.Namespace) -> int:
    root = _root(args)
    if not root.is_dir():
        print(f"cache root {root} does not exist; nothing to clear")
        return 0
    keys = args.key or None
    if keys is not None:
        known = {e.key for e in _cache.list_entries(root)}
        _refuse_unknown([k for k in keys if k not in known], root, "; nothing was removed")
    what = (f"every entry under {root}" if keys is None
            else f"{len(keys)} entr{'y' if len(keys) == 1 else 'ies'} under {root}")
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(
                f"refusing to remove {what} without asking, and stdin is not a terminal to "
                "ask on; nothing was removed. Pass -y (--yes) to remove without asking")
        answer = input(f"remove {what}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    n = _cache.clear(root, keys)
    print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {root}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``cache`` with ``list``, ``info`` and ``clear`` to a subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "cache", help="list, inspect or clear the on-disk compile cache",
        description="Show and manage freezeframe's on-disk compile cache. The root is "
        f"--dir, else ${_cache.ENV_CACHE_DIR}, else <XDG cache dir>/freezeframe.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", help="cache root (default: the resolved cache root)")
    sub = parser.add_subparsers(dest="cache_command", required=True)
    p_list = sub.add_parser("list", parents=[common], help="one line per cache entry")
    p_list.set_defaults(func=_cmd_list)
    p_info = sub.add_parser("info", parents=[common], help="key factors and artifacts of entries")
    p_info.add_argument("key", nargs="*", help="entry keys (default: all)")
    p_info.set_defaults(func=_cmd_info)
    p_clear = sub.add_parser("clear", parents=[common], help="remove entries (default: all)")
    p_clear.add_argument("key", nargs="*", help="entry keys (default: all)")
    p_clear.add_argument("-y", "--yes", action="store_true", help="do not ask")
    p_clear.set_defaults(func=_cmd_clear)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``freezeframe ARGV`` (``python -m freezeframe.cache.cli cache list``), with
    the command line's one-line errors and exit codes."""
    from freezeframe.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
