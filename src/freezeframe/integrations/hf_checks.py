"""The checks :func:`freezeframe.integrations.hf.compile` runs before anything is traced: they
refuse, with the reason and the fix, a model or a configuration that ``ff.hf`` cannot serve
correctly.

Each is decided from the model's class, its transformers config and its modules, never by
running it: attention that is not causal self-attention (encoders, encoder-decoders, heads that
cannot generate, models whose attention bypasses ``transformers.AttentionInterface``); layer
types other than full and sliding attention; a cache longer than the model's positions; a
user's config that cannot serve the cache (no split at the attention op, too few sequences);
and mixture-of-experts models under graphs that would freeze their routing. A model that gets
past them and still routes some attention elsewhere is caught once it is traced
(``CompiledCausalLM``'s split check).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from freezeframe.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    breakable_capture,
)
from freezeframe.errors import ConfigError

__all__ = [
    "check_attention",
    "check_causal_lm",
    "check_experts",
    "check_given_config",
    "check_positions",
    "positive_int",
]


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ff.hf.compile: {name}={value!r} must be an int >= 1")
    return value


_SERVED = ("ff.hf serves decoder-only causal LMs, whose every token attends only to itself and "
           "earlier tokens (LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...)")


def check_causal_lm(model: nn.Module) -> None:
    """Refuse, before anything is traced, a model whose attention is not causal self-attention
    (ff.hf would serve it with causal attention: wrong logits, nothing raised)."""
    name, config = type(model).__name__, model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention",
                                                                 False):
        raise ConfigError(f"ff.hf.compile: {name} has cross-attention (is_encoder_decoder or "
                          f"add_cross_attention); only decoder-only causal LMs are supported: "
                          f"{_SERVED}")
    bidirectional = sorted({type(m).__name__ for m in model.modules()
                            if getattr(m, "is_causal", True) is False})
    can_generate = getattr(type(model), "can_generate", None)
    if bidirectional or (callable(can_generate) and not can_generate()):
        why = (f"its attention is bidirectional ({', '.join(bidirectional)}.is_causal is False"
               f"{', config.is_decoder is False' if hasattr(config, 'is_decoder') else ''})"
               if bidirectional else "it has no causal LM head (can_generate() is False)")
        raise ConfigError(
            f"ff.hf.compile: {name} is not a causal language model: {why}. {_SERVED}; serve "
            "an encoder with ff.compile or ff.GraphRunner and an attention of your own")
    if not getattr(type(model), "_supports_attention_backend", False):
        raise ConfigError(
            f"ff.hf.compile: {name} does not route its attention through "
            "transformers.AttentionInterface (_supports_attention_backend is False), so "
            "freezeframe cannot split it at attention; use a model class that does "
            "(LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...)")


def check_attention(model: nn.Module) -> None:
    """Refuse layer types the attention op does not implement: it serves full and sliding
    causal attention (with soft-capping and sinks); chunked, linear, sparse or hybrid layers
    are refused, decided from ``config.layer_types``."""
    name, config = type(model).__name__, model.config
    layer_types = list(getattr(config, "layer_types", None) or ())
    other = sorted({t for t in layer_types if t not in _SERVED_LAYERS})
    if other:
        raise ConfigError(f"ff.hf.compile: {name} has {other} layers (config.layer_types); "
                          f"only {list(_SERVED_LAYERS)} layers are supported: serve it "
                          "without ff.hf")


_SERVED_LAYERS = ("full_attention", "sliding_attention")


def check_positions(model: nn.Module, max_cache_len: int) -> None:
    """Refuse a cache longer than the positions the model was built for."""
    positions_limit = getattr(model.config, "max_position_embeddings", None)
    if positions_limit is not None and max_cache_len > positions_limit:
        raise ConfigError(
            f"ff.hf.compile: max_cache_len={max_cache_len} is above the model's "
            f"max_position_embeddings={positions_limit}; pass at most {positions_limit}")


def check_given_config(config: object, max_batch_size: int, splitting_op: str,
                       given: Mapping[str, object]) -> CompilationConfig:
    """A user's ``config``, checked: none of the keyword arguments it replaces is ``given``
    (not ``None``), it is a :class:`CompilationConfig`, in PIECEWISE mode it splits at
    ``splitting_op``, and a decode step of ``max_batch_size`` rows fits its ``max_num_seqs``."""
    clash = sorted(k for k, v in given.items() if v is not None)
    if clash:
        raise ConfigError(
            f"ff.hf.compile: {clash} given together with config; set them in the "
            "CompilationConfig instead (cudagraph_capture_sizes, backend, graph_backend, "
            "cudagraph_mode, max_num_tokens, num_speculative_tokens)")
    if not isinstance(config, CompilationConfig):
        raise ConfigError(f"ff.hf.compile: config must be a CompilationConfig, got "
                          f"{type(config).__name__}")
    splits = config.mode is CompilationMode.PIECEWISE or breakable_capture(config)
    if splits and splitting_op not in (config.splitting_ops or ()):
        raise ConfigError(
            f"ff.hf.compile: config.splitting_ops={config.splitting_ops!r} does not name "
            f"{splitting_op!r}; add it, so that the graphs are split (or broken) at attention")
    if int(config.max_num_seqs) < max_batch_size:
        raise ConfigError(
            f"ff.hf.compile: config.max_num_seqs={config.max_num_seqs} is below "
            f"max_batch_size={max_batch_size}; a decode step of max_batch_size rows needs "
            f"max_num_seqs >= {max_batch_size}")
    return config


_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def check_experts(model: nn.Module, config: CompilationConfig) -> None:
    """Refuse a mixture-of-experts model when its routing would be captured: how many tokens
    each expert gets is data, read back to the host (transformers' grouped-mm fallback calls
    ``offs.tolist()``) or turned into shapes; a captured graph replays the routing of the step
    it captured. Served: no graphs, or breakable PIECEWISE graphs only, whose expert modules
    are breaks (:mod:`~freezeframe.integrations.hf_experts`)."""
    mode = config.cudagraph_mode
    if not isinstance(mode, CUDAGraphMode) or mode is CUDAGraphMode.NONE:
        return
    if breakable_capture(config) and not mode.has_full_cudagraphs():
        return
    counts = {f: getattr(model.config, f, None) for f in _EXPERT_FIELDS}
    found = [f"config.{f}={n}" for f, n in counts.items() if isinstance(n, int) and n > 1] + [
        f"{n} is a {type(m).__name__}" for n, m in model.named_modules()
        if type(m).__name__.endswith("Experts")]
    if found:
        raise ConfigError(
            f"ff.hf.compile: {type(model).__name__} is a mixture-of-experts model ({found[0]}) "
            f"and cudagraph_mode={mode.name} captures graphs; expert routing is data-dependent "
            "(which tokens go to which expert is read back to the host or becomes a shape), so "
            "a captured graph would freeze the routing of the step it captured and every "
            "replay would send tokens to the wrong experts. Pass trace=False with "
            "cudagraph_mode='piecewise' (breakable graphs; the experts run eagerly between "
            "them), cudagraph_mode='none' (compiled, no graphs), or serve it without ff.hf")
