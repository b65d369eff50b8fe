"""A model with a fault that can be armed at any stage (trace, warm-up, capture, replay, a
micro-batched step), and the check that a fault left no global state behind; shared by the
runner's and the compiled model's fault tests."""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch
from torch import nn

import freezeframe as ff
from freezeframe import CUDAGraphMode
from freezeframe.context import get_forward_context

NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
HIDDEN = 4


class InjectedFault(RuntimeError):
    pass


# Dynamo reports an exception its trace met (a fault in the fake impl) as its own error type,
# naming the original one
FAULT_TYPES = (InjectedFault, torch._dynamo.exc.TorchRuntimeError)


class FaultPlan:
    """Raises once, at the first call of the faulty op whose phase matches ``armed``."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.fired: list[str] = []
        self._lock = threading.Lock()

    def check(self, phase: str | None = None) -> None:
        phase = phase or _phase()
        with self._lock:
            if self.armed is None or phase != self.armed:
                return
            self.armed = None
            self.fired.append(phase)
        raise InjectedFault(f"injected at {phase}")


def _phase() -> str:
    """Where the faulty op runs (``trace`` is checked by its fake impl, which runs while Dynamo
    traces the first call): ``warmup`` / ``capture`` (the runner's eager passes and graph
    captures), ``replay`` (a step that replays graphs around the op), ``eager`` (a step without
    graphs), each prefixed ``micro_batch_`` inside a micro-batch thread."""
    ctx = get_forward_context()
    if ctx is None:
        return "outside"
    prefix = "micro_batch_" if ff.ubatch.in_micro_batch() else ""
    if ctx.capturing:
        # inside a micro-batch thread the mode is NONE; the capture pass is told apart by the
        # split step the runner made (its extras carry no parent mode), so both count as capture
        return prefix + ("capture" if ctx.mode is not NONE or prefix else "warmup")
    return prefix + ("replay" if ctx.mode is not NONE else "eager")


FAULTS = FaultPlan()


@torch.library.custom_op("fffaults::comm", mutates_args=("out",))
def _faulty_comm(x: torch.Tensor, out: torch.Tensor) -> None:
    """The splitting op (and, micro-batched, the communication): ``out = x * 2 + 1``, with
    yield points around it and the fault check between them. It writes into an ``out`` the
    graph before it allocated, as a splitting op between PIECEWISE graphs must: the next graph
    reads the address it saw at capture."""
    ff.ubatch.yield_to_comm()
    FAULTS.check()
    torch.mul(x, 2, out=out).add_(1)
    ff.ubatch.yield_to_compute()


@_faulty_comm.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    FAULTS.check("trace")  # Dynamo runs the fake impl while it traces the first call


def faulty_comm(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _faulty_comm(x, out)
    return out


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float(),
            torch.randint(-3, 4, (HIDDEN, HIDDEN), generator=g).float())


class FaultyModel(nn.Module):
    """Token-wise, integer-valued (exact results): linear, the faulty op, relu(linear)."""

    def __init__(self) -> None:
        super().__init__()
        w1, w2 = _weights()
        self.w1 = nn.Parameter(w1, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = faulty_comm(x @ self.w1)
        return torch.relu(h @ self.w2)


class ClosureForwardModel(nn.Module):
    """Same computation, with ``forward`` a closure set on the instance (a pattern some model
    wrappers use). Its Dynamo bytecode cannot be reused directly, so every call of the compiled
    model goes through ``torch.compile`` under the ``fail_on_recompile`` stance."""

    def __init__(self) -> None:
        super().__init__()
        w1, w2 = _weights()
        self.w1 = nn.Parameter(w1, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

        def forward(x: torch.Tensor) -> torch.Tensor:
            h = faulty_comm(x @ self.w1)
            return torch.relu(h @ self.w2)

        self.forward = forward  # type: ignore[method-assign]


def _inputs(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, (tokens, HIDDEN), generator=g).float()


def _eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return FaultyModel()(x)


# -- global state ---------------------------------------------------------------------------------
def _global_state() -> dict[str, Any]:
    from torch._dynamo import eval_frame

    return {
        "dispatch_modes": list(torch.utils._python_dispatch._get_current_dispatch_mode_stack()),
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "forward_context": get_forward_context(),
        "micro_batch": ff.ubatch.current_micro_batch(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "stance": eval_frame._stance.stance,
        "ubatch_threads": [t.name for t in threading.enumerate()
                           if t.name.startswith("freezeframe-ubatch") and t.is_alive()],
    }


CLEAN = {"dispatch_modes": [], "gc_enabled": True, "forward_context": None,
         "micro_batch": None, "grad": True, "inference": False, "stance": "default",
         "ubatch_threads": []}


def _assert_clean(frozen_before: int, clean: dict[str, Any] | None = None) -> None:
    """The process's global state is ``clean`` (default CLEAN), the gc freeze count as before."""
    state = _global_state()
    assert state.pop("gc_frozen") == frozen_before
    assert state == (CLEAN if clean is None else clean)


def rig_inputs(rig: Any, tokens: int, seed: int) -> torch.Tensor:
    """:func:`_inputs` on the scenario rig's device."""
    return _inputs(tokens, seed).to(rig.device)

