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
    # the probe refused an ISA the CPU has (a toolchain that cannot build it): trusting the
    # CPU's features would pick another ISA, so the probe must run
    if host["valid"]:
        assert artifacts.isa_probe_trusted({**host, "valid": host["valid"][:-1]}) is False
    assert artifacts.isa_probe_trusted({**host, "valid": [*host["valid"], ["x", "-mx"]]}) \
        is False
    assert artifacts.isa_probe_trusted(None) is False
    assert artifacts.isa_probe_trusted("avx2") is False


@x86
def test_a_user_setting_for_the_probe_is_left_alone() -> None:
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        assert artifacts.isa_probe_trusted(_host()) is False


def test_replay_settings_trust_the_probe_only_inside_and_only_when_asked() -> None:
    from torch._inductor import config as inductor_config

    before = inductor_config.cpp.vec_isa_ok
    with artifacts._replay_settings(True):
        assert inductor_config.cpp.vec_isa_ok is True
        assert inductor_config.cpp_cache_precompile_headers is \
            inductor_config.get_config_copy()["cpp_cache_precompile_headers"]
    assert inductor_config.cpp.vec_isa_ok is before
    with artifacts._replay_settings(False):
        assert inductor_config.cpp.vec_isa_ok is before


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
