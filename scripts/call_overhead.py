"""Per-call overhead of a compiled model against calling its pieces directly.

    python scripts/call_overhead.py

Runs from the repository root without PYTHONPATH: this checkout's ``src`` and the repository
root (for ``tests.helpers``) go first on ``sys.path``.

Part 1 compiles toy models with the eager compiler (so the pieces themselves cost what eager
costs) and times, per call:
  eager       the original module
  compiled    CompiledModel(x): the module-state check, the last remembered call's check (or
              the exact call key), then the graph inputs read and the stitching graph called
              with each piece's entry bound in
  bytecode    Dynamo's captured bytecode alone, the way calls went before the direct call
  stitching   the stitching graph on the flat graph inputs (piece dispatch included)
  pieces      the stitching graph with each piece's entry bound directly (no dispatch)
"compiled - pieces" is what the compiled model adds to its pieces, given both as the
difference of the two bests and as the median over rounds of the two timed side by side in one
round (steadier where a call costs hundreds of microseconds): the Chain rows, whose
pieces cost a few microseconds, show it plainly; rows whose pieces run real layers carry more
noise, and on this machine the pieces' own ops also run slower when more Python runs between
calls. The toy Llama's compiled call is then taken apart (``compiled_parts``): each part of it
timed in place, before the remembered call, and alone.

Part 2 times one FULL step of a GraphRunner (emulated backend) against the bare replay of the
graph that step runs: the difference is the host path of a step (binding and checking the
inputs, dispatch, staging, the module-state check, copy-back and output slicing). Part 3 times
planned PIECEWISE steps of chains of 1 and 5 splitting ops (a low-level torch.library op, steady
at a few microseconds) with their graphs emptied, against their bare parts: the host time per
piece and what one more piece adds. A benchmark script, not a test; the figures move with the
machine's speed, so compare rows of one run.

    python scripts/call_overhead.py --against /path/to/other/checkout

times a runner's steps in this checkout and in another one side by side, in one run: two worker
processes (one imports this checkout's ``src``, the other the other checkout's), asked in turn
round by round, so load on a shared machine hits both alike. Rows: a planned FULL step and a
planned PIECEWISE step of ``ExampleMLP`` (2 layers: 3 capturable pieces, 2 splitting-op calls;
3 tokens padded to 4) with their emulated graphs emptied (what is left is the step's host path,
an empty replay per graph and the splitting ops), the first step of a shape (it plans the shape:
binding, checks, dispatch, staging), FULL and PIECEWISE, once where another shape padded to
the same size was stepped before ("of a shape": 1..255 tokens padded to 256) and once where
none was ("of a size": sizes 1..96 each captured, so a PIECEWISE step runs the model's Python
to record its piece chain), and the first call of ``ff.compile(ExampleMLP())`` (trace, split,
compile; a fresh process per sample). Each row gives both checkouts' best and median (per
round; a first-step round is the median of its steps), the ratio of the medians and the median
of the per-round ratios ("paired": the two sides of a round run back to back, so a drift of the
machine's speed between rounds cancels out).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# this checkout's freezeframe (or, for a worker of --against, the checkout named by --src),
# and this checkout's tests/
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv[:-1] else str(REPO / "src")
sys.path[:0] = [_SRC, str(REPO)]

from tests.helpers.toy_models import (  # noqa: E402
    LlamaConfig,
    SillyModel,
    ToyLlama,
    _ToyAttention,
)

import freezeframe as ff  # noqa: E402
from freezeframe.compilation.signature import distinct_storages, exact_key  # noqa: E402
from freezeframe.models.ops import define_op  # noqa: E402
from freezeframe.runtime import GraphRunner, Tokens  # noqa: E402


def per_call_us(variants: dict[str, Callable[[], Any]], rounds: int = 15,
                iters: int = 400,
                samples: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Best per-call time of each variant, measured interleaved round by round so that load
    from other processes on a shared machine hits every variant alike, in CPU time of the
    measuring thread (time.thread_time: time spent waiting for a core does not count).
    ``samples``, when given, receives every round's per-call time of each variant (for
    :func:`paired_median`)."""
    for fn in variants.values():
        for _ in range(100):
            fn()
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for key, fn in variants.items():
            start = time.thread_time()
            for _ in range(iters):
                fn()
            us = (time.thread_time() - start) / iters * 1e6
            best[key] = min(best[key], us)
            if samples is not None:
                samples.setdefault(key, []).append(us)
    return best


