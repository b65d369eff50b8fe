"""Looking at the cache from outside a model: listing entries, their records, and clearing them.

Holds what ``freezeframe cache list|info|clear`` shows and does (:class:`CacheEntryInfo`,
:func:`list_entries`, :func:`read_usage`, :func:`read_index`, :func:`clear`) and the readers of
an entry's informational files (``key_factors.json``, ``usage.json``, ``index.json``), which
tell a damaged file (unreadable, not JSON, JSON of another kind) from a missing one. Nothing here
is loaded into a model: an entry is opened and filled by :mod:`freezeframe.cache.entry`, and the
files' layout and format are :mod:`freezeframe.cache.files`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from freezeframe.cache.files import (
    _FACTORS_NAME,
    _INDEX_NAME,
    _KEY_RE,
    _TRACE_NAME,
    _USAGE_NAME,
    atomic_write,
    check_private_dir,
    inductor_cache_path,
)

__all__ = ["CacheEntryInfo", "clear", "dir_size", "list_entries", "read_index", "read_usage"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CacheEntryInfo:
    """One entry directory, as ``freezeframe cache list/info`` shows it."""

    key: str
    path: Path
    size_bytes: int
    num_artifacts: int
    has_trace: bool
    modified: float
    factors: dict[str, Any]
    usage: dict[str, Any] = dataclasses.field(default_factory=dict)
    damaged: tuple[str, ...] = ()
    """The entry's informational files that are damaged (``key_factors.json``,
    ``usage.json``): shown as empty; the next start of the model writes them again."""


_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _read_json_object(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)`` for a file holding a JSON object; ``(None, None)`` when there is no
    file; ``(None, why)`` when it is damaged: unreadable, not JSON, or JSON of another kind
    (``[]``, ``null``, ``7``), which no file the cache writes holds."""
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"unreadable: {exc}"
    except ValueError as exc:  # not JSON, or not UTF-8
        return None, f"not valid JSON: {exc}"
    if not isinstance(loaded, dict):
        kind = _JSON_KINDS.get(type(loaded), type(loaded).__name__)
        return None, f"it holds {kind}, not a JSON object"
    return loaded, None


def _read_factors(entry: Path) -> tuple[dict[str, Any] | None, str | None]:
    """An entry's ``key_factors.json`` as :func:`_read_json_object` reads it, damaged too
    when its ``factors`` is not an object."""
    found, why = _read_json_object(entry / _FACTORS_NAME)
    if found is not None and not isinstance(found.get("factors"), dict):
        return None, "its 'factors' is not a JSON object"
    return found, why


def _read_usage(entry: Path) -> tuple[dict[str, Any], str | None]:
    """An entry's usage counts (zeros when ``usage.json`` is missing or damaged) and why it is
    damaged, or None."""
    usage: dict[str, Any] = {"starts": 0, "trace_loads": 0, "hits": 0, "misses": 0,
                             "last_used": None}
    loaded, why = _read_json_object(entry / _USAGE_NAME)
    for name in ("starts", "trace_loads", "hits", "misses"):
        if loaded is not None and isinstance(loaded.get(name), int):
            usage[name] = loaded[name]
    if loaded is not None and isinstance(loaded.get("last_used"), (int, float)):
        usage["last_used"] = loaded["last_used"]
    return usage, why


def read_usage(entry: Path) -> dict[str, Any]:
    """An entry's ``usage.json`` (starts, trace loads, piece hits and misses, last use); zeros
    when it is missing or damaged."""
    return _read_usage(entry)[0]


def read_index(entry: Path) -> dict[str, dict[str, Any]]:
    """The artifacts an entry's ``index.json`` lists (name -> record); empty, with a warning,
    when it is damaged (it is informational: loads trust the self-checking files)."""
    found, why = _read_json_object(entry / _INDEX_NAME)
    artifacts = None if found is None else _index_artifacts(found)
    if found is not None and artifacts is None:
        why = "its 'artifacts' is not an object of records"
    if why is not None:
        logger.warning("cache file %s is damaged (%s); shown without it, and the next compile "
                       "into this entry writes it again", entry / _INDEX_NAME, why)
    return dict(artifacts or {})


def _index_artifacts(index: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The records an ``index.json`` object lists, or None when they are not records."""
    artifacts = index.get("artifacts")
    if isinstance(artifacts, dict) and all(isinstance(r, dict) for r in artifacts.values()):
        return artifacts
    return None


def dir_size(path: Path) -> int:
    """The bytes of every file under ``path`` (what cannot be read counts as nothing)."""
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


def list_entries(root: Path) -> list[CacheEntryInfo]:
    """Every entry under ``root``, newest first (nothing is created)."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        if not (child.is_dir() and _KEY_RE.match(child.name)):
            continue
        factors, factors_damage = _read_factors(child)
        usage, usage_damage = _read_usage(child)
        damaged = []
        for name, why in ((_FACTORS_NAME, factors_damage), (_USAGE_NAME, usage_damage)):
            if why is not None:
                damaged.append(name)
                logger.warning("cache file %s is damaged (%s); shown without it, and the next "
                               "start of its model writes it again (or `freezeframe cache clear "
                               "%s` removes the entry)", child / name, why, child.name)
        artifacts = [p for p in child.glob("piece_*.bin")]
        out.append(CacheEntryInfo(
            key=child.name, path=child, size_bytes=dir_size(child),
            num_artifacts=len(artifacts), has_trace=(child / _TRACE_NAME).exists(),
            modified=child.stat().st_mtime, factors=factors or {}, usage=usage,
            damaged=tuple(damaged),
        ))
    return sorted(out, key=lambda e: e.modified, reverse=True)


def clear(root: Path, keys: Sequence[str] | None = None,
          on_removed: Callable[[Path], None] | None = None) -> int:
    """Remove the given entries (all when ``keys`` is None) and pointers to them; returns the
    number of entries removed. A process loading at the same time sees a miss, never a crash."""
    if not root.is_dir():
        return 0
    check_private_dir(root)
    removed = 0
    wanted = None if keys is None else set(keys)
    for entry in list_entries(root):
        if wanted is not None and entry.key not in wanted:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += 1
        if on_removed is not None:
            on_removed(entry.path)
    if wanted is None:  # everything: Inductor's kernel cache kept for this root too
        shutil.rmtree(inductor_cache_path(root), ignore_errors=True)
    models = root / "models"
    if models.is_dir():
        for pointer in models.glob("*.json"):
            _drop_from_pointer(pointer, wanted)
    return removed


def _drop_from_pointer(pointer: Path, wanted: set[str] | None) -> None:
    """Remove the pointer's references to the ``wanted`` entries (all when None); a pointer
    left with none, or one that cannot be read, is deleted."""
    try:
        entries = json.loads(pointer.read_text())["entries"]
        kept = [e for e in entries if wanted is not None and e["key"] not in wanted]
    except (OSError, ValueError, KeyError, TypeError):
        kept = []
    try:
        if kept and len(kept) == len(entries):
            return
        if kept:
            atomic_write(pointer, json.dumps({"entries": kept}, indent=2,
                                             sort_keys=True).encode())
        else:
            pointer.unlink()
    except OSError:
        logger.warning("could not update the saved-trace pointer %s", pointer, exc_info=True)
