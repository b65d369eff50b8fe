"""The saved compiled artifacts: one Inductor ``standalone_compile`` artifact per capturable
piece and per compile range or concrete size, so a warm start skips Inductor.

Holds :class:`PieceCache`, the ``cache=`` object of
:class:`~freezeframe.compilation.compilers.CompilerManager`: it finds a piece's artifact by the
piece's :func:`~freezeframe.cache.key.graph_hash`, turns a verified one into a runnable, and
saves what Inductor compiled. It does not hold the files (their header and checks are
:mod:`freezeframe.cache.files`'s, their names and the entry directory
:mod:`freezeframe.cache.entry`'s) or the saved trace.

Eager pieces have nothing worth saving (the "compiled" runnable is the FX graph itself), so the
cache stores no artifact for them and does not count them as hits or misses; only the saved
trace helps an eager model.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from freezeframe.cache.entry import CompileCache, range_bounds
from freezeframe.cache.key import graph_hash
from freezeframe.errors import CacheError, ConfigError

__all__ = ["ARTIFACT_FORMATS", "PieceCache", "choose_artifact_format", "isa_probe_record",
           "isa_probe_trusted", "prefetch_torch_key"]

logger = logging.getLogger(__name__)

ARTIFACT_FORMATS = ("auto", "aot", "standalone", "none")
"""What :func:`choose_artifact_format` accepts."""


def choose_artifact_format(requested: str = "auto", *, torch_module: Any = None) -> str | None:
    """How Inductor pieces are compiled and saved with this torch: the one place that decides.

    * ``"aot"``: ``torch._inductor.standalone_compile(..., aot=True)``, torch's bundled AOT
      artifact (``AOTCompiledArtifact``): a self-contained callable whose load needs neither
      Inductor's compile module nor its FX-graph cache (torch builds whose ``standalone_compile``
      takes ``aot``);
    * ``"standalone"``: ``standalone_compile`` without ``aot``: Inductor's cache artifacts
      (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` inside
      ``CompiledArtifact``), the fallback for torch builds without the AOT artifact;
    * ``None``: ``compile_fx``, nothing saved (torch without ``standalone_compile``, or
      ``"none"`` asked for).

    ``"auto"`` takes the first of these the installed torch has; naming a format forces it (the
    tests force the fallback this way), and one this torch lacks is a :class:`ConfigError`.
    ``torch_module`` stands in for ``torch`` (tests).
    """
    if requested not in ARTIFACT_FORMATS:
        raise ConfigError(f"artifact_format: {requested!r} is not one of {ARTIFACT_FORMATS}; "
                          "use 'auto' to let freezeframe pick what this torch has")
    if requested == "none":
        return None
    if torch_module is None:
        import torch as torch_module
    standalone = getattr(getattr(torch_module, "_inductor", None), "standalone_compile", None)
    has_aot = False
    if standalone is not None:
        try:
            has_aot = "aot" in inspect.signature(standalone).parameters
        except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
            has_aot = False
    if requested == "auto":
        return "aot" if has_aot else ("standalone" if standalone is not None else None)
    if standalone is None or (requested == "aot" and not has_aot):
        version = getattr(torch_module, "__version__", "?")
        raise ConfigError(f"artifact_format: {requested!r} needs torch._inductor."
                          f"standalone_compile{'(aot=True)' if requested == 'aot' else ''}, "
                          f"which torch {version} lacks; use 'auto'")
    return requested


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
    """Whether a piece's graph returns a tuple (what Inductor's compiled code returns as it is)
    rather than one value (which a loaded artifact returns as a 1-list). Read off the output
    node here, so loading an artifact does not import Inductor's compile module for it."""
    nodes = getattr(getattr(graph, "graph", None), "nodes", None)
    if nodes is None:
        return True
    out = next((n for n in reversed(nodes) if n.op == "output"), None)
    if out is None or not out.args:
        return True
    (value,) = out.args[:1]
    if isinstance(value, (list, tuple)):
        return True
    schema = getattr(getattr(value, "target", None), "_schema", None)
    returns = getattr(schema, "returns", ())
    return len(returns) > 1 and all(str(r.type) == "Tensor" for r in returns)


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


def isa_probe_record() -> dict[str, Any] | None:
    """Inductor's CPU vector-ISA probe as this process found it, with what its result depends
    on: the CPU's features (read with cpuid, no subprocess), the C++ compiler's version, and
    each ISA the probe accepted with its compiler flags. None off x86 (the probe is x86's
    only) or on a torch without these functions.

    The probe (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``) builds a small library with
    each ISA's flags and loads it in a child Python: about a second, paid by every process
    that loads a CPU artifact, because the ISA is part of each generated kernel's file name.
    """
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

        return {"cpu": list(cpu_vec_isa.x86_isa_checker()),
                "compiler": get_compiler_version_info(get_cpp_compiler()),
                "valid": [[str(isa), isa.build_arch_flags()]
                          for isa in cpu_vec_isa.valid_vec_isa_list()]}
    except Exception as exc:  # pragma: no cover - depends on the torch build and toolchain
        logger.debug("no record of the CPU ISA probe: %s: %s", type(exc).__name__, exc)
        return None


def isa_probe_trusted(record: Any) -> bool:
    """Whether a load may answer Inductor's ISA probe from ``record`` (:func:`isa_probe_record`
    of the process that compiled the artifact) instead of running it: this CPU has the same
    features, the compiler is the same version (torch is the same: the cache key says so), the
    user did not set ``cpp.vec_isa_ok`` themselves, and every ISA the record accepted is one
    these features allow, recorded with at least the flags this process starts from (the
    probe's sub-checks, AVX-512 BF16 and AMX-FP16, add flags to what it accepted). Then each
    build the probe would try has its answer in the record (see :func:`_answer_isa_probe`).
    Any doubt (no record, another torch layout) is False: the probe runs, as without a cache."""
    import platform

    if not isinstance(record, dict) or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor import cpu_vec_isa
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

        if inductor_config.cpp.vec_isa_ok is not None:
            return False
        cpu = list(cpu_vec_isa.x86_isa_checker())
        base = {str(isa): set(isa.build_arch_flags().split())
                for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in cpu for flag in str(isa).split())}
        valid = record.get("valid")
        if not isinstance(valid, list) or not all(
                isinstance(v, list) and len(v) == 2 and v[0] in base
                and base[v[0]] <= set(str(v[1]).split()) for v in valid):
            return False
        return (record.get("cpu") == cpu
                and record.get("compiler") == get_compiler_version_info(get_cpp_compiler()))
    except Exception as exc:  # pragma: no cover - depends on the torch build and toolchain
        logger.debug("the CPU ISA probe record cannot be checked: %s: %s",
                     type(exc).__name__, exc)
        return False


# Held while Inductor's per-process ISA answers are being filled from a record (one patch of
# VecISA.check_build at a time; see _answer_isa_probe)
_ISA_FILL_LOCK = threading.Lock()


def _answer_isa_probe(record: dict[str, Any]) -> None:
    """Fill Inductor's per-process answers about the CPU's vector ISAs from ``record``, so no
    probe library is built or loaded in this process.

    Inductor decides which ISAs work by building a small library per ISA and loading it in a
    child Python (``VecISA.check_build``), and, for ISAs that have them, a second and third
    build with extra flags (AVX-512 BF16, AMX, AMX-FP16); it keeps every answer for the rest of
    the process (``valid_vec_isa_list`` and each ISA's ``__bool__`` are cached). While that
    list is computed here, a build is answered from the record: it works when the record
    accepted this ISA with every flag the build asks for, which is what the probe found on this
    same CPU, compiler and torch (:func:`isa_probe_trusted`). The stand-in is installed under
    a lock for that one call and removed after it; a process whose list is already computed is
    left alone."""
    from torch._inductor import cpu_vec_isa

    accepted = {str(name): set(str(flags).split()) for name, flags in record["valid"]}

    def from_record(isa: Any, code: str) -> bool:
        flags = accepted.get(str(isa))
        return flags is not None and set(isa.build_arch_flags().split()) <= flags

    listing = cpu_vec_isa.valid_vec_isa_list
    with _ISA_FILL_LOCK:
        info = getattr(listing, "cache_info", None)
        if info is not None and info().currsize:
            return  # answered already in this process (by a probe or an earlier record)
        real = cpu_vec_isa.VecISA.check_build
        cpu_vec_isa.VecISA.check_build = from_record  # type: ignore[method-assign,assignment]
        try:
            listing()
        finally:
            cpu_vec_isa.VecISA.check_build = real  # type: ignore[method-assign]


def prefetch_torch_key() -> None:
    """Start computing ``torch_key`` (a hash of torch's own source files, which every artifact
    load compares with the one it was saved with: most of a second) in torch's background
    thread, so that it overlaps with loading the saved trace; a torch without the prefetch
    computes it on first use, as before."""
    try:
        from torch._inductor.codecache import torch_key

        prefetch = getattr(torch_key, "prefetch", None)
        if callable(prefetch):
            prefetch()
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logger.debug("torch_key cannot be prefetched: %s: %s", type(exc).__name__, exc)


class NamedCompiler(Protocol):
    """What the piece cache needs of a compiler: its name (``"inductor"``, ``"eager"``), part
    of every artifact's key (the compile stage's compilers have it)."""

    name: str


def _format_of(compiler: Any) -> str | None:
    """The artifact format a compiler writes (``InductorCompiler.artifact_format``)."""
    return getattr(compiler, "artifact_format", None) if compiler.name == "inductor" else None


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
        return _format_of(compiler) is not None and _compiled_artifact_class() is not None

    @staticmethod
    def _graph_key(compiler: NamedCompiler, graph: Any, example_inputs: Sequence[Any],
                   compile_range: Any) -> str:
        # the format joins the key: an artifact of the other format is a miss, never loaded
        return graph_hash(graph, example_inputs, [list(range_bounds(compile_range)),
                                                  compiler.name, _format_of(compiler)])

    def load(self, compiler: NamedCompiler, graph: Any, example_inputs: list[Any],
             compile_range: Any,
             piece_index: int) -> Callable[..., Any] | None:
        if not self._cacheable(compiler):
            return None
        gkey = self._graph_key(compiler, graph, example_inputs, compile_range)
        found = self.cache.load_artifact_with_header(piece_index, compile_range, gkey)
        if found is None:
            self.cache.record_miss()
            return None
        path, payload, header = found
        try:
            host = header.get("host")
            isa = host.get("isa") if isinstance(host, dict) else None
            if isinstance(isa, dict) and isa_probe_trusted(isa):
                _answer_isa_probe(isa)
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
                                     compiler=f"{compiler.name}:{_format_of(compiler)}",
                                     host={"isa": isa_probe_record()})
        except CacheError:
            raise
        except Exception as exc:  # e.g. a graph standalone_compile cannot serialise
            logger.warning("could not save the compiled piece %d for sizes %s to the cache "
                           "(%s: %s); the next start compiles it again", piece_index,
                           compile_range, type(exc).__name__, exc)
