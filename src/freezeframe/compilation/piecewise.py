"""One compiled callable per compile range and per concrete size, for one capturable piece.

A piece is compiled once with symbolic shapes for each compile range, and once with static
shapes for each concrete ``compile_size``. At run time the piece reads the batch size from its
arguments and calls the entry for it: an exact size wins over the range containing it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx

from freezeframe.compilation.compilers import CompilerManager
from freezeframe.errors import ShapeOutOfRangeError
from freezeframe.sizes import Range

__all__ = ["PiecewiseBackend", "SizeSource", "concrete_inputs", "find_size_source"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SizeSource:
    """Where a piece finds its runtime size: argument ``index`` itself (a SymInt argument)
    or dim ``dim`` of the tensor argument ``index``."""

    index: int
    dim: int | None = None

    def read(self, args: Sequence[Any]) -> int:
        value = args[self.index]
        return int(value if self.dim is None else value.shape[self.dim])


def _is_plain_symbol(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol)


def find_size_source(fake_args: Sequence[Any]) -> SizeSource | None:
    """The first SymInt argument that is a bare symbol, else the first tensor dim that is one;
    ``None`` for a piece whose shapes are all static."""
    for i, arg in enumerate(fake_args):
        if _is_plain_symbol(arg):
            return SizeSource(i)
    for i, arg in enumerate(fake_args):
        if isinstance(arg, torch.Tensor):
            for d, size in enumerate(arg.shape):
                if _is_plain_symbol(size):
                    return SizeSource(i, d)
    return None


def _concrete(value: Any, size: int) -> int:
    """A SymInt or int with every free symbol replaced by ``size``."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr.xreplace({s: size for s in expr.free_symbols}))
    return int(value)


def concrete_inputs(fake_args: Sequence[Any], size: int) -> list[Any]:
    """Real (zero-filled) example inputs for a static compile at ``size``: every symbolic size
    becomes ``size``. Static-shape compilers must not see fake tensors from the trace's shape
    environment, or they would pick up its symbols again."""
    out: list[Any] = []
    for arg in fake_args:
        if isinstance(arg, torch.Tensor):
            shape = [_concrete(s, size) for s in arg.shape]
            stride = [_concrete(s, size) for s in arg.stride()]
            real = torch.empty_strided(shape, stride, dtype=arg.dtype, device=arg.device)
            out.append(real.zero_() if real.numel() else real)
        elif isinstance(arg, torch.SymInt):
            out.append(_concrete(arg, size))
        else:
            out.append(arg)
    return out