def paired_median(samples: dict[str, list[float]], key: str, base: str) -> float:
    """The median over rounds of ``key``'s time minus ``base``'s in the same round: steadier
    than the difference of two bests where one call costs hundreds of microseconds and the
    machine's speed drifts between rounds."""
    return statistics.median(a - b for a, b in zip(samples[key], samples[base], strict=True))


def measure(name: str, module: torch.nn.Module, args: tuple[Any, ...],
            splitting_op: str = "silly::attention", rounds: int = 15,
            iters: int = 400) -> dict[str, float]:
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                               splitting_ops=[splitting_op], use_cache=False)
    model = ff.compile(module, cfg)
    model(*args)
    backend = model._variants[0].backend  # the first trace's (private: a benchmark)
    stitching = backend.stitching
    # The flat graph inputs, rebuilt from the sources Dynamo recorded for each placeholder.
    frame = dict(zip(inspect.signature(module.forward).parameters, args, strict=False))
    frame["self"] = module
    flat = []
    for node in stitching.graph.nodes:
        if node.op == "placeholder":
            flat.append(eval(node.meta["grapharg"].source.name, {"L": frame}))
    n = int(next(a for a in flat if isinstance(a, torch.Tensor)).shape[0])

    fast = model._variants[0].trace._fast
    direct = {}
    names = backend.capturable_names
    for piece_name, pb in zip(names, backend.piece_backends, strict=True):
        direct[piece_name] = pb.runnable_for(n)
    pieces_stitching = copy.copy(stitching)
    for piece_name, fn in direct.items():      # plain attributes, as the backends are
        pieces_stitching._modules.pop(piece_name, None)
        pieces_stitching.__dict__[piece_name] = fn
    assert getattr(pieces_stitching, names[0]) is direct[names[0]]
    assert getattr(stitching, names[0]) is backend.piece_backends[0]
    samples: dict[str, list[float]] = {}
    rows = per_call_us({
        "eager": lambda: module(*args),
        "compiled": lambda: model(*args),
        "bytecode": lambda: fast(module, *args),
        "stitching": lambda: stitching.forward(*flat),
        "pieces": lambda: pieces_stitching.forward(*flat),
    }, rounds=rounds, iters=iters, samples=samples)

    print(f"\n{name}: {len(backend.pieces)} pieces, {len(backend.piece_backends)} capturable")
    for key, us in rows.items():
        print(f"  {key:<10} {us:8.1f} us/call")
    print(f"  overhead compiled - pieces: {rows['compiled'] - rows['pieces']:.1f} us/call "
          f"({rows['compiled'] / rows['pieces']:.2f}x); for comparison, Dynamo's bytecode "
          f"adds {rows['bytecode'] - rows['pieces']:.1f} us over the pieces and piece dispatch "
          f"{rows['stitching'] - rows['pieces']:.1f} us")
    print(f"  median of paired rounds: compiled - pieces "
          f"{paired_median(samples, 'compiled', 'pieces'):.1f} us, bytecode - pieces "
          f"{paired_median(samples, 'bytecode', 'pieces'):.1f} us")
    return rows


# -- GraphRunner: host time of a step around the bare replay ----------------------------------
def _captured_runner(module: torch.nn.Module, inputs: dict[str, Any],
                     args: tuple[torch.Tensor, ...], splitting_ops: list[str],
                     mode: ff.CUDAGraphMode) -> tuple[Any, GraphRunner, ff.BatchDescriptor]:
    """``module`` compiled with the eager compiler, graphs of ``mode`` on the emulated backend,
    behind a captured runner that has run one step of ``args``; and the descriptor such a step
    replays."""
    cfg = ff.CompilationConfig(
        mode="piecewise" if splitting_ops else "dynamo_trace_once", backend="eager",
        splitting_ops=splitting_ops or None, cudagraph_mode=mode.name.lower(),
        graph_backend="emulated", cudagraph_capture_sizes=[1, 2, 4, 8], max_num_tokens=8,
        max_num_seqs=8, use_cache=False)
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs=inputs, progress=False)
    runner.capture()
    runner(*args)
    step_mode, desc = runner.dispatcher.dispatch(int(args[0].shape[0]))
    assert step_mode is mode, step_mode
    return model, runner, desc


