"""The silly-model configuration the graph scenarios share, on any graph backend."""

from __future__ import annotations

from typing import Any

from freezeframe import CompilationConfig


def silly_config(graph_backend: str, cudagraph_mode: str = "piecewise",
                 **changes: Any) -> CompilationConfig:
    """Piecewise compile with the eager compiler, split at ``silly::attention``, capture sizes
    [1, 2], the compile cache off; ``changes`` override any field."""
    base: dict[str, Any] = dict(mode="piecewise", backend="eager",
                                splitting_ops=["silly::attention"],
                                cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=[1, 2],
                                graph_backend=graph_backend, use_cache=False)
    base.update(changes)
    return CompilationConfig(**base)
