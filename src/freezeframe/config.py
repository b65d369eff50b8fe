"""The frozen, validated :class:`CompilationConfig` (its modes: :mod:`freezeframe.modes`).

Field names follow vLLM's ``CompilationConfig`` for everything we support, so a vLLM
compilation-config JSON with those fields is accepted as it is (the checks each field's value
goes through, and vLLM's key aliases, are :mod:`freezeframe.config_fields`). The config
resolves every derived value (capture sizes, compile sizes, graph mode after the splitting-op
rules) once, in ``__post_init__``; later code reads resolved values and never re-derives them.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from freezeframe.config_fields import (
    as_tuple,
    check_collective_splits,
    check_custom_ops,
    check_pass_config,
    normalise_keys,
    normalise_op_name,
    positive_int,
)
from freezeframe.errors import ConfigError
from freezeframe.modes import CompilationMode, CUDAGraphMode, check_piecewise_compilation
from freezeframe.sizes import (
    Range,
    compile_ranges,
    default_ladder,
    default_max_capture_size,
    padded_size,
    round_sizes_for_spec_decode,
)

__all__ = ["CUDAGraphMode", "CompilationConfig", "CompilationMode", "Range",
           "breakable_capture", "check_piecewise_compilation"]

logger = logging.getLogger(__name__)


_BACKENDS = ("eager", "inductor")
_GRAPH_BACKENDS = ("auto", "cuda", "emulated")
CAPTURE_SIZES_TOKEN = "cudagraph_capture_sizes"

# Fields that do not change compiled code and so stay out of cache_key().
_NOT_IN_CACHE_KEY = frozenset({"cache_dir", "debug", "use_cache", "graph_backend",
                               "cudagraph_num_of_warmups", "custom_ops", "pass_config"})



def breakable_capture(config: CompilationConfig) -> bool:
    """Whether ``config`` captures its PIECEWISE graphs breakable, over the forward as it runs
    (mode NONE or STOCK_TORCH_COMPILE with PIECEWISE graphs), rather than per traced piece."""
    graph_mode = config.cudagraph_mode
    return (isinstance(graph_mode, CUDAGraphMode) and graph_mode.has_piecewise_cudagraphs()
            and config.mode in (CompilationMode.NONE, CompilationMode.STOCK_TORCH_COMPILE))


@dataclasses.dataclass(frozen=True, eq=True)
class CompilationConfig:
    """Everything that decides how a model is compiled and captured.

    Given values are validated and the derived ones resolved in ``__post_init__``; after that
    each field holds its *resolved* value (``cudagraph_capture_sizes`` is the sorted tuple of
    sizes actually captured, ``cudagraph_mode`` the mode after the splitting-op rules).
    """

    # -- compilation ---------------------------------------------------------------------
    mode: CompilationMode | int | str = CompilationMode.PIECEWISE
    backend: str = "inductor"
    """The compiler for each piece: "eager" (no code generation) or "inductor". The field keeps
    vLLM's name so a vLLM compilation JSON reads unchanged; freezeframe's own code and docs call
    it the *compiler* (a "graph backend" is ``graph_backend``; Dynamo's backend is only the
    function ``ff.compile`` hands to ``torch.compile``)."""
    splitting_ops: Sequence[str] | None = None
    """Ops the graph is split at. ``None``: no split (one piece). ``[]`` explicitly asks for
    no split and turns PIECEWISE graphs off (see the splitting-op rules)."""
    compile_sizes: Sequence[int | str] | None = None
    compile_ranges_endpoints: Sequence[int] | None = None
    inductor_compile_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inductor_passes: Mapping[str, str | Callable[..., Any]] = dataclasses.field(
        default_factory=dict)
    # -- CUDA graphs ---------------------------------------------------------------------
    cudagraph_mode: CUDAGraphMode | str | None = None
    cudagraph_capture_sizes: Sequence[int] | None = None
    max_cudagraph_capture_size: int | None = None
    cudagraph_num_of_warmups: int = 0
    cudagraph_copy_inputs: bool = False
    cudagraph_specialize_lora: bool = True
    graph_backend: str = "auto"
    """How graphs are captured: "cuda" (torch.cuda.CUDAGraph), "emulated" (a faithful CPU
    stand-in for tests and CI) or "auto" (cuda when available, else graphs off)."""
    # -- batch limits the size rules need ------------------------------------------------
    max_num_tokens: int = 8192
    max_num_seqs: int = 256
    num_speculative_tokens: int = 0
    max_loras: int = 0
    # -- micro-batching ------------------------------------------------------------------
    micro_batching: bool = False
    num_micro_batches: int = 2
    micro_batch_decode_threshold: int = 32
    micro_batch_prefill_threshold: int = 512
    # -- cache and debugging -------------------------------------------------------------
    cache_dir: str = ""
    use_cache: bool = True
    debug: bool = False
    # -- vLLM fields accepted for its JSON, without effect here --------------------------
    custom_ops: Sequence[str] = ()
    """vLLM's switch between its ops' native and custom kernels (``["all"]``, ``["none"]``,
    ``["+rms_norm", "-silu_and_mul"]``). Checked for vLLM's syntax and otherwise without effect:
    freezeframe compiles the module as written and has no ops with two implementations to
    choose between (see docs/vllm_config.md)."""
    pass_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """vLLM's fusion-pass switches. Accepted when off (false or null); any switch turned on is
    a ConfigError naming it: freezeframe has none of these passes (see docs/vllm_config.md)."""

    # ------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        set_ = object.__setattr__
        # The raw inputs, kept so replace() re-derives everything from what the user asked for
        # (not from resolved values, which would pin the old ladder); also used for pickling.
        set_(self, "_given", {
            f.name: (dict(v) if isinstance(v, Mapping) else v)
            for f in dataclasses.fields(self) for v in (getattr(self, f.name),)})
        mode = CompilationMode.parse(self.mode)
        set_(self, "mode", mode)

        backend = str(self.backend or "inductor").strip().lower()
        if backend not in _BACKENDS:
            raise ConfigError(
                f"backend: unknown compiler {self.backend!r}; use one of {list(_BACKENDS)}")
        set_(self, "backend", backend)
        graph_backend = str(self.graph_backend).strip().lower()
        if graph_backend not in _GRAPH_BACKENDS:
            raise ConfigError(f"graph_backend: unknown graph backend {self.graph_backend!r}; "
                              f"use one of {list(_GRAPH_BACKENDS)}")
        set_(self, "graph_backend", graph_backend)

        for name in ("max_num_tokens", "max_num_seqs", "num_micro_batches"):
            positive_int(getattr(self, name), name)
        for name in ("num_speculative_tokens", "max_loras", "cudagraph_num_of_warmups",
                     "micro_batch_decode_threshold", "micro_batch_prefill_threshold"):
            positive_int(getattr(self, name), name, allow_zero=True)
        for name in ("cudagraph_copy_inputs", "cudagraph_specialize_lora", "use_cache", "debug",
                     "micro_batching"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not isinstance(self.cache_dir, str):
            raise ConfigError(f"cache_dir: expected a path string, got {self.cache_dir!r}")

        if not isinstance(self.inductor_compile_config, Mapping):
            raise ConfigError("inductor_compile_config: expected a mapping of Inductor config "
                              f"names to values, got {self.inductor_compile_config!r}")
        set_(self, "inductor_compile_config",
             MappingProxyType(dict(self.inductor_compile_config)))
        if not isinstance(self.inductor_passes, Mapping):
            raise ConfigError("inductor_passes: expected a mapping of names to callables or "
                              f"qualified names, got {self.inductor_passes!r}")
        set_(self, "inductor_passes", MappingProxyType(dict(self.inductor_passes)))
        set_(self, "custom_ops", check_custom_ops(self.custom_ops))
        if self.custom_ops:
            logger.info("custom_ops %s has no effect in freezeframe: the module's ops run as "
                        "written (there are no vLLM custom ops to switch)", list(self.custom_ops))
        set_(self, "pass_config", MappingProxyType(check_pass_config(self.pass_config)))

        self._resolve_splitting_ops_and_graph_mode()
        self._resolve_capture_sizes()
        self._resolve_compile_sizes()
        self._resolve_compile_ranges()
        if self.micro_batching and self.num_micro_batches < 2:
            raise ConfigError("num_micro_batches: micro-batching needs at least 2 micro-batches, "
                              f"got {self.num_micro_batches}")

    # -- resolution steps ----------------------------------------------------------------
    def _resolve_splitting_ops_and_graph_mode(self) -> None:
        set_ = object.__setattr__
        mode = CompilationMode.parse(self.mode)
        ops: tuple[str, ...] | None = None
        if self.splitting_ops is not None:
            ops = tuple(dict.fromkeys(normalise_op_name(op)
                                      for op in as_tuple(self.splitting_ops, "splitting_ops")))
        if self.cudagraph_mode is None:
            graph_mode = (CUDAGraphMode.PIECEWISE if mode is CompilationMode.PIECEWISE
                          else CUDAGraphMode.NONE)
        else:
            graph_mode = CUDAGraphMode.parse(self.cudagraph_mode)

        if mode is not CompilationMode.PIECEWISE:
            ops = ops if ops is not None else ()
        elif ops is not None and len(ops) == 0:
            if graph_mode is CUDAGraphMode.PIECEWISE:
                logger.warning("splitting_ops=[] with cudagraph_mode PIECEWISE: nothing is split, "
                               "so piecewise graphs are off; cudagraph_mode is now NONE")
                graph_mode = CUDAGraphMode.NONE
            elif graph_mode is CUDAGraphMode.FULL_AND_PIECEWISE:
                logger.warning("splitting_ops=[] with cudagraph_mode FULL_AND_PIECEWISE: nothing "
                               "is split, so only full graphs are captured; cudagraph_mode is "
                               "now FULL")
                graph_mode = CUDAGraphMode.FULL
        check_piecewise_compilation(graph_mode, mode, ops)
        check_collective_splits(ops or ())
        set_(self, "splitting_ops", ops if ops is None else tuple(ops))
        set_(self, "cudagraph_mode", graph_mode)

    def _resolve_capture_sizes(self) -> None:
        set_ = object.__setattr__
        assert isinstance(self.cudagraph_mode, CUDAGraphMode)
        user_list = self.cudagraph_capture_sizes
        user_max = self.max_cudagraph_capture_size
        if user_max is not None:
            positive_int(user_max, "max_cudagraph_capture_size", allow_zero=True)
        if user_list is not None:
            for s in as_tuple(user_list, "cudagraph_capture_sizes"):
                positive_int(s, "cudagraph_capture_sizes entry")
        if user_max == 0 and not user_list and self.cudagraph_mode is not CUDAGraphMode.NONE:
            # A largest graph of 0 tokens asks for no graphs: graphs are off, as with
            # cudagraph_mode NONE (vLLM's resolved form of graphs off is this same pair).
            logger.info("max_cudagraph_capture_size=0: no CUDA graphs; cudagraph_mode %s is "
                        "now NONE", self.cudagraph_mode.name)
            set_(self, "cudagraph_mode", CUDAGraphMode.NONE)
        if self.cudagraph_mode is CUDAGraphMode.NONE:
            set_(self, "cudagraph_capture_sizes", ())
            set_(self, "max_cudagraph_capture_size", 0)
            return

        sizes = self._capture_sizes(user_list, user_max)
        set_(self, "cudagraph_capture_sizes", tuple(sizes))
        set_(self, "max_cudagraph_capture_size", sizes[-1])

    def _capture_sizes(self, user_list: Sequence[int] | None, user_max: int | None) -> list[int]:
        """The sizes to capture while graphs are on: the user's list (less the sizes above
        ``max_num_tokens``) or the default ladder, checked against the user's maximum and
        rounded for speculative decoding."""
        assert isinstance(self.cudagraph_mode, CUDAGraphMode)
        if user_max is not None:
            max_size = min(user_max, self.max_num_tokens)
        else:
            max_size = default_max_capture_size(self.max_num_seqs, self.num_speculative_tokens,
                                                self.max_num_tokens)
        if user_list is not None:
            sizes = sorted({s for s in user_list if s <= self.max_num_tokens})
            if not sizes:
                raise ConfigError(
                    f"cudagraph_capture_sizes: {list(user_list)} leaves no size to capture (sizes "
                    f"above max_num_tokens={self.max_num_tokens} are dropped) while "
                    f"cudagraph_mode is {self.cudagraph_mode.name}; give at least one size or "
                    "set cudagraph_mode='none'")
        else:  # (the decode sizes are in it: nothing to round)
            sizes = default_ladder(max_size, self.max_num_seqs, 1 + self.num_speculative_tokens)
        valid_max = sizes[-1]
        if user_max is not None and user_max != valid_max:
            if user_list is not None:
                raise ConfigError(
                    f"max_cudagraph_capture_size={user_max} disagrees with the largest of "
                    f"cudagraph_capture_sizes={sizes} ({valid_max}); give only one of the two or "
                    "make them agree")
            logger.warning("Truncating max_cudagraph_capture_size from %d to %d: no batch "
                           "has more than max_num_tokens=%d tokens", user_max, valid_max,
                           self.max_num_tokens)
        if user_list is not None and len(sizes) < len(set(user_list)):
            logger.warning("cudagraph_capture_sizes above max_num_tokens=%d were dropped: %s",
                           self.max_num_tokens, sorted(set(user_list) - set(sizes)))
        if self.num_speculative_tokens > 0 and user_list is not None:
            multiple = 1 + self.num_speculative_tokens
            try:
                sizes = round_sizes_for_spec_decode(sizes, multiple, valid_max)
            except ValueError as exc:
                raise ConfigError(f"cudagraph_capture_sizes: {exc}") from None
        return sizes

    def _resolve_compile_sizes(self) -> None:
        if self.compile_sizes is None:
            object.__setattr__(self, "compile_sizes", ())
            return
        out: set[int] = set()
        for s in as_tuple(self.compile_sizes, "compile_sizes"):
            if s == CAPTURE_SIZES_TOKEN:
                out.update(self.cudagraph_capture_sizes or ())
            elif isinstance(s, str):
                raise ConfigError(f"compile_sizes: unknown entry {s!r}; entries are ints or the "
                                  f"string {CAPTURE_SIZES_TOKEN!r}")
            else:
                out.add(positive_int(s, "compile_sizes entry"))
        sizes = sorted(out)
        too_big = [s for s in sizes if s > self.max_num_tokens]
        if too_big:
            raise ConfigError(
                f"compile_sizes: {too_big} exceed max_num_tokens={self.max_num_tokens}, so no "
                "batch would ever run them; drop them or raise max_num_tokens")
        if self.cudagraph_mode is not CUDAGraphMode.NONE:
            capture = list(self.cudagraph_capture_sizes or ())
            for s in sizes:
                padded = padded_size(s, capture)
                if padded is not None and padded != s:
                    fix = f"add {s} to cudagraph_capture_sizes or compile {padded} instead"
                    if self.num_speculative_tokens:
                        fix = (f"the capture sizes are rounded up to multiples of "
                               f"1 + num_speculative_tokens = {1 + self.num_speculative_tokens}"
                               f" (a decode step's tokens): compile {padded} instead")
                    raise ConfigError(
                        f"compile_sizes: size {s} would be padded to {padded} by the capture "
                        f"sizes {capture}, so its compiled code would never run under a graph; "
                        f"{fix}")
        object.__setattr__(self, "compile_sizes", tuple(sizes))

    def _resolve_compile_ranges(self) -> None:
        if self.compile_ranges_endpoints is None:
            object.__setattr__(self, "compile_ranges_endpoints", ())
            return
        ends = as_tuple(self.compile_ranges_endpoints, "compile_ranges_endpoints")
        for e in ends:
            positive_int(e, "compile_ranges_endpoints entry")
            if e > self.max_num_tokens:
                raise ConfigError(
                    f"compile_ranges_endpoints: endpoint {e} is above max_num_tokens="
                    f"{self.max_num_tokens}; ranges end at max_num_tokens anyway, so drop it or "
                    "raise max_num_tokens")
        if 1 in ends:
            # A range [1, 1] would be compiled with a symbolic size that Dynamo specialises
            # anyway (0/1 specialisation); vLLM ignores this endpoint too.
            logger.warning("compile_ranges_endpoints: endpoint 1 ignored (the first range "
                           "always starts at 1; use compile_sizes=[1] for a size-1 compile)")
        kept = sorted({e for e in ends if e > 1})
        object.__setattr__(self, "compile_ranges_endpoints", tuple(kept))

    # -- derived views -------------------------------------------------------------------
    def compile_ranges(self) -> list[Range]:
        """The symbolic-shape compile ranges, e.g. ``[1,8] [9,32] [33,8192]``."""
        return compile_ranges(self.compile_ranges_endpoints or (), self.max_num_tokens)

    def padded_size(self, num_tokens: int) -> int | None:
        """The capture size a batch of ``num_tokens`` pads to, or ``None`` (no graph)."""
        return padded_size(num_tokens, self.cudagraph_capture_sizes or ())

    # -- (de)serialisation ---------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompilationConfig:
        """Build from a mapping, such as a vLLM compilation-config JSON object."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a compilation config must be a JSON object, got {data!r}")
        return cls(**normalise_keys(data, cls.field_names()))

    @classmethod
    def from_json(cls, text: str) -> CompilationConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"compilation config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON-able values; ``from_dict`` of it is equal."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.name.lower()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = {k: _qualname(v) for k, v in value.items()}
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def cache_key(self) -> str:
        """A stable hash of the fields that change compiled code (not cache_dir, debug, ...).

        Equal configs give equal keys in every process; a callable pass counts by its qualified
        name and its source (or its own ``uuid()``), so editing a pass changes the key.
        """
        data = {f.name: _fingerprint(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in _NOT_IN_CACHE_KEY}
        blob = json.dumps(data, sort_keys=True, default=repr).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=repr))

    def replace(self, **changes: Any) -> CompilationConfig:
        """A copy with ``changes`` applied to the values the user gave, everything re-derived
        and re-validated (so ``replace(max_num_seqs=8)`` gets the ladder for 8 sequences)."""
        given: dict[str, Any] = dict(getattr(self, "_given", None) or self.to_dict())
        given.update(normalise_keys(changes, self.field_names()))
        return CompilationConfig(**given)

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType fields cannot be pickled or deep-copied; rebuild from the inputs.
        return (_rebuild, (dict(getattr(self, "_given", None) or self.to_dict()),))


def _rebuild(given: dict[str, Any]) -> CompilationConfig:
    return CompilationConfig(**given)


def _qualname(value: Any) -> Any:
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
    return value


def _fingerprint(value: Any) -> Any:
    """A JSON-able value that is equal across processes for equal inputs."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return {str(k): _fingerprint(v) for k, v in items}
    if isinstance(value, (list, tuple)):
        return [_fingerprint(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        uuid = getattr(value, "uuid", None)
        if callable(uuid):
            return f"uuid:{uuid()}"
        try:
            source = inspect.getsource(value)
        except (OSError, TypeError):
            source = ""
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        return f"{_qualname(value)}#{digest}"
    return f"{type(value).__qualname__}:{value!r}"
