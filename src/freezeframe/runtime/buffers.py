"""The runner's static input buffers: where each step's inputs are copied, padded and watched.

A captured graph reads its inputs at the addresses it saw at capture, so every step copies its
inputs into the same buffers (one per input, sized for the largest step) and resets the padded
rows to the input's ``fill`` value, so nothing of an earlier, larger step leaks into the
padding::

    Tokens input "x", max_num_tokens 8, a step of 3 rows padded to 4

    buffer rows   0 1 2 | 3     | 4 5 6 7
                  real  | fill  | not read by this step (reset only when a later step pads
                                  over them: fill_from tracks the first row that may not
                                  hold the fill value)

After the step, the inputs the model wrote into (a moved version counter, or a write a
captured graph is known to make) are copied back into the caller's tensors: the real rows of a
``Tokens``/``Requests`` input, all of a ``Static`` one, as running the model eagerly on the
caller's tensors would have written them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from freezeframe.batch import BatchDescriptor, mixed_step_reqs
from freezeframe.config import CompilationConfig
from freezeframe.errors import InputMismatchError
from freezeframe.graphs.capturable import Capturable
from freezeframe.graphs.stores import public_attributes
from freezeframe.runtime.inputs import InputSpec
from freezeframe.runtime.outputs import map_tensors  # (the one walk of an output tree)
from freezeframe.stats import Stats

__all__ = ["Padding", "SavedBuffers", "Slot", "Staging", "StaticBuffers", "alias", "map_tensors",
           "share_elements"]

Slot = tuple[str, str, torch.Tensor]  # (input name, kind, buffer)
_version = operator.attrgetter("_version")


@dataclasses.dataclass(frozen=True, slots=True)
class Padding:
    """The padded tail ``[start, stop)`` of one input's buffer at one step shape."""

    name: str
    view: torch.Tensor
    fill: Any
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class Staging:
    """Where a step of one shape goes: per input (in spec order) its name, the buffer view its
    real rows are copied into and how many leading buffer rows that copy overwrites; and the
    padded tails to reset."""

    names: tuple[str, ...]
    targets: list[torch.Tensor]
    padding: tuple[Padding, ...]
    rows: tuple[int, ...]


