"""RoPE variants under ``ff.hf``: the ones whose frequencies HF picks per forward from the
longest position of one sequence.

An ``ff.hf`` step is flat: it holds several sequences and may prefill a long prompt in chunks,
so a per-forward choice would be made for the step, not for each sequence. Two variants make
one:

* **LongRoPE** (Phi-3 128k style) switches from its short to its long factors past
  ``original_max_position_embeddings``: a cache reaching past that is refused
  (:func:`check_rope`); below it every sequence uses the short factors, as in HF.
* **Dynamic NTK** (``rope_type="dynamic"``) recomputes its frequencies once a sequence grows
  past the positions cached so far (``max_seq_len_cached``, the model's
  ``max_position_embeddings`` unless HF grew it). A cache within them never grows, so HF's
  frequencies are the initial ones for every position: :func:`serve_dynamic_rope` runs the
  rotary embedding's forward without HF's per-call update (a data-dependent branch Dynamo
  cannot trace) on those modules. One HF already grew (it ran a longer sequence) is refused:
  its next shorter sequence would reset the frequencies.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from torch import nn

from freezeframe.errors import ConfigError

__all__ = ["check_rope", "serve_dynamic_rope"]


def _rope_dicts(config: object) -> list[Mapping[str, object]]:
    """The model's rope parameter dicts: transformers 5's ``rope_parameters`` (one, or one per
    layer type) or transformers 4's ``rope_scaling``."""
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, Mapping):
            nested = [v for v in value.values() if isinstance(v, Mapping)]
            found += nested if nested else [value]
    return found


def check_rope(model: nn.Module, max_cache_len: int) -> None:
    """Refuse a LongRoPE model (Phi-3 128k style) whose cache reaches past its original
    positions. HF picks the short or the long factors from the largest position of each forward
    of one sequence; a flat ``ff.hf`` step holds several sequences (and a prompt may be
    prefilled in chunks), so a sequence past the switch would be rotated with the step's
    factors, not its own. Below the switch every sequence uses the short factors in HF too."""
    config = model.config
    for params in _rope_dicts(config):
        if (params.get("rope_type") or params.get("type")) != "longrope":
            continue
        original = params.get("original_max_position_embeddings") or \
            getattr(config, "original_max_position_embeddings", None)
        if isinstance(original, int) and max_cache_len > original:
            raise ConfigError(
                f"ff.hf.compile: {type(model).__name__} uses LongRoPE, whose short or long "
                "factors HF picks from the longest position of each forward of one sequence; "
                "an ff.hf step mixes sequences and prefills long prompts in chunks, so "
                f"positions past original_max_position_embeddings={original} would get the "
                f"factors of the step, not of their sequence. Pass max_cache_len <= {original} "
                "(every sequence then uses the short factors, as in HF), or serve it without "
                "ff.hf")


def serve_dynamic_rope(model: nn.Module, max_cache_len: int) -> int:
    """Run each dynamic-NTK rotary embedding of ``model`` without HF's per-call frequency
    update, which a cache of ``max_cache_len`` positions never triggers (see the module
    docstring); returns how many modules were changed. Refuses, naming the module and the fix,
    a cache longer than the positions a module has cached, or a module HF already grew."""
    plain_forwards = []
    for name, module in model.named_modules():
        kind = getattr(module, "rope_type", None)
        kinds = list(kind.values()) if isinstance(kind, Mapping) else [kind]
        if not any(isinstance(k, str) and "dynamic" in k for k in kinds):
            continue
        where = f"ff.hf.compile: {name or type(model).__name__} ({type(module).__name__})"
        plain = getattr(type(module).forward, "__wrapped__", None)
        cached = getattr(module, "max_seq_len_cached", None)
        original = getattr(module, "original_max_seq_len", None)
        if plain is None or not isinstance(cached, int) or not isinstance(original, int) \
                or isinstance(kind, Mapping):
            raise ConfigError(
                f"{where} uses dynamic NTK RoPE in a form ff.hf does not know (per layer type, "
                "or without transformers' dynamic_rope_update): its frequencies would be "
                "decided per step, not per sequence. Serve it without ff.hf")
        if cached > original:
            raise ConfigError(
                f"{where}: its dynamic NTK RoPE was already grown to {cached} positions by an "
                f"earlier HF call past original_max_position_embeddings={original}; HF would "
                "reset it on the next shorter sequence. Load the model afresh before "
                "ff.hf.compile")
        if max_cache_len > cached:
            raise ConfigError(
                f"{where}: max_cache_len={max_cache_len} is past the {cached} positions its "
                "dynamic NTK RoPE covers before HF rescales it per sequence; ff.hf steps mix "
                f"sequences, so pass max_cache_len <= {cached}")
        plain_forwards.append((module, plain))
    for module, plain in plain_forwards:  # (all checked first: a refusal changes nothing)
        module.forward = types.MethodType(plain, module)  # HF's update would change nothing
    return len(plain_forwards)
