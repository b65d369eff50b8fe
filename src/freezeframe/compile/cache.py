"""The on-disk compile cache.

A warm start should not pay for work a previous process already did. Two things are worth
keeping across processes:

* one compiled artifact per capturable piece and per compile range or concrete size (an
  Inductor ``standalone_compile`` artifact), so a warm start skips Inductor;
* the Dynamo trace itself (the FX graph plus how its inputs bind to the forward's arguments and
  the module's parameters), so a warm start can skip Dynamo too when the traced sources are
  unchanged.

Layout (``<root>`` from :func:`resolve_cache_root`)::

    <root>/
      models/<base key>.json        which entry a model's last trace produced + its source hashes
      locks/<base key>.lock         flock: one process compiles a model, the others wait, then load
      inductor/                     Inductor's own cache while freezeframe compiles or loads
                                    (built CPU kernels, so a warm start runs no C++ compiler)
      <key>/                        one entry per (base factors, traced source contents)
        key_factors.json            every factor that went into the key, readable
        index.json                  this entry's artifacts (informational; files self-check)
        trace.bin                   the saved Dynamo trace (optional)
        piece_<i>_range_<s>_<e>.bin one compiled piece for one compile range or size

The *base key* hashes what is known before tracing: the freezeframe version, the config's
``cache_key()``, the source files of the config's Inductor passes, torch's version and
Inductor's system factors, the module's structure and the example-input signature, and the
user's optional ``model_key``. The entry *key* adds the contents
of every source file Dynamo traced, which is only known after a trace (or, on a warm start, from
the ``models/`` pointer, whose recorded files are re-hashed before it is trusted).

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
and verified (pieces and the trace); ``traces_loaded`` is 1 when Dynamo did not run.
``backend_compilations`` counts a hit too, as vLLM does, so it never depends on the cache state.

When the saved trace is not used (Dynamo traces as usual): no pointer for this base key, a
recorded source file changed, the trace file is damaged, a graph input cannot be named from the
forward's arguments, the forward returns something other than graph outputs and constants, or
this call's inputs do not fit the traced placeholders (dtype, rank, static sizes). Like
trace-once itself it assumes a forward without Python side effects outside the graph; module
state that the key does not see (a global flag read by forward) needs a ``model_key``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import platform
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freezeframe.errors import CacheError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

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
    "pass_sources",
    "resolve_cache_root",
    "torch_factors",
    "traced_files_from_graph",
    "unpack_artifact",
]

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "FREEZEFRAME_CACHE_DIR"
ENV_DISABLE_CACHE = "FREEZEFRAME_DISABLE_CACHE"

# Bumped whenever the on-disk layout or the artifact header changes, so old entries miss.
CACHE_FORMAT = 1
_MAGIC = b"FFCACHE1"
_HEADER_LEN_BYTES = 4
_TRACE_NAME = "trace.bin"
_FACTORS_NAME = "key_factors.json"
_INDEX_NAME = "index.json"
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")


class CorruptArtifactError(CacheError):
    """An artifact file is truncated, altered or not ours; it must never be loaded."""


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


def pass_sources(passes: Mapping[str, Any]) -> dict[str, str | None]:
    """``{pass name: sha256 of the file defining it}`` for the config's Inductor passes.

    The config's own key names a string pass by its name and a callable by its own source, and
    Inductor keys a custom pass by its ``uuid()``; none of them changes when a helper the pass
    calls is edited, so the defining file's contents join the key here. None when the pass or
    its file cannot be found (a builtin or a lambda typed at a prompt); such a pass is keyed by
    the config alone.
    """
    # Imported here: the compilers pull in torch, which `freezeframe cache list` never needs.
    from freezeframe.compile.compilers import resolve_pass

    out: dict[str, str | None] = {}
    for name, value in sorted(passes.items()):
        try:
            fn = resolve_pass(name, value)
        except ConfigError:
            out[name] = None
            continue
        try:
            path = inspect.getsourcefile(fn) or inspect.getsourcefile(type(fn))
        except TypeError:
            path = None
        out[name] = hash_sources([path]).get(path) if path else None
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
            trace = cache.load_trace()             # bytes or None (sources re-verified)
            if trace is None:
                ... Dynamo traces; inside the backend:
                cache.add_traced_files(traced_files_from_graph(gm))
                cache.save_trace(payload)          # optional
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
    ) -> CompileCache | None:
        """The cache for one model, or None when the cache is switched off.

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
        passes = pass_sources(config.inductor_passes)
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

    @property
    def sources(self) -> dict[str, str]:
        if self._sources is None:
            self._sources = hash_sources(self._traced_files)
        return self._sources

    @property
    def key(self) -> str:
        """The entry key: base factors + traced source contents (path-independent, so a cache
        copied to another checkout of the same code still hits)."""
        contents = sorted((os.path.basename(p), h) for p, h in self.sources.items())
        return _sha([self.base_key, contents])[:16]

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

    def inductor_dir(self, active: bool = True) -> contextlib.AbstractContextManager[None]:
        """Point Inductor's own cache at ``<root>/inductor`` for the block.

        An artifact holds the generated code, but on CPU not the C++ kernels built from it; with
        Inductor's kernel cache kept beside the artifacts (not in a temporary directory another
        boot or container loses), a warm start reuses the built kernels instead of running the
        C++ compiler again. Uses torch's own scoped helper, which restores the environment.
        """
        if not active:
            return contextlib.nullcontext()
        try:
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        except ImportError:  # pragma: no cover - older torch: Inductor keeps its default dir
            return contextlib.nullcontext()
        try:
            path = ensure_private_dir(self.root / "inductor")
        except OSError as exc:
            logger.warning("cannot create %s (%s); Inductor keeps its default cache directory",
                           self.root / "inductor", exc)
            return contextlib.nullcontext()
        return temporary_cache_dir(str(path))

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
    def save_trace(self, payload: bytes, meta: Mapping[str, Any] | None = None) -> Path:
        """Save the Dynamo trace of this model and point ``models/<base key>.json`` at it."""
        entry = self._entry()
        path = entry / _TRACE_NAME
        atomic_write(path, pack_artifact(payload, dict(meta or {})))
        models = ensure_private_dir(self.root / "models")
        pointer = {"key": self.key, "sources": self.sources}
        atomic_write(models / f"{self.base_key}.json",
                     json.dumps(pointer, indent=2, sort_keys=True).encode())
        self._inc("artifacts_saved")
        return path

    def load_trace(self) -> tuple[dict[str, Any], bytes] | None:
        """The saved trace for this model if every source file it recorded is unchanged.

        On success the recorded sources become this cache's sources (the key is fixed). On any
        mismatch or damage, returns None and the caller traces with Dynamo as usual.
        """
        pointer_path = self.root / "models" / f"{self.base_key}.json"
        try:
            pointer = json.loads(pointer_path.read_text())
            key, recorded = pointer["key"], dict(pointer["sources"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("saved-trace pointer %s is unreadable (%s); tracing", pointer_path, exc)
            return None
        if not isinstance(key, str) or not _KEY_RE.match(key):
            return None
        current = hash_sources(recorded)
        if current != recorded:
            changed = sorted(p for p in recorded if current.get(p) != recorded[p])
            logger.info("traced sources changed since the trace was saved (%s); tracing again",
                        ", ".join(changed[:5]))
            return None
        found = self._read_verified(self.root / key / _TRACE_NAME)
        if found is None:
            return None
        if self._sources is None:
            self._traced_files = set(recorded)
            self._sources = recorded
        if self.key != key:  # other sources recorded already; the pointer is not for us
            return None
        self._inc("artifacts_loaded")
        return found

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
    if wanted is None:  # everything: Inductor's kernel cache kept beside the entries too
        shutil.rmtree(root / "inductor", ignore_errors=True)
    models = root / "models"
    if models.is_dir():
        for pointer in models.glob("*.json"):
            try:
                key = json.loads(pointer.read_text()).get("key")
            except (OSError, ValueError, AttributeError):
                key = None
            if wanted is None or key in wanted or key is None:
                with contextlib.suppress(OSError):
                    pointer.unlink()
    return removed


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
    """The ``cache=`` object of :class:`~freezeframe.compile.compilers.CompilerManager`.

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
            self.cache.discard(path, f"{type(exc).__name__}: {exc}")
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
    graph inputs exactly as Dynamo's bytecode did (same source expressions), calls the compiled
    graph and rebuilds the return value from the graph outputs."""

    def __init__(self, module: Any, sources: Sequence[str], out_spec: str,
                 out_leaves: Sequence[tuple[str, Any]]) -> None:
        import torch.utils._pytree as pytree

        func: Any = module.forward.__func__
        code = func.__code__
        nargs = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:nargs])
        params = names[: code.co_argcount]
        if code.co_posonlyargcount:
            params.insert(code.co_posonlyargcount, "/")
        extra = code.co_argcount
        if code.co_flags & inspect.CO_VARARGS:
            params.append("*" + code.co_varnames[nargs])
            extra += 1
        elif code.co_kwonlyargcount:
            params.append("*")
        params.extend(names[code.co_argcount:])
        if code.co_flags & inspect.CO_VARKEYWORDS:
            params.append("**" + code.co_varnames[nargs + (1 if code.co_flags &
                                                            inspect.CO_VARARGS else 0)])
        local_names = [p.lstrip("*") for p in params if p not in ("/", "*")]
        frame = ", ".join(f"{n!r}: {n}" for n in local_names)
        body = ", ".join(sources)
        # L mirrors the frame Dynamo traced (its locals at entry), G the forward's globals.
        text = (f"def _bind({', '.join(params)}):\n    L = {{{frame}}}\n"
                f"    return ({body},)\n")
        namespace: dict[str, Any] = {"G": func.__globals__, "__builtins__": {}}
        exec(compile(text, "<freezeframe saved trace>", "exec"), namespace)
        bind = namespace["_bind"]
        bind.__defaults__ = func.__defaults__
        bind.__kwdefaults__ = func.__kwdefaults__
        self._module = module
        self._bind = bind
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


