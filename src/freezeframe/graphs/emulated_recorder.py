"""The emulated backend's recorder: a dispatch mode that runs a capture's ops and records each.

:class:`Recorder` is the ``emulated`` graph backend's capture (:mod:`freezeframe.graphs.emulated`
replays what it records). It runs every ATen operation of the captured region for real and
records it as a step, with the exact tensor objects it read and wrote; it refuses an op that
would synchronize the host with the device during a CUDA capture; and it notes the storages
allocated during the capture (the graph's own memory). A recorded step re-runs its op on the
captured tensors and copies the results into the tensors the capture produced.

Custom ops. A custom op reaches the dispatch mode as one call. If it has a Python body, the
body is run with the recorder still active, so its ATen operations are recorded and its Python
(a counter, logging) does not run on replay — exactly as on a GPU, where only the kernels the
body launched are in the graph. A custom op whose kernel shows the recorder no ATen work
(a C++ kernel) is recorded as one step and called again on replay.

Collectives. A process group's ops (the ``c10d`` namespace, which ``torch.distributed`` and its
functional collectives call) run asynchronously and return a ``Work``; their schemas do not say
which tensors they write. Each is recorded whatever its schema shows, and a replay waits for
its ``Work`` before the next step, as a captured NCCL kernel is ordered on the stream before
the kernels after it (without the wait, the op after a replayed all-reduce read a half-reduced
buffer: the functional ``wait_tensor`` finds nothing to wait for on replay).

Opaque kernels. Inductor's fused CPU kernels write through raw pointers that a dispatch mode
cannot see. :func:`opaque` marks such a callable as one unit: during an emulated capture it is
recorded as one step that calls it on the captured tensors and copies its outputs into the
captured outputs on replay; outside a capture it simply calls through.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from freezeframe.errors import CaptureError

__all__ = ["Recorder", "Step", "active_recorder", "is_opaque", "opaque"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

_OPAQUE_ATTR = "__freezeframe_opaque__"
_aten = torch.ops.aten
# the namespace of a process group's ops (see "Collectives" in the module docstring)
_COLLECTIVES = "c10d"

# Ops that only allocate: their contents are undefined, so replay must not touch the buffer
# they produced (a real graph does not re-allocate either; the memory keeps what it holds).
_ALLOCATION_ONLY = frozenset({
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
})

# Ops that read a tensor's value into a Python object: on a GPU they block on the device.
_HOST_READS = frozenset({
    _aten._local_scalar_dense.default,
    _aten.item.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten.allclose.default,
})

# Indexing ops whose output shape or kernel depends on data only when an index is a mask.
_MASKABLE_INDEXING = frozenset({
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
})


def _host_sync_reason(func: torch._ops.OpOverload, args: Sequence[Any],
                      kwargs: dict[str, Any]) -> str | None:
    """Why running ``func`` inside a captured region would need the host to wait for the
    device, or ``None`` when it would not."""
    if func in _HOST_READS or torch.Tag.data_dependent_output in func.tags:
        return "it reads a tensor value back to Python (.item(), bool(t), int(t), t.tolist())"
    if func in _MASKABLE_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        for index in indices or ():
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                return ("boolean-mask indexing has a data-dependent shape (it runs nonzero); "
                        "use torch.where or masked_fill instead")
        return None
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size has a data-dependent shape"
    if func is _aten.one_hot.default:
        num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return ("one_hot without num_classes reads the maximum back to the host"
                if num_classes == -1 else None)
    if torch.Tag.dynamic_output_shape in func.tags:
        return "its output shape depends on tensor values"
    return None


def _fresh_outputs(func: torch._ops.OpOverload, out: Any) -> list[torch.Tensor]:
    """The tensors ``func`` returned that are new memory (not an alias of an argument).

    Aliased returns (``add_`` returns ``self``, ``mul.out`` returns ``out``) need no copy on
    replay: re-running the op updates the aliased argument in place.
    """
    returns = func._schema.returns
    values = out if len(returns) > 1 else (out,)
    fresh: list[torch.Tensor] = []
    for ret, value in zip(returns, values, strict=False):
        if ret.alias_info is not None:
            continue
        fresh.extend(leaf for leaf in pytree.tree_leaves(value)
                     if isinstance(leaf, torch.Tensor))
    return fresh


def _mutates_an_argument(func: torch._ops.OpOverload) -> bool:
    return any(arg.alias_info is not None and arg.alias_info.is_write
               for arg in func._schema.arguments)


def _copy_into(targets: Sequence[torch.Tensor], results: Sequence[torch.Tensor],
               what: str) -> None:
    if len(targets) != len(results):
        raise CaptureError(
            f"emulated replay of {what} produced {len(results)} tensors but the capture "
            f"produced {len(targets)}; the region is not deterministic in structure, so it "
            "cannot be captured")
    for dst, src in zip(targets, results, strict=True):
        if dst is not src:
            dst.copy_(src)


def _wait_for_work(result: Any) -> None:
    """Wait for every ``Work`` a replayed collective returned (see the module docstring)."""
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
            leaf.wait()


def _clone_containers(tree: Any) -> Any:
    """Same leaves, new lists/tuples/dicts: a callee that clears its argument list (Inductor's
    boxed convention) must not empty the recorded one."""
    return pytree.tree_map(lambda leaf: leaf, tree)


def _pinned(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a new tensor object on the same memory (as it is
    now: storage, offset, shape, strides; sharing the tensor's version counter). A CUDA graph
    reads the addresses it captured; a step that held the tensor objects themselves would
    follow ``t.data = other`` to the new memory on replay, which a CUDA replay never does."""
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, tree)