def runner_overhead(name: str, module: torch.nn.Module, inputs: dict[str, Any],
                    args: tuple[torch.Tensor, ...], splitting_ops: list[str]) -> dict[str, float]:
    """One FULL step of a GraphRunner against the bare replay of the graph it runs (emulated
    backend: the replay re-runs the recorded ops; what the step adds is the host path)."""
    model, runner, desc = _captured_runner(module, inputs, args, splitting_ops,
                                           ff.CUDAGraphMode.FULL)
    n = int(args[0].shape[0])
    full = next(w for w in model.graph_wrappers() if w.runtime_mode is ff.CUDAGraphMode.FULL)
    graph = full.graph_for(desc)
    assert graph is not None
    rows = per_call_us({"step": lambda: runner(*args), "replay": graph.replay})
    overhead = rows["step"] - rows["replay"]
    # The same step with the emulated graph emptied (its recorded ops dropped): what is left
    # of a step is its host path and an empty replay, with much less noise than the
    # difference of two timings that each include the recorded ops
    recorded = graph._steps  # type: ignore[union-attr]
    graph._steps = []  # type: ignore[union-attr]
    try:
        empty = per_call_us({"step": lambda: runner(*args), "replay": graph.replay},
                            rounds=80, iters=200)
    finally:
        graph._steps = recorded  # type: ignore[union-attr]
    empty_host = empty["step"] - empty["replay"]
    print(f"\nGraphRunner FULL step, {name} ({n} tokens, padded to {desc.num_tokens})")
    print(f"  step     {rows['step']:8.1f} us/call")
    print(f"  replay   {rows['replay']:8.1f} us/call (the captured graph alone)")
    print(f"  host     {overhead:8.1f} us/step (step - replay)")
    print(f"  host     {empty_host:8.1f} us/step with the graph emptied (step {empty['step']:.1f}"
          f" - empty replay {empty['replay']:.1f})")
    return {"step_us": rows["step"], "replay_us": rows["replay"], "host_us": overhead,
            "host_empty_us": empty_host}


def piecewise_overhead(name: str, module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                       splitting_op: Any, op_args: tuple[Any, ...]) -> dict[str, float]:
    """One PIECEWISE step of a GraphRunner against its bare parts: each capturable piece's graph
    replayed and each splitting-op call, made directly; the difference per capturable piece is
    what the piecewise path adds per piece."""
    model, runner, desc = _captured_runner(module, {"x": Tokens()}, args, ["silly::attention"],
                                           ff.CUDAGraphMode.PIECEWISE)
    n = int(args[0].shape[0])
    graphs = [w.graph_for(desc) for w in model.graph_wrappers()]
    assert all(g is not None for g in graphs)
    num_ops = len(model.pieces) - len(graphs)

    def bare() -> None:
        for graph in graphs:
            graph.replay()  # type: ignore[union-attr]
        for _ in range(num_ops):
            splitting_op(*op_args)

    rows = per_call_us({"step": lambda: runner(*args), "bare": bare})
    per_piece = (rows["step"] - rows["bare"]) / len(graphs)
    print(f"\nGraphRunner PIECEWISE step, {name} ({n} tokens, padded to {desc.num_tokens}; "
          f"{len(graphs)} piece graphs, {num_ops} splitting-op calls)")
    print(f"  step     {rows['step']:8.1f} us/call")
    print(f"  bare     {rows['bare']:8.1f} us/call (piece replays + splitting-op calls)")
    print(f"  host     {rows['step'] - rows['bare']:8.1f} us/step, {per_piece:.1f} us per piece")
    return {"step_us": rows["step"], "bare_us": rows["bare"], "per_piece_us": per_piece}


