"""GraphWrapper: capture a runnable once per batch descriptor, replay it afterwards.

The wrapper holds the *policy* of graph use; the backend (:mod:`freezeframe.graphs.backend`)
holds the mechanism. Policy, as in the seeds:

* act only when the forward context's runtime mode equals the wrapper's own mode, otherwise
  call through. This one rule makes nesting work: a FULL wrapper around a model whose pieces
  are wrapped PIECEWISE — under a FULL step the outer wrapper captures/replays and the inner
  ones call through (inside the capture); under a PIECEWISE step the outer one calls through
  and the inner ones capture/replay;
* the first sight of a descriptor captures, later sights replay and return the stored output
  (the same tensor objects every time, overwritten by each replay);
* graphs are kept per owner as well: the forward context's ``owner`` (a runner's static
  buffers, or None for a low-level call). A graph reads the tensors it was captured on, so one
  owner never replays another's: two runners on one model, or a low-level call beside a
  runner, each capture and replay their own. The wrapper holds an owner weakly: once the owner
  is collected (a runner dropped, after a garbage collection), its graphs are dropped at the
  wrapper's next call, capture or inspection, so runners made and dropped on one model do not
  pile up graph memory;
* with ``ordinary_memory`` (a model whose calls keep the caller's autograd mode:
  ``inference_mode=False``, ``torch.compile(backend="freezeframe")``), a capture made in
  inference mode leaves it (grad stays off), so the graph's own memory (a piece's outputs,
  what it allocates) is ordinary tensors: a later call outside inference mode may write into
  them (the eager splitting op between pieces does) and is handed an answer it can change in
  place, as eager's. A capture reading an inference tensor (which it may write, and only
  inference mode may) stays in inference mode, and its graph serves calls in inference mode
  only: a call outside captures its own;
* a replay goes through the graph's :class:`~freezeframe.graphs.replay.Replay`, which states
  the rules for its arguments once (the captured tensors are read as they are, a new tensor of
  the captured shape is copied in, anything else is refused): the wrapper's own replays and a
  runner's planned steps (:meth:`GraphWrapper.replay_for`) take the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.containers import tensor_leaves
from freezeframe.context import get_forward_context
from freezeframe.errors import CaptureError, ConfigError
from freezeframe.graphs.backend import CapturedGraph, GraphBackend
from freezeframe.graphs.replay import Replay, ReplayShared, layout_of, tensor_args
from freezeframe.graphs.stores import AttributeStores
from freezeframe.stats import Stats

__all__ = ["CaptureWindow", "GraphOptions", "GraphWrapper"]

logger = logging.getLogger(__name__)

# graph_for's and replay_for's default owner: a graph of any owner
ANY_OWNER = object()


@dataclasses.dataclass(frozen=True)
class GraphOptions:
    """Per-wrapper switches the compile path sets by piece position.

    ``log``: log each capture (the first piece only, so a forward logs once per size).
    ``gc_disable``: skip the garbage collection / allocator flush before capture (every piece
    but the first: once per forward is enough, once per piece made capture ~10x slower).
    ``weak_ref_output``: keep and return the captured output as weak references (the last
    piece only — no later graph reads its output, so its memory need not be held; on CUDA this
    uses torch's non-owning-storage trick when available, else a strong reference is kept).
    """

    log: bool = False
    gc_disable: bool = False
    weak_ref_output: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise ConfigError(f"GraphOptions.{field.name}: expected True or False, got "
                                  f"{value!r}")


class CaptureWindow:
    """Whether capturing is allowed right now.

    Open by default so the low-level API (a forward context around a direct call) just works.
    A runner closes it after its ``capture()`` so that a descriptor nobody captured cannot
    trigger a slow, memory-hungry capture in the middle of serving: it raises instead. A runner
    made later keeps it open for its own steps (:meth:`open_for` its owner) until its own
    ``capture()``: its steps before that capture on its buffers, as the first runner's did.
    """

    __slots__ = ("_open", "_open_for")

    def __init__(self, is_open: bool = True) -> None:
        self._open = bool(is_open)
        self._open_for: weakref.WeakSet[Any] = weakref.WeakSet()

    @property
    def is_open(self) -> bool:
        return self._open

    def is_open_for(self, owner: object | None) -> bool:
        """Whether a step of ``owner`` (its forward context's owner) may capture."""
        return self._open or (owner is not None and owner in self._open_for)

    def open_for(self, owner: object) -> None:
        self._open_for.add(owner)

    def close_for(self, owner: object) -> None:
        self._open_for.discard(owner)

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        self._open = False

    @contextlib.contextmanager
    def opened(self) -> Iterator[CaptureWindow]:
        """Open the window for the ``with`` block, then restore the previous state."""
        previous = self._open
        self._open = True
        try:
            yield self
        finally:
            self._open = previous

    def __repr__(self) -> str:
        return f"CaptureWindow({'open' if self._open else 'closed'})"


def _ident(owner: object | None) -> int | None:
    """The key an owner's graphs are kept under: its id (the wrapper holds it weakly)."""
    return None if owner is None else id(owner)


def _owner_gone(wrapper_ref: weakref.ref[GraphWrapper], ident: int) -> None:
    """An owner was collected: its graphs go at the wrapper's next purge."""
    wrapper = wrapper_ref()
    if wrapper is not None:
        wrapper._gone.append(ident)


@dataclasses.dataclass
class _Entry:
    """What the wrapper keeps per owner and descriptor: the warm-ups made, then the graph's
    replay."""

    warmups_done: int = 0
    replay: Replay | None = None
    # the owner, held weakly: a lookup by id also checks the very object, so an entry of a
    # collected owner is never served to a new one that got its id before the purge
    owner: weakref.ref[Any] | None = None

    def owned_by(self, owner: object | None) -> bool:
        return owner is None if self.owner is None else self.owner() is owner


@contextlib.contextmanager
def _ordinary_tensors() -> Iterator[None]:
    """Leave inference mode (grad stays off) for a capture: what it allocates, the graph's
    memory that later calls reuse, is then ordinary tensors, which a call in any mode may
    write into (an eager splitting op between pieces) and hand to its caller."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write), or None for an inference
    tensor, which has none."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


class GraphWrapper:
    """Captures ``runnable`` once per owner and batch descriptor in ``runtime_mode`` and
    replays it (the owner: see the module docstring).

    ``runtime_mode`` is PIECEWISE (one piece of a split model; keyed by
    ``descriptor.relax_for_piecewise()``) or FULL (the whole forward; keyed by the full
    descriptor). ``stats`` receives ``graphs_captured``, ``replays`` and ``bypasses``.
    ``window`` is the :class:`CaptureWindow` a runner closes after capturing. ``num_warmups``
    eager calls (in the wrapper's mode) precede the capture of each descriptor. A replay with a
    tensor argument at a new address copies it into the captured one; ``debug=True`` raises
    instead (see :mod:`freezeframe.graphs.replay`).

    The capturing call returns real results on every backend: where the backend only records
    the work (``cuda``), the wrapper replays the new graph once before returning.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode | str,
        backend: GraphBackend,
        options: GraphOptions | None = None,
        *,
        stats: Stats,
        window: CaptureWindow,
        debug: bool = False,
        num_warmups: int = 0,
        ordinary_memory: bool = False,
    ) -> None:
        mode = CUDAGraphMode.parse(runtime_mode)
        if mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ConfigError(
                f"GraphWrapper runtime_mode: {mode.name} is not a graph mode; a wrapper "
                "captures PIECEWISE (one piece) or FULL (the whole forward) graphs — for NONE "
                "do not wrap, and dispatch FULL_AND_PIECEWISE / FULL_DECODE_ONLY to a runtime "
                "mode first")
        if not callable(runnable):
            raise TypeError(f"GraphWrapper runnable must be callable, got {runnable!r}")
        if isinstance(num_warmups, bool) or not isinstance(num_warmups, int) or num_warmups < 0:
            raise ConfigError(f"GraphWrapper num_warmups: expected an int >= 0, got "
                              f"{num_warmups!r}")
        self.runnable = runnable
        self.runtime_mode = mode
        self.backend = backend
        self.options = options if options is not None else GraphOptions()
        self.stats = stats
        self.window = window
        self.num_warmups = num_warmups
        # captures made in inference mode allocate ordinary tensors (see the module docstring)
        self.ordinary_memory = bool(ordinary_memory)
        # (the owner's id or None, key, whether the graph's memory is inference tensors) ->
        # what is kept for it (see the module docstring)
        self._entries: dict[tuple[int | None, BatchDescriptor, bool], _Entry] = {}
        self._watched: set[int] = set()  # owners whose collection is watched
        self._gone: list[int] = []  # owners collected since the last purge
        self._shared = ReplayShared(mode.name, bool(debug), stats)
        # the module whose attribute stores (self.last = out) a capture notes and each replay
        # repeats (see repeat_stores_of)
        self._stores_of: nn.Module | None = None

    @property
    def debug(self) -> bool:
        """Whether a replay refuses a new tensor instead of copying it into the captured one."""
        return self._shared.debug

    def repeat_stores_of(self, module: nn.Module) -> None:
        """Have every replay repeat the attribute stores the capturing call made on
        ``module``'s submodules (:mod:`freezeframe.graphs.stores`): for a FULL wrapper around
        a traced forward, whose Dynamo code stores after the graph call (``self.last = out``)
        and which a replay does not run."""
        self._stores_of = module

    # -- introspection --------------------------------------------------------------------
    def unwrap(self) -> Callable[..., Any]:
        """The wrapped runnable."""
        return self.runnable

    @property
    def captured_descriptors(self) -> list[BatchDescriptor]:
        """The keys that have a captured graph (of any owner), in capture order."""
        self._purge()
        keys = [key for (_, key, _), entry in list(self._entries.items())
                if entry.replay is not None]
        return list(dict.fromkeys(keys))

    def replay_for(self, descriptor: BatchDescriptor,
                   owner: object | None = ANY_OWNER) -> Replay | None:
        """The :class:`~freezeframe.graphs.replay.Replay` of the graph ``owner`` captured for
        ``descriptor`` (relaxed for PIECEWISE; by default the first of any owner), or
        ``None``. A runner's planned step calls it directly: a PIECEWISE step in place of the
        piece (with the piece's arguments), a FULL step with :meth:`Replay.on_captured` once
        :meth:`Replay.reads_captured` holds for its static buffers. The ``Replay`` raises
        :class:`~freezeframe.graphs.StaleReplay` once the graph is dropped (:meth:`clear`, a
        recapture): the caller goes back to calling the wrapper."""
        key = self._key(descriptor)
        self._purge()  # first: a new owner may have a collected one's id
        if owner is ANY_OWNER:
            return next((entry.replay for (_, k, _), entry in list(self._entries.items())
                         if k == key and entry.replay is not None), None)
        for born_inference in (False, True):
            entry = self._entries.get((_ident(owner), key, born_inference))
            if entry is not None and entry.owned_by(owner) and entry.replay is not None:
                return entry.replay
        return None

    def graph_for(self, descriptor: BatchDescriptor,
                  owner: object | None = ANY_OWNER) -> CapturedGraph | None:
        """The captured graph for ``descriptor`` (relaxed for PIECEWISE), or ``None``; see
        :meth:`replay_for` for ``owner``."""
        replay = self.replay_for(descriptor, owner)
        return None if replay is None else replay.graph

    def drop_owned_by(self, owner: object | None) -> int:
        """Drop the graphs ``owner`` captured (None: low-level calls); how many there were."""
        self._purge()
        return self._drop(_ident(owner))

    def _drop(self, ident: int | None) -> int:
        dropped = 0
        for found in [found for found in list(self._entries) if found[0] == ident]:
            replay = self._entries.pop(found).replay
            if replay is not None:
                replay.drop()
                dropped += 1
        return dropped

    def _watch(self, owner: object | None) -> None:
        """Drop ``owner``'s graphs once it is garbage (at the next purge: a collection may run
        in any thread, in the middle of a call)."""
        if owner is None or id(owner) in self._watched:
            return
        self._watched.add(id(owner))
        weakref.finalize(owner, _owner_gone, weakref.ref(self), id(owner))

    def _purge(self) -> None:
        while self._gone:
            try:
                ident = self._gone.pop()
            except IndexError:  # another thread took the last one
                return
            self._watched.discard(ident)
            self._drop(ident)

    def memory_bytes(self) -> int:
        """The graph memory this wrapper's graphs report holding, summed: each graph's
        ``memory_bytes`` where its type has one (an emulated graph counts the tensors it keeps
        alive), 0 for a graph that does not (a CUDA graph's memory lives in the shared pool,
        which only the device's free memory shows)."""
        self._purge()
        total = 0
        for entry in list(self._entries.values()):
            graph = entry.replay.graph if entry.replay is not None else None
            held = getattr(graph, "memory_bytes", None) if graph is not None else None
            if isinstance(held, int):
                total += held
        return total

    def clear(self) -> None:
        """Drop every captured graph and stored output so their memory can be freed; the next
        sight of a descriptor captures again (if the window is open)."""
        for entry in list(self._entries.values()):
            if entry.replay is not None:
                entry.replay.drop()  # a planned step holding it sees the drop
        self._entries.clear()

    def __repr__(self) -> str:
        return (f"GraphWrapper({self.runtime_mode.name}, backend={self.backend.name}, "
                f"graphs={len(self.captured_descriptors)})")

    # -- calling --------------------------------------------------------------------------
    def _key(self, descriptor: BatchDescriptor) -> BatchDescriptor:
        if self.runtime_mode is CUDAGraphMode.PIECEWISE:
            return descriptor.relax_for_piecewise()
        return descriptor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = get_forward_context()
        if ctx is None or ctx.mode is not self.runtime_mode or ctx.batch_descriptor is None:
            self.stats.inc("bypasses")
            return self.runnable(*args, **kwargs)

        key = self._key(ctx.batch_descriptor)
        owner = ctx.owner
        if self._gone:  # first: a new owner may have a collected one's id
            self._purge()
        found = (None if owner is None else id(owner), key, False)
        entry = self._found(found, owner)
        if (entry is None or entry.replay is None) and self.ordinary_memory \
                and torch.is_inference_mode_enabled():
            # in inference mode, a graph whose memory is inference tensors serves too (and a
            # capture reading an inference tensor makes one: see _capture)
            held = self._found((found[0], key, True), owner)
            if (held is not None and held.replay is not None) \
                    or any(a.tensor.is_inference() for a in tensor_args(args, kwargs)):
                found, entry = (found[0], key, True), held
        if entry is not None and entry.replay is not None:
            replay = entry.replay
            if layout_of(args, kwargs) != replay.layout:
                replay.refuse_arguments(args, kwargs)
            return replay(*args, **kwargs)

        if not self.window.is_open_for(owner):
            raise CaptureError(
                f"no {self.runtime_mode.name} graph was captured for {key}, and capturing now "
                "is not allowed: the capture window is closed. The runner's capture() is the "
                "place to capture (it opens the window and covers every size the dispatcher "
                "owns); capture this descriptor there — add its size to "
                "cudagraph_capture_sizes — or open the window explicitly with "
                "`with window.opened():`")
        if entry is None:
            self._watch(owner)
            entry = self._entries[found] = _Entry(
                owner=None if owner is None else weakref.ref(owner))
        if entry.warmups_done < self.num_warmups:
            if self.options.log:
                logger.debug("warm-up %d/%d of the %s graph for %s", entry.warmups_done + 1,
                             self.num_warmups, self.runtime_mode.name, key)
            out = self.runnable(*args, **kwargs)
            entry.warmups_done += 1  # a warm-up that raised does not count
            return out
        return self._capture(key, entry, args, kwargs, ordinary=not found[2])

    def _found(self, found: tuple[int | None, BatchDescriptor, bool],
               owner: object | None) -> _Entry | None:
        """The entry kept under ``found`` for ``owner`` (one of a collected owner whose id
        ``owner`` got before the purge is forgotten)."""
        entry = self._entries.get(found)
        if entry is not None and owner is not None and entry.owner is not None \
                and entry.owner() is not owner:
            self._entries.pop(found, None)  # a collected owner's, not purged yet
            return None
        return entry

    def _capture(self, key: BatchDescriptor, entry: _Entry, args: tuple[Any, ...],
                 kwargs: dict[str, Any], *, ordinary: bool) -> Any:
        if self.options.log:
            logger.debug("capturing a %s graph for %s (%s backend)", self.runtime_mode.name,
                         key, self.backend.name)
        inputs = tensor_args(args, kwargs)
        grad = torch.is_grad_enabled()
        if grad:
            needs = next((a for a in inputs if a.tensor.requires_grad), None)
            if needs is not None:
                self._refuse_autograd(key, f"{needs.where} requires grad")
        versions = [_version(a.tensor) for a in inputs]
        ctx = get_forward_context()
        # passed only when it differs from the default, so a backend written before the
        # argument existed keeps working for every capture but a background one
        extra = {"error_mode": ctx.capture_error_mode} \
            if ctx is not None and ctx.capture_error_mode != "global" else {}
        module = self._stores_of
        before = AttributeStores.snapshot(module) if module is not None else None
        with _ordinary_tensors() if ordinary and self.ordinary_memory \
                and torch.is_inference_mode_enabled() else contextlib.nullcontext():
            graph, output = self.backend.capture(lambda: self.runnable(*args, **kwargs),
                                                 gc_disable=self.options.gc_disable, **extra)
        stores = AttributeStores.since(before) if before is not None else None
        # which inputs the graph writes into (unknown for inference tensors: assumed written)
        written = tuple(v is None or _version(a.tensor) != v
                        for a, v in zip(inputs, versions, strict=True))
        if grad and any(t.requires_grad for t in tensor_leaves(output)):
            self._refuse_autograd(key, "its output requires grad")
        if not self.backend.capture_computes:
            # The capture only recorded the work: run it once, so this call returns real
            # values (and its in-place writes happen once), as every later replay does.
            graph.replay()
        if self.options.weak_ref_output:
            output = self.backend.weak_ref(output)
        # Stored strongly unless weak_ref_output: a later piece's graph reads this memory, so
        # it must not return to the pool while the graph exists. The Replay holds the tensor
        # arguments too: the graph reads their memory.
        entry.replay = Replay(graph, output, key, inputs, written, layout_of(args, kwargs),
                              self._shared, stores)
        self.stats.inc("graphs_captured")
        return output

    def _refuse_autograd(self, key: BatchDescriptor, why: str) -> None:
        raise CaptureError(
            f"cannot capture the {self.runtime_mode.name} graph for {key} while autograd is "
            f"recording ({why}): a replayed graph records no autograd history, so its outputs "
            "would have no gradient and the next replay would overwrite tensors autograd "
            "saved. Graphs are for inference: call under torch.no_grad() or "
            "torch.inference_mode(), or compile with ff.compile(..., inference_mode=True) (the "
            "default), which runs every call in inference mode")
