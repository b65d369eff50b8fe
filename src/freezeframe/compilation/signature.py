"""What a trace assumed about its call, and whether a later call fits it.

Trace-once drops every Dynamo guard, so nothing inside Dynamo checks a later call any more.
This module puts back the checks that matter, at the cost of one small tuple per call:

* :class:`CallSignature` describes a call's *structure*: for each argument of ``forward``,
  whether it is a tensor (dtype, device, rank, the sizes of its non-dynamic dims, contiguity),
  ``None``, a plain value (which the trace specialised on), a container of those, or another
  object; which tensor arguments share storage; the autograd mode when it matters.
* :class:`Signer` computes, per call, a hashable *key* that changes whenever the structure
  does (sizes of dynamic dims excluded), and, once per new key, the :class:`CallSignature`.
* :func:`incompatibility` says whether a new structure is an input error (a tensor with
  another dtype, device, rank or fixed size than the trace had: an :class:`InputMismatchError`
  naming the argument and the fix) or merely another structure worth its own trace (``None``
  where a tensor was, another plain value, another memory layout, aliasing).

The trace's conditions on dynamic sizes (``if x.shape[0] > 4:`` in ``forward``) and whether a
call's sizes satisfy them: :mod:`~freezeframe.compilation.size_conditions`.

Example: ``forward(self, x: Tensor, mask: Optional[Tensor] = None, scale: float = 1.0)`` with
``x`` dynamic in dim 0 has, for ``model(torch.randn(8, 16))``, the structure
``x: tensor float32 cpu (*, 16) contiguous; mask: None; scale: 1.0``; a call with a mask, or
``scale=2.0``, is a new structure (traced again); a call with ``torch.randn(8, 32)`` is an
input error (dim 1 was fixed at 16).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from freezeframe.compilation.values import MAX_DEPTH, Same, describe, parts, plain_token, token
from freezeframe.errors import InputMismatchError

__all__ = ["CallSignature", "SameCall", "Signer", "TensorSpec", "difference",
           "distinct_storages", "exact_key", "incompatibility", "same_call"]

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor as the trace saw it; dynamic dims have size ``None``."""

    dtype: torch.dtype
    device: torch.device
    sizes: tuple[int | None, ...]
    strides: tuple[int, ...] | None  # None when contiguous
    requires_grad: bool

    def describe(self) -> str:
        shape = ", ".join("*" if s is None else str(s) for s in self.sizes)
        layout = "contiguous" if self.strides is None else f"strides {self.strides}"
        return f"a {self.dtype} tensor on {self.device} of shape ({shape}), {layout}"


@dataclasses.dataclass(frozen=True)
class ValueSpec:
    """A plain value the trace specialised on (an int, a float, a string, a dtype, an enum
    member...), compared by :func:`plain_token` (type and value)."""

    value: Any = dataclasses.field(compare=False)
    token: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", plain_token(self.value))

    def describe(self) -> str:
        return f"the {type(self.value).__name__} {self.value!r}"


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
    """A list, tuple, dict or dataclass whose items are described in turn."""

    kind: str
    keys: tuple[Any, ...]
    items: tuple[Any, ...]

    def describe(self) -> str:
        if len(self.items) > 4:
            return f"a {self.kind} of {len(self.items)} items"
        if not self.keys:
            inner = [spec.describe() for spec in self.items]
        else:
            sep = ": " if self.kind == "dict" else "="
            inner = [f"{describe(k) if self.kind == 'dict' else k}{sep}{spec.describe()}"
                     for k, spec in zip(self.keys, self.items, strict=True)]
        return f"a {self.kind} ({'; '.join(inner)})"


@dataclasses.dataclass(frozen=True)
class ObjectSpec:
    """Any other object (a function, a module, an object with slots): the trace may have read
    anything from it, so only the very same object is the same structure."""

    type_name: str
    ref: Same

    def describe(self) -> str:
        obj = self.ref.obj
        name = getattr(obj, "__qualname__", None)
        if isinstance(name, str) and callable(obj):
            return f"the {self.type_name} {name} at {id(obj):#x}"
        return f"a {self.type_name} object at {id(obj):#x} (compared by identity)"


ArgSpec = TensorSpec | ValueSpec | ContainerSpec | ObjectSpec


