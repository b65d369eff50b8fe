"""The saved trace: a Dynamo trace written down so that a warm start can skip Dynamo.

Holds what a saved trace is made of: the rebuilt traced frame (:class:`_Frame`) in which the
sources of its graph inputs and of its value checks are evaluated, the sizes it assumed
(:class:`_SavedSizes`), the stored FX graph (:func:`_load_graph`), whether a call's inputs fit
its placeholders (:func:`_first_mismatch`), and the forward that stands in for Dynamo's bytecode
(:class:`_LoadedTrace`). It does not hold the values the trace specialised on nor how they are
re-checked (:mod:`freezeframe.compilation.guard_checks`), decide when a trace is saved or loaded
(:mod:`freezeframe.compilation.cached_trace`), nor decide where it is kept
(:class:`freezeframe.cache.entry.CompileCache`, which stores the checks as plain rows).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from freezeframe.compilation.constant_stores import ConstantStore, imported_module, resolve
from freezeframe.compilation.constant_stores import apply as apply_stores
from freezeframe.compilation.signature import Signer
from freezeframe.compilation.size_conditions import SizeGuards
from freezeframe.errors import CacheError

__all__ = ["missing_values", "valued_nodes"]


# Dynamo names the globals it installs ``<prefix>_<n>`` with a dunder prefix; the numbers differ
# between processes.
_INSTALLED_RE = re.compile(r"^__\w*_\d+$|^\w*_\d{6,}_c\d+$")  # (torch 2.13: <prefix>_<id>_c<n>)
_GLOBAL_NAME_RE = re.compile(r"G\[['\"]([^'\"]+)['\"]\]")


class _GlobalScope:
    """``G`` in a guard's or a graph input's source: the traced frame's globals, read live.

    Dynamo adds ``__import_<module>`` aliases to those globals while it traces (the globals of a
    function it inlined from another module) and ``__builtins_dict___<n>`` (the frame's
    builtins); a process that did not run Dynamo lacks them, so they are resolved to what they
    name, in every process alike. Any other global Dynamo installed (``<prefix>_<n>``) is
    refused, at save and at load alike, so a trace that needs one is never saved.
    """

    __slots__ = ("_globals", "modules")

    def __init__(self, globals_: Mapping[str, Any],
                 modules: Mapping[str, str] | None = None) -> None:
        self._globals = globals_
        # installed globals that hold a module (torch 2.13 installs ``torch`` by id), by the
        # module's name: recorded at save (:func:`installed_modules`), resolved at load
        self.modules = dict(modules or {})

    def __getitem__(self, name: str) -> Any:
        module_name = self.modules.get(name)
        if module_name is not None:
            return sys.modules.get(module_name) or importlib.import_module(module_name)
        module = imported_module(name)
        if module is not None:
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

    def __init__(self, module: Any, kind: str, modules: Mapping[str, str] | None = None) -> None:
        func: Any = module.forward.__func__
        self.kind = kind
        self.module = module
        if kind == "forward":
            params = _parameter_list(func.__code__)
            names = [p.lstrip("*") for p in params if p not in ("/", "*")]
            self._head = ", ".join(params)
            self._locals = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
            self.argument_roots = frozenset(names[1:])
            self.parameters = frozenset(names)
            self._defaults = (func.__defaults__, func.__kwdefaults__)
            globals_ = func.__globals__
        elif kind == "wrapped":
            self._head = "_ff_self, *args, **kwargs"
            self._locals = "{'args': args, 'kwargs': kwargs, 'fn': _ff_fn}"
            self.argument_roots = frozenset({"args", "kwargs"})
            self.parameters = frozenset()
            self._defaults = (None, None)
            code = _wrapped_frame_code()
            if code is None:  # pragma: no cover - depends on the torch build
                raise CacheError("this torch has no wrapper frame to rebuild")
            from torch._dynamo import external_utils

            globals_ = vars(external_utils)
        else:
            raise CacheError(f"unknown traced frame kind {kind!r}")
        self.globals = _GlobalScope(globals_, modules)
        self._raw_globals = globals_

    def installed_modules(self, sources: Sequence[str]) -> dict[str, str]:
        """The globals Dynamo installed by id that ``sources`` read and that hold a module
        (``G['_140619971177152_c0'].Tensor``: torch), by module name, so another process can
        resolve them; installed globals holding anything else stay refused."""
        found: dict[str, str] = {}
        for text in sources:
            for name in _GLOBAL_NAME_RE.findall(text):
                value = self._raw_globals.get(name)
                if _INSTALLED_RE.match(name) and isinstance(value, types.ModuleType) \
                        and imported_module(name) is None:
                    found[name] = value.__name__
        self.globals.modules.update(found)
        return found

    def function(self, body: str, lines: Sequence[str] = (), *, frame_locals: bool = True,
                 **names: Any) -> Callable[..., Any]:
        """``def f(<frame parameters>): L = <frame locals>; <lines>; return <body>``,
        compiled (without ``L`` when ``frame_locals`` is False: the code reads the parameters
        by name); ``lines`` and ``body`` may also read ``names`` (each starting with
        ``_ff_``)."""
        assert all(name.startswith("_ff_") for name in names), names
        statements = "".join(f"    {line}\n" for line in lines)
        head = f"    L = {self._locals}\n" if frame_locals else ""
        text = f"def _f({self._head}):\n{head}{statements}    return {body}\n"
        namespace: dict[str, Any] = {"G": self.globals, "_ff_fn": self.module.forward,
                                     "__builtins__": {}, **names}
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
                 out_leaves: Sequence[tuple[str, Any]],
                 stores: Sequence[ConstantStore] = ()) -> None:
        import torch.utils._pytree as pytree

        self._module = frame.module
        self._bind = frame.function(f"({', '.join(sources)},)")
        self.fn: Callable[..., Any] | None = None  # the compiled graph, set once checked
        self._spec = pytree.treespec_loads(out_spec)
        self._leaves = list(out_leaves)
        self._unflatten = pytree.tree_unflatten
        self._single = self._spec.is_leaf() and self._leaves[0][0] == "out"
        # forward's constant stores, repeated after each call as Dynamo's code did them
        self._stores = resolve(stores)

    @property
    def has_stores(self) -> bool:
        """Whether each call repeats constant stores of forward's (Python side effects)."""
        return bool(self._stores)

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The graph inputs for a call, evaluated as Dynamo's bytecode would."""
        return self._bind(self._module, *args, **kwargs)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs = self.fn(*self._bind(self._module, *args, **kwargs))  # type: ignore[misc]
        if self._stores:
            apply_stores(self._stores)
        if self._single:
            return outs[self._leaves[0][1]]
        leaves = [outs[v] if kind == "out" else v for kind, v in self._leaves]
        return self._unflatten(leaves, self._spec)


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
    def of(trace: Any, signer: Signer | None, inductor: bool, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> _SavedSizes:
        traced_at = signer.dynamic_sizes(args, kwargs) if signer is not None else {}
        return _SavedSizes(tuple(trace.size_conditions), dict(trace.size_symbols), traced_at,
                           inductor)

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

    def refuses(self, signer: Signer | None, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> str | None:
        """Why this call's sizes are not ones the saved trace serves, or None."""
        if signer is None:
            return None
        sizes = signer.dynamic_sizes(args, kwargs)
        if SizeGuards.of_trace(self.conditions, self.symbols, self.traced_at,
                               self.inductor).accepts(sizes):
            return None
        return (f"the call's sizes {dict(sizes)} are not ones the trace serves (its conditions "
                f"on sizes: {[str(c) for c, _ in self.conditions] or 'none'}, traced at "
                f"{dict(self.traced_at)})")


def _load_graph(blob: bytes, valued: Sequence[str] | None) -> tuple[Any, list[Any]]:
    """A saved graph with the fake values it was saved with, and its placeholders' values.

    ``valued`` names the nodes saved with a fake value
    (:func:`~freezeframe.compilation.trace_backend.keep_trace`: those the split
    reads). A trace saved without that list (an older version kept the placeholders' values
    only) or whose values do not all come back is refused with :class:`CacheError`, and the
    caller traces with Dynamo: re-deriving them by fake propagation outside Dynamo's tracing
    context can pin a symbolic size to the traced one (``F.pad`` reads it as an int).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if valued is None:
        raise CacheError("the saved graph has no list of its stored fake values")
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm: Any = GraphPickler.loads(blob, fake_mode)
    gm.recompile()
    missing = missing_values(gm, valued)
    if missing:
        raise CacheError(f"the fake values of {missing[:3]} did not come back")
    example_inputs = [n.meta.get("example_value", n.meta.get("val"))
                      for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, example_inputs


def valued_nodes(gm: Any) -> list[str]:
    """The names of a graph's nodes that hold a fake value (``example_value`` or ``val``)."""
    return [n.name for n in gm.graph.nodes
            if n.meta.get("example_value", n.meta.get("val")) is not None]


def missing_values(gm: Any, valued: Sequence[str]) -> list[str]:
    """The nodes named in ``valued`` that hold no fake value in ``gm``."""
    have = set(valued_nodes(gm))
    return [name for name in valued if name not in have]


def _holds_view(value: Any) -> bool:
    """Whether a node's fake value is, or (a tuple/list) holds, a tensor that is a view."""
    import torch

    if isinstance(value, (tuple, list)):
        return any(_holds_view(v) for v in value)
    return isinstance(value, torch.Tensor) and value._is_view()


def _detached(value: Any) -> Any:
    """A node's fake value with each tensor that is a view replaced by ``detach()`` of it: the
    same sizes, strides, storage offset and storage, without the view's base (which the graph
    pickler cannot write)."""
    import torch

    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, torch.Tensor) and value._is_view():
        return value.detach()
    return value


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
