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
* a replay reads the tensors the graph was captured with, so every replay checks its tensor
  arguments against them (a few hundred nanoseconds per tensor): the same tensor or a view at
  the same address with the same shape replays as is; a tensor at another address with the
  same shape and dtype is *copied into* the captured one first (counted in
  ``replay_input_copies``, logged once per wrapper, and copied back after the replay when the
  graph writes into it) — or, with ``debug=True``, refused with an error, for callers who want
  to prove that they always write into the captured buffers; another shape, dtype or set of
  tensor arguments is an :class:`~freezeframe.errors.InputMismatchError` (a replay cannot
  change the shape: pad the batch to the descriptor's size).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from freezeframe.batch import BatchDescriptor
from freezeframe.config import CUDAGraphMode
from freezeframe.context import get_forward_context
from freezeframe.errors import CaptureError, ConfigError, InputMismatchError
from freezeframe.graphs.backend import CapturedGraph, GraphBackend
from freezeframe.stats import Stats

__all__ = ["INPUT_COPIES", "CaptureWindow", "GraphOptions", "GraphWrapper", "PieceReplay",
           "StaleReplay"]

# Called with the captured tensor before a replay copies a new argument into it. A GraphRunner
# sets it for a step whose model runs hooks (runtime/plan.py): a forward pre-hook that returns
# new inputs makes the replay copy them into the runner's static buffer, a write that is the
# library's own and must not reach the caller's input.
INPUT_COPIES: contextvars.ContextVar[Callable[[torch.Tensor], None] | None] = \
    contextvars.ContextVar("freezeframe_input_copies", default=None)

logger = logging.getLogger(__name__)


class StaleReplay(Exception):
    """A function from :meth:`GraphWrapper.replayer` was called after its graph was dropped."""


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
    trigger a slow, memory-hungry capture in the middle of serving: it raises instead.
    """

    __slots__ = ("_open",)

    def __init__(self, is_open: bool = True) -> None:
        self._open = bool(is_open)

    @property
    def is_open(self) -> bool:
        return self._open

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


@dataclasses.dataclass
class _Entry:
    """What the wrapper keeps per descriptor."""

    warmups_done: int = 0
    graph: CapturedGraph | None = None
    output: Any = None
    # the tensor arguments of the capturing call (held: the graph reads their memory)
    inputs: tuple[_TensorArg, ...] = ()
    # per input: whether the capturing call wrote into it (copied back after a replay that
    # copied a new tensor in)
    written: tuple[bool, ...] = ()
    # which arguments were tensors, and the keyword names (see _layout)
    layout: tuple[Any, ...] = ((), ())


@dataclasses.dataclass(frozen=True)
class _TensorArg:
    """One tensor argument of the capturing call: where it was passed, and the tensor."""

    name: int | str  # argument position, or keyword name
    tensor: torch.Tensor

    @property
    def where(self) -> str:
        return f"argument {self.name}" if isinstance(self.name, int) else f"keyword {self.name!r}"

    def value(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(self.name, int):
            return args[self.name] if self.name < len(args) else None
        return kwargs.get(self.name)


def _reads_captured(now: Any, then: torch.Tensor) -> bool:
    """Whether argument ``now`` is the captured tensor ``then``, or a view of its very memory
    laid out the same way: a replay reads it as it is, with no copy."""
    return now is then or (
        isinstance(now, torch.Tensor) and now.shape == then.shape and now.dtype == then.dtype
        and now.device == then.device and now.data_ptr() == then.data_ptr()
        and now.stride() == then.stride())


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write), or None for an inference
    tensor, which has none."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


def _layout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Which positional arguments are tensors, and the keywords with whether each is one."""
    return (tuple(isinstance(a, torch.Tensor) for a in args),
            tuple((k, isinstance(v, torch.Tensor)) for k, v in kwargs.items()))


def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_TensorArg, ...]:
    named: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    return tuple(_TensorArg(name, value) for name, value in named
                 if isinstance(value, torch.Tensor))


