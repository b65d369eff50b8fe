"""The differential matrix (issue 31): seeded cases, each run against eager PyTorch.

``make test`` runs the fast slice: ``FAST_SEEDS`` seeds of the ``fast`` tier (eager compiler,
emulated graphs, every path and change) plus the named regression cases. ``make fuzz`` runs
the full matrix: ``FF_MATRIX=full``, ``FULL_SEEDS`` seeds of the ``full`` tier (Inductor, the
Hugging Face models and warm starts in a fresh subprocess too).

Environment:
  FF_MATRIX=fast|full      the tier (default fast)
  FF_MATRIX_SEED=12,34     run these seeds only (a failure prints the line that does this)
  FF_MATRIX_SEEDS=N        how many seeds, from FF_MATRIX_START (default 0)
  FF_MATRIX_SHRINK=0       do not shrink a failing case's event sequence
  FF_MATRIX_KNOWN_BUGS=0   run the seeds of known bugs as plain tests (not strict xfails)

A failing case prints its seed, the case in words (model, config, path, the calls and changes),
the event that failed and how, a shorter event sequence that fails alike (as code too), and
the command that reruns it.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import freezeframe as ff
from tests.matrix import models, refusals
from tests.matrix.cases import (
    GRAPH_MODES,
    PATHS,
    PENDING_KINDS,
    SWITCHED_KINDS,
    Call,
    Case,
    Change,
    Generate,
    Serve,
    generate,
)
from tests.matrix.harness import Outcome, run_case
from tests.matrix.models import SPECS

TIER = os.environ.get("FF_MATRIX", "fast")
FAST_SEEDS = 88
FULL_SEEDS = 400

# Open bugs the matrix found on the current code, by (tier, seed): strict xfails (not shrunk
# each run), so a fix turns the suite red until the entry is removed.
KNOWN_BUGS: dict[tuple[str, int], str] = {}


def _seeds() -> list[int]:
    chosen = os.environ.get("FF_MATRIX_SEED", "").strip()
    if chosen:
        return [int(s) for s in chosen.replace(",", " ").split()]
    count = int(os.environ.get("FF_MATRIX_SEEDS", FULL_SEEDS if TIER == "full" else FAST_SEEDS))
    start = int(os.environ.get("FF_MATRIX_START", "0"))
    return list(range(start, start + count))


def _run(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         shrink: bool = True, accept_wrong: bool = True) -> Outcome:
    cache_dir = None
    if case.warm:  # tests/conftest.py turns the cache off for every test
        monkeypatch.delenv("FREEZEFRAME_DISABLE_CACHE", raising=False)
        cache_dir = str(tmp_path / "cache")
    shrink = shrink and os.environ.get("FF_MATRIX_SHRINK", "1") != "0"
    return run_case(case, cache_dir, shrink=shrink, accept_wrong=accept_wrong)


def _seed_params() -> list[object]:
    if os.environ.get("FF_MATRIX_KNOWN_BUGS", "1") == "0":  # e.g. against an older commit
        return [pytest.param(seed, id=f"{TIER}-seed{seed}") for seed in _seeds()]
    return [pytest.param(seed, id=f"{TIER}-seed{seed}", marks=[pytest.mark.xfail(
                strict=True, reason=KNOWN_BUGS[(TIER, seed)])])
            if (TIER, seed) in KNOWN_BUGS else pytest.param(seed, id=f"{TIER}-seed{seed}")
            for seed in _seeds()]


@pytest.mark.parametrize("seed", _seed_params())
def test_seed(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              matrix_outcomes: dict[int, Any]) -> None:
    case = generate(seed, TIER)
    outcome = _run(case, tmp_path, monkeypatch, shrink=(TIER, seed) not in KNOWN_BUGS)
    if TIER == "fast":
        matrix_outcomes[seed] = (case, outcome)


# -- named regression cases --------------------------------------------------------------------
# The open bugs, each as the shortest case that shows it; strict xfails (a fix turns the suite
# red until its case moves to FOUND). Each pending kind of cases.PENDING_KINDS has one, named
# after it; the refusals wrong for a user (refusals.ACCEPTED's wrong_for_user) have one each,
# run with those refusals not accepted.
OPEN: dict[str, tuple[str, Case]] = {}


def _tier_marks(case: Case) -> list[pytest.MarkDecorator]:
    """The full tier's cases (Inductor, Hugging Face: slow on a small CPU) run in make fuzz."""
    if case.tier != "full":
        return []
    return [pytest.mark.inductor, pytest.mark.skipif(
        TIER != "full", reason="a full-tier case: FF_MATRIX=full (make fuzz) runs it")]