class StaticBuffers:
    """One static buffer per runner input; staging, padding and written-input tracking."""

    def __init__(self, specs: Mapping[str, InputSpec], config: CompilationConfig,
                 device: torch.device, stats: Stats) -> None:
        self.specs = specs
        self.device = device
        self._stats = stats
        # Always normal tensors (not inference tensors, even when the runner is built under
        # inference_mode): the runner writes into them outside inference mode, and their
        # version counters tell which inputs the model wrote into.
        with torch.inference_mode(False):
            self.buffers: dict[str, torch.Tensor] = {
                name: torch.full(spec.buffer_shape(config.max_num_tokens, config.max_num_seqs),
                                 spec.fill, dtype=spec.dtype, device=device)
                for name, spec in specs.items()}
        self.buffer_list = list(self.buffers.values())  # in the order of specs
        self.slots: list[Slot] = [(name, spec.kind, self.buffers[name])
                                  for name, spec in specs.items()]
        # Per buffer: the rows from this index on are known to hold the input's fill value (a
        # step whose padding lies there need not reset it). Staging and the model's writes
        # raise it; a refill of the whole buffer brings it back to 0.
        self.fill_from: dict[str, int] = dict.fromkeys(self.buffers, 0)
        # The staging of the last step, while nothing else wrote the buffers since: a step of
        # the same shape then finds its padding reset already (see stage_into)
        self.staged: Staging | None = None
        # (tokens, padded tokens, requests, padded requests) -> where a step is staged
        self._stagings: dict[tuple[int, int, int | None, int | None], Staging] = {}

    # -- staging ----------------------------------------------------------------------------
    def staging(self, num_tokens: int, padded_tokens: int, reqs: int | None,
                padded_reqs: int | None) -> Staging:
        """Where a step of this shape is copied (made once per shape, then kept)."""
        key = (num_tokens, padded_tokens, reqs, padded_reqs)
        staging = self._stagings.get(key)
        if staging is None:
            staging = self._stagings[key] = self._new_staging(*key)
        return staging

    def stage(self, values: Mapping[str, torch.Tensor], num_tokens: int, padded_tokens: int,
              reqs: int | None, padded_reqs: int | None) -> None:
        """Copy the step into the buffers and reset the padded tail to each input's fill. A
        step makes one copy launch for all inputs, and a fill only where an earlier step or
        the model may have written the padding."""
        staging = self.staging(num_tokens, padded_tokens, reqs, padded_reqs)
        self.stage_into(staging, [values[name] for name in staging.names])

    def stage_into(self, staging: Staging, sources: Sequence[torch.Tensor]) -> None:
        """Copy ``sources`` (one per input, in spec order) to where ``staging`` says and reset
        the padding rows that may not hold the fill value."""
        # (no autograd: the step runs with grad mode off)
        if len(sources) == 1:
            staging.targets[0].copy_(sources[0])
        else:
            torch._foreach_copy_(staging.targets, list(sources))
        if staging is self.staged:
            return  # this shape was staged last and nothing wrote the buffers since
        fill_from = self.fill_from
        for pad in staging.padding:
            if fill_from[pad.name] > pad.start:
                pad.view.fill_(pad.fill)
                if fill_from[pad.name] <= pad.stop:
                    fill_from[pad.name] = pad.start
        for name, real in zip(staging.names, staging.rows, strict=True):
            if real > fill_from[name]:
                fill_from[name] = real
        self.staged = staging

    def _new_staging(self, num_tokens: int, padded_tokens: int, reqs: int | None,
                     padded_reqs: int | None) -> Staging:
        names: list[str] = []
        targets: list[torch.Tensor] = []
        padding: list[Padding] = []
        rows: list[int] = []
        for name, spec in self.specs.items():
            buf = self.buffers[name]
            names.append(name)
            if spec.kind == "static":
                targets.append(buf)
                rows.append(rows_of(buf))  # every row of a static input is data
                continue
            real = num_tokens if spec.kind == "tokens" else (reqs or 0)
            padded = padded_tokens if spec.kind == "tokens" else (padded_reqs or real)
            targets.append(buf[:real])
            rows.append(real)
            if padded > real:
                padding.append(Padding(name, buf[real:padded], spec.fill, real, padded))
        return Staging(tuple(names), targets, tuple(padding), tuple(rows))

    def views(self, padded_tokens: int, padded_reqs: int | None) -> dict[str, torch.Tensor]:
        """The buffer views a step of this padded size passes to the model."""
        views = {}
        for name, spec in self.specs.items():
            buf = self.buffers[name]
            if spec.kind == "tokens":
                views[name] = buf[:padded_tokens]
            elif spec.kind == "requests":
                views[name] = buf[:padded_reqs or 0]
            else:
                views[name] = buf
        return views

    def reset_padding(self) -> None:
        """Fill every token and request buffer with its input's fill value (after capture's
        dummy steps, or a step that raised, wrote who knows which rows): from here on, a step
        resets only the padded rows an earlier step may have written."""
        self.staged = None
        with torch.no_grad():
            for name, spec in self.specs.items():
                if spec.kind != "static":
                    self.buffers[name].fill_(spec.fill)
                    self.fill_from[name] = 0

    def fill_dummy(self, desc: BatchDescriptor, max_num_seqs: int) -> tuple[int, int]:
        """Fill the buffers for a dummy step of ``desc`` (a warm-up or a capture): every row,
        real or padded, holds the fill value. Its token and request counts."""
        tokens = desc.num_tokens
        reqs = desc.num_reqs if desc.num_reqs is not None else mixed_step_reqs(tokens, max_num_seqs)
        self.staged = None
        with torch.no_grad():
            for name, spec in self.specs.items():
                if spec.kind != "static":
                    rows = tokens if spec.kind == "tokens" else reqs
                    self.buffers[name][:rows].fill_(spec.fill)
        return tokens, reqs

    # -- what the model wrote ---------------------------------------------------------------
    def versions(self) -> list[int]:
        """Each buffer's version counter, in spec order (a planned step's write check)."""
        return list(map(_version, self.buffer_list))

    def written(self, versions: list[int], graph_writes: frozenset[str] | None) -> list[Slot]:
        """The input slots the step wrote into.

        A write shows as a moved version counter: every in-place op that goes through the
        dispatcher bumps it (eager code, an emulated replay, Inductor's compiled code). A CUDA
        graph replay writes without the dispatcher, so for a replayed graph the inputs its
        capture wrote into (``graph_writes``) count too. The padding of a written buffer may
        hold anything after the step: it is reset before the next step that pads over it."""
        slots = [(name, kind, buf) for (name, kind, buf), before
                 in zip(self.slots, versions, strict=True)
                 if buf._version != before or (graph_writes is not None and name in graph_writes)]
        for name, _, buf in slots:
            self.fill_from[name] = rows_of(buf)
            self.staged = None
        return slots

    def copy_back(self, values: Mapping[str, torch.Tensor], slots: list[Slot],
                  num_tokens: int, reqs: int | None) -> list[str]:
        """Write each written input slot back into the caller's tensor, as running the model
        eagerly on that tensor would have: the real rows of a token or request input (never
        the padding), all of a static one. Returns the names copied."""
        copied: list[str] = []
        for name, kind, buf in slots:
            target = values[name]
            # An inference tensor (an earlier output passed back in) is written the way it
            # was made; any other tensor outside autograd, as eager's in-place op would be.
            mode = torch.inference_mode() if target.is_inference() else torch.no_grad()
            with mode:
                if kind == "static":
                    target.copy_(buf)
                else:
                    target.copy_(buf[:num_tokens if kind == "tokens" else (reqs or 0)])
            self._stats.inc("inputs_copied_back")
            copied.append(name)
        return copied

    # -- inputs sharing memory --------------------------------------------------------------
    def aliased(self, values: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], ...]:
        """Groups of inputs whose byte ranges overlap (the same tensor passed twice, views of
        one storage); :meth:`refuse_written_alias` confirms that they share an element before
        it refuses (``t[:, :2]`` and ``t[:, 2:]`` interleave but share none)."""
        if len(self.slots) < 2:
            return ()
        spans = sorted((*span, name) for name in self.specs
                       if (span := byte_span(values[name])) is not None)
        groups: list[list[str]] = []
        end = -1
        for start, stop, name in spans:
            if start < end:
                groups[-1].append(name)
            else:
                groups.append([name])
            end = max(end, stop)
        return tuple(tuple(g) for g in groups if len(g) > 1)

    @staticmethod
    def refuse_written_alias(values: Mapping[str, torch.Tensor],
                             aliased: tuple[tuple[str, ...], ...],
                             written: Collection[str]) -> None:
        """Eagerly, a write into one of two inputs that share memory shows through the other;
        the runner stages each input in a buffer of its own, so it would not."""
        for group in aliased:
            for hit in (n for n in group if n in written):
                other = next((n for n in group
                              if n != hit and share_elements(values[hit], values[n])), None)
                if other is None:
                    continue
                raise InputMismatchError(
                    f"inputs {hit!r} and {other!r} share memory and the model writes "
                    f"into {hit!r}: eagerly that write would show through {other!r}, "
                    "but the runner stages each input in a buffer of its own, so the step "
                    f"would not give eager's answer. Pass separate tensors (e.g. "
                    f"{other}={other}.clone())")