def _lean_kernel(q: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q)


def _lean_fake(q: torch.Tensor, out: torch.Tensor) -> None:
    return None


# A splitting op defined with torch.library's low-level API (as the library's own ops are), so
# that the op's own call is a few microseconds and steady; silly::attention, a custom_op, costs
# 30-50 us per call in Python and its noise alone would bury the piece path's.
LEAN_OP = "overhead::lean"
_LEAN_LIBRARY = define_op(LEAN_OP, "(Tensor q, Tensor(a!) out) -> ()", _lean_kernel, _lean_fake)


class Chain(torch.nn.Module):
    """``k`` lean splitting ops with an add between them: k + 1 capturable pieces."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.k):
            out = torch.empty_like(x)
            torch.ops.overhead.lean(x + 1, out)
            x = out
        return x + 1


class _LeanAttention(_ToyAttention):
    """ToyLlama's attention with the lean splitting op in place of silly::attention."""

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split(self.hidden, dim=-1)
        pos = positions.unsqueeze(-1).to(q.dtype)
        out = torch.empty_like(q)
        torch.ops.overhead.lean(q + k + v + 2 * pos, out)
        return self.o_proj(out)


def lean_llama(layers: int) -> ToyLlama:
    """A ToyLlama whose layers split at the lean op (same parameters, same pieces)."""
    model = ToyLlama(LlamaConfig(num_layers=layers, hidden_size=16, mlp_size=32,
                                 vocab_size=32))
    for layer in model.layers:
        layer.attn.__class__ = _LeanAttention
    return model


def compiled_parts(name: str, module: torch.nn.Module, args: tuple[Any, ...],
                   splitting_op: str = LEAN_OP) -> dict[str, float]:
    """Where a remembered call's time over its destination goes, in place and alone: the
    remembered call itself (graph inputs read, pieces called), then with only the
    module-state check before it, then with only the exact key and its lookup, then the whole
    compiled call; each part is also timed alone, back to back. On the development CPU a part
    costs several times more in place, between the pieces' own ops, than alone."""
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", cudagraph_mode="none",
                               splitting_ops=[splitting_op], use_cache=False)
    model = ff.compile(module, cfg)
    for _ in range(5):  # traced, direct call built, remembered, then served from memory
        model(*args)
    memo = model._exact
    known = memo[exact_key(args, {}, False)]
    state = model._state
    assert state is not None

    # the state's generated every-call check (changed_cheaply before it ran the full tier
    # itself; either name, so that two checkouts compare)
    cheap = getattr(state, "check", None) or state.changed_cheaply

    def with_state() -> Any:
        cheap()
        return known(*args)

    def with_key() -> Any:
        return memo[exact_key(args, {}, False)](*args)

    def key_alone() -> Any:
        return memo[exact_key(args, {}, False)]

    samples: dict[str, list[float]] = {}
    last = model._last  # the check of the last remembered call (signature.SameCall)
    assert last is not None and last.check(*args)

    def with_last() -> Any:
        if len(args) == last.count and last.check(*args) and distinct_storages(args):
            return last.call(*args)
        raise AssertionError("the last call's check failed")

    def last_alone() -> bool:
        return len(args) == last.count and last.check(*args) and distinct_storages(args)

    rows = per_call_us({"remembered": lambda: known(*args), "+state": with_state,
                        "+key": with_key, "+last": with_last, "compiled": lambda: model(*args),
                        "state alone": cheap, "key alone": key_alone,
                        "last alone": last_alone},
                       rounds=150, iters=20, samples=samples)
    base = rows["remembered"]
    print(f"\n{name}: the compiled call's parts, in place (over the remembered call "
          f"{base:.1f} us) and alone")
    print(f"  module-state check  {rows['+state'] - base:6.1f} us in place, "
          f"{rows['state alone']:5.1f} alone")
    print(f"  last call's check   {rows['+last'] - base:6.1f} us in place, "
          f"{rows['last alone']:5.1f} alone (what a call like the last one runs)")
    print(f"  exact key + lookup  {rows['+key'] - base:6.1f} us in place, "
          f"{rows['key alone']:5.1f} alone (what any other call runs)")
    print(f"  whole compiled call {rows['compiled'] - base:6.1f} us over the remembered call "
          "(the rest: the hook/trace conditions and inference-mode test of __call__)")
    paired = {k: paired_median(samples, k, "remembered")
              for k in ("+state", "+last", "+key", "compiled")}
    print("  median of paired rounds: " + ", ".join(
        f"{k.lstrip('+')} {v:.1f} us" for k, v in paired.items()))
    return rows


