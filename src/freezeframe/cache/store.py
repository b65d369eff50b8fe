"""The on-disk compile cache.

A warm start should not pay for work a previous process already did. Two things are worth
keeping across processes:

* one compiled artifact per capturable piece and per compile range or concrete size (an
  Inductor ``standalone_compile`` artifact), so a warm start skips Inductor;
* the Dynamo trace itself (the FX graph plus how its inputs bind to the forward's arguments and
  the module's parameters), so a warm start can skip Dynamo too when everything the trace
  depended on is unchanged.

Layout (``<root>`` from :func:`resolve_cache_root`)::

    <root>/
      models/<base key>.json        the entries a model's traces produced (newest first), each
                                    with its source hashes and code digests
      locks/<base key>.lock         flock: one process compiles a model, the others wait, then load
      inductor/                     Inductor's own cache while freezeframe compiles or loads
                                    (built CPU kernels, so a warm start runs no C++ compiler)
      <key>/                        one entry per (base factors, traced sources and code)
        key_factors.json            every factor that went into the key, readable
        index.json                  this entry's artifacts (informational; files self-check)
        trace.bin                   the saved Dynamo traces (optional): one per set of values
                                    the trace specialised on, each with the checks it needs
        piece_<i>_range_<s>_<e>.bin one compiled piece for one compile range or size

What decides whether something saved is reused:

* The *base key* hashes what is known before tracing: the freezeframe version, the config's
  ``cache_key()``, the source files of the config's Inductor passes, torch's version and
  Inductor's system factors, the module's class, structure and public attributes, every
  parameter's and buffer's shape/dtype/device, the example-input signature (plain argument
  values included), and the user's optional ``model_key``.
* The entry *key* adds what the trace read, known only after a trace (or, on a warm start, from
  the ``models/`` pointer, re-verified before it is trusted): the contents of every source file
  Dynamo traced or inlined, and a digest of every traced code object that has no source file
  to hash (``python -c``, ``exec``, ``<stdin>``, a notebook cell): bytecode, constants (nested
  code included), names and flags (:func:`code_digest`). Such code is found again on a warm
  start from the module's classes, the forward's globals and the values below; code that
  cannot be found, or that changed, means no reuse.
* Every *value the trace specialised on*, taken from the guards Dynamo built for the trace:
  constants and attributes of any name (``self._k``, ``self.table['a']``, a dtype, a field of
  a plain object, an enum member, a function or builtin an attribute holds), globals of any
  module the trace read (``consts.SCALE``), dict keys, sequence lengths, types, whether a
  submodule has hooks, tensors that are not forward arguments (dtype, device, sizes,
  strides), and torch's global state (grad mode, inference mode, default dtype/device, autocast,
  deterministic algorithms, torch-function modes). Guards are built only after the pieces are
  compiled, so these values select a saved trace *inside* the entry (trace.bin keeps one per
  set of values) rather than the entry; pieces are safe regardless, since every artifact is
  checked against its piece's :func:`graph_hash` (the generated code holds the constants).
  A trace whose guards hold something another process cannot compare (an object compared by
  identity, a guard kind not handled here, a global Dynamo installed) is not saved at all.

Safety rules, because loading an artifact runs the code in it:

* directories are created ``0700`` and a directory that other users can write to, or that
  another user owns, is refused with :class:`~freezeframe.errors.CacheError`;
* every file is written to a temporary file in the same directory and renamed into place;
* every artifact carries its length and SHA-256 in a header; a short or altered file is logged,
  removed and treated as a miss (the piece is recompiled), never loaded;
* a per-model ``flock`` serialises concurrent processes, so the second one waits for the first
  and then loads what it saved instead of compiling the same thing again.

Eager pieces have nothing worth saving (the "compiled" runnable is the FX graph itself), so the
cache stores no artifact for them and does not count them as hits or misses; only the saved
trace helps an eager model.

Counters (``model.stats``): ``cache_hits`` / ``cache_misses`` count Inductor piece x range
lookups (a hit produced a runnable without Inductor; a miss, including a corrupt or unloadable
artifact, was compiled); ``artifacts_saved`` / ``artifacts_loaded`` count files written / read
and verified (pieces and the trace); ``traces_loaded`` is 1 when Dynamo did not run;
``saved_trace_rejected`` is 1 when a saved trace existed for the model but none fit (the
reasons are logged at INFO); ``traces_not_saved`` is 1 when the first call's trace could not be
saved (the reason is logged at INFO). ``backend_compilations`` counts a hit too, as vLLM does,
so it never depends on the cache state.

When no saved trace is used (Dynamo traces as usual): no pointer for this base key, a recorded
source file or code object changed or cannot be found, a value the trace specialised on
differs or cannot be evaluated, the trace file is damaged, or this call's inputs do not fit
the traced placeholders (dtype, rank, static sizes). A trace is not saved when a graph input
cannot be named from the traced frame, the forward returns something other than graph outputs
and constants, or a guard cannot be re-checked in another process. Like trace-once itself it
assumes a forward without Python side effects outside the graph (the values are re-checked
once, on the first call) and one trace for every batch size (symbolic-size guards are not
re-checked). A value the trace never read through a guard (Dynamo folds ``a is b`` on two
plain objects without guarding either identity) is not seen; ``model_key`` is the escape hatch.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import hashlib
import importlib
import inspect
import json
import logging
import os
import pickle
import platform
import re
import shutil
import stat
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freezeframe.errors import CacheError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from freezeframe.compilation.trace import TraceOnce
    from freezeframe.config import CompilationConfig
    from freezeframe.sizes import Range
    from freezeframe.stats import Stats

__all__ = [
    "ENV_CACHE_DIR",
    "ENV_DISABLE_CACHE",
    "CacheEntryInfo",
    "CompileCache",
    "CorruptArtifactError",
    "atomic_write",
    "cache_enabled",
    "check_private_dir",
    "ensure_private_dir",
    "graph_hash",
    "hash_sources",
    "input_signature",
    "list_entries",
    "module_signature",
    "pack_artifact",
    "resolve_cache_root",
    "torch_factors",
    "traced_files_from_graph",
    "unpack_artifact",
]

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "FREEZEFRAME_CACHE_DIR"
ENV_DISABLE_CACHE = "FREEZEFRAME_DISABLE_CACHE"

# Bumped whenever the on-disk layout or the artifact header changes, so old entries miss.
CACHE_FORMAT = 3
_MAGIC = b"FFCACHE1"
_HEADER_LEN_BYTES = 4
_TRACE_NAME = "trace.bin"
_FACTORS_NAME = "key_factors.json"
_INDEX_NAME = "index.json"
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
# How many source variants one model's pointer lists, and how many saved traces (one per set of
# checked values) one entry keeps; the oldest go first.
_MAX_POINTER_ENTRIES = 8
_MAX_TRACE_VARIANTS = 8


class CorruptArtifactError(CacheError):
    """An artifact file is truncated, altered or not ours; it must never be loaded."""


@dataclasses.dataclass(frozen=True)
class SavedTrace:
    """One saved trace as :meth:`CompileCache.load_trace` offers it: the payload the compile
    path wrote, the checks a reuse must pass, and the digests of the traced code without a
    source file (to compare with the code the model runs now)."""

    key: str
    payload: bytes
    checks: tuple[ValueCheck, ...]
    meta: dict[str, Any]
    code: dict[str, list[str]]


# ---------------------------------------------------------------------------------------------
# where the cache lives, and whether it is on
# ---------------------------------------------------------------------------------------------
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cache_enabled(config: CompilationConfig | None = None) -> bool:
    """The cache is on unless ``config.use_cache`` is False or ``FREEZEFRAME_DISABLE_CACHE=1``."""
    if _env_true(ENV_DISABLE_CACHE):
        return False
    return config is None or bool(config.use_cache)


def resolve_cache_root(config: CompilationConfig | None = None) -> Path:
    """``config.cache_dir``, else ``$FREEZEFRAME_CACHE_DIR``, else ``<user cache dir>/freezeframe``
    (``$XDG_CACHE_HOME`` or ``~/.cache``). Nothing is created here."""
    if config is not None and config.cache_dir:
        return Path(config.cache_dir).expanduser()
    env = os.environ.get(ENV_CACHE_DIR, "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "freezeframe"


def check_private_dir(path: Path) -> None:
    """Refuse a directory another user could plant code in.

    Loading a cached artifact imports and runs its code, so the cache directory must be owned by
    the current user and writable by nobody else.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CacheError(f"cache directory {path} cannot be inspected: {exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(
            f"cache path {path} is not a directory; point config.cache_dir or "
            f"{ENV_CACHE_DIR} at a directory, or turn the cache off (use_cache=False or "
            f"{ENV_DISABLE_CACHE}=1)"
        )
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # no POSIX ownership to check (Windows)
        return
    mode = stat.S_IMODE(st.st_mode)
    fix = (
        f"fix: run `chmod 700 {path}` (if it is yours), or choose a private directory with "
        f"config.cache_dir / {ENV_CACHE_DIR}, or turn the cache off (use_cache=False or "
        f"{ENV_DISABLE_CACHE}=1)"
    )
    if st.st_uid != getuid():
        raise CacheError(
            f"cache directory {path} is owned by uid {st.st_uid}, not by the current user "
            f"(uid {getuid()}); loading a cached artifact runs its code, so freezeframe only "
            f"uses a cache directory you own; {fix}"
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"cache directory {path} has mode {mode:#o}, which lets group or other users write "
            f"to it; loading a cached artifact runs its code, so freezeframe refuses a cache "
            f"directory other users can write to; {fix}"
        )


