"""``GraphRunner(..., verify=N)``: the first N graph steps of each key, checked against eager.

A graph step answers from code that ran once, at capture: if anything the capture depended on
no longer holds (a value the model reads from Python, memory the graph reads at its captured
address, a kernel's assumption), the answer is wrong and nothing says so. With ``verify=N`` the
runner also runs the uncompiled module eagerly for the first ``N`` steps of each graph key
(mode and padded batch descriptor), on copies of the step's inputs taken before the step ran
(a model that writes its input writes them), outside any graph and through the model's hooks
as a plain call runs them (:meth:`Verifier.reference`), and
compares the two answers and the buffers each left behind. A difference raises
:class:`~freezeframe.errors.VerifyError` naming the key, the first output (or buffer) that
differs and by how much; the runner keeps the graph step's state and stays usable.

The module's buffers (a KV cache, a running count) are part of the check: both runs must start
from the same state, so the buffers are copied before the graph step, put back for the eager
run, and the graph step's buffers restored after it (a CUDA graph replay writes them without
moving their version counters, so every buffer is copied, not only those that changed). What
it costs, per verified step: the graph step taken unplanned, one eager forward, three copies of
every buffer, a copy of the answer and the comparison (on a 2-layer ToyLlama on the 2-core dev
CPU, ``scripts/verify_cost.py``: a verified step 2.1 ms where the graph step is 0.75 ms and an
eager forward 0.66 ms, so about two eager forwards more). Steps past the first ``N`` of a key
cost nothing (a dict lookup per unplanned graph step).

Tolerance: the largest absolute difference must stay within ``tolerance`` times the largest
absolute value of the eager result; by default 1e-4 for 32- and 64-bit floats (a compiler's
fused kernels round differently), 5e-2 for 16-bit ones, exact for integers and booleans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from freezeframe.batch import BatchDescriptor, GraphKey
from freezeframe.compilation.module_call import call_eagerly
from freezeframe.config import CUDAGraphMode
from freezeframe.containers import leaves, map_tensors
from freezeframe.context import forward_context
from freezeframe.errors import ConfigError, VerifyError
from freezeframe.stats import Stats

__all__ = ["Verifier", "default_tolerance"]



def default_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a result of ``dtype`` (see the module docstring)."""
    if not dtype.is_floating_point:
        return 0.0
    return 5e-2 if torch.finfo(dtype).bits <= 16 else 1e-4


def _difference(got: Any, want: Any, tolerance: float | None) -> str | None:
    """Why ``got`` is not ``want`` within tolerance, in words, or None."""
    if not isinstance(want, torch.Tensor):
        try:
            same = bool(got == want)
        except (RuntimeError, TypeError, ValueError):
            # (an object of another class holding tensors: nothing to compare it by)
            return None
        return None if same else f"is {got!r} where eager gives {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"is {type(got).__name__} where eager gives a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"is a {got.dtype} tensor of shape {list(got.shape)} where eager gives a "
                f"{want.dtype} tensor of shape {list(want.shape)}")
    if want.numel() == 0:
        return None
    g, w = got.detach().to("cpu"), want.detach().to("cpu")
    if not want.dtype.is_floating_point:
        return None if torch.equal(g, w) else "differs from eager's (exact values expected)"
    g, w = g.double(), w.double()
    if torch.isnan(g).ne(torch.isnan(w)).any():
        return "has NaN where eager's has none (or the reverse)"
    finite = torch.isfinite(w) & torch.isfinite(g)
    diff = float((g - w).abs()[finite].max()) if bool(finite.any()) else 0.0
    scale = float(w.abs()[finite].max()) if bool(finite.any()) else 0.0
    tol = default_tolerance(want.dtype) if tolerance is None else tolerance
    if diff > tol * max(scale, 1e-12):
        return (f"differs from eager's by up to {diff:.3g} (largest eager value {scale:.3g}; "
                f"allowed {tol:g} of it)")
    return None


@dataclasses.dataclass
class _Snapshot:
    """Every buffer of the module, copied (on the same device), and, before a step, copies
    of the step's inputs (by name) as the step received them."""

    buffers: list[tuple[str, torch.Tensor, torch.Tensor]]
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, module: nn.Module, inputs: Mapping[str, Any] | None = None) -> _Snapshot:
        with torch.no_grad():
            return cls([(name, buf, buf.detach().clone())
                        for name, buf in module.named_buffers()],
                       {name: v.detach().clone() if isinstance(v, torch.Tensor) else v
                        for name, v in (inputs or {}).items()})

    def restore(self) -> None:
        with torch.no_grad():
            for _, buf, copy in self.buffers:
                with torch.inference_mode(buf.is_inference()):
                    buf.copy_(copy)


