"""The built-in model specs ``freezeframe cache prewarm`` compiles: each module, the dims that
vary per call, and the first call a start makes. A process that wants a prewarmed entry builds
the same spec with :func:`prewarm_spec` and compiles it with the same config. Imports torch and
the models only when a spec is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from freezeframe.errors import ConfigError

__all__ = ["MODELS", "PrewarmSpec", "prewarm_spec"]

MODELS = ("example", "tiny", "1b")
"""The built-in model specs ``prewarm`` builds: ``example`` is :class:`ExampleMLP`, ``tiny``
and ``1b`` the reference Llama presets (seeded random weights, the KV cache of
:func:`prewarm_spec`)."""


@dataclasses.dataclass(frozen=True)
class PrewarmSpec:
    """A built-in model, the dims that vary per call, and the first call a start makes."""

    module: Any
    dynamic_arg_dims: dict[str, int]
    first_call: Callable[[Any], Any]


def prewarm_spec(name: str, *, layers: int | None = None, device: str = "cpu") -> PrewarmSpec:
    """The model spec ``name`` (one of :data:`MODELS`), with ``layers`` layers when given.

    A process that wants the prewarmed entry builds the same spec (same ``name``, ``layers``
    and ``device``) and compiles it with the same config: the cache key covers the module's
    structure and the first call's input signature.
    """
    import torch

    if name not in MODELS:
        raise ConfigError(f"--model: unknown model {name!r}; choose one of {list(MODELS)}")
    if layers is not None and layers < 1:
        raise ConfigError(f"--layers: must be at least 1, got {layers}")
    if name == "example":
        from freezeframe.models.example import ExampleMLP

        mlp = ExampleMLP(hidden_size=32, num_layers=layers or 2).to(device).eval()
        x = mlp.example_input(5).to(device)
        return PrewarmSpec(mlp, {"x": 0}, lambda model: model(x))

    from freezeframe.context import forward_context
    from freezeframe.models.attention import ATTN_METADATA_KEY
    from freezeframe.models.inputs import RequestChunk, build_step
    from freezeframe.models.kv_cache import KVCacheConfig
    from freezeframe.models.llama import LlamaConfig, LlamaModel, build_llama

    kv = KVCacheConfig(num_blocks=32, block_size=16, max_model_len=128)
    overrides = {} if layers is None else {"num_layers": layers}
    llama = build_llama(LlamaConfig.preset(name, **overrides), kv, seed=0, device=device)
    # a mixed step of several tokens (a dynamic dim first seen with size 1 is specialised)
    step = build_step([RequestChunk((1, 2, 3, 4, 5), 0, (0,)), RequestChunk((7, 8, 9), 0, (1,))],
                      kv, device=device)

    extras: dict[str, Any] = {ATTN_METADATA_KEY: step.host}

    def first_call(model: Any) -> Any:
        with torch.no_grad(), forward_context(None, **extras):
            return model(*step.args)

    return PrewarmSpec(llama, dict(LlamaModel.DYNAMIC_ARG_DIMS), first_call)
