"""Every Triton kernel of the project compiles for real GPUs (sm_80, sm_90) on this CPU, and the
sm_90 build of the decode step is the one meant: a CPU-side proxy for its speed.

The CPU tests run the kernels in Triton's interpreter, which accepts code a real compile refuses
(a plain Python global read inside a kernel passed every CPU test and failed on the first GPU)
and says nothing about the instructions a GPU runs. Triton compiles for a named GPU target down
to a cubin without a GPU, so each kernel is compiled here as the JIT would compile it for the
launches a call makes (``freezeframe.models.kernel_build``), in child processes started without
``TRITON_INTERPRET`` (this process imported triton with the interpreter on), and the build of
the 1B preset's decode step is read: tensor-core instructions in the attention kernel, 16-byte
loads and copies for the keys and values, few barriers, no spills. A kernel change that loses
one of these fails here, before any GPU sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# (capability, dtype, num_heads, num_kv_heads, head_dim, block_size), in two children run side
# by side: the 1B preset in bf16 (the bench's GPU model, read down to its SASS), the tiny preset
# in fp32 (the CPU bench and the tests: fp32 products), an MHA layout of head_dim 128 in fp16;
# sm_80 (A100) for the 1B preset
ONE_B = (90, "bfloat16", 32, 8, 64, 16)
CHILDREN = [[ONE_B, (90, "float32", 4, 2, 16, 16)],
            [(90, "float16", 8, 8, 128, 32), (80, "bfloat16", 32, 8, 64, 16)]]
KERNELS = ["attention", "combine", "split", "write"]
CHILD = textwrap.dedent("""
    import dataclasses, json, sys, torch
    from freezeframe.models.kernel_build import compile_for_gpu, inspect_build
    one_b = json.loads(sys.argv[2])
    done = []
    for cap, dtype, heads, kv, dim, block in json.loads(sys.argv[1]):
        kernels = compile_for_gpu(cap, dtype=getattr(torch, dtype), num_heads=heads,
                                  num_kv_heads=kv, head_dim=dim, block_size=block)
        read = [cap, dtype, heads, kv, dim, block] == one_b
        done.append([cap, dtype, heads, kv, dim, block, {
            name: dict(dataclasses.asdict(inspect_build(
                k, sass=read and name in ("attention", "split"))), cubin=len(k.asm["cubin"]))
            for name, k in kernels.items()}])
    print(json.dumps(done))
""")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 warning only
    return env


@pytest.fixture(scope="module")
def builds() -> dict[tuple[Any, ...], dict[str, dict[str, Any]]]:
    """Every build of ``CHILDREN`` by its shape, each kernel's :class:`BuildReport` fields and
    cubin size."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(shapes),
                               json.dumps(list(ONE_B))], cwd=ROOT, env=_child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for shapes in CHILDREN]
    found = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        for row in json.loads(out.strip().splitlines()[-1]):
            for report in row[6].values():  # JSON made the byte counts' keys strings
                for field in ("loads_by_bytes", "cp_async_by_bytes"):
                    report[field] = {int(size): n for size, n in report[field].items()}
            found[tuple(row[:6])] = row[6]
    return found


def test_the_attention_kernels_compile_to_cubin_for_sm80_and_sm90(
        builds: dict[tuple[Any, ...], dict[str, dict[str, Any]]]) -> None:
    assert sorted(builds) == sorted(tuple(shape) for shapes in CHILDREN for shape in shapes)
    # the cache write, the one-pass attention, its split-KV build and the combine: real cubins
    assert all(sorted(kernels) == KERNELS for kernels in builds.values())
    assert all(k["cubin"] > 1000 for kernels in builds.values() for k in kernels.values())


def test_the_sm90_decode_build_uses_tensor_cores_and_full_width_loads(
        builds: dict[tuple[Any, ...], dict[str, dict[str, Any]]]) -> None:
    """The 1B preset's sm_90 build (bf16, 32 heads, 8 KV heads, head_dim 64, blocks of 16)."""
    kernels = builds[ONE_B]
    for name in ("attention", "split"):
        attend = kernels[name]
        # both products on the tensor cores: per warp and 64-key tile, QK^T is 2 n-tiles x 4
        # k-steps of m16n8k16 and PV 2 x 4 (the old kernel, a broadcast multiply, had none)
        assert attend["tensor_core"] == attend["sass_mma"] == 16
        # keys and values arrive in 16-byte asynchronous copies, pipelined (two stages); no
        # global load narrower than 8 bytes but the token's 1-byte valid flag
        assert set(attend["cp_async_by_bytes"]) == {16} and attend["cp_async_by_bytes"][16] >= 4
        assert {size for size in attend["loads_by_bytes"] if size < 8} == {1}
        assert attend["loads_by_bytes"][1] == 1
        # barriers: 7 (the old kernel had 31 in SASS); no register spilled to local memory
        assert attend["barriers"] <= 8
        assert attend["spills"] == 0
        assert attend["num_warps"] == 4
    write = kernels["write"]
    # q, k and v rows read 16 bytes at a time; the rest are the per-token slot, flag and the
    # fp32 cos/sin rows (one value per thread)
    assert write["loads_by_bytes"][16] >= 3 and 2 not in write["loads_by_bytes"]
    assert kernels["split"]["ptx_lines"] < 1000 and kernels["attention"]["ptx_lines"] < 1000


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
    from freezeframe.models import kernel_build, paged_attention_triton

    if not paged_attention_triton.interpreter_ready():
        pytest.skip("this process runs compiled Triton kernels (CUDA present)")
    import torch

    with pytest.raises(ConfigError, match="without that variable"):
        kernel_build.compile_for_gpu(90, dtype=torch.bfloat16, num_heads=4, num_kv_heads=2,
                                     head_dim=16, block_size=16)
