"""Counting, on the CPU, the kernel launches one step would make on a GPU.

:class:`LaunchCensus` is a dispatch mode that counts, per piece of a split model (the pieces
between two calls of the splitting op), every aten op that launches a kernel on a GPU (views,
allocations and metadata ops launch none), and inside each call of the splitting op its aten
launches and its Triton kernel launches (counted by Triton's own pre-run hook, which runs for a
compiled kernel and for the interpreter alike). The copies Triton's interpreter makes to hand
CPU tensors to a kernel are its own, not the step's, and are not counted.

:func:`inductor_kernels` reads the kernels Inductor generates for one FX graph (its pieces'
``call()``: each fused kernel and each external call such as a matrix product) without
compiling them: the generated code is caught as Inductor saves it and the compile is stopped
before its C++ is built (seconds, where a full CPU compile takes tens of seconds).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel: allocation without a fill, metadata, aliasing
_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
              "_reshape_alias", "lift_fresh", "set_", "sym_size", "sym_stride", "sym_numel",
              "sym_storage_offset", "resize_", "_unsafe_view", "detach"}
_INTERPRETER = "triton/runtime/interpreter.py"


def _from_triton_interpreter() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_INTERPRETER):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def launches_a_kernel(func: Any, args: Any, result: Any) -> bool:
    """Whether the aten op ``func`` launched a kernel (would launch one on a GPU): an op whose
    schema says it may alias its input (a view, or ``to`` and the like) launches one only when
    its result has a storage of its own."""
    if getattr(func, "is_view", False):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return isinstance(result, torch.Tensor) and first is not None \
            and result.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    return func.overloadpacket.__name__ not in _NO_LAUNCH


class LaunchCensus(TorchDispatchMode):
    """``pieces[i]``: aten launches of the i-th stretch between splitting-op calls (piece
    ``2 i`` of the split graph); ``op_aten[j]`` and ``op_triton[j]``: aten and Triton launches
    inside the j-th call of the splitting op ``op`` (run through its Python implementation
    ``impl``, under this mode), Triton ones by kernel name."""

    def __init__(self, op: Any, impl: Any, triton_kernels: Iterable[Any]) -> None:
        super().__init__()
        self.op = op
        self.impl = impl
        self.kernels = list(triton_kernels)
        self.pieces: list[Counter[str]] = [Counter()]
        self.op_aten: list[Counter[str]] = []
        self.op_triton: list[Counter[str]] = []
        self._inside = False
        self._depth = 0
        self._hooks: list[tuple[Any, Any]] = []

    def _hook(self, kernel: Any) -> Any:
        name = kernel.__name__

        def count(*args: Any, **kwargs: Any) -> None:
            (self.op_triton[-1] if self._inside else self.pieces[-1])["triton:" + name] += 1

        return count

    def __enter__(self) -> LaunchCensus:
        if self._depth == 0:  # the mode is entered again around each splitting-op call
            self._hooks = [(kernel, self._hook(kernel)) for kernel in self.kernels]
            for kernel, hook in self._hooks:
                kernel.add_pre_run_hook(hook)
        self._depth += 1
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            for kernel, hook in self._hooks:
                kernel.pre_run_hooks.remove(hook)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is self.op:
            self.op_aten.append(Counter())
            self.op_triton.append(Counter())
            self._inside = True
            try:
                with self, torch.no_grad():  # count the ops its implementation runs
                    return self.impl(*args, **kwargs)
            finally:
                self._inside = False
                self.pieces.append(Counter())
        result = func(*args, **kwargs)
        if launches_a_kernel(func, args, result) and not _from_triton_interpreter():
            (self.op_aten[-1] if self._inside else self.pieces[-1])[str(func.overloadpacket)] += 1
        return result

    def op_launches(self, call: int) -> int:
        return sum(self.op_aten[call].values()) + sum(self.op_triton[call].values())


_CALL = re.compile(r"^\s+(?:(?P<ext>extern_kernels\.\w+|aten\.\w+(?:\.\w+)?)|"
                   r"(?P<kernel>[A-Za-z_]\w*))\((?!\)).*$", re.MULTILINE)


class _Stop(Exception):
    """Raised once Inductor has handed over its generated code: no C++ is compiled."""


def inductor_kernels(graph: torch.fx.GraphModule) -> list[str]:
    """The kernels (Inductor's fused kernels and external calls) that Inductor's ``call()``
    for ``graph`` launches, in order, with the graph's placeholders' fake values as inputs."""
    from torch._inductor import config
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering

    values = [node.meta.get("val", node.meta.get("example_value"))
              for node in graph.graph.nodes if node.op == "placeholder"]
    codes: list[str] = []

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _Stop

    fake_mode = torch._guards.detect_fake_mode(values)
    with config.patch({"fx_graph_cache": False}), \
            mock.patch.object(GraphLowering, "save_output_code", codes.append), \
            mock.patch.object(PyCodeCache, "load_by_key_path", stop), torch.no_grad():
        try:
            with fake_mode:
                compile_fx(graph, values)
        except Exception as exc:  # Inductor wraps the stop in its own error
            if not codes:
                raise RuntimeError("Inductor produced no code for the piece") from exc
    return _launched(codes[-1])


def _launched(code: str) -> list[str]:
    """The kernel calls of generated code's ``call()`` body."""
    body = code[code.index("    def call(self, args):"):]
    body = body[:body.index("\n        return ")]
    kernels = {m.group(1) for m in re.finditer(r"^(\w+) = async_compile\.\w+\(", code,
                                               re.MULTILINE)}
    found = []
    for match in _CALL.finditer(body):
        name = match.group("ext") or match.group("kernel")
        if match.group("ext") or name in kernels:
            found.append(name)
    return found


def attention_triton_kernels() -> list[Any]:
    """Every Triton kernel of the attention op's modules, once each (the modules this checkout
    has: the scripts run against other checkouts too)."""
    import importlib

    found: dict[int, Any] = {}
    for name in ("freezeframe.models.attention_kernels",
                 "freezeframe.models.paged_attention_triton"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for value in vars(module).values():
            if hasattr(value, "add_pre_run_hook") and hasattr(value, "pre_run_hooks"):
                found[id(value)] = value
    return list(found.values())
