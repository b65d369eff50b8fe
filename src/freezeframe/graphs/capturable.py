"""What a runner needs of a model that holds its own graphs.

:class:`~freezeframe.runtime.GraphRunner` drives any callable. A model that owns graph wrappers
(``ff.compile``'s :class:`~freezeframe.compilation.CompiledModel` is one) says so by having these
members; the runner then checks its config against the model's, opens its capture window around
``capture()``, frees its stale graphs, and refuses to capture while compiling is off. A plain
``nn.Module`` has none of them and simply runs eagerly on the runner's padded buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from freezeframe.batch import BatchDescriptor
    from freezeframe.config import CompilationConfig, CUDAGraphMode
    from freezeframe.graphs.backend import GraphBackend
    from freezeframe.graphs.replay import Replay
    from freezeframe.graphs.wrapper import CaptureWindow, GraphWrapper
    from freezeframe.stats import Stats

__all__ = ["Capturable", "Chain", "PieceRecording"]


@runtime_checkable
class Capturable(Protocol):
    """A model holding graph wrappers (``isinstance(model, Capturable)`` tells)."""

    config: CompilationConfig
    stats: Stats
    capture_window: CaptureWindow
    module: Any  # the uncompiled nn.Module (a runner's verify mode runs it eagerly)
    # moves each time the model drops every graph (its parameters or buffers were replaced
    # after the capture): a runner then captures its keys again
    graph_generation: int

    @property
    def graph_backend(self) -> GraphBackend | None:
        """The backend the model's graphs are captured with (and whose pool they share)."""

    @property
    def traced(self) -> bool:
        """Whether the first call (which traces, holding a lock across the whole call) is done."""

    @property
    def compile_off_reason(self) -> str | None:
        """Why calls now run eagerly (Dynamo disabled...), or None when they compile."""

    def graph_wrappers(self) -> list[GraphWrapper]:
        """Every graph wrapper the model owns."""

    def check_state(self) -> int:
        """Run the check of the model's state every call makes, now (dropping the graphs if
        parameters or buffers were replaced, raising if the module changed in a way its trace
        cannot serve); returns :attr:`graph_generation`."""

    def state_check(self) -> Callable[[], None] | None:
        """The model's every-call state check as a function of nothing (a runner's planned
        step runs it before its replays; it drops the graphs when parameters were replaced,
        so the replay then raises :class:`~freezeframe.graphs.StaleReplay`), or None."""

    def graph_replay(self, mode: CUDAGraphMode, descriptor: BatchDescriptor,
                     args: tuple[Any, ...], kwargs: dict[str, Any], owner: object
                     ) -> Replay | None:
        """The replay of the model's graph of the whole forward (FULL, or a breakable model's
        PIECEWISE graph) that ``owner`` (the runner's forward-context owner) captured for
        ``descriptor`` on exactly these arguments, or None (see
        :meth:`~freezeframe.compilation.CompiledModel.graph_replay`)."""

    def record_pieces(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                      descriptor: BatchDescriptor, owner: object) -> PieceRecording | None:
        """A recording to enter around the runner's own call of the model in a PIECEWISE step
        (see :meth:`~freezeframe.compilation.CompiledModel.record_pieces`), or None."""


class Chain(Protocol):
    """A PIECEWISE step of one shape without the model's Python: calling it runs each
    capturable piece's replay (``replays``) and each splitting op in order, and returns the
    model's output (see :class:`~freezeframe.compilation.graph_steps.PieceChain`)."""

    @property
    def replays(self) -> tuple[Replay, ...]: ...

    def __call__(self) -> Any: ...


class PieceRecording(Protocol):
    """The stitching graph's calls during one model call (a context manager the runner enters
    around it); :meth:`chain` turns them into the step's :class:`Chain`."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def chain(self, out: Any) -> Chain | None: ...
