"""A runner's options, checked once at construction: a misspelled one is an error there.

:class:`RunnerOptions` holds every keyword of :class:`~freezeframe.runtime.GraphRunner` that is
not the model, the config or the inputs, each resolved to the type the runner reads (a
capture-policy name to :class:`~freezeframe.runtime.capture_policy.CapturePolicy`, modes to a
frozenset) and checked against the rules that tie them together (a memory budget needs the
eager policy; the background policy cannot agree with data-parallel ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch

from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.errors import ConfigError
from freezeframe.graphs.capturable import Capturable
from freezeframe.runtime.capture_policy import CapturePolicy
from freezeframe.runtime.dispatcher import runtime_modes
from freezeframe.runtime.lockstep import Lockstep
from freezeframe.runtime.outputs import check_outputs

__all__ = ["RunnerOptions", "resolve_device", "runner_config"]


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """See :class:`~freezeframe.runtime.GraphRunner` for what each option does."""

    outputs: Any = "tokens"
    copy_outputs: bool = False
    strict: bool = False
    dp_sync: bool = False
    dp_group: Any = None
    invalid_modes: Collection[CUDAGraphMode] = frozenset()
    call_positional: bool = False
    progress: bool = True
    capture_policy: CapturePolicy | str = CapturePolicy.EAGER
    lazy_warmups: int = 1
    graph_memory_budget: int | None = None
    verify: int = 0
    verify_tolerance: float | None = None
    lockstep: Lockstep | bool | None = None

    def __post_init__(self) -> None:
        check_outputs(self.outputs)
        object.__setattr__(self, "invalid_modes", runtime_modes(self.invalid_modes))
        policy = CapturePolicy.parse(self.capture_policy)
        object.__setattr__(self, "capture_policy", policy)
        if not isinstance(self.lazy_warmups, int) or isinstance(self.lazy_warmups, bool) \
                or self.lazy_warmups < 0:
            raise ConfigError(f"lazy_warmups must be an int >= 0, got {self.lazy_warmups!r}")
        _check_budget(self.graph_memory_budget, policy)
        if policy is CapturePolicy.BACKGROUND and self.dp_sync:
            raise ConfigError(
                "capture_policy='background' with dp_sync=True: data-parallel ranks must "
                "capture the same graphs at the same steps, which a background thread cannot "
                "promise; use capture_policy='lazy' (deterministic) or 'eager'")
        object.__setattr__(self, "lockstep", _resolve_lockstep(self.lockstep, policy))

    @property
    def policy(self) -> CapturePolicy:
        return CapturePolicy.parse(self.capture_policy)

    @property
    def lockstep_config(self) -> Lockstep | None:
        return self.lockstep if isinstance(self.lockstep, Lockstep) else None


def _resolve_lockstep(lockstep: Any, policy: CapturePolicy) -> Lockstep | None:
    """``lockstep=True`` is ``Lockstep()`` (the world, the default timeout); off is None."""
    if lockstep is None or lockstep is False:
        return None
    if lockstep is True:
        lockstep = Lockstep()
    if not isinstance(lockstep, Lockstep):
        raise ConfigError(f"lockstep: expected True, False or a Lockstep(...), got {lockstep!r}")
    if policy is not CapturePolicy.EAGER:
        raise ConfigError(
            f"lockstep with capture_policy={policy.value!r}: lockstep capture agrees on and "
            "captures every graph in capture(), which the lazy and background policies leave "
            "to later steps; use capture_policy='eager' with lockstep")
    return lockstep


def _check_budget(budget: Any, policy: CapturePolicy) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"graph_memory_budget: expected a number of bytes (an int >= 0) or "
                          f"None, got {budget!r}")
    if policy is not CapturePolicy.EAGER:
        raise ConfigError(
            f"graph_memory_budget={budget} with capture_policy={policy.value!r}: the budget is "
            "checked by capture() before it captures every size, and the lazy and background "
            "policies capture sizes one at a time later, when their steps come; use "
            "capture_policy='eager' with a budget, or leave graph_memory_budget=None (choose "
            "sizes under a budget with `freezeframe plan` instead)")


def runner_config(config: CompilationConfig | None, held: Capturable | None,
                  strict: bool) -> CompilationConfig:
    """The runner's config: the one given, else the model's; it must agree with the model's
    on what sizes the keys (graph mode and capture sizes)."""
    model_config = held.config if held is not None else None
    if config is None:
        config = model_config
    if not isinstance(config, CompilationConfig):
        raise ConfigError(
            f"GraphRunner needs a CompilationConfig, got {config!r}; pass "
            "GraphRunner(model, ff.CompilationConfig(...), inputs=...)")
    if isinstance(model_config, CompilationConfig) and (
            model_config.cudagraph_mode is not config.cudagraph_mode
            or model_config.cudagraph_capture_sizes != config.cudagraph_capture_sizes):
        raise ConfigError(
            "GraphRunner config disagrees with the model's: cudagraph_mode "
            f"{config.cudagraph_mode!s} vs {model_config.cudagraph_mode!s}, capture "
            f"sizes {config.cudagraph_capture_sizes} vs "
            f"{model_config.cudagraph_capture_sizes}; pass the config the model was "
            "compiled with (or leave config out to use model.config)")
    if strict and config.cudagraph_mode is CUDAGraphMode.NONE:
        raise ConfigError(
            "strict=True with cudagraph_mode NONE: every step would be a fallback; turn "
            "graphs on or leave strict off")
    return config


def resolve_device(device: torch.device | str | None, model: Any) -> torch.device:
    """Where the buffers live: the one given, else the model's first parameter's, else CPU."""
    if device is None:
        params = getattr(model, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
