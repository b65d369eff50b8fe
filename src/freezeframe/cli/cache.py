"""``freezeframe cache list|info|clear|prewarm``: look at, manage and fill the on-disk compile
cache.

It imports nothing heavy, so ``freezeframe cache list`` starts fast (``prewarm`` imports torch
and the models, :mod:`freezeframe.models.prewarm`, when it runs). ``list`` and ``info`` show each
entry's size and what its starts found (piece hits and misses, from the entry's ``usage.json``).
An entry whose ``usage.json`` or ``key_factors.json`` is damaged is listed without it, marked,
and logged (the next start of its model writes it again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from freezeframe.cache import files as _files
from freezeframe.cache import inspect as _inspect
from freezeframe.cli.files import read_config_text
from freezeframe.errors import ConfigError

__all__ = ["add_parser"]


def _root(args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir).expanduser()
    return _files.resolve_cache_root(None)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _cmd_list(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = _inspect.list_entries(root)
    state = "off" if not _files.cache_enabled(None) else "on"
    print(f"cache root: {root} (cache {state} by environment)")
    if not entries:
        print("no entries")
        return 0
    print(f"{'key':<18}{'pieces':>7}{'trace':>7}{'size':>12}{'starts':>8}{'hits':>7}"
          f"{'misses':>8}  {'modified':<20} model")
    for e in entries:
        model = e.factors.get("factors", {}).get("model", "?")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.modified))
        u = e.usage
        damaged = f"  (damaged: {', '.join(e.damaged)})" if e.damaged else ""
        print(f"{e.key:<18}{e.num_artifacts:>7}{'yes' if e.has_trace else 'no':>7}"
              f"{_human(e.size_bytes):>12}{u.get('starts', 0):>8}{u.get('hits', 0):>7}"
              f"{u.get('misses', 0):>8}  {stamp:<20} {model}{damaged}")
    total = sum(e.size_bytes for e in entries)
    inductor = _files.inductor_cache_path(root)
    kernels = _inspect.dir_size(inductor) if inductor.is_dir() else 0
    print(f"{len(entries)} entries, {_human(total)}; Inductor kernel cache {_human(kernels)}")
    damaged_entries = sum(1 for e in entries if e.damaged)
    if damaged_entries:
        print(f"{damaged_entries} of them with damaged files, shown empty; the next start of "
              "each model writes them again")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = {e.key: e for e in _inspect.list_entries(root)}
    wanted = args.key or list(entries)
    if not wanted:
        print(f"cache root: {root}: no entries")
        return 0
    _refuse_unknown([k for k in wanted if k not in entries], root, "")
    status = 0
    for key in wanted:
        entry = entries[key]
        index = _inspect.read_index(entry.path)
        print(f"entry {entry.key}  ({entry.path})")
        if entry.damaged:
            print(f"  damaged: {', '.join(entry.damaged)} (shown empty; the next start of the "
                  "model writes them again)")
        print(f"  size: {_human(entry.size_bytes)}; saved trace: "
              f"{'yes' if entry.has_trace else 'no'}")
        u = entry.usage
        print(f"  starts: {u.get('starts', 0)} ({u.get('trace_loads', 0)} loaded the saved "
              f"trace); piece hits: {u.get('hits', 0)}, misses: {u.get('misses', 0)}")
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
        known = {e.key for e in _inspect.list_entries(root)}
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
    n = _inspect.clear(root, keys)
    print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {root}")
    return 0


# -- prewarm ----------------------------------------------------------------------------------


def _cmd_prewarm(args: argparse.Namespace) -> int:
    import freezeframe as ff
    from freezeframe.models.prewarm import prewarm_spec

    try:
        data = json.loads(read_config_text(args.config)) if args.config else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config: not valid JSON ({exc}); give a JSON object, '-' or "
                          "@FILE") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(data).__name__}")
    if args.dir:
        data["cache_dir"] = str(Path(args.dir).expanduser())
    if data.get("use_cache") is False:
        raise ConfigError("config: use_cache is false, so there is no cache to fill; drop it")
    spec = prewarm_spec(args.model, layers=args.layers, device=args.device)
    if args.model == "example":
        data.setdefault("splitting_ops", ["freezeframe_example::mix"])
    else:
        data.setdefault("splitting_ops", ["freezeframe::attention"])
    data.setdefault("mode", "piecewise")
    cfg = ff.CompilationConfig.from_dict(data)
    if not _files.cache_enabled(cfg):
        raise ConfigError(f"the cache is off by environment ({_files.ENV_DISABLE_CACHE}); "
                          "unset it to prewarm")
    start = time.perf_counter()
    model = ff.compile(spec.module, cfg, dynamic_arg_dims=spec.dynamic_arg_dims)
    spec.first_call(model)
    elapsed = time.perf_counter() - start
    s = model.stats
    print(f"prewarmed {args.model} ({type(spec.module).__name__}) with backend {cfg.backend} "
          f"in {elapsed:.2f} s under {_files.resolve_cache_root(cfg)}")
    print(f"  pieces: {s.capturable_pieces} capturable, {s.distinct_pieces} distinct; "
          f"compiles: {s.inductor_compiles + s.eager_compiles}; piece hits: {s.cache_hits}, "
          f"misses: {s.cache_misses}; saved trace loaded: {'yes' if s.traces_loaded else 'no'}"
          f"; files saved: {s.artifacts_saved}")
    return 0


class _ModelChoices:
    """``prewarm --model``'s choices, :data:`freezeframe.models.prewarm.MODELS`, read only when
    argparse looks at them (a ``--model`` given, ``prewarm``'s help or usage): importing the
    models package imports torch, which ``cache list`` must not."""

    def _names(self) -> tuple[str, ...]:
        from freezeframe.models.prewarm import MODELS

        return MODELS

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``cache`` with ``list``, ``info``, ``clear`` and ``prewarm`` to a subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "cache", help="list, inspect or clear the on-disk compile cache",
        description="Show and manage freezeframe's on-disk compile cache. The root is "
        f"--dir, else ${_files.ENV_CACHE_DIR}, else <XDG cache dir>/freezeframe.",
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
    p_warm = sub.add_parser(
        "prewarm", parents=[common], help="fill the cache for a config and a built-in model",
        description="Compile a built-in model with a config and keep what it compiled, so "
        "that a later process starting the same model with the same config (a deployment "
        "baking its image) loads instead of compiling.")
    p_warm.add_argument("config", nargs="?", default="",
                        help="the compilation config: a JSON object, '-' (stdin) or @FILE "
                        "(default: {}); splitting_ops defaults to the model's splitting op")
    model = p_warm.add_argument("--model", default="tiny",
                                help="built-in model spec (default: tiny)")
    model.choices = _ModelChoices()  # set after add_argument, which would list them at once
    p_warm.add_argument("--layers", type=int, help="number of layers (default: the spec's)")
    p_warm.add_argument("--device", default="cpu", help="where the model lives (default: cpu)")
    p_warm.set_defaults(func=_cmd_prewarm)
    return parser