@dataclasses.dataclass(frozen=True)
class CallSignature:
    """The structure of one call of ``forward``, arguments bound by name, defaults applied."""

    args: tuple[tuple[str, ArgSpec], ...]
    # groups of argument paths sharing storage; within a group, paths that are the very same
    # tensor are one item joined by " is " (Dynamo passes such a tensor to the graph once)
    aliases: tuple[tuple[str, ...], ...]
    grad_enabled: bool | None  # None when the autograd mode is not part of the structure

    def arg(self, name: str) -> ArgSpec | None:
        return next((spec for n, spec in self.args if n == name), None)

    def describe(self) -> str:
        parts = [f"{n}={spec.describe()}" for n, spec in self.args]
        if self.aliases:
            parts.append("sharing storage: " + "; ".join(" & ".join(g) for g in self.aliases))
        return ", ".join(parts)


def _dims_of(dims: Sequence[int], rank: int) -> frozenset[int]:
    return frozenset(d % rank for d in dims if -rank <= d < rank) if rank else frozenset()


def _nested_tensor_key(value: torch.Tensor) -> tuple[Any, ...]:
    """A tensor inside a container: every size counts (only top-level arguments have
    dynamic dims)."""
    layout = True if value.is_contiguous() else value.stride()
    return (value.dtype, value.device, tuple(value.shape), layout, value.requires_grad)


# Plain values an exact key holds by (type, value): equal values of these types are
# interchangeable in a trace (floats are not: -0.0 == 0.0, and a NaN equals nothing).
_EXACT_PLAIN = frozenset({int, bool, str, type(None)})
_PAIR = object()  # the first item of a two-tensor exact key

_TensorGuards: Any
try:  # torch's C++ tensor check, as Dynamo's guards use it
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every supported torch has it
    _TensorGuards = None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def exact_key(args: tuple[Any, ...], kwargs: Mapping[str, Any],
              grad_matters: bool) -> tuple[Any, ...] | None:
    """A key equal only for calls alike in everything that picks their route: each argument
    a plain ``torch.Tensor`` (shape, dtype, device, strides, requires_grad) or an int, bool,
    str or None (type and value); the keyword names; which tensors share storage and which
    are one tensor; the autograd mode when ``grad_matters``. None for a call holding anything
    else (a float, a container, a tensor subclass): it takes the long way.

    Two calls with one exact key have one :meth:`Signer.key` and the same dynamic sizes, so
    they meet the same size conditions: a compiled model remembers where a call with this key
    went and sends the next one there directly.

    It runs on every call of a compiled model, between the pieces' own ops, where each
    temporary object costs several times what it costs in a loop of its own: the calls of one
    or two positional tensors (a batch, or tokens and positions) get flat keys of their own,
    and storages are compared only where two of them are equal (as :meth:`Signer.key` does).
    Keys of different shapes never compare equal: the one-tensor key starts with a
    ``torch.Size``, the two-tensor key with ``_PAIR``, every other key with a tuple."""
    if not kwargs and not grad_matters:  # the common calls, kept short
        n = len(args)
        if n == 1:
            value = args[0]
            if value.__class__ is torch.Tensor:
                return (value.shape, value.dtype, value.device, value.stride(),
                        value.requires_grad)
        elif n == 2:
            a, b = args
            if a.__class__ is torch.Tensor and b.__class__ is torch.Tensor:
                # 0: two storages; 1: one storage, two tensors; 2: one tensor twice
                shared = 0 if a.untyped_storage().data_ptr() != \
                    b.untyped_storage().data_ptr() else 2 if a is b else 1
                return (_PAIR, a.shape, a.dtype, a.device, a.stride(), a.requires_grad,
                        b.shape, b.dtype, b.device, b.stride(), b.requires_grad, shared)
    key: list[Any] = [tuple(kwargs)] if kwargs else []
    tensors: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        cls = value.__class__
        if cls is torch.Tensor:
            tensors.append(value)
            key.append((value.shape, value.dtype, value.device, value.stride(),
                        value.requires_grad))
        elif cls in _EXACT_PLAIN:
            key.append((cls, value))
        else:
            return None
    if len(tensors) > 1:
        storages = list(map(_storage, tensors))
        if len(set(storages)) != len(storages):
            ids = list(map(id, tensors))
            key.append(("aliases", tuple(map(storages.index, storages)),
                        tuple(map(ids.index, ids))))
    if grad_matters:
        key.append(torch.is_grad_enabled())
    return tuple(key)