_TOOLCHAIN_SAFE = re.compile(r"[A-Za-z0-9_./+=,@%:-]+")


def _toolchain_safe(path: Path) -> bool:
    """Whether ``path`` can go on a C++ compiler's command line unquoted (Inductor builds
    kernels with a shell command that does not quote its paths)."""
    return bool(_TOOLCHAIN_SAFE.fullmatch(str(path)))


def inductor_cache_path(root: Path) -> Path:
    """Where Inductor's own cache lives for the cache root ``root``: ``<root>/inductor``, or,
    when that path holds characters the C++ toolchain cannot take on its command line (a
    space, a quote, non-ASCII), a private directory named after the root's hash under the
    temporary directory (``freezeframe-<uid>/inductor-<hash>``)."""
    own = root / "inductor"
    if _toolchain_safe(own):
        return own
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"freezeframe-{os.getuid()}" / f"inductor-{digest}"


def _forget_inductor_modules(path: Path) -> None:
    """Drop the modules Inductor loaded from ``path`` from its in-process code cache, so a
    rewritten file is imported again rather than served from memory."""
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:  # pragma: no cover
        return
    modules = getattr(PyCodeCache, "modules_no_attr", None) or getattr(PyCodeCache,
                                                                        "modules", None)
    if not isinstance(modules, dict):
        return
    prefix = str(path)
    for key, module in list(modules.items()):
        if str(getattr(module, "__file__", "")).startswith(prefix):
            modules.pop(key, None)


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if needed and check that it is private."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # another process won the race; it is checked below
            pass
        else:
            os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; be explicit
    check_private_dir(path)
    return path


# ---------------------------------------------------------------------------------------------
# atomic, self-checking files
# ---------------------------------------------------------------------------------------------
def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either the old file or the whole new one.

    The temporary file lives in the same directory, so ``os.replace`` is a rename within one
    file system (atomic on POSIX), and it is fsynced first so a crash cannot leave a renamed but
    empty file behind.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pack_artifact(payload: bytes, meta: Mapping[str, Any] | None = None) -> bytes:
    """``MAGIC | header length (4 bytes, big-endian) | JSON header | payload``; the header holds
    the payload's length and SHA-256 plus ``meta``."""
    header = dict(meta or {})
    header.update(
        format=CACHE_FORMAT, length=len(payload), sha256=hashlib.sha256(payload).hexdigest()
    )
    head = json.dumps(header, sort_keys=True).encode()
    return _MAGIC + len(head).to_bytes(_HEADER_LEN_BYTES, "big") + head + payload


def unpack_artifact(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """Inverse of :func:`pack_artifact`; raises :class:`CorruptArtifactError` on any mismatch."""
    start = len(_MAGIC) + _HEADER_LEN_BYTES
    if len(blob) < start or not blob.startswith(_MAGIC):
        raise CorruptArtifactError("missing freezeframe artifact header")
    head_len = int.from_bytes(blob[len(_MAGIC):start], "big")
    try:
        header = json.loads(blob[start:start + head_len].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptArtifactError("unreadable artifact header") from None
    if not isinstance(header, dict) or header.get("format") != CACHE_FORMAT:
        raise CorruptArtifactError("artifact header of another format")
    payload = blob[start + head_len:]
    if len(payload) != header.get("length"):
        raise CorruptArtifactError(
            f"artifact is {len(payload)} bytes long, its header says {header.get('length')} "
            "(truncated or appended to)"
        )
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CorruptArtifactError("artifact content does not match its SHA-256")
    return header, payload


# ---------------------------------------------------------------------------------------------
# key factors
# ---------------------------------------------------------------------------------------------
def _sha(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def torch_factors() -> dict[str, Any]:
    """torch's version and Inductor's system factors (device, CUDA/HIP and Triton versions).

    ``torch_key()`` (a hash of torch's own sources) is left out on purpose: it costs seconds,
    the version plus git revision identify a build, and Inductor's artifact loader checks
    ``torch_key`` itself (a mismatch fails the load, which the cache treats as a miss).
    """
    import torch

    factors: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_git": getattr(getattr(torch, "version", None), "git_version", None),
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "machine": platform.machine(),
    }
    try:  # torch 2.11-2.13 keep this in codecache; guard against it moving
        from torch._inductor.codecache import CacheBase

        system = CacheBase.get_system()
        factors["inductor_system"] = system.get("hash") if isinstance(system, dict) else system
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logger.debug("Inductor system factors unavailable: %s", exc)
        factors["inductor_system"] = None
    try:
        from torch._inductor import config as inductor_config

        portable = inductor_config.save_config_portable()
        # Only plain values: reprs of callables carry addresses and would change every process.
        factors["inductor_config"] = _sha(
            {k: v for k, v in sorted(portable.items())
             if isinstance(v, (bool, int, float, str, type(None)))}
        )[:16]
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logger.debug("Inductor config factors unavailable: %s", exc)
    return factors


def _primitive(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return all(_primitive(v) for v in value)
    return False


def _describe(value: Any) -> Any:
    """A stable description of a module attribute for the key: plain values as themselves,
    tensors by shape/dtype (a KV cache kept as a plain attribute), dataclasses by their fields,
    anything else by type only (its repr may hold an address)."""
    import torch

    if _primitive(value):
        return value
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype), value.device.type]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__qualname__,
                {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)}]
    return ["object", type(value).__qualname__]


def module_signature(module: torch.nn.Module) -> str:
    """A hash of what shapes the trace besides the source: each submodule's class and public
    attributes (``eps``, ``num_heads``, config dataclasses, plain tensor attributes...), and
    every parameter's and buffer's name, shape, dtype and device. Two instances of one class
    with different sizes get different keys."""
    items: list[Any] = []
    for name, sub in module.named_modules():
        attrs = {k: _describe(v) for k, v in sorted(vars(sub).items())
                 if not k.startswith("_")}
        items.append([name, type(sub).__module__, type(sub).__qualname__, attrs])
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        items.append([name, list(tensor.shape), str(tensor.dtype), tensor.device.type,
                      bool(tensor.requires_grad)])
    return _sha(items)[:16]


def input_signature(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None,
) -> list[Any]:
    """The example inputs as the trace sees them: dtype, device and shape of every tensor, the
    dynamic dims shown as ``"*"``, plain values as themselves, other objects by type."""
    import torch

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    dyn = dict(dynamic_arg_dims or {})
    out: list[Any] = []
    for name, value in bound.items():
        dims = dyn.get(name, ())
        dims_set = {dims} if isinstance(dims, int) else set(dims)
        if isinstance(value, torch.Tensor):
            rank = value.dim()
            dims_set = {d % rank for d in dims_set} if rank else set()
            shape = ["*" if i in dims_set else s for i, s in enumerate(value.shape)]
            out.append([name, "tensor", str(value.dtype), value.device.type, shape])
        elif _primitive(value):
            out.append([name, "value", value])
        else:
            out.append([name, "object", type(value).__qualname__])
    return out


def hash_sources(paths: Iterable[str]) -> dict[str, str]:
    """``{path: sha256 of its contents}`` for every real file among ``paths`` (``<string>``,
    ``<eval_with_key>`` and other pseudo files are skipped)."""
    out: dict[str, str] = {}
    for p in sorted(set(paths)):
        if not p or p.startswith("<"):
            continue
        try:
            with open(p, "rb") as fh:
                out[p] = hashlib.sha256(fh.read()).hexdigest()
        except OSError:
            logger.debug("traced file %s is not readable; left out of the cache key", p)
    return out


_STACK_FILE_RE = re.compile(r'File "([^"]+)", line \d+')


def traced_files_from_graph(gm: torch.fx.GraphModule | None = None) -> list[str]:
    """The source files a Dynamo trace read, for the cache key.

    Call it from inside the Dynamo backend: the active tracing context lists every code object
    Dynamo traced or inlined (``traced_code``, including helpers that left no node behind). The
    nodes' ``stack_trace`` metadata adds the user frames that produced nodes, which also covers
    torch builds whose context lacks ``traced_code``.
    """
    files: set[str] = set()
    try:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        for code in getattr(ctx, "traced_code", None) or ():
            files.add(code.co_filename)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logger.debug("tracing context unavailable: %s", exc)
    if gm is not None:
        for node in gm.graph.nodes:
            trace = node.meta.get("stack_trace") or ""
            files.update(_STACK_FILE_RE.findall(trace))
    return sorted(f for f in files if f and not f.startswith("<"))


