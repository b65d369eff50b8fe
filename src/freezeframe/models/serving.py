"""A small continuous-batching driver for the reference Llama: the workload graphs must survive.

Requests arrive at given steps, are admitted while a request slot and cache blocks are free,
have their prompts prefilled (in chunks when a prompt exceeds the step's token budget) in the
same batches as other requests' decode tokens, and leave after ``max_new_tokens`` greedy
tokens. Each step is one flattened token batch: *mixed* when any request is still prefilling,
*uniform decode* when every request contributes exactly one token — the two kinds a
FULL_AND_PIECEWISE config routes to different graphs.

The forward pass is pluggable (:class:`StepForward`): :class:`EagerForward` calls the model
directly, :class:`RunnerForward` goes through a :class:`~freezeframe.runtime.GraphRunner`. So
the same request trace runs eagerly and under every graph mode, and the outputs can be compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from freezeframe.context import forward_context
from freezeframe.errors import ConfigError
from freezeframe.models.attention import ATTN_METADATA_KEY
from freezeframe.models.inputs import RequestChunk, StepInputs, build_step
from freezeframe.models.kv_cache import BlockAllocator
from freezeframe.models.llama import LlamaModel

__all__ = [
    "EagerForward",
    "Request",
    "RunnerForward",
    "ServingDriver",
    "ServingResult",
    "StepForward",
    "llama_runner_inputs",
]


class StepForward(Protocol):
    """Runs one step: returns hidden states whose first ``step.num_tokens`` rows are real."""

    def __call__(self, step: StepInputs) -> torch.Tensor: ...


class EagerForward:
    """The model called directly (plain module, ``ff.compile``-d or ``torch.compile``-d).

    Passes the host-side request layout in the forward context so attention needs no sync.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, step: StepInputs) -> torch.Tensor:
        # the keyword is ATTN_METADATA_KEY ("attn_metadata")
        with forward_context(None, attn_metadata=step.host):
            return self.model(*step.args)  # type: ignore[no-any-return]


def llama_runner_inputs(model: LlamaModel, max_num_seqs: int) -> dict[str, Any]:
    """The ``inputs=`` mapping for ``GraphRunner(compiled_llama, config, inputs=...)``.

    ``query_start_loc`` has ``num_reqs + 1`` entries, one more than a request row, so it is a
    ``Static`` input of ``max_num_seqs + 1`` entries that :class:`RunnerForward` pads; padded
    request rows get ``seq_len`` 0, padded tokens slot ``-1`` (see models/attention.py).
    """
    from freezeframe.runtime.inputs import Requests, Static, Tokens

    max_blocks = model.cache_config.max_blocks
    return {
        "input_ids": Tokens(dtype=torch.long, fill=0),
        "positions": Tokens(dtype=torch.long, fill=0),
        "slot_mapping": Tokens(dtype=torch.long, fill=-1),
        "query_start_loc": Static(max_num_seqs + 1, dtype=torch.long, fill=0),
        "seq_lens": Requests(dtype=torch.long, fill=0),
        "block_tables": Requests(max_blocks, dtype=torch.long, fill=0),
    }


