"""Hugging Face transformers causal LMs, unmodified, served on freezeframe's graphs.

One entry: :func:`compile` (``ff.hf.compile(model, ...)``) takes a ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``GPT2LMHeadModel`` or any decoder-only model whose attention goes through
``transformers.AttentionInterface``, and returns a :class:`CompiledCausalLM` whose
:meth:`~CompiledCausalLM.generate` decodes greedily on captured graphs::

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                         intermediate_size=128, num_attention_heads=4)).eval()
    lm = ff.hf.compile(model, max_batch_size=8, max_cache_len=64, backend="eager",
                       graph_backend="emulated")
    lm.generate(torch.randint(0, 128, (3, 5)), max_new_tokens=4).sequences  # [3, 9]

How the model is served
-----------------------
* **Flat token batches.** Every step is one flat batch of tokens, as in vLLM: ``input_ids``,
  ``positions`` and ``seq_ids`` (the cache row of each token), each ``[num_tokens]``. The HF
  model sees them as one sequence (``input_ids[None]``, ``position_ids`` from ``positions``),
  so its embeddings, MLPs, norms and position embeddings are what they are eagerly; only
  attention needs to know which tokens belong together, and it is ours. A prefill of 3 prompts
  of 5 tokens is a 15-token step, a decode step of 3 sequences a 3-token step. So the token
  count is the one dynamic dim: one trace serves every batch, and graphs are captured per
  padded token count (for decode: per padded batch size).
* **The split point: HF's attention interface, calling our op.** Importing this module
  registers the attention implementation ``"freezeframe"``; :func:`compile` switches the model
  to it (``set_attn_implementation``, no model code changes). It calls the custom op
  ``freezeframe_hf::attention`` (:func:`freezeframe.models.ops.define_op`: microseconds a
  call), the splitting op, which runs eagerly between the captured pieces. Not SDPA: SDPA sees
  keys and values after HF's cache update and mask building (host-side bookkeeping that would
  land in captured pieces), cannot tell which tokens of a flat batch share a sequence, and other
  code calls it too. Our op owns the cache write and the attention, takes its metadata as
  tensors and needs no mask (a 4-d placeholder makes HF's mask utilities return early).
* **The static KV cache.** Two buffers, ``[layers, max_batch_size + 1, max_cache_len,
  kv_heads, head_dim]``, allocated once. The op writes each token's key and value at
  ``(seq_ids[t], positions[t])`` in place, then lets token ``t`` attend to cache positions
  ``<= positions[t]`` of its row: no host sync, no data-dependent shapes, so it is safe inside a
  captured graph (FULL modes) as well as between pieces. Padded tokens carry ``seq_ids == -1``
  and write only the extra sink row. A prefill rewrites its rows from position 0, so nothing
  needs clearing between generations. :meth:`CompiledCausalLM.step` checks every index on the
  host first: one outside the cache would be a device-side assert inside a graph.

Calling the HF model directly after :func:`compile` still works: without freezeframe's step
metadata the ``"freezeframe"`` attention runs HF's SDPA implementation with HF's SDPA mask.

Refused by :func:`compile` (:mod:`~freezeframe.integrations.hf_checks`), with the reason:
attention that is not causal self-attention (encoders such as ``BertForMaskedLM``,
encoder-decoders, heads that cannot generate); a sliding window shorter than ``max_cache_len``
(one at least that long never applies, and is served); other layer types, logit soft-capping,
attention sinks; and mixture-of-experts models while graphs are on (their routing is
data-dependent: a captured graph would freeze it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from freezeframe.compilation import CompiledModel
from freezeframe.compilation import compile as ff_compile
from freezeframe.config import CompilationConfig, CompilationMode
from freezeframe.errors import CompileError, ConfigError
from freezeframe.integrations.hf_checks import (
    check_attention,
    check_causal_lm,
    check_experts,
    check_given_config,
    check_positions,
    positive_int,
)
from freezeframe.models.ops import define_op
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.runner import CaptureReport
from freezeframe.stats import Stats

try:
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"freezeframe.integrations.hf needs Hugging Face transformers (>= 4.53): {exc}; "
        "install it with pip install 'freezeframe[hf]'") from None

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HF_ATTENTION_OP",
    "CompiledCausalLM",
    "Generation",
    "compile",
]

#: The splitting op, for ``CompilationConfig(splitting_ops=[HF_ATTENTION_OP])``.
HF_ATTENTION_OP = "freezeframe_hf::attention"
#: The name of the attention implementation registered with ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "freezeframe"
# The keyword argument under which a step's cache and metadata travel from the wrapper through
# the HF model (which passes its **kwargs on to the attention function) to the attention.
_STEP_KWARG = "freezeframe_step"
# Upper bound on tokens * cache positions * kv heads * head dim gathered at once by the op.
_GATHER_BUDGET = 1 << 22
# Attention features the op does not implement: the keyword HF passes, and what it means.
_UNSUPPORTED_KWARGS = {"sliding_window": "sliding-window attention",
                       "softcap": "attention logit soft-capping",
                       "s_aux": "attention sinks", "is_causal": "bidirectional attention"}


# -- the splitting op ------------------------------------------------------------------------
def _attention_kernel(
    q: torch.Tensor,  # [1, heads, T, head_dim]: HF's query layout for one sequence of T tokens
    k: torch.Tensor,  # [1, kv_heads, T, head_dim]
    v: torch.Tensor,  # [1, kv_heads, T, head_dim]
    out: torch.Tensor,  # [T, heads, head_dim], written
    k_cache: torch.Tensor,  # [layers, rows + 1, window, kv_heads, head_dim], written
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [T] position of each token in its sequence
    seq_ids: torch.Tensor,  # [T] cache row of each token; -1: padding (the sink row)
    layer: int,
    scale: float,
) -> None:
    """Write this step's keys and values into the layer's cache rows, then attend each token
    over its row's positions up to its own (causal over the cache)."""
    num_tokens = out.shape[0]
    if num_tokens == 0:
        return
    keys_cache, values_cache = k_cache[layer], v_cache[layer]
    sink = keys_cache.shape[0] - 1
    rows = torch.where(seq_ids < 0, torch.full_like(seq_ids, sink), seq_ids)
    # every token's key/value first, so a token sees the earlier tokens of the same step
    keys_cache.index_put_((rows, positions), k[0].transpose(0, 1).to(keys_cache.dtype))
    values_cache.index_put_((rows, positions), v[0].transpose(0, 1).to(values_cache.dtype))
    heads, head_dim = out.shape[1], out.shape[2]
    window, kv_heads = keys_cache.shape[1], keys_cache.shape[2]
    group = heads // kv_heads  # query heads per kv head (grouped-query attention)
    queries = q[0].transpose(0, 1).reshape(num_tokens, kv_heads, group, head_dim).float()
    visible = torch.arange(window, device=q.device) <= positions[:, None]  # [T, window]
    chunk = max(1, _GATHER_BUDGET // (window * kv_heads * head_dim))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        keys = keys_cache[rows[start:end]].float()  # [n, window, kv_heads, head_dim]
        values = values_cache[rows[start:end]].float()
        scores = torch.einsum("nkgd,ntkd->nkgt", queries[start:end], keys) * scale
        # position positions[t] itself is always visible, so no row is all -inf
        scores = scores.masked_fill(~visible[start:end, None, None, :], float("-inf"))
        result = torch.einsum("nkgt,ntkd->nkgd", scores.softmax(-1), values)
        out[start:end].copy_(result.reshape(end - start, heads, head_dim))


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    seq_ids: torch.Tensor, layer: int, scale: float) -> None:
    return None


