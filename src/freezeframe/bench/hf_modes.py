"""The Hugging Face rows of the bench: ``generate`` on a Hugging Face ``LlamaForCausalLM`` of
the preset's shapes (random weights from a fixed seed, the same in every mode), side by side:

* ``hf-eager``: HF's own ``generate`` (greedy, its dynamic cache);
* ``hf-compile``: HF's ``generate`` with a static cache (``cache_implementation="static"``),
  which HF compiles with ``torch.compile`` itself on a GPU (its ``CompileConfig``: mode
  ``reduce-overhead``): the recipe HF documents for fast decoding. HF compiles only on an
  accelerator, so on a CPU the row is the static cache alone and says so;
* ``ff-hf``: ``ff.hf.compile(model, cudagraph_mode="full_and_piecewise")`` and its
  ``generate``;
* ``ff-hf-lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens``) on a repetitive
  prompt, through ``ff.hf`` and through HF eager, each against its own plain ``generate`` of the
  same prompt: the speed-up, and whether the tokens equal plain greedy's (ff.hf's verification
  steps replay FULL graphs keyed on ``1 + k`` tokens per request). Where a generate refuses the
  argument the row says ``unsupported`` with its error.

Per batch size (:data:`HF_BATCH_SIZES`) a mode generates once untimed (HF compiles, ff.hf
captures) and once timed: tokens per second are ``batch * new_tokens / seconds``, the prefill
included, as a caller of ``generate`` sees it. Every mode generates the same number of tokens
from the same prompts (no end-of-sequence token, ``min_new_tokens = max_new_tokens``), and each
row counts how many of its tokens equal ``hf-eager``'s (bf16 rounding may flip a near tie).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from freezeframe.bench.measure import sync
from freezeframe.errors import ConfigError

__all__ = ["HF_BATCH_SIZES", "HF_PRESETS", "HFBench", "build_hf_llama"]

HF_BATCH_SIZES = (1, 8)
PROMPT_TOKENS = 32
LOOKUP_TOKENS = 4  # prompt_lookup_num_tokens of the ff-hf-lookup row
HF_PRESETS: dict[str, dict[str, Any]] = {
    # freezeframe's tiny reference-Llama shapes
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    # Llama-3.2-1B's shapes
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=True),
}


def build_hf_llama(preset: str, device: torch.device, seed: int = 0) -> Any:
    """A randomly initialised HF Llama of ``preset``'s shapes on ``device`` (bf16 on a GPU,
    float32 on a CPU), without special tokens, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**HF_PRESETS[preset], bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(dtype=dtype).eval()  # type: ignore[call-arg]


def _sequences(out: Any) -> torch.Tensor:
    """The token ids of a ``generate`` result (a tensor, or an object with ``sequences``)."""
    return out if isinstance(out, torch.Tensor) else out.sequences


