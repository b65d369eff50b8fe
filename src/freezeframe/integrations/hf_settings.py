"""The generation settings of one ``lm.generate`` call, resolved as Hugging Face's ``generate``
resolves them, and the ones ``ff.hf`` refuses.

Resolution (transformers 5's order; :func:`resolve`):

1. the ``generation_config`` argument, or an empty ``GenerationConfig``;
2. each field it leaves unset (``None``) from ``model.generation_config``;
3. each field still unset from HF's documented defaults (``max_length=20``, ``top_k=50``, ...);
4. the call's keyword arguments, over everything (``GenerationConfig.update``);
5. lengths: ``max_new_tokens`` wins over ``max_length`` (then ``max_length = width +
   max_new_tokens``); with no length anywhere, 20 new tokens (capped at the model's
   ``max_position_embeddings``); ``min_new_tokens`` sets ``min_length = width +
   min_new_tokens``. ``width`` is the padded prompt width, as in HF;
6. special tokens: ``eos_token_id`` as a list, ``pad_token_id`` falling back on the first of
   them.

Fields that ask for another decoding loop than greedy or sampling (beam search, contrastive
search, constrained or group beams, DoLa, classifier-free guidance, watermarking, ...) are a
:class:`~freezeframe.errors.ConfigError` naming the field and what to do instead; fields that
change nothing here (the cache implementation, compile settings, beam-only penalties) are taken
as HF takes them in greedy and sampling modes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from freezeframe.errors import ConfigError

try:
    from transformers import GenerationConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"freezeframe.integrations.hf needs Hugging Face transformers: {exc}; "
                      "install it with pip install 'freezeframe[hf]'") from None

__all__ = ["Settings", "Speculation", "resolve", "settings", "special_tokens"]

# HF's defaults for a field neither the call nor the model sets (transformers 5 keeps them out
# of GenerationConfig() and fills them in generate; transformers 4 has them in the class).
_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "num_beams": 1, "temperature": 1.0,
    "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "num_return_sequences": 1,
    "output_scores": False, "return_dict_in_generate": False, "remove_invalid_values": False,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0,
}

_BEAMS = "num_beams=1 (greedy or sampling), or HF's own model.generate for that decoding"


def _refusals(cfg: Any) -> list[tuple[str, str]]:
    """``(field=value, what it asks for)`` of every setting that needs a decoding loop other than
    greedy or sampling, or an output ff.hf does not make."""
    def get(name: str) -> Any:
        return getattr(cfg, name, None)

    found = []
    if (get("num_beams") or 1) > 1:
        found.append((f"num_beams={get('num_beams')}", "beam search"))
    if get("constraints") is not None or get("force_words_ids") is not None:
        name = "constraints" if get("constraints") is not None else "force_words_ids"
        found.append((f"{name}={get(name)!r}", "constrained beam search"))
    if (get("num_beam_groups") or 1) > 1 or (get("diversity_penalty") or 0.0) > 0:
        found.append((f"num_beam_groups={get('num_beam_groups')}", "group beam search"))
    if (get("penalty_alpha") or 0) > 0 and not get("do_sample") and (get("top_k") or 0) > 1:
        found.append((f"penalty_alpha={get('penalty_alpha')}", "contrastive search"))
    if get("dola_layers") is not None:
        found.append((f"dola_layers={get('dola_layers')!r}", "DoLa decoding"))
    if get("guidance_scale") not in (None, 1, 1.0):
        found.append((f"guidance_scale={get('guidance_scale')}",
                      "classifier-free guidance (a second forward per step)"))
    if get("watermarking_config") is not None:
        found.append(("watermarking_config", "watermarking"))
    if get("token_healing"):
        found.append(("token_healing=True", "token healing (re-tokenizes the prompt)"))
    for name in ("assistant_early_exit", "use_mtp", "speculation_type",
                 "assistant_ensemble_weight"):
        if get(name) not in (None, False):
            found.append((f"{name}={get(name)!r}",
                          "a speculative decoding method other than prompt lookup or a draft "
                          "model"))
    for name in ("output_attentions", "output_hidden_states"):
        if get(name):
            found.append((f"{name}=True", "per-layer outputs (the graphs do not keep them)"))
    return found


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative decoding of one call: ``num_tokens`` candidates per verification step, from
    the prompt itself (``prompt_lookup``, HF's ``PromptLookupCandidateGenerator``) or from a
    draft model (``draft``, an ``ff.hf`` model of the same tokenizer)."""

    num_tokens: int
    max_matching_ngram_size: int = 2
    draft: Any = None

    @property
    def prompt_lookup(self) -> bool:
        return self.draft is None


@dataclasses.dataclass(frozen=True)
class Settings:
    """One call's resolved generation settings, shared by its requests.

    ``config`` is the resolved ``GenerationConfig`` (a private copy: lengths final, fields HF
    fills in filled); ``width`` the padded prompt width the lengths count from (0 for a
    request added to the batcher on its own: its prompt is its whole history)."""

    config: Any
    width: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_token_id: int | None
    logits_processor: tuple[Any, ...] = ()
    stopping_criteria: tuple[Any, ...] = ()
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None
    tokenizer: Any = None
    speculation: Speculation | None = None

    @property
    def do_sample(self) -> bool:
        return bool(self.config.do_sample)


