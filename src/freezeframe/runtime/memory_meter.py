"""Reading the graph memory a runner's captures add, and predicting the rest from a few.

What "graph memory in use" means depends on where graphs keep their memory:

* ``emulated`` (graphs hold their own tensors): the bytes every graph wrapper holds, plus the
  micro-batch wrapper's split graphs;
* ``cuda``: the segments of the model's shared graph pool, read from the caching allocator;
* a model whose graphs the runner cannot see: minus the device's free memory (it moves with
  cuBLAS workspaces and warm-up caches too, so it is the roughest of the three).

The growth of that reading over a capture is the capture's memory; :meth:`GraphMemoryMeter.
predict` turns the measured probes into a prediction for every key (graph_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from freezeframe.batch import GraphKey
from freezeframe.graphs.capturable import Capturable
from freezeframe.runtime.graph_memory import (
    GraphMemoryPrediction,
    format_bytes,
    measurement_plan,
    predict_graph_memory,
)
from freezeframe.runtime.report import GraphCapture

__all__ = ["GraphMemoryMeter", "over_budget_message"]


class GraphMemoryMeter:
    """The graph-memory reading of one runner's model on one device (see the module
    docstring); ``extra_bytes`` reads what graphs outside the model hold (the micro-batch
    wrapper's)."""

    def __init__(self, held: Capturable | None, device: torch.device,
                 extra_bytes: Callable[[], int]) -> None:
        self._held = held
        self._device = device
        self._extra_bytes = extra_bytes

    @property
    def graphs_hold_their_own(self) -> bool:
        """Whether the model's graphs count their own memory (``emulated``: each graph holds
        its own tensors) rather than living in a CUDA pool only the allocator shows."""
        backend = self._held.graph_backend if self._held is not None else None
        return backend is not None and backend.name != "cuda"

    def in_use(self) -> int:
        """A reading whose growth over a capture is the graph memory it added."""
        if self.graphs_hold_their_own:
            assert self._held is not None
            return sum(w.memory_bytes() for w in self._held.graph_wrappers()) \
                + self._extra_bytes()
        backend = self._held.graph_backend if self._held is not None else None
        if backend is not None and self._device.type == "cuda":
            index = self._device.index
            pooled = backend.pool_bytes(index if index is not None
                                        else torch.cuda.current_device())
            if pooled is not None:
                return pooled
        return -_free_memory(self._device)

    def predict(self, keys: list[GraphKey], records: Sequence[GraphCapture],
                used_before: int | None) -> GraphMemoryPrediction:
        """Predict every key's graph memory from the measured probes (measurement_plan).

        Emulated: each probe's own bytes. CUDA (``used_before`` given): the pool's growth
        since the capture began, at the end of each probe's capture. The probes are captured
        smallest first, so the later probe of a family reuses the earlier's blocks and its own
        delta understates it; the growth so far is its footprint when it is the largest graph
        yet, and an overestimate otherwise, the safe side for a budget."""
        wanted = set(measurement_plan(keys))
        measured: dict[GraphKey, int] = {}
        pooled = not self.graphs_hold_their_own
        grown = 0
        for record in records:
            grown += record.memory_bytes
            key = (record.mode, record.descriptor)
            if key in wanted:
                measured[key] = grown if pooled and used_before is not None \
                    else record.memory_bytes
        return predict_graph_memory(keys, measured, pooled=pooled)


def over_budget_message(budget: int, prediction: GraphMemoryPrediction, measured: int) -> str:
    """The refusal of a capture whose prediction exceeds ``graph_memory_budget``."""
    largest = "; ".join(p.describe() for p in prediction.largest(3))
    sizes = sorted({p.descriptor.num_tokens for p in prediction.sizes})
    return (
        f"graph_memory_budget={budget} bytes ({format_bytes(budget)}): capturing the "
        f"{len(prediction.sizes)} graphs of capture sizes {sizes} is predicted to need "
        f"{prediction.total_bytes} bytes ({format_bytes(prediction.total_bytes)}, "
        f"{'one shared pool' if prediction.pooled else 'summed over graphs'}), from the "
        f"{measured} smallest graphs, captured and measured first. Largest: {largest}. "
        "Nothing was kept (the measured graphs were freed). Fix: capture fewer or smaller "
        "sizes (cudagraph_capture_sizes, max_cudagraph_capture_size), choose sizes under the "
        "budget with `freezeframe plan`, or raise graph_memory_budget")


def _free_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