def piece_slope(few: int = 1, many: int = 5) -> dict[str, float]:
    """The host time of a planned PIECEWISE step, graphs emptied, for chains of ``few`` and
    ``many`` lean splitting ops (``few + 1`` and ``many + 1`` capturable pieces), timed
    interleaved in one measurement against their bare parts (each emptied piece graph
    replayed and each op called, the way the stitching graph calls it: its OpOverload, in
    inference mode). Per piece: the host time over the pieces, and the slope (what one more
    piece adds)."""
    variants: dict[str, Callable[[], Any]] = {}
    op = torch.ops.overhead.lean.default
    for k in (few, many):
        args = (torch.randn(3),)
        model, runner, desc = _captured_runner(Chain(k), {"x": Tokens()}, args, [LEAN_OP],
                                               ff.CUDAGraphMode.PIECEWISE)
        runner(*args)
        # (planned_shapes since the runtime rebuild; _plans before, for before/after runs)
        planned = getattr(runner, "planned_shapes", None)
        assert (planned if planned is not None else len(runner._plans)) == 1, \
            "the step was not planned"
        graphs = [w.graph_for(desc) for w in model.graph_wrappers()]
        assert len(graphs) == k + 1 and all(g is not None for g in graphs)
        for graph in graphs:
            graph._steps = []  # type: ignore[union-attr]
        x4, out4 = torch.randn(4), torch.empty(4)

        def bare(graphs: list[Any] = graphs, k: int = k, x4: torch.Tensor = x4,
                 out4: torch.Tensor = out4) -> None:
            for graph in graphs:
                graph.replay()
            with torch.inference_mode():
                for _ in range(k):
                    op(x4, out4)

        variants[f"step{k}"] = lambda r=runner, a=args: r(*a)
        variants[f"bare{k}"] = bare
    rows = per_call_us(variants, rounds=80, iters=200)
    hosts = {k: rows[f"step{k}"] - rows[f"bare{k}"] for k in (few, many)}
    slope = (hosts[many] - hosts[few]) / (many - few)
    print(f"\nPlanned PIECEWISE step, graphs emptied, lean splitting op: host {hosts[few]:.1f} us "
          f"with {few + 1} pieces ({hosts[few] / (few + 1):.1f} us per piece), "
          f"{hosts[many]:.1f} us with {many + 1} ({hosts[many] / (many + 1):.1f} us per piece); "
          f"{slope:.1f} us per added piece")
    return {"host_few_us": hosts[few], "host_many_us": hosts[many],
            "per_piece_many_us": hosts[many] / (many + 1), "per_added_piece_us": slope}


class Doubler(torch.nn.Module):
    """A model that does (almost) nothing: one multiply."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


# -- side by side with another checkout (--against) -------------------------------------------
FIRST_SHAPES = 256  # the first-step runners serve 1..256 tokens, all padded to 256
FRESH_SIZES = 96  # the first-size runners capture sizes 1..96, each shape a size of its own


def _example_runner(graph_mode: str, sizes: list[int]) -> GraphRunner:
    """``ExampleMLP`` (2 layers) compiled with the eager compiler behind a captured runner
    (emulated graphs of ``graph_mode`` at ``sizes``), its graphs emptied: a replay re-runs
    nothing, so a step's time is its host path, the splitting ops and empty replays."""
    from freezeframe.models.example import MIX_OP, ExampleMLP
    module = ExampleMLP()
    cfg = ff.CompilationConfig(
        mode="piecewise", backend="eager", splitting_ops=[MIX_OP], cudagraph_mode=graph_mode,
        graph_backend="emulated", cudagraph_capture_sizes=sizes, max_num_tokens=max(sizes),
        max_num_seqs=8, use_cache=False)
    model = ff.compile(module, cfg)
    runner = GraphRunner(model, cfg, inputs={"x": Tokens(module.hidden_size)}, progress=False)
    runner.capture()
    for wrapper in model.graph_wrappers():
        for desc in wrapper.captured_descriptors:
            graph = wrapper.graph_for(desc)
            graph._steps = []  # type: ignore[union-attr]
    return runner


