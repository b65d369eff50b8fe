"""The graph-backend protocol and the choice of backend from the config.

A *graph backend* knows how to turn "run this callable once" into a replayable graph. The
wrapper (:mod:`freezeframe.graphs.wrapper`) owns the policy — when to capture, which key, what
to return — and asks the backend only for the mechanism. Keeping the mechanism behind two
methods is what lets the whole pipeline run on a machine without a GPU: the ``emulated``
backend implements the same contract on CPU tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from freezeframe.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.config import CompilationConfig

__all__ = ["CapturedGraph", "GraphBackend", "graphs_possible", "resolve_backend"]

logger = logging.getLogger(__name__)


@runtime_checkable
class CapturedGraph(Protocol):
    """One captured region. ``replay()`` re-runs the recorded work on the captured tensors and
    leaves its results in the captured output tensors; it reads no Python arguments."""

    def replay(self) -> None: ...


@runtime_checkable
class GraphBackend(Protocol):
    """The mechanism behind :class:`~freezeframe.graphs.GraphWrapper`.

    ``capture(fn, gc_disable=...)`` runs ``fn()`` once *as a capture* and returns the graph and
    whatever ``fn`` returned (on CUDA those tensors hold no computed values yet: kernels are
    recorded, not run). ``gc_disable`` skips the garbage collection and allocator cache flush
    that normally precede a capture; the compile path sets it for every piece but the first of
    a forward, because paying it once per piece made capture an order of magnitude slower.

    ``weak_ref(output)`` returns ``output`` with every tensor replaced by one that does not keep
    its memory alive (or the same tensors, where the backend has no such notion).

    ``capture_computes`` says whether ``capture`` also runs the work (``emulated``: yes; ``cuda``:
    no, kernels are only recorded). Where it does not, the caller replays the graph once right
    after capturing, so the capturing call's outputs and in-place writes are real, exactly once.

    ``prepare(runnable)`` readies a compiled runnable that launches its own kernels (an Inductor
    piece) for capture by this backend: ``cuda`` captures those kernels as they are and returns
    it unchanged; ``emulated`` cannot see inside it and marks it to be recorded as one step.

    ``share_capture()``, called on the capturing thread inside ``capture``, returns a factory of
    context managers: another thread that runs its work inside one has that work recorded into
    the capture in progress (micro-batch threads do, one at a time, in the order the schedule
    gives them). ``cuda`` needs nothing (kernels launched onto the capturing stream from any
    thread are captured) and returns ``contextlib.nullcontext``; ``emulated`` records through a
    dispatch mode, which is per thread, so the factory makes a recorder that appends to the
    capturing thread's one.

    ``pool_bytes(device)`` is the memory the graphs' shared pool holds on ``device``, from the
    allocator's own accounting (``cuda``), or ``None`` for a backend without one (``emulated``:
    each graph holds its own tensors and reports them itself).
    """

    name: str
    capture_computes: bool

    def capture(self, fn: Callable[[], Any], *, gc_disable: bool = False,
                error_mode: str = "global") -> tuple[CapturedGraph, Any]: ...

    def weak_ref(self, output: Any) -> Any: ...

    def prepare(self, runnable: Callable[..., Any]) -> Callable[..., Any]: ...

    def share_capture(self) -> Callable[[], AbstractContextManager[Any]]: ...

    def pool_bytes(self, device: int | None = None) -> int | None: ...


def graphs_possible(config: CompilationConfig) -> bool:
    """Whether ``config`` can capture graphs on this machine, without raising: never with
    ``cudagraph_mode`` NONE; always on ``emulated``; on ``cuda`` and ``auto`` only with a CUDA
    device (where :func:`resolve_backend` raises for ``cuda`` and turns ``auto`` off)."""
    from freezeframe.config import CUDAGraphMode

    if config.cudagraph_mode is CUDAGraphMode.NONE:
        return False
    if config.graph_backend == "emulated":
        return True
    return bool(torch.cuda.is_available())


def resolve_backend(config: CompilationConfig | str) -> GraphBackend | None:
    """The graph backend ``config.graph_backend`` asks for, or ``None`` when graphs are off.

    * ``"cuda"``: needs CUDA; without it this is a :class:`~freezeframe.errors.ConfigError`
      (asking for real graphs and silently getting none would hide a broken deployment).
    * ``"emulated"``: the CPU stand-in, always available.
    * ``"auto"``: ``cuda`` when ``torch.cuda.is_available()``, else ``None`` — graphs off, said
      once in the log (the compile path calls this once per compiled model).

    A config whose ``cudagraph_mode`` is NONE captures nothing, so it resolves to ``None``
    without a log line or an error. A plain string (``"auto"``, ``"cuda"``, ``"emulated"``) is
    accepted too, for callers that build wrappers by hand.
    """
    if isinstance(config, str):
        choice = config.strip().lower()
    else:
        from freezeframe.config import CUDAGraphMode

        if config.cudagraph_mode is CUDAGraphMode.NONE:
            return None
        choice = config.graph_backend

    if choice == "emulated":
        from freezeframe.graphs.emulated import EmulatedBackend

        return EmulatedBackend()
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "graph_backend: 'cuda' needs a CUDA device, but torch.cuda.is_available() is "
                f"False (torch {torch.__version__}); run on a GPU, use graph_backend='emulated' "
                "to test graph behaviour on CPU, or 'auto' to turn graphs off without CUDA")
        from freezeframe.graphs.cuda import CudaBackend

        return CudaBackend()
    if choice == "auto":
        if torch.cuda.is_available():
            from freezeframe.graphs.cuda import CudaBackend

            return CudaBackend()
        logger.info(
            "graph_backend 'auto': CUDA is not available, so no graphs are captured and every "
            "step runs without graphs; set graph_backend='emulated' to exercise capture and "
            "replay on CPU")
        return None
    raise ConfigError(
        f"graph_backend: unknown graph backend {choice!r}; use 'auto', 'cuda' or 'emulated'")
