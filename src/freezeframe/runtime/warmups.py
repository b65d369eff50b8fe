"""Warm-ups: how many passes without a graph run before a key is captured.

A capture must not be the first pass to run a key's code: Dynamo traces and compiles on a
first call (not allowed inside a capture, and impossible under the emulated recorder), and
where the graph backend only records (``cuda``) a key's first pass does lazy set-up a capture
cannot hold (a Triton kernel's compile and autotuning, cuBLAS handles and workspaces). So
beside the configured ``cudagraph_num_of_warmups``, at least one pass runs without a graph
before the first capture, before each concrete compile size's, while the model's first call
has not succeeded, and, where the backend only records, before every key's. :class:`Warmups`
remembers the sizes and keys that ran and says how many passes the next capture of a key needs.
"""

from __future__ import annotations

from freezeframe.batch import BatchDescriptor, GraphKey
from freezeframe.config import CompilationConfig, CUDAGraphMode
from freezeframe.graphs.capturable import Capturable

__all__ = ["Warmups"]


class Warmups:
    """The sizes and graph keys that ran without a graph before their first capture, and how
    many warm-ups a capture of a key runs (see the module docstring)."""

    def __init__(self, held: Capturable | None, config: CompilationConfig,
                 on_cuda: bool) -> None:
        self._held, self._config, self._on_cuda = held, config, on_cuda
        self._sizes: set[int] = set()
        self._keys: set[GraphKey] = set()

    def records_only(self) -> bool:
        """Whether the graph backend only records kernels when it captures (``cuda``), so code
        that first runs inside a capture would do its lazy set-up there (a Triton kernel's
        compile and autotuning, cuBLAS handles and workspaces, Inductor's first launch): work
        a capture cannot hold. ``emulated`` captures by running, as eager code does."""
        backend = self._held.graph_backend if self._held is not None else None
        if backend is not None:
            return not backend.capture_computes
        return self._on_cuda

    def first_step(self, key: GraphKey) -> bool:
        """A step of ``key`` before capture(): whether it is the key's warm-up (no pass ran
        its code yet and the backend only records), noted as one."""
        if key in self._keys or not self.records_only():
            return False
        self._keys.add(key)
        self._sizes.add(key[1].num_tokens)
        return True

    def before_capture(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> int:
        """The configured warm-ups, but at least one eager pass before the very first capture
        and before the first capture of each concrete compile size: tracing and compiling must
        happen outside any capture (a capture records kernels; Dynamo cannot trace under the
        emulated recorder, and compiling inside a CUDA capture is not allowed). Where the
        backend only records (``cuda``), at least one before the first capture of every graph
        key as well: each key may reach code no earlier pass ran (another compile range, an
        attention kernel's specialisation for this many requests, a micro-batch slice at a
        new offset)."""
        n = self._config.cudagraph_num_of_warmups
        num_tokens = desc.num_tokens
        first_sight = num_tokens not in self._sizes
        self._sizes.add(num_tokens)
        new_key = (mode, desc) not in self._keys
        self._keys.add((mode, desc))
        if new_key and self.records_only():
            return max(n, 1)
        if first_sight and (len(self._sizes) == 1
                            or num_tokens in (self._config.compile_sizes or ())):
            return max(n, 1)
        if self._held is not None and not self._held.traced:  # its first call has not succeeded
            return max(n, 1)
        return n

    def snapshot(self) -> tuple[frozenset[int], frozenset[GraphKey]]:
        """What ran so far, for :meth:`restore` after a capture attempt that raised."""
        return frozenset(self._sizes), frozenset(self._keys)

    def restore(self, snapshot: tuple[frozenset[int], frozenset[GraphKey]]) -> None:
        """Forget what ran since ``snapshot``: a failed first call may have left the model
        untraced, so the sizes it primed count as unprimed again."""
        self._sizes, self._keys = set(snapshot[0]), set(snapshot[1])
