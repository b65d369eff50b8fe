"""What a compiled model hands a runner to plan a graph step it repeats on the same buffers.

A :class:`~freezeframe.runtime.GraphRunner` calls the model on its static buffers, step after
step. Once a size is captured, the model's Python (routing, Dynamo's bytecode, the input checks
of each replay) gives the same answer every time, so the runner plans the step once and keeps
what it runs as data (``runtime/plan.py``):

* FULL (and a breakable model's PIECEWISE step): :func:`graph_replay` -- the graph's
  :class:`~freezeframe.graphs.replay.Replay`, when it was captured reading exactly the
  runner's buffers; the runner calls :meth:`~freezeframe.graphs.replay.Replay.on_captured`;
* PIECEWISE: a :class:`PieceChain` -- the pieces in the order the stitching graph calls them
  (each capturable piece its graph's ``Replay``, each splitting op as the graph calls it), the
  flat inputs Dynamo's code passed the stitching graph, and how the model's output is rebuilt.
  The runner's first step of a shape records it (:class:`PieceRecording`): the runner enters
  the recording around its own call of the model, then asks for the chain; nothing calls back
  into the runner.

The runner runs the model's every-call state check before either (parameters replaced since
the plan drop every graph, and the replay then raises :class:`~freezeframe.graphs.StaleReplay`).

And :func:`refuse_graphs_under_autograd`: a graph step is refused while autograd records.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation.direct_call import (
    free_of_side_effects,
    planned_stitching,
    rebuilder,
)
from freezeframe.compilation.routing import Variant
from freezeframe.config import CUDAGraphMode
from freezeframe.context import ForwardContext
from freezeframe.errors import CaptureError
from freezeframe.graphs import GraphWrapper
from freezeframe.graphs.replay import Replay, StaleReplay
from freezeframe.stats import Stats

__all__ = ["PieceChain", "PieceRecording", "drop_graphs", "graph_replay",
           "refuse_graphs_under_autograd"]

logger = logging.getLogger(__name__)

_requires_grad = operator.attrgetter("requires_grad")


def drop_graphs(wrappers: list[Any], moved: list[str], model_key: str, stats: Stats,
                warned: set[str]) -> bool:
    """Parameters or buffers (``moved``) were replaced, or their memory moved, since the
    graphs were captured: every graph reads the old memory at its captured address, so every
    graph of ``wrappers`` is dropped (the next step of each size captures again; a runner
    captures its keys again). A step is never served from them, and no new value is copied
    into the old tensors (a swapped-out weight stays as it was). Logged once per model
    (``warned``), counted in ``stats.graphs_dropped_weights``; False when no graph was held."""
    holding = [w for w in wrappers if w.captured_descriptors]
    if not holding:
        return False
    for wrapper in holding:
        wrapper.clear()
    stats.inc("graphs_dropped_weights")
    shown = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
    if "weights" not in warned:
        warned.add("weights")
        logger.warning("%s: %s replaced (or its memory moved) after graphs were captured: the "
                       "graphs read the old memory, so all of them were dropped and are "
                       "captured again (counted in stats.graphs_dropped_weights; logged once)",
                       model_key, shown)
    else:
        logger.debug("%s: %s replaced: graphs dropped", model_key, shown)
    return True


def graph_replay(wrapper: GraphWrapper | None, descriptor: BatchDescriptor,
                 args: tuple[Any, ...], kwargs: dict[str, Any], owner: object
                 ) -> Replay | None:
    """The :class:`Replay` of ``wrapper``'s graph that ``owner`` captured for ``descriptor``,
    when it was captured reading exactly these arguments; None otherwise."""
    replay = wrapper.replay_for(descriptor, owner) if wrapper is not None else None
    if replay is None or not replay.reads_captured(args, kwargs):
        return None
    return replay


@dataclasses.dataclass(frozen=True, slots=True)
class PieceChain:
    """A PIECEWISE step of one shape, as data (see the module docstring). Calling it runs the
    pieces in order through the stitching graph's own generated code, with ``calls`` bound in
    (``forward``), on the recorded ``flat_args``, and rebuilds the model's output."""

    descriptor: BatchDescriptor
    #: (stitching attribute, what it runs): each capturable piece's Replay, each splitting
    #: op's callable, in the order the stitching graph calls them
    calls: tuple[tuple[str, Any], ...]
    replays: tuple[Replay, ...]
    flat_args: tuple[Any, ...]
    forward: Callable[..., Any]
    rebuild: Callable[[Any], Any]
    inference: bool
    model_key: str

    def __call__(self) -> Any:
        for piece in self.replays:  # first: nothing runs when a graph was dropped
            if piece.graph is None:
                raise StaleReplay(f"a PIECEWISE graph for {self.descriptor} was dropped")
        try:
            if self.inference:  # (the guard torch.inference_mode() enters, for less)
                with torch._C._InferenceMode(True):
                    flat = self.forward(*self.flat_args)
            else:
                flat = self.forward(*self.flat_args)
        except StaleReplay as exc:  # part of the step ran: it must not run again
            raise CaptureError(
                f"{self.model_key}: a PIECEWISE graph of the planned step for "
                f"{self.descriptor} was dropped halfway through the step ({exc})") from None
        return self.rebuild(flat)


