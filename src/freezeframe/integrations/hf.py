"""Hugging Face transformers causal LMs, unmodified, served on freezeframe's graphs.

One entry: :func:`compile` (``ff.hf.compile(model, ...)``) takes a ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``GPT2LMHeadModel`` or any decoder-only model whose attention goes through
``transformers.AttentionInterface``, and returns a :class:`CompiledCausalLM`: HF's ``generate``
(its generation settings resolved and applied by transformers' own classes, per request;
speculative decoding verified on graphs) and :attr:`~CompiledCausalLM.batcher`, continuous
batching that ``generate`` is built on::

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                         intermediate_size=128, num_attention_heads=4)).eval()
    lm = ff.hf.compile(model, max_batch_size=8, max_cache_len=64, backend="eager",
                       graph_backend="emulated")
    lm.generate(torch.randint(0, 128, (3, 5)), max_new_tokens=4)  # [3, <= 9] token ids

How the model is served
-----------------------
* **Flat token batches.** Every step is one flat batch of tokens, as in vLLM: ``input_ids``,
  ``positions`` and ``seq_ids`` (the cache row of each token), each ``[num_tokens]``. The HF
  model sees them as one sequence (``input_ids[None]``, ``position_ids`` from ``positions``),
  so its embeddings, MLPs, norms and position embeddings are what they are eagerly; only
  attention needs to know which tokens belong together, and it is ours. A prefill of prompts of
  5 and 3 tokens is an 8-token step, a decode step of 3 sequences a 3-token step. So the token
  count is the one dynamic dim: one trace serves every batch, and graphs are captured per
  padded token count (for decode: per padded batch size). The module compiled is the HF model
  behind that flat forward (:mod:`~freezeframe.integrations.hf_flat`).
* **The split point: HF's attention interface, calling our op**
  (:mod:`~freezeframe.integrations.hf_attention`). Importing this module registers the
  attention implementation ``"freezeframe"``; :func:`compile` switches the model to it
  (``set_attn_implementation``, no model code changes). It calls the custom op
  ``freezeframe_hf::attention``, the splitting op, which runs eagerly between the captured
  pieces, and applies sliding windows, soft-capping and sinks as the layer asks. Not SDPA: SDPA
  sees keys and values after HF's cache update and mask building (host-side bookkeeping that
  would land in captured pieces), cannot tell which tokens of a flat batch share a sequence, and
  other code calls it too.
* **The static KV cache.** Two buffers, ``[layers, max_batch_size + 1, max_cache_len,
  kv_heads, head_dim]``, allocated once; the op writes and reads them in place, positions as
  tensors, no host sync. Padded tokens carry ``seq_ids == -1`` and write only the extra sink row.
  A prefill rewrites its rows from position 0, so nothing needs clearing between requests.
  :meth:`CompiledCausalLM.step` checks every index on the host first: one outside the cache
  would be a device-side assert inside a graph.

Calling the HF model directly after :func:`compile` still works: without freezeframe's step
metadata the ``"freezeframe"`` attention is HF's own.

Refused by :func:`compile` (:mod:`~freezeframe.integrations.hf_checks`), with the reason:
attention that is not causal self-attention (encoders such as ``BertForMaskedLM``,
encoder-decoders, heads that cannot generate); layer types other than full and sliding
attention; and mixture-of-experts models with FULL or traced PIECEWISE graphs (served without
graphs, or with ``trace=False`` and PIECEWISE graphs: :mod:`~freezeframe.integrations.hf_experts`
makes each expert module a graph break).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from freezeframe.compilation import CompiledModel
from freezeframe.compilation import compile as ff_compile
from freezeframe.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    breakable_capture,
)
from freezeframe.errors import CompileError, ConfigError
from freezeframe.integrations.hf_attention import ATTN_IMPLEMENTATION, HF_ATTENTION_OP
from freezeframe.integrations.hf_batching import Batcher, Finished, NewToken, RequestInfo
from freezeframe.integrations.hf_checks import (
    check_attention,
    check_causal_lm,
    check_experts,
    check_given_config,
    check_positions,
    positive_int,
)
from freezeframe.integrations.hf_experts import break_at_experts
from freezeframe.integrations.hf_flat import CacheShape, FlatCausalLM, cache_shape
from freezeframe.integrations.hf_generate import GenerateCall
from freezeframe.integrations.hf_generate import generate as _generate
from freezeframe.integrations.hf_rope import check_rope, serve_dynamic_rope
from freezeframe.integrations.hf_sampling import SamplingParams
from freezeframe.integrations.hf_serving import AsyncFront
from freezeframe.runtime import GraphRunner, Tokens
from freezeframe.runtime.runner import CaptureReport
from freezeframe.stats import Stats

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HF_ATTENTION_OP",
    "AsyncFront",
    "Batcher",
    "CompiledCausalLM",
    "Finished",
    "NewToken",
    "RequestInfo",
    "SamplingParams",
    "compile",
]


# -- the public object ---------------------------------------------------------------------
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
    """An HF causal LM compiled by :func:`compile`: HF's :meth:`generate`, the continuous
    :attr:`batcher` it runs on, the flat-token :meth:`step` under both, and the parts
    (``compiled``, ``runner``, ``config``).

    ``compiled`` is the :class:`~freezeframe.compilation.CompiledModel` (its ``stats`` count
    traces, pieces, compilations and graphs captured); ``runner`` the
    :class:`~freezeframe.runtime.GraphRunner` (its ``stats`` count steps per graph mode,
    padded tokens and fallbacks). Graphs are captured on the first step, or by :meth:`capture`.
    """

    def __init__(self, model: nn.Module, flat: FlatCausalLM, compiled: CompiledModel,
                 runner: GraphRunner, config: CompilationConfig, max_batch_size: int,
                 max_cache_len: int, num_layers: int, progress: bool) -> None:
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
        self._progress = progress
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        self._vocab_size: int | None = getattr(embeddings, "num_embeddings", None)
        #: Continuous batching over this model's cache rows (``generate`` runs on it too).
        self.batcher = Batcher(self)
        self._drafts: dict[int, CompiledCausalLM] = {}

    @property
    def stats(self) -> Stats:
        """The runner's counters (steps per graph mode, padding, fallbacks)."""
        return self.runner.stats

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one step takes (longer prefills are split into steps of this)."""
        return int(self.config.max_num_tokens)

    @property
    def num_speculative_tokens(self) -> int:
        """The candidates a verification step of speculative decoding checks: a uniform
        decode step is ``1 +`` this many tokens per request (the config's)."""
        return int(self.config.num_speculative_tokens)

    @property
    def vocab_size(self) -> int | None:
        """The number of token ids the model embeds (None when it does not say)."""
        return self._vocab_size

    @property
    def device(self) -> torch.device:
        """Where the model, its cache and its logits live."""
        return self._device

    def capture(self) -> CaptureReport:
        """Compile (trace once, compile the pieces) and capture a graph per capture size;
        idempotent. Reports both on stderr when ``ff.hf.compile(progress=True)`` (the default):
        a line before and after compiling, then the runner's capture progress. Without a graph
        backend (``graph_backend="auto"`` on a CPU) it captures nothing."""
        if self.runner.report is not None:
            return self.runner.report
        self._compile_first()
        report = self.runner.capture()
        self._check_split()
        return report

    def _compile_first(self) -> None:
        """The first call of the compiled model, outside any graph: Dynamo traces (or the trace
        is loaded from the compile cache) and the pieces compile, between two progress lines.
        Two padding tokens (cache row -1: the sink row), since a trace needs a size >= 2."""
        if self.compiled.traced or self.config.mode is CompilationMode.NONE:
            return
        name = type(self.model).__name__
        self._say(f"ff.hf: compiling {name} (one Dynamo trace, split at {HF_ATTENTION_OP}, "
                  f"{self.config.backend} compiler) ...")
        started = time.perf_counter()
        tokens = torch.zeros(2, dtype=torch.long, device=self._device)
        self.compiled(input_ids=tokens, positions=torch.arange(2, device=self._device),
                      seq_ids=tokens - 1)
        stats = self.compiled.stats
        how = "trace loaded from the compile cache" if stats.traces_loaded else "traced"
        self._say(f"ff.hf: compiled {name} in {time.perf_counter() - started:.1f} s "
                  f"({how}; {len(self.compiled.pieces)} pieces)")

    def _say(self, line: str) -> None:
        if self._progress:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

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
                f"5.24 does; this is {_transformers_version()}), so its tokens would attend "
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
        query = 1 + self.num_speculative_tokens
        uniform = uniform_decode and num_tokens % query == 0
        logits = self.runner(input_ids=input_ids, positions=positions, seq_ids=seq_ids,
                             uniform_decode=uniform,
                             num_reqs=num_tokens // query if uniform else None)
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

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None,
                 logits_processor: Any = None, stopping_criteria: Any = None,
                 prefix_allowed_tokens_fn: Any = None, synced_gpus: bool | None = None,
                 assistant_model: Any = None, streamer: Any = None, *,
                 generator: torch.Generator | None = None, **kwargs: Any) -> Any:
        """HF's ``model.generate(inputs, ...)`` on this model's graphs, with HF's arguments
        and results (:mod:`~freezeframe.integrations.hf_generate` says what is HF's, and
        docs/hf.md lists every generation setting, honoured or refused): ``inputs`` is
        ``[batch, width]`` token ids, prompts padded on the left or the right as
        ``attention_mask`` says; settings come from ``generation_config``, then
        ``model.generation_config``, then HF's defaults, the keyword arguments over all.
        Returns the ``[rows, width + new]`` token tensor, or with
        ``return_dict_in_generate=True`` transformers' ``GenerateDecoderOnlyOutput``.
        ``generator`` (freezeframe's) seeds sampling; an int as the second argument is
        ``max_new_tokens`` (a shorthand). ``prompt_lookup_num_tokens`` or ``assistant_model``
        (an HF model with the same tokenizer, compiled by ``ff.hf`` on first use, or a
        ``CompiledCausalLM``) decode speculatively: greedy tokens, verified ``1 + k`` at a
        time. Runs on :attr:`batcher`, beside the requests a server has there."""
        if isinstance(generation_config, int) and not isinstance(generation_config, bool):
            kwargs.setdefault("max_new_tokens", generation_config)
            generation_config = None
        if synced_gpus:
            kwargs["synced_gpus"] = synced_gpus
        call = GenerateCall(generation_config, logits_processor, stopping_criteria,
                            prefix_allowed_tokens_fn, assistant_model, streamer, generator)
        return _generate(self, inputs, call, kwargs)

    def draft(self, assistant: Any) -> CompiledCausalLM:
        """The ``ff.hf`` model that proposes candidates for :meth:`generate`'s
        ``assistant_model``: ``assistant`` itself when it is a ``CompiledCausalLM``, else it
        compiled once (the main model's cache shape, compiler and graph backend; kept for the
        next call). Its vocabulary must be this model's (the same tokenizer)."""
        if isinstance(assistant, CompiledCausalLM):
            draft = assistant
        else:
            key = id(assistant)
            cached = self._drafts.get(key)
            if cached is None or cached.model is not assistant:
                if assistant is self.model:
                    raise ConfigError("generate: assistant_model is the model itself; pass a "
                                      "smaller draft model of the same tokenizer")
                cached = compile(assistant, max_batch_size=self.max_batch_size,
                                 max_cache_len=self.max_cache_len,
                                 max_num_tokens=self.max_num_tokens,
                                 backend=str(self.config.backend),
                                 graph_backend=str(self.config.graph_backend),
                                 cudagraph_mode="none" if self.config.cudagraph_mode is
                                 CUDAGraphMode.NONE else "full_and_piecewise",
                                 trace=self.config.mode is CompilationMode.PIECEWISE,
                                 progress=self._progress)
                self._drafts[key] = cached
            draft = cached
        if draft.vocab_size != self.vocab_size:
            raise ConfigError(
                f"generate: the assistant model's vocabulary has {draft.vocab_size} tokens, "
                f"this model's {self.vocab_size}; a draft model must share the tokenizer (HF's "
                "assistant_tokenizer for other tokenizers is not supported by ff.hf)")
        if draft.max_batch_size < self.max_batch_size or \
                draft.max_cache_len < self.max_cache_len:
            raise ConfigError(
                "generate: the assistant CompiledCausalLM needs max_batch_size >= "
                f"{self.max_batch_size} and max_cache_len >= {self.max_cache_len} (it uses "
                "the main model's cache rows)")
        return draft


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


# -- the entry point -------------------------------------------------------------------------
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
    num_speculative_tokens: int | None = None,
    trace: bool = True,
    progress: bool = True,
) -> CompiledCausalLM:
    """Serve the HF causal LM ``model`` (used in place, weights shared) on freezeframe.

    The model's attention implementation is set to ``"freezeframe"`` (see the module docstring
    for what that does to direct calls); a static KV cache of ``max_batch_size`` rows by
    ``max_cache_len`` positions is allocated in the model's dtype on its device.

    Without ``config`` one is built: PIECEWISE, split at :data:`HF_ATTENTION_OP`,
    ``cudagraph_mode`` (default ``"piecewise"``), graphs for ``capture_sizes`` (default: the
    config's ladder for ``max_num_seqs=max_batch_size``), the ``backend`` compiler (default
    ``"inductor"``), ``graph_backend`` (default ``"auto"``: CUDA graphs on a GPU, none on a
    CPU; ``"emulated"`` captures on a CPU for tests), ``max_num_tokens`` per step (default
    ``max(512, max_batch_size)``; a longer prefill is split into steps of this). A step above
    the largest capture size runs without graphs (``runner.stats.fallback_too_large``).
    ``num_speculative_tokens=k`` keys FULL decode graphs on ``1 + k`` tokens per request:
    speculative decoding's verification steps replay them. With ``config``, give none of
    those; in PIECEWISE mode its ``splitting_ops`` must name :data:`HF_ATTENTION_OP`.

    ``trace=False`` builds the default config without a trace: mode NONE, the model's forward
    run as written, its PIECEWISE graphs captured breakable at the attention op (see
    :mod:`freezeframe.graphs.breakable`): no Dynamo and no compiler at startup, for a model
    Dynamo cannot trace or a start that must be fast. A mixture-of-experts model is served on
    graphs only so, with ``cudagraph_mode="piecewise"``: each expert module is a break.

    ``progress=True`` reports the compile and the capture on stderr (plain lines, or the
    runner's bar on a terminal) when they happen: at :meth:`CompiledCausalLM.capture` or the
    first step.
    """
    shape = cache_shape(model)
    check_causal_lm(model)
    max_batch_size = positive_int("max_batch_size", max_batch_size)
    max_cache_len = positive_int("max_cache_len", max_cache_len)
    check_attention(model)
    check_positions(model, max_cache_len)
    check_rope(model, max_cache_len)
    serve_dynamic_rope(model, max_cache_len)
    given: dict[str, Any] = {"max_num_tokens": max_num_tokens, "capture_sizes": capture_sizes,
                             "backend": backend, "graph_backend": graph_backend,
                             "cudagraph_mode": cudagraph_mode,
                             "num_speculative_tokens": num_speculative_tokens}
    config = _default_config(max_batch_size, trace, **given) if config is None else \
        check_given_config(config, max_batch_size, HF_ATTENTION_OP, given)
    check_experts(model, config)
    return _serve(model, config, shape, max_batch_size, max_cache_len, progress)


