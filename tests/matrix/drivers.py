"""Matrix cases whose model is served by a driver rather than called: the reference Llama
(``freezeframe.models.build_llama("tiny")`` behind a GraphRunner built as the bench's
``compile_with_runner`` builds it, driven by ``ServingDriver``) and tiny Hugging Face causal
LMs (``ff.hf.compile`` and its greedy ``generate``, against HF's own ``generate``).

The oracle is the harness's. The Llama runs in lockstep with eager: every step the driver
makes is also run by an eager copy of the model (its own KV cache) on the same inputs, and the
hidden states of every token are compared, prefill and decode, to the end of every request
(the driver samples from the compiled run, so the two never part). A Hugging Face generation
is compared with HF's token by token; greedy tokens may differ only where the two logits that
decide them are within the tolerance of each other (a near tie), where the comparison stops.
A refusal is accepted only where docs/guarantees.md promises it (refusals.py).
"""

from __future__ import annotations

import copy
import functools
import random
from typing import Any

import torch

import freezeframe as ff
from freezeframe.errors import FreezeframeError
from tests.matrix import models, refusals
from tests.matrix.cases import Case, Change, Generate, Serve, describe_event
from tests.matrix.changes import Changer
from tests.matrix.oracle import CallRecord, Failure, Outcome, compare, global_state

MAX_SEQS, MAX_TOKENS = 4, 16


def _at(index: int, event: Any, failure: Failure) -> Failure:
    return Failure(failure.kind, f"at event {index + 1} ({describe_event(event)}): {failure}")


# -- the reference Llama ---------------------------------------------------------------------
_REFUSED = object()


def _attempt(call: Any, outcome: Outcome, index: int, event: Any, via: str,
             changer: Changer) -> Any:
    """``call()``'s answer (counted in ``outcome.calls``), or ``_REFUSED`` after a
    FreezeframeError the guarantees promise for the changes made (counted and kept); any
    other exception is the case's failure."""
    try:
        got = call()
    except Failure as failure:
        raise _at(index, event, failure) from None
    except FreezeframeError as exc:
        entry = refusals.accepted(exc, changer.happened)
        if entry is None:
            raise _at(index, event, Failure(
                "refusal", f"refused where docs/guarantees.md promises an answer (after "
                           f"{sorted(changer.happened) or 'no change'}): "
                           f"{type(exc).__name__}: {exc}")) from exc
        outcome.refused += 1
        outcome.refusals.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        outcome.records.append(CallRecord(via, refused=f"{type(exc).__name__}: {exc}",
                                          wrong_for_user=entry.wrong_for_user,
                                          accepted_as=entry.name))
        return _REFUSED
    except Exception as exc:
        raise _at(index, event, Failure("raw exception", f"{type(exc).__name__}: {exc}")
                  ) from exc
    outcome.calls += 1
    outcome.records.append(CallRecord(via))
    return got


def _requests(seed: int) -> list[Any]:
    from freezeframe.models.serving import Request

    rng = random.Random(seed)
    return [Request(f"r{i}", tuple(rng.randrange(256) for _ in range(rng.randint(1, 14))),
                    max_new_tokens=rng.randint(2, 5), arrival_step=rng.randint(0, 3))
            for i in range(rng.randint(1, 4))]


class Lockstep:
    """The driver's forward through the runner, each step also run eagerly on a copy of the
    model with a KV cache of its own: every token's hidden state is compared."""

    def __init__(self, forward: Any, reference: Any, tol: float) -> None:
        from freezeframe.models.serving import EagerForward

        reference.reset_cache()
        self.forward, self.eager, self.tol = forward, EagerForward(reference), tol
        self.steps = 0

    def __call__(self, step: Any) -> torch.Tensor:
        with torch.no_grad():
            want = self.eager(step)[:step.num_tokens].float()
        got = self.forward(step)
        scale = max(1.0, float(want.abs().max()))
        compare(got[:step.num_tokens].float(), want, (0.0, self.tol * scale),
                f"serving step {self.steps}'s hidden states ({step.num_tokens} tokens, "
                f"{'uniform decode' if step.uniform_decode else 'mixed'})")
        self.steps += 1
        return got


