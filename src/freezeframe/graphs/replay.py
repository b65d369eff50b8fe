"""Replay: one captured graph with the tensors it reads, and the one copy-in / replay /
copy-back that every replay of it makes.

A replay re-runs the captured work on the captured memory. Whoever replays a graph goes
through its :class:`Replay`: the :class:`~freezeframe.graphs.GraphWrapper` for a call it
recognises, a runner's planned PIECEWISE step (which calls the ``Replay`` in place of the
piece) and a planned FULL step on the runner's static buffers (:meth:`Replay.on_captured`).
So the rules for the arguments are stated here, once:

* an argument that is the captured tensor, or a view of its very memory laid out the same way,
  is read as it is (a few hundred nanoseconds of checks per tensor);
* a tensor of the captured shape, dtype and device at another address is copied into the
  captured one first (counted in ``replay_input_copies``, logged once per wrapper; refused with
  ``debug=True``), and copied back after the replay when the capturing call wrote into it
  (or may have: an inference tensor has no version counter to tell) — unless it is the
  graph's own output memory (its last output passed in again, ``y = f(y)``), which the replay
  has just filled with the answer;
* a captured tensor a new argument was copied into is put back as it was once the replay is
  done (unless it is the graph's output memory): the copy is the replay's own, not a write of
  the model's, and whoever holds the captured tensor (a runner's static buffers, or on the
  low-level path the caller's own buffer) must see only what the model wrote (a forward
  pre-hook that returns new inputs makes the replay copy them into the captured tensors,
  which eagerly would be the caller's untouched ones);
* anything else is an :class:`~freezeframe.errors.InputMismatchError` naming the argument: a
  replay cannot change a shape. The graph does not run.

Before (a piece's graph captured reading ``a``, which it writes into)::

    replay(b)          # b: a new tensor shaped like a

After::

    kept = a.clone(); a.copy_(b); graph.replay(); b.copy_(a); a.copy_(kept)
    # and the captured output is returned

A ``Replay`` counts into tallies its wrapper owns, so call it from one thread at a time (a
runner holds its lock; two threads replaying one graph at once would race on its memory
anyway). The tallies are the wrapper's, shared by its owners: two runners on one model stepping
at the same moment may lose a count, never an answer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor
from freezeframe.containers import tensor_leaves
from freezeframe.errors import InputMismatchError
from freezeframe.graphs.backend import CapturedGraph
from freezeframe.graphs.stores import AttributeStores
from freezeframe.stats import Stats, Tally

__all__ = ["Replay", "ReplayShared", "StaleReplay", "TensorArg", "layout_of", "tensor_args"]

logger = logging.getLogger(__name__)


class StaleReplay(Exception):
    """A :class:`Replay` was called after its graph was dropped (a clear, a recapture)."""


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """One tensor argument of the capturing call: where it was passed, and the tensor."""

    name: int | str  # argument position, or keyword name
    tensor: torch.Tensor

    @property
    def where(self) -> str:
        return where(self.name)


def where(name: int | str) -> str:
    """How an error names an argument: ``argument 0`` or ``keyword 'x'``."""
    return f"argument {name}" if isinstance(name, int) else f"keyword {name!r}"


def layout_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Which positional arguments are tensors, and the keywords with whether each is one."""
    return (tuple(isinstance(a, torch.Tensor) for a in args),
            tuple((k, isinstance(v, torch.Tensor)) for k, v in kwargs.items()))


def tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[TensorArg, ...]:
    named: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    return tuple(TensorArg(name, value) for name, value in named
                 if isinstance(value, torch.Tensor))


def _reads_captured(now: Any, then: torch.Tensor) -> bool:
    """Whether argument ``now`` is the captured tensor ``then``, or a view of its very memory
    laid out the same way: a replay reads it as it is, with no copy."""
    return now is then or (
        isinstance(now, torch.Tensor) and now.shape == then.shape and now.dtype == then.dtype
        and now.device == then.device and now.data_ptr() == then.data_ptr()
        and now.stride() == then.stride())