class Verifier:
    """The verification of one runner: how many steps of each key are left to check."""

    def __init__(self, steps: int, tolerance: float | None, stats: Stats) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"verify: expected the number of graph steps to check per key, "
                              f"an int >= 0, got {steps!r}")
        if tolerance is not None and not (isinstance(tolerance, (int, float))
                                          and 0 <= tolerance < 1):
            raise ConfigError(f"verify_tolerance: expected a relative tolerance in [0, 1) or "
                              f"None for the per-dtype default, got {tolerance!r}")
        self.steps = steps
        self.tolerance = tolerance
        self._stats = stats
        self._done: dict[GraphKey, int] = {}

    def due(self, key: GraphKey) -> bool:
        """Whether a step of graph key ``key`` is still to be checked."""
        return self._done.get(key, 0) < self.steps

    def begin(self, module: nn.Module, inputs: Mapping[str, Any]) -> _Snapshot:
        """Before a checked graph step: the module's buffers and the step's ``inputs`` (by
        name) as the step starts from them (a model that writes its input writes the
        caller's tensor after the step: the reference must read it as it was)."""
        return _Snapshot.of(module, inputs)

    def reference(self, model: Any, before: _Snapshot, positional: bool, num_tokens: int,
                  extras: Mapping[str, Any]) -> Any:
        """The eager answer of a step: the inputs as ``before`` holds them (copies again, the
        reference may write them too), outside any graph, run as a plain call of ``model``
        would run (its hooks too) with the uncompiled module in place of its compiled
        forward (:func:`~freezeframe.compilation.module_call.call_eagerly`)."""
        copies = {name: v.clone() if isinstance(v, torch.Tensor) else v
                  for name, v in before.inputs.items()}
        args, kwargs = ((tuple(copies.values()), {}) if positional else ((), copies))
        with self.forward_context(num_tokens, extras):
            if isinstance(model, nn.Module) and isinstance(getattr(model, "module", None),
                                                           nn.Module):
                return call_eagerly(model, args, kwargs)
            return model.module(*args, **kwargs)

    def finish(self, key: GraphKey, before: _Snapshot, answer: Any, module: nn.Module,
               eager: Callable[[], Any]) -> None:
        """After the graph step of ``key`` answered ``answer``: run ``eager`` from the state
        ``before`` held, compare answers and buffers, leave the module as the graph step left
        it, and raise :class:`VerifyError` on a difference."""
        # (copied: the eager run must not be able to move what is compared)
        held = map_tensors(answer, lambda t: t.detach().clone())
        after = _Snapshot.of(module)
        before.restore()
        try:
            with torch.no_grad():
                want = eager()
            why = self._compare(held, want, after, module)
        finally:
            after.restore()
        self._done[key] = self._done.get(key, 0) + 1
        self._stats.inc("verified_steps")
        if why is not None:
            self._stats.inc("verify_mismatches")
            mode, desc = key
            raise VerifyError(
                f"verify: the {mode.name} graph step for {desc} gave another answer than the "
                f"module run eagerly on the same inputs: {why}. The graphs were captured for "
                "something that no longer holds (a value forward reads from Python, a tensor "
                "replaced in place of another, a kernel's assumption about the inputs). The "
                "runner is unchanged and keeps serving; compare cudagraph_mode='none' to find "
                "the cause")

    def _compare(self, got: Any, want: Any, after: _Snapshot,
                 module: nn.Module) -> str | None:
        got_leaves, want_leaves = list(leaves(got)), list(leaves(want))
        if [w for w, _ in got_leaves] != [w for w, _ in want_leaves]:
            return "the output's structure differs from eager's"
        for (where, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
            why = _difference(g, w, self.tolerance)
            if why is not None:
                return f"{where} {why}"
        eager_buffers = dict(module.named_buffers())
        for name, _, graph_value in after.buffers:
            why = _difference(graph_value, eager_buffers[name], self.tolerance)
            if why is not None:
                return f"buffer {name!r} after the step {why}"
        return None

    def forward_context(self, num_tokens: int, extras: Mapping[str, Any]) -> Any:
        """The context the eager run sees: no graph mode, the real batch size."""
        return forward_context(BatchDescriptor(num_tokens=num_tokens),
                               mode=CUDAGraphMode.NONE, **extras)