def serve_case(case: Case) -> Outcome:
    from freezeframe.models import ATTENTION_OP, KVCacheConfig, LlamaModel, build_llama
    from freezeframe.models.serving import RunnerForward, ServingDriver, llama_runner_inputs

    cache = KVCacheConfig(num_blocks=64, block_size=4, max_model_len=48)
    model = build_llama("tiny", cache, seed=case.seed, init_std=0.3)
    graphs = case.graph_mode != "none"
    cfg = ff.CompilationConfig(
        mode="piecewise", backend=case.compiler, splitting_ops=[ATTENTION_OP],
        cudagraph_mode=case.graph_mode,
        cudagraph_capture_sizes=list(case.ladder) if graphs else None,
        graph_backend="emulated", max_num_seqs=MAX_SEQS, max_num_tokens=MAX_TOKENS,
        use_cache=False)
    compiled = ff.compile(model, cfg, dynamic_arg_dims=dict(
        LlamaModel.DYNAMIC_ARG_DIMS, seq_lens=0, block_tables=0))
    runner = ff.GraphRunner(compiled, cfg, inputs=llama_runner_inputs(model, MAX_SEQS),
                            progress=False)
    runner.capture()
    forward = RunnerForward(runner, MAX_SEQS)
    changer = Changer(model, compiled, case.seed)
    outcome = Outcome()
    tol = 1e-4 if case.compiler == "eager" else 1e-3
    for index, event in enumerate(case.events):
        if isinstance(event, Change):
            changer.apply(event, index)
            continue
        assert isinstance(event, Serve)
        lockstep = Lockstep(forward, changer.reference(), tol)
        before = global_state()
        driver = ServingDriver(model, lockstep, max_num_seqs=MAX_SEQS,
                               max_num_batched_tokens=MAX_TOKENS)
        replays = compiled.stats.get("replays")
        got = _attempt(functools.partial(driver.run, _requests(event.requests)), outcome,
                       index, event, "serve", changer)
        if got is not _REFUSED:
            outcome.records[-1].graph = graphs
            outcome.records[-1].replayed = compiled.stats.get("replays") > replays
        if global_state() != before:
            raise _at(index, event, Failure("leak", f"{before} -> {global_state()}"))
    outcome.stats = dict(compiled.stats.snapshot())
    return outcome


# -- Hugging Face ----------------------------------------------------------------------------
def hf_case(case: Case) -> Outcome:
    family = case.model.removeprefix("hf_")
    model = models.hf_model(family, case.seed)
    twin = copy.deepcopy(model)  # HF eager, changed alike (ff.hf.compile works in place)
    lm = ff.hf.compile(model, max_batch_size=8, max_cache_len=32, max_num_tokens=64,
                       capture_sizes=list(case.ladder), backend=case.compiler,
                       graph_backend="emulated", cudagraph_mode=case.graph_mode)
    changers = [Changer(model, None, case.seed), Changer(twin, None, case.seed)]
    tied = {"lm_head.weight", "transformer.wte.weight", "model.embed_tokens.weight"}
    outcome = Outcome()
    tol = 1e-4 if case.compiler == "eager" else 1e-3
    for index, event in enumerate(case.events):
        if isinstance(event, Change):
            names = changers[0].param_names()
            target = event.target
            while names[target % len(names)] in tied:  # tied weights must stay tied
                target += 1
            for changer in changers:
                changer.apply(Change(event.kind, target), index)
            continue
        assert isinstance(event, Generate)
        gen = torch.Generator().manual_seed(case.seed * 1000 + index)
        prompts = torch.randint(0, 128, (event.batch, event.prompt), generator=gen)
        with torch.no_grad():
            want = twin.generate(prompts, max_new_tokens=event.new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        got = _attempt(functools.partial(lm.generate, prompts, event.new, output_logits=True,
                                         return_dict_in_generate=True),
                       outcome, index, event, "hf", changers[0])
        if got is _REFUSED:
            continue
        try:
            _same_generation(got, want, tol)
        except Failure as failure:
            raise _at(index, event, failure) from None
    return outcome


def _same_generation(got: Any, want: Any, tol: float) -> None:
    prompt = want.sequences.shape[1] - len(want.logits)
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        w = w.float()
        scale = max(1.0, float(w.abs().max()))
        compare(g.float(), w, (0.0, tol * scale), f"generated token {step}'s logits")
        column = prompt + step
        if not torch.equal(got.sequences[:, column], want.sequences[:, column]):
            if torch.equal(g.argmax(-1), w.argmax(-1)):
                raise Failure("wrong answer", f"token {step}: {got.sequences[:, column]}, "
                                              f"HF {want.sequences[:, column]}")
            return  # a near tie decided otherwise