class ModelCache:
    """Drives the cache for one :class:`~freezeframe.compile.model.CompiledModel`.

    The compile path calls :meth:`wrap_backend` around its Dynamo backend when it builds the
    trace, and routes calls through :meth:`__call__` (in place of the trace-once callable).
    The first call opens the cache (the input signature is part of the key), takes the model
    lock and then either

    * loads the saved trace (sources unchanged) and feeds the stored graph to the backend, so
      Dynamo never runs and every Inductor piece comes from an artifact; or
    * traces with Dynamo as usual, records the traced files, and saves the trace afterwards
      when the forward's inputs and outputs can be expressed without Dynamo's bytecode.

    The saved trace assumes what trace-once already assumes: guards are dropped and forward has
    no Python side effects outside the graph.
    """

    def __init__(self, model: Any, dynamic_arg_dims: Mapping[str, Any] | None = None, *,
                 model_key: str | None = None) -> None:
        self._model = model
        self._dims = dict(dynamic_arg_dims or {})
        self._user_key = model_key
        self.trace: Callable[..., Any] | None = None  # the trace-once callable, set by the model
        self._backend: Callable[..., Any] | None = None
        self._recorder: _OutputRecorder | None = None
        self._graph_blob: bytes | None = None
        self._sources: list[str] | None = None
        self._run: Callable[..., Any] | None = None
        self.cache: CompileCache | None = None
        self.trace_loaded = False

    # -- hooks for the compile path -------------------------------------------------------
    def wrap_backend(self, backend: Callable[..., Any]) -> Callable[..., Any]:
        """The Dynamo backend to trace with: records traced files for the key and keeps what
        the saved trace needs, then calls ``backend``."""
        self._backend = backend

        def cached_backend(gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            if self.cache is not None:
                self.cache.add_traced_files(traced_files_from_graph(gm))
                self._keep_graph(gm)
            fn = backend(gm, example_inputs)
            if self.cache is not None and self._graph_blob is not None:
                self._recorder = _OutputRecorder(fn)
                return self._recorder
            return fn

        return cached_backend

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
        self.cache = CompileCache.open(model.config, stats=model.stats, module=model.module,
                                       args=args, kwargs=kwargs, dynamic_arg_dims=self._dims,
                                       model_key=self._user_key)
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
            self._save_trace(out)
        self._run = trace
        return out

    def _keep_graph(self, gm: Any) -> None:
        try:
            from torch.fx._graph_pickler import GraphPickler, Options
        except ImportError:  # pragma: no cover - torch without a graph pickler
            return
        sources = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            name = _source_name(node)
            if name is None or not (name.startswith("L[") or name.startswith("G[")):
                logger.debug("graph input %s has no plain source; no saved trace", node.name)
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
            logger.info("the traced graph cannot be serialised (%s: %s); warm starts will "
                        "trace with Dynamo", type(exc).__name__, exc,
                        exc_info=logger.isEnabledFor(logging.DEBUG))
            return
        finally:
            for (node, key), value in stripped.items():
                node.meta[key] = value
        self._sources = sources

    def _save_trace(self, out: Any) -> None:
        import pickle

        import torch
        import torch.utils._pytree as pytree

        cache, rec = self.cache, self._recorder
        if cache is None or rec is None or rec.outputs is None or self._sources is None:
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
                logger.info("forward returns a value that is not a graph output; warm starts "
                            "will trace with Dynamo")
                return
        try:
            spec_text = pytree.treespec_dumps(spec)
        except Exception as exc:
            logger.info("forward's return structure cannot be saved (%s); warm starts will "
                        "trace with Dynamo", exc)
            return
        payload = pickle.dumps({"graph": self._graph_blob, "sources": self._sources,
                                "out_spec": spec_text, "out_leaves": described})
        try:
            cache.save_trace(payload, {"inputs": len(self._sources)})
        except CacheError:
            raise
        except Exception as exc:
            logger.warning("could not save the trace (%s: %s)", type(exc).__name__, exc)

    def _try_saved_trace(self, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Callable[..., Any] | None:
        import pickle

        cache = self.cache
        if cache is None or self._backend is None:
            return None
        if getattr(getattr(self._model.module, "forward", None), "__func__", None) is None:
            return None
        found = cache.load_trace()
        if found is None:
            return None
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx._graph_pickler import GraphPickler
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            data = pickle.loads(found[1])
            fake_mode = FakeTensorMode(shape_env=ShapeEnv())
            gm: Any = GraphPickler.loads(data["graph"], fake_mode)
            gm.recompile()
            example_inputs = [n.meta.get("example_value", n.meta.get("val"))
                              for n in gm.graph.nodes if n.op == "placeholder"]
            _propagate_fake_values(gm, example_inputs, fake_mode)
            loaded = _LoadedTrace(self._model.module, data["sources"], data["out_spec"],
                                  data["out_leaves"])
        except Exception as exc:
            cache.discard(cache.trace_path(), f"{type(exc).__name__}: {exc}")
            return None
        mismatch = _first_mismatch(loaded.bind(*args, **kwargs), example_inputs)
        if mismatch is not None:
            logger.info("the saved trace does not fit this call (%s); tracing with Dynamo",
                        mismatch)
            return None
        loaded.fn = self._backend(gm, example_inputs)  # compile errors here are real errors
        self.trace_loaded = True
        self._model.stats.inc("traces_loaded")
        logger.info("loaded the saved trace from %s; Dynamo did not run", cache.entry_dir)
        return loaded


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
