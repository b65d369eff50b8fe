"""The store on disk: where the compile cache lives and how its files are written and read.

Holds the cache root and its switches (``FREEZEFRAME_CACHE_DIR``, ``FREEZEFRAME_DISABLE_CACHE``),
private directories, atomic self-checking files (:func:`pack_artifact`,
:class:`CorruptArtifactError`), the per-model file lock, removal of stale temporary files,
:class:`CompileCache` (one model's entry directory, its index, artifact files and the
``models/`` pointer to its saved traces) and, for ``freezeframe cache``, listing and clearing
entries. It does not hold what goes into the key (:mod:`freezeframe.cache.key`), how a compiled
piece is loaded or saved (:mod:`freezeframe.cache.artifacts`), or what a saved trace holds and
when one is reused (:mod:`freezeframe.compilation.saved_trace`,
:mod:`freezeframe.compilation.cached_trace`): here a saved trace is a payload and rows of checks.

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
        usage.json                  starts, piece hits and misses so far (informational)
        trace.bin                   the saved Dynamo traces (optional): one per set of values
                                    the trace specialised on, each with the checks it needs
        piece_<i>_range_<s>_<e>.bin one compiled piece for one compile range or size

Safety rules, because loading an artifact runs the code in it:

* directories are created ``0700`` and a directory that other users can write to, or that
  another user owns, is refused with :class:`~freezeframe.errors.CacheError`;
* every file is written to a temporary file in the same directory and renamed into place;
* every artifact carries its length and SHA-256 in a header; a short or altered file is logged,
  removed and treated as a miss (the piece is recompiled), never loaded;
* a per-model ``flock`` serialises concurrent processes, so the second one waits for the first
  and then loads what it saved instead of compiling the same thing again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freezeframe.cache.key import (
    _sha,
    hash_sources,
    input_signature,
    module_signature,
    torch_factors,
)
from freezeframe.errors import CacheError
from freezeframe.sizes import Range

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from freezeframe.config import CompilationConfig
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
    "ensure_cache_root",
    "ensure_private_dir",
    "list_entries",
    "pack_artifact",
    "read_index",
    "read_usage",
    "resolve_cache_root",
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
_USAGE_NAME = "usage.json"
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
    path wrote, the checks a reuse must pass (as the rows it saved, which the store does not
    read: :meth:`~freezeframe.compilation.saved_trace.ValueCheck.as_tuple`), and the digests of
    the traced code without a source file (to compare with the code the model runs now)."""

    key: str
    payload: bytes
    checks: tuple[tuple[Any, ...], ...]
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


def ensure_cache_root(root: Path) -> Path:
    """:func:`ensure_private_dir` for the cache root. A root that cannot be created (a file
    where one of its directories should be, a read-only file system, no permission) is a
    :class:`CacheError` naming the directory, the cause and the fix, as a root that is not
    private is, rather than a bare ``OSError`` out of the model's first call."""
    try:
        return ensure_private_dir(root)
    except OSError as exc:
        raise CacheError(
            f"cannot create the cache directory {root}: {_why_not_created(root, exc)}; point "
            f"config.cache_dir or {ENV_CACHE_DIR} at a directory you can write to, or turn the "
            f"cache off (use_cache=False or {ENV_DISABLE_CACHE}=1)"
        ) from None


def _why_not_created(path: Path, exc: OSError) -> str:
    """Why ``path`` could not be created: the first of its ancestors that is not a directory,
    else what the operating system said (read-only file system, permission denied)."""
    for ancestor in (path, *path.parents):
        if ancestor.is_dir():
            break
        if ancestor.is_symlink() and not ancestor.exists():
            return f"{ancestor} is a broken symbolic link, not a directory"
        if ancestor.exists():
            return f"{ancestor} is a file, not a directory"
    if exc.errno == errno.EROFS:
        return f"{exc.filename or path} is on a read-only file system"
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


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
        from freezeframe._version import __version__

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
        found = self.load_artifact_with_header(piece_index, compile_range, graph_key)
        return None if found is None else (found[0], found[1])

    def load_artifact_with_header(self, piece_index: int, compile_range: Any,
                                  graph_key: str | None = None
                                  ) -> tuple[Path, bytes, dict[str, Any]] | None:
        """:meth:`load_artifact` with the artifact's header (what :meth:`save_artifact` wrote:
        piece, range, graph, compiler and its ``host`` record)."""
        path = self.entry_dir / artifact_name(piece_index, compile_range)
        found = self._read_verified(path)
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

    # -- the saved trace -------------------------------------------------------------------
    # Dynamo builds a trace's guards only after the backend has compiled (and looked up) every
    # piece, so the entry key, fixed by then, cannot hold the values the trace specialised on.
    # Those values select a *variant* inside the entry instead: trace.bin keeps one saved trace
    # per distinct set of checked values (newest first), so two instances of one class with
    # different values each warm-start from their own trace instead of replacing each other's.
    # The pieces need no such split: each artifact is checked against its piece's graph_hash,
    # whose generated code holds the constants baked into it.
    def save_trace(self, payload: bytes, meta: Mapping[str, Any] | None = None,
                   checks: Sequence[Sequence[Any]] = ()) -> Path:
        """Save the Dynamo trace of this model (with the checks a reuse must pass, as rows of
        plain values) beside the variants already saved for this entry, and point
        ``models/<base key>.json`` at it."""
        entry = self._entry()
        path = entry / _TRACE_NAME
        rows = [tuple(c) for c in checks]
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
                        checks=tuple(tuple(row) for row in variant["checks"]),
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
    usage: dict[str, Any] = dataclasses.field(default_factory=dict)
    damaged: tuple[str, ...] = ()
    """The entry's informational files that are damaged (``key_factors.json``,
    ``usage.json``): shown as empty; the next start of the model writes them again."""


_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _read_json_object(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)`` for a file holding a JSON object; ``(None, None)`` when there is no
    file; ``(None, why)`` when it is damaged: unreadable, not JSON, or JSON of another kind
    (``[]``, ``null``, ``7``), which no file the store writes holds."""
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
            key=child.name, path=child, size_bytes=_dir_size(child),
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
