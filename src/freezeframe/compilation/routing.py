"""Which trace of a compiled model serves a call, and the memos that make a repeated call cheap.

A compiled model holds one trace per call structure (:mod:`~freezeframe.compilation.signature`)
and per side of a Python branch on a size. A call is routed in three tiers, cheapest first::

    exact key (shapes, dtypes, ...) --memo--> the callable the last such call went to
        | miss
    structure key --routes--> the traces such calls went to; the first whose size
        | miss                conditions this call meets serves it
    signature --------------> a trace of the same structure that accepts these sizes, or
                              a new trace (refused past MAX_TRACES or for an incompatible call)

Before/after for a model called at batch sizes 3, 5, 3::

    call(3): no memo, no route -> trace 1 traced; routes[key] = [trace 1]
    call(5): no memo, routed to trace 1 (its conditions hold) -> its direct call worked out
    call(3): routed to trace 1 -> remembered: exact[(3, ...)] = trace 1's direct call
    call(3): served from the memo, without routing (and, from the compiled model's
             ``__call__``, without ``nn.Module.__call__``)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from freezeframe.compilation.assemble import Variant
from freezeframe.compilation.direct_call import direct_call, sized_call
from freezeframe.compilation.instance_reads import attribute_reads, tensor_attrs
from freezeframe.compilation.module_state import ModuleState, has_uninitialised_lazy
from freezeframe.compilation.outside_reads import OutsideReads
from freezeframe.compilation.signature import (
    CallSignature,
    SameCall,
    Signer,
    difference,
    incompatibility,
)
from freezeframe.compilation.size_conditions import SizeGuards, is_size_equality
from freezeframe.compilation.trace_checks import (
    refuse_root_hooks,
    refuse_self_changing_forward,
    reraise_trace_failure,
    warn_about_branches,
)
from freezeframe.errors import CompileError, InputMismatchError
from freezeframe.stats import Stats

__all__ = ["MAX_EXACT_KEYS", "MAX_TRACES", "Router"]

logger = logging.getLogger(__name__)

# A model gets one trace per distinct call structure (see freezeframe.compilation.signature); a
# forward whose structure keeps changing (an int argument that counts steps) would otherwise
# trace forever. Past this many traces a new structure is an error that names what changed.
MAX_TRACES = 8
# How many exact call keys a compiled model remembers (one per distinct shape called); past
# this the memory is emptied and refilled.
MAX_EXACT_KEYS = 1024


class Router:
    """The traces of one compiled model and the routes and memos that lead a call to one.

    ``exact`` and ``same`` are read directly by the model's fast path (the same dict objects
    for the router's life): exact call key -> where such a call goes, and per exact key a
    check that a call is alike without building its key (``None`` where there is none).
    """

    def __init__(self, model_key: str, signer: Signer, dims: Mapping[str, tuple[int, ...]],
                 stats: Stats, new_variant: Callable[[CallSignature | None], Variant], *,
                 warned: set[str], inductor: bool,
                 on_state_change: Callable[[], None] | None = None) -> None:
        self.model_key = model_key
        self.signer = signer
        self.dims = dims
        self.stats = stats
        self._new_variant = new_variant
        self._warned = warned  # what the model warned about (once each)
        self._inductor = inductor
        self._on_state_change = on_state_change  # the full module-state check (the model's)
        self.variants: list[Variant] = []
        self.routes: dict[tuple[Any, ...], list[Variant]] = {}
        self.exact: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.same: dict[tuple[Any, ...], SameCall | None] = {}
        # Built now so its FULL wrapper is visible before the first call; the first call
        # gives it its structure.
        self.spare: Variant | None = new_variant(None)

    def graph_wrappers(self) -> list[Any]:
        """Every graph wrapper of the traces (the spare's too): per trace, the PIECEWISE ones
        then the FULL one."""
        out: list[Any] = []
        for variant in [*self.variants, *([self.spare] if self.spare is not None else [])]:
            out.extend(variant.backend.wrappers)
            if variant.full_wrapper is not None:
                out.append(variant.full_wrapper)
        return out

    # -- finding a trace --------------------------------------------------------------------
    def route_of(self, key: tuple[Any, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Variant | None:
        """The trace an earlier call of this structure (``key``) was routed to and whose size
        conditions this call meets, or None (a route miss: see :meth:`serving`)."""
        for variant in self.routes.get(key, ()):
            guards = variant.guards
            if guards is not None and (guards.trivial or guards.accepts(
                    self.signer.dynamic_sizes(args, kwargs))):
                return variant
        return None

    def routed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Variant | None:
        return self.route_of(self.signer.key(args, kwargs), args, kwargs)

    def serving(self, key: tuple[Any, ...], signature: CallSignature,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Variant | None:
        """A trace of ``signature``'s structure that accepts this call's sizes (its route
        remembered under ``key``), or None when the call needs a new trace; raises when it
        cannot have one (see :meth:`refuse_new`)."""
        sizes = self.signer.dynamic_sizes(args, kwargs)
        same = [v for v in self.variants if v.signature == signature]
        for variant in same:
            guards = variant.guards
            if guards is not None and (guards.trivial or guards.accepts(sizes)):
                routes = self.routes.setdefault(key, [])
                if variant not in routes:
                    routes.append(variant)
                return variant
        for variant in same:
            self._check_consistent_sizes(variant, sizes)
        self.refuse_new(signature)
        return None

    def refuse_new(self, signature: CallSignature) -> None:
        """Raise when a call of ``signature`` may not get a trace of its own: it is
        incompatible with an existing trace (another dtype, rank, static size), or the model
        holds :data:`MAX_TRACES` traces."""
        for variant in self.variants:
            if variant.signature is None:
                continue
            why = incompatibility(variant.signature, signature, self.dims)
            if why is not None:
                raise InputMismatchError(f"{self.model_key}: {why}")
        if len(self.variants) >= MAX_TRACES:
            raise CompileError(
                f"{self.model_key}: this call would need trace number "
                f"{len(self.variants) + 1}, above the limit of {MAX_TRACES}. Each new call "
                f"structure is traced separately; this one is {signature.describe()}, and "
                f"differs from the first trace in {self.first_difference(signature)}. "
                "Keep the call structure fixed: pass values that change per call (step "
                "counters, flags) as tensors, keep tensors contiguous, pass the same function "
                "or object each call (a new one is compared by identity), and avoid Python "
                "branches on the batch size in forward")

    def first_difference(self, signature: CallSignature) -> str:
        first = self.variants[0].signature if self.variants else None
        return difference(first, signature) if first is not None else signature.describe()

    def _check_consistent_sizes(self, variant: Variant,
                                sizes: Mapping[tuple[str, int], int]) -> None:
        """Raise when the call breaks an equality the trace found between two dynamic sizes
        (``x`` and ``positions`` must have as many rows): eager would fail on it too."""
        if variant.guards is None:
            return
        symbols = variant.trace.size_symbols
        for expr, where in variant.guards.conditions:
            if not is_size_equality(expr):
                continue
            a, b = symbols.get(expr.lhs), symbols.get(expr.rhs)
            if a is None or b is None or a not in sizes or b not in sizes:
                continue
            if sizes[a] != sizes[b]:
                raise InputMismatchError(
                    f"{self.model_key}: argument {a[0]!r} has {sizes[a]} along dim {a[1]} but "
                    f"argument {b[0]!r} has {sizes[b]} along dim {b[1]}; the model needs them "
                    f"equal (at {where}). Pass both with the same size")

    # -- a new trace -----------------------------------------------------------------------
    def trace_new(self, module: nn.Module, key: tuple[Any, ...], signature: CallSignature,
                  args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[Any, ModuleState | None]:
        """Trace ``module`` anew for this call (of structure ``key``) and keep the trace;
        returns the call's output and, for the model's first trace, the module state it saw
        (checked on every later call). What the first trace refuses and how a failed trace
        reads: :mod:`~freezeframe.compilation.trace_checks`."""
        sizes = self.signer.dynamic_sizes(args, kwargs)
        variant = self._next_variant(signature, sizes)
        # The tracing call runs uncaptured even inside a FULL forward context: Dynamo cannot
        # trace inside a capture. A later call of that descriptor captures.
        first = not self.variants
        if first:
            refuse_root_hooks(module, self.model_key)
        before = None if not first or has_uninitialised_lazy(module) \
            else ModuleState(module, every_call=False)
        tensors_before = tensor_attrs(module) if first else {}
        try:
            out = variant.cache(*args, **kwargs)
            if before is not None:
                refuse_self_changing_forward(before, self.model_key)
        except BaseException as exc:
            if not self.variants and self.spare is None:
                # Nothing of the failed trace is kept: a fresh spare takes its place, so the
                # model looks as it did before the call and the next call traces again.
                self.spare = self._new_variant(None)
            reraise_trace_failure(exc, self.model_key, lambda: module(*args, **kwargs))
            raise  # (reraise_trace_failure always raises)
        trace = variant.trace
        variant.guards = SizeGuards.of_trace(trace.size_conditions, trace.size_symbols, sizes,
                                             self._inductor)
        state = self._first_state(module, trace.value_reads, tensors_before) if first else None
        warn_about_branches(trace, self.model_key, self._warned, self.stats)
        self.variants.append(variant)
        self.routes.setdefault(key, []).append(variant)
        return out, state

    def _first_state(self, module: nn.Module, reads: list[tuple[str, str]],
                     tensors_before: dict[tuple[int, str], int]) -> ModuleState:
        """The module state the first trace saw, checked from now on: with what it read from
        outside the module (class attributes, globals), and the plain tensor attributes it
        reads as inputs, less those the traced call stored anew (``self.last = out``)."""
        stored = {k for k, v in tensor_attrs(module).items() if tensors_before.get(k) != v}
        func = getattr(module.forward, "__func__", None)
        outside = OutsideReads(module, reads, getattr(func, "__globals__", None))
        attributes, tensors = attribute_reads(reads, module)
        return ModuleState(module, outside=outside, tensor_reads=tensors - stored,
                           attr_reads=attributes, on_change=self._on_state_change)

    def _next_variant(self, signature: CallSignature,
                      sizes: Mapping[tuple[str, int], int]) -> Variant:
        """The variant a new trace of ``signature`` fills (the spare one first); a trace
        after the first is counted in ``stats.retraces`` and logged with its cause."""
        if self.spare is not None:
            variant, self.spare = self.spare, None
            variant.signature = signature
        else:
            variant = self._new_variant(signature)
        if self.variants:
            self.stats.inc("retraces")
            if any(v.signature == signature for v in self.variants):
                logger.warning("%s: no trace serves a call with dynamic sizes %s (a Python "
                               "branch on a size in forward); it is traced again (trace %d)",
                               self.model_key, dict(sizes), len(self.variants) + 1)
            else:
                logger.warning("%s: a call with a new structure is traced again (trace %d); "
                               "it differs from the first trace in %s", self.model_key,
                               len(self.variants) + 1, self.first_difference(signature))
        return variant

    # -- remembering a call ------------------------------------------------------------------
    def forget_calls(self) -> None:
        """Empty the exact-key memos (their callables hold routes of dropped graphs)."""
        self.exact.clear()
        self.same.clear()

    def remember(self, variant: Variant, exact: tuple[Any, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any], graphs: bool) -> Any:
        """Call ``variant`` and remember it for calls with the exact key ``exact``: its direct
        call, with each piece's compiled entry bound in when the model has no ``graphs`` (no
        graph wrapper decides per call), else the variant as it is called now."""
        direct = variant.direct
        stitched = variant.stitched
        stitching = variant.backend.stitching
        if len(self.exact) >= MAX_EXACT_KEYS:
            self.forget_calls()  # (a few slow calls refill it)
        if direct is None or variant.full_wrapper is not None:
            self.exact[exact] = lambda *a, **k: variant(a, k)
            return variant(args, kwargs)
        if not graphs and stitched is not None and stitching is not None \
                and stitched.calls(stitching):
            backends = dict(zip(variant.backend.capturable_names,
                                variant.backend.piece_backends, strict=True))
            if all(getattr(stitching, name) is b for name, b in backends.items()):
                out, sized = sized_call(direct, stitching, backends, variant.sized, args,
                                        kwargs)
                self.exact[exact] = sized.call
                return out
        self.exact[exact] = direct.call
        return direct.call(*args, **kwargs)

    def call_building_direct(self, module: nn.Module, variant: Variant,
                             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``variant`` through Dynamo's bytecode, watching what it passes to the graph,
        and work out its direct call (direct_call.py) from that. Done on the variant's second
        routed call: the first one traced (or loaded) it."""
        stitched = variant.stitched
        if stitched is None or stitched.recording is not None or variant.full_wrapper \
                is not None:
            variant.direct_tried = stitched is not None and stitched.recording is None
            return variant(args, kwargs)
        calls: list[tuple[tuple[Any, ...], Any]] = []
        stitched.recording = calls
        try:
            out = variant(args, kwargs)
        finally:
            stitched.recording = None
        variant.direct_tried = True
        variant.direct = direct_call(module, variant.trace, variant.sources, stitched,
                                     calls, out, args, kwargs)
        return out