class RunnerForward:
    """A step through a GraphRunner built with :func:`llama_runner_inputs`."""

    def __init__(self, runner: Any, max_num_seqs: int) -> None:
        self.runner = runner
        self.max_num_seqs = max_num_seqs

    def __call__(self, step: StepInputs) -> torch.Tensor:
        t = step.tensors
        qsl = t["query_start_loc"][: step.num_reqs + 1]
        pad = self.max_num_seqs + 1 - qsl.shape[0]
        qsl = torch.cat([qsl, qsl[-1:].expand(pad)]) if pad > 0 else qsl
        return self.runner(  # type: ignore[no-any-return]
            input_ids=t["input_ids"][: step.num_tokens],
            positions=t["positions"][: step.num_tokens],
            slot_mapping=t["slot_mapping"][: step.num_tokens],
            query_start_loc=qsl,
            seq_lens=t["seq_lens"][: step.num_reqs],
            block_tables=t["block_tables"][: step.num_reqs],
            uniform_decode=step.uniform_decode,
            extras={ATTN_METADATA_KEY: step.host},
        )


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt that arrives before step ``arrival_step`` and wants ``max_new_tokens`` tokens."""

    req_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError(f"request {self.req_id!r}: the prompt is empty; give >= 1 token")
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"request {self.req_id!r}: max_new_tokens={self.max_new_tokens} must be >= 1"
            )


@dataclasses.dataclass
class ServingResult:
    """Generated tokens per request and, per step, what was sampled and from which logits."""

    outputs: dict[str, list[int]]
    step_kinds: list[str]  # "mixed" | "decode"
    step_logits: list[torch.Tensor]  # [num sampled, vocab] per step, on the host (fp32)
    step_sampled: list[list[str]]  # req ids sampled at each step, row order of step_logits

    @property
    def num_steps(self) -> int:
        return len(self.step_kinds)


@dataclasses.dataclass
class _Running:
    request: Request
    blocks: list[int]
    tokens: list[int]  # prompt + generated so far
    num_computed: int = 0  # tokens whose K/V are in the cache

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.request.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


class ServingDriver:
    """Continuous batching with greedy sampling over a pluggable :class:`StepForward`.

    ``max_num_seqs`` caps running requests, ``max_num_batched_tokens`` the tokens per step
    (decode tokens first, then prefill chunks).
    """

    def __init__(
        self,
        model: LlamaModel,
        forward: StepForward | None = None,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_steps: int = 10_000,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError(
                f"ServingDriver needs max_num_seqs >= 1 and max_num_batched_tokens >= 1, got "
                f"{max_num_seqs} and {max_num_batched_tokens}"
            )
        self.model = model
        self.forward = forward or EagerForward(model)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_steps = max_steps
        self.device = next(model.parameters()).device

    def run(self, requests: Sequence[Request]) -> ServingResult:
        """Serve ``requests`` to completion; the model's KV cache is reset first."""
        cache = self.model.cache_config
        for req in requests:
            if len(req.prompt) + req.max_new_tokens > cache.max_model_len:
                raise ConfigError(
                    f"request {req.req_id!r} needs {len(req.prompt) + req.max_new_tokens} "
                    f"positions but max_model_len is {cache.max_model_len}"
                )
        self.model.reset_cache()
        alloc = BlockAllocator(cache)
        pending = sorted(requests, key=lambda r: r.arrival_step)
        running: list[_Running] = []
        result = ServingResult(outputs={}, step_kinds=[], step_logits=[], step_sampled=[])
        step_index = 0
        while pending or running:
            if step_index >= self.max_steps:
                raise ConfigError(f"serving did not finish within max_steps={self.max_steps}")
            while (pending and pending[0].arrival_step <= step_index
                   and len(running) < self.max_num_seqs
                   and alloc.can_allocate(len(pending[0].prompt) + pending[0].max_new_tokens)):
                req = pending.pop(0)
                blocks = alloc.allocate(len(req.prompt) + req.max_new_tokens)
                running.append(_Running(req, blocks, list(req.prompt)))
            step_index += 1
            if not running:
                continue
            scheduled = self._schedule(running)
            self._run_step(scheduled, result)
            for entry in [r for r in running if r.num_generated >= r.request.max_new_tokens]:
                running.remove(entry)
                alloc.free(entry.blocks)
                result.outputs[entry.request.req_id] = entry.tokens[len(entry.request.prompt):]
        return result

    def _schedule(self, running: list[_Running]) -> list[tuple[_Running, int]]:
        """(request, new tokens) pairs: every decoding request, then prefill chunks."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[_Running, int]] = []
        for entry in running:
            if not entry.prefilling and budget > 0:
                plan.append((entry, 1))
                budget -= 1
        for entry in running:
            if entry.prefilling and budget > 0:
                count = min(len(entry.request.prompt) - entry.num_computed, budget)
                plan.append((entry, count))
                budget -= count
        return plan

    def _run_step(self, plan: list[tuple[_Running, int]], result: ServingResult) -> None:
        chunks = [
            RequestChunk(
                token_ids=tuple(e.tokens[e.num_computed : e.num_computed + n]),
                num_computed=e.num_computed,
                blocks=tuple(e.blocks),
            )
            for e, n in plan
        ]
        step = build_step(chunks, self.model.cache_config, device=self.device)
        with torch.no_grad():
            hidden = self.forward(step)
            # sample only where a request's prompt is complete after this step
            rows, sampled = [], []
            for i, (entry, count) in enumerate(plan):
                entry.num_computed += count
                if not entry.prefilling:
                    rows.append(step.host.query_start_loc[i + 1] - 1)
                    sampled.append(entry)
            logits = self.model.compute_logits(
                hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
            ).float()
        tokens = logits.argmax(dim=-1).tolist()
        for entry, token in zip(sampled, tokens, strict=True):
            entry.tokens.append(int(token))
        result.step_kinds.append("decode" if step.uniform_decode else "mixed")
        result.step_logits.append(logits.cpu())
        result.step_sampled.append([e.request.req_id for e in sampled])
