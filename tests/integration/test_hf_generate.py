"""``CompiledCausalLM.generate`` against Hugging Face's own ``generate``, token for token.

One tiny Llama (2 layers, hidden 64, vocab 128, random weights, nothing downloaded) compiled
once for the module (eager compiler, emulated PIECEWISE graphs for 1, 2, 4 and 8 tokens). HF
runs first on each input (its SDPA attention, its dynamic cache); then ours. Greedy tokens must
be identical, and so must seeded sampling: HF samples with ``torch.multinomial`` on the default
generator after ``torch.manual_seed(s)``, ours draws the same noise from a
``torch.Generator().manual_seed(s)``. Stop tokens are chosen from HF's own output so that rows
stop at different steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install 'freezeframe[hf]'")

import freezeframe as ff  # noqa: E402
from freezeframe.integrations import hf  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def lm(llama: Any) -> hf.CompiledCausalLM:
    lm = ff.hf.compile(llama, max_batch_size=8, max_cache_len=40, max_num_tokens=64,
                       capture_sizes=[1, 2, 4, 8], backend="eager", graph_backend="emulated",
                       progress=False)
    lm.capture()
    return lm


@pytest.fixture(scope="module")
def narrow(llama: Any) -> hf.CompiledCausalLM:
    """The same model with two cache rows and 4-token steps (breakable graphs, no Dynamo): a
    third row waits for a free row and a prompt over 4 tokens is prefilled in chunks."""
    return ff.hf.compile(llama, max_batch_size=2, max_cache_len=40, max_num_tokens=4,
                         capture_sizes=[1, 2, 4], backend="eager", graph_backend="emulated",
                         trace=False, progress=False)


def _hf(model: Any, ids: torch.Tensor, seed: int | None = None, **kwargs: Any) -> Any:
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, return_dict_in_generate=True, output_logits=True, **kwargs)


def _prompts(batch: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, width), generator=torch.Generator().manual_seed(seed))


def _assert_logits_close(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...],
                         alive: torch.Tensor) -> None:
    """Per column, the rows still generating (``alive[:, k]``) within 1e-5 of the largest
    logit (float32); finished rows hold NaN here and HF's pad-token logits there."""
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        rows = alive[:, k]
        assert torch.isnan(a[~rows]).all(), k
        error = (a[rows] - b[rows].float()).abs().max().item()
        assert error <= 1e-5 * b.abs().max().item(), (k, error)


def _alive(new: torch.Tensor, stop: set[int]) -> torch.Tensor:
    """``[batch, columns]``: whether each row was still generating at each new column."""
    alive = torch.ones_like(new, dtype=torch.bool)
    for row in range(new.shape[0]):
        for k in range(1, new.shape[1]):
            alive[row, k] = alive[row, k - 1] and int(new[row, k - 1]) not in stop
    return alive


def test_greedy_stops_each_row_at_its_stop_token_like_hf(llama: Any,
                                                         lm: hf.CompiledCausalLM) -> None:
    prompts = _prompts(4, 6, seed=1)
    free = _hf(llama, prompts, max_new_tokens=10, do_sample=False).sequences[:, 6:]
    # stop tokens that rows 0 and 2 make early (one id, then two), so rows finish apart
    one = int(free[0, 2])
    two = [int(free[2, 1]), one]
    for eos, pad in ((one, None), (two, 0)):
        expected = _hf(llama, prompts, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                       pad_token_id=pad)
        out = lm.generate(prompts, 10, eos_token_id=eos, pad_token_id=pad, output_logits=True,
                          return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected.sequences), (eos, out.sequences)
        stop = {eos} if isinstance(eos, int) else set(eos)
        alive = _alive(out.sequences[:, 6:], stop)
        assert not alive[0, 3:].any()  # row 0 made a stop token by its third new token
        _assert_logits_close(out.logits, expected.logits, alive)
    assert not lm.batcher.has_unfinished()


def test_the_models_own_stop_token_is_the_default(llama: Any,
                                                  lm: hf.CompiledCausalLM) -> None:
    prompts = _prompts(3, 5, seed=2)
    free = _hf(llama, prompts, max_new_tokens=8, do_sample=False).sequences[:, 5:]
    llama.generation_config.eos_token_id = int(free[1, 3])
    try:
        expected = _hf(llama, prompts, max_new_tokens=8, do_sample=False).sequences
        assert torch.equal(lm.generate(prompts, 8), expected)
    finally:
        llama.generation_config.eos_token_id = None


