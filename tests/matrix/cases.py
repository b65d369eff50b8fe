"""Cases of the differential matrix, each derived from one integer seed.

A :class:`Case` is a model (models.py), a configuration, a *path* (how the compiled model is
called) and a sequence of events: calls of some batch size and grad mode, and *changes* made to
the module between calls (weights updated or replaced, hooks, train/eval, a dtype move,
autocast, attributes forward reads, ...). harness.py runs a case against eager PyTorch; the
oracle for every call is the same: the compiled path's answer (outputs, inputs written in
place, the module's state) equals eager's on the same inputs and the same (changed) module, or
the compiled path raises a ``FreezeframeError``. Nothing else: not a different answer, not a raw
exception from inside torch, not a process that cannot compile afterwards.

A call may also go another way than the case's path (``Call.via``): a plain call between runner
steps, a forward-context call, or a second runner on the same compiled model (made and captured
at its first call), whose graphs are its own.

Two tiers: ``fast`` (the slice ``make test`` runs: eager compiler, emulated graphs, in-process
warm starts) and ``full`` (``make fuzz``: also Inductor, Hugging Face models, warm starts in a
fresh subprocess). ``generate(seed, tier)`` is deterministic; ``describe(case)`` says what a case
does in words. ``python -m tests.matrix.cases SEED [TIER]`` prints it.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from typing import Any

from freezeframe.sizes import padded_size, round_sizes_for_spec_decode
from tests.matrix.models import SPECS, ModelSpec

Event = Any  # Call | Change | Serve | Generate

GRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
# how a case calls the compiled model
PATHS = ("plain", "context", "runner", "microbatch", "torch_compile", "torch_compile_dynamic",
         "serve", "hf")
FF_PATHS = ("plain", "context", "runner", "microbatch")
RUNNER_PATHS = ("runner", "microbatch")
# how a call may go: a path, or a second runner on the same compiled model (made and captured
# at its first call; graphs are kept per runner)
RUNNER_VIAS = (*RUNNER_PATHS, "second_runner")

# -- what waits for a library fix ------------------------------------------------------------
# Kinds of draws whose library fix (issue 42) is being made on another branch: the generator
# does not draw them while they are listed here, and each has a named strict-xfail case in
# test_matrix.py (OPEN) that shows the bug. The lead switches a kind on (removes it here, and
# moves its OPEN case to FOUND) after merging its fix.
PENDING_KINDS: tuple[str, ...] = ()
# every kind PENDING_KINDS may hold, in words (the item in brackets)
SWITCHED_KINDS: dict[str, str] = {
    "module_global": "a module-level global forward reads, changed (change module_global) "
                     "[item 2]",
    "tensor_attr_replaced_graphs": "a plain tensor attribute replaced in a case with graphs "
                                   "(change tensor_attr_replaced) [item 1]",
    "scalar_arg_breakable": "a Python scalar argument that changes on breakable graphs [3]",
    "class_attr_breakable": "a class attribute changed after a breakable capture [3]",
    "scalar_arg_stock_context": "a Python scalar argument that changes, torch.compile("
                                "backend='freezeframe') under a forward context [12]",
    "dataclass_out": "a model returning a plain @dataclass of tensors (model dataclass_out) "
                     "[4]",
    "verify_writes_input": "verify=N on a model that writes into its input [9a]",
    "verify_hooked": "verify=N with hooks on the compiled model [9b]",
    "hf_generation_config": "ff.hf with model.generation_config fields HF's generate honours "
                            "(change gen_config) [5]",
    "pre_hook_low_level": "a forward pre-hook returning new inputs on the low-level context "
                          "path (found by this matrix: the replay copies the hook's tensor "
                          "into the caller's captured buffer; no fix under way yet)",
    "hooks_micro_batch": "hooks on the compiled model, micro-batched FULL steps (found by this "
                         "matrix: the step skips them, a wrong answer)",
    "micro_batch_full_uniform": "a uniform-decode step, micro-batched, cudagraph_mode FULL "
                                "(found by this matrix: refused, no FULL graph captured for "
                                "its key)",
    "micro_batch_requests": "a model with a Requests input, micro-batched (found by this "
                            "matrix: a raw IndexError slicing it)",
    "capture_writes_attributes": "a model storing a tensor attribute in forward "
                                 "(self.last = out) under the lazy or background capture "
                                 "policy (found by this matrix: a capture's dummy step after "
                                 "a step leaves its output there)",
    "stored_output_rebound": "a model storing a tensor attribute in forward (self.last = out) "
                             "with runner or context calls of several routes (found by this "
                             "matrix: after a plain call, or a call of another trace, FULL "
                             "replays leave that call's tensor there)",
}


def drawn(kind: str) -> bool:
    """Whether the generator draws ``kind`` (one of SWITCHED_KINDS) now."""
    return kind not in PENDING_KINDS


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of ``size`` tokens (``via``: another path than the case's, e.g. a plain call
    between runner steps)."""

    size: int
    grad: str = "no_grad"  # "grad" | "no_grad" | "inference"
    via: str = ""
    fresh: bool = False  # context path: a new tensor instead of the persistent buffer
    opt: bool = False  # the Optional argument is given (a tensor, not None)
    kwarg: int = -1  # index into the spec's plain keyword arguments, -1: none passed
    positional: bool = False  # tensors passed positionally rather than by name
    uniform: bool = False  # runner: a uniform-decode step (one query per request)
    split: tuple[int, ...] = ()  # micro-batching: tokens per request
    scalar: int = 0  # which Python scalar values (models.TIMESTEPS) the call passes
    reqs: int = 0  # requests: num_reqs of a uniform step, the Requests input's rows
    cast: bool = False  # a float input given in another dtype than the model's (a mistake)
    lora: int = -1  # runner: has_lora=True with this many active adapters; -1: no LoRA
    extras: bool = False  # runner: extras= for the forward context
    threads: int = 0  # runner: the step made from this many threads at once (each its inputs)
    wait: bool = False  # runner: wait_for_capture() after the step, before it is compared


