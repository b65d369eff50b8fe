"""The counting ``silly::attention`` op that every toy model splits at.

``silly::attention(q, k, v, out) -> None`` writes ``out = q + k + v`` and counts its real
calls. Registered with ``torch.library.custom_op``, so Dynamo keeps it as one opaque node and
the graph can be split at it; its fake impl does nothing (the op only mutates ``out``). Because
a splitting op runs *outside* every captured graph, the counter goes up on each replay: tests
use it to prove which code ran eagerly.

The op lives in the process-wide op registry, so it is registered once per process even if
this file is imported under two module names; both imports then share one counter.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["OP_NAME", "CallCounter", "attention", "counter", "get_counter", "reset_counter"]

OP_NAME = "silly::attention"


class CallCounter:
    """How many times the real (non-fake) op ran."""

    def __init__(self) -> None:
        self._value = 0
        self._lock = threading.Lock()

    def increment(self) -> None:
        with self._lock:
            self._value += 1

    def get(self) -> int:
        return self._value

    def reset(self) -> None:
        with self._lock:
            self._value = 0


def _register() -> CallCounter:
    from torch._library import custom_ops

    existing = custom_ops.OPDEFS.get(OP_NAME)
    if existing is not None:  # imported a second time under another module name
        return existing._init_fn.counter  # type: ignore[attr-defined]

    calls = CallCounter()

    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor) -> None:
        calls.increment()
        out.copy_(q + k + v)

    _attention.counter = calls  # type: ignore[attr-defined]
    op = torch.library.custom_op(OP_NAME, mutates_args=["out"])(_attention)

    @op.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        return None

    return calls


counter = _register()


def get_counter() -> int:
    return counter.get()


def reset_counter() -> None:
    counter.reset()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q + k + v`` through the splitting op (allocates the output it mutates)."""
    out = torch.empty_like(q)
    torch.ops.silly.attention(q, k, v, out)
    return out