class PiecewiseBackend:
    """The callable that replaces one capturable piece in the stitching module."""

    def __init__(self, graph: fx.GraphModule, fake_args: Sequence[Any], *, piece_index: int,
                 manager: CompilerManager, compile_ranges: Sequence[Range],
                 compile_sizes: Sequence[int], max_num_tokens: int,
                 graph_key: str | None = None, static_size: int | None = None) -> None:
        self.graph = graph
        # the piece's structural hash (graph_hash of graph and fake_args): pieces that share it
        # share compiled code; None lets the manager compute it
        self.graph_key = graph_key
        self.piece_index = piece_index
        self.fake_args = list(fake_args)
        self.size_source = find_size_source(self.fake_args)
        self.compile_ranges = list(compile_ranges)
        self.compile_sizes = tuple(compile_sizes)
        self.max_num_tokens = max_num_tokens
        self._manager = manager
        # exact size -> runnable (static shapes), range -> runnable (symbolic shapes)
        self._by_size: dict[int, Callable[..., Any]] = {}
        self._by_range: list[tuple[Range, Callable[..., Any]]] = []
        self._static: Callable[..., Any] | None = None
        # compile this one size with static shapes and nothing else (a trace the model serves
        # at that size only; see CompileBackend._static_size)
        self.static_size = static_size
        self.compile_seconds = 0.0

    def _other_dynamic_dims(self) -> bool:
        """Whether a symbol other than the batch size's shapes the piece's arguments."""
        assert self.size_source is not None
        index, dim = self.size_source.index, self.size_source.dim
        arg = self.fake_args[index]
        batch = arg if dim is None else arg.shape[dim]
        own = batch.node.expr.free_symbols
        for value in self.fake_args:
            sizes = [value] if isinstance(value, torch.SymInt) else (
                [*value.shape, *value.stride()] if isinstance(value, torch.Tensor) else [])
            for size in sizes:
                if isinstance(size, torch.SymInt) and size.node.expr.free_symbols - own:
                    return True
        return False

    @property
    def entries(self) -> list[Range]:
        """Every compiled entry: ranges first, then the extra single sizes."""
        return [r for r, _ in self._by_range] + [Range(s, s) for s in self._by_size]

    def compile_all(self) -> None:
        """Compile every entry up front, so no step ever pays for a compile."""
        start = time.perf_counter()
        if self.static_size is not None and self.size_source is not None:
            size = self.static_size
            self._by_size[size] = self._manager.compile(
                self.graph, concrete_inputs(self.fake_args, size), Range(size, size),
                self.piece_index)
        elif self.size_source is None:
            # No bare size symbol reaches this piece (static shapes, or only expressions such
            # as 2*s0): one compile over the whole range serves every batch.
            full = Range(1, self.max_num_tokens)
            self._static = self._manager.compile(self.graph, self.fake_args, full,
                                                 self.piece_index, graph_key=self.graph_key)
        else:
            for r in self.compile_ranges:
                self._by_range.append(
                    (r, self._manager.compile(self.graph, self.fake_args, r, self.piece_index,
                                              graph_key=self.graph_key)))
            sizes = self.compile_sizes
            if sizes and self._other_dynamic_dims():
                # a static entry fixes every size; with another dynamic dim (a sequence
                # length) the batch size alone does not say which: the ranges serve them
                logger.info("piece %d: compile_sizes %s are not compiled statically: the "
                            "piece has dynamic dims besides the batch size, which static code "
                            "would fix; its compile ranges serve those sizes",
                            self.piece_index, list(sizes))
                sizes = ()
            for size in sizes:
                if any(r.start == r.end == size for r in self.compile_ranges):
                    continue
                single = Range(size, size)
                # keyed by the concrete inputs' own hash (the manager computes it)
                self._by_size[size] = self._manager.compile(
                    self.graph, concrete_inputs(self.fake_args, size), single,
                    self.piece_index)
        self.compile_seconds = time.perf_counter() - start
        logger.info("piece %d: compiled %d entr%s in %.3f s", self.piece_index,
                    max(1, len(self._by_range) + len(self._by_size)),
                    "y" if len(self._by_range) + len(self._by_size) <= 1 else "ies",
                    self.compile_seconds)

    def runnable_for(self, size: int) -> Callable[..., Any]:
        """The entry for ``size``: an exact compile size wins over the range containing it."""
        fn = self._by_size.get(size)
        if fn is not None:
            return fn
        for r, fn in self._by_range:
            if r.start <= size <= r.end:
                return fn
        if size < 1:
            raise ShapeOutOfRangeError(
                f"piece {self.piece_index}: runtime size {size}; compiled pieces run batches of "
                "at least 1 token, so skip empty batches before calling the model")
        ranges = ", ".join(str(r) for r in self.compile_ranges)
        raise ShapeOutOfRangeError(
            f"piece {self.piece_index}: runtime size {size} is outside every compile range "
            f"({ranges}; single sizes {list(self.compile_sizes)}); the ranges end at "
            f"max_num_tokens={self.max_num_tokens}. Raise max_num_tokens in the "
            f"CompilationConfig to at least {size}, or split the batch")

    def entry_for(self, args: Sequence[Any]) -> Callable[..., Any]:
        """The compiled entry a call with ``args`` runs."""
        if self._static is not None:
            return self._static
        if self.size_source is None:
            raise RuntimeError(f"piece {self.piece_index} was called before compile_all()")
        return self.runnable_for(self.size_source.read(args))

    def __call__(self, *args: Any) -> Any:
        return self.entry_for(args)(*args)