def graph_hash(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               extra: Any = None) -> str:
    """A hash of one piece: its generated code plus the dtypes, shapes and strides of its example
    inputs. It is stored with the artifact and compared on load, so an artifact is never used for
    a graph it was not compiled from (e.g. the same class built with other sizes)."""
    import torch

    inputs: list[Any] = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            inputs.append([str(x.dtype), x.device.type, [str(s) for s in x.shape],
                           [str(s) for s in x.stride()]])
        else:
            inputs.append([type(x).__name__, str(x)])
    return _sha([gm.code, inputs, extra])[:32]


# ---------------------------------------------------------------------------------------------
# what a saved trace depends on besides its source files
# ---------------------------------------------------------------------------------------------
def _needs_code_digest(filename: str) -> bool:
    """True for code whose file cannot vouch for it: ``<stdin>``, ``<string>`` (``python -c``,
    ``exec``), FX's ``<eval_with_key>``, a notebook cell's file that is not on disk. Frozen
    standard-library modules (``<frozen ...>``) come with the Python build, which is a key
    factor of its own."""
    if filename.startswith("<frozen "):
        return False
    if not filename or filename.startswith("<"):
        return True
    return not (os.path.isfile(filename) and os.access(filename, os.R_OK))


def _const_text(value: Any) -> Any:
    if isinstance(value, types.CodeType):
        return ["code", code_digest(value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_const_text(v) for v in value]]
    if isinstance(value, frozenset):  # iteration order follows string hashing: sort
        return ["frozenset", sorted(json.dumps(_const_text(v)) for v in value)]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    return [type(value).__name__, repr(value)]


def code_digest(code: types.CodeType) -> str:
    """A digest of what a code object does, the same in every process for the same source: its
    bytecode, constants (nested functions and classes by their own digest), names, arguments,
    flags and exception table. File name and line numbers are left out, so moving code without
    changing it keeps the digest."""
    parts = [
        getattr(code, "co_qualname", code.co_name), code.co_code.hex(),
        [_const_text(c) for c in code.co_consts], code.co_names, code.co_varnames,
        code.co_freevars, code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
        code.co_kwonlyargcount, code.co_flags,
        getattr(code, "co_exceptiontable", b"").hex(),
    ]
    return _sha(parts)[:32]


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested_code(const)


def code_digests(codes: Iterable[types.CodeType]) -> dict[str, list[str]]:
    """``{qualified name: sorted digests}`` of the code objects among ``codes`` (and the code
    nested in them) that have no source file to hash (:func:`_needs_code_digest`)."""
    found: dict[str, set[str]] = {}
    for outer in codes:
        if not _needs_code_digest(outer.co_filename):
            continue
        for code in _nested_code(outer):
            name = getattr(code, "co_qualname", code.co_name)
            found.setdefault(name, set()).add(code_digest(code))
    return {name: sorted(d) for name, d in sorted(found.items())}


def _traced_code() -> list[types.CodeType]:
    """Every code object the active Dynamo trace traced or inlined, the traced frame first
    (empty outside a backend, or on a torch without ``traced_code``)."""
    try:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        return list(getattr(ctx, "traced_code", None) or ())
    except Exception as exc:  # pragma: no cover - depends on the torch build
        logger.debug("tracing context unavailable: %s", exc)
        return []


def _live_code_digests(roots: Iterable[Any]) -> dict[str, set[str]]:
    """``{qualified name: digests}`` of the code without a source file that ``roots`` reach: a
    root's class and its bases (methods, properties, static and class methods), a function's
    code, nested code, closure cells and, for a function without a source file, the functions
    and classes of its globals (a helper defined beside a ``python -c`` model)."""
    found: dict[str, set[str]] = {}
    seen: set[int] = set()
    unsourced: dict[str, bool] = {}  # file name -> _needs_code_digest, asked once per file
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.MethodType | staticmethod | classmethod):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            if code.co_filename not in unsourced:
                unsourced[code.co_filename] = _needs_code_digest(code.co_filename)
            if not unsourced[code.co_filename]:
                continue
            for inner in _nested_code(code):
                name = getattr(inner, "co_qualname", inner.co_name)
                found.setdefault(name, set()).add(code_digest(inner))
            stack.extend(c.cell_contents for c in obj.__closure__ or ()
                         if _has_contents(c))
            if id(obj.__globals__) not in seen:
                seen.add(id(obj.__globals__))
                stack.extend(v for v in list(obj.__globals__.values())
                             if isinstance(v, type | types.FunctionType))
        elif isinstance(obj, type):
            for klass in obj.__mro__:
                if klass.__module__ != "builtins" and klass is not obj:
                    stack.append(klass)
            stack.extend(v for v in list(vars(obj).values())
                         if isinstance(v, type | types.FunctionType | staticmethod
                                       | classmethod | property))
        elif not isinstance(obj, types.ModuleType):
            stack.append(type(obj))
    return found


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _code_mismatch(recorded: Mapping[str, Sequence[str]], roots: Iterable[Any]) -> str | None:
    """Why the live code does not match the digests recorded with a trace, or None. Each
    recorded name must be found, and every live code object of that name must have a recorded
    digest (two definitions of one name that differ cannot be told apart, so they do not match).
    """
    if not recorded:
        return None
    live = _live_code_digests(roots)
    for name, digests in recorded.items():
        now = live.get(name)
        if not now:
            return f"the code of {name} (no source file) cannot be found to compare"
        if now != set(digests):
            return f"the code of {name} (no source file) changed"
    return None


_IMPORT_ALIAS = "__import_"
# Dynamo names the globals it installs ``<prefix>_<n>`` with a dunder prefix; the numbers differ
# between processes.
_INSTALLED_RE = re.compile(r"^__\w*_\d+$")


class _GlobalScope:
    """``G`` in a guard's or a graph input's source: the traced frame's globals, read live.

    Dynamo adds ``__import_<module>`` aliases to those globals while it traces (the globals of a
    function it inlined from another module) and ``__builtins_dict___<n>`` (the frame's
    builtins); a process that did not run Dynamo lacks them, so they are resolved to what they
    name, in every process alike. Any other global Dynamo installed (``<prefix>_<n>``) is
    refused, at save and at load alike, so a trace that needs one is never saved.
    """

    __slots__ = ("_globals",)

    def __init__(self, globals_: Mapping[str, Any]) -> None:
        self._globals = globals_

    def __getitem__(self, name: str) -> Any:
        if name.startswith(_IMPORT_ALIAS):
            module = name[len(_IMPORT_ALIAS):].replace("_dot_", ".")
            return sys.modules.get(module) or importlib.import_module(module)
        if _INSTALLED_RE.match(name):
            if name.startswith("__builtins_dict__"):  # the frame's builtins, as a dict
                found = self._globals.get("__builtins__", builtins)
                return found if isinstance(found, dict) else vars(found)
            raise KeyError(f"{name} is a global Dynamo installed while tracing (a process "
                           "that did not trace lacks it)")
        return self._globals[name]


def _wrapped_frame_code() -> types.CodeType | None:
    """The code of the frame ``torch.compile`` puts around a callable it cannot trace as it is
    (a bound method whose function has no source file); None on a torch without it."""
    try:
        from torch._dynamo.external_utils import wrap_inline
    except ImportError:  # pragma: no cover - depends on the torch build
        return None
    return wrap_inline(len).__code__  # type: ignore[no-any-return]


class _Frame:
    """The frame Dynamo traced, rebuilt without Dynamo, so the sources its guards and graph
    inputs name (``L['x']``, ``L['self'].scale``, ``G['consts'].SCALE``) can be evaluated.

    ``kind`` is ``"forward"`` (the module's forward itself: ``L`` holds its arguments at entry,
    defaults applied) or ``"wrapped"`` (``torch.compile``'s wrapper around a forward without a
    source file: ``L`` holds ``args``, ``kwargs`` and ``fn``, the bound forward). Functions made
    by :meth:`function` take the module followed by the call's arguments.
    """

    def __init__(self, module: Any, kind: str) -> None:
        func: Any = module.forward.__func__
        self.kind = kind
        self.module = module
        if kind == "forward":
            params = _parameter_list(func.__code__)
            names = [p.lstrip("*") for p in params if p not in ("/", "*")]
            self._head = ", ".join(params)
            self._locals = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
            self.argument_roots = frozenset(names[1:])
            self._defaults = (func.__defaults__, func.__kwdefaults__)
            globals_ = func.__globals__
        elif kind == "wrapped":
            self._head = "_ff_self, *args, **kwargs"
            self._locals = "{'args': args, 'kwargs': kwargs, 'fn': _ff_fn}"
            self.argument_roots = frozenset({"args", "kwargs"})
            self._defaults = (None, None)
            code = _wrapped_frame_code()
            if code is None:  # pragma: no cover - depends on the torch build
                raise CacheError("this torch has no wrapper frame to rebuild")
            from torch._dynamo import external_utils

            globals_ = vars(external_utils)
        else:
            raise CacheError(f"unknown traced frame kind {kind!r}")
        self.globals = _GlobalScope(globals_)

    def function(self, body: str) -> Callable[..., Any]:
        """``def f(<frame parameters>): L = <frame locals>; return <body>``, compiled."""
        text = f"def _f({self._head}):\n    L = {self._locals}\n    return {body}\n"
        namespace: dict[str, Any] = {"G": self.globals, "_ff_fn": self.module.forward,
                                     "__builtins__": {}}
        exec(compile(text, "<freezeframe saved trace>", "exec"), namespace)
        fn = namespace["_f"]
        fn.__defaults__, fn.__kwdefaults__ = self._defaults
        return fn  # type: ignore[no-any-return]

    def locals_at_entry(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return self.function("L")(self.module, *args, **kwargs)  # type: ignore[no-any-return]


def _parameter_list(code: types.CodeType) -> list[str]:
    """A code object's parameters as a ``def`` writes them (``/``, ``*``, ``*args``, ...)."""
    nargs = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:nargs])
    params = names[: code.co_argcount]
    if code.co_posonlyargcount:
        params.insert(code.co_posonlyargcount, "/")
    if code.co_flags & inspect.CO_VARARGS:
        params.append("*" + code.co_varnames[nargs])
    elif code.co_kwonlyargcount:
        params.append("*")
    params.extend(names[code.co_argcount:])
    if code.co_flags & inspect.CO_VARKEYWORDS:
        params.append("**" + code.co_varnames[nargs + (1 if code.co_flags &
                                                        inspect.CO_VARARGS else 0)])
    return params


