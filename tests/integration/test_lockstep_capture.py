"""Lockstep capture on two gloo ranks (CPU, loopback only): agree first, fail together.

The model all-reduces its input in every pass, as a tensor-parallel layer does, so a rank that
stops capturing leaves the other waiting in a collective. One pair of processes runs the
scenarios in order (each rank's n-th capture() is the n-th lockstep session):

1. rank 1 has another capture-size ladder: both ranks raise a ConfigError naming the field and
   both values, before any pass ran;
2. the same config: both capture the same graphs in the same order, then serve a step;
3. rank 0 raises while capturing its second graph, before its all-reduce: rank 1, waiting in
   that all-reduce, gives up after the lockstep timeout, and both raise a CaptureError naming
   rank 0, the graph and the error, within a bounded time;
4. rank 1 never calls capture(): rank 0 raises, naming rank 1, after the timeout;
5. (between 1 and 2) rank 1's input has another dtype: both ranks raise a ConfigError naming
   the input and both dtypes, before any pass ran (gloo's size check aborted a rank before);

and, in a pair of its own, the rank hosting the store (rank 0) dies while capturing: the other
raises a CaptureError saying the store cannot be reached, not a raw DistNetworkError.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from freezeframe.context import get_forward_context
from freezeframe.errors import ConfigError
from freezeframe.runtime.lockstep import Lockstep, plan_difference
from tests.helpers.ranks import run_ranks

TIMEOUT_S = 3.0
LADDER = [1, 2, 4, 8]


class _Reducing(nn.Module):
    """``x + sum over ranks of x``; notes each capture pass, and raises in the capture pass of
    ``fail_at`` (mode name, padded tokens) when one is set."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.group_name = group_name
        self.fail_at: tuple[str, int] | None = None
        self.captured: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import freezeframe as ff
        from freezeframe.models.parallel import all_reduce_sum

        ctx = get_forward_context()
        assert ctx is not None and ctx.batch_descriptor is not None
        if ctx.capturing and ctx.mode is not ff.CUDAGraphMode.NONE:
            key = (ctx.mode.name, ctx.batch_descriptor.num_tokens)
            if key == self.fail_at:
                raise RuntimeError("injected capture fault")
            self.captured.append(f"{key[0]} {key[1]}")
        return x + all_reduce_sum(x, self.group_name)


def _runner(model: _Reducing, ladder: list[int], dtype: torch.dtype = torch.float32) -> Any:
    import freezeframe as ff

    cfg = ff.CompilationConfig(cudagraph_mode="full", graph_backend="emulated",
                               cudagraph_capture_sizes=ladder, max_num_tokens=8, max_num_seqs=8)
    return ff.GraphRunner(model, cfg, inputs={"x": ff.runtime.Tokens(2, dtype=dtype)},
                          progress=False, lockstep=Lockstep(timeout_s=TIMEOUT_S))


def _attempt(runner: Any) -> dict[str, Any]:
    """capture(): the error (type and message) it raised, and how long it took."""
    t0 = time.monotonic()
    try:
        runner.capture()
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    return {"error": error, "seconds": time.monotonic() - t0}


def _lockstep_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    out: dict[str, Any] = {}
    model = _Reducing(name)  # 1: another ladder on rank 1
    runner = _runner(model, LADDER if rank == 0 else LADDER[:3])
    out["ladder"] = {**_attempt(runner), "captured": model.captured,
                     "report": runner.report is not None}
    model = _Reducing(name)  # 5: another input dtype on rank 1
    runner = _runner(model, LADDER, torch.float32 if rank == 0 else torch.float64)
    out["dtype"] = {**_attempt(runner), "captured": model.captured}
    model = _Reducing(name)  # 2: the same config
    runner = _runner(model, LADDER)
    out["agreed"] = {**_attempt(runner), "captured": model.captured}
    y = runner(torch.full((3, 2), float(rank + 1)))
    out["agreed"]["step"] = y.tolist()
    model = _Reducing(name)  # 3: rank 0 fails in its second graph
    model.fail_at = ("FULL", 4) if rank == 0 else None
    runner = _runner(model, LADDER)
    out["fault"] = {**_attempt(runner), "captured": model.captured,
                    "captures": runner.stats.captures, "failures": runner.stats.capture_failures}
    if rank == 0:  # 4: rank 1 never comes
        out["absent"] = _attempt(_runner(_Reducing(name), LADDER))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_lockstep_worker, 2, deadline_s=120.0)


