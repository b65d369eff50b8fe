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
    uniform: bool = False  # runner: a uniform-decode step (one token per request)
    split: tuple[int, ...] = ()  # micro-batching: tokens per request


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
    warm: str = ""  # "" | "inproc" | "subprocess": run the case twice on one compile cache
    # mode "none" / "stock_torch_compile" split at the model's ops: breakable PIECEWISE graphs
    breakable: bool = False
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
    "autocast_on": "calls from now on under torch.autocast('cpu', dtype=torch.bfloat16)",
    "autocast_off": "calls from now on without autocast",
    "default_dtype64": "calls from now on under torch.set_default_dtype(torch.float64)",
    "default_dtype32": "calls from now on under the default dtype float32",
    "class_attr": "type(module).OFFSET = 2.5 (a class attribute forward reads)",
    "instance_attr": "module.scale = 3.0 (forward reads it; elsewhere a new attribute)",
    "equal_attr": "module.scale set to an equal new float object",
}
PARAM_CHANGES = ("scale_data", "add_no_grad", "replace_param", "p_data_assign",
                 "load_state_dict_assign", "load_state_dict")
NO_PARAMS = ("silly", "sandwich", "outer", "keeps_last")


def _change_kinds(case: Case) -> list[str]:
    name, path = case.model, case.path
    if path == "serve":
        return [*PARAM_CHANGES, "hook_model_fwd", "remove_hook", "hook_sub_fwd"]
    if path == "hf":
        return ["scale_data", "add_no_grad", "replace_param", "p_data_assign", "load_state_dict"]
    kinds = ["train", "eval", "hook_sub_fwd", "remove_hook", "instance_attr", "equal_attr",
             "autocast_on", "autocast_off", "hook_root_fwd"]
    if name not in NO_PARAMS:
        kinds += [*PARAM_CHANGES, "register_buffer", "swap_submodule", "bias_none", "to_float64"]
    if path in FF_PATHS:
        kinds += ["hook_model_fwd", "hook_model_pre"]
    # the changes only these models notice, drawn as often as all the others together
    if name == "reads_attrs":
        kinds += ["class_attr"] * len(kinds)
    if name == "makes_ones":
        kinds += ["default_dtype64", "default_dtype32"] * len(kinds)
    if path in RUNNER_PATHS:  # the runner's inputs are float32 Tokens: no dtype move there
        kinds = [k for k in kinds if k != "to_float64"]
    if path.startswith("torch_compile"):
        # Dynamo does not guard on hooks added after it compiled (torch._dynamo.config.
        # skip_nnmodule_hook_guards): torch.compile(backend="eager") ignores them too
        kinds = [k for k in kinds if not k.startswith("hook_") and k != "remove_hook"]
    return kinds


# -- the generator ---------------------------------------------------------------------------
def generate(seed: int, tier: str = "fast") -> Case:
    """The case of ``seed`` in ``tier`` ("fast" or "full")."""
    rng = random.Random(f"{tier}:{seed}")
    full = tier == "full"
    paths = {"plain": 2, "context": 3, "runner": 4, "microbatch": 1, "torch_compile": 1,
             "torch_compile_dynamic": 1, "serve": 1}
    if full:
        paths["hf"] = 1
    path = rng.choices(list(paths), weights=list(paths.values()))[0]
    model = _model(seed, path)
    case = Case(seed=seed, tier=tier, model=model, path=path)
    case = _config(rng, case, full)
    events = _events(rng, case, full)
    return dataclasses.replace(case, events=tuple(events))