def detach_from_written(out: Any, values: Mapping[str, torch.Tensor],
                        slots: list[Slot]) -> Any:
    """An output leaf that shares memory with an input about to be written back (the previous
    step's output passed in again, to a model that writes its input) is cloned first: the
    copy-back would otherwise overwrite the answer."""
    targets = [values[name] for name, _, _ in slots]
    if not targets:
        return out
    return map_tensors(out, lambda t: t.clone() if any(
        share_elements(t, target) for target in targets) else t)


class SavedBuffers:
    """The model's buffers and attributes as they were before ``capture()``, to undo what its
    dummy steps did to them.

    Buffers: what the steps wrote into them (a running count, a KV cache). A copy on the device
    when the buffers fit in ``DEVICE_LIMIT`` bytes, or in ``device_room`` (a lazy or background
    capture of one key passes half the device's free memory: a whole KV cache copied to the
    host and back per key would cost about a second per 10 GiB), on the host otherwise;
    restored in place (graphs keep the addresses), and only where the version counter moved.

    Attributes: what forward stored on any of the module's submodules (``self.last = out``
    leaves a dummy step's output there): each public attribute's binding is put back, and one
    the steps added is deleted. An object changed in place (a list appended to) is not
    followed."""

    DEVICE_LIMIT = 256 << 20

    def __init__(self, model: Any, device_room: int = 0) -> None:
        named = model.named_buffers() if isinstance(model, torch.nn.Module) else ()
        buffers = [b for _, b in named]
        total = sum(b.numel() * b.element_size() for b in buffers)
        on_device = total <= max(self.DEVICE_LIMIT, device_room)
        self.on_device = on_device
        self.saved: list[tuple[torch.Tensor, int | None, torch.Tensor]] = []
        with torch.no_grad():
            for buf in buffers:
                copy = buf.detach().clone() if on_device else buf.detach().to("cpu", copy=True)
                self.saved.append((buf, version_of(buf), copy))
        # the user's module (a compiled model's own attributes are its bookkeeping)
        root = model.module if isinstance(model, Capturable) else model
        self.bindings: list[tuple[dict[str, Any], dict[str, Any]]] = [
            (vars(sub), public_attributes(vars(sub))) for sub in root.modules()
        ] if isinstance(root, torch.nn.Module) else []

    def restore_attributes(self) -> int:
        """Put back the attributes' bindings (see the class docstring); how many changed."""
        restored = 0
        for attrs, saved in self.bindings:
            for name, value in saved.items():
                if attrs.get(name, _ABSENT) is not value:
                    attrs[name] = value
                    restored += 1
            for name in [k for k in public_attributes(attrs) if k not in saved]:
                del attrs[name]
                restored += 1
        self.bindings.clear()
        return restored

    def restore(self) -> int:
        restored = 0
        for buf, version, copy in self.saved:
            if version is not None and version_of(buf) == version:
                continue
            with torch.inference_mode(buf.is_inference()), torch.no_grad():
                buf.copy_(copy)
            restored += 1
        self.saved.clear()
        return restored


_ABSENT = object()


def rows_of(buf: torch.Tensor) -> int:
    return int(buf.shape[0]) if buf.dim() else 0


def version_of(t: torch.Tensor) -> int | None:
    """The version counter, or None for an inference tensor (it has none)."""
    return None if t.is_inference() else t._version


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``t`` can touch, ``[start, stop)``, or None for an empty tensor."""
    start = t.data_ptr()
    if not start or not t.numel():
        return None
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have an element in common: their byte ranges overlap and,
    unless both are plain ranges, their element offsets in the storage meet (computed on
    the CPU from the strides; conservatively True when the element sizes differ)."""
    span_a, span_b = byte_span(a), byte_span(b)
    if span_a is None or span_b is None or span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or \
            a.element_size() != b.element_size() or (a.is_contiguous() and b.is_contiguous()):
        return True
    size = a.untyped_storage().nbytes() // a.element_size()
    index = torch.arange(size, dtype=torch.int64)

    def offsets(t: torch.Tensor) -> torch.Tensor:
        return index.as_strided(t.shape, t.stride(), t.storage_offset()).flatten()

    return bool(torch.isin(offsets(a), offsets(b)).any())


def alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # a new tensor object on the same memory
