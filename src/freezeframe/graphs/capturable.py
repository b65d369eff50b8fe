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
    from freezeframe.config import CompilationConfig
    from freezeframe.graphs.backend import GraphBackend
    from freezeframe.graphs.wrapper import CaptureWindow, GraphWrapper
    from freezeframe.stats import Stats

__all__ = ["Capturable"]


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

    def replayer(self, descriptor: BatchDescriptor, args: tuple[Any, ...],
                 kwargs: dict[str, Any], owner: object) -> Callable[[], Any] | None:
        """A zero-argument replay of the model's FULL graph that ``owner`` (the runner's
        forward-context owner) captured for ``descriptor`` on exactly these arguments, or None
        (see :meth:`~freezeframe.compilation.CompiledModel.replayer`)."""

    def plan_piecewise(self, descriptor: BatchDescriptor, args: tuple[Any, ...],
                       kwargs: dict[str, Any], run: Callable[[], Any], owner: object
                       ) -> tuple[Any, Callable[[], Any] | None]:
        """Call ``run()`` (this model on these arguments inside a PIECEWISE forward context for
        ``descriptor``) and return its output with, when the call can be repeated without the
        model's Python, a zero-argument function that repeats it (see
        :meth:`~freezeframe.compilation.CompiledModel.plan_piecewise`)."""
