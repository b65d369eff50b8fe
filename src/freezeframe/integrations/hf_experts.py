"""Mixture-of-experts layers on breakable graphs: the expert computation as a graph break.

Which tokens go to which expert is data: transformers' expert modules (``MixtralExperts``,
``Qwen2MoeExperts``, ...) read the per-expert token counts back to the host or turn them into
shapes. A captured graph would replay the routing of the step it captured, so ``ff.hf.compile``
refuses such a model with FULL graphs or traced PIECEWISE ones (:func:`check_experts` in
:mod:`~freezeframe.integrations.hf_checks`). With a breakable capture (``trace=False``,
``cudagraph_mode="piecewise"``) it serves it: each expert module's ``forward`` becomes a
:func:`~freezeframe.graphs.breakable.graph_break`, so the router (a linear layer and a top-k,
fixed shapes) stays in the captured segments and the experts run eagerly at every replay, on
the tensors the segment before wrote, their output copied where the next segment reads it.

Before::

    layer.mlp.experts.forward  ->  MixtralExperts.forward (captured: routing frozen)

After::

    layer.mlp.experts.forward  ->  graph_break(MixtralExperts.forward bound to the module)
"""

from __future__ import annotations

from torch import nn

from freezeframe.graphs.breakable import graph_break

__all__ = ["break_at_experts", "expert_modules"]

_BROKEN = "__freezeframe_experts_break__"


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that run its experts (their class name ends with ``Experts``)."""
    return [(name, module) for name, module in model.named_modules()
            if type(module).__name__.endswith("Experts")]


def break_at_experts(model: nn.Module) -> int:
    """Make each expert module's ``forward`` a graph break (an instance attribute over the
    class's method; idempotent). Returns how many modules are breaks now."""
    count = 0
    for _, module in expert_modules(model):
        if not getattr(module.forward, _BROKEN, False):
            broken = graph_break(module.forward)
            setattr(broken, _BROKEN, True)
            module.forward = broken  # type: ignore[method-assign]
        count += 1
    return count
