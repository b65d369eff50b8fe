"""The attention op's Triton kernels built for a real GPU on a machine without one, and what
their builds hold: the CPU-side check that the kernels a GPU will run are the ones meant.

Why: Triton's interpreter, which runs the kernels on CPU tensors in the tests, accepts code that
a real compile refuses (a plain Python global read inside a kernel, say), and says nothing about
speed. Compiling for the real target (``sm_90``: H100, H200) down to a cubin and reading the
build turns both into test failures: :func:`compile_for_gpu` builds each kernel exactly as
Triton's JIT would for the launch a plan makes (the same arguments, the same specialisation of
16-byte-aligned pointers, integers divisible by 16 and integers equal to 1), and
:func:`inspect_build` counts what matters in the PTX and the SASS: tensor-core instructions,
the width of global loads, ``cp.async`` copies, barriers, local-memory spills.

Needs a process in which triton was imported without ``TRITON_INTERPRET=1`` (the tests run it
in a child process); the SASS needs the ``cuobjdump`` Triton ships.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from freezeframe.errors import ConfigError
from freezeframe.models import attention_kernels as kernels
from freezeframe.models import paged_attention_triton as host
from freezeframe.models.attention import split_workspace

__all__ = ["BuildReport", "compile_for_gpu", "inspect_build"]

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.bool: "u1"}
_DIVISIBLE = [["tt.divisibility", 16]]


def compile_for_gpu(capability: int, *, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, num_tokens: int = 4, num_blocks: int = 64,
                    max_blocks: int = 8, splits: int = 4) -> dict[str, Any]:
    """Compile the kernels of one decode step of the given shapes for an NVIDIA GPU of compute
    ``capability`` (80: A100, 90: H100), down to cubins, without a GPU and without launching
    them. Returns Triton's compiled kernels by name: ``"write"`` (RoPE and the cache write),
    ``"attention"`` (one pass), ``"split"`` (the attention kernel with ``splits`` splits) and
    ``"combine"``. The launches come from the same plans a call makes, on meta tensors shaped
    as the reference Llama passes them (``q``, ``k``, ``v`` views of one projection)."""
    if not isinstance(kernels.attend_kernel, JITFunction) \
            or isinstance(kernels.attend_kernel, InterpretedFunction):
        raise ConfigError(
            "compile_for_gpu: triton was imported with TRITON_INTERPRET=1, so the kernels are "
            "interpreted functions that cannot be compiled; call it in a process started "
            "without that variable")
    width = (num_heads + 2 * num_kv_heads) * head_dim

    def meta(*shape: int, kind: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(*shape, dtype=kind, device="meta")

    qkv = meta(num_tokens, width, kind=dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    slots = num_blocks * block_size + 1
    tensors = dict(
        q=qkv[:, :q_end].view(num_tokens, num_heads, head_dim),
        k=qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),
        v=qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim),
        rope=meta(num_tokens, head_dim, kind=torch.float32),
        out=meta(num_tokens, num_heads, head_dim, kind=dtype),
        k_cache=meta(slots, num_kv_heads, head_dim, kind=dtype),
        v_cache=meta(slots, num_kv_heads, head_dim, kind=dtype),
        positions=meta(num_tokens), slot_mapping=meta(num_tokens), token_req=meta(num_tokens),
        token_valid=meta(num_tokens, kind=torch.bool), block_tables=meta(num_tokens, max_blocks),
        workspace=split_workspace(num_heads, num_kv_heads, head_dim, device="meta"))
    one_pass = host.plan_for(tensors, block_size, head_dim ** -0.5, 1)
    split = host.plan_for(tensors, block_size, head_dim ** -0.5, splits)
    assert one_pass.write is not None and split.combine is not None
    ordered = host.call_tensors(tensors)
    return {"write": _build(one_pass.write, ordered, capability),
            "attention": _build(one_pass.attend, ordered, capability),
            "split": _build(split.attend, ordered, capability),
            "combine": _build(split.combine, ordered, capability)}


def _build(launch: Any, tensors: tuple[Any, ...], capability: int) -> Any:
    """``launch`` compiled for the target, specialised as Triton's JIT specialises it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = launch.kernel.arg_names
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for index, (name, value) in enumerate(zip(names, launch.arguments(tensors), strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            attrs[(index,)] = _DIVISIBLE  # meta tensors stand for aligned ones
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:  # the JIT turns an integer argument equal to 1 into a constant
            signature[name] = "constexpr"
            constexprs[(index,)] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = _DIVISIBLE
    for name, value in launch.constants.items():
        signature[name] = "constexpr"
        constexprs[(names.index(name),)] = value
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options=dict(launch.options))


@dataclasses.dataclass(frozen=True)
class BuildReport:
    """What one compiled kernel holds, counted in its PTX and its SASS.

    ``tensor_core``: matrix instructions (``mma``/``wgmma``) in PTX; ``loads_by_bytes``: global
    loads by bytes per thread (16 is a full vector load); ``cp_async_by_bytes``: asynchronous
    global-to-shared copies by bytes; ``barriers``: CTA barriers (``bar.sync``) in PTX;
    ``ptx_lines`` (instructions and labels); ``num_warps``; ``shared``: shared memory in bytes.
    From the SASS, when read (else None): ``sass_mma`` (``HMMA``, ``HGMMA``) and ``spills``
    (local-memory loads and stores, ``LDL``/``STL``)."""

    tensor_core: int
    loads_by_bytes: dict[int, int]
    cp_async_by_bytes: dict[int, int]
    barriers: int
    ptx_lines: int
    num_warps: int
    shared: int
    sass_mma: int | None
    spills: int | None


_PTX_LOAD = re.compile(r"\bld\.global(?P<mods>(?:\.[\w:]+)*)")


def _load_bytes(mods: str) -> int:
    vector = re.search(r"\.v(\d)", mods)
    width = re.search(r"\.[busf](8|16|32|64|128)\b", mods)
    bits = int(width.group(1)) if width else 32
    return (int(vector.group(1)) if vector else 1) * bits // 8


def inspect_build(compiled: Any, *, sass: bool = True) -> BuildReport:
    """Count ``compiled``'s (a Triton compiled kernel's) instructions that decide its speed;
    ``sass=False`` skips the SASS (a ``cuobjdump`` run, about a second)."""
    ptx = compiled.asm["ptx"]
    code = [line for line in (raw.strip() for raw in ptx.splitlines())
            if line and not line.startswith(("//", "."))]
    loads: dict[int, int] = {}
    for match in _PTX_LOAD.finditer(ptx):
        size = _load_bytes(match.group("mods"))
        loads[size] = loads.get(size, 0) + 1
    copies: dict[int, int] = {}
    for size in re.findall(r"\bcp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)",
                           ptx):
        copies[int(size, 0)] = copies.get(int(size, 0), 0) + 1
    disassembly = _sass(compiled.asm["cubin"]) if sass else None
    return BuildReport(
        tensor_core=len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", ptx)),
        loads_by_bytes=dict(sorted(loads.items())),
        cp_async_by_bytes=dict(sorted(copies.items())),
        barriers=len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
        ptx_lines=len(code),
        num_warps=int(compiled.metadata.num_warps),
        shared=int(compiled.metadata.shared),
        sass_mma=None if disassembly is None else len(re.findall(r"\b(?:HMMA|HGMMA)\b",
                                                                    disassembly)),
        spills=None if disassembly is None else len(re.findall(r"\b(?:LDL|STL)\b",
                                                                  disassembly)),
    )


def _sass(cubin: bytes) -> str:
    """The SASS of a cubin, from the ``cuobjdump`` Triton ships."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout
