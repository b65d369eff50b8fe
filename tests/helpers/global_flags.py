"""A library-style module-level object that functions set attributes of (as transformers'
output capturing does under Dynamo): for the saved-trace tests of constant stores."""

from __future__ import annotations

from typing import Any

import torch


class Flags:
    def __init__(self) -> None:
        self.collecting = False
        self.collected: Any = None


FLAGS = Flags()


def reset_flags(x: torch.Tensor) -> torch.Tensor:
    """Sets two constants (each call, as a context manager's exit would) and doubles ``x``."""
    FLAGS.collected = None
    FLAGS.collecting = False
    return x * 2


def keep_sum(x: torch.Tensor) -> torch.Tensor:
    """Stores a value computed from ``x``: not a constant."""
    FLAGS.collected = x.shape[0] * 3 + 1
    return x * 2