def _worker() -> None:
    """A worker of --against: set the runners up, then answer the parent's commands (one per
    line on stdin, one figure per line on stdout, in microseconds)."""
    torch.set_num_threads(1)
    x3 = torch.randn(3, 32)
    planned = {mode: _example_runner(mode, [1, 2, 4, 8]) for mode in ("full", "piecewise")}
    for runner in planned.values():
        runner(x3)  # the first step of the shape plans it
        runner(x3)
    inputs = {n: torch.randn(n, 32) for n in range(1, FIRST_SHAPES + 1)}
    # "first": every shape padded to one size, whose first shape was stepped in the set-up;
    # "first-size": every shape a size of its own (each captured)
    first = {("first", mode): _example_runner(mode, [FIRST_SHAPES])
             for mode in ("full", "piecewise")}
    for runner in first.values():
        runner(inputs[FIRST_SHAPES])
    first.update({("first-size", mode): _example_runner(mode, list(range(1, FRESH_SIZES + 1)))
                  for mode in ("full", "piecewise")})
    fresh = {key: iter(range(1, FIRST_SHAPES)) for key in first}
    print("ready", flush=True)
    for line in sys.stdin:
        command, mode, count = line.split()
        n = int(count)
        if command == "planned":
            runner = planned[mode]
            start = time.thread_time()
            for _ in range(n):
                runner(x3)
            us = (time.thread_time() - start) / n * 1e6
        else:  # the first step of each of n shapes not seen yet
            runner, times = first[command, mode], []
            for _ in range(n):
                x = inputs[next(fresh[command, mode])]
                start = time.thread_time()
                runner(x)
                times.append(time.thread_time() - start)
            us = statistics.median(times) * 1e6
        print(us, flush=True)


def _first_call() -> None:
    """--first-call: the CPU time of ff.compile(ExampleMLP()) and its first call, printed in
    microseconds (a fresh process per sample: nothing of an earlier trace is cached)."""
    from freezeframe.models.example import MIX_OP, ExampleMLP
    torch.set_num_threads(1)
    module = ExampleMLP()
    x = module.example_input(3)
    cfg = ff.CompilationConfig(mode="piecewise", backend="eager", splitting_ops=[MIX_OP],
                               cudagraph_mode="none", use_cache=False)
    start = time.process_time()
    ff.compile(module, cfg)(x)
    print((time.process_time() - start) * 1e6)