def _open_params() -> list[object]:
    return [pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=reason),
                                               *_tier_marks(case)])
            for name, (reason, case) in OPEN.items()]


@pytest.mark.parametrize("name", _open_params())
def test_open_bug(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(OPEN[name][1], tmp_path, monkeypatch, shrink=False, accept_wrong=False)


def test_every_pending_kind_and_wrong_refusal_has_its_open_case() -> None:
    """The lead switches a kind on (PENDING_KINDS) or drops a wrong refusal (refusals.py)
    together with moving its OPEN case to FOUND: the three lists agree."""
    wrong = {entry.wrong_for_user for entry in refusals.ACCEPTED if entry.wrong_for_user}
    found_by_matrix: set[str] = set()  # (none open)
    assert set(PENDING_KINDS) <= set(SWITCHED_KINDS)
    assert set(OPEN) == set(PENDING_KINDS) | wrong
    assert found_by_matrix <= set(PENDING_KINDS)


def test_found_stock_torch_compile_instances_leave_the_class_compilable() -> None:
    """Found (fast seed 75): every ff.compile(mode='stock_torch_compile') instance left
    Dynamo cache entries on the class's forward (one per grad mode); its compile now runs over
    a private copy of its code."""
    _many_instances_then_torch_compile("stock_torch_compile", instances=6)


def test_found_many_compiled_instances_leave_the_class_compilable() -> None:
    """Found (a health check failed) while 5e9b846 fixed it: every ff.compile'd instance
    added a Dynamo cache entry on the class's forward, and after 8 a plain
    torch.compile(fullgraph=True) of the class failed."""
    _many_instances_then_torch_compile("piecewise", instances=10)


def _many_instances_then_torch_compile(mode: str, instances: int) -> None:
    torch._dynamo.reset()  # what earlier tests compiled of the class counts toward the limit
    try:
        _compile_instances(mode, instances)
    finally:
        torch._dynamo.reset()


def _compile_instances(mode: str, instances: int) -> None:
    cfg = ff.CompilationConfig(mode=mode, backend="eager", use_cache=False)
    for i in range(instances):
        instance = models.Small()
        compiled = ff.compile(instance, cfg, inference_mode=False)
        for grad in (True, False):  # a stock torch.compile recompiles for each grad mode
            x = torch.randn(3 + i, 4)
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(compiled(x), instance(x), rtol=0, atol=0)
    module, x = models.Small(), torch.randn(3, 4)
    with torch.no_grad():
        got = torch.compile(module, fullgraph=True, backend="eager")(x)
        torch.testing.assert_close(got, module(x), rtol=0, atol=0)


# Bugs the matrix found, fixed since: each as the shortest case that showed it (the seed it came
# from, the commit that fixed it); most on c9d3e67 (docs/results/matrix-c9d3e67.txt).
FOUND: dict[str, Case] = {
    # OPEN until matrixfix fixed them; the reason each was open:
    # a micro-batched FULL step replayed its split graph and skipped the compiled model's
    # forward hooks and pre-hooks (a wrong answer); they now run once around the whole step
    "hooks_micro_batch": Case(
        seed=1, tier="fast", model="sandwich", path="microbatch",
        graph_mode="full_and_piecewise", ladder=(4,), events=(
            Call(4, positional=True, uniform=True, reqs=4, split=(1, 1, 1, 1)),
            Change("hook_model_fwd"),
            Call(4, positional=True, uniform=True, reqs=4, split=(1, 1, 1, 1)))),
    # micro-batching with cudagraph_mode FULL refused a uniform-decode step (CaptureError: no
    # FULL graph captured for (2 tokens, 2 requests, not uniform)): capture() captured the key
    # unsplit as a mixed step; the split step now replays that graph unsplit (counted)
    "micro_batch_full_uniform": Case(
        seed=1, tier="fast", model="sandwich", path="microbatch", graph_mode="full",
        ladder=(1, 2, 4), events=(
            Call(2, positional=True, uniform=True, reqs=2, split=(1, 1)),)),
    # micro-batching a model with a Requests input: a raw IndexError (a Tokens input of
    # request numbers indexed the micro-batch's own rows of it); now a ConfigError at
    # GraphRunner(...) naming the input and the fix (refusals.py, docs/guarantees.md)
    "micro_batch_requests": Case(
        seed=1, tier="fast", model="per_request", path="microbatch",
        graph_mode="piecewise", ladder=(1, 2, 4), events=(
            Call(2, positional=True, uniform=True, reqs=2, split=(1, 1)),)),
    # a forward pre-hook on the compiled model returning new inputs, low-level forward context:
    # the replay copied the hook's tensor into the captured tensor, there the caller's own
    # input (the copy is now put back on every path, not only a runner's)
    "pre_hook_low_level": Case(
        seed=1, tier="fast", model="rmsnorm", path="context", graph_mode="piecewise",
        ladder=(8,), events=(Call(8), Change("hook_model_pre"), Call(8))),
    # the background capture's dummy steps ran forward after a user step, and its
    # self.last = out left the dummy output there (a capture now puts back every attribute its
    # dummy steps bound)
    "capture_writes_attributes": Case(
        seed=1, tier="fast", model="keeps_last", path="runner",
        graph_mode="full_decode_only", ladder=(1, 4, 8), policy="background",
        events=(Call(3, positional=True, wait=True),)),
    # a FULL graph holds Dynamo's code with its self.last = out, but a replay ran kernels only:
    # after a plain call between runner steps, model.last kept the plain call's (low-level
    # path alike, fast seed 71); a FULL replay now repeats the capture's attribute stores
    "stored_output_rebound": Case(
        seed=5, tier="fast", model="keeps_last", path="runner", graph_mode="full",
        ladder=(8,), events=(Call(6, positional=True), Call(5, via="plain"),
                             Call(6, positional=True))),
    # fast seed 17 once the six kinds above were drawn: a runner step cut each place of one
    # tensor object returned twice ({"pair": (h, [y, h*2]), "logits": y}) as a tensor of its
    # own; the cut (and copy_outputs, and a micro-batched step's join) now keeps it one
    "repeated_output_tensor": Case(
        seed=17, tier="fast", model="nested_out", path="runner",
        graph_mode="full_decode_only", ladder=(1, 2, 4, 8), policy="background",
        inference_mode=False, verify=2, events=(Call(1, grad="inference", opt=True,
                                                     positional=True),)),
    # OPEN until the trust merge (d529a4c) fixed them (issue 42); the reason each was open:
    # issue 42 item 2: a module-level global forward reads, changed after the first call, keeps
    # its first value (a wrong answer)
    "module_global": Case(
        seed=1, tier="fast", model="reads_global", path="plain",
        events=(Call(3), Change("module_global"), Call(3))),
    # issue 42 item 1: a plain tensor attribute replaced after capture: planned and unplanned
    # runner steps answer with the old tensor
    "tensor_attr_replaced_graphs": Case(
        seed=1, tier="fast", model="tensor_attr", path="runner", graph_mode="full",
        ladder=(4,), events=(Call(3, positional=True), Call(3, positional=True),
                             Change("tensor_attr_replaced"), Call(3, positional=True))),
    # issue 42 item 3: a Python float / int argument on breakable graphs replays the captured
    # value (a wrong answer)
    "scalar_arg_breakable": Case(
        seed=1, tier="fast", model="timestep", path="context", mode="none",
        breakable=True, graph_mode="piecewise", ladder=(4,),
        events=(Call(4, scalar=0), Call(4, scalar=2))),
    # issue 42 item 3: a class attribute changed after a breakable capture is not seen
    "class_attr_breakable": Case(
        seed=1, tier="fast", model="reads_attrs", path="context", mode="none",
        breakable=True, graph_mode="piecewise", ladder=(4,),
        events=(Call(4), Change("class_attr"), Call(4))),
    # issue 42 item 12: torch.compile(backend='freezeframe') in a forward context, a Python float
    # that changes: a CaptureError about aten._local_scalar_dense, naming no argument
    "scalar_arg_stock_context": Case(
        seed=1, tier="fast", model="timestep", path="torch_compile",
        graph_mode="piecewise", ladder=(4,),
        events=(Call(4, via="context"), Call(4, via="context", scalar=2))),
    # issue 42 item 4: a model returning a plain @dataclass of tensors (a raw AttributeError here;
    # the padded rows on a runner step)
    "dataclass_out": Case(
        seed=1, tier="fast", model="dataclass_out", path="runner", graph_mode="full",
        ladder=(4,), events=(Call(3, positional=True), Call(3, positional=True))),
    # issue 42 item 9a: verify=N on a model that writes its input: a false VerifyError
    "verify_writes_input": Case(
        seed=1, tier="fast", model="makes_ones", path="runner", graph_mode="full",
        ladder=(4,), verify=2, events=(Call(3, positional=True),)),
    # issue 42 item 9b: verify=N with a forward hook on the compiled model: a false VerifyError
    # (the reference skips the hook)
    "verify_hooked": Case(
        seed=1, tier="fast", model="silly", path="runner", graph_mode="full",
        ladder=(4,), verify=2, events=(Change("hook_model_fwd"), Call(3, positional=True))),
    # issue 42 item 5: lm.generate ignores model.generation_config fields HF's generate honours
    # (repetition_penalty, no_repeat_ngram_size): other tokens
    "hf_generation_config": Case(
        seed=2, tier="fast", model="hf_gpt2", path="hf", ladder=(8,),
        events=(Change("gen_config"), Generate(2, 4, 6))),
    # issue 42: setting an attribute forward never reads refuses every later call
    "unread_attribute_set": Case(
        seed=1, tier="fast", model="silly", path="plain",
        events=(Call(3), Change("instance_attr"), Call(3))),
    # issue 42: a graph captured by a keyword call, replayed by a positional one:
    # InputMismatchError
    "positional_after_keyword_capture": Case(
        seed=1, tier="fast", model="sandwich", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4), Call(4, positional=True))),
    # fast seed 40: modes "none" and "stock_torch_compile" called module.forward, skipping
    # hooks on the module itself; stock missed a hook added after the first call to a
    # submodule that had none (Dynamo does not guard empty hook dicts): both now call the
    # module, and stock compiles again when such a hook appears
    "root_hook_mode_none": Case(
        seed=91, tier="fast", model="reads_attrs", path="plain", mode="none",
        events=(Call(6), Change("hook_root_fwd"), Call(12))),
    "root_hook_stock_torch_compile": Case(
        seed=91, tier="fast", model="reads_attrs", path="plain", mode="stock_torch_compile",
        events=(Call(6), Change("hook_root_fwd"), Call(12))),
    "submodule_hook_stock_torch_compile": Case(
        seed=177, tier="fast", model="tuple_out", path="plain", mode="stock_torch_compile",
        events=(Call(8), Change("hook_sub_fwd", 0), Call(8))),
    # modes "none" and "stock_torch_compile": a FULL graph replay did not run forward's
    # `self.last = out`; a capture whose forward sets an attribute is now refused
    "stored_output_after_full_replay_stock": Case(
        seed=94, tier="fast", model="keeps_last", path="context", mode="stock_torch_compile",
        graph_mode="full", events=(Call(4), Call(10, via="plain"), Call(4))),
    "stored_output_after_full_replay_none": Case(
        seed=94, tier="fast", model="keeps_last", path="context", mode="none",
        graph_mode="full", events=(Call(4), Call(10, via="plain"), Call(4))),
    # found on 2759703 (fast seed 100, full seed 34), fixed by e0d56f0: modes "none" and
    # "stock_torch_compile" replayed a FULL graph captured before a parameter or submodule was
    # replaced with the old one
    "replaced_weight_full_graph_stock": Case(
        seed=34, tier="fast", model="rmsnorm", path="context", mode="stock_torch_compile",
        graph_mode="full", ladder=(2,), events=(Call(1), Change("replace_param", 6), Call(1))),
    "replaced_weight_full_graph_none": Case(
        seed=34, tier="fast", model="rmsnorm", path="context", mode="none",
        graph_mode="full", ladder=(2,), events=(Call(1), Change("replace_param", 6), Call(1))),
    # fast seed 5 (5b603c2): a forward hook on the compiled model did not run on runner steps
    "runner_steps_skip_the_compiled_models_hooks": Case(
        seed=5, tier="fast", model="silly", path="runner", graph_mode="full_decode_only",
        ladder=(1, 2, 8), ranges=(2,), events=(
            Change("hook_model_fwd"), Call(6, grad="inference", opt=True, uniform=True))),
    # fast seed 90 (5b603c2): two runner steps handed out one tensor object
    "runner_answers_are_one_tensor_object": Case(
        seed=90, tier="fast", model="optional_kwargs", path="runner",
        mode="stock_torch_compile", graph_mode="full", ladder=(1,), events=(
            Call(1, fresh=True, opt=True, kwarg=0, positional=True),
            Call(1, grad="grad", positional=True))),
    # fast seed 107 (5b603c2): the Llama served a replaced weight's old values from its graphs
    "llama_replaced_weight": Case(
        seed=107, tier="fast", model="llama", path="serve", graph_mode="full", ladder=(1, 8),
        ranges=(2, 4), events=(Change("replace_param", 4), Serve(63911))),
    # fast seed 49 (e3baf65): capturing a stock_torch_compile model made Dynamo skip forward's
    # code for good: every later compile of the class failed
    "stock_torch_compile_capture_poisons_the_class": Case(
        seed=49, tier="fast", model="dict_out", path="runner", mode="stock_torch_compile",
        graph_mode="full", policy="lazy", warm="inproc", events=(
            Call(1, fresh=True, positional=True), Call(1, grad="inference", fresh=True))),
    # (01c224e) autocast and the default dtype: a call under other settings than the trace's
    # replayed a graph of the trace's dtype
    "autocast_after_the_trace": Case(
        seed=97, tier="fast", model="optional_kwargs", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4), Change("autocast_on"), Call(4))),
    "default_dtype_after_the_trace": Case(
        seed=97, tier="fast", model="makes_ones", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4), Change("default_dtype64"), Call(4))),
    # (01c224e) a warm start loaded a trace without forward's `self.last = out`
    "warm_start_skips_a_stored_output": Case(
        seed=48, tier="fast", model="keeps_last", path="plain", warm="inproc",
        events=(Call(3), Call(5))),
    # full seed 36 (5b603c2): a bias set to None reached Inductor's code: a raw TypeError
    "inductor_bias_set_to_none": Case(
        seed=36, tier="full", model="optional_kwargs", path="runner", compiler="inductor",
        graph_mode="full", ladder=(1,), policy="lazy", events=(
            Call(1), Call(5, grad="inference", fresh=True, opt=True, positional=True,
                          uniform=True),
            Change("bias_none", 5), Call(2, grad="inference", fresh=True))),
    # (17ee911) an Inductor trace made at one row gave NaN at every other size
    "inductor_first_call_of_one_row": Case(
        seed=1, tier="full", model="mixes_rows", path="plain", compiler="inductor",
        events=(Call(1), Call(3), Call(4), Call(9), Call(1))),
    # full seed 68 (5b603c2): an HF model served a replaced weight's old values
    "hf_replaced_weight": Case(
        seed=68, tier="full", model="hf_gpt2", path="hf", graph_mode="full_and_piecewise",
        ladder=(2, 8), events=(Generate(8, 5, 3), Change("replace_param", 7),
                               Generate(3, 6, 4))),
    # a forward pre-hook returning new inputs: a runner step copied them back into the
    # caller's input (the replay's copy into the static buffer was taken for a model write)
    "pre_hook_inputs_written_back": Case(
        seed=21, tier="fast", model="sandwich", path="runner", graph_mode="full", ladder=(2, 8),
        events=(Call(5), Change("hook_model_pre"), Call(5))),
    # a class attribute forward reads (type(module).OFFSET = 2.5) changed after the trace was
    # served from it; now checked on every call (refused)
    "class_attribute_read_by_forward": Case(
        seed=85, tier="fast", model="reads_attrs", path="plain",
        events=(Call(6), Change("class_attr"), Call(5))),
    # Inductor, inference_mode=False: the grad trace reused the no_grad trace's pieces
    # (compiled without autograd); grad mode is part of the piece hash now
    # full seed 178: mode "stock_torch_compile" with Inductor: every emulated FULL graph step
    # was wrong (Inductor's C++ kernels write through pointers the emulated recorder cannot
    # see); stock_backend now hands Inductor's code to the graph backend's prepare (opaque)
    "stock_torch_compile_inductor_full_graphs": Case(
        seed=178, tier="full", model="rmsnorm", path="runner", mode="stock_torch_compile",
        compiler="inductor", graph_mode="full", ladder=(1, 4, 8), events=(Call(3),)),
    # full seed 19 of the old generator (make fuzz on main; its rerun passed on its own): a
    # second Inductor compile of the Llama on a warm Inductor cache (the first's, in the same
    # process or another) failed: "forward pins a dynamic size to 4" (Inductor's cache hit
    # added the cached code's guards to the trace); ranges now compile afresh, and every
    # matrix case gets an Inductor cache of its own (harness.own_inductor_cache)
    "inductor_llama_on_a_warm_inductor_cache": Case(
        seed=19, tier="full", model="llama", path="serve", compiler="inductor",
        graph_mode="full", ladder=(8,), warm="inproc", events=(Serve(696292),)),
    "inductor_grad_after_a_no_grad_call": Case(
        seed=112, tier="full", model="no_split", path="plain", compiler="inductor",
        inference_mode=False, events=(Call(3), Call(12, grad="grad"))),
    # full seeds 24, 109, 289 (docs/results/matrix-fuzz-2026-11-28.md), inference_mode=False:
    # graphs captured inside torch.inference_mode() held inference tensors, and the splitting
    # op run eagerly between pieces at a later no_grad or grad call wrote into one: a raw
    # "Inplace update to inference tensor outside InferenceMode" where eager answered; a
    # capture in inference mode now allocates ordinary tensors (graphs/wrapper.py)
    "inference_capture_then_no_grad_context": Case(
        seed=24, tier="full", model="tensor_attr", path="context", graph_mode="piecewise",
        ladder=(4, 8), inference_mode=False, events=(
            Call(8, grad="inference", fresh=True, opt=True), Call(8, grad="no_grad", opt=True))),
    "inference_capture_then_grad_runner": Case(
        seed=109, tier="full", model="nested_out", path="runner", graph_mode="piecewise",
        ladder=(1, 2, 4, 8), inference_mode=False, dtype="float16", verify=2, events=(
            Call(2, grad="inference", positional=True, uniform=True, reqs=2),
            Call(2, grad="grad", positional=True, uniform=True, reqs=2))),
    "inference_capture_then_grad_micro_batch": Case(
        seed=289, tier="full", model="rmsnorm", path="microbatch",
        graph_mode="full_and_piecewise", ladder=(2,), ranges=(2, 4), inference_mode=False,
        events=(Call(2, grad="inference", uniform=True, split=(1, 1), reqs=2),
                Call(2, grad="grad", opt=True, positional=True, split=(1, 1)))),
    # full seed 32: autocast switched on after a breakable capture under stock_torch_compile
    # with Inductor answered float32 where eager answers bfloat16 (a wrong answer): the pieces
    # Dynamo's autocast trace made hashed alike to the first trace's, and their Inductor code
    # (float32) was reused; the piece hash now holds autocast and the default dtype
    "inductor_autocast_after_a_breakable_capture": Case(
        seed=32, tier="full", model="py_state", path="plain", mode="stock_torch_compile",
        compiler="inductor", graph_mode="piecewise", ladder=(8,), breakable=True, events=(
            Call(3, grad="inference", fresh=True), Change("autocast_on", 7), Call(3))),
    # full seeds 168, 194, 221 (make fuzz on 80c71c0): torch.compile(backend="freezeframe",
    # dynamic=True) passes every Python float forward reads (an argument t, an attribute
    # norm.eps, a function's default) to its graph as a tensor from the first call on: a graph
    # step through the forward context was refused (CaptureError) at its first call; each
    # graph is now specialised on those values (compiled again for another value). One case
    # for the three: tests/unit/test_dynamo_backend.py checks every source of a number
    "scalar_argument_torch_compile_dynamic": Case(
        seed=168, tier="fast", model="timestep", path="torch_compile_dynamic",
        graph_mode="piecewise", ladder=(2,), events=(
            Call(1, via="context", fresh=True, opt=True, scalar=2),
            Call(1, via="context", scalar=1))),
    # full seed 165: verify=N compared a @dataclass output as one value (==), and the first
    # step raised torch's "Boolean value of Tensor ... is ambiguous"; verify, the graphs and
    # the runner now walk every output container one way (freezeframe.containers)
    "dataclass_output_verified": Case(
        seed=165, tier="fast", model="dataclass_out", path="runner", mode="stock_torch_compile",
        graph_mode="piecewise", ladder=(1, 8), breakable=True, dtype="float64", verify=2,
        events=(Call(6, grad="grad", fresh=True, positional=True),)),
    # full seed 192: a micro-batched uniform-decode step under FULL_DECODE_ONLY replayed its
    # split FULL graph without forward's self.last = out (the capture's stores are put back,
    # and a replay runs no Python); an eager split step left the last micro-batch's rows
    # there. Split steps now bind the whole step's output (runtime/ubatch/stores.py)
    "stored_output_micro_batched_full_decode_only": Case(
        seed=192, tier="fast", model="keeps_last", path="microbatch", mode="dynamo_trace_once",
        graph_mode="full_decode_only", ladder=(2,), events=(
            Call(2, grad="inference", uniform=True, split=(1, 1), reqs=2),)),
}


