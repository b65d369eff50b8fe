"""``lm.batcher`` as a server uses it, shared with ``lm.generate``: owners, listing, ids, and
a fault at each point where user code runs.

A tiny Llama on emulated breakable graphs (no Dynamo), served once for the module. Every fault
is injected once; afterwards the batcher holds nothing of the failed call, the other requests
finish with the tokens HF's ``generate`` gives them alone, and a later ``generate`` works.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install 'freezeframe[hf]'")

import freezeframe as ff  # noqa: E402
from freezeframe.integrations import hf  # noqa: E402

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
SERVER = [[11, 12, 13, 14], [21, 22, 23]]
PROMPTS = torch.tensor([[31, 32, 33, 34, 35], [41, 42, 43, 44, 45]])


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def lm(llama: Any) -> hf.CompiledCausalLM:
    return ff.hf.compile(llama, max_batch_size=8, max_cache_len=32, max_num_tokens=64,
                         capture_sizes=[1, 2, 4, 8], graph_backend="emulated", trace=False,
                         progress=False)


@pytest.fixture(scope="module")
def alone(llama: Any) -> dict[str, list[int]]:
    """HF's greedy tokens for each server prompt alone (6 new) and the generate batch (4)."""
    with torch.no_grad():
        out = {f"s{i}": llama.generate(torch.tensor([p]), max_new_tokens=6,
                                       do_sample=False)[0, len(p):].tolist()
               for i, p in enumerate(SERVER)}
        out["generate"] = llama.generate(PROMPTS, max_new_tokens=4, do_sample=False).tolist()
    return out


@pytest.fixture(autouse=True)
def _empty(lm: hf.CompiledCausalLM) -> Any:
    yield
    assert not lm.batcher.requests(), "a test left requests behind"


def _serve(lm: hf.CompiledCausalLM) -> None:
    for i, prompt in enumerate(SERVER):
        lm.batcher.add(prompt, ff.hf.SamplingParams(max_new_tokens=6), request_id=f"s{i}")


def _finish(lm: hf.CompiledCausalLM, alone: dict[str, list[int]],
            streamed: dict[str, list[int]] | None = None) -> None:
    """Step the server's requests to their end; they must have HF's tokens."""
    streamed = streamed if streamed is not None else {}
    while lm.batcher.has_unfinished():
        for token in lm.batcher.step():
            streamed.setdefault(token.request_id, []).append(token.token)
    done = {f.request_id: f for f in lm.batcher.take_finished()}
    assert sorted(done) == ["s0", "s1"]
    for rid, f in done.items():
        assert (list(f.tokens), f.finish_reason) == (alone[rid], "length"), rid
        assert streamed.get(rid, []) == alone[rid][len(alone[rid]) - len(streamed.get(rid, [])):]


def test_generate_beside_a_server_owns_only_its_requests(
        lm: hf.CompiledCausalLM, alone: dict[str, list[int]]) -> None:
    # Before: generate refused to run beside unfinished requests, and swallowed a server's
    # finished but uncollected ones (take_finished then returned nothing).
    _serve(lm)
    streamed: dict[str, list[int]] = {}
    for token in lm.batcher.step():  # the server's prefill and first tokens
        streamed.setdefault(token.request_id, []).append(token.token)
    states = {(r.request_id, r.state, r.owner) for r in lm.batcher.requests()}
    assert states == {("s0", "running", "caller"), ("s1", "running", "caller")}
    for _ in range(2):  # (8 steps: the server's requests end inside them)
        assert lm.generate(PROMPTS, max_new_tokens=4).tolist() == alone["generate"]
    # generate's steps moved the server's requests on: their tokens come with the next step
    assert lm.batcher.has_unfinished() and lm.batcher.num_running == 0
    _finish(lm, alone, streamed)
    assert streamed == {rid: alone[rid] for rid in ("s0", "s1")}
    _serve(lm)
    while lm.batcher.has_unfinished():
        lm.batcher.step()
    assert {(r.request_id, r.state) for r in lm.batcher.requests()} == {
        ("s0", "finished"), ("s1", "finished")}
    assert lm.generate(PROMPTS, max_new_tokens=4).tolist() == alone["generate"]
    assert sorted(f.request_id for f in lm.batcher.take_finished()) == ["s0", "s1"]


