"""The cache key: what a compiled model's cache entry depends on.

Holds the factors known before tracing (torch and toolchain, the module's structure and the
example inputs' signature), the hashes of the source files a trace read, and the hash of one
compiled piece's graph. It does not hold the digests of traced code that has no source file
(and finding that code again in a live model: :mod:`freezeframe.cache.traced_code`), the
identity of the config's Inductor passes (resolving a pass is the compile path's:
:func:`freezeframe.compilation.compilers.pass_sources`), where entries are stored
(:mod:`freezeframe.cache.entry`), or the values a trace specialised on
(:mod:`freezeframe.compilation.saved_trace`).

What decides whether something saved is reused:

* The *base key* hashes what is known before tracing: the freezeframe version, the config's
  ``cache_key()``, the source files of the config's Inductor passes, torch's version and
  Inductor's system factors, the rank and world size under ``torch.distributed``, the module's
  class, structure and public attributes, every parameter's and buffer's shape/dtype/device,
  the example-input signature (plain argument values included), and the user's optional
  ``model_key``.
* The entry *key* adds what the trace read, known only after a trace (or, on a warm start, from
  the ``models/`` pointer, re-verified before it is trusted): the contents of every source file
  Dynamo traced or inlined, and a digest of every traced code object that has no source file
  to hash (``python -c``, ``exec``, ``<stdin>``, a notebook cell): bytecode, constants (nested
  code included), names and flags (``traced_code.code_digest``). Such code is found again on a warm
  start from the module's classes, the forward's globals and the values the trace specialised
  on; code that cannot be found, or that changed, means no reuse.
* Every value the trace specialised on selects a saved trace inside the entry
  (:mod:`freezeframe.compilation.saved_trace`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import json
import logging
import os
import platform
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from freezeframe.cache.files import CACHE_FORMAT

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from freezeframe.config import CompilationConfig

__all__ = [
    "ambient_settings",
    "autocast_settings",
    "base_factors",
    "distributed_factors",
    "graph_hash",
    "hash_sources",
    "input_signature",
    "is_primitive",
    "module_signature",
    "torch_factors",
    "traced_files_from_graph",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# key factors
# ---------------------------------------------------------------------------------------------
def _sha(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def distributed_factors() -> dict[str, Any]:
    """The process's place in ``torch.distributed``: ``{"distributed": {"rank", "world_size",
    "backend"}}`` when a process group of more than one rank is initialised, ``{}`` otherwise
    (so a single process keeps the key it always had).

    Each rank gets an entry of its own: its traces may differ (a tensor-parallel shard's
    shapes, a branch on the rank), and ranks sharing one cache directory then never wait on
    each other's entry lock or take each other's pieces.
    """
    import torch

    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return {}
    return {"distributed": {"rank": int(dist.get_rank()),
                            "world_size": int(dist.get_world_size()),
                            "backend": str(dist.get_backend())}}


def torch_factors() -> dict[str, Any]:
    """torch's version and Inductor's system factors (device, CUDA/HIP and Triton versions;
    ``"no gpu"`` where torch sees no GPU), and the process's rank and world size under
    ``torch.distributed`` (:func:`distributed_factors`).

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
        **distributed_factors(),
    }
    try:  # torch 2.11-2.13 keep this in codecache; guard against it moving
        if not torch.cuda.is_available():
            # Inductor's system factors describe the GPU (device name, CUDA/HIP version) and
            # Triton; without a GPU they hash nothing, but computing them still hashes
            # Triton's files (about a second of every start).
            factors["inductor_system"] = "no gpu"
        else:
            from torch._inductor.codecache import CacheBase

            system = CacheBase.get_system()
            factors["inductor_system"] = (system.get("hash") if isinstance(system, dict)
                                          else system)
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


