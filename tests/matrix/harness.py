"""Runs one matrix case against eager PyTorch (see cases.py for what a case is).

For every call the eager reference is a copy of the module made just before it (so it has
every change made so far, and the state earlier calls left), given the same inputs under the
same grad mode, autocast and default dtype. The compiled path must then

- answer what eager answers: same structure (a dataclass or namedtuple stays one), dtypes and
  shapes; equal values (bit for bit where the guarantees promise it: the eager compiler on the
  batch the step ran; a runner step, which pads, and Inductor to a tolerance); under
  ``inference_mode=False`` and grad mode on, the same ``requires_grad`` and the same parameter
  gradients;
- leave what eager leaves: the inputs forward writes into, the module's parameters, buffers,
  tensor attributes (``self.last = out``; on a runner step their real rows) and the Python
  state forward writes (``self.seen["rows"] = n``);
- hand out a new tensor object each time, and two for two;
- or raise a ``FreezeframeError`` that docs/guarantees.md promises for what the case did
  (refusals.py; anything else is a failure of kind "refusal"), leaving the module's
  parameters and buffers as they were.

It fails on anything else: another answer, an exception from inside torch or freezeframe that
is not a ``FreezeframeError`` (unless eager raised the same type: the model's own error, or a
fault the case injected), grad mode / default dtype / autocast / forward context left changed.
The low-level context path pads its inputs itself, to the capture size it works out from the
case's ladder (not with the library's ``padded_size``). After the case, a fresh ``ff.compile``
and a plain ``torch.compile(fullgraph=True, backend="eager")`` of a small module and of the
case's own model class must still work (the health check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from torch import nn

import freezeframe as ff
from freezeframe.errors import FreezeframeError
from tests.matrix import models, refusals
from tests.matrix.cases import (
    RUNNER_VIAS,
    Call,
    Case,
    Change,
    describe,
    describe_event,
    generate,
    rerun_command,
)
from tests.matrix.changes import Changer, copy_module
from tests.matrix.oracle import (
    CallRecord,
    Failure,
    Outcome,
    clone,
    compare,
    compare_python_state,
    compare_state,
    global_state,
    leaves,
    python_state_of,
    state_of,
)

__all__ = ["CallRecord", "Failure", "Harness", "Outcome", "execute", "run_case"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M = ff.CUDAGraphMode
MAX_TOKENS = 16
DTYPES = {"float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int32": torch.int32}


def make_config(case: Case, cache_dir: str | None) -> ff.CompilationConfig:
    spec, graphs = case.spec, case.graph_mode != "none"
    fields: dict[str, Any] = dict(
        mode=case.mode, backend=case.compiler,
        splitting_ops=list(spec.splitting_ops) if case.split else None,
        cudagraph_mode=case.graph_mode,
        cudagraph_capture_sizes=list(case.ladder) if graphs else None,
        compile_ranges_endpoints=list(case.ranges) or None,
        compile_sizes=list(case.compile_sizes) or None, graph_backend="emulated",
        max_num_tokens=MAX_TOKENS, max_num_seqs=MAX_TOKENS, use_cache=bool(cache_dir),
        cache_dir=cache_dir or "", max_loras=case.max_loras,
        num_speculative_tokens=case.spec_tokens)
    if case.path == "microbatch":
        fields.update(micro_batching=True, num_micro_batches=2, micro_batch_decode_threshold=2,
                      micro_batch_prefill_threshold=4)
    return ff.CompilationConfig(**fields)


def padded_size(ladder: tuple[int, ...], size: int) -> int | None:
    """The capture size a low-level call of ``size`` rows pads to, worked out from the case's
    ladder alone (the library's own ``padded_size`` is what it checks)."""
    above = [s for s in ladder if s >= size and s <= MAX_TOKENS]
    return min(above) if above else None


def _grad_mode(name: str) -> Any:
    return {"grad": torch.enable_grad(), "no_grad": torch.no_grad(),
            "inference": torch.inference_mode()}[name]


@dataclasses.dataclass
class Prepared:
    """One call, ready to run both ways: where it goes, its inputs (``theirs`` for eager,
    ``mine`` for the compiled path), the graph mode and rows of a low-level call."""

    via: str
    mode: ff.CUDAGraphMode
    rows: int
    args: dict[str, Any]
    kwargs: dict[str, Any]
    theirs: dict[str, Any]
    mine: dict[str, Any]
    grad_check: bool


# -- one case on ff.compile / torch.compile ----------------------------------------------------
class Harness:
    def __init__(self, case: Case, cache_dir: str | None = None,
                 accept_wrong: bool = True) -> None:
        self.case, self.spec = case, case.spec
        self.module = models.build(self.spec, case.seed)
        dtype = DTYPES.get(case.dtype)
        if dtype is not None and dtype.is_floating_point:
            self.module.to(dtype)
        # the dtype of index inputs (ToyLlama's ids)
        self.index_dtype = dtype if dtype is not None and not dtype.is_floating_point \
            else torch.long
        self.cfg = make_config(case, cache_dir)
        self.compiled = self._compile()
        self.changer = Changer(self.module, self.compiled, case.seed)
        if dtype is not None and dtype.is_floating_point:
            self.changer.dtype = dtype
        self.runner: ff.GraphRunner | None = None
        self.second_runner: ff.GraphRunner | None = None
        self.answers: list[torch.Tensor] = []  # every tensor handed out, kept alive
        self.buffers: dict[str, torch.Tensor] = {}  # the context path's persistent inputs
        self.outcome = Outcome()
        self.whole_way = 0  # runner steps that went the whole way (see _runner)
        self.forms: set[tuple[bool, int]] = set()  # how context calls passed their arguments
        self.structures: set[tuple[Any, ...]] = set()  # call structures (each may trace)
        self.scalars: set[tuple[int, int]] = set()  # the Python scalars calls passed
        self.accept_wrong = accept_wrong  # accept the refusals wrong for a user (refusals.py)
        self.index = 0

    def _compile(self) -> Any:
        case = self.case
        if case.path.startswith("torch_compile"):
            dynamic = True if case.path == "torch_compile_dynamic" else None
            return torch.compile(self.module, backend="freezeframe",
                                 options={"config": self.cfg}, dynamic=dynamic)
        return ff.compile(self.module, self.cfg, inference_mode=case.inference_mode,
                          dynamic_arg_dims=self.spec.dynamic_dims)

    def run(self) -> Outcome:
        try:
            for index, event in enumerate(self.case.events):
                self.index = index
                if isinstance(event, Change):
                    self.changer.apply(event, index)
                elif event.threads > 1 and (event.via or self.case.path) in RUNNER_VIAS:
                    self.threaded_call(event, index)
                else:
                    self.call(event, index)
        finally:
            self.changer.undo_globals()
        stats = getattr(self.compiled, "stats", None)
        if stats is not None and hasattr(stats, "snapshot"):
            self.outcome.stats = dict(stats.snapshot())
        return self.outcome

    # -- the paths --------------------------------------------------------------------------
    @property
    def input_dtype(self) -> torch.dtype:
        return self.changer.dtype if self.spec.float_inputs else self.index_dtype

    def _runner(self, second: bool = False) -> ff.GraphRunner:
        runner = self.second_runner if second else self.runner
        if runner is None:
            assert self.spec.runner_inputs is not None
            runner = ff.GraphRunner(self.compiled, self.cfg,
                                    inputs=self.spec.runner_inputs(self.input_dtype),
                                    progress=False, capture_policy=self.case.policy,
                                    verify=self.case.verify, copy_outputs=self.case.threads)
            with torch.no_grad():
                runner.capture()
            # count the steps that go the whole way (make their plan now): a step that does
            # not runs a kept plan
            stepper = runner._stepper
            whole_way = stepper.plan

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.whole_way += 1
                return whole_way(*args, **kwargs)

            stepper.plan = counted  # type: ignore[method-assign]
            if second:
                self.second_runner = runner
            else:
                self.runner = runner
        return runner

    def _context_mode(self, index: int) -> ff.CUDAGraphMode:
        mode = self.case.graph_mode
        if mode == "full_and_piecewise":
            return (M.FULL, M.PIECEWISE)[index % 2]
        return {"none": M.NONE, "piecewise": M.PIECEWISE, "full": M.FULL,
                "full_decode_only": M.FULL}[mode]

    def _inputs(self, call: Call, rows: int, index: int, via: str,
                thread: int = 0) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.case.seed * 1000 + index * 10 + thread)
        draw = models.Draw(opt=call.opt, scalar=call.scalar, reqs=call.reqs)
        assert self.spec.inputs is not None
        args = self.spec.inputs(rows, gen, self.input_dtype, draw)
        if via in RUNNER_VIAS:
            assert self.spec.runner_inputs is not None
            names = self.spec.runner_inputs(self.input_dtype)
            args = {k: v for k, v in args.items() if k in names}
        if call.cast:  # a float input in another dtype than the model's
            other = torch.float32 if self.changer.dtype == torch.float64 else torch.float64
            args = {k: v.to(other) if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v for k, v in args.items()}
        return args

    def _stage(self, args: dict[str, Any], fresh: bool) -> dict[str, Any]:
        """The context path's inputs: written into persistent buffers (or fresh tensors)."""
        out: dict[str, Any] = {}
        for name, value in args.items():
            if not isinstance(value, torch.Tensor) or fresh:
                out[name] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            buf = self.buffers.get(name)
            if buf is None or buf.dtype != value.dtype or buf.shape[1:] != value.shape[1:]:
                buf = self.buffers[name] = torch.zeros((MAX_TOKENS, *value.shape[1:]),
                                                       dtype=value.dtype)
            buf[:value.shape[0]].copy_(value)
            out[name] = buf[:value.shape[0]]
        return out

    def _invoke(self, via: str, call: Call, args: dict[str, Any], kwargs: dict[str, Any],
                mode: ff.CUDAGraphMode, rows: int) -> Any:
        target = self.compiled
        if via in RUNNER_VIAS:
            runner = self._runner(second=via == "second_runner")
            extra: dict[str, Any] = {"uniform_decode": call.uniform}
            if call.uniform and not self.spec.requests:  # (reqs 0: one query per request)
                extra["num_reqs"] = call.reqs or call.size // (1 + self.case.spec_tokens)
            if call.split:
                extra.update(num_scheduled_tokens=list(call.split), num_reqs=len(call.split))
            if call.lora >= 0:
                extra.update(has_lora=True, num_active_loras=call.lora)
            if call.extras:
                extra["extras"] = {"matrix_step": self.index}
            if call.positional:
                return runner(*args.values(), **extra)
            return runner(**args, **extra)
        if via == "context" and mode is not M.NONE:
            with ff.forward_context(ff.BatchDescriptor(num_tokens=rows), mode=mode):
                return _call_with(target, call, args, kwargs)
        return _call_with(target, call, args, kwargs)

    # -- what may cause a refusal ----------------------------------------------------------
    def _causes(self, call: Call, via: str) -> set[str]:
        """The change kinds applied so far and this call's features: what an accepted refusal
        must have been caused by (refusals.py)."""
        case, causes = self.case, set(self.changer.happened)
        stock_paths = case.path.startswith("torch_compile")
        if call.grad == "grad" and (not case.inference_mode or stock_paths):
            causes.add("grad_call")
        if call.cast:
            causes.add("cast")
        if via == "context" and len(self.forms) > 1:
            causes.add("args_form")
        graphs = case.graph_mode != "none"
        if case.model == "keeps_last" and case.mode in ("none", "stock_torch_compile") \
                and graphs:
            causes.add("forward_sets_attr")
        if case.model == "py_state" and case.mode in ("piecewise", "dynamo_trace_once") \
                and not stock_paths:
            causes.add("forward_writes_state")
        if len(self.structures) >= 8:
            causes.add("many_structures")
        if case.path == "microbatch" and self.spec.requests:
            causes.add("micro_batch_requests")
        if len(self.scalars) > 1 and case.breakable:
            causes.add("scalar_breakable")
        return causes

    def _note(self, call: Call, via: str) -> None:
        self.scalars.add((call.scalar, call.kwarg))
        if via == "context":
            self.forms.add((call.positional, call.kwarg))
        changer = self.changer
        self.structures.add((call.opt, call.kwarg, call.scalar, call.grad, changer.dtype,
                             changer.autocast, changer.default64, via))

    def _refused(self, exc: FreezeframeError, call: Call, via: str) -> CallRecord:
        """A refusal: accepted only where the guarantees promise it for what the case did."""
        text = f"{type(exc).__name__}: {exc}"
        entry = refusals.accepted(exc, self._causes(call, via), self.accept_wrong)
        if entry is None:
            raise Failure("refusal", f"refused where docs/guarantees.md promises an answer "
                                     f"(after {sorted(self.changer.happened) or 'no change'}): "
                                     f"{text}") from exc
        self.outcome.refused += 1
        self.outcome.refusals.append(text[:300])
        return CallRecord(via, refused=text, wrong_for_user=entry.wrong_for_user,
                          accepted_as=entry.name)

    # -- one call ---------------------------------------------------------------------------
    def _prepare(self, call: Call, index: int, thread: int = 0) -> Prepared:
        via = call.via or self.case.path
        if via.startswith("torch_compile"):
            via = "plain"
        mode, rows = M.NONE, call.size
        if via == "context":
            mode = self._context_mode(index)
            padded = padded_size(self.case.ladder, call.size) if mode is not M.NONE else None
            if padded is None:
                mode = M.NONE
            else:
                rows = padded
        args = self._inputs(call, rows, index, via, thread)
        kwargs = dict([self.spec.kwargs[call.kwarg]]) \
            if call.kwarg >= 0 and via not in RUNNER_VIAS else {}
        theirs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        mine = self._stage(args, call.fresh) if via == "context" else \
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        grad_check = call.grad == "grad" and not self.case.inference_mode and via == "plain" \
            and self.spec.autograd
        return Prepared(via, mode, rows, args, kwargs, theirs, mine, grad_check)

    def call(self, call: Call, index: int) -> None:
        p = self._prepare(call, index)
        self._note(call, p.via)
        fault = self.changer.take_fault()
        reference = self.changer.reference()
        want, want_exc = self._eager(reference, call, p, fault)
        before = {k: v.detach().clone() for k, v in state_of(self.module, False).items()}
        settings = global_state()
        probe = self._probe(p.via)
        try:
            with self.changer.settings(), _grad_mode(call.grad):
                if p.grad_check:
                    self._zero_grads(self.module)
                models.FAULT.armed = fault
                try:
                    got = self._invoke(p.via, call, p.mine, p.kwargs, p.mode, p.rows)
                finally:
                    models.FAULT.armed = False
                if call.wait and p.via in RUNNER_VIAS:
                    self._runner(second=p.via == "second_runner").wait_for_capture()
                fresh_answer = got
                got_copy = clone(got)
                requires_grad = [t.requires_grad for t in leaves(got)]
                if p.grad_check:
                    self._backward(got)
        except FreezeframeError as exc:
            self.outcome.records.append(self._refused(exc, call, p.via))
            self._check_leaks(settings)
            after = state_of(self.module, False)
            for key, value in before.items():
                if key in after:
                    compare(after[key], value, None, f"{key} after a refused call")
            return
        except Exception as exc:
            if want_exc is not None and type(exc) is type(want_exc):
                # the model's own error (or the injected fault), raised eagerly too: what it
                # wrote before it raised is what eager wrote
                self.outcome.records.append(CallRecord(p.via))
                self._check_written(p, reference, self._tolerance(p.via), None)
                return
            raise Failure("raw exception", f"{type(exc).__name__}: {exc}"
                          + (f" (eager raised {type(want_exc).__name__}: {want_exc})"
                             if want_exc is not None else " (eager answered)")) from exc
        self.outcome.calls += 1
        self.outcome.records.append(self._record(p.via, p.mode, probe))
        self._check_leaks(settings)
        if want_exc is not None:
            raise Failure("wrong answer", f"the compiled path answered where eager raised "
                                          f"{type(want_exc).__name__}: {want_exc}")
        tol = self._tolerance(p.via)
        compare(got_copy, want, tol, "the output")
        if p.mode is M.NONE:  # (a low-level replay hands out its graph's stored output)
            self._check_identity(fresh_answer)
        self._check_written(p, reference, tol, call.size)
        if p.grad_check:
            self._check_grads(requires_grad, reference, tol)
        elif self._keeps_autograd(p.via) and requires_grad != self.want_requires_grad:
            raise Failure("wrong answer", f"outputs requiring grad: {requires_grad}, eager "
                                          f"{self.want_requires_grad} (autograd dropped)")

    def _keeps_autograd(self, via: str) -> bool:
        """Whether a call's outputs must require grad where eager's do: not a runner step
        (inference only) nor a call of a model compiled with inference_mode=True (the
        default); torch.compile(backend="freezeframe") keeps autograd."""
        if via in RUNNER_VIAS:
            return False
        return self.case.path.startswith("torch_compile") or not self.case.inference_mode

    def _check_written(self, p: Prepared, reference: nn.Module,
                       tol: tuple[float, float] | None, size: int | None) -> None:
        """The inputs, the module's tensors and its Python state as eager left them."""
        for key, value in p.theirs.items():
            if isinstance(value, torch.Tensor):
                compare(p.mine[key], value, tol, f"input {key!r} after the call")
        runner = p.via in RUNNER_VIAS  # its forward saw the padded batch
        ours, eager = state_of(self.module, True), state_of(reference, True)
        compare_state(ours, eager, tol, size if runner else None)
        if not runner or not self.spec.row_independent:
            compare_python_state(python_state_of(self.module), python_state_of(reference))

    def _check_grads(self, requires_grad: list[bool], reference: nn.Module,
                     tol: tuple[float, float] | None) -> None:
        if requires_grad != self.want_requires_grad:
            raise Failure("wrong answer", f"outputs requiring grad: {requires_grad}, eager "
                                          f"{self.want_requires_grad} (autograd dropped)")
        for (name, p), (_, q) in zip(self.module.named_parameters(),
                                     reference.named_parameters(), strict=True):
            if p.grad is None and q.grad is None:
                continue
            compare(_grad_or_zeros(p), _grad_or_zeros(q), tol or (1e-6, 1e-6),
                    f"the gradient of {name}")

    def threaded_call(self, call: Call, index: int) -> None:
        """A runner step made from ``call.threads`` threads at once, each with inputs of its
        own (the runner copies outputs: copy_outputs=True); each answer against eager's."""
        via = call.via or self.case.path
        self._runner(second=via == "second_runner")  # (made before the threads start)
        prepared = [self._prepare(call, index, thread) for thread in range(call.threads)]
        wanted = [self._eager(self.changer.reference(), call, p, False) for p in prepared]
        got: list[Any] = [None] * call.threads
        errors: list[BaseException | None] = [None] * call.threads

        def step(k: int) -> None:
            try:
                with self.changer.settings(), _grad_mode(call.grad):
                    got[k] = clone(self._invoke(via, call, prepared[k].mine, {}, M.NONE,
                                                call.size))
            except BaseException as exc:  # (reported below, in the main thread)
                errors[k] = exc

        threads = [threading.Thread(target=step, args=(k,)) for k in range(call.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k, ((want, want_exc), exc) in enumerate(zip(wanted, errors, strict=True)):
            if isinstance(exc, FreezeframeError):
                self.outcome.records.append(self._refused(exc, call, via))
            elif exc is not None:
                if want_exc is not None and type(exc) is type(want_exc):
                    continue
                raise Failure("raw exception", f"thread {k}: {type(exc).__name__}: {exc}")
            else:
                self.outcome.calls += 1
                self.outcome.records.append(CallRecord(via))
                if want_exc is not None:
                    raise Failure("wrong answer", f"thread {k} answered where eager raised "
                                                  f"{type(want_exc).__name__}: {want_exc}")
                compare(got[k], want, self._tolerance(via), f"thread {k}'s output")

    def _probe(self, via: str) -> tuple[int, int, int]:
        """The counters a call's record is read from: replays, whole-way and graph steps."""
        stats = getattr(self.compiled, "stats", None)
        replays = stats.get("replays") if stats is not None and hasattr(stats, "get") else 0
        runner = self.second_runner if via == "second_runner" else self.runner
        graph_steps = 0
        if runner is not None:
            graph_steps = runner.stats.get("steps_full") + runner.stats.get("steps_piecewise")
        return replays, self.whole_way, graph_steps

    def _record(self, via: str, mode: ff.CUDAGraphMode, probe: tuple[int, int, int]
                ) -> CallRecord:
        replays, whole_way, graph_steps = self._probe(via)
        runner = via in RUNNER_VIAS  # (a runner made by this call had no steps before it)
        return CallRecord(
            via=via, graph=(graph_steps > probe[2]) if runner else mode is not M.NONE,
            replayed=replays > probe[0], planned=runner and whole_way == probe[1])

    def _eager(self, reference: nn.Module, call: Call, p: Prepared,
               fault: bool) -> tuple[Any, Exception | None]:
        try:
            with self.changer.settings(), _grad_mode(call.grad):
                if p.grad_check:
                    self._zero_grads(reference)
                models.FAULT.armed = fault
                try:
                    want = _call_with(reference, call, p.theirs, p.kwargs)
                finally:
                    models.FAULT.armed = False
                want_copy = clone(want)
                self.want_requires_grad = [t.requires_grad for t in leaves(want)]
                self.want_aliasing = aliasing(leaves(want))
                if p.grad_check:
                    self._backward(want)
            return want_copy, None
        except Exception as exc:  # the model raises: the compiled path may raise alike
            return None, exc

    @staticmethod
    def _zero_grads(module: nn.Module) -> None:
        for p in module.parameters():
            p.grad = None

    @staticmethod
    def _backward(out: Any) -> None:
        grads = [t for t in leaves(out) if t.requires_grad]
        if grads:
            sum(t.float().sum() for t in grads).backward()  # type: ignore[union-attr]

    def _tolerance(self, via: str) -> tuple[float, float] | None:
        if self.changer.autocast or self.input_dtype in (torch.bfloat16, torch.float16):
            return (2e-2, 2e-2)
        if self.case.compiler == "inductor":
            return (1e-4, 1e-4)
        if via in RUNNER_VIAS:
            return (1e-5, 1e-5)  # padded to a capture size: a matmul may round otherwise
        return None

    def _check_identity(self, answer: Any) -> None:
        new = leaves(answer)
        if aliasing(new) != self.want_aliasing:
            raise Failure("identity", f"the answer's tensor objects repeat as "
                                      f"{aliasing(new)}, eager's as {self.want_aliasing} "
                                      "(each output leaf by the first leaf that is the same "
                                      "object)")
        for t in new:
            if any(t is old for old in self.answers):
                raise Failure("identity", "the answer is a tensor object an earlier call "
                                          "returned")
        self.answers.extend(new)

    def _check_leaks(self, before: tuple[Any, ...]) -> None:
        after = global_state()
        if after != before:
            raise Failure("leak", f"(grad, inference, default dtype, autocast, no forward "
                                  f"context) was {before} before the call, {after} after")


def aliasing(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor by the index of the first one that is the same object (two outputs that are
    one tensor eagerly must be one in the answer, and two must be two)."""
    return [next(i for i, u in enumerate(tensors) if u is t) for t in tensors]


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """No gradient and a zero one mean the same (Inductor's backward may write zeros)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _call_with(target: Any, call: Call, args: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    if call.positional:
        return target(*args.values(), **kwargs)
    return target(**args, **kwargs)


# -- the health check ------------------------------------------------------------------------
def health_check(case: Case) -> None:
    """A fresh ff.compile and torch.compile(fullgraph=True) still work, for a small module and
    for the case's own model class."""
    if global_state() != (True, False, torch.float32, False, True):
        raise Failure("leak", f"global state after the case: {global_state()}")
    checks: list[tuple[str, nn.Module, dict[str, Any], tuple[str, ...]]] = [
        ("a small module", models.Small(), {"x": torch.randn(3, 4)}, ())]
    if not case.spec.served:
        gen = torch.Generator().manual_seed(5)
        checks.append((f"a new {case.model}", models.build(case.spec, case.seed),
                       case.spec.inputs(3, gen, torch.float32, models.Draw()),  # type: ignore[misc]
                       case.spec.splitting_ops))
    for what, module, args, ops in checks:
        with torch.no_grad():
            want = copy_module(module)(**_cloned(args))
            cfg = ff.CompilationConfig(backend="eager", splitting_ops=list(ops) or None,
                                       use_cache=False)
            for how in ("ff.compile", "torch.compile(fullgraph=True, backend='eager')"):
                try:
                    fresh = copy_module(module)
                    if how == "ff.compile":
                        dims = case.spec.dynamic_dims if module is not checks[0][1] else None
                        compiled: Any = ff.compile(fresh, cfg, dynamic_arg_dims=dims)
                        got = compiled(**_cloned(args))
                    else:
                        with _dynamo_limit(case, module is not checks[0][1]):
                            compiled = torch.compile(fresh, fullgraph=True, backend="eager")
                            got = compiled(**_cloned(args))
                except FreezeframeError as exc:
                    if module is not checks[0][1] and refusals.accepted(
                            exc, _own_refusal_causes(case)):
                        continue  # (what any new instance of this class meets)
                    raise Failure("health", f"after the case, {how} of {what} raised "
                                            f"{type(exc).__name__}: {exc}") from exc
                except Exception as exc:
                    raise Failure("health", f"after the case, {how} of {what} raised "
                                            f"{type(exc).__name__}: {exc}") from exc
                compare(clone(got), want, None, f"after the case, {how} of {what}")


def _own_refusal_causes(case: Case) -> set[str]:
    """What refuses a fresh ff.compile (piecewise) of the case's model class by itself."""
    return {"forward_writes_state"} if case.model == "py_state" else set()


def _dynamo_limit(case: Case, own_class: bool) -> Any:
    """Dynamo's per-code recompile limit (8) for the health check's torch.compile of the case's
    own class, raised where the case itself compiled that class with torch.compile: there the
    case's calls (each grad mode, default dtype, dtype and size regime a guard of its own) fill
    the limit as they would with backend="eager" (full seed 47 of the old generator: six
    entries either way), which says nothing of freezeframe; a class freezeframe poisoned (its
    code skipped for good, an entry that fails) still fails."""
    if own_class and case.path.startswith("torch_compile"):
        return torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512)
    return contextlib.nullcontext()


def _cloned(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# -- running a case --------------------------------------------------------------------------
@contextlib.contextmanager
def own_inductor_cache(case: Case) -> Any:
    """An Inductor case compiles with an on-disk Inductor cache of its own, empty at first: a
    case runs as in a fresh process on a fresh machine, whatever ran before it (a case of
    the full tier failed after others had filled the shared cache, and its rerun command,
    on its own, passed). A warm Inductor cache is a case of its own (warm="inproc": the case
    run twice)."""
    if case.compiler != "inductor":
        yield
        return
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="ff-matrix-inductor-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def execute(case: Case, cache_dir: str | None = None, accept_wrong: bool = True) -> Outcome:
    with own_inductor_cache(case):
        return _execute(case, cache_dir, accept_wrong)


def _execute(case: Case, cache_dir: str | None, accept_wrong: bool) -> Outcome:
    from tests.matrix import drivers

    if case.path == "serve":  # (warm: served twice, the second on the first's caches)
        outcome = drivers.serve_case(case)
        return drivers.serve_case(case) if case.warm == "inproc" else outcome
    if case.path == "hf":
        return drivers.hf_case(case)
    if case.warm == "subprocess" and cache_dir:
        return warm_in_subprocesses(case, cache_dir)
    runs = [case, case] if case.warm == "inproc" and cache_dir else [case]
    if case.warm == "sibling" and cache_dir:
        runs = [sibling(case), case]
    outcome = Outcome()
    for start, run in enumerate(runs):
        harness = Harness(run, cache_dir, accept_wrong)
        try:
            outcome = harness.run()
        except Failure as failure:
            where = ""
            if case.warm == "inproc" and cache_dir:
                where = f"the {'warm' if start else 'cold'} start's "
            elif len(runs) == 2:
                where = "the sibling's " if start == 0 else "(after the sibling) "
            event = run.events[harness.index]
            raise Failure(failure.kind, f"at {where}event {harness.index + 1} "
                                        f"({describe_event(event)}): {failure}") from failure
    return outcome


def sibling(case: Case) -> Case:
    """Another case of the same model class on the same cache: other weights (its own seed),
    an attribute set before its first call (``scale`` where forward reads one), the case's
    first two calls. What it saves must never be served to ``case`` as its own."""
    calls = tuple(e for e in case.events if isinstance(e, Call))[:2]
    return dataclasses.replace(case, seed=case.seed + 100_003, warm="",
                               events=(Change("instance_attr"), *calls))


def warm_in_subprocesses(case: Case, cache_dir: str) -> Outcome:
    """The case run cold in one fresh process, then warm in another, on one cache dir."""
    env = dict(os.environ)
    env.pop("FREEZEFRAME_DISABLE_CACHE", None)
    outcome = Outcome()
    for start in ("cold", "warm"):
        proc = subprocess.run(
            [sys.executable, "-m", "tests.matrix.harness", str(case.seed), case.tier, cache_dir],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            kind = "raw exception"
            for line in tail:
                for known in ("wrong answer", "raw exception", "state", "identity", "leak",
                              "health"):
                    if line.startswith(f"MATRIX-FAILURE {known}"):
                        kind = known
            raise Failure(kind, f"the {start} start in a fresh process failed:\n      "
                          + "\n      ".join(tail))
        last = proc.stdout.strip().splitlines()[-1]
        outcome = Outcome.from_json(json.loads(last))
    return outcome


def run_case(case: Case, cache_dir: str | None = None, shrink: bool = True,
             accept_wrong: bool = True) -> Outcome:
    """Run ``case`` and the health check; on a failure raise one whose message is the seed, the
    case in words, what failed, a shrunk event sequence and the command that reruns it.
    ``accept_wrong=False``: a refusal wrong for a user fails it (refusals.py)."""
    configs = compiler_configs()
    try:
        outcome = execute(case, cache_dir, accept_wrong)
        health_check(case)
        changed = [k for k, v in compiler_configs().items()
                   if not _same_setting(configs.get(k), v)]
        if changed:  # (it would reach every later case of the process, not the rerun)
            raise Failure("leak", f"the case left Dynamo / Inductor settings changed: "
                                  f"{sorted(changed)[:8]}")
        return outcome
    except Failure as failure:
        torch._dynamo.reset()
        message = [f"{describe(case)}", f"  FAILED ({failure.kind}) {failure}"]
        if shrink and case.warm != "subprocess" and case.path != "hf":
            small = shrink_case(case, failure.kind, cache_dir)
            if small is not None and small != case:
                message += ["  a shorter sequence that fails alike:",
                            "\n".join("  " + line for line in describe(small).splitlines()[3:]),
                            f"  as code: run_case({small!r})"]
        message.append(f"  rerun: {rerun_command(case)}")
        raise Failure(failure.kind, "\n".join(message)) from None
    finally:
        # Dynamo's per-code-object caches would otherwise fill up over many cases of one
        # class (its recompile limit); the health check above ran first, so a case that
        # poisoned the process has been caught already
        torch._dynamo.reset()


def compiler_configs() -> dict[str, Any]:
    """Dynamo's and Inductor's settings (the process-wide state a case could leave behind
    for the next one), by name."""
    from torch._inductor import config as inductor_config

    return {f"{name}.{k}": v
            for name, module in (("dynamo", torch._dynamo.config), ("inductor", inductor_config))
            for k, v in module.get_config_copy().items()}


def _same_setting(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # (a value that cannot be compared: its type)
        return type(a) is type(b)


def shrink_case(case: Case, kind: str, cache_dir: str | None, budget_s: float = 60.0
                ) -> Case | None:
    """Drop events one at a time while the case still fails with the same kind of failure."""
    deadline = time.monotonic() + budget_s
    events = list(case.events)
    i = len(events) - 1
    while i >= 0 and time.monotonic() < deadline:
        trial = dataclasses.replace(case, events=tuple(events[:i] + events[i + 1:]))
        if trial.events and _fails_alike(trial, kind, cache_dir):
            events = list(trial.events)
        i -= 1
    return dataclasses.replace(case, events=tuple(events))


def _fails_alike(case: Case, kind: str, cache_dir: str | None) -> bool:
    torch._dynamo.reset()
    try:
        execute(case, cache_dir)
        health_check(case)
    except Failure as failure:
        return failure.kind == kind
    except Exception:
        return False
    return False


if __name__ == "__main__":  # python -m tests.matrix.harness SEED TIER CACHE_DIR (warm starts)
    _case = generate(int(sys.argv[1]), sys.argv[2])
    _case = dataclasses.replace(_case, warm="")
    try:
        _outcome = execute(_case, sys.argv[3])
        health_check(_case)
    except Failure as _failure:
        print(f"MATRIX-FAILURE {_failure}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(dataclasses.asdict(_outcome)))