def test_a_server_thread_and_generate_share_the_batcher(
        lm: hf.CompiledCausalLM, alone: dict[str, list[int]]) -> None:
    streamed: dict[str, list[int]] = {}
    failures: list[BaseException] = []

    def server() -> None:
        try:
            _serve(lm)
            _finish(lm, alone, streamed)
        except BaseException as exc:  # (reported by the main thread)
            failures.append(exc)

    thread = threading.Thread(target=server)
    thread.start()
    results = [lm.generate(PROMPTS, max_new_tokens=4).tolist() for _ in range(2)]
    thread.join(timeout=300)
    assert not failures and not thread.is_alive()
    assert results == [alone["generate"]] * 2
    assert streamed == {rid: alone[rid] for rid in ("s0", "s1")}


def test_made_up_ids_never_collide_with_a_callers(lm: hf.CompiledCausalLM) -> None:
    # Before: a caller's "req-2" made a later plain add() fail
    batcher = lm.batcher
    taken = [batcher.add([5], ff.hf.SamplingParams(max_new_tokens=1), request_id=f"req-{i}")
             for i in range(3)]
    made = [batcher.add([5], ff.hf.SamplingParams(max_new_tokens=1)) for _ in range(3)]
    assert len(set(taken + made)) == 6
    with pytest.raises(ff.ConfigError, match="request_id='req-1' must be a str not in use"):
        batcher.add([5], request_id="req-1")
    while batcher.has_unfinished():
        batcher.step()
    assert sorted(f.request_id for f in batcher.take_finished()) == sorted(taken + made)


def test_a_generation_config_given_to_add_is_honoured_or_refused(lm: hf.CompiledCausalLM,
                                                                  llama: Any) -> None:
    # Before: Batcher.add took a GenerationConfig's num_return_sequences=2 and made one
    # sequence, and ignored prompt_lookup_num_tokens, output_scores and output_logits.
    batcher = lm.batcher
    with pytest.raises(ff.ConfigError, match=r"Batcher\.add: num_return_sequences=2: a request "
                                             r"is one sequence; add the prompt that many times"):
        batcher.add(SERVER[0], transformers.GenerationConfig(max_new_tokens=3, do_sample=True,
                                                             num_return_sequences=2))
    prompt = [5, 6, 7, 8] * 3
    with torch.no_grad():
        greedy = llama.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    steps = lm.stats.steps
    batcher.add(prompt, transformers.GenerationConfig(
        max_new_tokens=8, prompt_lookup_num_tokens=3, output_scores=True, output_logits=True),
        request_id="lookup")
    while batcher.has_unfinished():
        batcher.step()
    (done,) = batcher.take_finished()
    assert list(done.tokens) == greedy[0, len(prompt):].tolist()
    assert lm.stats.steps - steps < 8  # candidates were verified several at a time
    assert len(done.scores) == len(done.logits) == 8
    assert torch.equal(done.scores[0], done.logits[0])  # (greedy, no processor)


class _Raise:
    """User code that raises ``error`` at its ``when``-th call."""

    def __init__(self, error: BaseException, when: int = 2) -> None:
        self.error, self.when, self.calls = error, when, 0

    def hit(self) -> None:
        self.calls += 1
        if self.calls == self.when:
            raise self.error


class _Streamer(_Raise):
    def put(self, value: torch.Tensor) -> None:
        self.hit()

    def end(self) -> None:
        pass


class _Processor(_Raise, transformers.LogitsProcessor):
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.hit()
        return scores


class _Criterion(_Raise, transformers.StoppingCriteria):
    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.hit()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _faulty(kind: str, error: BaseException) -> dict[str, Any]:
    if kind == "streamer":
        return {"streamer": _Streamer(error)}
    if kind == "processor":
        return {"logits_processor": [_Processor(error, when=3)]}
    return {"stopping_criteria": [_Criterion(error, when=3)]}


