"""The saved compiled artifacts: one Inductor ``standalone_compile`` artifact per capturable
piece and per compile range or concrete size, so a warm start skips Inductor.

Holds :class:`PieceCache`, the ``cache=`` object of
:class:`~freezeframe.compilation.compilers.CompilerManager`: it finds a piece's artifact by the
piece's :func:`~freezeframe.cache.key.graph_hash`, turns a verified one into a runnable, and
saves what Inductor compiled. It does not hold the files (names, header, checks and entry
directory are :mod:`freezeframe.cache.store`'s) or the saved trace.

Eager pieces have nothing worth saving (the "compiled" runnable is the FX graph itself), so the
cache stores no artifact for them and does not count them as hits or misses; only the saved
trace helps an eager model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from freezeframe.cache.key import graph_hash
from freezeframe.cache.store import CompileCache, range_bounds
from freezeframe.errors import CacheError

__all__ = ["PieceCache"]

logger = logging.getLogger(__name__)


def _compiled_artifact_class() -> Any:
    """``CompiledArtifact`` of this torch (exported from ``torch._inductor`` in 2.13, found in
    ``torch._inductor.standalone_compile`` in older builds); None when torch has neither."""
    import torch

    cls = getattr(torch._inductor, "CompiledArtifact", None)
    if cls is None:
        with contextlib.suppress(ImportError):
            from torch._inductor.standalone_compile import CompiledArtifact as cls  # type: ignore
    return cls


def _returns_tuple(graph: Any) -> bool:
    try:
        from torch._inductor.compile_fx import graph_returns_tuple
    except ImportError:  # pragma: no cover
        return True
    return bool(graph_returns_tuple(graph))


class _SingleOutput:
    """A loaded artifact of a piece whose graph returns one value (not a tuple).

    ``standalone_compile`` compiles such a graph as if it returned a 1-tuple and unwraps the
    result itself, but an artifact loaded from disk returns the 1-list; unwrap it here so a
    loaded piece returns exactly what the freshly compiled one did. Only a list/tuple result is
    unwrapped, so a torch that fixes this upstream is not double-unwrapped.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        if isinstance(out, (list, tuple)) and len(out) == 1:
            return out[0]
        return out


class NamedCompiler(Protocol):
    """What the piece cache needs of a compiler: its name (``"inductor"``, ``"eager"``), part
    of every artifact's key (the compile stage's compilers have it)."""

    name: str


class PieceCache:
    """The ``cache=`` object of :class:`~freezeframe.compilation.compilers.CompilerManager`.

    Inductor pieces: ``load`` turns a verified artifact into a runnable without running
    Inductor, ``save`` writes the ``standalone_compile`` artifact. Eager pieces have nothing
    worth saving (the runnable is the FX graph), so they are neither looked up nor counted.
    Every failure here is a logged miss; the compile path then compiles as if uncached.
    """

    def __init__(self, cache: CompileCache) -> None:
        self.cache = cache

    @staticmethod
    def _cacheable(compiler: NamedCompiler) -> bool:
        return compiler.name == "inductor" and _compiled_artifact_class() \
            is not None

    @staticmethod
    def _graph_key(compiler: NamedCompiler, graph: Any, example_inputs: Sequence[Any],
                   compile_range: Any) -> str:
        return graph_hash(graph, example_inputs, [list(range_bounds(compile_range)),
                                                  compiler.name])

    def load(self, compiler: NamedCompiler, graph: Any, example_inputs: list[Any],
             compile_range: Any,
             piece_index: int) -> Callable[..., Any] | None:
        if not self._cacheable(compiler):
            return None
        gkey = self._graph_key(compiler, graph, example_inputs, compile_range)
        found = self.cache.load_artifact(piece_index, compile_range, gkey)
        if found is None:
            self.cache.record_miss()
            return None
        path, payload = found
        try:
            runnable = self._load_payload(payload, path.parent)
        except Exception as exc:  # any failure is a miss: torch key mismatch, unpickling, ...
            why = f"{type(exc).__name__}: {exc}"
            self.cache.discard(path, why)
            # The artifact verified, so what failed may be a file it reads from Inductor's
            # cache (a truncated kernel): compiling again on top of that file would fail too.
            self.cache.reset_inductor_dir(why)
            self.cache.record_miss()
            return None
        self.cache.record_hit()
        if not _returns_tuple(graph):
            runnable = _SingleOutput(runnable)
        return runnable

    @staticmethod
    def _load_payload(payload: bytes, where: Path) -> Callable[..., Any]:
        cls = _compiled_artifact_class()
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".load.", suffix=".bin")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
            return cls.load(path=tmp, format="binary")  # type: ignore[no-any-return]
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def recover(self, error: BaseException) -> bool:
        """After a failed compile: empty Inductor's cache directory if freezeframe's is in use
        (a damaged file there fails every compile that reads it); True when the compile is
        worth one more try."""
        return self.cache.reset_inductor_dir(f"a compile failed: {type(error).__name__}: "
                                             f"{str(error)[:300]}")

    def save(self, compiler: NamedCompiler, graph: Any, example_inputs: list[Any],
             compile_range: Any,
             piece_index: int, runnable: Callable[..., Any]) -> None:
        if not self._cacheable(compiler) or not callable(getattr(runnable, "save", None)):
            return
        gkey = self._graph_key(compiler, graph, example_inputs, compile_range)
        try:
            entry = self.cache._entry()
            fd, tmp = tempfile.mkstemp(dir=entry, prefix=".save.", suffix=".bin")
            os.close(fd)
            try:
                runnable.save(path=tmp, format="binary")  # type: ignore[attr-defined]
                payload = Path(tmp).read_bytes()
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self.cache.save_artifact(piece_index, compile_range, payload, graph_key=gkey,
                                     compiler=compiler.name)
        except CacheError:
            raise
        except Exception as exc:  # e.g. a graph standalone_compile cannot serialise
            logger.warning("could not save the compiled piece %d for sizes %s to the cache "
                           "(%s: %s); the next start compiles it again", piece_index,
                           compile_range, type(exc).__name__, exc)