class _CannotCheck(Exception):
    """A guard whose condition cannot be re-checked in another process."""


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"


def _encode(value: Any) -> Any:
    """A value as plain data that compares equal in another process exactly when the value is
    the same: primitives with their type, containers element-wise, dtypes and devices by name,
    enum members, classes, modules and builtins by their qualified name, functions by name and
    code digest. Anything else (an arbitrary object compared by identity) raises
    :class:`_CannotCheck`."""
    import torch

    kind = type(value)
    if value is None:
        return ["none"]
    if kind in (bool, int, str):
        return [kind.__name__, value]
    if kind in (float, complex):
        return [kind.__name__, repr(value)]  # keeps nan, inf and -0.0 apart
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is types.CodeType:
        return ["code", code_digest(value)]
    if kind in (tuple, list, torch.Size):
        return [kind.__name__, [_encode(v) for v in value]]
    if kind in (set, frozenset):
        return [kind.__name__, sorted(json.dumps(_encode(v)) for v in value)]
    if isinstance(value, torch.dtype | torch.device):
        return [kind.__name__, str(value)]
    if isinstance(value, enum.Enum):
        return ["enum", _qualified(kind), value.name]
    if isinstance(value, type):
        return ["class", _qualified(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, types.FunctionType):
        return ["function", _qualified(value), code_digest(value.__code__)]
    if isinstance(value, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        return ["op", str(value)]
    if isinstance(value, types.BuiltinFunctionType | types.MethodDescriptorType
                  | types.WrapperDescriptorType | types.ClassMethodDescriptorType):
        owner = getattr(value, "__self__", None)
        if owner is None or isinstance(owner, type | types.ModuleType):
            return ["builtin", _qualified(owner) if isinstance(owner, type) else
                    getattr(owner, "__name__", None), _qualified(value)]
    raise _CannotCheck(f"a {_qualified(kind)} compared by identity")


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """One thing a trace specialised on, re-checked before its saved trace is reused.

    ``source`` is the guard's source expression (``L['self']._k``, ``G['consts'].SCALE``,
    ``L['n']``), evaluated in the rebuilt traced frame (:class:`_Frame`); ``kind`` says what is
    compared with ``expected`` (plain data, :func:`_encode`): ``value`` (the encoded value),
    ``type`` (its class), ``len``, ``keys`` (a dict's keys in order), ``contains`` (whether
    ``arg`` is a key), ``hasattr`` (whether attribute ``arg`` exists), ``in_dict`` (whether
    ``arg`` is in the object's instance dict), ``same`` (whether it is the object ``arg``
    names), ``not_none``, ``tensor`` (dtype, device, sizes, strides of a tensor that is not a
    forward argument) and ``state`` (a global torch setting named by ``source``). ``guard`` is
    Dynamo's guard kind it came from, for logs.
    """

    kind: str
    source: str
    expected: Any
    arg: Any = None
    guard: str = ""

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.kind, self.source, self.expected, self.arg, self.guard)


# Dynamo guard kinds, by what the saved trace does with them.
_VALUE_GUARDS = frozenset({
    "CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH", "ID_MATCH", "CLASS_MATCH",
    "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "CONSTANT_SUBCLASS_MATCH",
})
# Global torch state with no source: each is replaced by the settings _STATE records.
_STATE_GUARDS = frozenset({
    "GRAD_MODE", "GLOBAL_STATE", "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE",
    "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS",
})
# Symbolic-size guards: trace-once drops them on purpose (one trace serves every batch size);
# the fit check (:func:`_first_mismatch`) re-checks dtype, rank and every static size.
_SIZE_GUARDS = frozenset({"SHAPE_ENV"})


def _torch_state() -> dict[str, Callable[[], Any]]:
    import torch

    return {
        "grad_enabled": torch.is_grad_enabled,
        "inference_mode": torch.is_inference_mode_enabled,
        "default_dtype": lambda: str(torch.get_default_dtype()),
        "default_device": lambda: str(torch.get_default_device()),
        "deterministic": torch.are_deterministic_algorithms_enabled,
        "autocast_cpu": lambda: torch.is_autocast_enabled("cpu"),
        "autocast_cuda": lambda: torch.is_autocast_enabled("cuda"),
        "torch_function": torch._C._is_torch_function_enabled,
        "function_modes": lambda: len(torch.overrides._get_current_function_mode_stack()),
        "saved_tensor_hooks": lambda: torch._C._autograd._top_saved_tensors_default_hooks(
            False) is not None,
    }


def _guard_keyword(entry: Any, name: str) -> Any:
    create = getattr(getattr(entry, "orig_guard", None), "create_fn", None)
    keywords = getattr(create, "keywords", None) or {}
    if name not in keywords:
        raise _CannotCheck(f"{entry.guard_type} guard on {entry.name} without its {name!r}")
    return keywords[name]


def _source_text(source: Any) -> str:
    name = source.name  # a property in torch 2.13, a method in older builds
    return str(name() if callable(name) else name)


def value_checks(entries: Sequence[Any], frame: _Frame) -> list[ValueCheck]:
    """The checks a saved trace needs, from the guards Dynamo built for the trace.

    Raises :class:`_CannotCheck` for a guard that cannot be re-checked in another process (an
    object compared by identity, a guard kind not handled here): such a trace is not saved.
    """
    import torch

    checks: dict[tuple[Any, ...], ValueCheck] = {}

    def add(check: ValueCheck) -> None:
        checks.setdefault((check.kind, check.source, repr(check.arg)), check)

    for entry in entries:
        kind = entry.guard_type
        guard = getattr(entry, "orig_guard", None)
        source = str(getattr(guard, "name", "") or entry.name)
        if kind in _STATE_GUARDS or kind in _SIZE_GUARDS:
            continue
        if kind == "TENSOR_MATCH":
            root = re.match(r"^L\[['\"]([^'\"]+)['\"]\]", source)
            if root is not None and root.group(1) in frame.argument_roots:
                continue  # a forward argument: the fit check compares it with the placeholders
            value = entry.value
            if not isinstance(value, torch.Tensor):
                raise _CannotCheck(f"TENSOR_MATCH guard on {source} holds no tensor")
            add(ValueCheck("tensor", source, _tensor_meta(value), guard=kind))
            continue
        if kind in _VALUE_GUARDS:
            add(ValueCheck("value", source, _encode(_entry_value(entry)), guard=kind))
        elif kind == "TYPE_MATCH":
            add(ValueCheck("type", source, _qualified(type(_entry_value(entry))), guard=kind))
        elif kind in ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"):
            value = _entry_value(entry)
            add(ValueCheck("type", source, _qualified(type(value)), guard=kind))
            add(ValueCheck("len", source, len(value), guard=kind))
        elif kind in ("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK"):
            add(ValueCheck("keys", source, [_encode(k) for k in _entry_value(entry)],
                           guard=kind))
        elif kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS",
                      "SET_NOT_CONTAINS"):
            key = _guard_keyword(entry, "key")
            _encode(key)  # a key that cannot be written down cannot be checked
            add(ValueCheck("contains", source, "NOT" not in kind, arg=key, guard=kind))
        elif kind == "HASATTR":
            attr = _guard_keyword(entry, "attr")
            if not source.endswith("." + attr):
                raise _CannotCheck(f"HASATTR guard on {source} for attribute {attr!r}")
            add(ValueCheck("hasattr", source[: -len(attr) - 1], bool(entry.has_value),
                           arg=attr, guard=kind))
        elif kind == "NOT_PRESENT_IN_GENERIC_DICT":
            add(ValueCheck("in_dict", source, False, arg=_guard_keyword(entry, "attr"),
                           guard=kind))
        elif kind == "DUPLICATE_INPUT":
            other = _source_text(_guard_keyword(entry, "source_b"))
            add(ValueCheck("same", source, True, arg=other, guard=kind))
        elif kind == "NOT_NONE_MATCH":
            add(ValueCheck("not_none", source, True, guard=kind))
        else:
            raise _CannotCheck(f"a {kind} guard on {source or 'global state'}")
    for name, read in _torch_state().items():
        try:
            add(ValueCheck("state", name, _encode(read()), guard="torch state"))
        except Exception as exc:
            raise _CannotCheck(f"torch setting {name} cannot be read ({exc})") from None
    return list(checks.values())