@dataclasses.dataclass(frozen=True)
class Change:
    """A change of the module between calls; ``target`` picks the parameter or submodule."""

    kind: str
    target: int = 0


@dataclasses.dataclass(frozen=True)
class Serve:
    """The reference Llama: one continuous-batching run of a request trace drawn from
    ``requests``."""

    requests: int


@dataclasses.dataclass(frozen=True)
class Generate:
    """A Hugging Face model: greedy ``generate`` of ``batch`` prompts."""

    batch: int
    prompt: int
    new: int


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    tier: str
    model: str
    path: str
    mode: str = "piecewise"
    compiler: str = "eager"
    graph_mode: str = "none"
    ladder: tuple[int, ...] = (1, 2, 4, 8)
    ranges: tuple[int, ...] = ()
    compile_sizes: tuple[int, ...] = ()
    policy: str = "eager"  # runner capture policy
    inference_mode: bool = True
    # "" | "inproc" | "subprocess": run the case twice on one compile cache; "sibling": a
    # sibling case (another seed's weights and attributes, same class) runs on the cache first
    warm: str = ""
    # mode "none" / "stock_torch_compile" split at the model's ops: breakable PIECEWISE graphs
    breakable: bool = False
    dtype: str = ""  # runner paths: the inputs' (and module's) dtype; "": float32 (long ids)
    verify: int = 0  # runner: GraphRunner(verify=N)
    max_loras: int = 0  # runner: config max_loras (LoRA graph keys)
    spec_tokens: int = 0  # runner: config num_speculative_tokens
    threads: bool = False  # runner: steps from several threads (copy_outputs=True)
    events: tuple[Event, ...] = ()

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.model]

    @property
    def split(self) -> bool:
        return (self.mode == "piecewise" or self.breakable) and bool(self.spec.splitting_ops)