def is_primitive(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return all(is_primitive(v) for v in value)
    return False


def _describe(value: Any) -> Any:
    """A stable description of a module attribute for the key: plain values as themselves,
    tensors by shape/dtype (a KV cache kept as a plain attribute), dataclasses by their fields,
    anything else by type only (its repr may hold an address)."""
    import torch

    if is_primitive(value):
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
        elif is_primitive(value):
            out.append([name, "value", value])
        else:
            out.append([name, "object", type(value).__qualname__])
    return out


def base_factors(config: CompilationConfig, module: torch.nn.Module | None,
                 args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                 dynamic_arg_dims: Mapping[str, int | Sequence[int]] | None,
                 model_key: str | None, extra_factors: Mapping[str, Any] | None,
                 inductor_passes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Every factor of a model's base key, known before it is traced
    (:meth:`~freezeframe.cache.entry.CompileCache.open`)."""
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
    return factors


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


class _Normaliser:
    """Writes the parts of one piece as plain data that does not depend on names: nodes by their
    position, symbolic sizes by the order their symbols first appear, constant tensors by their
    values, and objects it cannot describe by value by their identity in this process (so two
    pieces that hold different such objects are never taken for one)."""

    def __init__(self) -> None:
        self.symbols: dict[Any, str] = {}
        self.nodes: dict[Any, int] = {}

    def sym(self, value: Any) -> str:
        import sympy

        expr = value.node.expr if hasattr(value, "node") else value
        if not isinstance(expr, sympy.Basic):
            return repr(expr)
        for s in sorted(expr.free_symbols, key=str):
            if s not in self.symbols:
                self.symbols[s] = f"d{len(self.symbols)}"
        # printed in a fixed order of the canonical names, not of the trace's own symbols
        renamed = expr.xreplace({s: sympy.Symbol(self.symbols[s], integer=True, positive=True)
                                 for s in expr.free_symbols})
        return str(renamed)

    def tensor_meta(self, t: Any) -> list[Any]:
        return [str(t.dtype), str(t.device), [self.value(s) for s in t.shape],
                [self.value(s) for s in t.stride()], bool(t.requires_grad)]

    def tensor_value(self, t: Any) -> list[Any]:
        """A constant tensor (a ``get_attr`` of the piece): its metadata and a digest of its
        values. A tensor whose values cannot be read (a fake tensor) is described by identity."""
        import torch

        meta = self.tensor_meta(t)
        try:
            data = t.detach().to("cpu").contiguous()
            blob = data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        except Exception:  # fake, meta or an exotic layout: never equal to another tensor
            return ["tensor", meta, _identity(t)]
        return ["tensor", meta, hashlib.sha256(blob).hexdigest()]

    def value(self, a: Any) -> Any:
        import torch
        from torch import fx

        if isinstance(a, fx.Node):
            return ["node", self.nodes.get(a, a.name)]
        if isinstance(a, bool | int | float | str | type(None)):
            return [type(a).__name__, repr(a)]  # 1, 1.0, True and -0.0 stay apart
        if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
            return ["sym", type(a).__name__, self.sym(a)]
        if isinstance(a, list | tuple):
            return [type(a).__name__, [self.value(x) for x in a]]
        if isinstance(a, dict):
            return ["dict", [[self.value(k), self.value(v)] for k, v in a.items()]]
        if isinstance(a, slice):
            return ["slice", self.value(a.start), self.value(a.stop), self.value(a.step)]
        if a is Ellipsis:
            return ["..."]
        if isinstance(a, torch.dtype | torch.device | torch.layout | torch.memory_format):
            return [type(a).__name__, str(a)]
        if isinstance(a, torch.Tensor):
            return self.tensor_value(a)
        if isinstance(a, enum.Enum):
            return ["enum", type(a).__module__, type(a).__qualname__, a.name]
        return ["object", type(a).__module__, type(a).__qualname__, _identity(a)]

    def target(self, gm: Any, node: Any) -> Any:
        import torch
        from torch import fx

        target = node.target
        if node.op in ("get_attr", "call_module"):
            obj: Any = gm
            try:
                for part in str(target).split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                return ["missing", str(target)]
            if isinstance(obj, fx.GraphModule):
                return ["graph", _structure(obj, _Normaliser())]
            if isinstance(obj, torch.Tensor):
                return self.tensor_value(obj)
            return self.value(obj)
        if isinstance(target, str):  # call_method
            return target
        if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return ["op", str(target)]
        qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
        if isinstance(qualname, str):
            return ["fn", getattr(target, "__module__", None), qualname]
        return self.value(target)


_PROCESS_TOKEN = f"{os.getpid()}-{id(_Normaliser)}"


def _identity(obj: Any) -> str:
    """Equal only for the same object in the same process (and never across processes)."""
    return f"id:{id(obj)}@{_PROCESS_TOKEN}"


def _structure(gm: Any, norm: _Normaliser) -> list[Any]:
    rows: list[Any] = []
    for i, node in enumerate(gm.graph.nodes):
        norm.nodes[node] = i
        if node.op == "placeholder":
            rows.append(["placeholder"])
            continue
        rows.append([node.op, norm.target(gm, node), norm.value(tuple(node.args)),
                     norm.value(dict(node.kwargs))])
    return rows


def graph_hash(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               extra: Any = None) -> str:
    """A structural hash of one piece: what decides the code a compiler makes of it.

    Covers, in order, every node's kind, target (an op, a function by qualified name, a method
    name), arguments (other nodes by position, constants by type and value) and keyword
    arguments; constant tensors (``get_attr``) by dtype, shape, strides and a digest of their
    values; nested graphs (a higher-order op's body) by their own structure; and every example
    input's dtype, device, sizes, strides and ``requires_grad``, symbolic sizes with their
    symbols renamed in order of first appearance; whether grad mode is on (Inductor compiles
    a piece under ``no_grad`` as an inference graph with no autograd: reused for a trace made
    with grad on, its outputs would not require grad); and the other ambient settings a
    compiler bakes into its code (:func:`ambient_settings`: autocast, the default dtype,
    deterministic algorithms): a graph Dynamo traced under ``torch.autocast`` has the same
    nodes as one traced without, and Inductor's code for the one without returns float32
    where autocast wants bfloat16. Node and placeholder names are left out,
    so the pieces of identical layers (which differ only in the names of their parameters,
    passed in as inputs) hash alike; two pieces that differ in a constant do not. An object it
    cannot describe by value is hashed by its identity in this process: such a piece is reused
    only where the very same object appears, and never found in another process's cache.

    It is stored with each saved artifact and compared on load, and it decides which pieces
    share one compiled callable (:class:`~freezeframe.compilation.compilers.CompilerManager`).
    """
    import torch

    norm = _Normaliser()
    inputs: list[Any] = []  # first, so symbols are numbered in the order of the inputs
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            inputs.append(["tensor", *norm.tensor_meta(x)])
        else:
            inputs.append(norm.value(x))
    return _sha([inputs, _structure(gm, norm), extra, torch.is_grad_enabled(),
                 ambient_settings()])[:32]


def autocast_settings() -> dict[str, str]:
    """Autocast per device type, as compiled code depends on it: ``{"autocast on cpu": "off"
    or "on (torch.bfloat16)", ...}`` (the compile key's and the per-call module check's one
    reading of it)."""
    import torch

    return {f"autocast on {device}": (f"on ({torch.get_autocast_dtype(device)})"
                                      if torch.is_autocast_enabled(device) else "off")
            for device in ("cpu", "cuda")}


def ambient_settings() -> list[Any]:
    """The process-wide settings, outside a graph's nodes, that a compiler reads when it
    compiles the graph: autocast per device type (on or off, and its dtype), the default
    dtype (of a tensor a node makes without naming one) and deterministic algorithms."""
    import torch

    return [sorted(autocast_settings().items()), str(torch.get_default_dtype()),
            torch.are_deterministic_algorithms_enabled()]