_LIBRARY = define_op(
    HF_ATTENTION_OP,
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) k_cache, Tensor(c!) v_cache, "
    "Tensor positions, Tensor seq_ids, int layer, float scale) -> ()",
    _attention_kernel, _attention_fake)


# -- the HF attention function -----------------------------------------------------------------
class _StepMetadata(NamedTuple):
    """What the attention of one step needs beyond q, k, v: the caches and where tokens go."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"freezeframe"`` attention implementation (HF's attention-function signature)."""
    step = kwargs.pop(_STEP_KWARG, None)
    if step is None:
        # The HF model called directly, not through CompiledCausalLM: HF's own SDPA path (the
        # "freezeframe" mask is HF's SDPA mask, so padding and caches work as with "sdpa").
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
            **kwargs)
    # ff.hf.compile refuses such models up front; this is the safety net at trace time.
    problems: dict[str, Any] = {kwarg: kwargs.get(kwarg) for kwarg in _UNSUPPORTED_KWARGS}
    window = problems["sliding_window"]
    if isinstance(window, int) and window >= step.k_cache.shape[2]:
        problems["sliding_window"] = None  # a window as long as the cache never masks anything
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    problems["is_causal"] = False if causal is False else None
    for kwarg, got in problems.items():
        if got is not None:
            raise CompileError(
                f"ff.hf: layer {getattr(module, 'layer_idx', '?')} of "
                f"{type(module).__name__} asks for {_UNSUPPORTED_KWARGS[kwarg]} "
                f"({kwarg}={got!r}); freezeframe's HF attention implements full causal "
                "attention only: serve this model without freezeframe")
    num_tokens, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    out = query.new_empty((num_tokens, heads, head_dim))
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    torch.ops.freezeframe_hf.attention(query, key, value, out, step.k_cache, step.v_cache,
                                       step.positions, step.seq_ids,
                                       int(module.layer_idx),  # type: ignore[arg-type]
                                       scale)
    return out.unsqueeze(0), None