def _storages(output: Any) -> frozenset[int]:
    """The addresses of the storages of ``output``'s tensors (one without a plain storage, a
    sparse tensor, is left out)."""
    found = set()
    for leaf in tensor_leaves(output):
        try:
            found.add(leaf.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            continue
    return frozenset(found)


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.copy_(value)``, in inference mode where ``target`` is an inference tensor (a
    captured argument made in inference mode, or the caller's): only inference mode may write
    one, and the copy is the replay's own bookkeeping, whatever mode the call is in."""
    if target.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            target.copy_(value)
    else:
        target.copy_(value)


class ReplayShared:
    """What every :class:`Replay` of one wrapper shares: its mode's name (for messages), the
    ``debug`` switch, the two tallies it counts into (``replays``, ``replay_input_copies``),
    and whether the copy-in was logged yet."""

    __slots__ = ("copies", "copy_logged", "debug", "mode", "replays")

    def __init__(self, mode: str, debug: bool, stats: Stats) -> None:
        self.mode = mode
        self.debug = debug
        self.replays: Tally = stats.tally("replays")
        self.copies: Tally = stats.tally("replay_input_copies")
        self.copy_logged = False


class Replay:
    """One captured graph, its output and the tensor arguments it was captured reading.

    ``replay(*args, **kwargs)`` checks the arguments (see the module docstring), replays and
    returns the captured output (the same objects every time, overwritten by each replay).
    :meth:`drop` forgets the graph: a later call raises :class:`StaleReplay`."""

    __slots__ = ("_inputs", "_output_memory", "_shared", "graph", "key", "layout", "output",
                 "stores")

    def __init__(self, graph: CapturedGraph, output: Any, key: BatchDescriptor,
                 inputs: tuple[TensorArg, ...], written: tuple[bool, ...],
                 layout: tuple[Any, ...], shared: ReplayShared,
                 stores: AttributeStores | None = None) -> None:
        self.graph: CapturedGraph | None = graph
        # the attribute stores of the capturing call's Python, repeated after each replay
        self.stores = stores
        self.output = output
        self.key = key
        self.layout = layout  # which arguments were tensors, and the keyword names
        # (where it was passed, the captured tensor, whether the capturing call wrote into it)
        self._inputs = tuple((c.name, c.tensor, w)
                             for c, w in zip(inputs, written, strict=True))
        # the storages of the output: an argument in one of them gets no copy-back
        self._output_memory = _storages(output)
        self._shared = shared

    @property
    def live(self) -> bool:
        """Whether the graph is still held (not dropped by a clear or a recapture)."""
        return self.graph is not None

    @property
    def positional(self) -> bool:
        """Whether the capturing call passed every argument by position (a planned PIECEWISE
        step calls a piece's replay that way)."""
        return not self.layout[1]

    def drop(self) -> None:
        self.graph = None

    def reads_captured(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``args``/``kwargs`` are, tensor for tensor, the memory the graph was
        captured reading (same address, shape, strides, dtype and device)."""
        if layout_of(args, kwargs) != self.layout:
            return False
        return all(_reads_captured(args[name] if isinstance(name, int) else kwargs[name], then)
                   for name, then, _ in self._inputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.graph
        if graph is None:
            raise StaleReplay(f"the {self._shared.mode} graph for {self.key} was dropped")
        copied: list[tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor]] | None = None
        for name, then, written in self._inputs:
            now = args[name] if name.__class__ is int else kwargs[name]  # type: ignore[index]
            if now is then or _reads_captured(now, then):
                continue
            kept = self._copy_in(name, now, then)
            if copied is None:
                copied = []
            copied.append((now, then, written, kept))
        graph.replay()
        if copied is not None:
            self._after_copies(copied)
        if self.stores is not None:
            self.stores.repeat()
        self._shared.replays.n += 1
        return self.output

    def _after_copies(self, copied: list[tuple[torch.Tensor, torch.Tensor, bool,
                                               torch.Tensor]]) -> None:
        """After a replay that copied new arguments in: what the graph wrote into a copy
        reaches the caller's tensor, and the captured tensor is put back (see the module
        docstring); neither where it is the graph's output memory."""
        output = self._output_memory
        for now, then, written, kept in copied:
            if written and now.untyped_storage().data_ptr() not in output:
                _write(now, then)
            if then.untyped_storage().data_ptr() not in output:
                _write(then, kept)

    def on_captured(self) -> Any:
        """Replay on the very tensors of the capture, for a caller that checked its arguments
        once with :meth:`reads_captured` and always passes those (a runner's static buffers):
        nothing is checked per call."""
        graph = self.graph
        if graph is None:
            raise StaleReplay(f"the {self._shared.mode} graph for {self.key} was dropped")
        graph.replay()
        if self.stores is not None:
            self.stores.repeat()
        self._shared.replays.n += 1
        return self.output

    def _copy_in(self, name: int | str, now: Any, then: torch.Tensor) -> torch.Tensor:
        """Copy a new argument into the captured tensor, or refuse it. Returns the captured
        tensor as it was before the copy (to be put back)."""
        shared = self._shared
        if not isinstance(now, torch.Tensor) or now.shape != then.shape \
                or now.dtype != then.dtype or now.device != then.device:
            raise self._misfit(name, now, then)
        if shared.debug:
            raise self._moved(name, now, then)
        kept = then.clone()
        _write(then, now)
        shared.copies.n += 1
        if not shared.copy_logged:
            shared.copy_logged = True
            logger.info("%s of the %s graph for %s is a new tensor, not the captured one: it is "
                        "copied into the captured buffer before each such replay (counted in "
                        "stats.replay_input_copies); write into the captured buffer to avoid "
                        "the copy", where(name), shared.mode, self.key)
        return kept

    def _misfit(self, name: int | str, now: Any, then: torch.Tensor) -> InputMismatchError:
        graph = f"the {self._shared.mode} graph for {self.key}"
        if not isinstance(now, torch.Tensor):
            return InputMismatchError(
                f"{where(name)} of {graph} is {type(now).__name__}, but the graph was "
                "captured with a tensor there; call it with the same arguments it was "
                "captured with")
        rows = ""
        if now.dim() >= 1 and then.dim() == now.dim() and now.shape[1:] == then.shape[1:]:
            rows = (f" — {now.shape[0]} rows where the graph was captured with "
                    f"{then.shape[0]}: a replay would return {then.shape[0]} rows, some of "
                    "them stale")
        return InputMismatchError(
            f"{where(name)} of {graph} is {tuple(now.shape)} {now.dtype} on {now.device}, "
            f"but the graph was captured with {tuple(then.shape)} {then.dtype} on "
            f"{then.device}{rows}. A replay always works on the captured shape: pad the batch "
            "to the descriptor's size (the dispatcher's padded num_tokens) and pass that many "
            "rows")

    def _moved(self, name: int | str, now: torch.Tensor,
               then: torch.Tensor) -> InputMismatchError:
        return InputMismatchError(
            f"{where(name)} of the {self._shared.mode} graph for {self.key} has address "
            f"{now.data_ptr():#x} (strides {now.stride()}), but the graph was captured "
            f"reading address {then.data_ptr():#x} (strides {then.stride()}). debug=True "
            "refuses the copy a replay would otherwise make: write the new data into the "
            "captured buffer (captured.copy_(new), or a slice of a persistent buffer) instead "
            "of passing a new tensor")

    def refuse_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise: the call passes its arguments differently from the capturing call."""
        def shown(layout: tuple[Any, ...]) -> str:
            positional, keywords = layout
            parts = ["tensor" if t else "other" for t in positional]
            parts += [f"{k}={'tensor' if t else 'other'}" for k, t in keywords]
            return f"({', '.join(parts)})"

        raise InputMismatchError(
            f"the {self._shared.mode} graph for {self.key} was captured with arguments "
            f"{shown(self.layout)} but is replayed with {shown(layout_of(args, kwargs))}; a "
            "replay re-runs the captured work on the captured tensors, so call it with the "
            "same arguments it was captured with")