def _fill(target: Any, source: Any) -> None:
    """Set each field of ``target`` that is ``None`` to ``source``'s value (HF's
    ``defaults_only`` update, kept to public attributes)."""
    values = source.to_dict() if hasattr(source, "to_dict") else dict(source)
    for key, value in values.items():
        if key.startswith("_") or key == "transformers_version":
            continue
        if getattr(target, key, None) is None and value is not None:
            setattr(target, key, copy.deepcopy(value))


def _class_default_max_length() -> Any:
    """``GenerationConfig().max_length``: None on transformers 5, 20 on transformers 4 (where a
    config still holding it counts as "no length given")."""
    return GenerationConfig().max_length


def resolve(model_config: Any, model_generation_config: Any, generation_config: Any,
            kwargs: Mapping[str, Any], width: int) -> tuple[Any, dict[str, Any]]:
    """The resolved ``GenerationConfig`` for a prompt ``width`` tokens wide (see the module
    docstring) and the keyword arguments that are not generation fields (model inputs, which
    the caller refuses). Raises :class:`ConfigError` for a refused setting or impossible
    lengths."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ConfigError(f"generate: generation_config must be a transformers "
                          f"GenerationConfig, got {type(generation_config).__name__}")
    unset = _class_default_max_length()
    given_max = kwargs.get("max_length")
    default_max_length = given_max is None and all(
        getattr(c, "max_length", None) in (None, unset)
        for c in (generation_config, model_generation_config) if c is not None)
    default_min_length = kwargs.get("min_length") is None and all(
        getattr(c, "min_length", None) in (None, 0)
        for c in (generation_config, model_generation_config) if c is not None)
    if generation_config is not None:
        cfg = copy.deepcopy(generation_config)
        if model_generation_config is not None:
            _fill(cfg, model_generation_config)
    else:  # (transformers 4 fills GenerationConfig() with defaults: start from the model's)
        cfg = copy.deepcopy(model_generation_config) if model_generation_config is not None \
            else GenerationConfig()
    _fill(cfg, _DEFAULTS)
    try:
        unused = cfg.update(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"generate: {exc}") from None
    refused = _refusals(cfg)
    if refused:
        field, what = refused[0]
        raise ConfigError(f"generate: {field} asks for {what}, which ff.hf does not run; pass "
                          f"{_alternative(field)}")
    _lengths(cfg, model_config, width, default_max_length, default_min_length)
    return cfg, unused


def _alternative(field: str) -> str:
    if field.startswith(("num_beams", "constraints", "force_words_ids", "num_beam_groups")):
        return _BEAMS
    if field.startswith("penalty_alpha"):
        return "penalty_alpha=None (greedy) or do_sample=True, or HF's own model.generate"
    if field.startswith(("output_attentions", "output_hidden_states")):
        return "it as False (call the HF model directly for per-layer outputs)"
    name = field.split("=")[0]
    return f"{name}=None (or use HF's own model.generate for it)"


def _lengths(cfg: Any, model_config: Any, width: int, default_max_length: bool,
             default_min_length: bool) -> None:
    """HF's length rules (module docstring, step 5), in place."""
    for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, int):  # (HF would count 2.5 as 3)
            raise ConfigError(f"generate: {name}={value!r} must be an int (a token count)")
    if cfg.max_new_tokens is not None:
        cfg.max_length = cfg.max_new_tokens + width
    elif default_max_length:
        cfg.max_length = _DEFAULTS["max_length"] + width
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit is not None:
            cfg.max_length = min(cfg.max_length, limit)
    if cfg.min_new_tokens is not None:
        cfg.min_length = cfg.min_new_tokens + width
    if width >= cfg.max_length:
        raise ConfigError(
            f"generate: the prompt is {width} tokens wide but max_length is {cfg.max_length}, "
            "which leaves no new token; pass max_new_tokens (or a larger max_length)")
    del default_min_length  # (HF only warns about conflicting min lengths)


def special_tokens(cfg: Any) -> tuple[tuple[int, ...], int | None]:
    """``(stop ids, pad id)``: ``eos_token_id`` as a tuple of distinct ids, ``pad_token_id``
    or, unset, the first stop id (HF's fallback)."""
    eos = cfg.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"generate: eos_token_id={cfg.eos_token_id!r} must be a token id "
                          ">= 0, a list of them, or None")
    pad = cfg.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = int(pad)
    if pad is None and ids:
        pad = ids[0]
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
        raise ConfigError(f"generate: pad_token_id={pad!r} must be a token id >= 0 or None")
    return tuple(dict.fromkeys(ids)), pad


def settings(cfg: Any, width: int, *, logits_processor: Any = None,
             stopping_criteria: Any = None, prefix_allowed_tokens_fn: Any = None,
             tokenizer: Any = None, speculation: Speculation | None = None) -> Settings:
    """The :class:`Settings` of a resolved ``cfg`` for prompts ``width`` tokens wide."""
    stop_ids, pad = special_tokens(cfg)
    return Settings(
        config=cfg, width=width, max_new_tokens=int(cfg.max_length) - width,
        stop_ids=stop_ids, pad_token_id=pad,
        logits_processor=tuple(logits_processor or ()),
        stopping_criteria=tuple(stopping_criteria or ()),
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, tokenizer=tokenizer,
        speculation=speculation)