def test_min_new_tokens_blocks_stop_tokens_like_hf(llama: Any, lm: hf.CompiledCausalLM) -> None:
    prompts = _prompts(2, 5, seed=3)
    free = _hf(llama, prompts, max_new_tokens=8, do_sample=False).sequences[:, 5:]
    eos = int(free[0, 1])
    expected = _hf(llama, prompts, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                   min_new_tokens=4, pad_token_id=0)
    out = lm.generate(prompts, 8, eos_token_id=eos, min_new_tokens=4, pad_token_id=0)
    assert torch.equal(out, expected.sequences)
    assert int(free[0, 1]) not in out[0, 5:9].tolist()


@pytest.mark.parametrize("side", ["left", "right"])
def test_prompts_of_different_lengths_are_served_ragged(llama: Any, lm: hf.CompiledCausalLM,
                                                        side: str) -> None:
    lengths = [7, 3, 5, 1]
    width = max(lengths)
    prompts = _prompts(len(lengths), width, seed=4)
    mask = torch.zeros_like(prompts)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    ids = prompts.masked_fill(mask == 0, 0)
    # each row alone, by HF: the reference for both paddings
    alone = [_hf(llama, ids[row][mask[row] == 1][None], max_new_tokens=6,
                 do_sample=False).sequences[0, -6:] for row in range(len(lengths))]
    steps = lm.stats.steps
    out = lm.generate(ids, 6, attention_mask=mask)
    assert torch.equal(out[:, :width], ids)
    assert torch.equal(out[:, width:], torch.stack(alone))
    # one ragged prefill step of 16 real tokens (no padding computed), then 5 decode steps
    assert lm.stats.steps - steps == 6
    if side == "left":  # HF's own left-padded batch gives the same tokens
        expected = _hf(llama, ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, expected.sequences)


def test_a_pad_token_in_the_prompts_is_read_as_padding_as_hf_does(
        llama: Any, lm: hf.CompiledCausalLM) -> None:
    prompts = _prompts(2, 6, seed=5)
    prompts[1, :2] = 1  # left padding with pad_token_id=1 and no attention_mask
    expected = _hf(llama, prompts, max_new_tokens=4, do_sample=False, pad_token_id=1)
    out = lm.generate(prompts, 4, pad_token_id=1)
    assert torch.equal(out, expected.sequences)
    with pytest.raises(ff.ConfigError, match=r"row 0 of attention_mask has a gap between "
                                             r"prompt tokens; each row's prompt must be one run"):
        lm.generate(prompts, 4, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1]] * 2))


@pytest.mark.parametrize(("options", "seed"), [
    ({}, 11),  # HF's defaults when sampling: temperature 1, top_k 50
    ({"temperature": 0.7, "top_k": 0}, 12),
    ({"temperature": 1.3, "top_k": 20, "top_p": 0.9}, 13),
    ({"top_k": 0, "top_p": 0.5}, 14),
])
def test_seeded_sampling_draws_the_tokens_hf_draws(llama: Any, lm: hf.CompiledCausalLM,
                                                   options: dict[str, Any], seed: int) -> None:
    prompts = _prompts(4, 5, seed=seed)
    expected = _hf(llama, prompts, seed=seed, max_new_tokens=8, do_sample=True, **options)
    out = lm.generate(prompts, 8, do_sample=True, generator=torch.Generator().manual_seed(seed),
                      **options)
    assert torch.equal(out, expected.sequences), options
    # the default generator, seeded the same way, is the same stream
    torch.manual_seed(seed)
    assert torch.equal(lm.generate(prompts, 8, do_sample=True, **options), expected.sequences)


def test_seeded_sampling_with_stop_tokens_and_ragged_prompts(llama: Any,
                                                             lm: hf.CompiledCausalLM) -> None:
    # finished rows still take their share of every draw, as in HF's loop
    prompts = _prompts(3, 6, seed=21)
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0
    mask[2, :1] = 0
    free = _hf(llama, prompts, seed=21, attention_mask=mask, max_new_tokens=8, do_sample=True,
               top_k=0).sequences[:, 6:]
    eos = int(free[1, 2])
    expected = _hf(llama, prompts, seed=21, attention_mask=mask, max_new_tokens=8,
                   do_sample=True, top_k=0, eos_token_id=eos)
    out = lm.generate(prompts, 8, attention_mask=mask, do_sample=True, top_k=0, eos_token_id=eos,
                      generator=torch.Generator().manual_seed(21))
    assert torch.equal(out, expected.sequences)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(value.tolist())

    def end(self) -> None:
        self.calls.append("end")


