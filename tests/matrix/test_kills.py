"""Named cases that kill the mutants of scripts/mutate.py the seeds of the fast slice may miss.

Each case is a few calls on tiny shapes (eager compiler, emulated graphs), run against eager
PyTorch like every matrix case; the comment above it names the mutants it kills (see
``python scripts/mutate.py --list``). Each mutant is killed by at least two of these cases or
seeds, so one case changing does not leave it unseen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import freezeframe as ff
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.configs import silly_config
from tests.helpers.toy_models import SillyModel
from tests.matrix.cases import Call, Case, Change
from tests.matrix.harness import run_case

_P = Call(3, positional=True)  # a runner step of 3 tokens, tensors positional (planned)
_K = Call(3)  # the same step, tensors by name (planned alike)

KILLS: dict[str, Case] = {
    # planned FULL steps of new values, by position and by name: plan_skips_last_input_copy,
    # plan_same_tensor_object
    "planned_full_new_values": Case(
        seed=3, tier="fast", model="reads_attrs", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, _K, _P)),
    # a Requests and a Static input after the tokens: the last input is not the first
    # (plan_skips_last_input_copy, plan_same_tensor_object)
    "planned_full_per_request": Case(
        seed=4, tier="fast", model="per_request", path="runner", graph_mode="full",
        ladder=(4,), events=(Call(3, reqs=2), Call(3, reqs=2), Call(3, reqs=2))),
    # a change the module-state check sees, after planned steps: plan_skips_state_check,
    # plan_in_context_skips_check, class_attr_unseen, hooks_change_unseen
    "planned_full_class_attr": Case(
        seed=5, tier="fast", model="reads_attrs", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, Change("class_attr"), _P, Change("restore_class_attr"),
                             _P)),
    "planned_piecewise_class_attr": Case(
        seed=6, tier="fast", model="reads_attrs", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_P, _P, Change("class_attr"), _P, Change("restore_class_attr"),
                             _P)),
    "planned_full_sub_hook": Case(
        seed=36, tier="fast", model="sandwich", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, Change("hook_sub_fwd", 0), _P, Change("remove_hook"), _P)),
    # train() on a model that branches on self.training: training_unseen
    "plain_train_branches": Case(
        seed=39, tier="fast", model="branches", path="plain",
        events=(Call(3, positional=True), Call(3, positional=True), Change("train"),
                Call(3, positional=True), Change("eval"), Call(3, positional=True))),
    "context_train_branches": Case(
        seed=40, tier="fast", model="branches", path="context", graph_mode="piecewise",
        ladder=(4,), events=(Call(4), Call(4), Change("train"), Call(4), Change("eval"),
                             Call(4))),
    # an input of another dtype after planned steps of float32: plan_key_without_dtype,
    # input_dtype_unchecked
    "planned_full_cast_input": Case(
        seed=8, tier="fast", model="reads_attrs", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, Call(3, positional=True, cast=True), _P)),
    "planned_piecewise_cast_input": Case(
        seed=9, tier="fast", model="sandwich", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_K, _K, Call(3, cast=True), _K)),
    # hooks on the compiled model after planned steps: plan_ignores_hooks,
    # skip_call_ignores_pre_hooks
    "planned_full_pre_hook": Case(
        seed=10, tier="fast", model="reads_attrs", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, Change("hook_model_pre"), _P, _P, Change("remove_hook"),
                             _P)),
    "planned_piecewise_fwd_hook": Case(
        seed=11, tier="fast", model="sandwich", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_P, _P, Change("hook_model_fwd"), _P, _P)),
    "plain_pre_hook_after_memo": Case(
        seed=12, tier="fast", model="reads_attrs", path="plain",
        events=(Call(3), Call(3), Change("hook_model_pre"), Call(3), Call(3))),
    # hooked before the first step: whole_way_ignores_hooks
    "hooked_from_the_start_full": Case(
        seed=13, tier="fast", model="reads_attrs", path="runner", graph_mode="full",
        ladder=(4,), events=(Change("hook_model_fwd"), _P, _P, _P)),
    "pre_hooked_from_the_start_full": Case(
        seed=14, tier="fast", model="sandwich", path="runner", graph_mode="full",
        ladder=(4,), events=(Change("hook_model_pre"), _K, _K, _P)),
    # planned PIECEWISE steps: piecewise_plan_cut_reused
    "planned_piecewise_steps": Case(
        seed=15, tier="fast", model="outer", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_P, _P, _P, _K)),
    # the last op a splitting op (ffmatrix::mix returns a new tensor): each planned PIECEWISE
    # step's output is a new tensor (piecewise_plan_cut_reused)
    "planned_piecewise_split_last": Case(
        seed=31, tier="fast", model="per_request", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(Call(3, reqs=2), Call(3, reqs=2), Call(3, reqs=2))),
    "planned_piecewise_split_last_mixed": Case(
        seed=32, tier="fast", model="per_request", path="runner",
        graph_mode="full_and_piecewise", ladder=(2, 4),
        events=(Call(3, reqs=2), Call(2, reqs=1), Call(3, reqs=2), Call(2, reqs=1),
                Call(3, reqs=2))),
    # a model writing its input: copy_back_skipped (runner), replay_no_copy_back (context, a
    # fresh tensor each call)
    "writes_input_runner_full": Case(
        seed=16, tier="fast", model="makes_ones", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, _P)),
    "writes_input_runner_piecewise": Case(
        seed=17, tier="fast", model="makes_ones", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_P, _K, _P)),
    "writes_input_context_fresh": Case(
        seed=18, tier="fast", model="makes_ones", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4, fresh=True), Call(4, fresh=True))),
    "writes_input_context_piecewise_fresh": Case(
        seed=19, tier="fast", model="makes_ones", path="context", graph_mode="piecewise",
        ladder=(4,), events=(Call(4), Call(4, fresh=True), Call(4, fresh=True))),
    # output containers on runner steps: cut_rebuilds_lists, dataclass_output_uncut,
    # cut_keeps_padding
    "namedtuple_out_runner": Case(
        seed=20, tier="fast", model="namedtuple_out", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P)),
    "namedtuple_out_piecewise": Case(
        seed=21, tier="fast", model="namedtuple_out", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_P, _K)),
    "dataclass_out_piecewise": Case(
        seed=22, tier="fast", model="dataclass_out", path="runner", graph_mode="piecewise",
        ladder=(4,), events=(_P, _K, _P)),
    # a global forward reads, changed and put back: outside_value_unchecked,
    # global_change_unseen, global_compared_by_identity
    "global_changed_and_back": Case(
        seed=23, tier="fast", model="reads_global", path="plain",
        events=(Call(3), Call(3), Change("module_global"), Call(3), Change("restore_global"),
                Call(3))),
    "global_changed_runner": Case(
        seed=24, tier="fast", model="reads_global", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, Change("module_global"), _P, Change("restore_global"),
                             _P)),
    # a parameter replaced after planned steps: graphs_kept_after_weights_replaced,
    # replaced_weights_unseen
    "planned_full_param_replaced": Case(
        seed=25, tier="fast", model="reads_attrs", path="runner", graph_mode="full",
        ladder=(4,), events=(_P, _P, Change("replace_param", 0), _P, _K)),
    "context_full_param_replaced": Case(
        seed=26, tier="fast", model="tensor_attr", path="context", graph_mode="full",
        ladder=(4,), events=(Call(4), Call(4), Change("replace_param", 0), Call(4))),
    # changes after calls of a remembered shape (positional: the compiled model's short cut):
    # state_check_skipped_on_memo, hooks_change_unseen, refuses_after_a_change
    "plain_sub_hook_after_memo": Case(
        seed=27, tier="fast", model="sandwich", path="plain",
        events=(Call(3), Call(3), Change("hook_sub_fwd", 0), Call(3), Call(3))),
    "plain_class_attr_after_memo": Case(
        seed=37, tier="fast", model="reads_attrs", path="plain",
        events=(Call(3, positional=True), Call(3, positional=True), Call(3, positional=True),
                Change("class_attr"), Call(3, positional=True),
                Change("restore_class_attr"), Call(3, positional=True))),
    "plain_global_after_memo": Case(
        seed=38, tier="fast", model="reads_global", path="plain",
        events=(Call(3, positional=True), Call(3, positional=True), Call(3, positional=True),
                Change("module_global"), Call(3, positional=True),
                Change("restore_global"), Call(3, positional=True))),
    "plain_equal_attr_after_memo": Case(
        seed=28, tier="fast", model="reads_attrs", path="plain",
        events=(Call(3), Call(3), Change("equal_attr"), Call(3), Change("train"), Call(3))),
}


@pytest.mark.parametrize("name", list(KILLS))
def test_named_kill(name: str, tmp_path: Path) -> None:
    run_case(KILLS[name], None, shrink=False)


@pytest.mark.parametrize("first_uniform", [True, False])
def test_named_kill_uniform_and_mixed_steps_dispatch_apart(first_uniform: bool) -> None:
    """Under FULL_DECODE_ONLY a uniform-decode step replays the FULL graph and a mixed step of
    as many tokens runs eagerly, whichever came first (the answers are alike, the modes are
    the runner's stats): dispatch_memo_without_uniform."""
    cfg = silly_config("emulated", "full_decode_only", cudagraph_capture_sizes=[2, 4],
                       max_num_tokens=4, max_num_seqs=4)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    runner.capture()
    eager = SillyModel()
    for uniform in (first_uniform, not first_uniform, first_uniform):
        x = torch.randn(2, 3)
        torch.testing.assert_close(runner(x, uniform_decode=uniform), eager(x))
    full = 2 if first_uniform else 1
    assert (runner.stats.steps_full, runner.stats.steps_eager) == (full, 3 - full)


@pytest.mark.parametrize("graph_mode", ["full", "piecewise"])
def test_named_kill_each_size_pads_to_the_next_capture_size(graph_mode: str) -> None:
    """Steps of 1 to 4 tokens with capture sizes [2, 4] pad to 2, 2, 4, 4 and each replays a
    graph (the answers of a step padded further, or run eagerly, are alike: the runner's stats
    tell): padding_table_shifted."""
    cfg = silly_config("emulated", graph_mode, cudagraph_capture_sizes=[2, 4],
                       max_num_tokens=4, max_num_seqs=4)
    model = ff.compile(SillyModel(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, progress=False)
    runner.capture()
    eager = SillyModel()
    for n in (1, 2, 3, 4):
        x = torch.randn(n, 3)
        torch.testing.assert_close(runner(x), eager(x))
    stats = runner.stats
    graphs = stats.steps_full if graph_mode == "full" else stats.steps_piecewise
    assert (graphs, stats.steps_eager, stats.padded_tokens) == (4, 0, 2)


OFFSETS = [0.5, 1.5]  # a global forward reads (rebound to an equal new list below)


class _ReadsOffsets(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + OFFSETS[1]


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_named_kill_a_global_rebound_to_an_equal_value_is_served(graph_mode: str) -> None:
    """A module-level global forward reads, rebound to a new object of equal value, is served
    as the guarantees state (compared by value, as an argument is); another value is refused
    by name: global_compared_by_identity."""
    global OFFSETS
    cfg = silly_config("emulated", graph_mode, cudagraph_capture_sizes=[4])
    model = ff.compile(_ReadsOffsets(), cfg)
    x = torch.arange(12.0).reshape(4, 3)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(x), x * 2 + 1.5)
            OFFSETS = [0.5, float("1.5")]  # a new list, equal items
            torch.testing.assert_close(model(x), x * 2 + 1.5)
            OFFSETS = [0.5, 2.5]
            with pytest.raises(ff.CompileError, match=r"OFFSETS"):
                model(x)
    finally:
        OFFSETS = [0.5, 1.5]


def test_named_kill_a_forward_set_on_the_compiled_model_runs() -> None:
    """A wrapper set as ``forward`` on the compiled model's instance (as accelerate's hooks do)
    runs on every later call, also for a shape seen before, whose calls otherwise skip
    ``nn.Module.__call__``: skip_call_ignores_instance_forward."""
    cfg = silly_config("emulated", "none")
    model = ff.compile(SillyModel(), cfg)
    eager = SillyModel()
    x = torch.randn(3, 3)
    with torch.no_grad():
        for _ in range(3):  # a shape seen twice: its calls take the short cut
            torch.testing.assert_close(model(x), eager(x))
        traced = model.forward
        model.forward = lambda *args, **kwargs: traced(*args, **kwargs) * 2
        for _ in range(2):
            torch.testing.assert_close(model(x), eager(x) * 2)
        del model.forward
        torch.testing.assert_close(model(x), eager(x))