@pytest.mark.slow
def test_another_ladder_is_refused_before_capture(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        got = res["ladder"]
        assert got["error"][0] == "ConfigError"
        assert ("rank 1 has cudagraph_capture_sizes=[1, 2, 4] but rank 0 has "
                "cudagraph_capture_sizes=[1, 2, 4, 8]") in got["error"][1]
        assert "give every rank the same cudagraph_capture_sizes" in got["error"][1]
        assert got["captured"] == [] and got["report"] is False
        assert got["seconds"] < TIMEOUT_S


@pytest.mark.slow
def test_another_input_dtype_is_refused_before_capture(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        got = res["dtype"]
        assert got["error"][0] == "ConfigError"
        assert ("input 0 is x: tokens float64 [8, 2] on rank 1 but x: tokens float32 [8, 2] "
                "on rank 0") in got["error"][1]
        assert got["captured"] == []
        assert got["seconds"] < TIMEOUT_S


@pytest.mark.slow
def test_same_config_captures_the_same_graphs_in_order(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        got = res["agreed"]
        assert got["error"] is None
        assert got["captured"] == ["FULL 8", "FULL 4", "FULL 2", "FULL 1"]
        # x + (1 + 2): rank r's x is r + 1, and the step's all-reduce ran
        assert got["step"] == [[rank + 4.0] * 2] * 3


@pytest.mark.slow
def test_a_rank_failing_capture_fails_every_rank_in_time(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        got = res["fault"]
        assert got["error"][0] == "CaptureError", rank
        message = got["error"][1]
        assert message.startswith(
            "lockstep capture stopped on every rank: rank 0 failed at graph 2 of 4 "
            "(FULL tokens=4 reqs=4): RuntimeError: injected capture fault"), message
        # graph 1 on both ranks; rank 1 reached graph 2's pass and waited in its all-reduce
        assert got["captured"] == [["FULL 8"], ["FULL 8", "FULL 4"]][rank]
        assert (got["captures"], got["failures"]) == (1, 1)
        # rank 1 waited out its all-reduce (the bounded timeout), then both reported
        assert got["seconds"] < 3 * TIMEOUT_S, got["seconds"]
    assert "then rank 1 failed at graph 2 of 4" in ranks[0]["fault"]["error"][1]


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_after_the_timeout(
        ranks: list[dict[str, Any]]) -> None:
    got = ranks[0]["absent"]
    assert got["error"][0] == "CaptureError"
    assert got["error"][1].startswith(
        "lockstep capture: rank(s) [1] did not reach capture() (where the ranks compare "
        f"their plans) within Lockstep.timeout_s={TIMEOUT_S} s (this is rank 0)")
    assert TIMEOUT_S <= got["seconds"] < 2 * TIMEOUT_S


def test_plan_difference_names_the_first_input_that_differs() -> None:
    base = {"inputs": ["x: tokens float32 [8, 2]"], "graphs": ["FULL tokens=2"]}
    other = {"inputs": ["x: tokens float32 [8, 5]"], "graphs": ["FULL tokens=2"]}
    assert plan_difference([base, other]) == (
        "lockstep capture: the ranks disagree before capture: input 0 is x: tokens float32 "
        "[8, 5] on rank 1 but x: tokens float32 [8, 2] on rank 0 (1 vs 1 inputs). Every rank "
        "must capture the same graphs in the same order: give every rank the same inputs (the "
        "same CompilationConfig and runner options)")


def test_plan_difference_names_the_first_difference() -> None:
    base = {"cudagraph_mode": "FULL", "graphs": ["FULL tokens=2", "FULL tokens=1"]}
    assert plan_difference([base, dict(base)]) is None
    other = {"cudagraph_mode": "FULL", "graphs": ["FULL tokens=2"]}
    assert plan_difference([base, base, other]) == (
        "lockstep capture: the ranks disagree before capture: graph 1 is missing on rank 2 but "
        "FULL tokens=1 on rank 0 (1 vs 2 graphs). Every rank must capture the same graphs in "
        "the same order: give every rank the same graphs (the same CompilationConfig and "
        "runner options)")


def test_lockstep_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"Lockstep.timeout_s must be a number of seconds > 0, "
                                          r"got 0"):
        Lockstep(timeout_s=0)
    with pytest.raises(ConfigError, match=r"collective_groups must be a tuple"):
        Lockstep(collective_groups=[None])  # type: ignore[arg-type]
    import freezeframe as ff

    cfg = ff.CompilationConfig(cudagraph_mode="full", graph_backend="emulated",
                               cudagraph_capture_sizes=[1, 2])
    with pytest.raises(ConfigError, match=r"lockstep with capture_policy='lazy'"):
        ff.GraphRunner(nn.Identity(), cfg, inputs={"x": ff.runtime.Tokens(2)},
                       capture_policy="lazy", lockstep=True)
    runner = ff.GraphRunner(nn.Identity(), cfg, inputs={"x": ff.runtime.Tokens(2)},
                            lockstep=True, progress=False)
    with pytest.raises(ConfigError, match=r"torch\.distributed is not initialised"):
        runner.capture()


def _step_fault_worker(rank: int, world: int) -> dict[str, Any]:
    """Both ranks capture; then rank 1's step fails before its all-reduce (an input the runner
    refuses) and rank 1 leaves; rank 0's step waits in the all-reduce until the process group
    gives up: an error within the group's timeout, never a hang."""
    import torch.distributed as dist

    runner = _runner(_Reducing(dist.group.WORLD.group_name), LADDER)
    runner.capture()
    t0 = time.monotonic()
    try:
        runner(torch.ones(3, 2) if rank == 0 else torch.ones(3, 5))
        error = None
    except Exception as exc:
        error = type(exc).__name__
    return {"error": error, "seconds": time.monotonic() - t0}


@pytest.mark.slow
def test_a_rank_failing_a_step_leaves_the_others_an_error_within_the_group_timeout() -> None:
    # Steps after capture are not in lockstep: the process group's own timeout bounds the wait
    # (docs/distributed.md); here 10 s
    ranks = run_ranks(_step_fault_worker, 2, deadline_s=120.0, group_timeout_s=10.0)
    assert ranks[1]["error"] == "InputMismatchError"
    assert ranks[0]["error"] == "RuntimeError"  # gloo's: the peer left or the wait timed out
    assert ranks[0]["seconds"] < 10.0 + 5.0


def _store_dies_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 (hosting the store) exits in its capture of the second graph."""
    import os

    import torch.distributed as dist

    model = _Reducing(dist.group.WORLD.group_name)
    runner = _runner(model, LADDER)
    if rank == 0:
        def die(*_: Any) -> None:
            ctx = ff_context()
            if ctx is not None and ctx.capturing and ctx.batch_descriptor is not None \
                    and ctx.batch_descriptor.num_tokens == 4:
                os._exit(3)

        model.register_forward_pre_hook(die)
    return _attempt(runner)


def ff_context() -> Any:

    return get_forward_context()


@pytest.mark.slow
def test_a_dead_store_host_is_a_capture_error_not_a_raw_network_error() -> None:
    ranks = run_ranks(_store_dies_worker, 2, deadline_s=120.0, may_die={0})
    assert ranks[0] is None  # rank 0 exited
    got = ranks[1]
    assert got["error"][0] == "CaptureError", got
    assert "the process group's store cannot be reached from rank 1" in got["error"][1]
    # rank 1 fails in graph 2's collective, or (a slower rank 1) while it still polls the
    # store at graph 2's start barrier: either way the error names the graph
    assert ("This rank (1) failed at graph 2 of 4 (FULL tokens=4 reqs=4)" in got["error"][1]
            or "This rank (1) was waiting for graph 2 of 4 (FULL tokens=4 reqs=4)."
            in got["error"][1]), got["error"][1]
    assert got["seconds"] < 3 * TIMEOUT_S
