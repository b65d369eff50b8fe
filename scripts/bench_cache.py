"""Cold vs warm start of the tiny Llama preset with the Inductor compiler, in one run.

Each start is a separate process: import torch and freezeframe, build the model, ``ff.compile``
it and run the first step (which traces and compiles, or loads). The cold start gets an empty
cache root; the warm starts reuse it. Inductor's own cache is pointed at a fresh directory
for every process, so only freezeframe's cache can make a warm start fast.

    python scripts/bench_cache.py [--warm-runs 2] [--preset tiny] [--compile-sizes 8,16]
                                  [--keep DIR] [--device cpu|cuda] [--json FILE]

Prints, per start, the first-call time (trace + compile, or load) and the whole process
time to the first output, then the warm/cold ratios. Target: warm first call <= 10% of cold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import time
t_start = time.perf_counter()
import json, sys
sys.path.insert(0, {src!r})
import torch
import freezeframe as ff
from freezeframe.models.attention import ATTENTION_OP, ATTN_METADATA_KEY
from freezeframe.models.inputs import RequestChunk, build_step
from freezeframe.models.kv_cache import KVCacheConfig
from freezeframe.models.llama import LlamaModel, build_llama

t_import = time.perf_counter()
kv = KVCacheConfig(num_blocks=32, block_size=16, max_model_len=128)
base = build_llama({preset!r}, kv, seed=0, device={device!r})
cfg = ff.CompilationConfig(mode="piecewise", backend="inductor", splitting_ops=[ATTENTION_OP],
                           cudagraph_mode="none", max_num_seqs=8, max_num_tokens=64,
                           compile_sizes={compile_sizes!r}, cache_dir={cache_dir!r})
model = ff.compile(base, cfg, dynamic_arg_dims=dict(LlamaModel.DYNAMIC_ARG_DIMS))
# a mixed step of several tokens (a dynamic dim first seen with size 1 would be specialised)
step = build_step([RequestChunk((1, 2, 3, 4, 5), 0, (0,)), RequestChunk((7, 8, 9), 0, (1,))],
                  kv, device={device!r})
t_first = time.perf_counter()
with torch.no_grad(), ff.forward_context(None, **{{ATTN_METADATA_KEY: step.host}}):
    out = model(*step.args)
if {device!r} != "cpu":
    torch.cuda.synchronize()
t_done = time.perf_counter()
print(json.dumps({{
    "first_call_s": t_done - t_first, "process_s": t_done - t_start,
    "import_s": t_import - t_start, "stats": model.stats.snapshot(),
    "checksum": float(out.double().sum()), "out": out.flatten()[:8].tolist(),
}}))
"""


def _start(cache_dir: Path, preset: str, compile_sizes: list[int],
           device: str) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("FREEZEFRAME_DISABLE_CACHE", None)
    inductor_dir = tempfile.mkdtemp(prefix="ff_bench_inductor_")
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    code = _CHILD.format(src=str(ROOT / "src"), preset=preset, cache_dir=str(cache_dir),
                         compile_sizes=compile_sizes, device=device)
    wall = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=1800)
    finally:
        shutil.rmtree(inductor_dir, ignore_errors=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"benchmark child failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - wall
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="Llama preset (default: tiny)")
    parser.add_argument("--warm-runs", type=int, default=2, help="warm starts to time")
    parser.add_argument("--compile-sizes", default="",
                        help="comma-separated concrete compile sizes (more Inductor work per "
                        "start; default: none, one general-shape compile per piece)")
    parser.add_argument("--keep", metavar="DIR",
                        help="use DIR as the cache root and keep it (must not exist)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu (default), cuda or cuda:N")
    parser.add_argument("--json", metavar="FILE",
                        help="also write every start's figures and the verdict to FILE")
    args = parser.parse_args(argv)

    if args.keep:
        cache_dir = Path(args.keep)
        if cache_dir.exists():
            parser.error(f"--keep {cache_dir}: already exists; a cold start needs a new dir")
        parent = None
    else:
        parent = Path(tempfile.mkdtemp(prefix="ff_bench_cache_"))
        cache_dir = parent / "cache"
    sizes = [int(x) for x in args.compile_sizes.split(",") if x.strip()]
    try:
        cold = _start(cache_dir, args.preset, sizes, args.device)
        warms = [_start(cache_dir, args.preset, sizes, args.device)
                 for _ in range(max(1, args.warm_runs))]
    finally:
        if parent is not None:
            shutil.rmtree(parent, ignore_errors=True)

    def counters(r: dict[str, Any]) -> str:
        s = r["stats"]
        keys = ("inductor_compiles", "cache_hits", "cache_misses", "artifacts_saved",
                "artifacts_loaded", "traces_loaded")
        return " ".join(f"{k}={s.get(k, 0)}" for k in keys)

    print(f"freezeframe compile cache: Llama preset {args.preset!r} on {args.device}, Inductor, "
          f"compile sizes "
          f"{sizes or 'none'}, {len(warms)} warm start(s); python {sys.version.split()[0]}")
    print(f"{'start':<8}{'first call':>12}{'process':>10}{'imports':>10}  counters")
    rows = [("cold", cold)] + [(f"warm{i + 1}", w) for i, w in enumerate(warms)]
    for name, r in rows:
        print(f"{name:<8}{r['first_call_s']:>11.2f}s{r['process_s']:>9.2f}s"
              f"{r['import_s']:>9.2f}s  {counters(r)}")
    warm_first = min(w["first_call_s"] for w in warms)
    warm_proc = min(w["process_s"] for w in warms)
    same = all(w["checksum"] == cold["checksum"] and w["out"] == cold["out"] for w in warms)
    ratio = warm_first / cold["first_call_s"]
    print(f"warm/cold first call (trace+compile vs load): {ratio:.1%} "
          f"({warm_first:.2f}s / {cold['first_call_s']:.2f}s); target <= 10%: "
          f"{'met' if ratio <= 0.10 else 'NOT met'}")
    print(f"warm/cold whole process to first output: {warm_proc / cold['process_s']:.1%} "
          f"({warm_proc:.2f}s / {cold['process_s']:.2f}s)")
    print(f"outputs identical cold vs warm: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "preset": args.preset, "device": args.device, "compile_sizes": sizes,
            "starts": dict(rows), "warm_cold_first_call": ratio,
            "warm_cold_process": warm_proc / cold["process_s"], "outputs_identical": same,
        }, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