def against(other: Path, rounds: int, first_calls: int) -> None:
    """The step rows of this checkout and ``other``, side by side (see the module docstring)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {"this": REPO / "src", "other": other.resolve() / "src"}
    for side, src in sides.items():
        if not (src / "freezeframe").is_dir():
            raise SystemExit(f"--against: no freezeframe package under {src} ({side})")
    script = str(Path(__file__).resolve())
    workers = {side: subprocess.Popen([sys.executable, script, "--worker", "--src", str(src)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=env)
               for side, src in sides.items()}

    def ask(side: str, line: str) -> float:
        proc = workers[side]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    for side, proc in workers.items():
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"--against: the {side} worker failed to start")
    rows = {"planned FULL step": "planned full 200",
            "planned PIECEWISE step": "planned piecewise 200",
            "first FULL step of a shape": f"first full {FIRST_SHAPES // rounds // 2 or 1}",
            "first PIECEWISE step of a shape":
                f"first piecewise {FIRST_SHAPES // rounds // 2 or 1}",
            "first FULL step of a size": f"first-size full {FRESH_SIZES // rounds or 1}",
            "first PIECEWISE step of a size":
                f"first-size piecewise {FRESH_SIZES // rounds or 1}"}
    samples: dict[str, dict[str, list[float]]] = {row: {s: [] for s in sides} for row in rows}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for row, line in rows.items():
            for side in order:
                samples[row][side].append(ask(side, line))
    for proc in workers.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    row = "first ff.compile call (ms)"
    if first_calls:
        samples[row] = {s: [] for s in sides}
    for r in range(first_calls):
        for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            out = subprocess.run([sys.executable, script, "--first-call", "--src",
                                  str(sides[side])], env=env, capture_output=True, text=True,
                                 check=True)
            samples[row][side].append(float(out.stdout.split()[-1]) / 1000)
    print(f"\nside by side: this = {REPO}, other = {other.resolve()}; {rounds} rounds "
          f"(first calls: {first_calls}), CPU time per step in us (first call: ms)")
    print(f"  {'':34} {'this best':>10} {'median':>9} {'other best':>11} {'median':>9} "
          f"{'this/other':>11} {'paired':>8}")
    for row, by_side in samples.items():
        this, them = by_side["this"], by_side["other"]
        # the median over rounds of each round's ratio: the two sides of one round ran
        # back to back, so a drift of the machine's speed between rounds cancels out
        paired = statistics.median(a / b for a, b in zip(this, them, strict=True))
        print(f"  {row:34} {min(this):10.1f} {statistics.median(this):9.1f} "
              f"{min(them):11.1f} {statistics.median(them):9.1f} "
              f"{statistics.median(this) / statistics.median(them):10.2f}x {paired:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="time the runner's steps here and in CHECKOUT side by side")
    parser.add_argument("--rounds", type=int, default=20,
                        help="rounds of --against (default 20)")
    parser.add_argument("--first-calls", type=int, default=5,
                        help="first-call samples per checkout with --against (default 5; 0: "
                             "none)")
    parser.add_argument("--src", help=argparse.SUPPRESS)  # (read before the imports)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker()
    if args.first_call:
        return _first_call()
    if args.against is not None:
        return against(args.against, args.rounds, args.first_calls)
    torch.set_num_threads(1)
    with torch.inference_mode():
        # The lean op first: silly::attention's own 30-50 us call is noisy enough to move the
        # rows below by several microseconds from run to run.
        measure("Chain(2 lean splitting ops, x: 8)", Chain(2), (torch.randn(8),),
                splitting_op=LEAN_OP, rounds=80, iters=200)
        tokens = (torch.randint(0, 32, (8,)), torch.arange(8))
        # Every parameter is a graph input read from the module on each call (as Dynamo's own
        # code reads it), so the overhead grows with the layers: 9 reads against 49.
        for layers in (2, 12):
            measure(f"ToyLlama({layers} layers, 8 tokens, lean op)", lean_llama(layers),
                    tokens, splitting_op=LEAN_OP, rounds=40, iters=100)
        measure("SillyModel(x: 8)", SillyModel(), (torch.randn(8),))
        compiled_parts("ToyLlama(2 layers, 8 tokens, lean op)", lean_llama(2), tokens)
    long = {"dtype": torch.long}
    runner_overhead("no-op model (x * 2)", Doubler(), {"x": Tokens(4)},
                    (torch.randn(3, 4),), [])
    runner_overhead("SillyModel", SillyModel(), {"x": Tokens()}, (torch.randn(3),),
                    ["silly::attention"])
    x4 = torch.randn(4)
    piecewise_overhead("SillyModel", SillyModel(), (torch.randn(3),),
                       torch.ops.silly.attention, (x4, x4, x4, torch.empty(4)))
    piece_slope()
    runner_overhead("ToyLlama(2 layers)", ToyLlama(LlamaConfig(num_layers=2)),
                    {"input_ids": Tokens(**long), "positions": Tokens(**long)},
                    (torch.randint(0, 128, (3,)), torch.arange(3)), ["silly::attention"])


if __name__ == "__main__":
    main()