# -- changes ---------------------------------------------------------------------------------
# what each change does, in words (the harness implements them)
CHANGES = {
    "scale_data": "p.data.mul_(2) on parameter #{t}",
    "add_no_grad": "with torch.no_grad(): p.add_(0.25) on parameter #{t}",
    "replace_param": "parameter #{t} replaced: owner.name = nn.Parameter(new values)",
    "p_data_assign": "parameter #{t}: p.data = a new tensor",
    "bias_none": "Linear #{t}: .bias = None",
    "load_state_dict_assign": "load_state_dict(new values, assign=True)",
    "load_state_dict": "load_state_dict(new values) (copied in place)",
    "register_buffer": "submodule #{t}.register_buffer('extra', ones)",
    "swap_submodule": "Linear #{t} replaced by a new nn.Linear of the same shape",
    "train": "module.train()",
    "eval": "module.eval()",
    "hook_model_fwd": "forward hook on the compiled model: every output tensor * 2 + 1",
    "hook_model_pre": "forward pre-hook (with_kwargs) on the compiled model: float inputs * 0.5",
    "hook_root_fwd": "forward hook on the module itself (the root): outputs * 2 + 1",
    "hook_sub_fwd": "forward hook on submodule #{t} (the root if it has none): outputs * 2 + 1",
    "remove_hook": "the most recent hook removed",
    "to_float64": "module.to(torch.float64), float inputs float64 from now on",
    "to_float32": "module.to(torch.float32), float inputs float32 again",
    "autocast_on": "calls from now on under torch.autocast('cpu', dtype=torch.bfloat16)",
    "autocast_off": "calls from now on without autocast",
    "default_dtype64": "calls from now on under torch.set_default_dtype(torch.float64)",
    "default_dtype32": "calls from now on under the default dtype float32",
    "class_attr": "type(module).OFFSET = 2.5 (a class attribute forward reads)",
    "restore_class_attr": "type(module).OFFSET = 1.0 again (its traced value)",
    "instance_attr": "module.scale = 3.0 (forward reads it; elsewhere a new attribute)",
    "restore_attr": "module.scale = 2.0 again (elsewhere the new attribute deleted)",
    "equal_attr": "module.scale set to an equal new float object",
    "module_global": "models.GAIN = 3.0 (a module-level global forward reads)",
    "restore_global": "models.GAIN = 1.5 again",
    "tensor_attr_replaced": "module.gain = a new tensor (a plain tensor attribute replaced)",
    "tensor_attr_inplace": "module.gain.mul_(1.5) (a plain tensor attribute changed in place)",
    "fault": "the next call's ffmatrix::mix raises once (eagerly too): the call raises it, "
             "leaves nothing behind, and later calls answer",
    "gen_config": "model.generation_config: repetition_penalty=1.3, no_repeat_ngram_size=2",
}
PARAM_CHANGES = ("scale_data", "add_no_grad", "replace_param", "p_data_assign",
                 "load_state_dict_assign", "load_state_dict")
NO_PARAMS = ("silly", "sandwich", "outer", "keeps_last")
# a change the guarantees refuse, and the change that takes it back (the calls between are
# refused; the ones after it are compared again)
UNDO = {"hook_model_fwd": "remove_hook", "hook_model_pre": "remove_hook",
        "hook_root_fwd": "remove_hook", "hook_sub_fwd": "remove_hook",
        "autocast_on": "autocast_off", "default_dtype64": "default_dtype32", "train": "eval",
        "instance_attr": "restore_attr", "class_attr": "restore_class_attr",
        "to_float64": "to_float32", "module_global": "restore_global"}
# refused for good (in the traced modes): drawn only in a case's last third
FINAL = ("bias_none", "register_buffer", "swap_submodule")
MIX_MODELS = ("optional_kwargs", "dict_out", "tuple_out", "branches", "makes_ones", "timestep",
              "dataclass_out", "namedtuple_out", "nested_out", "per_request")