# Process-wide, as the op itself is: registering again under the same name replaces the entry
# with the same function.
transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


# -- the traced module -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _CacheShape:
    layers: int
    kv_heads: int
    head_dim: int


class _FlatCausalLM(nn.Module):
    """The HF model behind a flat-token forward: ``[num_tokens]`` ids, positions and cache rows
    in, ``[num_tokens, vocab]`` logits out. Holds the static KV cache as buffers."""

    def __init__(self, model: nn.Module, shape: _CacheShape, max_batch_size: int,
                 max_cache_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.k_cache: torch.Tensor
        self.v_cache: torch.Tensor
        # one extra row: the sink that padded tokens write into
        dims = (shape.layers, max_batch_size + 1, max_cache_len, shape.kv_heads, shape.head_dim)
        self.register_buffer("k_cache", torch.zeros(dims, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(dims, dtype=dtype, device=device),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                seq_ids: torch.Tensor) -> torch.Tensor:
        # A 4-d mask is taken as given by HF's mask utilities, so HF builds none; the attention
        # op ignores it (it masks by position and cache row).
        placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device)
        step = _StepMetadata(self.k_cache, self.v_cache, positions, seq_ids)
        output = self.model(input_ids=input_ids[None], position_ids=positions[None],
                            attention_mask=placeholder, use_cache=False,
                            **{_STEP_KWARG: step})
        return output.logits[0]  # type: ignore[no-any-return]


# -- the public object ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Generation:
    """What :meth:`CompiledCausalLM.generate` returns: ``sequences`` ``[batch, prompt + new]``
    (prompts, then the greedy tokens) and, with ``output_logits=True``, one ``[batch, vocab]``
    tensor of logits per generated token (as HF's ``generate(output_logits=True)``)."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...] = ()


_STEP_ARGS = ("input_ids", "positions", "seq_ids")


def _indices(name: str, value: object) -> torch.Tensor:
    """``value`` (a 1-d integer tensor, or a list or tuple of ints) as a 1-d integer tensor."""
    tensor = value if isinstance(value, torch.Tensor) else None
    if isinstance(value, (list, tuple)):
        try:
            tensor = torch.as_tensor(value, dtype=None if value else torch.long)
        except (TypeError, ValueError, RuntimeError):
            tensor = None
    if tensor is None or tensor.dim() != 1 or tensor.dtype == torch.bool \
            or tensor.is_floating_point() or tensor.is_complex():
        got = (f"a {tensor.dim()}-d {tensor.dtype} tensor" if tensor is not None
               else repr(value) if isinstance(value, (list, tuple)) else type(value).__name__)
        raise ConfigError(f"step: {name} must be a 1-d integer tensor or a list of ints, one "
                          f"entry per token; got {got}")
    return tensor


# What to do about an index below 0 or above the limit, per step argument.
_STEP_FIXES = {
    "input_ids": ("pass token ids of this model's tokenizer",) * 2,
    "positions": ("a position counts from 0 (the token's index in its sequence)",
                  "ff.hf.compile with max_cache_len >= {} for sequences this long"),
    "seq_ids": ("seq_ids are the cache rows of real sequences, from 0 (padding is the runner's)",
                "ff.hf.compile with max_batch_size >= {} for that many rows")}


class CompiledCausalLM:
    """An HF causal LM compiled by :func:`compile`: greedy :meth:`generate`, the flat-token
    :meth:`step` it is built on, and the parts (``compiled``, ``runner``, ``config``).

    ``compiled`` is the :class:`~freezeframe.compilation.CompiledModel` (its ``stats`` count
    traces, pieces, compilations and graphs captured); ``runner`` the
    :class:`~freezeframe.runtime.GraphRunner` (its ``stats`` count steps per graph mode,
    padded tokens and fallbacks). Graphs are captured on the first step, or by :meth:`capture`.
    """

    def __init__(self, model: nn.Module, flat: _FlatCausalLM, compiled: CompiledModel,
                 runner: GraphRunner, config: CompilationConfig, max_batch_size: int,
                 max_cache_len: int, num_layers: int) -> None:
        self.model = model
        self.compiled = compiled
        self.runner = runner
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self._flat = flat
        self._num_layers = num_layers
        self._device: torch.device = flat.k_cache.device
        self._split_checked = False
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        self._vocab_size: int | None = getattr(embeddings, "num_embeddings", None)

    @property
    def stats(self) -> Stats:
        """The runner's counters (steps per graph mode, padding, fallbacks)."""
        return self.runner.stats

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one step takes (longer prefills are split into steps of this)."""
        return int(self.config.max_num_tokens)

    def capture(self) -> CaptureReport:
        """Trace (once) and capture a graph per capture size; idempotent. Without a graph
        backend (``graph_backend="auto"`` on a CPU) it captures nothing and the first step
        traces."""
        if self.runner.report is not None:
            return self.runner.report
        report = self.runner.capture()
        self._check_split()
        return report

    def _check_split(self) -> None:
        """Once traced: every layer's attention must have gone through the op."""
        if self._split_checked or not self.compiled.traced:
            return
        self._split_checked = True
        if self.config.mode is not CompilationMode.PIECEWISE:
            return
        split = sum(1 for p in self.compiled.pieces if p.is_splitting_op)
        if split != self._num_layers:
            raise CompileError(
                f"ff.hf: the trace of {type(self.model).__name__} calls {HF_ATTENTION_OP} "
                f"{split} times, but the model has {self._num_layers} layers: some attention "
                "does not go through transformers.AttentionInterface with freezeframe's step "
                "metadata (its forward must pass **kwargs on to the attention function; "
                "GPT2LMHeadModel does from some 5.x release: 4.53.3, 4.57.1 and 5.0.0 do not, "
                f"5.24 does; this is {transformers.__version__}), so its tokens would attend "
                "across sequences; upgrade transformers, or serve this model without ff.hf")

    def step(self, input_ids: torch.Tensor | Sequence[int],
             positions: torch.Tensor | Sequence[int], seq_ids: torch.Tensor | Sequence[int],
             *, uniform_decode: bool = False) -> torch.Tensor:
        """One flat step: token ``t`` (``input_ids[t]``) sits at ``positions[t]`` of cache row
        ``seq_ids[t]``; every earlier position of that row must have been written by an earlier
        token. Returns ``[num_tokens, vocab]`` logits, a view of the graph's output that the
        next step overwrites (clone to keep it). ``uniform_decode=True`` says every row has one
        token (FULL graphs key on it). Each argument is a 1-d integer tensor or a list of ints.

        Before any device work, ``0 <= positions < max_cache_len``, ``0 <= seq_ids <
        max_batch_size`` and (on the host) the token ids are checked: an index outside the cache
        is a device-side assert inside a graph. Lists and CPU tensors are checked on the host
        and copied without a sync; metadata already on a GPU cost one read back each."""
        ids, where, rows = self._check_step(input_ids, positions, seq_ids)
        return self._run(ids, where, rows, uniform_decode)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
             uniform_decode: bool) -> torch.Tensor:
        self.capture()
        num_tokens = int(input_ids.shape[0])
        logits = self.runner(input_ids=input_ids, positions=positions, seq_ids=seq_ids,
                             uniform_decode=uniform_decode,
                             num_reqs=num_tokens if uniform_decode else None)
        self._check_split()  # the first traced step, when capture() traced nothing
        return logits  # type: ignore[no-any-return]

    def _check_step(self, *given: object) -> list[torch.Tensor]:
        """``step``'s arguments as ``torch.long`` tensors on the device, every index checked."""
        tensors = [_indices(name, value) for name, value in zip(_STEP_ARGS, given, strict=True)]
        counts = [int(t.shape[0]) for t in tensors]
        if len(set(counts)) != 1 or counts[0] == 0:
            raise ConfigError(
                f"step: input_ids, positions and seq_ids need one entry per token, at least "
                f"one, but have {counts[0]}, {counts[1]} and {counts[2]} entries")
        limits = {"input_ids": (self._vocab_size, "the vocabulary size (config.vocab_size)"),
                  "positions": (self.max_cache_len, "max_cache_len"),
                  "seq_ids": (self.max_batch_size, "max_batch_size")}
        for name, tensor in zip(_STEP_ARGS, tensors, strict=True):
            limit, what = limits[name]
            if limit is None or (name == "input_ids" and tensor.device.type != "cpu"):
                continue  # token ids on a GPU come from argmax; reading them back would sync
            # on the host a list is cheaper than tensor ops; on a device, one read back
            values = tensor.tolist() if tensor.device.type == "cpu" else \
                torch.stack(torch.aminmax(tensor)).tolist()
            low, high = min(values), max(values)
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                at = int((tensor == bad).nonzero()[0, 0])
                raise ConfigError(f"step: {name}[{at}] = {bad} is outside [0, {what}={limit}); "
                                  f"{_STEP_FIXES[name][bad >= 0].format(bad + 1)}")
        return [t.to(self._device, torch.long, non_blocking=True) for t in tensors]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 output_logits: bool = False) -> Generation:
        """Greedy decoding, as HF's ``model.generate(input_ids, do_sample=False,
        max_new_tokens=...)`` without stopping tokens: ``input_ids`` is ``[batch, prompt]``
        (every prompt the same length, no padding), ``batch <= max_batch_size`` and
        ``prompt + max_new_tokens - 1 <= max_cache_len``. The prompts are prefilled in steps
        of up to ``max_num_tokens`` tokens, then each new token is one decode step of
        ``batch`` tokens (padded to a capture size)."""
        batch, prompt = self._check_generate(input_ids, max_new_tokens)
        device = self._device
        ids = input_ids.to(device)
        flat_ids = ids.reshape(-1)
        positions = torch.arange(prompt, device=device).repeat(batch)
        rows = torch.arange(batch, device=device)
        seq_ids = rows.repeat_interleave(prompt)
        last = [b * prompt + prompt - 1 for b in range(batch)]  # each row's last prompt token
        picked: list[torch.Tensor] = []
        budget = self.max_num_tokens
        for start in range(0, batch * prompt, budget):
            end = min(start + budget, batch * prompt)
            logits = self._run(flat_ids[start:end], positions[start:end], seq_ids[start:end],
                               False)
            wanted = [i - start for i in last if start <= i < end]
            if wanted:
                picked.append(logits[torch.tensor(wanted, device=logits.device)])
        next_logits = torch.cat(picked)
        kept: list[torch.Tensor] = []
        tokens = [ids]
        for i in range(max_new_tokens):
            if output_logits:
                kept.append(next_logits.clone())
            next_tokens = next_logits.argmax(dim=-1)
            tokens.append(next_tokens[:, None])
            if i + 1 == max_new_tokens:
                break
            position = torch.full((batch,), prompt + i, dtype=torch.long, device=device)
            next_logits = self._run(next_tokens, position, rows, True)
        return Generation(sequences=torch.cat(tokens, dim=1), logits=tuple(kept))

    def _check_generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[int, int]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
                or input_ids.dtype != torch.long:
            got = (f"a {input_ids.dim()}-d {input_ids.dtype} tensor"
                   if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
            raise ConfigError(f"generate: input_ids must be a 2-d torch.long tensor [batch, "
                              f"prompt], got {got}")
        batch, prompt = int(input_ids.shape[0]), int(input_ids.shape[1])
        if not 1 <= batch <= self.max_batch_size:
            raise ConfigError(
                f"generate: input_ids has {batch} rows but max_batch_size is "
                f"{self.max_batch_size}; pass at most that many prompts, or ff.hf.compile with "
                f"max_batch_size={max(batch, 1)}")
        if prompt < 1:
            raise ConfigError("generate: input_ids has 0 prompt tokens; give at least 1")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ConfigError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 1")
        needed = prompt + max_new_tokens - 1  # the last token is sampled, never cached
        if needed > self.max_cache_len:
            raise ConfigError(
                f"generate: a prompt of {prompt} tokens and max_new_tokens={max_new_tokens} "
                f"need {needed} cache positions but max_cache_len is {self.max_cache_len}; "
                f"ff.hf.compile with max_cache_len={needed}")
        return batch, prompt


# -- the entry point -------------------------------------------------------------------------
def _cache_shape(model: nn.Module) -> _CacheShape:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise ConfigError(
            f"ff.hf.compile: model is a {type(model).__name__} without a transformers config "
            "(model.config.num_hidden_layers); pass a transformers causal LM such as "
            "LlamaForCausalLM")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return _CacheShape(layers=int(config.num_hidden_layers), kv_heads=kv_heads,
                       head_dim=int(head_dim))


def _default_capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return sorted({*sizes, max_batch_size})


def compile(
    model: nn.Module,
    config: CompilationConfig | None = None,
    *,
    max_batch_size: int = 8,
    max_cache_len: int = 256,
    max_num_tokens: int | None = None,
    capture_sizes: Sequence[int] | None = None,
    backend: str | None = None,
    graph_backend: str | None = None,
    cudagraph_mode: str | None = None,
    trace: bool = True,
) -> CompiledCausalLM:
    """Serve the HF causal LM ``model`` (used in place, weights shared) on freezeframe.

    The model's attention implementation is set to ``"freezeframe"`` (see the module docstring
    for what that does to direct calls); a static KV cache of ``max_batch_size`` rows by
    ``max_cache_len`` positions is allocated in the model's dtype on its device.

    Without ``config`` one is built: PIECEWISE, split at :data:`HF_ATTENTION_OP`,
    ``cudagraph_mode`` (default ``"piecewise"``), graphs for ``capture_sizes`` (default: the
    powers of two up to ``max_batch_size``, and ``max_batch_size``), the ``backend`` compiler
    (default ``"inductor"``), ``graph_backend`` (default ``"auto"``: CUDA graphs on a GPU,
    none on a CPU; ``"emulated"`` captures on a CPU for tests), ``max_num_tokens`` per step
    (default ``max(512, max_batch_size)``; a longer prefill is split into steps of this) and
    ``max_num_seqs=max_batch_size``. A step of more tokens than the largest capture size (a
    long prefill) runs without graphs, counted in ``runner.stats.fallback_too_large``.
    With ``config``, give none of those four; in PIECEWISE mode its ``splitting_ops`` must name
    :data:`HF_ATTENTION_OP`.

    ``trace=False`` builds the default config without a trace: mode NONE, the model's forward
    run as written, its PIECEWISE graphs captured breakable at the attention op (see
    :mod:`freezeframe.graphs.breakable`): no Dynamo and no compiler at startup, for a model
    Dynamo cannot trace or a start that must be fast.
    """
    shape = _cache_shape(model)
    check_causal_lm(model)
    max_batch_size = positive_int("max_batch_size", max_batch_size)
    max_cache_len = positive_int("max_cache_len", max_cache_len)
    check_attention(model, max_cache_len)
    check_positions(model, max_cache_len)
    if config is None:
        config = _default_config(max_batch_size, max_num_tokens, capture_sizes, backend,
                                 graph_backend, cudagraph_mode, trace)
    else:
        config = check_given_config(
            config, max_batch_size, HF_ATTENTION_OP,
            {"max_num_tokens": max_num_tokens, "capture_sizes": capture_sizes,
             "backend": backend, "graph_backend": graph_backend,
             "cudagraph_mode": cudagraph_mode})
    check_experts(model, config)
    return _serve(model, config, shape, max_batch_size, max_cache_len)


def _default_config(max_batch_size: int, max_num_tokens: int | None,
                    capture_sizes: Sequence[int] | None, backend: str | None,
                    graph_backend: str | None, cudagraph_mode: str | None,
                    trace: bool = True) -> CompilationConfig:
    """The config :func:`compile` builds when given none (its docstring lists the defaults)."""
    tokens = positive_int("max_num_tokens", max_num_tokens) if max_num_tokens is not None \
        else max(512, max_batch_size)
    return CompilationConfig(
        mode="piecewise" if trace else "none", backend=backend or "inductor",
        splitting_ops=[HF_ATTENTION_OP],
        cudagraph_mode=cudagraph_mode or "piecewise",
        cudagraph_capture_sizes=list(capture_sizes) if capture_sizes is not None
        else _default_capture_sizes(max_batch_size),
        max_num_tokens=tokens, max_num_seqs=max_batch_size,
        graph_backend=graph_backend or "auto")


def _serve(model: nn.Module, config: CompilationConfig, shape: _CacheShape, max_batch_size: int,
           max_cache_len: int) -> CompiledCausalLM:
    """Switch ``model`` to the ``"freezeframe"`` attention, wrap it with its static KV cache,
    compile that and put a runner around it."""
    parameter = next(model.parameters())
    flat = _FlatCausalLM(model, shape, max_batch_size, max_cache_len, parameter.dtype,
                         parameter.device).eval()
    model.eval()
    hf_model: Any = model  # a transformers PreTrainedModel (untyped here)
    if hasattr(hf_model, "set_attn_implementation"):
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # transformers before set_attn_implementation: every submodule reads the config
        hf_model.config._attn_implementation = ATTN_IMPLEMENTATION
    compiled = ff_compile(flat, config, model_key=f"ff.hf:{type(model).__qualname__}")
    runner = GraphRunner(
        compiled, config, progress=False, device=parameter.device,
        inputs={"input_ids": Tokens(dtype=torch.long, fill=0),
                "positions": Tokens(dtype=torch.long, fill=0),
                "seq_ids": Tokens(dtype=torch.long, fill=-1)})
    return CompiledCausalLM(model, flat, compiled, runner, config, max_batch_size,
                            max_cache_len, shape.layers)