def test_found_the_health_check_blames_no_one_for_the_cases_own_torch_compile() -> None:
    """Full seed 47 of the old generator (make fuzz on main): after a torch_compile_dynamic
    case of MakesOnes, the health check's torch.compile(fullgraph=True) of the class hit
    Dynamo's recompile limit. The case's own calls (grad modes, default dtypes, sizes) fill the
    limit on the class's forward exactly as with backend="eager" (six entries either way, the
    same calls): a matrix bug. The health check now raises the limit where the case itself
    torch.compile'd the class, and still fails a case of another path whose class is full."""
    from tests.matrix.harness import Failure, health_check

    torch._dynamo.reset()
    try:
        # the class's forward filled to Dynamo's limit by torch.compile alone: each backend
        # (as each grad mode, default dtype, ... of the case) is an entry of its own
        module = models.build(SPECS["makes_ones"], 47)
        with torch.no_grad():
            for _ in range(torch._dynamo.config.recompile_limit):
                torch.compile(module, backend=lambda gm, example: gm.forward)(
                    torch.randn(3, models.H))
        with pytest.raises(Failure, match=r"health: after the case, torch\.compile"):
            health_check(Case(seed=47, tier="fast", model="makes_ones", path="plain"))
        health_check(Case(seed=47, tier="fast", model="makes_ones",
                          path="torch_compile_dynamic"))
    finally:
        torch._dynamo.reset()