def _change_kinds(case: Case) -> list[str]:
    name, path = case.model, case.path
    if path == "serve":
        return [*PARAM_CHANGES, "hook_model_fwd", "remove_hook", "hook_sub_fwd"]
    if path == "hf":
        kinds = ["scale_data", "add_no_grad", "replace_param", "p_data_assign",
                 "load_state_dict"]
        return kinds + (["gen_config"] * 2 if drawn("hf_generation_config") else [])
    kinds = ["train", "hook_sub_fwd", "instance_attr", "equal_attr", "autocast_on",
             "hook_root_fwd"]
    if name not in NO_PARAMS:
        kinds += [*PARAM_CHANGES, "register_buffer", "swap_submodule", "bias_none",
                  "to_float64", "to_float64"]
    hooks_allowed = path != "microbatch" or drawn("hooks_micro_batch")
    if path in FF_PATHS and not (case.verify and not drawn("verify_hooked")) and hooks_allowed:
        kinds += ["hook_model_fwd"]
        if path != "context" or drawn("pre_hook_low_level"):
            kinds += ["hook_model_pre"]
    # the changes only these models notice, drawn as often as all the others together
    special: list[str] = []
    if name == "reads_attrs" and (drawn("class_attr_breakable") or not case.breakable):
        special = ["class_attr"]
    if name == "makes_ones":
        special = ["default_dtype64"]
    if name == "reads_global" and drawn("module_global"):
        special = ["module_global"]
    if name == "tensor_attr":
        replaced = drawn("tensor_attr_replaced_graphs") or case.graph_mode == "none" \
            or path == "plain"  # (plain calls replay no graph)
        special = ["tensor_attr_inplace"] + (["tensor_attr_replaced"] if replaced else [])
    kinds += special * (len(kinds) // max(1, len(special)))
    if name in MIX_MODELS and case.split and case.graph_mode in ("none", "piecewise") \
            and case.policy != "background" and not case.threads:
        # (a FULL graph's replay runs no Python: nothing would raise; a background capture
        # would meet the fault in its own thread)
        kinds += ["fault"] * 3
    if path in RUNNER_PATHS:  # the runner's inputs are of one dtype: no dtype move there
        kinds = [k for k in kinds if k != "to_float64"]
    if path.startswith("torch_compile"):
        # Dynamo does not guard on hooks added after it compiled (torch._dynamo.config.
        # skip_nnmodule_hook_guards): torch.compile(backend="eager") ignores them too
        kinds = [k for k in kinds if not k.startswith("hook_")]
    return kinds


# -- the generator ---------------------------------------------------------------------------
def generate(seed: int, tier: str = "fast") -> Case:
    """The case of ``seed`` in ``tier`` ("fast" or "full")."""
    rng = random.Random(f"{tier}:{seed}")
    full = tier == "full"
    path = _path(rng, full)
    # the seeds before this one whose path draws from the same models (a runner's, or any
    # model's): those models in turn
    kind = path in RUNNER_PATHS
    turn = sum(1 for s in range(seed)
               if (_path(random.Random(f"{tier}:{s}"), full) in RUNNER_PATHS) == kind)
    model = _model(turn, path)
    case = Case(seed=seed, tier=tier, model=model, path=path)
    case = _config(rng, case, full)
    case = _runner_options(rng, case)
    events = _events(rng, case, full)
    return dataclasses.replace(case, events=tuple(events))


def _path(rng: random.Random, full: bool) -> str:
    """A case's path: the first draw of its seed's generator."""
    paths = {"plain": 2, "context": 3, "runner": 4, "microbatch": 1, "torch_compile": 1,
             "torch_compile_dynamic": 1, "serve": 1, "hf": 1 if full else 0}
    return rng.choices(list(paths), weights=list(paths.values()))[0]


def _model(seed: int, path: str) -> str:
    """In turn (``seed``: the case's turn among the seeds from 0 whose paths draw from the
    same models), so that the seeds from 0 cover the models one after another."""
    if path == "serve":
        return "llama"
    if path == "hf":
        return ["hf_llama", "hf_qwen2", "hf_gpt2"][seed % 3]
    names = [n for n, s in SPECS.items() if not s.served
             and (n != "dataclass_out" or drawn("dataclass_out"))]
    if path in RUNNER_PATHS:
        names = [n for n in names if SPECS[n].row_independent and SPECS[n].runner_inputs]
    if path == "microbatch" and not drawn("micro_batch_requests"):
        names = [n for n in names if not SPECS[n].requests]
    if path == "context":
        names = [n for n in names if SPECS[n].context]
    return names[seed % len(names)]


def _config(rng: random.Random, case: Case, full: bool) -> Case:
    path = case.path
    changes: dict[str, Any] = {}
    if path in ("torch_compile", "torch_compile_dynamic"):
        changes["mode"] = rng.choice(["piecewise", "piecewise", "dynamo_trace_once"])
    elif path in FF_PATHS:
        changes["mode"] = rng.choices(["piecewise", "dynamo_trace_once", "none",
                                       "stock_torch_compile"], weights=[6, 2, 1, 2])[0]
        changes["inference_mode"] = rng.random() > 0.25
        if rng.random() < 0.25 and full:  # (the fast slice: in its named cases only)
            changes["compiler"] = "inductor"
        if path != "microbatch" and rng.random() < (0.15 if full else 0.1):
            changes["warm"] = rng.choice(["subprocess" if full else "inproc", "sibling"])
        if path in RUNNER_PATHS:
            changes["policy"] = rng.choice(["eager", "eager", "eager", "lazy", "background"])
            if case.model == "keeps_last" and not drawn("capture_writes_attributes"):
                changes["policy"] = "eager"
    elif full and path in ("serve", "hf") and rng.random() < 0.2:
        changes["compiler"] = "inductor"
        if path == "serve" and random.Random(f"{case.tier}:{case.seed}:warm").random() < 0.5:
            changes["warm"] = "inproc"  # served twice: the second on a warm Inductor cache
    case = dataclasses.replace(case, **changes)
    split = case.split or path in ("serve", "hf")
    modes = list(GRAPH_MODES) if split else ["none", "full", "full_decode_only"]
    if path in ("torch_compile", "torch_compile_dynamic"):
        modes = ["none", "piecewise", "full"] if split else ["none", "full"]
    if path == "hf":
        modes = ["none", "piecewise", "full", "full_and_piecewise"]
    if case.mode == "stock_torch_compile":
        modes = ["none", "full"]
    # runner and context cases replay graphs: without graphs only now and then
    weights = [0.4 if m == "none" and path in ("runner", "context") else 1.0 for m in modes]
    graph_mode = rng.choices(modes, weights=weights)[0]
    if case.model == "keeps_last" and case.mode in ("none", "stock_torch_compile") \
            and graph_mode != "none" and rng.random() < 0.7:
        # (every capture of its forward is refused there: seldom, not never)
        case = dataclasses.replace(case, mode="piecewise")
    # (drawn from a stream of their own, so that adding them changed no other case)
    alt = random.Random(f"{case.tier}:{case.seed}:breakable")
    if case.mode in ("none", "stock_torch_compile") and path in FF_PATHS and \
            case.spec.splitting_ops and alt.random() < 0.5:
        case = dataclasses.replace(case, breakable=True)
        graph_mode = alt.choice(["piecewise", "piecewise", "full_and_piecewise"])
    ladder = tuple(sorted(rng.sample([1, 2, 4, 8], rng.randint(1, 4))))
    if path in ("serve", "hf"):
        ladder = tuple(sorted({*ladder, 8}))
    elif path in ("runner", "context") and rng.random() < 0.7:
        ladder = tuple(sorted({*ladder, 8}))  # room for sizes that replay
    ranges: tuple[int, ...] = ()
    if case.mode == "piecewise" and case.split and rng.random() < 0.3:
        ranges = tuple(sorted(rng.sample([2, 4], rng.randint(1, 2))))
    sizes: tuple[int, ...] = ()
    if path in FF_PATHS and case.compiler == "eager" and rng.random() < 0.2:
        sizes = tuple(sorted(rng.sample(ladder, 1)))
    return dataclasses.replace(case, graph_mode=graph_mode, ladder=ladder, ranges=ranges,
                               compile_sizes=sizes)


def _runner_options(rng: random.Random, case: Case) -> Case:
    """The runner's inputs' dtype, verify, LoRA, speculative decoding and threads (drawn from
    a stream of their own)."""
    if case.path not in RUNNER_PATHS:
        return case
    alt = random.Random(f"{case.tier}:{case.seed}:runner")
    spec, changes = case.spec, {}
    if alt.random() < (0.35 if spec.float_inputs else 0.5) and case.compiler == "eager":
        changes["dtype"] = alt.choice(["float64", "bfloat16", "float16"]) \
            if spec.float_inputs else "int32"
    if case.path == "runner":
        if alt.random() < 0.25 and case.graph_mode != "none" and (
                case.model != "makes_ones" or drawn("verify_writes_input")):
            changes["verify"] = 2
        if alt.random() < 0.2 and case.graph_mode != "none":
            changes["max_loras"] = alt.choice([1, 2])
        if alt.random() < 0.15 and case.graph_mode != "none":
            spec_tokens = changes["spec_tokens"] = alt.choice([1, 2])
            if case.compile_sizes:  # (full seed 67: compile size 1, capture sizes [2, 4, 8])
                changes["compile_sizes"] = _spec_compile_sizes(case, spec_tokens)
        if alt.random() < 0.12:
            changes["threads"] = True
    return dataclasses.replace(case, **changes)


def _spec_compile_sizes(case: Case, spec_tokens: int) -> tuple[int, ...]:
    """A case's compile sizes under speculative decoding: the config rounds its capture sizes
    up to multiples of the decode query length (1 + ``spec_tokens``), so each compile size,
    drawn from the ladder, is the capture size it pads to as rounded (a size padded to another
    is a ConfigError: its code would never run under a graph)."""
    ladder = round_sizes_for_spec_decode(case.ladder, 1 + spec_tokens, max(case.ladder))
    return tuple(sorted({size for s in case.compile_sizes
                         if (size := padded_size(s, ladder)) is not None}))


# the changes only some models notice (or only some configurations allow): a case that may
# draw one draws it first, most of the time
SPECIAL = ("class_attr", "default_dtype64", "module_global", "tensor_attr_inplace",
           "tensor_attr_replaced", "fault")


def _change(rng: random.Random, kinds: list[str], late: bool, first: bool = False) -> Change:
    special = [k for k in kinds if k in SPECIAL]
    if first and special and rng.random() < 0.7:
        return Change(rng.choice(special), rng.randint(0, 7))
    final = [k for k in kinds if k in FINAL]
    if late and final and rng.random() < 0.3:  # (the last calls of a case meet them)
        return Change(rng.choice(final), rng.randint(0, 7))
    choices = [k for k in kinds if k not in FINAL] or kinds
    return Change(rng.choice(choices), rng.randint(0, 7))


def _events(rng: random.Random, case: Case, full: bool) -> list[Event]:
    count = rng.randint(3, 10 if full else 7)
    if case.path == "serve":
        return _serve_events(rng, case, max(2, count // 2))
    if case.path == "hf":
        return _hf_events(rng, case, max(2, count // 2))
    kinds = _change_kinds(case)
    events: list[Event] = []
    last: Call | None = None
    undo: str | None = None
    burst = _burst(rng, case)
    for i in range(count + burst):
        if i < burst:  # a runner case opens with steps of one shape: the first ones plan
            call = _call(rng, case, first=i == 0)
            call = dataclasses.replace(call, via="", positional=call.positional or
                                       case.path == "runner", lora=-1, extras=False,
                                       threads=0)
            if case.path == "runner" and case.graph_mode == "full_decode_only":
                # (only a uniform decode step has a graph there)
                query = 1 + case.spec_tokens
                reqs = max(1, min(call.size, max(case.ladder)) // query)
                call = dataclasses.replace(call, uniform=True, reqs=reqs, size=reqs * query)
            if last is not None:
                call = dataclasses.replace(_again(rng, case, call, last), cast=False)
            events.append(call)
            last = events[-1]
            continue
        if i > 0 and undo is not None and rng.random() < 0.75:
            events.append(Change(undo))
            undo = None
        elif i > 0 and rng.random() < 0.4:
            change = _change(rng, kinds, late=i >= count * 2 // 3,
                             first=not any(isinstance(e, Change) for e in events))
            events.append(change)
            undo = UNDO.get(change.kind, undo)
        call = _call(rng, case, first=i == 0)
        if last is not None and rng.random() < 0.6:  # the same shape again: a planned step
            call = _again(rng, case, call, last)
        events.append(call)
        last = call
    return events


def _burst(rng: random.Random, case: Case) -> int:
    """How many calls of one shape a runner or context case opens with (0: none): enough for
    the last to run from its plan after the verified steps and the steps before a lazy
    capture; on the context path, for a replay after the call that traces and the one that
    captures."""
    if case.path not in ("runner", "context") or rng.random() > 0.9:
        return 0
    if case.path == "context":
        return 3
    return 2 + case.verify + (case.policy != "eager") + (case.policy == "background")


def _again(rng: random.Random, case: Case, call: Call, last: Call) -> Call:
    """``call`` made a step of ``last``'s shape: on a runner, as a plannable step (inputs by
    position, no option a plan does not cover) most of the time, sometimes with an input of
    the wrong dtype (which the plan must refuse as the first step did)."""
    same = dict(size=last.size, split=last.split, uniform=last.uniform, reqs=last.reqs)
    if case.path in RUNNER_PATHS:  # (a plain step of last's shape: plannable if last was)
        same.update(positional=last.positional, lora=last.lora, extras=last.extras,
                    threads=last.threads,
                    cast=rng.random() < 0.12 and case.spec.float_inputs and not call.via)
    if case.path == "context":
        same.update(positional=last.positional, kwarg=last.kwarg, opt=last.opt)
    return dataclasses.replace(call, **same)


def _size(rng: random.Random, case: Case, first: bool) -> int:
    if first and rng.random() < 0.35:
        return 1
    if case.path in ("runner", "microbatch", "context") and rng.random() < 0.85:
        return rng.randint(1, max(case.ladder))  # a size with a graph
    return rng.randint(1, 12)


def _call(rng: random.Random, case: Case, *, first: bool) -> Call:
    spec = case.spec
    size = _size(rng, case, first)
    grads = ["no_grad", "inference", "grad"]
    via = ""
    if case.path in ("runner", "microbatch", "context"):
        draw = rng.random()
        if draw < 0.12:
            via = "plain"
        elif case.path in RUNNER_PATHS and draw < 0.22:
            via = "second_runner"
    if case.model == "keeps_last" and case.path in (*RUNNER_PATHS, "context") \
            and not drawn("stored_output_rebound"):
        via = ""  # (and one grad mode below: one route, one trace)
    if case.path.startswith("torch_compile") and case.graph_mode != "none" and \
            rng.random() < 0.6 and (_scalars_change(case) or not _python_scalars(spec)):
        via = "context"  # (a Python float argument there waits for a fix: PENDING_KINDS)
    uniform = case.path in RUNNER_PATHS and rng.random() < 0.4
    if case.path == "microbatch" and case.graph_mode == "full" \
            and not drawn("micro_batch_full_uniform"):
        uniform = False
    split: tuple[int, ...] = ()
    reqs = 0
    if uniform:
        query = 1 + case.spec_tokens
        reqs = max(1, size // query)
        size = reqs * query
    elif spec.requests:
        reqs = rng.randint(1, size)
    if case.path == "microbatch":
        size = max(size, 2)
        reqs = size if uniform else reqs
        split = (1,) * size if uniform else _partition(rng, size)
    kwarg = rng.randrange(len(spec.kwargs)) if spec.kwargs and rng.random() < 0.5 else -1
    if not _scalars_change(case):
        kwarg = -1  # (a keyword argument is a Python scalar that changes)
    grad = rng.choice(grads)
    if case.model == "keeps_last" and case.path in (*RUNNER_PATHS, "context") \
            and not drawn("stored_output_rebound"):
        grad = "no_grad"
    call = Call(size=size, grad=grad, via=via, fresh=rng.random() < 0.4,
                opt=rng.random() < 0.5, kwarg=kwarg, positional=rng.random() < 0.3,
                uniform=uniform, split=split, scalar=_scalar(rng, case), reqs=reqs)
    if case.path in RUNNER_PATHS and rng.random() > 0.7:  # step options a plan does not cover
        call = dataclasses.replace(
            call, positional=rng.random() < 0.5,
            lora=rng.randint(0, case.max_loras) if case.max_loras and rng.random() < 0.6
            else -1,
            extras=rng.random() < 0.4, threads=2 if case.threads and rng.random() < 0.6 else 0)
    elif case.path in RUNNER_PATHS:  # a plain step, its inputs mostly by position (a step
        # by keyword is not planned today; the plans of both are checked once it is)
        call = dataclasses.replace(call, positional=rng.random() < 0.75)
    if case.policy == "background" and rng.random() < 0.3:
        call = dataclasses.replace(call, wait=True)
    return call


def _python_scalars(spec: ModelSpec) -> bool:
    """Whether the model's forward takes a Python scalar argument (default values included)."""
    return spec.scalars or bool(spec.kwargs)


def _scalars_change(case: Case) -> bool:
    """Whether the Python scalars a call passes may change from call to call: not where that
    waits for a library fix (PENDING_KINDS)."""
    if case.breakable and not drawn("scalar_arg_breakable"):
        return False
    return not (case.path.startswith("torch_compile") and case.graph_mode != "none"
                and not drawn("scalar_arg_stock_context"))


def _scalar(rng: random.Random, case: Case) -> int:
    """Which Python scalar values a call passes (models.TIMESTEPS)."""
    if not case.spec.scalars or not _scalars_change(case):
        return 0
    return rng.randrange(4)


def _partition(rng: random.Random, n: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1))))
    bounds = [0, *cuts, n]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def _serve_events(rng: random.Random, case: Case, count: int) -> list[Event]:
    kinds = _change_kinds(case)
    events: list[Event] = [Serve(rng.randint(0, 10**6))]
    for _ in range(count - 1):
        if rng.random() < 0.6:
            events.append(Change(rng.choice(kinds), rng.randint(0, 7)))
        events.append(Serve(rng.randint(0, 10**6)))
    return events


def _hf_events(rng: random.Random, case: Case, count: int) -> list[Event]:
    kinds = _change_kinds(case)
    events: list[Event] = []
    for i in range(count):
        if i > 0 and rng.random() < 0.5:
            events.append(Change(rng.choice(kinds), rng.randint(0, 7)))
        events.append(Generate(rng.choice([1, 2, 3, 5, 8]), rng.randint(1, 6),
                               rng.randint(2, 4)))
    return events


# -- words -----------------------------------------------------------------------------------
def describe_event(event: Event) -> str:
    if isinstance(event, Change):
        return "change: " + CHANGES[event.kind].format(t=event.target)
    if isinstance(event, Serve):
        return f"serve the request trace drawn from {event.requests}"
    if isinstance(event, Generate):
        return (f"generate: {event.batch} prompt(s) of {event.prompt} token(s), "
                f"{event.new} new token(s)")
    words = [f"call of {event.size} token(s)", f"grad mode {event.grad}"]
    if event.via:
        words.append(f"via the {event.via} path")
    if event.fresh:
        words.append("a fresh input tensor")
    if event.opt:
        words.append("the Optional argument given")
    if event.kwarg >= 0:
        words.append(f"keyword argument #{event.kwarg}")
    if event.positional:
        words.append("tensors positional")
    if event.uniform:
        words.append("uniform decode")
    if event.split:
        words.append(f"requests of {list(event.split)} tokens")
    if event.reqs:
        words.append(f"{event.reqs} request(s)")
    if event.scalar:
        words.append(f"Python scalars #{event.scalar}")
    if event.cast:
        words.append("a float input in another dtype than the model's (refused or raised)")
    if event.lora >= 0:
        words.append(f"has_lora=True, {event.lora} active adapter(s)")
    if event.extras:
        words.append("extras= given")
    if event.threads:
        words.append(f"from {event.threads} threads at once")
    if event.wait:
        words.append("then runner.wait_for_capture()")
    return ", ".join(words)


def describe(case: Case) -> str:
    spec = case.spec
    lines = [
        f"seed {case.seed} (tier {case.tier}): model {case.model}"
        + (f" ({spec.note})" if spec.note else ""),
        f"  config: mode={case.mode} compiler={case.compiler} cudagraph_mode={case.graph_mode}"
        f" graph_backend=emulated capture sizes={list(case.ladder)}"
        f" splitting_ops={list(spec.splitting_ops) if case.split else None}"
        f" compile_ranges_endpoints={list(case.ranges)} compile_sizes={list(case.compile_sizes)}"
        f" inference_mode={case.inference_mode}"
        + (" (breakable graphs)" if case.breakable else ""),
        f"  path: {case.path}"
        + (f" (capture_policy={case.policy})" if case.path in RUNNER_PATHS else "")
        + (f", inputs of dtype {case.dtype}" if case.dtype else "")
        + (f", verify={case.verify}" if case.verify else "")
        + (f", max_loras={case.max_loras}" if case.max_loras else "")
        + (f", num_speculative_tokens={case.spec_tokens}" if case.spec_tokens else "")
        + (", steps from several threads (copy_outputs=True)" if case.threads else "")
        + (f", run twice on one compile cache ({case.warm} warm start)"
           if case.warm in ("inproc", "subprocess") else "")
        + (", on a compile cache a sibling case (another seed) filled first"
           if case.warm == "sibling" else ""),
        "  events:",
    ]
    lines += [f"    {i + 1}. {describe_event(e)}" for i, e in enumerate(case.events)]
    return "\n".join(lines)


def rerun_command(case: Case) -> str:
    return (f"FF_MATRIX={case.tier} FF_MATRIX_SEED={case.seed} .venv/bin/python -m pytest "
            f"tests/matrix -k test_seed")


if __name__ == "__main__":  # python -m tests.matrix.cases SEED [TIER]
    print(describe(generate(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "fast")))