class _OpStep:
    """One recorded ATen (or invisible custom) operation."""

    __slots__ = ("args", "func", "kwargs", "targets")

    def __init__(self, func: torch._ops.OpOverload, args: tuple[Any, ...],
                 kwargs: dict[str, Any], targets: list[torch.Tensor]) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.targets = targets  # the capture's fresh outputs: replay writes into these

    @property
    def name(self) -> str:
        return str(self.func)

    def pin(self) -> None:
        self.args, self.kwargs = _pinned(self.args), _pinned(self.kwargs)

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.func.namespace == _COLLECTIVES:
            _wait_for_work(result)
        if self.targets:
            fresh = ([t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
                     if self.func.is_view else _fresh_outputs(self.func, result))
            _copy_into(self.targets, fresh, self.name)


class _OpaqueStep:
    """One call of an :func:`opaque` callable on the captured tensors."""

    __slots__ = ("args", "fn", "kwargs", "targets")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 targets: list[torch.Tensor]) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.targets = targets

    @property
    def name(self) -> str:
        return f"opaque:{getattr(self.fn, '__qualname__', type(self.fn).__name__)}"

    def pin(self) -> None:
        self.args, self.kwargs = _pinned(self.args), _pinned(self.kwargs)

    def run(self) -> None:
        result = self.fn(*_clone_containers(self.args), **_clone_containers(self.kwargs))
        leaves = [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        _copy_into(self.targets, leaves, self.name)


Step = _OpStep | _OpaqueStep


def _aliases_an_input(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether every tensor ``out`` holds shares storage with a tensor argument."""
    inputs = {t.untyped_storage().data_ptr()
              for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return all(t.untyped_storage().data_ptr() in inputs for t in outs)


class Recorder(TorchDispatchMode):
    """Runs every ATen op for real and records it with the exact tensors it touched.

    A dispatch mode is active on one thread only. ``joining`` makes a recorder for another
    thread that appends to ``joining``'s steps (and reports inference mode to it), so work
    handed between threads one at a time is recorded in the order it ran."""

    def __init__(self, joining: Recorder | None = None) -> None:
        super().__init__()
        self._root: Recorder = joining._root if joining is not None else self
        self.steps: list[Step] = self._root.steps if joining is not None else []
        self.saw_inference = False  # whether any op ran under inference_mode (root only)
        self._recorded = 0  # steps this recorder appended (another thread appends to steps too)
        # Addresses of the storages allocated during the capture (shared with joiners): the
        # graph's own memory, as opposed to the inputs and weights it reads. Addresses only, so
        # a temporary the graph does not keep is not kept alive by this set.
        self.born: set[int] = self._root.born if joining is not None else set()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile'd code run during a capture (a ``stock_torch_compile`` model) is
        recorded as the ops it runs, and Dynamo compiles with the recorder switched off. A mode
        that did not say so made Dynamo skip the frame, and mark its code object (shared by
        every instance of the class) as never to be compiled again: every later compile of
        the class failed ("found no compiled frames")."""
        return True

    def _append(self, step: Step) -> None:
        self.steps.append(step)
        self._recorded += 1

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any,
                           args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = dict(kwargs or {})
        args = tuple(args)
        reason = _host_sync_reason(func, args, kwargs)
        if reason is not None:
            raise CaptureError(
                f"{func} cannot run inside a captured graph: {reason}. On a GPU this would "
                "synchronize the host during capture and fail. Move it out of the captured "
                "region (compute it before the forward, or make the op a splitting op so it "
                "runs between graphs)")
        if torch.is_inference_mode_enabled():
            self._root.saw_inference = True
        if func.namespace not in ("aten", "prims", "prim"):
            return self._run_custom_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func: torch._ops.OpOverload, args: tuple[Any, ...],
                kwargs: dict[str, Any], out: Any) -> None:
        if func in _ALLOCATION_ONLY:
            # An allocation has no contents: nothing to replay, but its memory is the graph's
            # (a later ``out=`` op writes into it).
            self._note_born([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
            return
        if func.is_view and _aliases_an_input(args, kwargs, out):
            # A view aliases memory the graph already tracks. An op that *may* return a view
            # (``aten.to.dtype``, which reaches the mode under inference_mode) but returned new
            # memory is recorded like any other.
            return
        if func.is_view:  # returned new memory (see above): all of it is the step's output
            targets = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        else:
            targets = _fresh_outputs(func, out)
        self._note_born(targets)
        if not targets and not _mutates_an_argument(func):
            return  # a query with no effect on any tensor (e.g. a size or a flag)
        self._append(_OpStep(func, args, kwargs, targets))

    def _run_custom_op(self, func: torch._ops.OpOverload, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """Run a custom op's kernel with the recorder active, so a Python body is recorded as
        the ATen ops it runs; an op whose kernel shows us nothing is recorded whole."""
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors:
            keys = functools.reduce(lambda acc, t: acc | torch._C._dispatch_keys(t),
                                    tensors[1:], torch._C._dispatch_keys(tensors[0]))
        # Only the kernels below the Python key: the mode has already had its turn.
        keys = keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
        before = self._recorded
        with self:
            out = func.redispatch(keys, *args, **kwargs)
        if self._recorded == before:
            logger.debug("custom op %s showed no ATen work; recording it as one step", func)
            targets = _fresh_outputs(func, out)
            self._note_born(targets)
            if targets or _mutates_an_argument(func) or func.namespace == _COLLECTIVES:
                self._append(_OpStep(func, args, kwargs, targets))
        return out

    def _note_born(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            self.born.add(t.untyped_storage().data_ptr())

    def record_opaque(self, fn: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` once, unobserved, and record it as one step."""
        with torch.utils._python_dispatch._disable_current_modes():
            out = fn(*_clone_containers(args), **_clone_containers(kwargs))
        targets = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        # what the opaque call returned is new memory unless it is one of its arguments'
        read = {t.untyped_storage().data_ptr()
                for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self._note_born([t for t in targets if t.untyped_storage().data_ptr() not in read])
        self._append(_OpaqueStep(fn, _clone_containers(args), _clone_containers(kwargs),
                                 targets))
        return out


def active_recorder() -> Recorder | None:
    stack = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    for mode in reversed(stack):
        if isinstance(mode, Recorder):
            return mode
    return None


def opaque(fn: _F) -> _F:
    """Mark ``fn`` (typically an Inductor-compiled piece) as one unit for emulated graphs.

    During an emulated capture a call of the returned function is recorded as one step: on
    replay ``fn`` is called again on the captured argument tensors and its outputs are copied
    into the tensors the capture returned. Outside a capture it is exactly ``fn``. On the
    ``cuda`` backend it changes nothing (the kernels ``fn`` launches are captured directly).
    Marking twice is harmless.
    """
    if is_opaque(fn):
        return fn

    @functools.wraps(fn)
    def call_opaque(*args: Any, **kwargs: Any) -> Any:
        recorder = active_recorder()
        if recorder is None:
            return fn(*args, **kwargs)
        return recorder.record_opaque(fn, args, kwargs)

    setattr(call_opaque, _OPAQUE_ATTR, True)
    return call_opaque  # type: ignore[return-value]


def is_opaque(fn: Any) -> bool:
    """Whether ``fn`` came from :func:`opaque`."""
    return bool(getattr(fn, _OPAQUE_ATTR, False))