def _model(seed: int, path: str) -> str:
    """In turn by seed, so that any run of consecutive seeds covers every model."""
    if path == "serve":
        return "llama"
    if path == "hf":
        return ["hf_llama", "hf_qwen2", "hf_gpt2"][seed % 3]
    names = [n for n, s in SPECS.items() if not s.served]
    if path in RUNNER_PATHS:
        names = [n for n in names if SPECS[n].row_independent]
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
        if full and rng.random() < 0.25:
            changes["compiler"] = "inductor"
        if path != "microbatch" and rng.random() < (0.15 if full else 0.08):
            changes["warm"] = "subprocess" if full else "inproc"
        if path in RUNNER_PATHS:
            changes["policy"] = rng.choice(["eager", "eager", "lazy", "background"])
    elif full and path in ("serve", "hf") and rng.random() < 0.2:
        changes["compiler"] = "inductor"
    case = dataclasses.replace(case, **changes)
    split = case.split or path in ("serve", "hf")
    modes = list(GRAPH_MODES) if split else ["none", "full", "full_decode_only"]
    if path in ("torch_compile", "torch_compile_dynamic"):
        modes = ["none", "piecewise", "full"] if split else ["none", "full"]
    if path == "hf":
        modes = ["none", "piecewise", "full", "full_and_piecewise"]
    if case.mode == "stock_torch_compile":
        modes = ["none", "full"]
    graph_mode = rng.choice(modes)
    # (drawn from a stream of their own, so that adding them changed no other case)
    alt = random.Random(f"{case.tier}:{case.seed}:breakable")
    if case.mode in ("none", "stock_torch_compile") and path in FF_PATHS and \
            case.spec.splitting_ops and alt.random() < 0.5:
        case = dataclasses.replace(case, breakable=True)
        graph_mode = alt.choice(["piecewise", "piecewise", "full_and_piecewise"])
    ladder = tuple(sorted(rng.sample([1, 2, 4, 8], rng.randint(1, 4))))
    if path in ("serve", "hf"):
        ladder = tuple(sorted({*ladder, 8}))
    ranges: tuple[int, ...] = ()
    if case.mode == "piecewise" and case.split and rng.random() < 0.3:
        ranges = tuple(sorted(rng.sample([2, 4], rng.randint(1, 2))))
    sizes: tuple[int, ...] = ()
    if path in FF_PATHS and case.compiler == "eager" and rng.random() < 0.2:
        sizes = tuple(sorted(rng.sample(ladder, 1)))
    return dataclasses.replace(case, graph_mode=graph_mode, ladder=ladder, ranges=ranges,
                               compile_sizes=sizes)


def _events(rng: random.Random, case: Case, full: bool) -> list[Event]:
    count = rng.randint(3, 10 if full else 7)
    if case.path == "serve":
        return _serve_events(rng, case, max(2, count // 2))
    if case.path == "hf":
        return _hf_events(rng, case, max(2, count // 2))
    kinds = _change_kinds(case)
    events: list[Event] = []
    last: Call | None = None
    for i in range(count):
        if i > 0 and rng.random() < 0.35:
            events.append(Change(rng.choice(kinds), rng.randint(0, 7)))
        call = _call(rng, case, first=i == 0)
        if last is not None and rng.random() < 0.3:  # the same shape again: a planned step
            call = dataclasses.replace(call, size=last.size, split=last.split,
                                       uniform=last.uniform)
        events.append(call)
        last = call
    return events


def _call(rng: random.Random, case: Case, *, first: bool) -> Call:
    spec = case.spec
    size = 1 if first and rng.random() < 0.35 else rng.randint(1, 12)
    grads = ["no_grad", "inference", "grad"]
    via = ""
    if case.path in ("runner", "microbatch", "context"):
        draw = rng.random()
        if draw < 0.15:
            via = "plain"
        elif case.path in RUNNER_PATHS and draw < 0.27:
            via = "second_runner"
    if case.path.startswith("torch_compile") and case.graph_mode != "none" and \
            rng.random() < 0.6:
        via = "context"
    uniform = case.path in RUNNER_PATHS and rng.random() < 0.4
    split: tuple[int, ...] = ()
    if case.path == "microbatch":
        size = max(size, 2)
        split = (1,) * size if uniform else _partition(rng, size)
    kwarg = rng.randrange(len(spec.kwargs)) if spec.kwargs and rng.random() < 0.5 else -1
    return Call(size=size, grad=rng.choice(grads), via=via, fresh=rng.random() < 0.4,
                opt=rng.random() < 0.5, kwarg=kwarg,
                positional=rng.random() < 0.3, uniform=uniform, split=split)


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
        + (f", run twice on one compile cache ({case.warm} warm start)" if case.warm else ""),
        "  events:",
    ]
    lines += [f"    {i + 1}. {describe_event(e)}" for i, e in enumerate(case.events)]
    return "\n".join(lines)


def rerun_command(case: Case) -> str:
    return (f"FF_MATRIX={case.tier} FF_MATRIX_SEED={case.seed} .venv/bin/python -m pytest "
            f"tests/matrix -k seed")


if __name__ == "__main__":  # python -m tests.matrix.cases SEED [TIER]
    print(describe(generate(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "fast")))