def _entry_value(entry: Any) -> Any:
    if not entry.has_value:
        raise _CannotCheck(f"{entry.guard_type} guard on {entry.name} without a value")
    return entry.value


def _tensor_meta(value: torch.Tensor) -> list[Any]:
    return [str(value.dtype), value.device.type, list(value.shape), list(value.stride()),
            bool(value.requires_grad)]


def _guard_namespace(frame: _Frame, locals_: Mapping[str, Any]) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # the helpers Dynamo's own guard code calls
        from torch._dynamo.guards import _get_closure_vars

        namespace.update(_get_closure_vars())
    namespace.update({"L": locals_, "G": frame.globals, "__builtins__": builtins})
    return namespace


def failed_check(checks: Sequence[ValueCheck], frame: _Frame, locals_: Mapping[str, Any],
                 seen: list[Any] | None = None) -> str | None:
    """Why ``checks`` do not hold in ``frame`` (with ``locals_`` as its ``L``), or None when
    each holds. A source that cannot be evaluated fails its check. Values evaluated are
    appended to ``seen`` (their code is compared by :func:`_code_mismatch`)."""
    namespace = _guard_namespace(frame, locals_)
    state = _torch_state()

    def evaluate(source: str) -> Any:
        value = eval(compile(source, "<freezeframe guard>", "eval"), namespace)
        if seen is not None:
            seen.append(value)
        return value

    for check in checks:
        try:
            got = _check_value(check, evaluate, state)
        except _CannotCheck as exc:
            return f"{check.source} ({check.guard}): {exc}"
        except Exception as exc:
            return (f"{check.source} ({check.guard}) cannot be evaluated "
                    f"({type(exc).__name__}: {exc})")
        if got != check.expected:
            return (f"{check.source} ({check.guard}) is {got!r}, the trace has "
                    f"{check.expected!r}")
    return None


def _check_value(check: ValueCheck, evaluate: Callable[[str], Any],
                 state: Mapping[str, Callable[[], Any]]) -> Any:
    """What ``check`` observes now, comparable with ``check.expected``."""
    import torch

    kind = check.kind
    if kind == "state":
        read = state.get(check.source)
        if read is None:
            raise _CannotCheck("unknown torch setting")
        return _encode(read())
    if kind == "hasattr":
        return hasattr(evaluate(check.source), check.arg)
    value = evaluate(check.source)
    if kind == "value":
        return _encode(value)
    if kind == "type":
        return _qualified(type(value))
    if kind == "len":
        return len(value)
    if kind == "keys":
        return [_encode(k) for k in value]
    if kind == "contains":
        return check.arg in value
    if kind == "in_dict":
        return check.arg in getattr(value, "__dict__", {})
    if kind == "same":
        return value is evaluate(check.arg)
    if kind == "not_none":
        return value is not None
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            return ["not a tensor", _qualified(type(value))]
        return _tensor_meta(value)
    raise _CannotCheck(f"unknown check kind {kind!r}")


_STALE_TEMP_S = 600.0


def _remove_stale_temps(directory: Path) -> None:
    """Remove temporary files a crashed process left behind (older than ten minutes, so a
    write in progress elsewhere is never touched)."""
    now = time.time()
    for pattern in (".*.tmp", ".load.*", ".save.*"):
        for p in directory.glob(pattern):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > _STALE_TEMP_S:
                    p.unlink()