class GraphWrapper:
    """Captures ``runnable`` once per batch descriptor in ``runtime_mode`` and replays it.

    ``runtime_mode`` is PIECEWISE (one piece of a split model; keyed by
    ``descriptor.relax_for_piecewise()``) or FULL (the whole forward; keyed by the full
    descriptor). ``stats`` receives ``graphs_captured``, ``replays`` and ``bypasses``.
    ``window`` is the :class:`CaptureWindow` a runner closes after capturing. ``num_warmups``
    eager calls (in the wrapper's mode) precede the capture of each descriptor. A replay with a
    tensor argument at a new address copies it into the captured one; ``debug=True`` raises
    instead (see the module docstring).

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
        self.debug = bool(debug)
        self.num_warmups = num_warmups
        self._entries: dict[BatchDescriptor, _Entry] = {}
        self._copy_logged = False

    # -- introspection --------------------------------------------------------------------
    def unwrap(self) -> Callable[..., Any]:
        """The wrapped runnable."""
        return self.runnable

    @property
    def captured_descriptors(self) -> list[BatchDescriptor]:
        """The keys that have a captured graph, in capture order."""
        return [key for key, entry in self._entries.items() if entry.graph is not None]

    def graph_for(self, descriptor: BatchDescriptor) -> CapturedGraph | None:
        """The captured graph for ``descriptor`` (relaxed for PIECEWISE), or ``None``."""
        entry = self._entries.get(self._key(descriptor))
        return None if entry is None else entry.graph

    def memory_bytes(self) -> int:
        """The graph memory this wrapper's graphs report holding, summed: each graph's
        ``memory_bytes`` where its type has one (an emulated graph counts the tensors it keeps
        alive), 0 for a graph that does not (a CUDA graph's memory lives in the shared pool,
        which only the device's free memory shows)."""
        total = 0
        for entry in self._entries.values():
            held = getattr(entry.graph, "memory_bytes", None) if entry.graph is not None else None
            if isinstance(held, int):
                total += held
        return total

    def clear(self) -> None:
        """Drop every captured graph and stored output so their memory can be freed; the next
        sight of a descriptor captures again (if the window is open)."""
        for entry in self._entries.values():
            entry.graph = None  # a replayer made for it sees the drop (see replayer)
        self._entries.clear()

    def replayer(self, descriptor: BatchDescriptor, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Callable[[], Any] | None:
        """A zero-argument function that replays the graph of ``descriptor`` and returns its
        output, for a caller that always passes these very arguments (a runner's static
        buffers): everything a replay checks per call is checked once, here.

        ``None`` when there is no graph for ``descriptor`` or when ``args``/``kwargs`` are
        not, tensor for tensor, the memory the graph was captured reading (same address,
        shape, strides, dtype and device). The returned function raises
        :class:`StaleReplay` once the graph is gone (:meth:`clear`, a recapture): the caller
        goes back to calling the wrapper. Call it from one thread at a time (a runner calls it
        under its lock): it counts its replays in a plain integer, a
        :class:`~freezeframe.stats.Tally`."""
        key = self._key(descriptor)
        entry = self._entries.get(key)
        if entry is None or entry.graph is None or _layout(args, kwargs) != entry.layout:
            return None
        for captured in entry.inputs:
            if not _reads_captured(captured.value(args, kwargs), captured.tensor):
                return None
        graph, output, stats = entry.graph, entry.output, self.stats
        replays = stats.tally("replays")

        def replay() -> Any:
            if entry.graph is not graph:
                stats.retire(replays)
                raise StaleReplay(f"the {self.runtime_mode.name} graph for {key} was dropped")
            graph.replay()
            replays.n += 1
            return output

        return replay

    def piece_replayer(self, descriptor: BatchDescriptor) -> PieceReplay | None:
        """The replay of this PIECEWISE wrapper's graph for ``descriptor``, for a caller that
        calls the pieces of one step shape again and again in the same order (a runner's
        planned step): the forward context, the key and the argument layout are looked up
        once, here. Each call still takes the piece's arguments: those that are the captured
        tensors are read as they are; a new tensor (a splitting op's fresh output) of the
        captured shape, dtype and device is copied in first, as :meth:`__call__` does, and
        copied back out if the graph writes into it. Anything else raises
        :class:`StaleReplay` before the graph runs (the caller goes back to calling the
        wrapper). ``None`` when there is no graph for ``descriptor`` or it was captured with
        keyword arguments. Call it from one thread at a time."""
        key = self._key(descriptor)
        entry = self._entries.get(key)
        if entry is None or entry.graph is None or entry.layout[1]:
            return None
        if not all(isinstance(c.name, int) for c in entry.inputs):
            return None
        return PieceReplay(self, key, entry)

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
        entry = self._entries.get(key)
        if entry is not None and entry.graph is not None:
            return self._replay(key, entry, entry.graph, args, kwargs)

        if not self.window.is_open:
            raise CaptureError(
                f"no {self.runtime_mode.name} graph was captured for {key}, and capturing now "
                "is not allowed: the capture window is closed. The runner's capture() is the "
                "place to capture (it opens the window and covers every size the dispatcher "
                "owns); capture this descriptor there — add its size to "
                "cudagraph_capture_sizes — or open the window explicitly with "
                "`with window.opened():`")
        if entry is None:
            entry = self._entries[key] = _Entry()
        if entry.warmups_done < self.num_warmups:
            if self.options.log:
                logger.debug("warm-up %d/%d of the %s graph for %s", entry.warmups_done + 1,
                             self.num_warmups, self.runtime_mode.name, key)
            out = self.runnable(*args, **kwargs)
            entry.warmups_done += 1  # a warm-up that raised does not count
            return out
        return self._capture(key, entry, args, kwargs)

    def _capture(self, key: BatchDescriptor, entry: _Entry, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        if self.options.log:
            logger.debug("capturing a %s graph for %s (%s backend)", self.runtime_mode.name,
                         key, self.backend.name)
        inputs = _tensor_args(args, kwargs)
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
        graph, output = self.backend.capture(lambda: self.runnable(*args, **kwargs),
                                             gc_disable=self.options.gc_disable, **extra)
        # which inputs the graph writes into (unknown for inference tensors: assumed written)
        written = tuple(v is None or _version(a.tensor) != v
                        for a, v in zip(inputs, versions, strict=True))
        if grad and any(isinstance(t, torch.Tensor) and t.requires_grad
                        for t in pytree.tree_leaves(output)):
            self._refuse_autograd(key, "its output requires grad")
        if not self.backend.capture_computes:
            # The capture only recorded the work: run it once, so this call returns real
            # values (and its in-place writes happen once), as every later replay does.
            graph.replay()
        if self.options.weak_ref_output:
            output = self.backend.weak_ref(output)
        # Stored strongly unless weak_ref_output: a later piece's graph reads this memory, so
        # it must not return to the pool while the graph exists.
        entry.output = output
        entry.inputs = inputs
        entry.written = written
        entry.layout = _layout(args, kwargs)
        entry.graph = graph
        self.stats.inc("graphs_captured")
        return output

    def _replay(self, key: BatchDescriptor, entry: _Entry, graph: CapturedGraph,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _layout(args, kwargs) != entry.layout:
            self._refuse_arguments(key, entry, args, kwargs)
        copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for captured, written in zip(entry.inputs, entry.written, strict=True):
            now = captured.value(args, kwargs)
            then = captured.tensor
            if _reads_captured(now, then):
                continue
            if now.shape != then.shape or now.dtype != then.dtype \
                    or now.device != then.device:
                self._refuse_shape(key, captured, now)
            if self.debug:
                self._refuse_address(key, captured, now)
            watch = INPUT_COPIES.get()
            if watch is not None:
                watch(then)
            then.copy_(now)
            if written:
                copied.append((now, then))
            self.stats.inc("replay_input_copies")
            if not self._copy_logged:
                self._copy_logged = True
                logger.info("%s of the %s graph for %s is a new tensor, not the captured one: "
                            "it is copied into the captured buffer before each such replay "
                            "(counted in stats.replay_input_copies); write into the captured "
                            "buffer to avoid the copy", captured.where,
                            self.runtime_mode.name, key)
        graph.replay()
        for now, then in copied:  # the graph wrote into its copy: the caller's tensor gets it
            now.copy_(then)
        self.stats.inc("replays")
        return entry.output

    def _refuse_autograd(self, key: BatchDescriptor, why: str) -> None:
        raise CaptureError(
            f"cannot capture the {self.runtime_mode.name} graph for {key} while autograd is "
            f"recording ({why}): a replayed graph records no autograd history, so its outputs "
            "would have no gradient and the next replay would overwrite tensors autograd "
            "saved. Graphs are for inference: call under torch.no_grad() or "
            "torch.inference_mode(), or compile with ff.compile(..., inference_mode=True) (the "
            "default), which runs every call in inference mode")

    def _refuse_arguments(self, key: BatchDescriptor, entry: _Entry,
                          args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The call passes its arguments differently from the capturing call."""
        def shown(layout: tuple[Any, ...]) -> str:
            positional, keywords = layout
            parts = ["tensor" if t else "other" for t in positional]
            parts += [f"{k}={'tensor' if t else 'other'}" for k, t in keywords]
            return f"({', '.join(parts)})"

        raise InputMismatchError(
            f"the {self.runtime_mode.name} graph for {key} was captured with arguments "
            f"{shown(entry.layout)} but is replayed with {shown(_layout(args, kwargs))}; a "
            "replay re-runs the captured work on the captured tensors, so call it with the "
            "same arguments it was captured with")

    def _refuse_shape(self, key: BatchDescriptor, captured: _TensorArg, now: Any) -> None:
        then = captured.tensor
        graph = f"the {self.runtime_mode.name} graph for {key}"
        if not isinstance(now, torch.Tensor):
            raise InputMismatchError(
                f"{captured.where} of {graph} is {type(now).__name__}, but the graph was "
                "captured with a tensor there; call it with the same arguments it was "
                "captured with")
        rows = ""
        if now.dim() >= 1 and then.dim() == now.dim() and now.shape[1:] == then.shape[1:]:
            rows = (f" — {now.shape[0]} rows where the graph was captured with "
                    f"{then.shape[0]}: a replay would return {then.shape[0]} rows, some of "
                    "them stale")
        raise InputMismatchError(
            f"{captured.where} of {graph} is {tuple(now.shape)} {now.dtype} on {now.device}, "
            f"but the graph was captured with {tuple(then.shape)} {then.dtype} on "
            f"{then.device}{rows}. A replay always works on the captured shape: pad the batch "
            "to the descriptor's size (the dispatcher's padded num_tokens) and pass that many "
            "rows")

    def _refuse_address(self, key: BatchDescriptor, captured: _TensorArg,
                        now: torch.Tensor) -> None:
        then = captured.tensor
        raise InputMismatchError(
            f"{captured.where} of the {self.runtime_mode.name} graph for {key} has address "
            f"{now.data_ptr():#x} (strides {now.stride()}), but the graph was captured reading "
            f"address {then.data_ptr():#x} (strides {then.stride()}). debug=True refuses the "
            "copy a replay would otherwise make: write the new data into the captured buffer "
            "(captured.copy_(new), or a slice of a persistent buffer) instead of passing a new "
            "tensor")


class PieceReplay:
    """One PIECEWISE graph's replay with its arguments, planned once (see
    :meth:`GraphWrapper.piece_replayer`)."""

    __slots__ = ("_copies", "_entry", "_graph", "_inputs", "_key", "_mode", "_nargs",
                 "_output", "_replays", "_stats")

    def __init__(self, wrapper: GraphWrapper, key: BatchDescriptor, entry: _Entry) -> None:
        assert entry.graph is not None
        self._key = key
        self._mode = wrapper.runtime_mode.name
        self._entry = entry
        self._graph = entry.graph
        self._output = entry.output
        self._nargs = len(entry.layout[0])
        # (position, the captured tensor, whether the capture wrote into it)
        self._inputs = tuple((cast(int, c.name), c.tensor, written)
                             for c, written in zip(entry.inputs, entry.written, strict=True))
        self._stats = wrapper.stats
        self._replays = wrapper.stats.tally("replays")
        self._copies = wrapper.stats.tally("replay_input_copies")

    @property
    def live(self) -> bool:
        """Whether the graph is still the one planned (not dropped by a clear or recapture)."""
        return self._entry.graph is self._graph

    def retire(self) -> None:
        """Fold this replay's counts into the plain counters (its plan is forgotten)."""
        self._stats.retire(self._replays)
        self._stats.retire(self._copies)

    def __call__(self, *args: Any) -> Any:
        if self._entry.graph is not self._graph:
            raise StaleReplay(f"the {self._mode} graph for {self._key} was dropped")
        if len(args) != self._nargs:
            raise StaleReplay(f"the {self._mode} graph for {self._key} got {len(args)} "
                              f"arguments, its capture {self._nargs}")
        copied: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        for i, then, written in self._inputs:
            now = args[i]
            if now is then or _reads_captured(now, then):
                continue
            if now.__class__ is not torch.Tensor or now.shape != then.shape \
                    or now.dtype != then.dtype or now.device != then.device:
                raise StaleReplay(f"argument {i} of the {self._mode} graph for {self._key} "
                                  "does not fit the captured tensor")
            then.copy_(now)
            self._copies.n += 1
            if written:
                copied = [] if copied is None else copied
                copied.append((now, then))
        self._graph.replay()
        if copied:
            for now, then in copied:  # the graph wrote into its copy: the caller's tensor too
                now.copy_(then)
        self._replays.n += 1
        return self._output
