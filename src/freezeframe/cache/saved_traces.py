"""A model's saved Dynamo traces on disk: an entry's ``trace.bin`` and the ``models/`` pointer.

Dynamo builds a trace's guards only after the backend has compiled (and looked up) every piece,
so the entry key, fixed by then, cannot hold the values the trace specialised on. Those values
select a *variant* inside the entry instead: ``trace.bin`` keeps one saved trace per distinct
set of checked values (newest first), so two instances of one class with different values each
warm-start from their own trace instead of replacing each other's. The pieces need no such
split: each artifact is checked against its piece's graph hash, whose generated code holds the
constants baked into it.

A start does not know its entry's key before it traces (the key holds the traced source files
and code), so ``models/<base key>.json`` lists the entries saved for a base key (newest first),
each with the source hashes and code digests it was traced from: a start whose sources still
hash the same finds its entry there without tracing.

Here a saved trace is a payload and rows of checks. Which entry a model's cache opens, its key
and its counters are :class:`freezeframe.cache.entry.CompileCache`'s; what a saved trace holds
and when one is reused are the compile path's (:mod:`freezeframe.compilation.saved_trace`,
:mod:`freezeframe.compilation.cached_trace`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from freezeframe.cache.files import (
    _KEY_RE,
    CorruptArtifactError,
    _read_verified,
    atomic_write,
    discard_unloadable,
    ensure_private_dir,
    pack_artifact,
)
from freezeframe.cache.key import _sha

__all__ = ["PointerEntry", "SavedTrace", "add_variant", "fitting_variant", "pointer_path",
           "read_pointer", "read_variants", "write_pointer"]

logger = logging.getLogger(__name__)

# How many source variants one model's pointer lists, and how many saved traces (one per set of
# checked values) one entry keeps; the oldest go first.
_MAX_POINTER_ENTRIES = 8
_MAX_TRACE_VARIANTS = 8


@dataclasses.dataclass(frozen=True)
class SavedTrace:
    """One saved trace as :meth:`~freezeframe.cache.entry.CompileCache.load_trace` offers it: the
    payload the compile path wrote, the checks a reuse must pass (as the rows it saved, which the
    cache does not read: :meth:`~freezeframe.compilation.guard_checks.ValueCheck.as_tuple`), and
    the digests of the traced code without a source file (to compare with the code the model
    runs now)."""

    key: str
    payload: bytes
    checks: tuple[tuple[Any, ...], ...]
    meta: dict[str, Any]
    code: dict[str, list[str]]


@dataclasses.dataclass(frozen=True)
class PointerEntry:
    """One entry a model's pointer lists: its key, the traced source files with their hashes
    when it was saved, and the digests of its traced code without a source file."""

    key: str
    sources: dict[str, str]
    code: dict[str, list[str]]


def pointer_path(root: Path, base_key: str) -> Path:
    """``models/<base key>.json`` under the cache root."""
    return root / "models" / f"{base_key}.json"


def read_pointer(path: Path) -> list[PointerEntry]:
    """The entries ``models/<base key>.json`` lists (newest first); [] when it is missing,
    and [] with a warning when it is unreadable."""
    try:
        entries = json.loads(path.read_text())["entries"]
        out = []
        for e in entries:
            key, sources, code = e["key"], dict(e["sources"]), dict(e["code"])
            if isinstance(key, str) and _KEY_RE.match(key):
                out.append(PointerEntry(key, sources, {str(n): sorted(map(str, d))
                                                       for n, d in code.items()}))
        return out
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("saved-trace pointer %s is unreadable (%s); tracing", path, exc)
        return []


def write_pointer(root: Path, base_key: str, mine: PointerEntry) -> None:
    """Put ``mine`` first in the model's pointer, the other entries after it (the oldest
    dropped past the limit)."""
    path = ensure_private_dir(root / "models") / f"{base_key}.json"
    others = [e for e in read_pointer(path) if e.key != mine.key]
    entries = [dataclasses.asdict(e) for e in [mine, *others][:_MAX_POINTER_ENTRIES]]
    atomic_write(path, json.dumps({"entries": entries}, indent=2, sort_keys=True).encode())


def read_variants(path: Path) -> list[dict[str, Any]]:
    """The saved traces ``trace.bin`` holds (newest first); [] when it is missing, and [] when
    it is corrupt or unreadable (logged and removed)."""
    found = _read_verified(path)
    if found is None:
        return []
    try:
        variants = pickle.loads(found[1])["variants"]
        if not isinstance(variants, list) or not all(
                isinstance(v, dict) and isinstance(v.get("payload"), bytes)
                and isinstance(v.get("checks"), list) for v in variants):
            raise TypeError("not a list of saved traces")
    except Exception as exc:
        discard_unloadable(path, f"unreadable saved traces: {type(exc).__name__}: {exc}")
        return []
    return variants


def add_variant(path: Path, payload: bytes, meta: Mapping[str, Any] | None,
                checks: Sequence[Sequence[Any]]) -> None:
    """Write ``trace.bin`` with this saved trace first: it replaces the one saved with the same
    checks, the others stay behind it (the oldest dropped past the limit)."""
    rows = [tuple(c) for c in checks]
    digest = _sha(rows)[:16]
    kept = [v for v in read_variants(path) if v.get("digest") != digest]
    variants = [{"digest": digest, "checks": rows, "payload": payload,
                 "meta": dict(meta or {})}, *kept][:_MAX_TRACE_VARIANTS]
    body = pickle.dumps({"variants": variants}, protocol=pickle.HIGHEST_PROTOCOL)
    atomic_write(path, pack_artifact(body, {"variants": len(variants)}))


def fitting_variant(entry: PointerEntry, path: Path,
                    accept: Callable[[SavedTrace], str | None] | None
                    ) -> tuple[SavedTrace | None, list[str]]:
    """The first saved trace in ``entry``'s ``trace.bin`` (at ``path``) that ``accept`` takes
    (it returns None, or why the trace does not fit), and why each one before it did not fit.

    A trace that cannot be read (rows of another layout, or ``accept`` raising
    :class:`~freezeframe.cache.files.CorruptArtifactError`) has its file removed, logged, and
    ends the search of this entry."""
    reasons: list[str] = []
    for variant in read_variants(path):
        try:
            saved = SavedTrace(
                key=entry.key, payload=variant["payload"],
                checks=tuple(tuple(row) for row in variant["checks"]),
                meta=dict(variant.get("meta") or {}), code=entry.code)
            why = accept(saved) if accept is not None else None
        except (TypeError, ValueError) as exc:  # rows of another layout
            discard_unloadable(path, f"unreadable saved trace: {exc}")
            break
        except CorruptArtifactError as exc:
            discard_unloadable(path, str(exc))
            break
        if why is not None:
            reasons.append(f"entry {entry.key}: {why}")
            continue
        return saved, reasons
    return None, reasons