def _found_params() -> list[object]:
    """Every found bug runs in make test, the full tier's too (a few seconds each): a
    regression must fail the suite CI runs, not only make fuzz."""
    return [pytest.param(name, id=name,
                         marks=[pytest.mark.inductor] if case.compiler == "inductor" else [])
            for name, case in FOUND.items()]


@pytest.mark.parametrize("name", _found_params())
def test_regression(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(FOUND[name], tmp_path, monkeypatch)


# -- the generator itself ------------------------------------------------------------------------
def test_cases_are_reproducible_from_their_seed() -> None:
    assert generate(7, "fast") == generate(7, "fast")
    assert generate(7, "full") == generate(7, "full")
    assert generate(7, "fast") != generate(8, "fast")


def test_every_drawn_configuration_is_valid() -> None:
    """Full seed 67 drew compile size 1 from its ladder [1, 2, 4, 8], then speculative decoding,
    which rounds the ladder to [2, 4, 8]: a ConfigError before its first call. Every seed of
    both tiers makes a config the library takes."""
    from tests.matrix.harness import make_config

    for tier, count in (("fast", FAST_SEEDS), ("full", FULL_SEEDS)):
        for seed in range(count):
            make_config(generate(seed, tier), None)


def test_the_fast_slice_covers_every_path_graph_mode_model_and_change() -> None:
    cases = [generate(seed, "fast") for seed in range(FAST_SEEDS)]
    seen = collections.defaultdict(set)
    for case in cases:
        for what in ("path", "graph_mode", "model", "policy", "mode", "warm", "compiler",
                     "dtype", "verify", "max_loras", "spec_tokens", "threads", "breakable"):
            seen[what].add(getattr(case, what))
        for event in case.events:
            if isinstance(event, Change):
                seen["change"].add(event.kind)
            elif isinstance(event, Call):
                seen["grad"].add(event.grad)
                seen["via"].add(event.via)
                seen["call"].update(f for f in ("cast", "extras", "threads", "scalar", "uniform",
                                                "positional", "fresh", "wait")
                                    if getattr(event, f))
                seen["call"].update(["lora"] if event.lora >= 0 else [])
        first = case.events[0]
        seen["first size"].add(first.size if isinstance(first, Call) else 0)
    from tests.matrix.cases import CHANGES

    assert seen["path"] == set(PATHS) - {"hf"}  # (Inductor and HF: named cases, make fuzz)
    assert seen["graph_mode"] == set(GRAPH_MODES)
    hf = {n for n in SPECS if n.startswith("hf_")}
    pending_models = {"dataclass_out"} if "dataclass_out" in PENDING_KINDS else set()
    assert seen["model"] == set(SPECS) - hf - pending_models
    assert seen["policy"] == {"eager", "lazy", "background"}
    assert seen["mode"] == {"piecewise", "dynamo_trace_once", "none", "stock_torch_compile"}
    assert seen["warm"] == {"", "inproc", "sibling"}
    assert seen["compiler"] == {"eager"}
    assert seen["dtype"] == {"", "float64", "bfloat16", "float16", "int32"}
    assert seen["verify"] == {0, 2}
    assert seen["max_loras"] == {0, 1, 2}
    assert seen["spec_tokens"] == {0, 1, 2}
    assert seen["threads"] == seen["breakable"] == {False, True}
    # every change, less those only a pending kind draws
    pending_changes = {"module_global": {"module_global", "restore_global"},
                       "hf_generation_config": {"gen_config"}}
    waiting = {k for kind, kinds in pending_changes.items() if kind in PENDING_KINDS
               for k in kinds}
    # (gen_config: an ff.hf change, drawn on the hf path alone, which the fast tier does not
    # draw; its named case, hf_generation_config, runs in make test)
    assert seen["change"] == set(CHANGES) - waiting - {"gen_config"}
    assert seen["grad"] == {"grad", "no_grad", "inference"}
    assert seen["via"] == {"", "plain", "context", "second_runner"}
    assert seen["call"] == {"cast", "extras", "threads", "scalar", "uniform", "positional",
                            "fresh", "lora", "wait"}
    assert 1 in seen["first size"]


# -- the floor ----------------------------------------------------------------------------------
# A call ending in a refusal checks less than one compared with eager, and a library that
# refuses too much would pass every seed: of the fast slice's calls, at least OVERALL are
# compared, and at least FLOOR in each group (per path, per compile mode, per cudagraph_mode;
# groups of MIN_CALLS calls or more); most runner cases run planned steps and replay graphs,
# most context cases replay. (The shares: python -m tests.matrix.shares; docs/results/.)
FLOOR = 0.6
OVERALL = 0.75
MIN_CALLS = 15
MOST = 0.5


def test_the_fast_slice_compares_most_calls_plans_and_replays(
        matrix_outcomes: dict[int, Any]) -> None:
    """Over the fast slice (the seeds this session ran, the others run here)."""
    if TIER != "fast":
        pytest.skip("the floor holds on the fast slice (FF_MATRIX=fast)")
    from tests.matrix import shares

    missing = [seed for seed in range(FAST_SEEDS) if seed not in matrix_outcomes]
    results, failures = shares.run_seeds("fast", missing)
    assert not failures, f"seeds failed: {failures}"
    results += [matrix_outcomes[seed] for seed in range(FAST_SEEDS) if seed in matrix_outcomes]
    low = []
    for name in ("path", "compile mode", "cudagraph_mode"):
        for key, t in shares.tallies(results, shares.GROUPS[name]).items():
            if t.calls >= MIN_CALLS and t.compared < FLOOR * t.calls:
                low.append(f"{name} {key}: {t.compared} of {t.calls} calls compared")
    assert not low, f"compared below the floor of {FLOOR:.0%}: {low}"
    calls = sum(len(o.records) for _, o in results)
    compared = sum(1 for _, o in results for r in o.records if not r.refused)
    assert compared >= OVERALL * calls, f"{compared} of {calls} calls compared"
    for what, (n, of) in shares.case_shares(results).items():
        assert n >= MOST * of, f"{what}: {n} of {of}"
