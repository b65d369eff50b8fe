"""Every Triton kernel of the project compiles for real GPUs (sm_80, sm_90) on this CPU.

The CPU tests run the kernels in Triton's interpreter, which accepts code a real compile refuses
(a plain Python global read inside a kernel passed every CPU test and failed on the first GPU).
Triton compiles for a named GPU target down to a cubin without a GPU, so each kernel is compiled
here for the shapes the bench uses, in a child process started without ``TRITON_INTERPRET``
(this process imported triton with the interpreter on).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# (dtype, num_heads, num_kv_heads, head_dim, block_size): the 1B preset in bf16 and fp16 (the
# bench's GPU model), the tiny preset in fp32 (the CPU bench and the tests), an MHA layout
SHAPES = [("bfloat16", 32, 8, 64, 16), ("float16", 32, 8, 64, 16), ("float32", 4, 2, 16, 16),
          ("bfloat16", 8, 8, 128, 32)]
CHILD = textwrap.dedent("""
    import json, sys, torch
    from freezeframe.models.paged_attention_triton import compile_for_gpu
    done = []
    for capability in (80, 90):
        for dtype, heads, kv, dim, block in json.loads(sys.argv[1]):
            kernels = compile_for_gpu(capability, dtype=getattr(torch, dtype), num_heads=heads,
                                      num_kv_heads=kv, head_dim=dim, block_size=block)
            done.append([capability, dtype, heads, kv, dim, block,
                         {name: len(k.asm["cubin"]) for name, k in kernels.items()}])
    print(json.dumps(done))
""")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 warning only
    return env


def test_the_paged_attention_kernels_compile_to_cubin_for_sm80_and_sm90() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SHAPES)], cwd=ROOT,
                          env=_child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [row[:6] for row in done] == [[cap, *shape] for cap in (80, 90) for shape in SHAPES]
    # the one-pass kernel and the split-KV pair, each a real cubin (not an empty object)
    assert all(sorted(row[6]) == ["attention", "reduce", "split"] for row in done)
    assert all(size > 1000 for row in done for size in row[6].values())


def test_the_ahead_of_time_compile_catches_what_the_interpreter_lets_through(
        tmp_path: Path) -> None:
    """The check has teeth: a kernel reading a plain module global (the bug the paged-attention
    kernel shipped with) compiles in no target, though the interpreter runs it."""
    child = textwrap.dedent("""
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        LIMIT = -1.0e30
        @triton.jit
        def kernel(out_ptr):
            tl.store(out_ptr, tl.full([1], LIMIT, dtype=tl.float32).sum())
        try:
            triton.compile(ASTSource(kernel, {"out_ptr": "*fp32"}, {}),
                           target=GPUTarget("cuda", 90, 32))
        except Exception as exc:
            print("refused:", type(exc).__name__, "Cannot access global" in str(exc))
        else:
            print("compiled")
    """)
    script = tmp_path / "plain_global_kernel.py"  # Triton reads a kernel's source from a file
    script.write_text(child)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "refused: CompilationError True"


def test_compile_for_gpu_refuses_an_interpreted_kernel_with_the_fix_named() -> None:
    from freezeframe.errors import ConfigError
    from freezeframe.models import paged_attention_triton

    if not paged_attention_triton.interpreter_ready():
        pytest.skip("this process runs compiled Triton kernels (CUDA present)")
    import torch

    with pytest.raises(ConfigError, match="without that variable"):
        paged_attention_triton.compile_for_gpu(90, dtype=torch.bfloat16, num_heads=4,
                                               num_kv_heads=2, head_dim=16, block_size=16)