def test_the_streamer_gets_what_hfs_streamer_gets(llama: Any, lm: hf.CompiledCausalLM) -> None:
    prompts = _prompts(2, 4, seed=6)
    free = _hf(llama, prompts, max_new_tokens=6, do_sample=False).sequences[:, 4:]
    eos = int(free[0, 1])
    theirs, ours = _Recorder(), _Recorder()
    with torch.no_grad():
        llama.generate(prompts, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                       streamer=theirs)
    lm.generate(prompts, 6, eos_token_id=eos, streamer=ours)
    assert ours.calls == theirs.calls
    assert ours.calls[-1] == "end" and len(ours.calls) == 1 + 6 + 1


def test_sampling_parameters_are_checked_by_transformers(lm: hf.CompiledCausalLM) -> None:
    prompts = _prompts(1, 3, seed=7)
    for kwargs, message in [
        ({"temperature": 0.0}, r"`temperature` \(=0.0\) has to be a strictly positive float"),
        ({"top_k": -1}, r"`top_k` has to be a strictly positive integer, but is -1"),
        ({"eos_token_id": "x"}, "eos_token_id='x' must be a token id"),
        ({"eos_token_id": 500}, "eos_token_id 500 is outside the vocabulary of 128 tokens"),
        # (HF makes 3 tokens for 2.5, ff.hf made 2 before)
        ({"max_new_tokens": 2.5}, r"max_new_tokens=2\.5 must be an int \(a token count\)"),
        ({"max_length": 6.0}, r"max_length=6\.0 must be an int"),
        ({"attention_mask": torch.ones(2, 3)}, r"attention_mask must be a tensor shaped like "
                                               r"input_ids \(1, 3\), got \(2, 3\)"),
    ]:
        with pytest.raises(ff.ConfigError, match=message):
            lm.generate(prompts, 2, do_sample=True, **kwargs)
    assert not lm.batcher.requests()


def test_prompts_prefilled_in_chunks_give_hfs_tokens(llama: Any,
                                                     narrow: hf.CompiledCausalLM) -> None:
    # Before: a prompt longer than a step (max_num_tokens, 512 by default; or a batch whose
    # prompts add up to more) took its first new token from the logits of its first chunk's
    # first token, and every later token followed from that wrong one.
    prompts = _prompts(3, 6, seed=8)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    ids = prompts.masked_fill(mask == 0, 0)
    for kwargs in ({"do_sample": False}, {"do_sample": True, "top_k": 0}):
        expected = _hf(llama, ids, seed=9, attention_mask=mask, max_new_tokens=5, **kwargs)
        out = narrow.generate(ids, 5, attention_mask=mask,
                              generator=torch.Generator().manual_seed(9), **kwargs)
        assert torch.equal(out, expected.sequences), kwargs
    alone = _hf(llama, prompts[:1], max_new_tokens=5, do_sample=False).sequences
    steps = narrow.stats.steps
    assert torch.equal(narrow.generate(prompts[:1], 5), alone)
    assert narrow.stats.steps - steps == 2 + 4  # the prompt in 4 + 2 tokens, then 4 decodes


class _StopOn(transformers.StoppingCriteria):
    """A caller's criterion: a row stops once its last token is a multiple of ``mod`` and it is
    ``length`` tokens long (HF decodes such a row on while others of its batch go on)."""

    def __init__(self, mod: int, length: int) -> None:
        self.mod, self.length = mod, length

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return (input_ids[:, -1] % self.mod == 0) & (input_ids.shape[-1] >= self.length)


@pytest.mark.parametrize(("seed", "mod"), [(1, 2), (0, 3)])
def test_rows_a_criterion_stops_decode_on_to_the_last_rows_stop_like_hf(
        llama: Any, lm: hf.CompiledCausalLM, narrow: hf.CompiledCausalLM, seed: int,
        mod: int) -> None:
    # Before: when the last row a criterion stopped came before an earlier-stopped row in a
    # step, generate raised a raw ValueError (list.remove); with rows running behind others
    # (a third row waiting for a cache row) the call ended at the first all-stopped step and
    # the rows behind got pad tokens where HF has their tokens.
    prompts = _prompts(3, 6, seed=seed)
    mask = torch.ones_like(prompts)
    mask[1, :3], mask[2, :1] = 0, 0
    ids = prompts.masked_fill(mask == 0, 0)
    kwargs = {"attention_mask": mask, "pad_token_id": 0, "max_new_tokens": 10,
              "stopping_criteria": transformers.StoppingCriteriaList([_StopOn(mod, 7)])}
    expected = _hf(llama, ids, **kwargs).sequences
    for served in (lm, narrow):
        assert torch.equal(served.generate(ids, **kwargs), expected), served.max_batch_size
        assert not served.batcher.requests()
