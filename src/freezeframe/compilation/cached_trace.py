"""The first call of one trace: load a saved trace, else trace with Dynamo, then save the trace.

Holds :class:`ModelCache`, through which a trace's calls go: on the first call it opens the
model's :class:`~freezeframe.cache.entry.CompileCache` (or finds the cache off and just
traces), takes the model lock, and either has the trace's backend build a saved trace that
fits (checked with :mod:`freezeframe.compilation.saved_trace`) so Dynamo never runs, or runs
trace-once and, as a step after that call, saves what the backend kept of the trace. It does
not hold the trace itself (:mod:`freezeframe.compilation.trace`), the backend and what it keeps
(:mod:`freezeframe.compilation.trace_backend`), what a saved trace is made of
(:mod:`freezeframe.compilation.saved_trace`) or the files (:mod:`freezeframe.cache`).

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

import dataclasses
import logging
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from freezeframe.cache.artifacts import prefetch_torch_key
from freezeframe.cache.entry import CompileCache, SavedTrace
from freezeframe.cache.files import CorruptArtifactError, cache_enabled
from freezeframe.cache.key import is_primitive
from freezeframe.cache.traced_code import code_mismatch
from freezeframe.compilation.compilers import config_passes, pass_sources
from freezeframe.compilation.constant_stores import ConstantStore
from freezeframe.compilation.direct_call import free_of_side_effects
from freezeframe.compilation.guard_checks import (
    ValueCheck,
    _CannotCheck,
    failed_check,
    value_checks,
)
from freezeframe.compilation.saved_trace import (
    _first_mismatch,
    _Frame,
    _load_graph,
    _LoadedTrace,
    _SavedSizes,
)
from freezeframe.compilation.signature import Signer
from freezeframe.config import CompilationConfig
from freezeframe.errors import CacheError
from freezeframe.stats import Stats

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.compilation.trace import TraceOnce
    from freezeframe.compilation.trace_backend import KeptTrace, TraceBackend

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
    """The first call of one trace of a :class:`~freezeframe.compilation.model.CompiledModel`,
    and every call after it (in place of the trace-once callable).

    The first call opens the cache (the input signature is part of the key), takes the model
    lock and then either

    * loads a saved trace (sources unchanged, every value and piece of code the trace
      specialised on unchanged) and has the trace's backend build the stored graph, so Dynamo
      never runs and every Inductor piece comes from an artifact; or
    * traces with Dynamo as usual (the backend keeps what saving needs: see
      :class:`~freezeframe.compilation.trace_backend.KeptTrace`), and then, a step after the
      call, saves the trace (with checks built from the trace's guards) when the forward's
      inputs and outputs can be expressed without Dynamo's bytecode and every guard can be
      re-checked in another process.

    The saved trace assumes what trace-once already assumes: forward has no Python side effects
    outside the graph. It is loaded only for a call whose sizes meet the conditions its Python
    branches put on them (saved with it), and whose placeholders' dtypes, ranks and static
    sizes fit.
    """

    def __init__(self, module: nn.Module, config: CompilationConfig, stats: Stats,
                 backend: TraceBackend, trace: TraceOnce,
                 dynamic_arg_dims: Mapping[str, Any] | None = None, *,
                 model_key: str | None = None, signer: Signer | None = None) -> None:
        self._module = module
        self._config = config
        self._stats = stats
        self._backend = backend
        self.trace = trace
        self._signer = signer  # the model's call keys: the sizes a saved trace is checked on
        self._dims = dict(dynamic_arg_dims or {})
        self._user_key = model_key
        self._run: Callable[..., Any] | None = None
        self.cache: CompileCache | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._run is not None:
            return self._run(*args, **kwargs)
        return self._first_call(args, kwargs)

    # -- first call -----------------------------------------------------------------------
    def _first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        config, trace = self._config, self.trace
        # the passes are resolved only for a cache that is on, as CompileCache.open did itself
        passes = pass_sources(config_passes(config)) if cache_enabled(config) else None
        self.cache = CompileCache.open(config, stats=self._stats, module=self._module,
                                       args=args, kwargs=kwargs, dynamic_arg_dims=self._dims,
                                       model_key=self._user_key, inductor_passes=passes)
        if self.cache is None:
            self._run = trace
            return trace(*args, **kwargs)
        self._backend.save_into(self.cache)
        if config.backend == "inductor":
            prefetch_torch_key()  # every artifact load compares it; overlaps the trace's load
        with self.cache.lock(), self.cache.inductor_dir(config.backend == "inductor"):
            loaded = self._try_saved_trace(args, kwargs)
            if loaded is not None:
                self._run = loaded
                out = loaded(*args, **kwargs)
                self.cache.record_start(trace_loaded=True)
                return out
            out = trace(*args, **kwargs)
            self._save_trace(out, args, kwargs)  # the step after the first call
            self.cache.record_start(trace_loaded=False)
        self._run = trace
        return out

    def _not_saving(self, why: str) -> None:
        logger.info("the trace of %s is not saved, so warm starts will trace with Dynamo: %s",
                    type(self._module).__name__, why)
        self._stats.inc("traces_not_saved")

    def _save_trace(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Saves the first call's trace (``out`` is what it returned) for warm starts, or logs
        and counts why it cannot be saved: the reasons are checked cheapest first."""
        cache, kept, rec = self.cache, self._backend.kept, self._backend.outputs
        if cache is None:
            return
        if kept is not None and kept.not_saved is not None:
            self._not_saving(kept.not_saved)
            return
        if kept is None or rec is None or rec.outputs is None:
            self._not_saving("the compiled graph was not called by the first call")
            return
        if kept.frame is None:
            self._not_saving("Dynamo traced a frame other than the forward")
            return
        stores: tuple[ConstantStore, ...] = ()
        pure = free_of_side_effects(self.trace)
        if not pure:
            # Dynamo's code repeats forward's Python side effects on every call (a store such
            # as self.last_hidden = h); a saved trace calls the graph alone, so a warm start
            # would skip them where a cold one makes them, unless they are constant stores
            # it repeats itself (constant_stores.py)
            stores = kept.stores or ()
        if not pure and not stores:
            self._not_saving("forward has Python side effects (it stores into the module or "
                             "elsewhere) that only Dynamo's code repeats")
            return
        try:
            described, spec_text = _output_layout(out, rec.outputs)
            checks, modules = self._checks_holding_now(self.trace.guard_entries, kept,
                                                       kept.frame, args, kwargs)
        except _NotSaved as exc:
            self._not_saving(str(exc))
            return
        sizes = _SavedSizes.of(self.trace, self._signer, self._config.backend == "inductor",
                               args, kwargs)
        payload = pickle.dumps({"graph": kept.graph, "sources": list(kept.sources),
                                "out_spec": spec_text, "out_leaves": described,
                                "frame": kept.frame, "sizes": sizes.to_data(),
                                "valued": list(kept.valued),
                                "stores": [store.to_data() for store in stores],
                                "modules": modules})
        try:
            cache.save_trace(payload, {"inputs": len(kept.sources)},
                             [c.as_tuple() for c in checks])
        except CacheError:
            raise
        except Exception as exc:
            logger.warning("could not save the trace (%s: %s)", type(exc).__name__, exc)

    def _checks_holding_now(self, entries: Sequence[Any], kept: KeptTrace, frame_kind: str,
                            args: tuple[Any, ...], kwargs: dict[str, Any]
                            ) -> tuple[list[ValueCheck], dict[str, str]]:
        """The value checks to save with the trace, built from its guards, each of which must
        hold right now, as the trace saw it: this proves the sources evaluate the same way
        without Dynamo, and catches a forward that changed what it read; and the modules the
        globals Dynamo installed by id hold (see ``_Frame.installed_modules``). Raises
        :class:`_NotSaved` when they cannot be built or one does not hold."""
        try:
            frame = _Frame(self._module, frame_kind)
            checks = value_checks(entries, frame)
            modules = frame.installed_modules(
                [c.source for c in checks] + [str(c.arg) for c in checks if c.arg is not None]
                + list(kept.sources))
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
        if cache is None:
            return None
        if getattr(getattr(self._module, "forward", None), "__func__", None) is None:
            return None
        chosen: list[_Chosen] = []

        def accept(saved: SavedTrace) -> str | None:
            return self._refusal(saved, args, kwargs, chosen)

        if cache.load_trace(accept) is None:
            return None
        pick = chosen[-1]
        # errors here are real
        pick.loaded.fn = self._backend.build(pick.gm, pick.example_inputs).stitched
        # the branches the saved trace took on sizes, for the per-call size checks; a trace
        # whose stores the loaded forward repeats is not free of side effects
        self.trace.adopt_saved(pick.sizes.conditions, pick.sizes.symbols, pick.reads,
                               side_effects=pick.loaded.has_stores)
        self._stats.inc("traces_loaded")
        logger.info("loaded the saved trace from %s; Dynamo did not run", cache.entry_dir)
        return pick.loaded

    def _refusal(self, saved: SavedTrace, args: tuple[Any, ...], kwargs: dict[str, Any],
                 chosen: list[_Chosen]) -> str | None:
        """Why ``saved`` does not fit this call, checked cheapest first (the values and code it
        specialised on, its conditions on sizes, its placeholders), or None after appending it,
        loaded, to ``chosen``. Raises :class:`CorruptArtifactError` for a trace that cannot be
        read."""
        module = self._module
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
