"""Runs one matrix case against eager PyTorch (see cases.py for what a case is).

For every call the eager reference is a copy of the module made just before it (so it has
every change made so far, and the state earlier calls left), given the same inputs under the
same grad mode, autocast and default dtype. The compiled path must then

- answer what eager answers: same structure, dtypes and shapes; equal values (bit for bit
  where the README promises it: the eager compiler on the batch the step ran; a runner step,
  which pads, and Inductor to a tolerance); under ``inference_mode=False`` and grad mode on,
  the same ``requires_grad`` and the same parameter gradients;
- leave what eager leaves: the inputs forward writes into, the module's parameters, buffers and
  tensor attributes (``self.last = out``);
- hand out a new tensor object each time, and two for two;
- or raise a ``FreezeframeError`` (and leave the module's parameters and buffers as they were).

It fails on anything else: another answer, an exception from inside torch or freezeframe that
is not a ``FreezeframeError`` (unless eager raised the same type), grad mode / default dtype /
autocast / forward context left changed. After the case, a fresh ``ff.compile`` and a plain
``torch.compile(fullgraph=True, backend="eager")`` of a small module and of the case's own
model class must still work (the health check).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

import freezeframe as ff
from freezeframe.errors import FreezeframeError
from tests.matrix import models
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M = ff.CUDAGraphMode
MAX_TOKENS = 16


class Failure(AssertionError):
    """What the oracle found; ``kind`` groups failures for shrinking ("wrong answer", "raw
    exception", "state", "identity", "leak", "health")."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(f"{kind}: {text}")
        self.kind = kind


@dataclasses.dataclass
class Outcome:
    calls: int = 0
    refused: int = 0
    refusals: list[str] = dataclasses.field(default_factory=list)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)


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
        cache_dir=cache_dir or "")
    if case.path == "microbatch":
        fields.update(micro_batching=True, num_micro_batches=2, micro_batch_decode_threshold=2,
                      micro_batch_prefill_threshold=4)
    return ff.CompilationConfig(**fields)


# -- comparing -------------------------------------------------------------------------------
def leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    return []