def _default_config(max_batch_size: int, trace: bool, *, max_num_tokens: int | None,
                    capture_sizes: Sequence[int] | None, backend: str | None,
                    graph_backend: str | None, cudagraph_mode: str | None,
                    num_speculative_tokens: int | None) -> CompilationConfig:
    """The config :func:`compile` builds when given none (its docstring lists the defaults)."""
    tokens = positive_int("max_num_tokens", max_num_tokens) if max_num_tokens is not None \
        else max(512, max_batch_size)
    return CompilationConfig(
        mode="piecewise" if trace else "none", backend=backend or "inductor",
        splitting_ops=[HF_ATTENTION_OP],
        cudagraph_mode=cudagraph_mode or "piecewise",
        cudagraph_capture_sizes=list(capture_sizes) if capture_sizes is not None else None,
        max_num_tokens=tokens, max_num_seqs=max_batch_size,
        num_speculative_tokens=num_speculative_tokens or 0,
        graph_backend=graph_backend or "auto")


def _settle(model: nn.Module, device: torch.device) -> None:
    """One token through the model as it is, before freezeframe records its state: modules
    that set attributes on their first forward (LongRoPE's ``long_inv_freq``, or its re-registered
    ``inv_freq`` buffer on older transformers) have set them, so the first served step is not
    refused as a change of the module after its first call."""
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def _serve(model: nn.Module, config: CompilationConfig, shape: CacheShape, max_batch_size: int,
           max_cache_len: int, progress: bool) -> CompiledCausalLM:
    """Switch ``model`` to the ``"freezeframe"`` attention, wrap it with its static KV cache,
    compile that and put a runner around it."""
    parameter = next(model.parameters())
    flat = FlatCausalLM(model, shape, max_batch_size, max_cache_len, parameter.dtype,
                         parameter.device).eval()
    model.eval()
    _settle(model, parameter.device)
    hf_model: Any = model  # a transformers PreTrainedModel (untyped here)
    if hasattr(hf_model, "set_attn_implementation"):
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # transformers before set_attn_implementation: every submodule reads the config
        hf_model.config._attn_implementation = ATTN_IMPLEMENTATION
    if breakable_capture(config):
        break_at_experts(model)  # (check_experts let only breakable PIECEWISE graphs through)
    compiled = ff_compile(flat, config, model_key=f"ff.hf:{type(model).__qualname__}")
    runner = GraphRunner(
        compiled, config, progress=progress, device=parameter.device,
        inputs={"input_ids": Tokens(dtype=torch.long, fill=0),
                "positions": Tokens(dtype=torch.long, fill=0),
                "seq_ids": Tokens(dtype=torch.long, fill=-1)})
    return CompiledCausalLM(model, flat, compiled, runner, config, max_batch_size,
                            max_cache_len, shape.layers, progress)

