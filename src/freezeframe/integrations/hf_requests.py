"""The requests of ``lm.batcher``: what a step makes (:class:`NewToken`), what leaves
(:class:`Finished`), what the batcher lists (:class:`RequestInfo`), and how a request is made:
its settings resolved, its prompt and lengths checked, its token picking built
(:func:`make_request`).

A ``generate`` call is an :class:`Owner`: its requests' tokens, ends and faults go to it, never
to the caller of :meth:`~freezeframe.integrations.hf_batching.Batcher.step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from freezeframe.errors import ConfigError
from freezeframe.integrations.hf_processing import Decoder, Row, row_wise
from freezeframe.integrations.hf_sampling import NoiseDraws, SamplingParams
from freezeframe.integrations.hf_settings import Settings, Speculation, resolve, settings
from freezeframe.integrations.hf_speculation import Proposer

__all__ = ["Chunk", "Finished", "Live", "Model", "NewToken", "Owner", "RequestInfo",
           "check_greedy", "check_prompt", "make_request", "prompt_lookup", "request_settings",
           "spec_width"]


class Model(Protocol):
    """What the batcher needs of a ``CompiledCausalLM``."""

    max_batch_size: int
    max_cache_len: int
    model: Any

    @property
    def max_num_tokens(self) -> int: ...

    @property
    def num_speculative_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    def step(self, input_ids: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
             *, uniform_decode: bool = False) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class NewToken:
    """A token a step made: the ``index``-th new token of ``request_id``; ``finished`` when it
    was the request's last (``finish_reason`` then says why)."""

    request_id: str
    token: int
    index: int
    finished: bool
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request that left: its new ``tokens`` (a stop token that ended it included) and why
    (``"eos"``, ``"length"``, ``"stop"``, ``"aborted"`` or ``"error"``, then ``error`` holds the
    exception). ``logits`` holds the float32 logits each token was picked from and ``scores``
    those logits after the processors (``[vocab]`` each) when the request keeps them."""

    request_id: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str
    logits: tuple[torch.Tensor, ...] = ()
    scores: tuple[torch.Tensor, ...] = ()
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """One request the batcher holds: ``state`` ``"waiting"`` (no cache row yet),
    ``"running"`` or ``"finished"`` (not yet taken); ``owner`` ``"caller"`` (added with
    :meth:`Batcher.add`) or ``"generate"`` (a running ``lm.generate``)."""

    request_id: str
    state: str
    owner: str
    prompt_tokens: int
    new_tokens: int


class Owner:
    """A ``generate`` call's share of the batcher: its tokens and finished requests, kept
    apart from the caller's."""

    def __init__(self) -> None:
        self.tokens: list[NewToken] = []
        self.finished: dict[str, Finished] = {}
        self.error: BaseException | None = None
        self.live = 0
        # the most columns a row that left needs (its tokens, or where a criterion stopped it)
        self.widest = 0


@dataclasses.dataclass(eq=False)
class Live:
    """A request between :meth:`Batcher.add` and its end."""

    request_id: str
    prompt: tuple[int, ...]
    settings: Settings
    decoder: Decoder
    owner: Owner | None
    noise: NoiseDraws | None = None
    member: int = 0  # its row in the noise draws
    keep_logits: bool = False
    keep_scores: bool = False
    proposer: Proposer | None = None
    # a criterion ended it after this many new tokens, but its call's other rows go on (HF's
    # rule: the call ends at the first column where every row was stopped)
    stopped: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt, then new tokens
    row: int = -1  # its cache row once admitted
    computed: int = 0  # tokens whose keys and values are in the cache
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    scores: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclasses.dataclass(eq=False)
class Chunk:
    live: Live
    count: int  # tokens of this request in the step, from live.computed on
    candidates: list[int] = dataclasses.field(default_factory=list)  # speculative, verified
    proposed: int = 0  # how many of the candidates were proposed (the rest is padding)
    first: int = 0  # its first row in the step's logits

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token (so a token is picked)."""
        return self.live.computed + self.count - len(self.candidates) >= len(self.live.tokens)


def request_settings(model: Model, params: Any, width: int, processors: Any,
                     criteria: Any) -> tuple[Settings, object | None]:
    """A request's :class:`Settings` from ``Batcher.add``'s arguments (a prompt ``width``
    tokens long), and the key its history-free processors may be shared under."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params.check_vocab(model.vocab_size)
        cfg, _ = resolve(None, None, params.generation_config(), {}, width)
        key = params if not processors and not criteria else None
    elif type(params).__name__ == "GenerationConfig":
        cfg, _ = resolve(getattr(model.model, "config", None),
                         getattr(model.model, "generation_config", None), params, {}, width)
        if (cfg.num_return_sequences or 1) > 1:
            raise ConfigError(
                f"Batcher.add: num_return_sequences={cfg.num_return_sequences}: a request is "
                "one sequence; add the prompt that many times (each with its own generator), "
                "or use lm.generate")
        key = None
    else:
        raise ConfigError(f"Batcher.add: params must be a SamplingParams or a transformers "
                          f"GenerationConfig, got {type(params).__name__}")
    return settings(cfg, width, logits_processor=processors, stopping_criteria=criteria,
                    speculation=prompt_lookup(model, cfg)), key