@dataclasses.dataclass
class HFBench:
    """What the HF modes share: the preset, the prompts, hf-eager's tokens to compare with,
    and the ``ff.hf`` model once compiled (ff-hf-lookup reuses it)."""

    preset: str
    device: torch.device
    new_tokens: int
    seed: int = 0
    batch_sizes: tuple[int, ...] = HF_BATCH_SIZES
    reference: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    ff_lm: Any = None

    def prompts(self, batch: int, repetitive: bool = False) -> torch.Tensor:
        vocab = HF_PRESETS[self.preset]["vocab_size"]
        gen = torch.Generator().manual_seed(1000 + batch)
        if repetitive:  # an 8-token phrase four times: what prompt lookup finds again
            phrase = torch.randint(0, vocab, (batch, 8), generator=gen)
            return phrase.repeat(1, PROMPT_TOKENS // 8).to(self.device)
        return torch.randint(0, vocab, (batch, PROMPT_TOKENS), generator=gen).to(self.device)

    def run(self, mode: str, checkpoint: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """The entry of ``mode``; ``checkpoint`` is given the entry so far after each
        measurement."""
        entry: dict[str, Any] = {"batch_sizes": list(self.batch_sizes),
                                 "prompt_tokens": PROMPT_TOKENS, "new_tokens": self.new_tokens,
                                 "notes": []}
        t0 = time.perf_counter()
        if mode == "ff-hf-lookup":
            self._lookup(entry, checkpoint)
        else:
            generate = self._generator(mode, entry)
            entry["setup_s"] = time.perf_counter() - t0
            rows: dict[str, Any] = entry.setdefault("generate", {})
            for batch in self.batch_sizes:
                rows[str(batch)] = self._row(mode, generate, batch)
                checkpoint(entry)
            if mode == "ff-hf":
                entry["runner_stats"] = self.ff_lm.runner.stats.snapshot()
        entry["startup_s"] = time.perf_counter() - t0
        return entry

    def _generator(self, mode: str, entry: dict[str, Any]) -> Callable[..., torch.Tensor]:
        """``(input_ids, **options) -> token ids`` for ``mode``."""
        n = self.new_tokens
        if mode == "ff-hf":
            lm = self._ff_lm(entry)
            return lambda ids, **kw: _sequences(lm.generate(ids, n, min_new_tokens=n, **kw))
        model = build_hf_llama(self.preset, self.device, self.seed)
        options: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n,
                                   "do_sample": False, "pad_token_id": 0}
        if mode == "hf-compile":
            options["cache_implementation"] = "static"
            if self.device.type != "cuda":
                entry["notes"].append("HF compiles generate only on an accelerator: on this "
                                      "CPU the row is the static cache without torch.compile")
        return lambda ids, **kw: _sequences(model.generate(
            ids, attention_mask=torch.ones_like(ids), **options, **kw))

    def _ff_lm(self, entry: dict[str, Any]) -> Any:
        if self.ff_lm is None:
            import freezeframe as ff

            cuda = self.device.type == "cuda"
            model = build_hf_llama(self.preset, self.device, self.seed)
            # num_speculative_tokens: ff-hf-lookup's verification steps (1 + k tokens per
            # request) replay FULL graphs of their own, and a step may look k tokens past the
            # last one it keeps, so the cache holds that much more
            self.ff_lm = ff.hf.compile(
                model, max_batch_size=max(self.batch_sizes),
                max_cache_len=PROMPT_TOKENS + self.new_tokens + LOOKUP_TOKENS + 1,
                num_speculative_tokens=LOOKUP_TOKENS,
                cudagraph_mode="full_and_piecewise", backend="inductor" if cuda else "eager",
                graph_backend="cuda" if cuda else "emulated", progress=False)
            report = self.ff_lm.capture()
            entry["capture"] = {"graphs": report.num_graphs, "seconds": report.seconds,
                                "summary": report.summary()}
        return self.ff_lm

    def _timed(self, generate: Callable[..., torch.Tensor], ids: torch.Tensor,
               **options: Any) -> tuple[float, torch.Tensor, float]:
        """One untimed ``generate`` (compiles, captures), then one timed: its seconds, its new
        tokens, and the untimed one's seconds."""
        t0 = time.perf_counter()
        generate(ids, **options)
        sync(self.device)
        t1 = time.perf_counter()
        out = generate(ids, **options)
        sync(self.device)
        return time.perf_counter() - t1, out[:, ids.shape[1]:].cpu(), t1 - t0

    def _row(self, mode: str, generate: Callable[..., torch.Tensor], batch: int
             ) -> dict[str, Any]:
        seconds, tokens, first = self._timed(generate, self.prompts(batch))
        if mode == "hf-eager":
            self.reference[batch] = tokens
        return {"seconds": seconds, "tokens_per_s": tokens.numel() / seconds,
                "first_call_s": first, "new_tokens": tokens.shape[1],
                **self._match(batch, tokens)}

    def _match(self, batch: int, tokens: torch.Tensor) -> dict[str, Any]:
        want = self.reference.get(batch)
        if want is None or want.shape != tokens.shape:
            return {"equal_to_hf_eager": None}
        return {"equal_to_hf_eager": float((want == tokens).float().mean())}

    def _lookup(self, entry: dict[str, Any], checkpoint: Callable[[dict[str, Any]], None]
                ) -> None:
        """Prompt lookup against plain greedy on a repetitive prompt, at batch 1: ff.hf's
        row, then HF eager's (the reference of what prompt lookup gives this model)."""
        ids = self.prompts(1, repetitive=True)
        lm = self._ff_lm(entry)
        n = self.new_tokens
        runs: list[tuple[str, Callable[..., torch.Tensor]]] = [
            ("ff-hf", lambda i, **kw: _sequences(lm.generate(i, n, min_new_tokens=n, **kw)))]
        model = build_hf_llama(self.preset, self.device, self.seed)
        runs.append(("hf-eager", lambda i, **kw: _sequences(model.generate(
            i, attention_mask=torch.ones_like(i), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0, **kw))))
        for name, generate in runs:
            plain_s, plain, _ = self._timed(generate, ids)
            try:
                lookup_s, found, _ = self._timed(generate, ids,
                                                 prompt_lookup_num_tokens=LOOKUP_TOKENS)
            except (TypeError, ConfigError) as exc:  # the argument refused: not supported
                entry[name] = {"unsupported": f"{type(exc).__name__}: {exc}"[:400],
                               "plain_s": plain_s}
            else:
                entry[name] = {"plain_s": plain_s, "lookup_s": lookup_s,
                               "speedup": plain_s / lookup_s,
                               "equal_to_plain_greedy": bool(torch.equal(plain, found))}
            checkpoint(entry)
        ours = entry["ff-hf"]
        if "unsupported" in ours:
            entry["unsupported"] = ours["unsupported"]