class PieceRecording:
    """The stitching graph's calls during one model call, for :meth:`chain`: entered by the
    runner around its first PIECEWISE step of a shape (a call of ``variant`` for
    ``descriptor``, its graphs those ``owner`` captured)."""

    __slots__ = ("_descriptor", "_inference", "_model_key", "_owner", "_stitched", "_variant",
                 "calls")

    def __init__(self, variant: Variant, descriptor: BatchDescriptor, owner: object,
                 inference: bool, model_key: str) -> None:
        self._variant, self._descriptor, self._owner = variant, descriptor, owner
        self._stitched = variant.stitched  # what the trace's code calls (read once)
        self._inference, self._model_key = inference, model_key
        # (flat inputs, flat outputs) of each stitching call; None: not recording (another
        # recording was under way)
        self.calls: list[tuple[tuple[Any, ...], Any]] | None = []

    def __enter__(self) -> PieceRecording:
        stitched = self._stitched
        if stitched is None or stitched.recording is not None:
            self.calls = None
        else:
            stitched.recording = self.calls
        return self

    def __exit__(self, *exc: object) -> None:
        stitched = self._stitched
        if self.calls is not None and stitched is not None \
                and stitched.recording is self.calls:
            stitched.recording = None

    def chain(self, out: Any) -> PieceChain | None:
        """The recorded call as a :class:`PieceChain` (``out``: what the model returned); None
        when it cannot be repeated without the model's Python (Python side effects in the
        generated code, not one stitching call, an output that is not the graph's own, a piece
        without a graph of this owner)."""
        variant, calls = self._variant, self.calls
        backend, stitched = variant.backend, self._stitched
        stitching = backend.stitching
        if calls is None or len(calls) != 1 or stitching is None or stitched is None:
            return None
        if stitched.pure is None:
            stitched.pure = free_of_side_effects(variant.trace)
        if not stitched.pure:
            return None
        flat_args, flat_out = calls[0]
        rebuild = rebuilder(out, flat_out)
        if rebuild is None or not stitched.calls(stitching):
            return None
        names = backend.capturable_names
        wrappers = [getattr(stitching, name) for name in names]
        if not all(isinstance(w, GraphWrapper) for w in wrappers):
            return None
        found = [w.replay_for(self._descriptor, self._owner) for w in wrappers]
        replays = [r for r in found if r is not None and r.positional]
        if len(replays) != len(found):
            return None
        bound = dict(zip(names, replays, strict=True))
        ordered = tuple((p.name, bound.get(p.name, getattr(stitching, p.name)))
                        for p in backend.pieces)
        return PieceChain(self._descriptor, ordered, tuple(replays), tuple(flat_args),
                          planned_stitching(stitching, bound), rebuild,
                          self._inference, self._model_key)


def refuse_graphs_under_autograd(ctx: ForwardContext | None, graph_mode: CUDAGraphMode,
                                 module: nn.Module, params: tuple[nn.Parameter, ...],
                                 args: tuple[Any, ...], kwargs: dict[str, Any],
                                 model_key: str) -> None:
    """Refuse a graph step (capture or replay) while autograd records and something needs
    a gradient, before any piece runs: a replayed graph records no autograd history, so
    its output would lack eager's gradient. Checked per call rather than per piece, because
    a piece that needs no gradient would otherwise be captured before the one that does
    fails, and a graph captured while nothing needed one would be replayed silently.

    Only a graph step with ``inference_mode=False`` and grad enabled pays for it (the
    parameters are read at about 0.1 us each per call; a call under ``torch.no_grad()``, as
    the runner makes, skips it)."""
    if ctx is None or ctx.batch_descriptor is None or ctx.mode is CUDAGraphMode.NONE \
            or not graph_mode.has_mode(ctx.mode):
        return
    if any(map(_requires_grad, params)):
        name = next(n for n, p in module.named_parameters() if p.requires_grad)
        why = f"parameter {name!r} requires grad"
    elif _needs_grad(args) or _needs_grad(kwargs.values()):
        why = f"{_argument_needing_grad(module, args, kwargs)} requires grad"
    else:
        return
    raise CaptureError(
        f"{model_key}: cannot run the {ctx.mode.name} graphs for "
        f"{ctx.batch_descriptor} while autograd is recording ({why}): a replayed graph "
        "records no autograd history, so its output would have no gradient where eager's "
        "has one. This model was compiled with ff.compile(..., inference_mode=False); "
        "graphs are for inference: call under torch.no_grad() or torch.inference_mode(), "
        "compile with inference_mode=True (the default), or run steps that need "
        "gradients with mode=CUDAGraphMode.NONE")


def _needs_grad(values: Iterable[Any]) -> bool:
    """Whether a tensor among ``values`` (or inside a list, tuple or dict among them) requires
    grad; plain tensors are checked without flattening."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple, dict)) and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in pytree.tree_leaves(value)):
            return True
    return False


def _argument_needing_grad(module: nn.Module, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> str:
    """The name of the first argument holding a tensor that requires grad (error path)."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError:  # the call itself is wrong; the model's own error follows
        return "an argument"
    for name, value in bound.items():
        if any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in pytree.tree_leaves(value)):
            return f"argument {name!r}"
    return "an argument"