# ---------------------------------------------------------------------------------------------
# locking
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _flock(path: Path, *, what: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: released when the block ends or the process dies."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: atomic writes still keep files whole
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:  # a read-only cache: nothing will be written, so no lock is needed
        logger.warning("cannot create the compile lock %s (%s); going on without it", path, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process compiling %s (lock %s)", what, path)
            start = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            logger.info("got the compile lock for %s after %.1fs", what, time.monotonic() - start)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# the cache of one model
# ---------------------------------------------------------------------------------------------
def _range_bounds(compile_range: Any) -> tuple[int, int]:
    if isinstance(compile_range, int):
        return compile_range, compile_range
    start, end = getattr(compile_range, "start", None), getattr(compile_range, "end", None)
    if start is None or end is None:
        start, end = compile_range
    return int(start), int(end)


def artifact_name(piece_index: int, compile_range: Range | tuple[int, int] | int) -> str:
    start, end = _range_bounds(compile_range)
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
        ensure_private_dir(self.root)

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

        Raises :class:`CacheError` when the cache directory is not private.
        """
        if not cache_enabled(config):
            return None
        from freezeframe import __version__

        factors: dict[str, Any] = {
            "cache_format": CACHE_FORMAT,
            "freezeframe": __version__,
            "config": config.cache_key(),
            **torch_factors(),
            "model_key": model_key,
        }
        passes = dict(inductor_passes or {})
        if passes:
            factors["inductor_passes"] = passes
        if module is not None:
            forward = type(module).forward
            factors["model"] = f"{type(module).__module__}.{type(module).__qualname__}"
            factors["forward_line"] = getattr(getattr(forward, "__code__", None),
                                              "co_firstlineno", None)
            factors["module_signature"] = module_signature(module)
            factors["inputs"] = input_signature(module, args, kwargs or {}, dynamic_arg_dims)
        if extra_factors:
            factors["extra"] = dict(extra_factors)
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
        (:func:`code_digests`); they join the key. Same timing rule as
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
        factors = entry / _FACTORS_NAME
        if not factors.exists():
            body = {
                "key": self.key,
                "base_key": self.base_key,
                "factors": self.base_factors,
                "sources": self.sources,
                "code": self.code,
                "config": self._config_dict,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write(factors, json.dumps(body, indent=2, sort_keys=True, default=repr)
                         .encode())
        return entry

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
        wanted = self.inductor_path()
        if not _toolchain_safe(wanted):
            logger.warning("neither %s nor %s can be handed to the C++ compiler (spaces or "
                           "other characters it cannot take); Inductor keeps its default cache "
                           "directory", self.root / "inductor", wanted)
            return contextlib.nullcontext()
        try:
            if wanted.parent != self.root:
                ensure_private_dir(wanted.parent)
            path = ensure_private_dir(wanted)
        except OSError as exc:
            logger.warning("cannot create %s (%s); Inductor keeps its default cache directory",
                           wanted, exc)
            return contextlib.nullcontext()
        if wanted.parent != self.root:
            logger.info("Inductor's cache for %s is kept at %s: the root's path has characters "
                        "the C++ compiler cannot take", self.root, path)
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
        for child in list(path.iterdir()) if path.is_dir() else []:
            with contextlib.suppress(OSError):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink()
        _forget_inductor_modules(path)
        return True

    # -- counting --------------------------------------------------------------------------
    def _inc(self, name: str) -> None:
        if self.stats is not None:
            self.stats.inc(name)

    def record_hit(self) -> None:
        self._inc("cache_hits")

    def record_miss(self) -> None:
        self._inc("cache_misses")

    # -- files -----------------------------------------------------------------------------
    def _read_verified(self, path: Path) -> tuple[dict[str, Any], bytes] | None:
        """The header and payload of ``path``, or None when it is missing or corrupt (a corrupt
        file is logged and removed so the rewrite starts clean)."""
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("cache artifact %s is unreadable (%s); recompiling", path, exc)
            return None
        try:
            return unpack_artifact(blob)
        except CorruptArtifactError as exc:
            logger.warning("cache artifact %s is corrupt (%s); removing it and recompiling",
                           path, exc)
            with contextlib.suppress(OSError):
                path.unlink()
            return None

    def discard(self, path: Path, reason: str) -> None:
        """Remove an artifact that verified but failed to load (logged)."""
        logger.warning("cache artifact %s could not be loaded (%s); removing it and "
                       "recompiling", path, reason)
        with contextlib.suppress(OSError):
            path.unlink()

    def load_artifact(self, piece_index: int, compile_range: Any,
                      graph_key: str | None = None) -> tuple[Path, bytes] | None:
        """The verified payload of one piece's artifact (and its path), or None.

        Does not count hits or misses: the caller does once it knows whether the payload
        turned into a runnable (:meth:`record_hit` / :meth:`record_miss`).
        """
        path = self.entry_dir / artifact_name(piece_index, compile_range)
        found = self._read_verified(path)
        if found is None:
            return None
        header, payload = found
        if graph_key is not None and header.get("graph") != graph_key:
            logger.info("cache artifact %s was compiled from another graph; recompiling", path)
            return None
        self._inc("artifacts_loaded")
        return path, payload

    def save_artifact(self, piece_index: int, compile_range: Any, payload: bytes, *,
                      graph_key: str | None = None, compiler: str = "") -> Path:
        """Write one piece's artifact atomically and list it in the index."""
        entry = self._entry()
        start, end = _range_bounds(compile_range)
        name = artifact_name(piece_index, compile_range)
        meta = {"piece": piece_index, "range": [start, end], "graph": graph_key,
                "compiler": compiler}
        atomic_write(entry / name, pack_artifact(payload, meta))
        self._update_index(name, {**meta, "bytes": len(payload)})
        self._inc("artifacts_saved")
        logger.debug("saved cache artifact %s (%d bytes)", entry / name, len(payload))
        return entry / name

    def _update_index(self, name: str, record: Mapping[str, Any]) -> None:
        # Informational only (``freezeframe cache info``): loads trust the self-checking files.
        # Callers hold lock() during compilation, so read-modify-write does not lose entries.
        index_path = self.entry_dir / _INDEX_NAME
        index: dict[str, Any] = {"format": CACHE_FORMAT, "artifacts": {}}
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(index_path.read_text())
            if isinstance(loaded, dict) and isinstance(loaded.get("artifacts"), dict):
                index = loaded
        index["artifacts"][name] = dict(record)
        atomic_write(index_path, json.dumps(index, indent=2, sort_keys=True).encode())

    # -- the saved trace -------------------------------------------------------------------
    # Dynamo builds a trace's guards only after the backend has compiled (and looked up) every
    # piece, so the entry key, fixed by then, cannot hold the values the trace specialised on.
    # Those values select a *variant* inside the entry instead: trace.bin keeps one saved trace
    # per distinct set of checked values (newest first), so two instances of one class with
    # different values each warm-start from their own trace instead of replacing each other's.
    # The pieces need no such split: each artifact is checked against its piece's graph_hash,
    # whose generated code holds the constants baked into it.
    def save_trace(self, payload: bytes, meta: Mapping[str, Any] | None = None,
                   checks: Sequence[ValueCheck] = ()) -> Path:
        """Save the Dynamo trace of this model (with the checks a reuse must pass) beside the
        variants already saved for this entry, and point ``models/<base key>.json`` at it."""
        entry = self._entry()
        path = entry / _TRACE_NAME
        rows = [c.as_tuple() for c in checks]
        digest = _sha(rows)[:16]
        kept = [v for v in self._read_variants(path) if v.get("digest") != digest]
        variants = [{"digest": digest, "checks": rows, "payload": payload,
                     "meta": dict(meta or {})}, *kept][:_MAX_TRACE_VARIANTS]
        body = pickle.dumps({"variants": variants}, protocol=pickle.HIGHEST_PROTOCOL)
        atomic_write(path, pack_artifact(body, {"variants": len(variants)}))
        models = ensure_private_dir(self.root / "models")
        pointer_path = models / f"{self.base_key}.json"
        mine = {"key": self.key, "sources": self.sources, "code": self.code}
        others = [e for e in self._pointer_entries(pointer_path) if e["key"] != self.key]
        pointer = {"entries": [mine, *others][:_MAX_POINTER_ENTRIES]}
        atomic_write(pointer_path, json.dumps(pointer, indent=2, sort_keys=True).encode())
        self._inc("artifacts_saved")
        return path

    def _read_variants(self, path: Path) -> list[dict[str, Any]]:
        found = self._read_verified(path)
        if found is None:
            return []
        try:
            variants = pickle.loads(found[1])["variants"]
            if not isinstance(variants, list) or not all(
                    isinstance(v, dict) and isinstance(v.get("payload"), bytes)
                    and isinstance(v.get("checks"), list) for v in variants):
                raise TypeError("not a list of saved traces")
        except Exception as exc:
            self.discard(path, f"unreadable saved traces: {type(exc).__name__}: {exc}")
            return []
        return variants

    @staticmethod
    def _pointer_entries(path: Path) -> list[dict[str, Any]]:
        """The entries ``models/<base key>.json`` lists (newest first); [] when it is missing,
        and [] with a warning when it is unreadable."""
        try:
            entries = json.loads(path.read_text())["entries"]
            out = []
            for e in entries:
                key, sources, code = e["key"], dict(e["sources"]), dict(e["code"])
                if isinstance(key, str) and _KEY_RE.match(key):
                    out.append({"key": key, "sources": sources,
                                "code": {str(n): sorted(map(str, d)) for n, d in code.items()}})
            return out
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("saved-trace pointer %s is unreadable (%s); tracing", path, exc)
            return []

    def load_trace(self, accept: Callable[[SavedTrace], str | None] | None = None
                   ) -> SavedTrace | None:
        """A saved trace for this model whose recorded source files are unchanged and which
        ``accept`` takes (it returns None, or why the trace does not fit: a checked value or
        code without a source file differs, the call's inputs do not fit).

        On success the recorded sources and code become this cache's (the key is fixed). When
        saved traces exist but none is taken, logs why, counts ``saved_trace_rejected`` and
        returns None: the caller traces with Dynamo as usual. ``accept`` raises
        :class:`CorruptArtifactError` for a trace that cannot be read; its file is removed.
        """
        reasons: list[str] = []
        for pointed in self._pointer_entries(self.root / "models" / f"{self.base_key}.json"):
            key, recorded, code = pointed["key"], pointed["sources"], pointed["code"]
            current = hash_sources(recorded)
            if current != recorded:
                changed = sorted(p for p in recorded if current.get(p) != recorded[p])
                reasons.append(f"entry {key}: traced sources changed ({', '.join(changed[:5])})")
                continue
            if self._sources is not None and (recorded != self._sources or code != self.code):
                continue  # the key is fixed already and this entry is not it
            path = self.root / key / _TRACE_NAME
            for variant in self._read_variants(path):
                try:
                    saved = SavedTrace(
                        key=key, payload=variant["payload"],
                        checks=tuple(ValueCheck(*row) for row in variant["checks"]),
                        meta=dict(variant.get("meta") or {}), code=code)
                    why = accept(saved) if accept is not None else None
                except (TypeError, ValueError) as exc:  # rows of another layout
                    self.discard(path, f"unreadable saved trace: {exc}")
                    break
                except CorruptArtifactError as exc:
                    self.discard(path, str(exc))
                    break
                if why is not None:
                    reasons.append(f"entry {key}: {why}")
                    continue
                if self._sources is None:
                    self._traced_files = set(recorded)
                    self._sources = dict(recorded)
                    self._traced_code = {n: set(d) for n, d in code.items()}
                    self._code = dict(code)
                self._inc("artifacts_loaded")
                return saved
        if reasons:
            logger.info("a saved trace exists for model %s but does not fit, so Dynamo traces "
                        "again: %s", self.base_key, "; ".join(reasons[:4]))
            self._inc("saved_trace_rejected")
        return None

    def trace_path(self) -> Path:
        return self.entry_dir / _TRACE_NAME


# ---------------------------------------------------------------------------------------------
# inspection (the CLI)
# ---------------------------------------------------------------------------------------------
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


def _dir_size(path: Path) -> int:
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
        factors: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            factors = json.loads((child / _FACTORS_NAME).read_text())
        artifacts = [p for p in child.glob("piece_*.bin")]
        out.append(CacheEntryInfo(
            key=child.name, path=child, size_bytes=_dir_size(child),
            num_artifacts=len(artifacts), has_trace=(child / _TRACE_NAME).exists(),
            modified=child.stat().st_mtime, factors=factors,
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


# ---------------------------------------------------------------------------------------------
# integration with the compile path
# ---------------------------------------------------------------------------------------------
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
    def _cacheable(compiler: Any) -> bool:
        return getattr(compiler, "name", "") == "inductor" and _compiled_artifact_class() \
            is not None

    @staticmethod
    def _graph_key(compiler: Any, graph: Any, example_inputs: Sequence[Any],
                   compile_range: Any) -> str:
        return graph_hash(graph, example_inputs, [list(_range_bounds(compile_range)),
                                                  getattr(compiler, "name", "")])

    def load(self, compiler: Any, graph: Any, example_inputs: list[Any], compile_range: Any,
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

    def save(self, compiler: Any, graph: Any, example_inputs: list[Any], compile_range: Any,
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
                                     compiler=getattr(compiler, "name", ""))
        except CacheError:
            raise
        except Exception as exc:  # e.g. a graph standalone_compile cannot serialise
            logger.warning("could not save the compiled piece %d for sizes %s to the cache "
                           "(%s: %s); the next start compiles it again", piece_index,
                           compile_range, type(exc).__name__, exc)


def _source_name(node: Any) -> str | None:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name  # a property in torch 2.13, a method in older builds
    return str(name() if callable(name) else name)


class _OutputRecorder:
    """Wraps the compiled graph Dynamo's bytecode calls, to see the first call's graph outputs
    (so the forward's return value can be expressed in terms of them for the saved trace)."""

    __slots__ = ("fn", "outputs")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.outputs: list[Any] | None = None

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.outputs is None:
            self.outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        return out


class _LoadedTrace:
    """The forward of a warm start that skipped Dynamo: binds the call's arguments to the
    graph inputs exactly as Dynamo's bytecode did (same source expressions, in the rebuilt
    traced frame), calls the compiled graph and rebuilds the return value from the graph
    outputs."""

    def __init__(self, frame: _Frame, sources: Sequence[str], out_spec: str,
                 out_leaves: Sequence[tuple[str, Any]]) -> None:
        import torch.utils._pytree as pytree

        self._module = frame.module
        self._bind = frame.function(f"({', '.join(sources)},)")
        self.fn: Callable[..., Any] | None = None  # the compiled graph, set once checked
        self._spec = pytree.treespec_loads(out_spec)
        self._leaves = list(out_leaves)
        self._unflatten = pytree.tree_unflatten
        self._single = self._spec.is_leaf() and self._leaves[0][0] == "out"

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The graph inputs for a call, evaluated as Dynamo's bytecode would."""
        return self._bind(self._module, *args, **kwargs)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs = self.fn(*self._bind(self._module, *args, **kwargs))  # type: ignore[misc]
        if self._single:
            return outs[self._leaves[0][1]]
        leaves = [outs[v] if kind == "out" else v for kind, v in self._leaves]
        return self._unflatten(leaves, self._spec)


@dataclasses.dataclass
class _Chosen:
    """The saved trace a warm start takes, ready to compile."""

    gm: Any
    example_inputs: list[Any]
    loaded: _LoadedTrace
    sizes: _SavedSizes


class ModelCache:
    """Drives the cache for one :class:`~freezeframe.compilation.model.CompiledModel`.

    The compile path calls :meth:`wrap_backend` around its Dynamo backend when it builds the
    trace, and routes calls through :meth:`__call__` (in place of the trace-once callable).
    The first call opens the cache (the input signature is part of the key), takes the model
    lock and then either

    * loads a saved trace (sources unchanged, every value and piece of code the trace
      specialised on unchanged) and feeds the stored graph to the backend, so Dynamo never
      runs and every Inductor piece comes from an artifact; or
    * traces with Dynamo as usual, records the traced files and code, and saves the trace
      afterwards (with checks built from the trace's guards) when the forward's inputs and
      outputs can be expressed without Dynamo's bytecode and every guard can be re-checked in
      another process.

    The saved trace assumes what trace-once already assumes: forward has no Python side effects
    outside the graph. It is loaded only for a call whose sizes meet the conditions its Python
    branches put on them (saved with it), and whose placeholders' dtypes, ranks and static
    sizes fit.
    """

    def __init__(self, model: Any, dynamic_arg_dims: Mapping[str, Any] | None = None, *,
                 model_key: str | None = None) -> None:
        self._model = model
        self._dims = dict(dynamic_arg_dims or {})
        self._user_key = model_key
        self.trace: TraceOnce | None = None  # the trace-once callable, set by the model
        self._backend: Callable[..., Any] | None = None
        self._recorder: _OutputRecorder | None = None
        self._graph_blob: bytes | None = None
        self._sources: list[str] | None = None
        self._frame_kind: str | None = None
        self._not_saved: str | None = None  # why this trace cannot be saved, once known
        self._run: Callable[..., Any] | None = None
        self.cache: CompileCache | None = None
        self.trace_loaded = False

    # -- hooks for the compile path -------------------------------------------------------
    def wrap_backend(self, backend: Callable[..., Any]) -> Callable[..., Any]:
        """The Dynamo backend to trace with: records traced files and code for the key and
        keeps what the saved trace needs, then calls ``backend``."""
        self._backend = backend

        def cached_backend(gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            if self.cache is not None:
                codes = _traced_code()
                self.cache.add_traced_files(traced_files_from_graph(gm))
                self.cache.add_traced_code(code_digests(codes))
                self._frame_kind = self._traced_frame_kind(codes)
                self._keep_graph(gm)
            fn = backend(gm, example_inputs)
            if self.cache is not None and self._graph_blob is not None:
                self._recorder = _OutputRecorder(fn)
                return self._recorder
            return fn

        return cached_backend

    def _traced_frame_kind(self, codes: Sequence[types.CodeType]) -> str | None:
        """Which frame Dynamo traced (see :class:`_Frame`), from the first traced code."""
        func = getattr(getattr(self._model.module, "forward", None), "__func__", None)
        if not codes or func is None:
            return None
        if codes[0] is func.__code__:
            return "forward"
        if codes[0] is _wrapped_frame_code():
            return "wrapped"
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._run is not None:
            return self._run(*args, **kwargs)
        return self._first_call(args, kwargs)

    # -- first call -----------------------------------------------------------------------
    def _first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        model, trace = self._model, self.trace
        if trace is None:
            raise CacheError("ModelCache.trace was not set; the compile path must assign the "
                             "trace-once callable before the first call")
        from freezeframe.compilation.compilers import config_passes, pass_sources

        # the passes are resolved only for a cache that is on, as CompileCache.open did itself
        passes = (pass_sources(config_passes(model.config)) if cache_enabled(model.config)
                  else None)
        self.cache = CompileCache.open(model.config, stats=model.stats, module=model.module,
                                       args=args, kwargs=kwargs, dynamic_arg_dims=self._dims,
                                       model_key=self._user_key, inductor_passes=passes)
        if self.cache is None:
            self._run = trace
            return trace(*args, **kwargs)
        manager = getattr(model, "manager", None)
        if manager is not None:
            manager.cache = PieceCache(self.cache)
        with self.cache.lock(), self.cache.inductor_dir(model.config.backend == "inductor"):
            loaded = self._try_saved_trace(args, kwargs)
            if loaded is not None:
                self._run = loaded
                return loaded(*args, **kwargs)
            out = trace(*args, **kwargs)
            self._save_trace(out, args, kwargs)
        self._run = trace
        return out

    def _keep_graph(self, gm: Any) -> None:
        try:
            from torch.fx._graph_pickler import GraphPickler, Options
        except ImportError:  # pragma: no cover - torch without a graph pickler
            self._not_saved = "this torch has no graph pickler"
            return
        sources = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            name = _source_name(node)
            if name is None or not (name.startswith("L[") or name.startswith("G[")):
                self._not_saved = f"graph input {node.name} has no plain source"
                return
            sources.append(name)
        # Only the placeholders' fake values are stored (some intermediate fake tensors hold
        # unpicklable state); the loader re-derives the others by fake propagation.
        # A placeholder that is a view (say a reshaped block table) is stored as a plain tensor
        # of the same sizes and strides: what the graph sees, without the view's base.
        stripped: dict[tuple[Any, str], Any] = {}
        for node in gm.graph.nodes:
            for key in ("example_value", "val"):
                if key not in node.meta:
                    continue
                if node.op != "placeholder":
                    stripped[(node, key)] = node.meta.pop(key)
                else:
                    value = node.meta[key]
                    plain = _unviewed(value)
                    if plain is not value:
                        stripped[(node, key)] = value
                        node.meta[key] = plain
        try:
            # Node metadata: only what splitting and Inductor read (Dynamo's own entries hold
            # real tensors and weak references).
            self._graph_blob = GraphPickler.dumps(
                gm, Options(ops_filter=None, node_metadata_key_filter=_KEEP_META.__contains__))
        except Exception as exc:
            self._not_saved = f"the traced graph cannot be serialised ({type(exc).__name__}: {exc})"
            logger.debug("graph pickling failed", exc_info=True)
            return
        finally:
            for (node, key), value in stripped.items():
                node.meta[key] = value
        self._sources = sources

    def _not_saving(self, why: str) -> None:
        logger.info("the trace of %s is not saved, so warm starts will trace with Dynamo: %s",
                    type(self._model.module).__name__, why)
        self._model.stats.inc("traces_not_saved")

    def _save_trace(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch
        import torch.utils._pytree as pytree

        cache, rec = self.cache, self._recorder
        if cache is None:
            return
        if self._not_saved is not None:
            self._not_saving(self._not_saved)
            return
        if rec is None or rec.outputs is None or self._sources is None:
            self._not_saving("the compiled graph was not called by the first call")
            return
        if self._frame_kind is None:
            self._not_saving("Dynamo traced a frame other than the forward")
            return
        entries = getattr(self.trace, "guard_entries", None)
        if entries is None:
            self._not_saving("the trace does not record its guards")
            return
        leaves, spec = pytree.tree_flatten(out)
        described: list[tuple[str, Any]] = []
        for leaf in leaves:
            index = next((i for i, o in enumerate(rec.outputs) if o is leaf), None)
            if index is not None:
                described.append(("out", index))
            elif not isinstance(leaf, torch.Tensor) and _primitive(leaf):
                described.append(("const", leaf))
            else:
                self._not_saving("forward returns a value that is not a graph output")
                return
        try:
            spec_text = pytree.treespec_dumps(spec)
        except Exception as exc:
            self._not_saving(f"forward's return structure cannot be saved ({exc})")
            return
        try:
            frame = _Frame(self._model.module, self._frame_kind)
            checks = value_checks(entries, frame)
            # Each check must hold right now, as the trace saw it: this proves the sources
            # evaluate the same way without Dynamo, and catches a forward that changed what it
            # read.
            why = failed_check(checks, frame, frame.locals_at_entry(args, kwargs))
        except _CannotCheck as exc:
            self._not_saving(f"the trace specialised on {exc}, which another process cannot "
                             "re-check")
            return
        except Exception as exc:
            self._not_saving(f"its checks cannot be built ({type(exc).__name__}: {exc})")
            return
        if why is not None:
            self._not_saving(f"a value the trace specialised on cannot be re-checked: {why}")
            return
        sizes = _SavedSizes.of(self.trace, self._model, args, kwargs)
        payload = pickle.dumps({"graph": self._graph_blob, "sources": self._sources,
                                "out_spec": spec_text, "out_leaves": described,
                                "frame": self._frame_kind, "sizes": sizes.to_data()})
        try:
            cache.save_trace(payload, {"inputs": len(self._sources)}, checks)
        except CacheError:
            raise
        except Exception as exc:
            logger.warning("could not save the trace (%s: %s)", type(exc).__name__, exc)

    def _try_saved_trace(self, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Callable[..., Any] | None:
        cache = self.cache
        module = self._model.module
        if cache is None or self._backend is None:
            return None
        if getattr(getattr(module, "forward", None), "__func__", None) is None:
            return None
        chosen: list[_Chosen] = []

        def accept(saved: SavedTrace) -> str | None:
            try:
                data = pickle.loads(saved.payload)
                frame = _Frame(module, data["frame"])
            except Exception as exc:
                raise CorruptArtifactError(f"{type(exc).__name__}: {exc}") from None
            try:
                locals_ = frame.locals_at_entry(args, kwargs)
                seen: list[Any] = [module, module.forward, *module.modules(),
                                   *locals_.values()]
                why = failed_check(saved.checks, frame, locals_, seen)
                if why is None:
                    why = _code_mismatch(saved.code, seen)
            except Exception as exc:  # a call that does not bind, an odd object to walk
                why = f"it cannot be checked against this call ({type(exc).__name__}: {exc})"
            if why is not None:
                return why
            try:
                sizes = _SavedSizes.from_data(data["sizes"])
            except Exception as exc:
                raise CorruptArtifactError(f"{type(exc).__name__}: {exc}") from None
            why = sizes.refuses(self._model, args, kwargs)
            if why is not None:
                return why
            try:
                gm, example_inputs = _load_graph(data["graph"])
                loaded = _LoadedTrace(frame, data["sources"], data["out_spec"],
                                      data["out_leaves"])
            except Exception as exc:
                raise CorruptArtifactError(f"{type(exc).__name__}: {exc}") from None
            try:
                mismatch = _first_mismatch(loaded.bind(*args, **kwargs), example_inputs)
            except Exception as exc:
                mismatch = f"the graph inputs cannot be bound ({type(exc).__name__}: {exc})"
            if mismatch is not None:
                return f"the call does not fit the trace ({mismatch})"
            chosen.append(_Chosen(gm, example_inputs, loaded, sizes))
            return None

        if cache.load_trace(accept) is None:
            return None
        pick = chosen[-1]
        pick.loaded.fn = self._backend(pick.gm, pick.example_inputs)  # errors here are real
        # the branches the saved trace took on sizes, for the per-call size checks
        if self.trace is not None:
            self.trace.adopt_size_conditions(pick.sizes.conditions, pick.sizes.symbols)
        self.trace_loaded = True
        self._model.stats.inc("traces_loaded")
        logger.info("loaded the saved trace from %s; Dynamo did not run", cache.entry_dir)
        return pick.loaded


@dataclasses.dataclass(frozen=True)
class _SavedSizes:
    """What a saved trace assumed about the dynamic sizes: the conditions its Python branches
    put on them (as sympy text), which argument dim each symbol is, and the sizes it was traced
    at. A warm start loads the trace only for a call that meets the conditions (the other side
    of `if x.shape[0] > 4:` traces again), and, with Inductor, a trace made at size 1 only for
    size 1 (Inductor writes size-1 code there)."""

    conditions: tuple[tuple[Any, str], ...]
    symbols: dict[Any, tuple[str, int]]
    traced_at: dict[tuple[str, int], int]
    inductor: bool

    @staticmethod
    def of(trace: Any, model: Any, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> _SavedSizes:
        signer = getattr(model, "_signer", None)
        traced_at = signer.dynamic_sizes(args, kwargs) if signer is not None else {}
        return _SavedSizes(tuple(trace.size_conditions), dict(trace.size_symbols), traced_at,
                           model.config.backend == "inductor")

    def to_data(self) -> dict[str, Any]:
        import sympy

        return {"conditions": [[sympy.srepr(expr), where] for expr, where in self.conditions],
                "symbols": [[sympy.srepr(sym), name, dim]
                            for sym, (name, dim) in self.symbols.items()],
                "traced_at": [[name, dim, n] for (name, dim), n in self.traced_at.items()],
                "inductor": self.inductor}

    @staticmethod
    def from_data(data: Mapping[str, Any]) -> _SavedSizes:
        import sympy

        symbols = {sympy.sympify(text): (str(name), int(dim))
                   for text, name, dim in data["symbols"]}
        by_name = {str(sym): sym for sym in symbols}
        conditions = []
        for text, where in data["conditions"]:
            expr = sympy.sympify(text)
            # the same symbol objects as the mapping, whatever sympify made of them
            expr = expr.xreplace({s: by_name[str(s)] for s in expr.free_symbols
                                  if str(s) in by_name})
            conditions.append((expr, str(where)))
        traced_at = {(str(name), int(dim)): int(n) for name, dim, n in data["traced_at"]}
        return _SavedSizes(tuple(conditions), symbols, traced_at, bool(data["inductor"]))

    def refuses(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why this call's sizes are not ones the saved trace serves, or None."""
        from freezeframe.compilation.signature import SizeGuards

        signer = getattr(model, "_signer", None)
        if signer is None:
            return None
        sizes = signer.dynamic_sizes(args, kwargs)
        only = ({where: 1 for where, n in self.traced_at.items() if n == 1}
                if self.inductor else {})
        if SizeGuards(self.conditions, self.symbols, only).accepts(sizes):
            return None
        return (f"the call's sizes {dict(sizes)} are not ones the trace serves (its conditions "
                f"on sizes: {[str(c) for c, _ in self.conditions] or 'none'}, traced at "
                f"{dict(self.traced_at)})")


def _load_graph(blob: bytes) -> tuple[Any, list[Any]]:
    """A saved graph with fresh fake values on every node, and its placeholders' values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm: Any = GraphPickler.loads(blob, fake_mode)
    gm.recompile()
    example_inputs = [n.meta.get("example_value", n.meta.get("val"))
                      for n in gm.graph.nodes if n.op == "placeholder"]
    _propagate_fake_values(gm, example_inputs, fake_mode)
    return gm, example_inputs


_KEEP_META = frozenset({"example_value", "val", "stack_trace", "tensor_meta"})


def _unviewed(value: Any) -> Any:
    """A fake tensor that is a view, as a fresh tensor of the same sizes/strides/dtype."""
    import torch

    if not isinstance(value, torch.Tensor) or not value._is_view():
        return value
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        plain = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                    device=value.device, requires_grad=value.requires_grad)
    return plain


def _propagate_fake_values(gm: Any, example_inputs: Sequence[Any], fake_mode: Any) -> None:
    """Recompute every node's fake value (``example_value`` / ``val``, as Dynamo leaves them)
    from the placeholders', so splitting and Inductor see the graph as Dynamo produced it."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*example_inputs)
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output") and "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])


def _first_mismatch(actual: Sequence[Any], expected: Sequence[Any]) -> str | None:
    """Why the real graph inputs of this call do not fit the saved trace's placeholders, or
    None: same count, tensors with the same dtype, device type, rank and every static size
    (symbolic sizes fit anything), plain ints for symbolic ones."""
    import torch

    if len(actual) != len(expected):
        return f"{len(actual)} graph inputs, the trace has {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"input {i} is {type(a).__name__}, the trace has a tensor"
            if a.dtype != e.dtype or a.device.type != e.device.type or a.dim() != e.dim():
                return (f"input {i} is {a.dtype}/{a.device.type}/rank {a.dim()}, the trace has "
                        f"{e.dtype}/{e.device.type}/rank {e.dim()}")
            for d, (sa, se) in enumerate(zip(a.shape, e.shape, strict=True)):
                if isinstance(se, int) and sa != se:
                    return f"input {i} has size {sa} in dim {d}, the trace has {se}"
        elif isinstance(e, torch.SymInt):
            if not isinstance(a, int):
                return f"input {i} is {type(a).__name__}, the trace has a size"
        elif e is not None and not isinstance(a, type(e)):
            return f"input {i} is {type(a).__name__}, the trace has {type(e).__name__}"
    return None