class SameCall:
    """A check, mostly in C++, that a call is alike in everything its exact key holds to the
    call this was made from, without building the key: the same number of positional
    tensors and no keywords, each tensor of the same class, dispatch keys, dtype, device,
    ``requires_grad``, sizes and strides (``torch._C._dynamo.guards.TensorGuards``, the check
    Dynamo's own guards make), and pairwise distinct storages. Made only for calls of plain
    tensors with distinct storages (:func:`same_call`); ``call`` is where such a call goes.

    Measured side by side in place on the development CPU (a two-tensor call of the toy
    Llama), it costs about 4-6 us against 16-20 for the key and its lookup. The tensor check
    reads the thread's dispatch state (``torch.inference_mode``, ``torch.no_grad``): made in
    one and run in another, it fails, and the call builds its key (and the compiled model
    makes the check anew in that state)."""

    __slots__ = ("call", "check", "count")

    def __init__(self, count: int, check: Callable[..., bool],
                 call: Callable[..., Any]) -> None:
        self.count = count
        self.check = check
        self.call = call


def distinct_storages(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether no two of ``tensors`` share a storage (as :func:`exact_key` compares them)."""
    if len(tensors) == 2:
        return tensors[0].untyped_storage().data_ptr() != tensors[1].untyped_storage().data_ptr()
    return len(set(map(_storage, tensors))) == len(tensors)


def same_call(args: tuple[Any, ...], kwargs: Mapping[str, Any],
              call: Callable[..., Any]) -> SameCall | None:
    """A :class:`SameCall` for calls like this one, going to ``call``; None for a call with
    keywords, with anything but plain tensors, with two tensors on one storage, or where
    this torch has no tensor check."""
    if kwargs or not args or _TensorGuards is None \
            or any(value.__class__ is not torch.Tensor for value in args):
        return None
    if len(args) > 1 and not distinct_storages(args):
        return None
    try:
        guard = _TensorGuards(*args, dynamic_dims_sizes=[list(t.shape) for t in args],
                              dynamic_dims_strides=[list(t.stride()) for t in args])
        if not guard.check(*args):
            return None
    except (TypeError, RuntimeError):  # (another signature in another torch)
        return None
    return SameCall(len(args), guard.check, call)


class Signer:
    """Describes calls of one ``forward`` given its dynamic dims (``{arg name: dims}``)."""

    def __init__(self, forward: Callable[..., Any],
                 dynamic_arg_dims: Mapping[str, Sequence[int]], *,
                 grad_matters: bool) -> None:
        self._sig = inspect.signature(forward)
        params = list(self._sig.parameters.values())
        self._positional = [p.name for p in params
                            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._dims = {name: tuple(d) for name, d in dynamic_arg_dims.items()}
        self._grad_matters = grad_matters
        self._dyn: dict[tuple[Any, int], frozenset[int]] = {}  # (arg, rank) -> dynamic dims

    # -- the per-call key (hot path) ------------------------------------------------------
    def key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """A hashable key equal for two calls of the same structure (dynamic sizes aside).

        Calls spelled differently (positional vs keyword) may get different keys for the same
        structure; :meth:`signature` then gives equal signatures.
        """
        positional = self._positional
        pieces: list[Any] = []
        tensors: list[torch.Tensor] = []  # every tensor, nested ones included, in call order

        def nested(t: torch.Tensor) -> tuple[Any, ...]:
            tensors.append(t)
            return _nested_tensor_key(t)

        for i, value in enumerate(args):
            name = positional[i] if i < len(positional) else i
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            pieces.append(self._leaf_key(name, value, nested))
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            pieces.append((name, self._leaf_key(name, value, nested)))
        if len(tensors) > 1:  # storages are read only where two tensors could share one
            storages = list(map(_storage, tensors))
            if len(set(storages)) != len(storages):
                ids = list(map(id, tensors))  # the same tensor twice, or two views of one
                pieces.append(("aliases", tuple(map(storages.index, storages)),
                               tuple(map(ids.index, ids))))
        if self._grad_matters:
            pieces.append(torch.is_grad_enabled())
        return tuple(pieces)

    def _leaf_key(self, name: Any, value: Any,
                  nested: Callable[[torch.Tensor], Any] = _nested_tensor_key) -> Any:
        if isinstance(value, torch.Tensor):
            shape = value.shape
            dyn = self._dyn.get((name, len(shape)))
            if dyn is None:
                dyn = self._dyn[(name, len(shape))] = _dims_of(self._dims.get(name, ()),
                                                               len(shape))
            sizes: tuple[Any, ...] = tuple(-1 if d in dyn else s for d, s in enumerate(shape)) \
                if dyn else tuple(shape)
            layout = True if value.is_contiguous() else value.stride()
            return (value.dtype, value.device, sizes, layout, value.requires_grad)
        return token(value, nested)

    # -- the full description (once per new key) ------------------------------------------
    def signature(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CallSignature:
        """The structure of a call, arguments bound by name and defaults applied.

        Raises :class:`InputMismatchError` when the arguments do not bind to ``forward``.
        """
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise InputMismatchError(
                f"the arguments do not fit forward{self._sig}: {exc}; call the compiled model "
                "as you would call the module") from None
        bound.apply_defaults()
        specs: list[tuple[str, ArgSpec]] = []
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, value in bound.arguments.items():
            specs.append((name, self._spec(name, value, name, tensors, 0)))
        groups: dict[int, dict[int, list[str]]] = {}
        for path, tensor in tensors:
            same = groups.setdefault(_storage(tensor), {})
            same.setdefault(id(tensor), []).append(path)
        aliases = tuple(tuple(" is ".join(paths) for paths in g.values())
                        for g in groups.values() if sum(map(len, g.values())) > 1)
        grad = torch.is_grad_enabled() if self._grad_matters else None
        return CallSignature(tuple(specs), aliases, grad)

    def _spec(self, name: str, value: Any, path: str,
              tensors: list[tuple[str, torch.Tensor]], depth: int) -> ArgSpec:
        if isinstance(value, torch.Tensor):
            tensors.append((path, value))
            dyn = _dims_of(self._dims.get(name, ()) if depth == 0 else (), value.dim())
            sizes = tuple(None if d in dyn else int(s) for d, s in enumerate(value.shape))
            strides = None if value.is_contiguous() else tuple(value.stride())
            return TensorSpec(value.dtype, value.device, sizes, strides, value.requires_grad)
        if plain_token(value) is not None:
            return ValueSpec(value)
        split = parts(value) if depth < MAX_DEPTH else None
        if split is not None:
            kind, keys, items = split
            return ContainerSpec(kind, keys, tuple(
                self._spec(name, v, _item_path(path, kind, keys, i), tensors, depth + 1)
                for i, v in enumerate(items)))
        return ObjectSpec(type(value).__qualname__, Same(value))

    def dynamic_sizes(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                      ) -> dict[tuple[str, int], int]:
        """``{(arg name, dim): size}`` of every dynamic dim of this call."""
        out: dict[tuple[str, int], int] = {}
        positional = self._positional
        named: list[tuple[str, Any]] = [
            (positional[i] if i < len(positional) else str(i), v) for i, v in enumerate(args)]
        named.extend(kwargs.items())
        for name, value in named:
            dims = self._dims.get(name)
            if dims and isinstance(value, torch.Tensor):
                for d in _dims_of(dims, value.dim()):
                    out[(name, d)] = int(value.shape[d])
        return out


def _item_path(path: str, kind: str, keys: tuple[Any, ...], i: int) -> str:
    if not keys:
        return f"{path}[{i}]"
    if kind == "dict":
        return f"{path}[{describe(keys[i])}]"
    return f"{path}.{keys[i]}"


def _fix_for(name: str, old: TensorSpec, new: TensorSpec,
             dims: Sequence[int]) -> str | None:
    """Why a tensor argument cannot be served by a trace that saw ``old``, or None."""
    if new.dtype != old.dtype:
        return (f"argument {name!r} is {new.dtype}, but the model was traced with {old.dtype}; "
                f"pass {name}.to({old.dtype}) (or compile a separate model for {new.dtype})")
    if new.device != old.device:
        return (f"argument {name!r} is on {new.device}, but the model was traced with it on "
                f"{old.device}; move it with {name}.to({str(old.device)!r}) (the model's "
                "weights live there)")
    if len(new.sizes) != len(old.sizes):
        return (f"argument {name!r} has {len(new.sizes)} dims, but the model was traced with "
                f"{len(old.sizes)} ({old.describe()}); pass a tensor of that rank")
    for d, (a, b) in enumerate(zip(old.sizes, new.sizes, strict=True)):
        if a is not None and b is not None and a != b:
            dyn = list(dims)
            return (f"argument {name!r} has size {b} in dim {d}, but dim {d} was fixed at {a} "
                    f"when the model was traced (only dims {dyn} of {name!r} vary between "
                    f"calls); if dim {d} should vary, pass dynamic_arg_dims={{{name!r}: "
                    f"{sorted({*dyn, d})}}} to ff.compile")
    return None


def incompatibility(traced: CallSignature, new: CallSignature,
                    dynamic_arg_dims: Mapping[str, Sequence[int]]) -> str | None:
    """A message when ``new`` is an input error against ``traced``, or None when ``new`` is
    only another structure (which a new trace may serve)."""
    for name, old in traced.args:
        spec = new.arg(name)
        if isinstance(old, TensorSpec) and isinstance(spec, TensorSpec):
            why = _fix_for(name, old, spec, dynamic_arg_dims.get(name, ()))
            if why is not None:
                return why
        elif isinstance(old, TensorSpec) and isinstance(spec, (ContainerSpec, ObjectSpec)):
            return (f"argument {name!r} is {spec.describe()}, but the model was traced with "
                    f"{old.describe()}; pass a tensor (torch.as_tensor(...) on "
                    f"{old.device}, dtype {old.dtype})")
        elif isinstance(old, TensorSpec) and isinstance(spec, ValueSpec) and \
                spec.value is not None:
            return (f"argument {name!r} is {spec.describe()}, but the model was traced with "
                    f"{old.describe()}; pass a tensor")
    return None


def difference(traced: CallSignature, new: CallSignature) -> str:
    """What sets ``new`` apart from ``traced``, for the retrace message: each differing part as
    ``where: traced -> new``, where is an argument (a path into a container, ``xs[3]``) and its
    property (None-ness, dtype, device, rank, shape, strides, requires_grad, value), storage
    sharing, or the autograd mode. Two structures can describe alike (a list of 5 items) and
    still differ; this names the part."""
    found: list[str] = []
    names = [n for n, _ in traced.args] + [n for n, _ in new.args if traced.arg(n) is None]
    for name in names:
        _spec_difference(name, traced.arg(name), new.arg(name), found)
    if traced.aliases != new.aliases:
        found.append(f"storage sharing: {_sharing(traced)} -> {_sharing(new)}")
    if traced.grad_enabled != new.grad_enabled:
        found.append(f"autograd: {_grad(traced.grad_enabled)} -> {_grad(new.grad_enabled)}")
    return "; ".join(found) if found else "nothing (the same structure)"


def _spec_difference(path: str, old: ArgSpec | None, new: ArgSpec | None,
                     found: list[str]) -> None:
    if old == new:
        return
    if isinstance(old, TensorSpec) and isinstance(new, TensorSpec):
        rank = (len(old.sizes), len(new.sizes))
        props = [("dtype", old.dtype, new.dtype), ("device", old.device, new.device),
                 ("rank", *rank)]
        if rank[0] == rank[1]:
            props += [("shape", _shape(old), _shape(new)),
                      ("strides", old.strides or "contiguous", new.strides or "contiguous")]
        props.append(("requires_grad", old.requires_grad, new.requires_grad))
        found.extend(f"{path}: {name} {a} -> {b}" for name, a, b in props if a != b)
        return
    if isinstance(old, ContainerSpec) and isinstance(new, ContainerSpec) and \
            (old.kind, old.keys, len(old.items)) == (new.kind, new.keys, len(new.items)):
        for i, (a, b) in enumerate(zip(old.items, new.items, strict=True)):
            _spec_difference(_item_path(path, old.kind, old.keys, i), a, b, found)
        return
    found.append(f"{path}: {_words(old)} -> {_words(new)}")


def _shape(spec: TensorSpec) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in spec.sizes) + ")"


def _words(spec: ArgSpec | None) -> str:
    if spec is None:
        return "not passed"
    if isinstance(spec, ValueSpec) and spec.value is None:
        return "None"
    return spec.describe()


def _sharing(sig: CallSignature) -> str:
    return "; ".join(" & ".join(group) for group in sig.aliases) or "none"


def _grad(enabled: bool | None) -> str:
    return "grad enabled" if enabled else "grad disabled"
