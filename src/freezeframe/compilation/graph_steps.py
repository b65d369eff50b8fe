"""What a compiled model hands a runner for a graph step it repeats on the same buffers.

A :class:`~freezeframe.runtime.GraphRunner` calls the model on its static buffers, step after
step. Once a size is captured, the model's Python (routing, Dynamo's bytecode, the input checks
of each replay) gives the same answer every time, so it is worked out once, here, and the
runner keeps a zero-argument function:

* FULL: :func:`full_replay` -- the FULL graph's :class:`~freezeframe.graphs.replay.Replay` on
  the buffers it was captured reading, checked once;
* PIECEWISE: :func:`piecewise_replay` -- the stitching graph called directly on the flat
  inputs Dynamo's code passed it, each capturable piece its graph's ``Replay`` (the same
  argument checks a call through the wrapper makes), the splitting ops called as the graph
  calls them, the output rebuilt from the graph's outputs.

Both keep the module-state check of every call (``check``: parameters replaced since the plan
drop every graph, and the replay then raises :class:`~freezeframe.graphs.StaleReplay`).

And :func:`refuse_graphs_under_autograd`: a graph step is refused while autograd records.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freezeframe.batch import BatchDescriptor
from freezeframe.compilation.direct_call import (
    Stitched,
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

__all__ = ["drop_graphs", "full_replay", "piecewise_replay", "refuse_graphs_under_autograd"]

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


def full_replay(wrapper: GraphWrapper | None, descriptor: BatchDescriptor,
                args: tuple[Any, ...], kwargs: dict[str, Any],
                check: Callable[[], None] | None, owner: object) -> Callable[[], Any] | None:
    """A zero-argument replay of ``wrapper``'s FULL graph that ``owner`` captured for
    ``descriptor`` on these arguments, running ``check`` (the model's every-call state check)
    first; None when there is no such graph."""
    replay = wrapper.replay_for(descriptor, owner) if wrapper is not None else None
    if replay is None or not replay.reads_captured(args, kwargs):
        return None
    on_captured = replay.on_captured
    if check is None:
        return on_captured

    def checked() -> Any:
        check()
        return on_captured()

    return checked


def piecewise_replay(variant: Variant, stitched: Stitched, descriptor: BatchDescriptor,
                     calls: list[tuple[tuple[Any, ...], Any]], out: Any,
                     check: Callable[[], None] | None, inference: bool,
                     model_key: str, owner: object) -> Callable[[], Any] | None:
    """The PIECEWISE step of ``variant`` for ``descriptor`` (its graphs those ``owner``
    captured), repeated without the model's
    Python: ``calls`` is what one watched call passed to the stitching graph and got back,
    ``out`` what it returned. None when anything about it is not plannable (Python side
    effects in the generated code, an output that is not the graph's own, a piece without a
    graph)."""
    backend = variant.backend
    stitching = backend.stitching
    if len(calls) != 1 or stitching is None or not free_of_side_effects(variant.trace):
        return None
    flat_args, flat_out = calls[0]
    rebuild = rebuilder(out, flat_out)
    if rebuild is None or not stitched.calls(stitching):
        return None
    names = backend.capturable_names
    wrappers = [getattr(stitching, name) for name in names]
    if not all(isinstance(w, GraphWrapper) for w in wrappers):
        return None
    found = [w.replay_for(descriptor, owner) for w in wrappers]
    if any(r is None or not r.positional for r in found):
        return None
    pieces = cast(list[Replay], found)
    forward = planned_stitching(stitching, dict(zip(names, pieces, strict=True))).forward

    def replay() -> Any:
        if check is not None:  # first: parameters replaced since the plan drop every graph
            check()
        if not all(piece.live for piece in pieces):
            raise StaleReplay(f"a PIECEWISE graph for {descriptor} was dropped")
        try:
            if inference:  # (the guard torch.inference_mode() enters, for less)
                with torch._C._InferenceMode(True):
                    flat = forward(*flat_args)
            else:
                flat = forward(*flat_args)
        except StaleReplay as exc:  # part of the step ran: it must not run again
            raise CaptureError(
                f"{model_key}: a PIECEWISE graph of the planned step for {descriptor} was "
                f"dropped halfway through the step ({exc})") from None
        return rebuild(flat)

    return replay


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