def compare(got: Any, want: Any, tol: tuple[float, float] | None, what: str) -> None:
    """Same structure, dtypes and shapes; equal values (``tol`` None: bit for bit)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Failure("wrong answer", f"{what}: a {type(got).__name__}, eager a tensor")
        if got.dtype != want.dtype or got.shape != want.shape:
            raise Failure("wrong answer", f"{what}: {got.dtype} {tuple(got.shape)}, eager "
                                          f"{want.dtype} {tuple(want.shape)}")
        rtol, atol = tol if tol is not None else (0.0, 0.0)
        try:
            torch.testing.assert_close(got.detach(), want.detach(), rtol=rtol, atol=atol,
                                       equal_nan=True, check_device=False)
        except AssertionError as exc:
            raise Failure("wrong answer", f"{what} differs from eager's: {exc}") from None
        return
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            raise Failure("wrong answer", f"{what}: {_shape_of(got)}, eager {_shape_of(want)}")
        for key in want:
            compare(got[key], want[key], tol, f"{what}[{key!r}]")
        return
    if isinstance(want, (tuple, list)):
        if type(got) is not type(want) or len(got) != len(want):
            raise Failure("wrong answer", f"{what}: {_shape_of(got)}, eager {_shape_of(want)}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            compare(g, w, tol, f"{what}[{i}]")
        return
    if got != want:
        raise Failure("wrong answer", f"{what}: {got!r}, eager {want!r}")


def _shape_of(value: Any) -> str:
    if isinstance(value, dict):
        return f"dict with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def state_of(module: nn.Module, attrs: bool) -> dict[str, Any]:
    """Parameters, buffers and (``attrs``) tensor attributes, by name."""
    out: dict[str, Any] = {f"param {k}": v for k, v in module.named_parameters()}
    out.update({f"buffer {k}": v for k, v in module.named_buffers()})
    if attrs:
        for prefix, sub in module.named_modules():
            for key, value in vars(sub).items():
                if isinstance(value, torch.Tensor):
                    out[f"attribute {prefix + '.' if prefix else ''}{key}"] = value
    return out


def _grad_mode(name: str) -> Any:
    return {"grad": torch.enable_grad(), "no_grad": torch.no_grad(),
            "inference": torch.inference_mode()}[name]


def global_state() -> tuple[Any, ...]:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.is_autocast_enabled("cpu"),
            ff.get_forward_context() is None)


# -- one case on ff.compile / torch.compile ----------------------------------------------------
class Harness:
    def __init__(self, case: Case, cache_dir: str | None = None) -> None:
        self.case, self.spec = case, case.spec
        self.module = models.build(self.spec, case.seed)
        self.cfg = make_config(case, cache_dir)
        self.compiled = self._compile()
        self.changer = Changer(self.module, self.compiled, case.seed)
        self.runner: ff.GraphRunner | None = None
        self.second_runner: ff.GraphRunner | None = None
        self.answers: list[torch.Tensor] = []  # every tensor handed out, kept alive
        self.buffers: dict[str, torch.Tensor] = {}  # the context path's persistent inputs
        self.outcome = Outcome()

    def _compile(self) -> Any:
        case = self.case
        if case.path.startswith("torch_compile"):
            dynamic = True if case.path == "torch_compile_dynamic" else None
            return torch.compile(self.module, backend="freezeframe",
                                 options={"config": self.cfg}, dynamic=dynamic)
        return ff.compile(self.module, self.cfg, inference_mode=case.inference_mode)

    def run(self) -> Outcome:
        for index, event in enumerate(self.case.events):
            self.index = index
            if isinstance(event, Change):
                self.changer.apply(event, index)
            else:
                self.call(event, index)
        stats = getattr(self.compiled, "stats", None)
        if stats is not None and hasattr(stats, "snapshot"):
            self.outcome.stats = dict(stats.snapshot())
        return self.outcome

    # -- the paths --------------------------------------------------------------------------
    def _runner(self, second: bool = False) -> ff.GraphRunner:
        runner = self.second_runner if second else self.runner
        if runner is None:
            runner = ff.GraphRunner(self.compiled, self.cfg,
                                    inputs=self.spec.runner_inputs(),  # type: ignore[misc]
                                    progress=False, capture_policy=self.case.policy)
            with torch.no_grad():
                runner.capture()
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

    def _inputs(self, call: Call, rows: int, index: int, via: str) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.case.seed * 1000 + index)
        args = self.spec.inputs(rows, gen, self.changer.dtype, call.opt)  # type: ignore[misc]
        if via in RUNNER_VIAS:
            names = self.spec.runner_inputs()  # type: ignore[misc]
            args = {k: v for k, v in args.items() if k in names}
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
            if call.uniform:
                extra["num_reqs"] = call.size
            if call.split:
                extra.update(num_scheduled_tokens=list(call.split), num_reqs=len(call.split))
            if call.positional:
                return runner(*args.values(), **extra)
            return runner(**args, **extra)
        if via == "context" and mode is not M.NONE:
            with ff.forward_context(ff.BatchDescriptor(num_tokens=rows), mode=mode):
                return _call_with(target, call, args, kwargs)
        return _call_with(target, call, args, kwargs)

    # -- one call ---------------------------------------------------------------------------
    def call(self, call: Call, index: int) -> None:
        via = call.via or self.case.path
        if via.startswith("torch_compile"):
            via = "plain"
        mode, rows = M.NONE, call.size
        if via == "context":
            mode = self._context_mode(index)
            padded = self.cfg.padded_size(call.size) if mode is not M.NONE else None
            if padded is None:
                mode = M.NONE
            else:
                rows = padded
        args = self._inputs(call, rows, index, via)
        kwargs = dict([self.spec.kwargs[call.kwarg]]) \
            if call.kwarg >= 0 and via not in RUNNER_VIAS else {}
        theirs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        mine = self._stage(args, call.fresh) if via == "context" else \
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        grad_check = call.grad == "grad" and not self.case.inference_mode and via == "plain" \
            and self.spec.autograd
        reference = self.changer.reference()
        want, want_exc = self._eager(reference, call, theirs, kwargs, grad_check)
        before = {k: v.detach().clone() for k, v in state_of(self.module, False).items()}
        settings = global_state()
        try:
            with self.changer.settings(), _grad_mode(call.grad):
                if grad_check:
                    self._zero_grads(self.module)
                got = self._invoke(via, call, mine, kwargs, mode, rows)
                fresh_answer = got
                got_copy = _clone(got)
                requires_grad = [t.requires_grad for t in leaves(got)]
                if grad_check:
                    self._backward(got)
        except FreezeframeError as exc:
            self.outcome.refused += 1
            self.outcome.refusals.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            self._check_leaks(settings, via)
            after = state_of(self.module, False)
            for key, value in before.items():
                if key in after:
                    compare(after[key], value, None, f"{key} after a refused call")
            return
        except Exception as exc:
            if want_exc is not None and type(exc) is type(want_exc):
                return  # the model's own error, raised eagerly too
            raise Failure("raw exception", f"{type(exc).__name__}: {exc}"
                          + (f" (eager raised {type(want_exc).__name__}: {want_exc})"
                             if want_exc is not None else " (eager answered)")) from exc
        self.outcome.calls += 1
        self._check_leaks(settings, via)
        if want_exc is not None:
            raise Failure("wrong answer", f"the compiled path answered where eager raised "
                                          f"{type(want_exc).__name__}: {want_exc}")
        tol = self._tolerance(via)
        compare(got_copy, want, tol, "the output")
        if mode is M.NONE:  # (a low-level replay hands out its graph's stored output)
            self._check_identity(fresh_answer, want)
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                compare(mine[key], value, tol, f"input {key!r} after the call")
        attrs = via not in RUNNER_VIAS  # a runner's forward sees the padded batch
        ours, eager = state_of(self.module, attrs), state_of(reference, attrs)
        if set(ours) != set(eager):
            raise Failure("state", f"module state names {sorted(set(ours) ^ set(eager))} "
                                   f"differ from eager's after the call")
        for key in eager:
            compare(ours[key], eager[key], tol, f"{key} after the call")
        if grad_check:
            if requires_grad != self.want_requires_grad:
                raise Failure("wrong answer", f"outputs requiring grad: {requires_grad}, eager "
                                              f"{self.want_requires_grad} (autograd dropped)")
            for (name, p), (_, q) in zip(self.module.named_parameters(),
                                         reference.named_parameters(), strict=True):
                if p.grad is None and q.grad is None:
                    continue
                compare(_grad_or_zeros(p), _grad_or_zeros(q), tol or (1e-6, 1e-6),
                        f"the gradient of {name}")

    def _eager(self, reference: nn.Module, call: Call, args: dict[str, Any],
               kwargs: dict[str, Any], grad_check: bool) -> tuple[Any, Exception | None]:
        try:
            with self.changer.settings(), _grad_mode(call.grad):
                if grad_check:
                    self._zero_grads(reference)
                want = _call_with(reference, call, args, kwargs)
                want_copy = _clone(want)
                self.want_requires_grad = [t.requires_grad for t in leaves(want)]
                if grad_check:
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
        if self.changer.autocast:
            return (2e-2, 2e-2)
        if self.case.compiler == "inductor":
            return (1e-4, 1e-4)
        if via in RUNNER_VIAS:
            return (1e-5, 1e-5)  # padded to a capture size: a matmul may round otherwise
        return None

    def _check_identity(self, answer: Any, want: Any) -> None:
        new = leaves(answer)
        if len({id(t) for t in new}) < len({id(t) for t in leaves(want)}):
            raise Failure("identity", "two outputs of one answer are the same tensor object "
                                      "(eagerly they are two)")
        for t in new:
            if any(t is old for old in self.answers):
                raise Failure("identity", "the answer is a tensor object an earlier call "
                                          "returned")
        self.answers.extend(new)

    def _check_leaks(self, before: tuple[Any, ...], via: str) -> None:
        after = global_state()
        if after != before:
            raise Failure("leak", f"(grad, inference, default dtype, autocast, no forward "
                                  f"context) was {before} before the call, {after} after")


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """No gradient and a zero one mean the same (Inductor's backward may write zeros)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _call_with(target: Any, call: Call, args: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    if call.positional:
        return target(*args.values(), **kwargs)
    return target(**args, **kwargs)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


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
                       case.spec.inputs(3, gen, torch.float32, False),  # type: ignore[misc]
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
                        compiled: Any = ff.compile(fresh, cfg)
                    else:
                        compiled = torch.compile(fresh, fullgraph=True, backend="eager")
                    got = compiled(**_cloned(args))
                except Exception as exc:
                    raise Failure("health", f"after the case, {how} of {what} raised "
                                            f"{type(exc).__name__}: {exc}") from exc
                compare(_clone(got), want, None, f"after the case, {how} of {what}")


def _cloned(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# -- running a case --------------------------------------------------------------------------
def execute(case: Case, cache_dir: str | None = None) -> Outcome:
    from tests.matrix import drivers

    if case.path == "serve":
        return drivers.serve_case(case)
    if case.path == "hf":
        return drivers.hf_case(case)
    if case.warm == "subprocess" and cache_dir:
        return warm_in_subprocesses(case, cache_dir)
    runs = 2 if case.warm == "inproc" and cache_dir else 1
    outcome = Outcome()
    for start in range(runs):
        harness = Harness(case, cache_dir)
        try:
            outcome = harness.run()
        except Failure as failure:
            where = f"the {'warm' if start else 'cold'} start's " if runs == 2 else ""
            event = case.events[harness.index]
            raise Failure(failure.kind, f"at {where}event {harness.index + 1} "
                                        f"({describe_event(event)}): {failure}") from failure
    return outcome


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
        outcome = Outcome(**json.loads(last))
    return outcome


def run_case(case: Case, cache_dir: str | None = None, shrink: bool = True) -> Outcome:
    """Run ``case`` and the health check; on a failure raise one whose message is the seed, the
    case in words, what failed, a shrunk event sequence and the command that reruns it."""
    try:
        outcome = execute(case, cache_dir)
        health_check(case)
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