def check_greedy(which: str, cfg: Any) -> None:
    """Refuse speculative decoding (``which`` asks for it) where it cannot give the tokens."""
    if cfg.do_sample:
        raise ConfigError(f"generate: {which} with do_sample=True: ff.hf's speculative "
                          "decoding is greedy only; pass do_sample=False, or drop it to sample")
    if (cfg.num_return_sequences or 1) > 1:
        raise ConfigError(f"generate: {which} with num_return_sequences="
                          f"{cfg.num_return_sequences}: speculative decoding returns one "
                          "sequence per prompt (as in HF)")


def prompt_lookup(model: Model, cfg: Any) -> Speculation | None:
    """The prompt-lookup speculation a resolved config asks for (``prompt_lookup_num_tokens``),
    checked against what the model's graphs verify, or None."""
    lookup = getattr(cfg, "prompt_lookup_num_tokens", None)
    if lookup is None:
        return None
    check_greedy(f"prompt_lookup_num_tokens={lookup}", cfg)
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 1:
        raise ConfigError(f"generate: prompt_lookup_num_tokens={lookup!r} must be an int >= 1")
    if model.num_speculative_tokens and lookup > model.num_speculative_tokens:
        raise ConfigError(
            f"generate: prompt_lookup_num_tokens={lookup} is more than the "
            f"num_speculative_tokens={model.num_speculative_tokens} this model's graphs "
            f"verify; pass at most that many, or ff.hf.compile with "
            f"num_speculative_tokens={lookup}")
    return Speculation(num_tokens=lookup,
                       max_matching_ngram_size=int(cfg.max_matching_ngram_size or 2))


def spec_width(model: Model, resolved: Settings) -> int:
    """The candidates each verification step of a request with these settings checks."""
    spec = resolved.speculation
    return 0 if spec is None else max(spec.num_tokens, model.num_speculative_tokens)


def _check_lengths(model: Model, tokens: list[int], resolved: Settings) -> int:
    """Refuse stop tokens outside the vocabulary and a request the cache cannot hold;
    returns its speculative width."""
    bad = [i for i in resolved.stop_ids if model.vocab_size is not None and i >= model.vocab_size]
    if bad:
        raise ConfigError(f"eos_token_id {bad[0]} is outside the vocabulary of "
                          f"{model.vocab_size} tokens; pass this model's stop token "
                          "(model.generation_config.eos_token_id)")
    extra = spec_width(model, resolved)
    if extra + 1 > model.max_num_tokens:
        raise ConfigError(
            f"Batcher.add: a verification step of 1 + {extra} tokens is more than "
            f"max_num_tokens={model.max_num_tokens}; ask for fewer speculative tokens")
    needed = len(tokens) + resolved.max_new_tokens - 1 + extra
    if needed > model.max_cache_len:
        raise ConfigError(
            f"Batcher.add: a prompt of {len(tokens)} tokens and max_new_tokens="
            f"{resolved.max_new_tokens}{f' and {extra} speculative tokens' if extra else ''} "
            f"need {needed} cache positions but max_cache_len is {model.max_cache_len}; "
            f"ff.hf.compile with max_cache_len={needed}")
    return extra


def make_request(model: Model, shared_lists: dict[object, Any], rid: str, tokens: list[int],
                 resolved: Settings, *, padded: list[int], padding: int | None,
                 owner: Owner | None, noise: NoiseDraws | None = None, member: int = 0,
                 keep_logits: bool = False, keep_scores: bool = False,
                 share: object | None = None) -> Live:
    """A request, checked, not yet queued. ``padded``: the row as HF sees it (its padding,
    then ``tokens``); ``share``: a key under which requests with the same history-free
    processors share one list (kept in ``shared_lists``)."""
    if resolved.do_sample and noise is None:
        raise ConfigError("Batcher: a sampling request needs noise draws")
    extra = _check_lengths(model, tokens, resolved)
    row = Row(member, torch.tensor([padded], dtype=torch.long), padding)
    capacity = len(padded) + resolved.max_new_tokens + extra
    shared = None
    if share is not None:
        shared = shared_lists.get(share)
        if shared is None:
            candidate = Decoder(resolved, row, model.device, capacity).processors
            shared = (share, candidate) if row_wise(candidate) else (None, None)
            shared_lists[share] = shared
        shared = shared if shared[0] is not None else None
    decoder = Decoder(resolved, row, model.device, capacity, shared)
    live = Live(rid, tuple(tokens), resolved, decoder, owner, noise=noise, member=member,
                keep_logits=keep_logits, keep_scores=keep_scores, tokens=list(tokens))
    if resolved.speculation is not None:
        live.proposer = Proposer(resolved, decoder, model.vocab_size, model.device)
    return live


def check_prompt(model: Model, prompt: Sequence[int] | torch.Tensor) -> list[int]:
    """``prompt`` as a list of token ids of the model's vocabulary."""
    values = prompt.tolist() if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 \
        else list(prompt) if isinstance(prompt, (list, tuple)) else None
    vocab = model.vocab_size
    if not values or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise ConfigError(f"Batcher.add: prompt must be a non-empty list or 1-d tensor of "
                          f"token ids, got {_describe(prompt)}")
    bad = next((t for t in values if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ConfigError(f"Batcher.add: prompt token {bad} is outside [0, vocab_size="
                          f"{vocab}); pass token ids of this model's tokenizer")
    return values


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d {value.dtype} tensor"
    return repr(value) if isinstance(value, (list, tuple)) else type(value).__name__
