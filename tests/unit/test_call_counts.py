"""How many of freezeframe's own Python functions a planned runner step calls, exactly
(``scripts/count_calls.py`` prints these and the other scenarios; tests/helpers/call_count.py
says what is counted). Issue 45's limits: a planned FULL step at most 12 calls, a planned
PIECEWISE step of 3 pieces at most 30. A change that moves a count updates the number here,
never past the limit; the listed calls say where the time of a step goes."""

from __future__ import annotations

from tests.helpers.call_count import scenario

FULL_LIMIT, PIECEWISE_LIMIT = 12, 30


def test_a_planned_full_step_calls_eleven_freezeframe_functions() -> None:
    counted = scenario("full-step")
    assert [f"{module}.{name}" for module, name in counted.calls] == [
        "runtime.runner.GraphRunner.__call__",
        "runtime.lock.StepLock.enter",
        "runtime.steps.Stepper.step",
        "compilation.module_call.may_skip_module_call",  # the one rule for skipping
        "compilation.module_call.hooked",  # nn.Module.__call__ (a replay does)
        "runtime.steps.Stepper.run",
        "runtime.buffers.StaticBuffers.stage_into",
        "compilation.model.CompiledModel.check_state",
        "<generated>.check",  # the module-state check, generated per module
        "graphs.replay.Replay.on_captured",
        "runtime.lock.StepLock.exit",
    ]
    assert len(counted.calls) == 11 <= FULL_LIMIT


def test_a_planned_piecewise_step_of_three_pieces_calls_23() -> None:
    counted = scenario("piecewise-step")
    names = [f"{module}.{name}" for module, name in counted.calls]
    assert names.count("graphs.replay.Replay.__call__") == 3  # one per piece
    assert names.count("runtime.steps.Stepper.run") == 1
    assert len(names) == 23 <= PIECEWISE_LIMIT
