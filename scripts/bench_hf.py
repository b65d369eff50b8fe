"""Greedy decode of a Hugging Face LlamaForCausalLM: HF eager, HF + torch.compile, freezeframe.

    python scripts/bench_hf.py [--preset tiny|1b] [--batch-sizes 1,8,32] [--prompt 16]
                               [--new-tokens 32] [--device cpu|cuda] [--timeout 300]
                               [--ff-graph-backend auto|emulated|cuda] [--json FILE]

One run times, side by side, the decode steps (one new token for every sequence of the batch)
of one randomly initialised HF Llama (the same weights in every mode, from a fixed seed):

* ``hf-eager``: the model called step by step as ``generate()`` does, SDPA attention and HF's
  dynamic cache;
* ``hf-compile``: ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` with
  HF's ``StaticCache`` (the recipe HF documents for fast decoding). On a CPU reduce-overhead has
  no CUDA graphs: it is Inductor's code alone, and the table says so;
* ``freezeframe``: ``ff.hf.compile(model)`` (pieces compiled by Inductor, split at the attention
  op, graphs per padded batch size where a graph backend is available: on a CPU ``auto`` captures
  nothing, ``--ff-graph-backend emulated`` shows the emulated backend's overhead instead).

Each mode runs in its own process (so one's compile caches and failures cannot touch another),
under ``--timeout`` seconds; a mode that fails or runs out of time is a row saying so. Per batch
size a mode prefills and decodes once untimed (compiling, capturing), then again timed; the
figure is the median decode step. Ratios are HF eager's step time over each mode's (above 1:
faster than HF eager). Generated tokens are compared with HF eager's.

The step-by-step loop here times single decode steps; ``freezeframe bench --modes hf-eager,
hf-compile,ff-hf,ff-hf-lookup`` times whole ``generate`` calls side by side (the GPU check's
Hugging Face rows). Both build the same models (``freezeframe.bench.hf_modes.HF_PRESETS``).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's freezeframe, as in the children

from freezeframe.bench.hf_modes import HF_PRESETS as PRESETS  # noqa: E402

MODES = ("hf-eager", "hf-compile", "freezeframe")


# -- child: one mode -------------------------------------------------------------------------
def _build(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**PRESETS[args.preset], bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    dtype = torch.bfloat16 if args.device == "cuda" and args.preset != "tiny" else torch.float32
    return transformers.LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _cache_kwarg(model: Any) -> str:
    # transformers 5 calls the cache argument ``cache``; 4.x ``past_key_values``
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters \
        else "past_key_values"


def _hf_decode(model: Any, forward: Any, prompts: Any, new: int, cache: Any,
               device: str) -> tuple[list[float], Any]:
    import torch

    key = _cache_kwarg(model)
    out = model(input_ids=prompts, use_cache=True, **{key: cache})
    tokens = out.logits[:, -1].argmax(-1)
    generated, times = [tokens], []
    for _ in range(new - 1):
        _sync(device)
        start = time.perf_counter()
        out = forward(input_ids=tokens[:, None], use_cache=True, **{key: cache})
        tokens = out.logits[:, -1].argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - start)
        generated.append(tokens)
    return times, torch.stack(generated, dim=1)


def _ff_decode(lm: Any, prompts: Any, new: int, device: str) -> tuple[list[float], Any]:
    import torch

    batch, prompt = prompts.shape
    tokens = lm.generate(prompts, max_new_tokens=1)[:, -1].to(device)  # the prefill
    rows = torch.arange(batch, device=device)
    generated, times = [tokens], []
    for i in range(new - 1):
        position = torch.full((batch,), prompt + i, dtype=torch.long, device=device)
        _sync(device)
        start = time.perf_counter()
        tokens = lm.step(tokens, position, rows, uniform_decode=True).argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - start)
        generated.append(tokens)
    return times, torch.stack(generated, dim=1)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = _build(args)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.prompt + args.new_tokens
    notes: list[str] = []
    started = time.perf_counter()
    lm = None
    forward = model
    if args.child == "hf-compile":
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        if args.device != "cuda":
            notes.append("hf-compile on CPU: reduce-overhead has no CUDA graphs here, so this "
                         "is Inductor's code without graphs")
    elif args.child == "freezeframe":
        import freezeframe as ff

        lm = ff.hf.compile(model, max_batch_size=max(sizes), max_cache_len=max_len,
                           backend="inductor", graph_backend=args.ff_graph_backend)
        report = lm.capture()
        notes.append(f"freezeframe: {report.num_graphs} graphs captured "
                     f"(graph_backend={args.ff_graph_backend}"
                     + (", none on a CPU" if report.num_graphs == 0 else "") + ")")
    setup = time.perf_counter() - started
    rows: dict[str, Any] = {}
    with torch.no_grad():
        for batch in sizes:
            prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt),
                                    generator=torch.Generator().manual_seed(batch)
                                    ).to(args.device)
            first = time.perf_counter()
            results = []
            for _ in range(1 + args.repeats):  # untimed warm-up (compiles, captures), timed
                if lm is not None:
                    results.append(_ff_decode(lm, prompts, args.new_tokens, args.device))
                    continue
                if args.child == "hf-compile":
                    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len,
                                                     max_batch_size=batch)
                else:
                    cache = transformers.DynamicCache()
                results.append(_hf_decode(model, forward, prompts, args.new_tokens, cache,
                                          args.device))
            times = [t for r in results[1:] for t in r[0]]
            tokens = results[-1][1]
            digest = hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:12]
            rows[str(batch)] = {"ms_per_step": 1e3 * statistics.median(times),
                                "warmup_s": time.perf_counter() - first,
                                "tokens": digest}
    if lm is not None:
        s = lm.stats
        notes.append(f"freezeframe: {len(lm.compiled.pieces)} pieces, "
                     f"{sum(p.is_splitting_op for p in lm.compiled.pieces)} of them the attention "
                     f"op; steps: {s.steps_piecewise} on piecewise graphs, {s.steps_eager} "
                     f"without graphs ({s.fallback_graphs_unavailable} for want of a graph "
                     "backend)")
    return {"mode": args.child, "setup_s": setup, "rows": rows, "notes": notes,
            "transformers": transformers.__version__, "torch": torch.__version__}


# -- parent: every mode, side by side ----------------------------------------------------------
def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--preset", args.preset,
           "--batch-sizes", args.batch_sizes, "--prompt", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--device", args.device,
           "--ff-graph-backend", args.ff_graph_backend, "--threads", str(args.threads),
           "--repeats", str(args.repeats)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"mode": mode, "error": f"failed (exit {proc.returncode}): {last[:160]}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def _table(results: list[dict[str, Any]], sizes: list[str]) -> str:
    eager = next((r for r in results if r["mode"] == "hf-eager" and "rows" in r), None)
    head = ["mode", "setup s"] + [f"bs={b} ms/step" for b in sizes] \
        + [f"bs={b} vs eager" for b in sizes] + ["tokens = eager"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} |" + " |" * (len(head) - 2))
            continue
        ms = [f"{r['rows'][b]['ms_per_step']:.3f}" for b in sizes]
        ratio = [f"{eager['rows'][b]['ms_per_step'] / r['rows'][b]['ms_per_step']:.2f}x"
                 if eager else "-" for b in sizes]
        same = "-" if eager is None else ("yes" if all(
            r["rows"][b]["tokens"] == eager["rows"][b]["tokens"] for b in sizes) else "no")
        lines.append(f"| {r['mode']} | {r['setup_s']:.1f} | " + " | ".join(ms + ratio)
                     + f" | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds each mode may take, compile included")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ff-graph-backend", default="auto",
                        choices=("auto", "emulated", "cuda"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per mode (1: steadier on a shared machine)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed decodes per batch size (the median step over all)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: give at least 2 (one prefill token and "
                     "one decode step)")
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    sizes = [b.strip() for b in args.batch_sizes.split(",")]
    results = []
    for mode in modes:
        print(f"bench_hf: {mode} ...", file=sys.stderr, flush=True)
        results.append(_run_mode(mode, args))
    import torch

    shapes = PRESETS[args.preset]
    print(f"HF LlamaForCausalLM greedy decode, preset {args.preset} (hidden "
          f"{shapes['hidden_size']}, {shapes['num_hidden_layers']} layers, vocab "
          f"{shapes['vocab_size']}), prompt {args.prompt}, {args.new_tokens} new tokens, on "
          f"{args.device}; torch {torch.__version__}, transformers "
          f"{next((r['transformers'] for r in results if 'transformers' in r), '?')}, "
          f"{args.threads} torch thread(s) per mode")
    print(f"ms/step: median of {args.repeats} x {args.new_tokens - 1} timed decode steps (one "
          "new token for every sequence); vs eager: HF eager's ms/step over the mode's "
          "(above 1x: faster)")
    print(_table(results, sizes))
    for r in results:
        for note in r.get("notes", []):
            print(f"- {note}")
    if args.device == "cpu":
        print("- on this CPU no mode has CUDA graphs; these numbers say nothing about GPU "
              "speed-ups")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