@pytest.mark.parametrize("kind", ["streamer", "processor", "criterion", "step"])
@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_failed_generate_leaves_the_batcher_as_it_found_it(
        lm: hf.CompiledCausalLM, alone: dict[str, list[int]], kind: str,
        error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the failed call's rows stayed in lm.batcher and every later generate failed
    _serve(lm)
    lm.batcher.step()
    kwargs: dict[str, Any] = {}
    if kind == "step":  # the model step itself refuses (a refused change, Ctrl-C)
        fault = _Raise(error, when=3)
        real = lm.step

        def step(*args: Any, **kw: Any) -> torch.Tensor:
            fault.hit()
            return real(*args, **kw)
        monkeypatch.setattr(lm, "step", step)
    else:
        kwargs = _faulty(kind, error)
    with pytest.raises(type(error)):
        lm.generate(PROMPTS, max_new_tokens=4, **kwargs)
    monkeypatch.undo()
    assert {r.owner for r in lm.batcher.requests()} == {"caller"}
    assert lm.batcher.num_running + lm.batcher.num_waiting == 2
    assert lm.generate(PROMPTS, max_new_tokens=4).tolist() == alone["generate"]
    _finish(lm, alone)


def test_a_servers_request_whose_code_raises_ends_alone(
        lm: hf.CompiledCausalLM, alone: dict[str, list[int]]) -> None:
    batcher = lm.batcher
    _serve(lm)
    batcher.add([7, 8], transformers.GenerationConfig(max_new_tokens=5), request_id="bad",
                logits_processor=[_Processor(RuntimeError("injected"), when=2)])
    batcher.step()
    with pytest.raises(RuntimeError, match="injected"):
        batcher.step()
    states = {r.request_id: r.state for r in batcher.requests()}
    assert states == {"s0": "running", "s1": "running", "bad": "finished"}
    failed = [f for f in batcher.take_finished() if f.request_id == "bad"]
    assert failed[0].finish_reason == "error" and str(failed[0].error) == "injected"
    _finish(lm, alone)


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_servers_criterion_that_raises_streams_every_token_its_request_kept(
        lm: hf.CompiledCausalLM, alone: dict[str, list[int]], error: BaseException) -> None:
    # Before: the token the failing criterion was judging was in the request's Finished
    # tokens but never in a step's tokens (a stream lost it); after Ctrl-C the request went on.
    batcher = lm.batcher
    _serve(lm)
    batcher.add(SERVER[0], transformers.GenerationConfig(max_new_tokens=6), request_id="bad",
                stopping_criteria=[_Criterion(error, when=3)])
    streamed: dict[str, list[int]] = {}
    raised = 0
    while batcher.has_unfinished():
        try:
            made = batcher.step()
        except type(error):
            raised += 1
            continue
        for token in made:
            streamed.setdefault(token.request_id, []).append(token.token)
    assert raised == 1
    done = {f.request_id: f for f in batcher.take_finished()}
    assert (done["bad"].finish_reason, done["bad"].error) == ("error", error)
    assert list(done["bad"].tokens) == streamed["bad"] == alone["s0"][:3]
    for rid in ("s0", "s1"):
        assert list(done[rid].tokens) == streamed[rid] == alone[rid]


def test_the_async_front_streams_each_request(lm: hf.CompiledCausalLM,
                                              alone: dict[str, list[int]]) -> None:
    front = ff.hf.AsyncFront(lm.batcher)

    async def collect(prompt: list[int], stop_after: int | None = None) -> list[int]:
        got = []
        async for token in front.stream(prompt, ff.hf.SamplingParams(max_new_tokens=6)):
            got.append(token)
            if stop_after is not None and len(got) == stop_after:
                break  # the client went away: its request is aborted
        return got

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(collect(SERVER[0]), collect(SERVER[1], 2),
                                         collect(SERVER[1])))

    first, left, second = asyncio.run(main())
    assert (first, second, left) == (alone["s0"], alone["s1"], alone["s1"][:2])


def test_the_async_front_raises_a_failed_model_step_from_every_stream(
        lm: hf.CompiledCausalLM, alone: dict[str, list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the front retried a failing model step forever (hundreds of thousands of steps
    # a minute) and no stream ever ended or saw the error.
    front = ff.hf.AsyncFront(lm.batcher)
    fault = _Raise(RuntimeError("device lost"), when=2)
    real = lm.step

    def step(*args: Any, **kw: Any) -> torch.Tensor:
        if fault.calls >= fault.when:
            fault.calls += 1
            raise fault.error
        fault.hit()
        return real(*args, **kw)
    monkeypatch.setattr(lm, "step", step)

    async def collect(prompt: list[int]) -> list[int] | BaseException:
        try:
            return [t async for t in front.stream(prompt, ff.hf.SamplingParams(max_new_tokens=6))]
        except RuntimeError as exc:
            return exc

    async def main() -> list[list[int] | BaseException]:
        return list(await asyncio.wait_for(
            asyncio.gather(collect(SERVER[0]), collect(SERVER[1])), timeout=30))

    assert asyncio.run(main()) == [fault.error, fault.error]
    assert fault.calls == 2  # the failed step is not retried
    monkeypatch.undo()
    first = asyncio.run(main())  # the front serves again
    assert first == [alone["s0"], alone["s1"]]
