"""GraphRunner shared by threads: steps run one at a time, so every thread gets eager's
outputs; an overlap of steps switches the runner to copying outputs; a model calling its own
runner gets an error, not a deadlock. Every scenario runs on every graph backend present (the
``rig`` fixture)."""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import freezeframe as ff
from freezeframe import CompilationConfig
from freezeframe.errors import FreezeframeError
from freezeframe.runtime import GraphRunner, Tokens
from tests.helpers.toy_models import SillyModel
from tests.scenarios.conftest import Rig

THREADS, STEPS, MAX_TOKENS = 4, 150, 12


def _config(rig: Rig, mode: str) -> CompilationConfig:
    return rig.config(mode, cudagraph_capture_sizes=[1, 2, 4, 8], max_num_tokens=MAX_TOKENS,
                      max_num_seqs=MAX_TOKENS)


class Scaled(nn.Module):
    """SillyModel's 9x + 19, each row scaled by its own factor: a step reads two buffers, so a
    step staged over by another thread's inputs shows in either."""

    def __init__(self) -> None:
        super().__init__()
        self.silly = SillyModel()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.silly(x) * scale.unsqueeze(-1)


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_threads_sharing_a_runner_get_eager_outputs(rig: Rig, mode: str) -> None:
    cfg = _config(rig, mode)
    model = ff.compile(Scaled(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3), "scale": Tokens()},
                         copy_outputs=True, device=rig.device, progress=False)
    runner.capture()
    eager = Scaled()
    wrong: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(index: int) -> None:
        rng = random.Random(index)
        try:
            start.wait()
            for step in range(STEPS):
                n = rng.randint(1, MAX_TOKENS)
                x = torch.full((n, 3), float(rng.randint(-3, 3)), device=rig.device)
                x[0, 0] = index  # each thread's rows differ from every other's
                scale = torch.full((n,), float(rng.randint(1, 3)), device=rig.device)
                out = runner(x, scale, num_reqs=n, uniform_decode=rng.random() < 0.5)
                if not torch.equal(rig.host(out), rig.host(eager(x, scale))):
                    wrong.append((index, step, n))
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert wrong == []
    assert runner.stats.steps == THREADS * STEPS


def _wait_until_blocked_in_acquire(thread: threading.Thread) -> None:
    """Until ``thread``'s stack shows it inside the runner's lock acquisition."""
    for _ in range(30_000):
        frame = sys._current_frames().get(thread.ident or -1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_wait" and code.co_filename.endswith("lock.py"):
                return
            frame = frame.f_back
        time.sleep(0.001)
    raise AssertionError("the second step never reached the runner's lock")


class ViewOut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_an_overlap_switches_the_runner_to_copying_outputs(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """Without copy_outputs a step returns views of static memory; once a step had to wait for
    another thread's, every later step returns copies (a waiting thread's step would overwrite
    the views the other thread just got)."""
    cfg = _config(rig, "full")
    model = ff.compile(ViewOut(), cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(3)}, device=rig.device,
                         progress=False)
    runner.capture()
    first = runner(torch.ones(4, 3, device=rig.device))
    second = runner(torch.zeros(4, 3, device=rig.device))
    assert first.data_ptr() == second.data_ptr()  # the graph's static output, twice

    inside, release = threading.Event(), threading.Event()

    class Holding(nn.Module):
        """Holds its step open until told to finish, so a second thread's step must wait."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            assert release.wait(30)
            return x * 2

    holding = GraphRunner(Holding(), _config(rig, "none"), inputs={"x": Tokens(3)},
                          device=rig.device, progress=False)
    results: dict[str, Any] = {}
    caplog.set_level(logging.WARNING, logger="freezeframe.runtime.runner")
    first_thread = threading.Thread(
        target=lambda: results.update(a=holding(torch.ones(2, 3, device=rig.device))))
    first_thread.start()
    assert inside.wait(30)
    inside.clear()
    second_thread = threading.Thread(
        target=lambda: results.update(b=holding(torch.ones(3, 3, device=rig.device))))
    second_thread.start()
    _wait_until_blocked_in_acquire(second_thread)
    release.set()
    first_thread.join(30)
    second_thread.join(30)
    assert torch.equal(rig.host(results["a"]), torch.full((2, 3), 2.0))
    assert torch.equal(rig.host(results["b"]), torch.full((3, 3), 2.0))
    assert holding.stats.lock_waits == 1
    assert sum("steps from several threads overlapped" in r.getMessage()
               for r in caplog.records) == 1
    # from now on outputs are copies: two steps no longer share memory
    third = holding(torch.ones(2, 3, device=rig.device))
    fourth = holding(torch.ones(2, 3, device=rig.device))
    assert third.data_ptr() != fourth.data_ptr()


class CallsItsRunner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.runner: GraphRunner | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.runner is not None
        return self.runner(x)


def test_a_model_calling_its_own_runner_is_an_error_not_a_deadlock(rig: Rig) -> None:
    model = CallsItsRunner()
    runner = GraphRunner(model, _config(rig, "none"), inputs={"x": Tokens(3)},
                         device=rig.device, progress=False)
    model.runner = runner
    with pytest.raises(FreezeframeError, match="started from inside a step or capture on the "
                                               "same thread"):
        runner(torch.ones(2, 3, device=rig.device))
    # the lock was released: the runner still works
    model.runner = None
    runner.model = ViewOut()
    assert torch.equal(rig.host(runner(torch.ones(2, 3, device=rig.device))),
                       torch.full((2, 3), 2.0))
