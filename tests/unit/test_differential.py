"""A differential test that finds the next wrong answer: random small models, random configs
and random call sequences, every result compared with the same model run eagerly.

Models (``Zoo``) mix what broke freezeframe before: an optional tensor argument, a buffer
updated in forward, an input written in place, a Python branch on a module attribute and one
on the batch size, zero to two calls of a splitting op. Configs draw the compile mode, the
graph mode (emulated graphs), the capture ladder and compile ranges. Calls draw the batch size
(on, between and beyond the ladder, size 1 first), the path (a plain call, the low-level
forward context with a padded input, a ``GraphRunner`` step), grad mode, whether a step passes
the persistent buffer or a new tensor, and injected faults. The oracle: outputs, inputs written
in place and buffers equal an eager copy fed the same inputs, or the call raises a freezeframe
error; anything else fails. Bounded (a fixed number of derandomized examples, eager compiler
only) so it runs in CI in about a minute.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import freezeframe as ff
from freezeframe.errors import FreezeframeError

H = 4
SPLIT = "difftest::mix"


class _Fault:
    """Armed, the splitting op raises once (it runs eagerly, between captured pieces)."""

    armed = False
    lock = threading.Lock()

    @classmethod
    def check(cls) -> None:
        with cls.lock:
            if cls.armed:
                cls.armed = False
                raise InjectedFault("injected in the splitting op")


class InjectedFault(RuntimeError):
    pass


@torch.library.custom_op(SPLIT, mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    _Fault.check()
    return x.flip(-1) * 0.5 + x.sum(-1, keepdim=True)


@mix.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@dataclasses.dataclass(frozen=True)
class Recipe:
    optional_bias: bool
    buffer_update: bool
    mutate_input: bool
    relu: bool  # a Python branch on a module attribute
    batch_branch: int | None  # `if x.shape[0] > k` when set
    splits: int

    @property
    def row_independent(self) -> bool:
        """Whether padded rows leave the real rows (and the state) untouched: what a runner,
        which pads every step, needs to equal eager on the real rows."""
        return self.batch_branch is None and not self.buffer_update and not self.optional_bias


class Zoo(nn.Module):
    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(H, H)
        self.lin2 = nn.Linear(H, H)
        self.register_buffer("total", torch.zeros(H))
        self.relu = recipe.relu
        self.splits = recipe.splits
        self.threshold = recipe.batch_branch
        self.buffer_update = recipe.buffer_update
        self.mutate_input = recipe.mutate_input

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.mutate_input:
            x.mul_(2)
        h = self.lin1(x)
        for _ in range(self.splits):
            h = torch.ops.difftest.mix(h)
        h = torch.relu(h) if self.relu else torch.tanh(h)
        if self.threshold is not None and x.shape[0] > self.threshold:
            h = h * 3
        if bias is not None:
            h = h + bias
        if self.buffer_update:
            self.total.add_(h.sum(0))
        return self.lin2(h)


@dataclasses.dataclass(frozen=True)
class Call:
    size: int
    path: str  # "plain" | "context" | "runner"
    bias: bool
    grad: str  # "plain" | "no_grad" | "inference"
    fresh: bool  # a new tensor instead of the persistent buffer (context path)
    fault: bool


recipes = st.builds(Recipe, optional_bias=st.booleans(), buffer_update=st.booleans(),
                    mutate_input=st.booleans(), relu=st.booleans(),
                    batch_branch=st.sampled_from([None, None, None, 1, 2, 3, 4, 6]),
                    splits=st.sampled_from([1, 2, 1, 0]))


@st.composite
def configs(draw: st.DrawFn, recipe: Recipe) -> ff.CompilationConfig:
    mode = draw(st.sampled_from(["piecewise", "dynamo_trace_once", "piecewise", "none"]))
    split = mode == "piecewise" and recipe.splits > 0
    graph_modes = (["piecewise", "full_and_piecewise", "full"] if split else ["full"]) + ["none"]
    graph_mode = draw(st.sampled_from(graph_modes))
    ladder = sorted(draw(st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1)))
    ends = sorted(draw(st.sets(st.sampled_from([2, 4])))) if split else []
    return ff.CompilationConfig(
        mode=mode, backend="eager", splitting_ops=[SPLIT] if split else None,
        cudagraph_mode=graph_mode, cudagraph_capture_sizes=ladder,
        compile_ranges_endpoints=ends, graph_backend="emulated", max_num_tokens=16,
        max_num_seqs=8, use_cache=False)


@st.composite
def calls(draw: st.DrawFn, recipe: Recipe) -> list[Call]:
    paths = ["context", "plain", "context"] + (["runner"] * 3 if recipe.row_independent else [])
    out = []
    for i in range(draw(st.integers(1, 6))):
        size = 1 if i == 0 and draw(st.booleans()) else draw(st.integers(1, 10))
        out.append(Call(size=size, path=draw(st.sampled_from(paths)),
                        bias=recipe.optional_bias and draw(st.booleans()),
                        grad=draw(st.sampled_from(["plain", "no_grad", "inference"])),
                        fresh=draw(st.booleans()),
                        fault=recipe.splits > 0 and draw(st.integers(0, 5)) == 0))
    return out


def _grad(mode: str) -> Any:
    return {"plain": torch.enable_grad(), "no_grad": torch.no_grad(),
            "inference": torch.inference_mode()}[mode]


def _data(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))


class Harness:
    """The compiled model and its eager twin, fed identical inputs."""

    def __init__(self, recipe: Recipe, cfg: ff.CompilationConfig) -> None:
        self.recipe, self.cfg = recipe, cfg
        module = Zoo(recipe)
        self.eager = copy.deepcopy(module)
        self.model = ff.compile(module, cfg)
        self.buffer = torch.zeros(16, H)
        self.runner: ff.GraphRunner | None = None
        self.graph_mode: ff.CUDAGraphMode = cfg.cudagraph_mode  # type: ignore[assignment]

    def _runner(self) -> ff.GraphRunner:
        if self.runner is None:
            self.runner = ff.GraphRunner(self.model, self.cfg, inputs={"x": ff.Tokens(H)},
                                         progress=False)
            with torch.no_grad():
                self.runner.capture()
        return self.runner

    def _context_mode(self, step: int) -> ff.CUDAGraphMode:
        M = ff.CUDAGraphMode
        if self.graph_mode is M.FULL_AND_PIECEWISE:
            return (M.FULL, M.PIECEWISE)[step % 2]
        return {M.NONE: M.NONE, M.PIECEWISE: M.PIECEWISE, M.FULL: M.FULL}[self.graph_mode]

    def step(self, call: Call, step: int) -> None:
        rows = call.size
        mode = ff.CUDAGraphMode.NONE
        if call.path == "context":
            mode = self._context_mode(step)
            padded = self.cfg.padded_size(call.size)
            if padded is None:
                mode = ff.CUDAGraphMode.NONE
            else:
                rows = padded
        x = _data(rows, seed=step)
        bias = _data(rows, seed=100 + step) if call.bias else None
        if call.path == "context" and not call.fresh:
            self.buffer[:rows].copy_(x)
            mine = self.buffer[:rows]
        else:
            mine = x.clone()
        theirs = x.clone()
        their_bias = bias.clone() if bias is not None else None
        runner = self._runner() if call.path == "runner" else None  # captures: not armed yet
        if call.fault:
            _Fault.armed = True
        try:
            with _grad(call.grad):
                if runner is not None:
                    got = runner(mine)
                elif call.path == "context":
                    desc = ff.BatchDescriptor(num_tokens=rows) if mode is not \
                        ff.CUDAGraphMode.NONE else None
                    with ff.forward_context(desc, mode=mode):
                        got = self.model(mine, bias)
                else:
                    got = self.model(mine, bias)
                got = got.clone()
        except InjectedFault:
            assert call.fault
            _Fault.armed = True  # the same fault, at the same place, in eager
            with pytest.raises(InjectedFault), torch.no_grad():
                self.eager(theirs, their_bias)
            self._compare_state(mine, theirs, call)
            return
        except FreezeframeError as exc:
            _Fault.armed = False
            message = str(exc)
            assert len(message) > 40 and "\n" not in message.strip()[:40], message
            return
        assert not _Fault.armed or call.path == "runner" or mode is ff.CUDAGraphMode.FULL, \
            "an armed fault did not fire: the splitting op did not run"
        _Fault.armed = False
        with torch.no_grad():
            want = self.eager(theirs, their_bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{call} (step {step}): {m}")
        self._compare_state(mine, theirs, call)

    def _compare_state(self, mine: torch.Tensor, theirs: torch.Tensor, call: Call) -> None:
        torch.testing.assert_close(mine, theirs, msg=lambda m: f"input after {call}: {m}")
        torch.testing.assert_close(self.model.module.total, self.eager.total,
                                   msg=lambda m: f"buffer after {call}: {m}")


@pytest.fixture(autouse=True)
def _disarmed() -> Any:
    _Fault.armed = False
    yield
    _Fault.armed = False


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_every_call_equals_eager_or_raises_a_clear_error(data: st.DataObject) -> None:
    recipe = data.draw(recipes, label="recipe")
    cfg = data.draw(configs(recipe), label="config")
    sequence = data.draw(calls(recipe), label="calls")
    harness = Harness(recipe, cfg)
    for step, call in enumerate(sequence):
        harness.step(call, step)


# -- what the suite found, kept as explicit cases --------------------------------------------
def _config(mode: str, graph_mode: str, ladder: list[int], split: bool) -> ff.CompilationConfig:
    return ff.CompilationConfig(
        mode=mode, backend="eager", splitting_ops=[SPLIT] if split else None,
        cudagraph_mode=graph_mode, cudagraph_capture_sizes=ladder, graph_backend="emulated",
        max_num_tokens=16, max_num_seqs=8, use_cache=False)


def _replay(recipe: Recipe, cfg: ff.CompilationConfig, sequence: list[Call]) -> None:
    harness = Harness(recipe, cfg)
    for step, call in enumerate(sequence):
        harness.step(call, step)


def test_found_a_size_one_step_after_a_trace_at_two_took_the_other_branch() -> None:
    """`x.shape[0] > 1` left no guard in a trace made at size 2 (Dynamo assumes >= 2), and the
    size-1 FULL graph replayed the wrong side of the branch."""
    _replay(Recipe(False, False, False, False, 1, 0), _config("piecewise", "full", [1], False),
            [Call(2, "context", False, "plain", False, False),
             Call(1, "context", False, "plain", False, False)])


def test_found_a_bound_equal_to_the_first_size_failed_the_trace() -> None:
    """`x.shape[0] > 2` first called at size 2: a raw ConstraintViolationError."""
    _replay(Recipe(False, False, False, False, 2, 0), _config("piecewise", "full", [1], False),
            [Call(2, "context", False, "plain", False, False),
             Call(3, "plain", False, "plain", False, False)])


def test_found_a_runner_step_that_raised_dropped_what_the_model_had_written() -> None:
    """The model wrote into its input, then its splitting op raised: eager leaves the write in
    the caller's tensor; the runner copied nothing back."""
    _replay(Recipe(False, False, True, False, None, 1),
            _config("piecewise", "piecewise", [1, 2], True),
            [Call(1, "runner", False, "plain", False, True),
             Call(2, "runner", False, "plain", False, False)])
