"""The cache's files on disk: where the cache lives, how its files are written, checked and locked.

Holds the cache root and its switches (``FREEZEFRAME_CACHE_DIR``, ``FREEZEFRAME_DISABLE_CACHE``),
private directories, atomic self-checking files (:func:`pack_artifact`,
:class:`CorruptArtifactError`), removal of stale temporary files, the per-model file lock and
where Inductor's own cache goes. It does not hold what an entry is
(:mod:`freezeframe.cache.entry`), what goes into its key (:mod:`freezeframe.cache.key`), or
listing and clearing entries (:mod:`freezeframe.cache.inspect`).

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
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freezeframe.errors import CacheError

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.config import CompilationConfig

__all__ = [
    "CACHE_FORMAT",
    "ENV_CACHE_DIR",
    "ENV_DISABLE_CACHE",
    "CorruptArtifactError",
    "atomic_write",
    "cache_enabled",
    "check_private_dir",
    "discard_unloadable",
    "ensure_cache_root",
    "ensure_private_dir",
    "inductor_cache_path",
    "pack_artifact",
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


def _private_inductor_dir(root: Path) -> Path | None:
    """The private directory Inductor's own cache goes to for the cache root ``root``
    (:func:`inductor_cache_path`, created), or None, logged, when there is none to give it: no
    path the C++ toolchain can take, or one that cannot be created (Inductor then keeps its
    default cache directory)."""
    wanted = inductor_cache_path(root)
    if not _toolchain_safe(wanted):
        logger.warning("neither %s nor %s can be handed to the C++ compiler (spaces or "
                       "other characters it cannot take); Inductor keeps its default cache "
                       "directory", root / "inductor", wanted)
        return None
    try:
        if wanted.parent != root:
            ensure_private_dir(wanted.parent)
        path = ensure_private_dir(wanted)
    except OSError as exc:
        logger.warning("cannot create %s (%s); Inductor keeps its default cache directory",
                       wanted, exc)
        return None
    if wanted.parent != root:
        logger.info("Inductor's cache for %s is kept at %s: the root's path has characters "
                    "the C++ compiler cannot take", root, path)
    return path


def _empty_inductor_dir(path: Path) -> None:
    """Remove everything in Inductor's cache directory ``path`` (what cannot be removed stays)
    and forget the modules Inductor loaded from it, so the next compile writes it afresh."""
    for child in list(path.iterdir()) if path.is_dir() else []:
        with contextlib.suppress(OSError):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink()
    _forget_inductor_modules(path)


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


def _read_verified(path: Path) -> tuple[dict[str, Any], bytes] | None:
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


def discard_unloadable(path: Path, reason: str) -> None:
    """Remove a file that verified but failed to load (logged), so the rewrite starts clean."""
    logger.warning("cache artifact %s could not be loaded (%s); removing it and "
                   "recompiling", path, reason)
    with contextlib.suppress(OSError):
        path.unlink()


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
