"""The first call of a compiled model with the cache on: load a saved trace, else trace with
Dynamo and save the trace.

Holds :class:`ModelCache`, through which :mod:`freezeframe.compilation.model` routes calls: on
the first call it opens the model's :class:`~freezeframe.cache.entry.CompileCache`, takes the
model lock, and either compiles a saved trace that fits (checked with
:mod:`freezeframe.compilation.saved_trace`) so Dynamo never runs, or runs trace-once and saves
what the trace produced. It does not hold the trace itself (:mod:`freezeframe.compilation.trace`),
what a saved trace is made of (:mod:`freezeframe.compilation.saved_trace`) or the files
(:mod:`freezeframe.cache`).

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

import contextlib
import dataclasses
import logging
import pickle
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from freezeframe.cache.artifacts import PieceCache, prefetch_torch_key
from freezeframe.cache.entry import CompileCache, SavedTrace
from freezeframe.cache.files import CorruptArtifactError, cache_enabled
from freezeframe.cache.key import (
    code_digests,
    code_mismatch,
    is_primitive,
    traced_code_objects,
    traced_files_from_graph,
)
from freezeframe.compilation.compilers import config_passes, pass_sources
from freezeframe.compilation.constant_stores import ConstantStore, stores_of_current_trace
from freezeframe.compilation.direct_call import free_of_side_effects
from freezeframe.compilation.guard_checks import (
    ValueCheck,
    _CannotCheck,
    failed_check,
    value_checks,
)
from freezeframe.compilation.saved_trace import (
    _KEEP_META,
    _detached,
    _first_mismatch,
    _Frame,
    _holds_view,
    _load_graph,
    _LoadedTrace,
    _OutputRecorder,
    _SavedSizes,
    _unviewed,
    _wrapped_frame_code,
    source_name,
    valued_nodes,
)
from freezeframe.compilation.signature import Signer
from freezeframe.compilation.split import splitting_ops_of, values_the_split_reads
from freezeframe.errors import CacheError

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.compilation.trace import TraceOnce

__all__ = ["ModelCache"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Chosen:
    """The saved trace a warm start takes, ready to compile."""

    gm: Any
    example_inputs: list[Any]
    loaded: _LoadedTrace
    sizes: _SavedSizes
    # what its checks read, each (source, guard kind): class attributes, globals...
    reads: tuple[tuple[str, str], ...] = ()


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
                 model_key: str | None = None, signer: Signer | None = None) -> None:
        self._model = model
        self._signer = signer  # the model's call keys: the sizes a saved trace is checked on
        self._dims = dict(dynamic_arg_dims or {})
        self._user_key = model_key
        self.trace: TraceOnce | None = None  # the trace-once callable, set by the model
        self._backend: Callable[..., Any] | None = None
        self._recorder: _OutputRecorder | None = None
        self._graph_blob: bytes | None = None
        # the nodes the graph blob holds a fake value for
        self._valued: list[str] | None = None
        self._sources: list[str] | None = None
        self._frame_kind: str | None = None
        self._not_saved: str | None = None  # why this trace cannot be saved, once known
        # forward's side effects, when all are constant stores a saved trace can repeat
        self._stores: tuple[ConstantStore, ...] | None = None
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
                codes = traced_code_objects()
                self.cache.add_traced_files(traced_files_from_graph(gm))
                self.cache.add_traced_code(code_digests(codes))
                self._frame_kind = self._traced_frame_kind(codes)
                self._keep_graph(gm)
                self._stores = stores_of_current_trace()
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
        if codes[0] == func.__code__:  # (a private copy of it: see TraceOnce)
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
        if model.config.backend == "inductor":
            prefetch_torch_key()  # every artifact load compares it; overlaps the trace's load
        with self.cache.lock(), self.cache.inductor_dir(model.config.backend == "inductor"):
            loaded = self._try_saved_trace(args, kwargs)
            if loaded is not None:
                self._run = loaded
                out = loaded(*args, **kwargs)
                self.cache.record_start(trace_loaded=True)
                return out
            out = trace(*args, **kwargs)
            self._save_trace(out, args, kwargs)
            self.cache.record_start(trace_loaded=False)
        self._run = trace
        return out

    def _keep_graph(self, gm: Any) -> None:
        """Keeps what saving this trace will need of the graph Dynamo traced, while the graph
        still holds its fake values: the sources of its inputs and the pickled graph. Notes
        instead why the trace cannot be saved."""
        try:
            from torch.fx._graph_pickler import GraphPickler, Options
        except ImportError:  # pragma: no cover - torch without a graph pickler
            self._not_saved = "this torch has no graph pickler"
            return
        sources, why = _input_sources(gm)
        if why is not None:
            self._not_saved = why
            return
        # Node metadata: only what splitting and Inductor read (Dynamo's own entries hold real
        # tensors and weak references).
        options = Options(ops_filter=None, node_metadata_key_filter=_KEEP_META.__contains__)
        try:
            with _kept_values_only(gm, splitting_ops_of(self._model.config)):
                self._graph_blob = GraphPickler.dumps(gm, options)
                self._valued = valued_nodes(gm)
        except Exception as exc:
            self._graph_blob = None
            self._not_saved = f"the traced graph cannot be serialised ({type(exc).__name__}: {exc})"
            logger.debug("graph pickling failed", exc_info=True)
            return
        self._sources = sources

    def _not_saving(self, why: str) -> None:
        logger.info("the trace of %s is not saved, so warm starts will trace with Dynamo: %s",
                    type(self._model.module).__name__, why)
        self._model.stats.inc("traces_not_saved")

    def _save_trace(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Saves the first call's trace (``out`` is what it returned) for warm starts, or logs
        and counts why it cannot be saved: the reasons are checked cheapest first."""
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
        stores: tuple[ConstantStore, ...] = ()
        if self.trace is not None and not free_of_side_effects(self.trace):
            # Dynamo's code repeats forward's Python side effects on every call (a store such
            # as self.last_hidden = h); a saved trace calls the graph alone, so a warm start
            # would skip them where a cold one makes them, unless they are constant stores
            # it repeats itself (constant_stores.py)
            stores = self._stores or ()
        if self.trace is not None and not free_of_side_effects(self.trace) and not stores:
            self._not_saving("forward has Python side effects (it stores into the module or "
                             "elsewhere) that only Dynamo's code repeats")
            return
        entries = getattr(self.trace, "guard_entries", None)
        if entries is None:
            self._not_saving("the trace does not record its guards")
            return
        try:
            described, spec_text = _output_layout(out, rec.outputs)
            checks, modules = self._checks_holding_now(entries, self._frame_kind, args, kwargs)
        except _NotSaved as exc:
            self._not_saving(str(exc))
            return
        sizes = _SavedSizes.of(self.trace, self._signer, self._model.config.backend == "inductor",
                               args, kwargs)
        payload = pickle.dumps({"graph": self._graph_blob, "sources": self._sources,
                                "out_spec": spec_text, "out_leaves": described,
                                "frame": self._frame_kind, "sizes": sizes.to_data(),
                                "valued": self._valued,
                                "stores": [store.to_data() for store in stores],
                                "modules": modules})
        try:
            cache.save_trace(payload, {"inputs": len(self._sources)},
                             [c.as_tuple() for c in checks])
        except CacheError:
            raise
        except Exception as exc:
            logger.warning("could not save the trace (%s: %s)", type(exc).__name__, exc)

    def _checks_holding_now(self, entries: Sequence[Any], frame_kind: str,
                            args: tuple[Any, ...], kwargs: dict[str, Any]
                            ) -> tuple[list[ValueCheck], dict[str, str]]:
        """The value checks to save with the trace, built from its guards, each of which must
        hold right now, as the trace saw it: this proves the sources evaluate the same way
        without Dynamo, and catches a forward that changed what it read; and the modules the
        globals Dynamo installed by id hold (see ``_Frame.installed_modules``). Raises
        :class:`_NotSaved` when they cannot be built or one does not hold."""
        try:
            frame = _Frame(self._model.module, frame_kind)
            checks = value_checks(entries, frame)
            modules = frame.installed_modules(
                [c.source for c in checks] + [str(c.arg) for c in checks if c.arg is not None]
                + list(self._sources or ()))
            why = failed_check(checks, frame, frame.locals_at_entry(args, kwargs))
        except _CannotCheck as exc:
            raise _NotSaved(f"the trace specialised on {exc}, which another process cannot "
                            "re-check") from None
        except Exception as exc:
            raise _NotSaved(f"its checks cannot be built ({type(exc).__name__}: {exc})") from None
        if why is not None:
            raise _NotSaved(f"a value the trace specialised on cannot be re-checked: {why}")
        return checks, modules

    def _try_saved_trace(self, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Callable[..., Any] | None:
        """The forward of a saved trace that fits this call, with its graph compiled by the
        backend, so Dynamo never runs; None when there is none (the cache then counts and logs
        why)."""
        cache = self.cache
        if cache is None or self._backend is None:
            return None
        if getattr(getattr(self._model.module, "forward", None), "__func__", None) is None:
            return None
        chosen: list[_Chosen] = []

        def accept(saved: SavedTrace) -> str | None:
            return self._refusal(saved, args, kwargs, chosen)

        if cache.load_trace(accept) is None:
            return None
        pick = chosen[-1]
        pick.loaded.fn = self._backend(pick.gm, pick.example_inputs)  # errors here are real
        # the branches the saved trace took on sizes, for the per-call size checks
        if self.trace is not None:
            self.trace.adopt_size_conditions(pick.sizes.conditions, pick.sizes.symbols)
            self.trace.adopt_value_reads(pick.reads)
        self.trace_loaded = True
        self._model.stats.inc("traces_loaded")
        logger.info("loaded the saved trace from %s; Dynamo did not run", cache.entry_dir)
        return pick.loaded

    def _refusal(self, saved: SavedTrace, args: tuple[Any, ...], kwargs: dict[str, Any],
                 chosen: list[_Chosen]) -> str | None:
        """Why ``saved`` does not fit this call, checked cheapest first (the values and code it
        specialised on, its conditions on sizes, its placeholders), or None after appending it,
        loaded, to ``chosen``. Raises :class:`CorruptArtifactError` for a trace that cannot be
        read."""
        module = self._model.module
        # rows of another layout raise TypeError: load_trace removes the file
        checks = tuple(ValueCheck(*row) for row in saved.checks)
        try:
            data = pickle.loads(saved.payload)
            frame = _Frame(module, data["frame"], data.get("modules"))
        except Exception as exc:
            raise CorruptArtifactError(f"{type(exc).__name__}: {exc}") from None
        why = _specialised_values_differ(saved, checks, frame, args, kwargs)
        if why is not None:
            return why
        try:
            sizes = _SavedSizes.from_data(data["sizes"])
        except Exception as exc:
            raise CorruptArtifactError(f"{type(exc).__name__}: {exc}") from None
        why = sizes.refuses(self._signer, args, kwargs)
        if why is not None:
            return why
        try:
            gm, example_inputs = _load_graph(data["graph"], data.get("valued"))
            loaded = _LoadedTrace(frame, data["sources"], data["out_spec"], data["out_leaves"],
                                  [ConstantStore.from_data(d) for d in data.get("stores", ())])
        except Exception as exc:
            raise CorruptArtifactError(f"{type(exc).__name__}: {exc}") from None
        try:
            mismatch = _first_mismatch(loaded.bind(*args, **kwargs), example_inputs)
        except Exception as exc:
            mismatch = f"the graph inputs cannot be bound ({type(exc).__name__}: {exc})"
        if mismatch is not None:
            return f"the call does not fit the trace ({mismatch})"
        chosen.append(_Chosen(gm, example_inputs, loaded, sizes,
                              tuple((c.source, c.guard) for c in checks)))
        return None


class _NotSaved(Exception):
    """Why the first call's trace cannot be saved (logged, and counted in
    ``traces_not_saved``)."""


def _input_sources(gm: Any) -> tuple[list[str], str | None]:
    """The sources the traced graph's inputs are read from (``L['x']``, ``G['consts'].T``), in
    placeholder order, and why the trace cannot be saved when one has no such plain source (a
    saved trace rebinds each input from its source, without Dynamo's bytecode)."""
    sources: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = source_name(node)
        if name is None or not (name.startswith("L[") or name.startswith("G[")):
            return sources, f"graph input {node.name} has no plain source"
        sources.append(name)
    return sources, None


@contextlib.contextmanager
def _kept_values_only(gm: Any, splitting_ops: Sequence[str]) -> Iterator[None]:
    """The traced graph as a saved trace stores it, for the duration of the block; its node
    metadata is restored on the way out, whatever happens.

    A placeholder that is a view (say a reshaped block table) is stored as a plain tensor of the
    same sizes and strides: what the graph sees, without the view's base. So is every fake value
    the split reads (:func:`~freezeframe.compilation.split.values_the_split_reads`: the values
    crossing piece boundaries, sizes), a view as its ``detach()`` (the graph pickler cannot
    write a view's base), so a warm start need not re-derive them by fake propagation through
    the whole graph; :func:`valued_nodes` lists the nodes stored with one. The values inside
    pieces are left out (most of them: unpickling one costs about 2 ms); a piece compiled on a
    warm start is traced again by Inductor from its inputs' values. A trace whose kept values
    cannot be written (state the pickler cannot write) is not saved: re-deriving them by fake
    propagation outside Dynamo's tracing context can pin a symbolic size to the traced one (an
    op that reads it as an int), so warm starts trace it with Dynamo instead (its pieces'
    artifacts still load).
    """
    replaced: dict[tuple[Any, str], Any] = {}

    def put(node: Any, key: str, value: Any) -> None:
        replaced.setdefault((node, key), node.meta[key])
        node.meta[key] = value

    try:
        for node in gm.graph.nodes:
            for key in ("example_value", "val"):
                if key in node.meta and node.op == "placeholder":
                    put(node, key, _unviewed(node.meta[key]))
        keep = values_the_split_reads(gm, splitting_ops)
        for node in gm.graph.nodes:
            for key in ("example_value", "val"):
                if key not in node.meta or node.op == "placeholder":
                    continue
                if node.name not in keep:
                    replaced.setdefault((node, key), node.meta[key])
                    del node.meta[key]
                    continue
                put(node, key, _detached(node.meta[key]))
                if _holds_view(node.meta[key]):
                    raise CacheError(f"the value of {node.name} is still a view")
        yield
    finally:
        for (node, key), value in replaced.items():
            node.meta[key] = value


def _output_layout(out: Any, outputs: Sequence[Any]) -> tuple[list[tuple[str, Any]], str]:
    """Forward's return value ``out`` in terms of the graph's ``outputs`` on the same call:
    each leaf as ``("out", index)`` or ``("const", value)``, and the structure around them as
    text, so a warm start rebuilds it (:class:`_LoadedTrace`). Raises :class:`_NotSaved` for a
    leaf that is neither, or a structure that cannot be written down."""
    import torch
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(out)
    described: list[tuple[str, Any]] = []
    for leaf in leaves:
        index = next((i for i, o in enumerate(outputs) if o is leaf), None)
        if index is not None:
            described.append(("out", index))
        elif not isinstance(leaf, torch.Tensor) and is_primitive(leaf):
            described.append(("const", leaf))
        else:
            raise _NotSaved("forward returns a value that is not a graph output")
    try:
        spec_text = pytree.treespec_dumps(spec)
    except Exception as exc:
        raise _NotSaved(f"forward's return structure cannot be saved ({exc})") from None
    return described, spec_text


def _specialised_values_differ(saved: SavedTrace, checks: Sequence[ValueCheck], frame: _Frame,
                               args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a value or a piece of code the saved trace specialised on is not the same for this
    call (its checks, then the code of every object they and the call reach), or None."""
    module = frame.module
    try:
        locals_ = frame.locals_at_entry(args, kwargs)
        seen: list[Any] = [module, module.forward, *module.modules(), *locals_.values()]
        why = failed_check(checks, frame, locals_, seen)
        if why is None:
            why = code_mismatch(saved.code, seen)
    except Exception as exc:  # a call that does not bind, an odd object to walk
        why = f"it cannot be checked against this call ({type(exc).__name__}: {exc})"
    return why
