"""One model's cache entry: its key, its compiled-piece files, its saved traces and its records.

Holds :class:`CompileCache`, which the compile path opens once per compiled model: it fixes the
entry's key from the base factors and the traced sources and code, loads and saves each piece's
artifact file, keeps the saved Dynamo traces (``trace.bin``) and the ``models/`` pointer to
them, and keeps the entry's informational records (``key_factors.json``, ``index.json``,
``usage.json``). It does not hold the files' format, the root, the lock or the private
directories (:mod:`freezeframe.cache.files`), what goes into the key
(:mod:`freezeframe.cache.key`), how a compiled piece is loaded or saved
(:mod:`freezeframe.cache.artifacts`), how saved traces are kept in ``trace.bin`` and found
through the pointer (:mod:`freezeframe.cache.saved_traces`), or what a saved trace holds and
when one is reused (:mod:`freezeframe.compilation.saved_trace`,
:mod:`freezeframe.compilation.cached_trace`).

A warm start should not pay for work a previous process already did. Two things are worth
keeping across processes:

* one compiled artifact per capturable piece and per compile range or concrete size (an
  Inductor ``standalone_compile`` artifact), so a warm start skips Inductor;
* the Dynamo trace itself (the FX graph plus how its inputs bind to the forward's arguments and
  the module's parameters), so a warm start can skip Dynamo too when everything the trace
  depended on is unchanged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freezeframe.cache.files import (
    _FACTORS_NAME,
    _INDEX_NAME,
    _TRACE_NAME,
    _USAGE_NAME,
    CACHE_FORMAT,
    _empty_inductor_dir,
    _flock,
    _private_inductor_dir,
    _read_verified,
    _remove_stale_temps,
    atomic_write,
    cache_enabled,
    discard_unloadable,
    ensure_cache_root,
    ensure_private_dir,
    inductor_cache_path,
    pack_artifact,
    resolve_cache_root,
)
from freezeframe.cache.inspect import (
    _index_artifacts,
    _read_factors,
    _read_json_object,
    _read_usage,
)
from freezeframe.cache.key import _sha, base_factors, hash_sources
from freezeframe.cache.saved_traces import (
    PointerEntry,
    SavedTrace,
    add_variant,
    fitting_variant,
    pointer_path,
    read_pointer,
    write_pointer,
)
from freezeframe.errors import CacheError
from freezeframe.sizes import Range

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from freezeframe.config import CompilationConfig
    from freezeframe.stats import Stats

__all__ = ["CompileCache", "SavedTrace", "artifact_name", "range_bounds"]

logger = logging.getLogger(__name__)


def range_bounds(compile_range: Range | tuple[int, int] | int) -> tuple[int, int]:
    """``(start, end)`` of a compile range, a pair, or one compile size."""
    if isinstance(compile_range, Range):
        return compile_range.start, compile_range.end
    if isinstance(compile_range, int):
        return compile_range, compile_range
    start, end = compile_range
    return int(start), int(end)


def artifact_name(piece_index: int, compile_range: Range | tuple[int, int] | int) -> str:
    start, end = range_bounds(compile_range)
    return f"piece_{piece_index}_range_{start}_{end}.bin"


class CompileCache:
    """The cache of one compiled model (one ``CompiledModel``).

    Lifecycle, driven by the compile path::

        cache = CompileCache.open(config, stats=model.stats, module=module, args=args,
                                  kwargs=kwargs, dynamic_arg_dims=dims, model_key=model_key)
        if cache is None: ...                      # cache off
        with cache.lock():                         # held for the whole first call
            saved = cache.load_trace(accept)       # SavedTrace or None (sources re-verified,
                                                   # then accept() checks values and code)
            if saved is None:
                ... Dynamo traces; inside the backend:
                cache.add_traced_files(traced_files_from_graph(gm))
                cache.add_traced_code(code objects without a source file)
                cache.save_trace(payload, checks=...)   # optional
            ... per piece and range: cache.load_artifact / cache.save_artifact
    """

    def __init__(self, root: Path, base_factors: Mapping[str, Any],
                 stats: Stats | None = None) -> None:
        self.root = root
        self.base_factors = dict(base_factors)
        self.base_key = _sha(self.base_factors)[:16]
        self.stats = stats
        self._traced_files: set[str] = set()
        self._sources: dict[str, str] | None = None  # frozen once the key is computed
        self._traced_code: dict[str, set[str]] = {}
        self._code: dict[str, list[str]] | None = None  # frozen with the sources
        self._inductor_active: Path | None = None  # inside inductor_dir(): the directory
        self._hits = 0  # piece lookups of this process (record_start adds them to usage.json)
        self._misses = 0
        self._factors_checked = False  # key_factors.json read (and written if need be) once
        ensure_cache_root(self.root)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        config: CompilationConfig,
        *,
        stats: Stats | None = None,
        module: torch.nn.Module | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None = None,
        model_key: str | None = None,
        extra_factors: Mapping[str, Any] | None = None,
        inductor_passes: Mapping[str, Any] | None = None,
    ) -> CompileCache | None:
        """The cache for one model, or None when the cache is switched off.

        ``inductor_passes`` identifies the config's Inductor passes for the key
        (:func:`~freezeframe.compilation.compilers.pass_sources` of
        :func:`~freezeframe.compilation.compilers.config_passes`): resolving a pass is the
        compile path's business, so the compile path passes it in.

        Raises :class:`CacheError` when the cache directory is not private or cannot be
        created.
        """
        if not cache_enabled(config):
            return None
        factors = base_factors(config, module, args, kwargs, dynamic_arg_dims, model_key,
                                extra_factors, inductor_passes)
        cache = cls(resolve_cache_root(config), factors, stats)
        cache._config_dict = config.to_dict()
        return cache

    _config_dict: dict[str, Any] | None = None

    # -- the key ---------------------------------------------------------------------------
    def add_traced_files(self, paths: Iterable[str]) -> None:
        """Record source files Dynamo traced; their contents join the key. Call before the first
        load/save of an artifact (the key is fixed then)."""
        new = {p for p in paths if p and not p.startswith("<")}
        if self._sources is not None and not new <= set(self._sources):
            raise CacheError(
                "traced files were added after the cache key was fixed; call "
                "cache.add_traced_files(...) before the first artifact is loaded or saved"
            )
        self._traced_files |= new

    def add_traced_code(self, digests: Mapping[str, Iterable[str]]) -> None:
        """Record the digests of traced code that has no source file to hash
        (``traced_code.code_digests``); they join the key. Same timing rule as
        :meth:`add_traced_files`."""
        if self._code is not None:
            if any(set(d) - set(self._code.get(name, ())) for name, d in digests.items()):
                raise CacheError(
                    "traced code was added after the cache key was fixed; call "
                    "cache.add_traced_code(...) before the first artifact is loaded or saved")
            return
        for name, found in digests.items():
            self._traced_code.setdefault(name, set()).update(found)

    @property
    def sources(self) -> dict[str, str]:
        if self._sources is None:
            self._sources = hash_sources(self._traced_files)
        return self._sources

    @property
    def code(self) -> dict[str, list[str]]:
        """``{qualified name: digests}`` of the traced code without a source file."""
        if self._code is None:
            self._code = {n: sorted(d) for n, d in sorted(self._traced_code.items())}
        return self._code

    @property
    def key(self) -> str:
        """The entry key: base factors + traced source contents (path-independent, so a cache
        copied to another checkout of the same code still hits) + the digests of traced code
        without a source file."""
        contents = sorted((os.path.basename(p), h) for p, h in self.sources.items())
        return _sha([self.base_key, contents, sorted(self.code.items())])[:16]

    @property
    def entry_dir(self) -> Path:
        return self.root / self.key

    def _entry(self) -> Path:
        entry = ensure_private_dir(self.entry_dir)
        _remove_stale_temps(entry)
        self._check_factors(entry)
        return entry

    def _check_factors(self, entry: Path) -> None:
        """Write the entry's ``key_factors.json`` when it is missing, and again when it is
        damaged (logged, counted in ``cache_files_damaged``); read once per instance."""
        if self._factors_checked:
            return
        path = entry / _FACTORS_NAME
        found, why = _read_factors(entry)
        if found is None:
            if why is not None:
                self._damaged(path, why, "writing it again")
            body = {
                "key": self.key,
                "base_key": self.base_key,
                "factors": self.base_factors,
                "sources": self.sources,
                "code": self.code,
                "config": self._config_dict,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write(path, json.dumps(body, indent=2, sort_keys=True, default=repr).encode())
        self._factors_checked = True

    def _damaged(self, path: Path, why: str, action: str) -> None:
        """Log and count a damaged informational file of this entry (``usage.json``,
        ``key_factors.json``): nothing is loaded from them, so they are rewritten, never
        trusted."""
        logger.warning("cache file %s is damaged (%s); %s", path, why, action)
        self._inc("cache_files_damaged")

    # -- locking ---------------------------------------------------------------------------
    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive per-model lock: hold it across tracing and compiling, so a second process
        starting the same model waits and then loads instead of compiling again."""
        try:
            locks = ensure_private_dir(self.root / "locks")
        except OSError as exc:
            logger.warning("cannot create %s (%s); compiling without the cross-process lock",
                           self.root / "locks", exc)
            return contextlib.nullcontext()
        return _flock(locks / f"{self.base_key}.lock", what=f"model {self.base_key}")

    def inductor_path(self) -> Path:
        return inductor_cache_path(self.root)

    def inductor_dir(self, active: bool = True) -> contextlib.AbstractContextManager[None]:
        """Point Inductor's own cache at :meth:`inductor_path` for the block.

        An artifact holds the generated code, but on CPU not the C++ kernels built from it; with
        Inductor's kernel cache kept beside the artifacts (not in a temporary directory another
        boot or container loses), a warm start reuses the built kernels instead of running the
        C++ compiler again. Uses torch's own scoped helper, which restores the environment.
        Inside the block :meth:`reset_inductor_dir` can empty it after a failure.
        """
        if not active:
            return contextlib.nullcontext()
        try:
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        except ImportError:  # pragma: no cover - older torch: Inductor keeps its default dir
            return contextlib.nullcontext()
        path = _private_inductor_dir(self.root)
        if path is None:
            return contextlib.nullcontext()
        return self._inductor_dir_active(path, temporary_cache_dir(str(path)))

    @contextlib.contextmanager
    def _inductor_dir_active(self, path: Path, scope: contextlib.AbstractContextManager[Any]
                             ) -> Iterator[None]:
        with scope:
            self._inductor_active = path
            try:
                yield
            finally:
                self._inductor_active = None

    def reset_inductor_dir(self, why: str) -> bool:
        """Empty Inductor's cache directory while it is in use (a file in it was damaged: a
        truncated kernel, random bytes), so the next compile writes it afresh. Counted in
        ``inductor_cache_resets``; False when no freezeframe-owned directory is in use."""
        path = self._inductor_active
        if path is None:
            return False
        logger.warning("Inductor's cache %s looks damaged (%s); emptying it and compiling "
                       "again", path, why)
        self._inc("inductor_cache_resets")
        _empty_inductor_dir(path)
        return True

    # -- counting --------------------------------------------------------------------------
    def _inc(self, name: str) -> None:
        if self.stats is not None:
            self.stats.inc(name)

    def record_hit(self) -> None:
        self._hits += 1
        self._inc("cache_hits")

    def record_miss(self) -> None:
        self._misses += 1
        self._inc("cache_misses")

    def record_start(self, *, trace_loaded: bool) -> None:
        """Add this start's piece hits and misses to the entry's ``usage.json`` (for
        ``freezeframe cache list``): starts, starts that loaded the saved trace, hits, misses,
        last use. Only an entry that exists is updated; a failure is logged, never raised.
        A damaged ``usage.json`` or ``key_factors.json`` (not JSON, or JSON of another kind) is
        logged, counted in ``cache_files_damaged`` and written again."""
        path = self.entry_dir / _USAGE_NAME
        if not self.entry_dir.is_dir():
            return
        usage, why = _read_usage(self.entry_dir)
        if why is not None:
            self._damaged(path, why, "counting its starts again from this one")
        usage.update(starts=usage["starts"] + 1,
                     trace_loads=usage["trace_loads"] + int(trace_loaded),
                     hits=usage["hits"] + self._hits, misses=usage["misses"] + self._misses,
                     last_used=time.time())
        try:
            self._check_factors(self.entry_dir)
            atomic_write(path, json.dumps(usage, sort_keys=True).encode())
        except OSError as exc:
            logger.debug("could not record the cache usage in %s: %s", path, exc)

    # -- files -----------------------------------------------------------------------------
    def discard(self, path: Path, reason: str) -> None:
        """Remove an artifact that verified but failed to load (logged)."""
        discard_unloadable(path, reason)

    def load_artifact(self, piece_index: int, compile_range: Any,
                      graph_key: str | None = None) -> tuple[Path, bytes] | None:
        """The verified payload of one piece's artifact (and its path), or None.

        Does not count hits or misses: the caller does once it knows whether the payload
        turned into a runnable (:meth:`record_hit` / :meth:`record_miss`).
        """
        found = self.load_artifact_with_header(piece_index, compile_range, graph_key)
        return None if found is None else (found[0], found[1])

    def load_artifact_with_header(self, piece_index: int, compile_range: Any,
                                  graph_key: str | None = None
                                  ) -> tuple[Path, bytes, dict[str, Any]] | None:
        """:meth:`load_artifact` with the artifact's header (what :meth:`save_artifact` wrote:
        piece, range, graph, compiler and its ``host`` record)."""
        path = self.entry_dir / artifact_name(piece_index, compile_range)
        found = _read_verified(path)
        if found is None:
            return None
        header, payload = found
        if graph_key is not None and header.get("graph") != graph_key:
            logger.info("cache artifact %s was compiled from another graph; recompiling", path)
            return None
        self._inc("artifacts_loaded")
        return path, payload, header

    def save_artifact(self, piece_index: int, compile_range: Any, payload: bytes, *,
                      graph_key: str | None = None, compiler: str = "",
                      host: Mapping[str, Any] | None = None) -> Path:
        """Write one piece's artifact atomically and list it in the index. ``host`` is plain
        data about the process that compiled it, kept in the header (the piece cache records
        Inductor's CPU vector-ISA probe there)."""
        entry = self._entry()
        start, end = range_bounds(compile_range)
        name = artifact_name(piece_index, compile_range)
        meta: dict[str, Any] = {"piece": piece_index, "range": [start, end],
                                "graph": graph_key, "compiler": compiler}
        if host is not None:
            meta["host"] = dict(host)
        atomic_write(entry / name, pack_artifact(payload, meta))
        self._update_index(name, {**meta, "bytes": len(payload)})
        self._inc("artifacts_saved")
        logger.debug("saved cache artifact %s (%d bytes)", entry / name, len(payload))
        return entry / name

    def _update_index(self, name: str, record: Mapping[str, Any]) -> None:
        # Informational only (``freezeframe cache info``): loads trust the self-checking files.
        # Callers hold lock() during compilation, so read-modify-write does not lose entries.
        index_path = self.entry_dir / _INDEX_NAME
        loaded, _ = _read_json_object(index_path)
        index: dict[str, Any] = {"format": CACHE_FORMAT, "artifacts": {}}
        if loaded is not None and _index_artifacts(loaded) is not None:  # a damaged one is
            index = loaded                                                 # written afresh
        index["artifacts"][name] = dict(record)
        atomic_write(index_path, json.dumps(index, indent=2, sort_keys=True).encode())

    # -- the saved trace (kept per set of checked values: cache/saved_traces.py) -------------
    def save_trace(self, payload: bytes, meta: Mapping[str, Any] | None = None,
                   checks: Sequence[Sequence[Any]] = ()) -> Path:
        """Save the Dynamo trace of this model (with the checks a reuse must pass, as rows of
        plain values) beside the variants already saved for this entry, and point
        ``models/<base key>.json`` at it."""
        path = self._entry() / _TRACE_NAME
        add_variant(path, payload, meta, checks)
        write_pointer(self.root, self.base_key, PointerEntry(self.key, self.sources, self.code))
        self._inc("artifacts_saved")
        return path

    def load_trace(self, accept: Callable[[SavedTrace], str | None] | None = None
                   ) -> SavedTrace | None:
        """A saved trace for this model whose recorded source files are unchanged and which
        ``accept`` takes (it returns None, or why the trace does not fit: a checked value or
        code without a source file differs, the call's inputs do not fit).

        On success the recorded sources and code become this cache's (the key is fixed). When
        saved traces exist but none is taken, logs why, counts ``saved_trace_rejected`` and
        returns None: the caller traces with Dynamo as usual. ``accept`` raises
        :class:`~freezeframe.cache.files.CorruptArtifactError` for a trace that cannot be read;
        its file is removed.
        """
        reasons: list[str] = []
        for pointed in read_pointer(pointer_path(self.root, self.base_key)):
            recorded = pointed.sources
            current = hash_sources(recorded)
            if current != recorded:
                changed = sorted(p for p in recorded if current.get(p) != recorded[p])
                reasons.append(f"entry {pointed.key}: traced sources changed "
                               f"({', '.join(changed[:5])})")
                continue
            if self._sources is not None and (recorded != self._sources
                                              or pointed.code != self.code):
                continue  # the key is fixed already and this entry is not it
            saved, rejected = fitting_variant(pointed, self.root / pointed.key / _TRACE_NAME,
                                              accept)
            reasons += rejected
            if saved is None:
                continue
            if self._sources is None:
                self._traced_files = set(recorded)
                self._sources = dict(recorded)
                self._traced_code = {n: set(d) for n, d in pointed.code.items()}
                self._code = dict(pointed.code)
            self._inc("artifacts_loaded")
            return saved
        if reasons:
            logger.info("a saved trace exists for model %s but does not fit, so Dynamo traces "
                        "again: %s", self.base_key, "; ".join(reasons[:4]))
            self._inc("saved_trace_rejected")
        return None

    def trace_path(self) -> Path:
        return self.entry_dir / _TRACE_NAME

