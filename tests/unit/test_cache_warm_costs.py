"""What a warm start no longer pays (issue 16): the CPU ISA probe when the compiling process's
recorded result is known to hold here, and Triton's hash in the key on a machine without a GPU.
No compiles: the decisions are checked against records built field by field."""

from __future__ import annotations

import platform
from typing import Any

import pytest
import torch

from freezeframe.cache import artifacts
from freezeframe.cache import key as ff_key

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                         reason="Inductor's ISA probe exists on x86 only")


def _host() -> dict[str, Any]:
    """The record a process on this host writes when its probe accepted every ISA the CPU's
    features allow (what isa_probe_record() returns here, built without running the probe)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    cpu = list(cpu_vec_isa.x86_isa_checker())
    return {"cpu": cpu, "compiler": get_compiler_version_info(get_cpp_compiler()),
            "valid": [[str(i), i.build_arch_flags()] for i in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in cpu for flag in str(i).split())]}


@x86
def test_the_recorded_probe_is_trusted_only_when_everything_it_depends_on_holds() -> None:
    host = _host()
    assert artifacts.isa_probe_trusted(host) is True
    assert artifacts.isa_probe_trusted({**host, "cpu": [*host["cpu"], "made_up_isa"]}) is False
    assert artifacts.isa_probe_trusted({**host, "compiler": "another compiler"}) is False
    # the probe refused an ISA the CPU has (a toolchain that cannot build it): the record
    # answers that build too (refused), as the same compiler would again
    if host["valid"]:
        assert artifacts.isa_probe_trusted({**host, "valid": host["valid"][:-1]}) is True
    # an ISA these features do not allow, or one recorded with fewer flags than this process
    # starts from: the record was not made here
    assert artifacts.isa_probe_trusted({**host, "valid": [*host["valid"], ["x", "-mx"]]}) \
        is False
    if host["valid"]:
        name, flags = host["valid"][0]
        fewer = [[name, " ".join(flags.split()[:-1])], *host["valid"][1:]]
        assert artifacts.isa_probe_trusted({**host, "valid": fewer}) is False
    # the sub-checks' flags (AVX-512 BF16, AMX-FP16) on top of the base: still this host
    extra = [[name, flags + " -mavx512bf16"] for name, flags in host["valid"]]
    assert artifacts.isa_probe_trusted({**host, "valid": extra}) is True
    assert artifacts.isa_probe_trusted(None) is False
    assert artifacts.isa_probe_trusted("avx2") is False


@x86
def test_a_user_setting_for_the_probe_is_left_alone() -> None:
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        assert artifacts.isa_probe_trusted(_host()) is False


@x86
def test_the_record_answers_every_build_of_the_probe_in_a_fresh_process() -> None:
    """In a fresh process whose probe would raise if it built anything, the ISA list Inductor
    computes from a record is the record's, sub-check flags included (on an AMX CPU the
    probe's AVX-512 BF16 and AMX builds were what a warm start still ran), and a refused ISA
    stays refused; the real check_build is back afterwards."""
    import json
    import subprocess
    import sys
    import textwrap

    from torch._inductor import cpu_vec_isa

    # what the probe finds here (run in this process, seconds), less its first ISA
    probed = [[str(i), i.build_arch_flags()] for i in cpu_vec_isa.valid_vec_isa_list()]
    record = {**_host(), "valid": probed[1:]}
    child = textwrap.dedent("""
        import json, sys
        import torch._inductor.cpu_vec_isa as isa
        from freezeframe.cache import artifacts
        def probe(self, code):
            raise RuntimeError("the ISA probe ran")
        isa.VecISA.check_build = probe
        record = json.loads(sys.argv[1])
        assert artifacts.isa_probe_trusted(record)
        artifacts._answer_isa_probe(record)
        got = [[str(i), i.build_arch_flags()] for i in isa.valid_vec_isa_list()]
        print(json.dumps([got, isa.VecISA.check_build is probe]))
    """)
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(record)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, restored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == record["valid"] and restored is True


def test_no_gpu_means_no_triton_hash_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.codecache import CacheBase

    def refuse() -> Any:
        raise AssertionError("get_system hashes Triton's files")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(CacheBase, "get_system", staticmethod(refuse))
    assert ff_key.torch_factors()["inductor_system"] == "no gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(CacheBase, "get_system", staticmethod(lambda: {"hash": "gpu-hash"}))
    assert ff_key.torch_factors()["inductor_system"] == "gpu-hash"
