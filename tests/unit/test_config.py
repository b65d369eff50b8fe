"""CompilationConfig: the rules of research §2 and the table of §7.7, JSON, errors, cache key."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freezeframe.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    breakable_capture,
)
from freezeframe.errors import ConfigError
from freezeframe.sizes import Range

REPO = Path(__file__).resolve().parents[2]
LADDER_256 = (1, 2, 4, *range(8, 257, 8))

# -- enums ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (0, CompilationMode.NONE),
        (1, CompilationMode.STOCK_TORCH_COMPILE),
        (2, CompilationMode.DYNAMO_TRACE_ONCE),
        (3, CompilationMode.PIECEWISE),
        ("3", CompilationMode.PIECEWISE),
        ("none", CompilationMode.NONE),
        ("Stock_Torch_Compile", CompilationMode.STOCK_TORCH_COMPILE),
        ("dynamo_trace_once", CompilationMode.DYNAMO_TRACE_ONCE),
        ("PIECEWISE", CompilationMode.PIECEWISE),
        ("vllm_compile", CompilationMode.PIECEWISE),
        ("VLLM_COMPILE", CompilationMode.PIECEWISE),
        ("dynamo_once", CompilationMode.DYNAMO_TRACE_ONCE),
        ("DYNAMO_AS_IS", CompilationMode.STOCK_TORCH_COMPILE),
        ("no_compilation", CompilationMode.NONE),
        (None, CompilationMode.PIECEWISE),
        (CompilationMode.NONE, CompilationMode.NONE),
    ],
)
def test_compilation_mode_parse(given: Any, want: CompilationMode) -> None:
    assert CompilationMode.parse(given) is want


@pytest.mark.parametrize("bad", [4, -1, True, "fast", "", 3.0])
def test_compilation_mode_parse_errors(bad: Any) -> None:
    with pytest.raises(ConfigError, match="mode: unknown compilation mode") as exc:
        CompilationMode.parse(bad)
    assert "NONE (0), STOCK_TORCH_COMPILE (1), DYNAMO_TRACE_ONCE (2), PIECEWISE (3)" in str(
        exc.value)
    assert "VLLM_COMPILE" in str(exc.value)


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("none", CUDAGraphMode.NONE),
        ("Piecewise", CUDAGraphMode.PIECEWISE),
        ("FULL", CUDAGraphMode.FULL),
        ("full_decode_only", CUDAGraphMode.FULL_DECODE_ONLY),
        (" Full_And_Piecewise ", CUDAGraphMode.FULL_AND_PIECEWISE),
        (0, CUDAGraphMode.NONE),
        (1, CUDAGraphMode.PIECEWISE),
        (2, CUDAGraphMode.FULL),
        (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
        # the forms vLLM prints a mode in (issue 42 item 15): a JSON dump's value pair, the
        # enum's str and repr, a value as text
        ([2, 1], CUDAGraphMode.FULL_AND_PIECEWISE),
        ([2, 0], CUDAGraphMode.FULL_DECODE_ONLY),
        ((2, 1), CUDAGraphMode.FULL_AND_PIECEWISE),
        ("[2, 0]", CUDAGraphMode.FULL_DECODE_ONLY),
        ("(2, 1)", CUDAGraphMode.FULL_AND_PIECEWISE),
        ("1", CUDAGraphMode.PIECEWISE),
        ("CUDAGraphMode.FULL_DECODE_ONLY", CUDAGraphMode.FULL_DECODE_ONLY),
        ("<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>", CUDAGraphMode.FULL_AND_PIECEWISE),
        ("<CUDAGraphMode.NONE: 0>", CUDAGraphMode.NONE),
    ],
)
def test_cudagraph_mode_parse(given: Any, want: CUDAGraphMode) -> None:
    assert CUDAGraphMode.parse(given) is want


def test_a_vllm_json_with_the_mode_as_a_pair_is_read() -> None:
    cfg = CompilationConfig.from_json('{"cudagraph_mode": [2, 1], "max_num_seqs": 8, '
                                      '"splitting_ops": ["silly::attention"]}')
    assert cfg.cudagraph_mode is CUDAGraphMode.FULL_AND_PIECEWISE
    assert cfg.cudagraph_capture_sizes == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("bad", ["fully", 3, True, "", [2, 2], [1, 2], [2, 1, 0], "[3]",
                                 [True, False], "CUDAGraphMode.HALF"])
def test_cudagraph_mode_parse_errors(bad: Any) -> None:
    with pytest.raises(ConfigError, match="cudagraph_mode: unknown CUDA-graph mode") as exc:
        CUDAGraphMode.parse(bad)
    assert "NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE" in str(exc.value)


M = CUDAGraphMode


@pytest.mark.parametrize(
    # mode, separate, decode, mixed, max, has_full, has_piecewise/requires_piecewise
    ("mode", "sep", "dec", "mix", "mx", "full", "pw"),
    [
        (M.NONE, False, M.NONE, M.NONE, M.NONE, False, False),
        (M.PIECEWISE, False, M.PIECEWISE, M.PIECEWISE, M.PIECEWISE, False, True),
        (M.FULL, False, M.FULL, M.FULL, M.FULL, True, False),
        (M.FULL_DECODE_ONLY, True, M.FULL, M.NONE, M.FULL, True, False),
        (M.FULL_AND_PIECEWISE, True, M.FULL, M.PIECEWISE, M.FULL, True, True),
    ],
)
def test_cudagraph_mode_helpers(mode: CUDAGraphMode, sep: bool, dec: CUDAGraphMode,
                                mix: CUDAGraphMode, mx: CUDAGraphMode, full: bool,
                                pw: bool) -> None:
    assert mode.separate_routine() is sep
    assert mode.decode_mode() is dec
    assert mode.mixed_mode() is mix
    assert mode.max_cudagraph_mode() is mx
    assert mode.has_full_cudagraphs() is full
    assert mode.has_piecewise_cudagraphs() is pw
    assert mode.requires_piecewise_compilation() is pw
    assert mode.has_mode(dec) and mode.has_mode(mix)


def test_cudagraph_mode_runtime_modes() -> None:
    assert CUDAGraphMode.valid_runtime_modes() == {M.NONE, M.PIECEWISE, M.FULL}
    assert not M.FULL_DECODE_ONLY.has_mode(M.PIECEWISE)
    with pytest.raises(ValueError, match="runtime mode"):
        M.FULL.has_mode(M.FULL_AND_PIECEWISE)


# -- research §7.7: test_cudagraph_sizes_post_init ---------------------------------------------
# vLLM builds these with an opt-125m engine and max_num_seqs = min(budget, 128); here the budget
# is max_num_tokens and max_num_seqs is given directly. vLLM's rows with tensor parallelism +
# sequence parallelism (sizes not divisible by TP dropped) do not apply: freezeframe has no TP.

F_AND_P = "full_and_piecewise"


@pytest.mark.parametrize(
    ("capture_sizes", "max_size", "budget", "graph_mode", "want_max", "want_sizes"),
    [
        (None, None, 2048, F_AND_P, 256, LADDER_256),
        ([1, 2, 4], 4, 2048, F_AND_P, 4, (1, 2, 4)),
        ([1, 256], None, 2048, F_AND_P, 256, (1, 256)),
        ([], None, 2048, "none", 0, ()),
        (None, 0, 2048, "none", 0, ()),
        (None, 257, 2048, F_AND_P, 257, (*LADDER_256, 257)),  # the maximum joins the ladder
        (None, 257, 200, F_AND_P, 200, (1, 2, 4, *range(8, 193, 8), 200)),  # token budget
        ([1, 2, 4, 15], None, 2048, F_AND_P, 15, (1, 2, 4, 15)),
        ([1, 2, 4, 15], None, 8, F_AND_P, 4, (1, 2, 4)),  # 15 is above the budget
    ],
)
def test_cudagraph_sizes_post_init(capture_sizes: list[int] | None, max_size: int | None,
                                   budget: int, graph_mode: str, want_max: int,
                                   want_sizes: tuple[int, ...]) -> None:
    cfg = CompilationConfig(
        cudagraph_capture_sizes=capture_sizes, max_cudagraph_capture_size=max_size,
        max_num_tokens=budget, max_num_seqs=min(budget, 128), cudagraph_mode=graph_mode,
        backend="eager")
    assert cfg.max_cudagraph_capture_size == want_max
    assert cfg.cudagraph_capture_sizes == want_sizes


@pytest.mark.parametrize(
    ("capture_sizes", "max_size", "match"),
    [
        ([1, 2, 4], 8, r"max_cudagraph_capture_size=8 disagrees with the largest of "
                       r"cudagraph_capture_sizes=\[1, 2, 4\] \(4\)"),
        ([], None, r"cudagraph_capture_sizes: \[\] leaves no size to capture"),
        ([1, 2], 0, r"max_cudagraph_capture_size=0 disagrees with the largest of "
                    r"cudagraph_capture_sizes=\[1, 2\] \(2\)"),
    ],
)
def test_cudagraph_sizes_post_init_errors(capture_sizes: list[int] | None,
                                          max_size: int | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CompilationConfig(cudagraph_capture_sizes=capture_sizes,
                          max_cudagraph_capture_size=max_size, max_num_tokens=2048,
                          max_num_seqs=128, cudagraph_mode=F_AND_P, backend="eager")


def test_truncation_and_dropped_sizes_warn(ff_logs: pytest.LogCaptureFixture) -> None:
    CompilationConfig(max_cudagraph_capture_size=257, max_num_tokens=200, max_num_seqs=128)
    assert ("Truncating max_cudagraph_capture_size from 257 to 200: no batch has more than "
            "max_num_tokens=200 tokens") in ff_logs.text
    ff_logs.clear()
    CompilationConfig(max_cudagraph_capture_size=257, max_num_tokens=2048, max_num_seqs=128)
    assert "Truncating" not in ff_logs.text
    ff_logs.clear()
    cfg = CompilationConfig(cudagraph_capture_sizes=[4, 1, 2, 2, 15], max_num_tokens=8)
    assert cfg.cudagraph_capture_sizes == (1, 2, 4)
    assert "above max_num_tokens=8 were dropped: [15]" in ff_logs.text


def test_default_ladder_has_51_sizes() -> None:
    cfg = CompilationConfig()
    assert cfg.cudagraph_mode is M.PIECEWISE
    assert len(cfg.cudagraph_capture_sizes) == 51
    assert cfg.max_cudagraph_capture_size == 512
    assert CompilationConfig(max_num_seqs=128).max_cudagraph_capture_size == 256
    # the user's list is deduplicated and sorted
    assert CompilationConfig(cudagraph_capture_sizes=[8, 2, 8, 1]).cudagraph_capture_sizes == (
        1, 2, 8)


def test_a_token_budget_off_the_ladder_is_its_last_size() -> None:
    # vLLM's field name for the budget is accepted too
    cfg = CompilationConfig.from_dict({"max_num_batched_tokens": 100})
    assert cfg.max_num_tokens == 100
    assert cfg.cudagraph_capture_sizes == (1, 2, 4, *range(8, 97, 8), 100)
    assert cfg.max_cudagraph_capture_size == 100
    assert [cfg.padded_size(n) for n in (95, 96, 97, 100, 101)] == [96, 96, 100, 100, None]


@settings(deadline=None, max_examples=60)  # the machine is shared; timing is not under test
@given(budget=st.integers(1, 1200), seqs=st.integers(1, 300),
       user_max=st.one_of(st.none(), st.integers(1, 1200)))
def test_every_size_up_to_the_maximum_has_a_padded_size(budget: int, seqs: int,
                                                        user_max: int | None) -> None:
    cfg = CompilationConfig(max_num_tokens=budget, max_num_seqs=seqs,
                            max_cudagraph_capture_size=user_max, backend="eager")
    want_max = min(user_max, budget) if user_max is not None else min(2 * seqs, 512, budget)
    assert cfg.max_cudagraph_capture_size == want_max
    assert cfg.cudagraph_capture_sizes[-1] == want_max
    assert all(cfg.padded_size(n) is not None for n in range(1, want_max + 1))
    assert cfg.padded_size(want_max + 1) is None


def test_graphs_off_means_no_sizes() -> None:
    for cfg in (CompilationConfig(mode="none"), CompilationConfig(cudagraph_mode="none"),
                CompilationConfig(mode="stock_torch_compile")):
        assert cfg.cudagraph_mode is M.NONE
        assert cfg.cudagraph_capture_sizes == ()
        assert cfg.max_cudagraph_capture_size == 0
        assert cfg.padded_size(3) is None


def test_full_graphs_without_compilation() -> None:
    cfg = CompilationConfig(mode="none", cudagraph_mode="full", cudagraph_capture_sizes=[1, 2])
    assert cfg.cudagraph_mode is M.FULL and cfg.cudagraph_capture_sizes == (1, 2)


# -- spec decode ------------------------------------------------------------------------------


def test_spec_decode_default_ladder() -> None:
    # max = min(64 * (1 + 1) * 2, 512, 8192) = 256; the decode sizes 2 * (1, 2, 4, 8, ..., 64)
    # are all on the token ladder already
    cfg = CompilationConfig(max_num_seqs=64, num_speculative_tokens=1)
    assert cfg.cudagraph_capture_sizes == (1, 2, 4, *range(8, 257, 8))
    assert cfg.max_cudagraph_capture_size == 256


# vLLM's default ladder with speculative decoding (issue 42 item 17): the token ladder up to
# min(max_num_seqs * (1 + k) * 2, 512, budget), joined by c * (1 + k) for request counts c on
# the ladder's steps up to max_num_seqs (and max_num_seqs itself) that fit under it; nothing
# is rounded. Cases worked out by hand from that rule.
@pytest.mark.parametrize(("kwargs", "want"), [
    # 2 requests of 1 + 1 tokens... up to 4 requests: 2, 4, 8 are on the token ladder
    ({"max_num_seqs": 4, "num_speculative_tokens": 1}, (1, 2, 4, 8, 16)),
    # 5 requests: 10 joins (5 * 2), 20 is the ceiling
    ({"max_num_seqs": 5, "num_speculative_tokens": 1}, (1, 2, 4, 8, 10, 16, 20)),
    # 1 + 2 tokens: 3, 6, 12, 24 for 1, 2, 4, 8 requests; ceiling 8 * 3 * 2 = 48
    ({"max_num_seqs": 8, "num_speculative_tokens": 2},
     (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48)),
    # a budget of 20 tokens clamps the ceiling: decode sizes above it (32) are dropped
    ({"max_num_seqs": 8, "num_speculative_tokens": 3, "max_num_tokens": 20},
     (1, 2, 4, 8, 16, 20)),
    # 13 requests of 1 + 2: 3, 6, 12, 24 and 39 (all 13) under the ceiling of 78
    ({"max_num_seqs": 13, "num_speculative_tokens": 2},
     (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 39, 40, 48, 56, 64, 72, 78)),
])
def test_spec_decode_default_ladder_joins_the_decode_sizes(kwargs: dict[str, Any],
                                                           want: tuple[int, ...]) -> None:
    cfg = CompilationConfig(**kwargs)
    assert cfg.cudagraph_capture_sizes == want
    assert cfg.max_cudagraph_capture_size == want[-1]


def test_sixteen_speculative_tokens_keep_the_whole_token_ladder() -> None:
    """Issue 42 item 17: with k=16 the default sizes were multiples of 17 topped at 510. The
    51 rungs of the plain ladder stay, with the decode sizes of 1, 2, 4 and 24 requests
    (17, 34, 68, 408) added; 8 and 16 requests (136, 272) are rungs already; 32 requests (544)
    are above 512."""
    cfg = CompilationConfig(max_num_seqs=256, num_speculative_tokens=16)
    plain = CompilationConfig(max_num_seqs=256).cudagraph_capture_sizes
    assert len(plain) == 51
    assert cfg.cudagraph_capture_sizes == tuple(sorted({*plain, 17, 34, 68, 408}))
    assert len(cfg.cudagraph_capture_sizes) == 55
    assert cfg.max_cudagraph_capture_size == 512
    assert [cfg.padded_size(n) for n in (3, 17, 18, 401, 409, 512)] == [4, 17, 24, 408, 416,
                                                                       512]


def test_spec_decode_user_list() -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 15], num_speculative_tokens=2)
    # multiples of 3, at most 15: 1->3, 2->3, 4->6, 8->9, 15->15
    assert cfg.cudagraph_capture_sizes == (3, 6, 9, 15)
    assert cfg.max_cudagraph_capture_size == 15
    with pytest.raises(ConfigError, match="decode query length 4"):
        CompilationConfig(cudagraph_capture_sizes=[1, 2], max_cudagraph_capture_size=2,
                          num_speculative_tokens=3)


def test_spec_decode_single_multiple_fallback() -> None:
    # 5 rounds to 8 > 5: nothing survives, but one graph of 4 tokens fits
    cfg = CompilationConfig(cudagraph_capture_sizes=[5], num_speculative_tokens=3)
    assert cfg.cudagraph_capture_sizes == (4,)
    assert cfg.max_cudagraph_capture_size == 4


# -- padding ----------------------------------------------------------------------------------


def test_padded_size_from_config() -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8])
    assert [cfg.padded_size(n) for n in range(10)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, None]


# -- research §7.7: test_compile_sizes_padding_validation --------------------------------------


@pytest.mark.parametrize("compile_sizes", [[3], [5]])
def test_compile_sizes_that_padding_changes_are_errors(compile_sizes: list[int]) -> None:
    with pytest.raises(ConfigError, match="would be padded to") as exc:
        CompilationConfig(cudagraph_mode="full", cudagraph_capture_sizes=[1, 2, 4, 8],
                          compile_sizes=compile_sizes)
    s = compile_sizes[0]
    assert f"size {s} would be padded to {4 if s == 3 else 8}" in str(exc.value)
    assert f"add {s} to cudagraph_capture_sizes" in str(exc.value)


def test_a_compile_size_rounded_away_by_speculative_decoding_names_the_rounding() -> None:
    """Full seed 67: size 1 is in the capture sizes the user gave, but num_speculative_tokens=1
    rounds them to [2, 4, 8]; the fix "add 1 to cudagraph_capture_sizes" could not work."""
    with pytest.raises(ConfigError) as exc:
        CompilationConfig(cudagraph_mode="full", cudagraph_capture_sizes=[1, 2, 4, 8],
                          compile_sizes=[1], num_speculative_tokens=1)
    assert str(exc.value) == (
        "compile_sizes: size 1 would be padded to 2 by the capture sizes [2, 4, 8], so its "
        "compiled code would never run under a graph; the capture sizes are rounded up to "
        "multiples of 1 + num_speculative_tokens = 2 (a decode step's tokens): compile 2 "
        "instead")


@pytest.mark.parametrize(
    ("compile_sizes", "want"),
    [
        ([1, 2, 4, 8], (1, 2, 4, 8)),
        (["cudagraph_capture_sizes"], (1, 2, 4, 8)),
        ([16, "cudagraph_capture_sizes", 16], (1, 2, 4, 8, 16)),  # above the max: no graph
    ],
)
def test_compile_sizes_fixed_points_are_fine(compile_sizes: list[Any],
                                             want: tuple[int, ...]) -> None:
    cfg = CompilationConfig(cudagraph_mode="full", cudagraph_capture_sizes=[1, 2, 4, 8],
                            compile_sizes=compile_sizes)
    assert cfg.compile_sizes == want


def test_compile_sizes_any_when_graphs_off() -> None:
    cfg = CompilationConfig(cudagraph_mode="none", cudagraph_capture_sizes=[1, 2, 4, 8],
                            compile_sizes=[5, 3, 3])
    assert cfg.compile_sizes == (3, 5)
    cfg = CompilationConfig(cudagraph_mode="none", compile_sizes=["cudagraph_capture_sizes"])
    assert cfg.compile_sizes == ()


def test_compile_sizes_errors() -> None:
    with pytest.raises(ConfigError, match="compile_sizes: unknown entry 'capture'"):
        CompilationConfig(compile_sizes=["capture"])
    with pytest.raises(ConfigError, match=r"compile_sizes: \[9000\] exceed max_num_tokens=8192"):
        CompilationConfig(cudagraph_mode="none", compile_sizes=[9000])
    with pytest.raises(ConfigError, match="compile_sizes entry: must be >= 1, got 0"):
        CompilationConfig(compile_sizes=[0])


# -- compile ranges ---------------------------------------------------------------------------


def test_compile_ranges() -> None:
    cfg = CompilationConfig(compile_ranges_endpoints=[32, 8])
    assert cfg.compile_ranges_endpoints == (8, 32)
    assert cfg.compile_ranges() == [Range(1, 8), Range(9, 32), Range(33, 8192)]
    assert CompilationConfig().compile_ranges() == [Range(1, 8192)]
    cfg = CompilationConfig(compile_ranges_endpoints=[8, 64], max_num_tokens=64)
    assert cfg.compile_ranges() == [Range(1, 8), Range(9, 64)]


def test_compile_range_endpoint_errors(ff_logs: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="endpoint 9000 is above max_num_tokens=8192"):
        CompilationConfig(compile_ranges_endpoints=[8, 9000])
    cfg = CompilationConfig(compile_ranges_endpoints=[1, 8])
    assert cfg.compile_ranges_endpoints == (8,)
    assert "endpoint 1 ignored" in ff_logs.text


# -- splitting ops and the derived graph mode -------------------------------------------------


def test_default_graph_mode() -> None:
    assert CompilationConfig().cudagraph_mode is M.PIECEWISE
    assert CompilationConfig(mode="dynamo_trace_once").cudagraph_mode is M.NONE
    assert CompilationConfig().splitting_ops is None
    assert CompilationConfig(mode="none", splitting_ops=None).splitting_ops == ()


def test_empty_splitting_ops_turn_piecewise_off(ff_logs: pytest.LogCaptureFixture) -> None:
    cfg = CompilationConfig(splitting_ops=[], cudagraph_mode="piecewise")
    assert cfg.cudagraph_mode is M.NONE
    assert cfg.splitting_ops == ()
    assert cfg.cudagraph_capture_sizes == ()
    assert [r.levelname for r in ff_logs.records] == ["WARNING"]
    assert "cudagraph_mode is now NONE" in ff_logs.text


def test_empty_splitting_ops_keep_full(ff_logs: pytest.LogCaptureFixture) -> None:
    cfg = CompilationConfig(splitting_ops=[], cudagraph_mode="FULL_AND_PIECEWISE")
    assert cfg.cudagraph_mode is M.FULL
    assert len(cfg.cudagraph_capture_sizes) == 51
    assert [r.levelname for r in ff_logs.records] == ["WARNING"]
    assert "cudagraph_mode is now FULL" in ff_logs.text
    ff_logs.clear()
    for mode in ("full", "full_decode_only", "none"):
        cfg = CompilationConfig(splitting_ops=[], cudagraph_mode=mode)
        assert cfg.cudagraph_mode is CUDAGraphMode.parse(mode)
    assert ff_logs.records == []


def test_splitting_op_names() -> None:
    cfg = CompilationConfig(splitting_ops=["silly::attention", "silly.attention",
                                           "aten.mm.default", "ns::op.out"])
    assert cfg.splitting_ops == ("silly::attention", "aten::mm.default", "ns::op.out")
    for bad in ("attention", "a::b::c", "::op", 3, "a.b.c.d"):
        with pytest.raises(ConfigError, match=r"splitting_ops: .* is not an op name"):
            CompilationConfig(splitting_ops=[bad])
    with pytest.raises(ConfigError, match="splitting_ops: expected a list"):
        CompilationConfig(splitting_ops="silly::attention")


def test_piecewise_graphs_need_a_split_or_a_breakable_capture() -> None:
    for graph_mode in ("piecewise", "full_and_piecewise"):
        # one traced graph has nothing to cut at
        with pytest.raises(ConfigError, match="needs mode PIECEWISE") as exc:
            CompilationConfig(mode="dynamo_trace_once", cudagraph_mode=graph_mode)
        assert "set mode='piecewise'" in str(exc.value)
        assert "mode='none' for graphs that break at the splitting ops" in str(exc.value)
        # mode NONE and STOCK_TORCH_COMPILE capture them breakable, over the running forward
        for mode in ("none", "stock_torch_compile"):
            cfg = CompilationConfig(mode=mode, cudagraph_mode=graph_mode)
            assert cfg.cudagraph_mode is CUDAGraphMode[graph_mode.upper()]
            assert breakable_capture(cfg) is True
        assert breakable_capture(CompilationConfig(mode="piecewise",
                                                   cudagraph_mode=graph_mode)) is False


# -- other validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"backend": "tvm"},
         r"backend: unknown compiler 'tvm'; use one of \['eager', 'inductor'\]"),
        ({"graph_backend": "xla"}, "graph_backend: unknown graph backend 'xla'"),
        ({"max_num_tokens": 0}, "max_num_tokens: must be >= 1, got 0"),
        ({"max_num_seqs": True}, "max_num_seqs: expected an int, got True"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens: must be >= 0, got -1"),
        ({"debug": "yes"}, "debug: expected true or false, got 'yes'"),
        ({"cache_dir": 3}, "cache_dir: expected a path string"),
        ({"cudagraph_capture_sizes": [1, 0]}, "cudagraph_capture_sizes entry: must be >= 1"),
        ({"cudagraph_capture_sizes": "1,2"}, "cudagraph_capture_sizes: expected a list"),
        ({"inductor_compile_config": [1]}, "inductor_compile_config: expected a mapping"),
        ({"inductor_passes": "p"}, "inductor_passes: expected a mapping"),
        ({"micro_batching": True, "num_micro_batches": 1}, "at least 2 micro-batches"),
    ],
)
def test_validation_errors(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CompilationConfig(**changes)


def test_config_error_is_value_error_and_config_is_frozen() -> None:
    with pytest.raises(ValueError):
        CompilationConfig(backend="tvm")
    cfg = CompilationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "eager"  # type: ignore[misc]
    assert CompilationConfig(backend="").backend == "inductor"
    assert CompilationConfig(backend=" Eager ").backend == "eager"


# -- dict / JSON ------------------------------------------------------------------------------

VLLM_JSON = {
    "level": 3,
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "cudagraph_capture_sizes": [1, 2, 4],
    "splitting_ops": ["vllm::unified_attention", "vllm.unified_attention_with_output"],
    "compile_sizes": ["cudagraph_capture_sizes"],
    "backend": "",
    "cache_dir": "",
    "inductor_compile_config": {"max_autotune": False},
    "cudagraph_num_of_warmups": 1,
    "cudagraph_copy_inputs": False,
    "max_cudagraph_capture_size": 4,
}


def test_vllm_json_accepted_as_is() -> None:
    cfg = CompilationConfig.from_json(json.dumps(VLLM_JSON))
    assert cfg.mode is CompilationMode.PIECEWISE
    assert cfg.cudagraph_mode is M.FULL_AND_PIECEWISE
    assert cfg.cudagraph_capture_sizes == (1, 2, 4)
    assert cfg.compile_sizes == (1, 2, 4)
    assert cfg.splitting_ops == ("vllm::unified_attention", "vllm::unified_attention_with_output")
    assert cfg.backend == "inductor"
    assert dict(cfg.inductor_compile_config) == {"max_autotune": False}
    assert cfg.cudagraph_num_of_warmups == 1
    assert CompilationConfig.from_dict({"mode": "VLLM_COMPILE", "max_num_batched_tokens": 64}
                                       ).max_num_tokens == 64


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"mode": "none"},
        {"mode": 2, "backend": "eager"},
        {"splitting_ops": [], "cudagraph_mode": "full_and_piecewise"},
        {"splitting_ops": ["silly::attention"], "compile_sizes": [16, "cudagraph_capture_sizes"],
         "compile_ranges_endpoints": [8, 32], "cudagraph_capture_sizes": [1, 2, 16]},
        {"max_cudagraph_capture_size": 257, "max_num_seqs": 128},
        {"num_speculative_tokens": 2, "cudagraph_capture_sizes": [1, 5, 7]},
        {"inductor_compile_config": {"max_autotune": True}, "inductor_passes": {"p": "m.f"},
         "cache_dir": "/tmp/x", "debug": True, "graph_backend": "emulated"},
        {"micro_batching": True, "num_micro_batches": 3, "max_loras": 2},
    ],
)
def test_json_round_trip(kwargs: dict[str, Any]) -> None:
    cfg = CompilationConfig(**kwargs)
    text = cfg.to_json()
    again = CompilationConfig.from_json(text)
    assert again == cfg
    assert again.to_json() == text
    assert again.cache_key() == cfg.cache_key()
    assert hash(again) == hash(cfg)
    assert CompilationConfig.from_dict(cfg.to_dict()) == cfg


def test_to_dict_is_plain_json() -> None:
    d = CompilationConfig(splitting_ops=["silly::attention"],
                          cudagraph_capture_sizes=[1, 2]).to_dict()
    assert d["mode"] == "piecewise"
    assert d["cudagraph_mode"] == "piecewise"
    assert d["cudagraph_capture_sizes"] == [1, 2]
    assert d["splitting_ops"] == ["silly::attention"]
    assert d["max_num_tokens"] == 8192
    json.dumps(d)


def test_unknown_fields_list_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        CompilationConfig.from_dict({"cudagraph_sizes": [1], "backend": "eager"})
    msg = str(exc.value)
    assert "unknown compilation-config field(s) ['cudagraph_sizes']" in msg
    for name in CompilationConfig.field_names():
        assert repr(name) in msg
    assert "aliases: ['level', 'max_num_batched_tokens']" in msg


def test_unsupported_vllm_fields_are_named() -> None:
    with pytest.raises(ConfigError, match=r"\['full_cuda_graph', 'use_inductor'\] are vLLM "
                                          "fields freezeframe does not support"):
        CompilationConfig.from_dict({"use_inductor": True, "full_cuda_graph": False})


def test_json_errors() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        CompilationConfig.from_json("{mode: 3")
    with pytest.raises(ConfigError, match="must be a JSON object, got"):
        CompilationConfig.from_json("[1, 2]")
    with pytest.raises(ConfigError, match="level: given twice"):
        CompilationConfig.from_dict({"mode": 3, "level": 3})


# -- replace, pickling ------------------------------------------------------------------------


def test_replace_re_derives_from_the_given_values() -> None:
    cfg = CompilationConfig(backend="eager", max_num_seqs=256)
    small = cfg.replace(max_num_seqs=4)
    assert small.cudagraph_capture_sizes == (1, 2, 4, 8)
    assert small.backend == "eager"
    assert small.replace(max_num_seqs=256) == cfg
    assert cfg.replace(cudagraph_capture_sizes=[1, 2]).max_cudagraph_capture_size == 2
    assert cfg.replace(level=0).mode is CompilationMode.NONE
    with pytest.raises(ConfigError, match="unknown compilation-config field"):
        cfg.replace(nope=1)


def test_pickle_and_deepcopy_keep_callables() -> None:
    cfg = CompilationConfig(inductor_passes={"p": _a_pass},
                            inductor_compile_config={"max_autotune": True})
    for copied in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert copied == cfg
        assert copied.inductor_passes["p"] is _a_pass
    assert cfg.to_dict()["inductor_passes"] == {"p": f"{__name__}._a_pass"}


def _a_pass(graph: Any) -> None:
    return None


def _other_pass(graph: Any) -> None:
    return None


# -- cache key --------------------------------------------------------------------------------


def test_cache_key_ignores_fields_that_do_not_change_code() -> None:
    base = CompilationConfig(backend="eager")
    key = base.cache_key()
    assert len(key) == 16
    for changes in ({"cache_dir": "/tmp/elsewhere"}, {"debug": True}, {"use_cache": False},
                    {"graph_backend": "emulated"}, {"cudagraph_num_of_warmups": 3}):
        assert base.replace(**changes).cache_key() == key, changes


def test_cache_key_changes_with_compiled_code() -> None:
    base = CompilationConfig(backend="eager")
    variants = [
        {"backend": "inductor"}, {"mode": "dynamo_trace_once"},
        {"splitting_ops": ["silly::attention"]}, {"compile_sizes": [1]},
        {"compile_ranges_endpoints": [8]}, {"inductor_compile_config": {"max_autotune": True}},
        {"inductor_passes": {"p": _a_pass}}, {"cudagraph_mode": "full"},
        {"cudagraph_capture_sizes": [1, 2]}, {"max_num_tokens": 4096},
    ]
    keys = {base.replace(**v).cache_key() for v in variants}
    assert len(keys) == len(variants)
    assert base.cache_key() not in keys
    # a callable pass counts by its name and source
    assert (base.replace(inductor_passes={"p": _a_pass}).cache_key()
            != base.replace(inductor_passes={"p": _other_pass}).cache_key())


def test_cache_key_is_stable_across_processes() -> None:
    kwargs = {"backend": "eager", "splitting_ops": ["silly::attention"],
              "compile_ranges_endpoints": [8, 32], "inductor_compile_config": {"b": 1, "a": 2}}
    code = ("import json, sys; from freezeframe.config import CompilationConfig; "
            "print(CompilationConfig(**json.loads(sys.argv[1])).cache_key())")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONHASHSEED": "random"}
    keys = {
        subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True,
                       text=True, check=True, env=env).stdout.strip()
        for _ in range(2)
    }
    assert keys == {CompilationConfig(**kwargs).cache_key()}


# -- vLLM's current capture-size rules (docs/vllm_config.md) ----------------------------------


@pytest.mark.parametrize(
    ("kwargs", "want_sizes"),
    [
        # the token budget is the ceiling and off the 8-step grid: it is the last size
        ({"max_num_tokens": 100, "max_num_seqs": 128}, (1, 2, 4, *range(8, 97, 8), 100)),
        # the user's maximum off the grid (257) is kept, not truncated to 256
        ({"max_cudagraph_capture_size": 257, "max_num_seqs": 128},
         (*LADDER_256, 257)),
        # the 2 * max_num_seqs ceiling off the grid (2 * 13 = 26)
        ({"max_num_seqs": 13}, (1, 2, 4, 8, 13, 16, 24, 26)),
    ],
)
def test_the_maximum_is_always_on_the_ladder(kwargs: dict[str, Any],
                                             want_sizes: tuple[int, ...]) -> None:
    cfg = CompilationConfig(backend="eager", **kwargs)
    assert cfg.cudagraph_capture_sizes == want_sizes
    assert cfg.max_cudagraph_capture_size == want_sizes[-1]
    assert cfg.padded_size(want_sizes[-1]) == want_sizes[-1]
    assert cfg.padded_size(want_sizes[-1] + 1) is None


@pytest.mark.parametrize(
    ("kwargs", "want_sizes"),
    [
        # 100 requests of 1 token: 100 is off the 8-step grid, so it is added (ceiling 200)
        ({"max_num_seqs": 100},
         (1, 2, 4, *range(8, 97, 8), 100, *range(104, 201, 8))),
        # 300 requests of 1 + 1 tokens = 600 tokens, above the 512 token ceiling: not added
        # (vLLM's ceiling holds with spec decode too; the widest decode step runs eagerly)
        ({"max_num_seqs": 300, "num_speculative_tokens": 1},
         (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))),
        # ... whatever the token budget
        ({"max_num_seqs": 300, "num_speculative_tokens": 1, "max_num_tokens": 590},
         (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))),
        # ... but a maximum the user wrote down is the ceiling, and 600 is under it
        ({"max_num_seqs": 300, "num_speculative_tokens": 1, "max_cudagraph_capture_size": 1024},
         (1, 2, 4, *range(8, 257, 8), *range(272, 593, 16), 600, *range(608, 1025, 16))),
        # ... nor above the user's maximum (which is on the ladder itself)
        ({"max_num_seqs": 20, "max_cudagraph_capture_size": 12}, (1, 2, 4, 8, 12)),
    ],
)
def test_the_widest_decode_batch_is_captured(kwargs: dict[str, Any],
                                             want_sizes: tuple[int, ...]) -> None:
    cfg = CompilationConfig(backend="eager", **kwargs)
    assert cfg.cudagraph_capture_sizes == want_sizes
    assert cfg.max_cudagraph_capture_size == want_sizes[-1]


@pytest.mark.parametrize(("max_num_tokens", "want_max"), [(8192, 512), (16384, 512), (300, 300)])
def test_the_default_ceiling_holds_with_spec_decode(max_num_tokens: int, want_max: int) -> None:
    # 1024 requests of 1 + 16 tokens: min(1024 * 17 * 2, 512, budget) is the ceiling, and the
    # widest decode batch (8704 tokens) is far above it; the decode sizes under it join
    cfg = CompilationConfig(max_num_seqs=1024, num_speculative_tokens=16,
                            max_num_tokens=max_num_tokens)
    decodes = [s for s in (17, 34, 68, 136, 272, 408) if s <= want_max]
    plain = CompilationConfig(max_cudagraph_capture_size=want_max).cudagraph_capture_sizes
    assert cfg.cudagraph_capture_sizes == tuple(sorted({*plain, *decodes}))
    assert cfg.max_cudagraph_capture_size == want_max
    assert cfg.padded_size(want_max + 1) is None


def test_a_users_list_is_kept_as_given_without_the_decode_batch() -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8], max_num_seqs=5)
    assert cfg.cudagraph_capture_sizes == (1, 2, 4, 8)


def test_spec_decode_default_ladder_under_a_budget() -> None:
    # 1 + 2 tokens per request; 4 requests: ceiling min(24, 512, 100) = 24, decodes 3, 6, 12
    cfg = CompilationConfig(max_num_tokens=100, max_num_seqs=4, num_speculative_tokens=2)
    assert cfg.cudagraph_capture_sizes == (1, 2, 3, 4, 6, 8, 12, 16, 24)
    # 64 requests: the budget of 100 is the ceiling; decodes of 1..32 requests fit (3..96)
    cfg = CompilationConfig(max_num_tokens=100, max_num_seqs=64, num_speculative_tokens=2)
    assert cfg.cudagraph_capture_sizes == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64,
                                           72, 80, 88, 96, 100)
    assert cfg.max_cudagraph_capture_size == 100
    assert [cfg.padded_size(n) for n in (95, 97, 101)] == [96, 100, None]


@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "full_and_piecewise", None])
def test_a_maximum_of_zero_turns_graphs_off_quietly(graph_mode: str | None,
                                                    ff_logs: pytest.LogCaptureFixture) -> None:
    cfg = CompilationConfig(max_cudagraph_capture_size=0, cudagraph_mode=graph_mode,
                            splitting_ops=["silly::attention"])
    assert cfg.cudagraph_mode is M.NONE
    assert cfg.cudagraph_capture_sizes == ()
    assert cfg.max_cudagraph_capture_size == 0
    assert cfg.padded_size(1) is None
    assert not [r for r in ff_logs.records if r.levelno >= logging.WARNING]
    # the same from vLLM's JSON, and with an empty list beside it
    again = CompilationConfig.from_json(
        '{"max_cudagraph_capture_size": 0, "cudagraph_capture_sizes": [], '
        '"cudagraph_mode": "FULL_AND_PIECEWISE"}')
    assert (again.cudagraph_mode, again.cudagraph_capture_sizes) == (M.NONE, ())


def test_cudagraph_mode_none_ignores_sizes_quietly(ff_logs: pytest.LogCaptureFixture) -> None:
    cfg = CompilationConfig.from_json(
        '{"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2, 4], '
        '"max_cudagraph_capture_size": 4}')
    assert (cfg.cudagraph_mode, cfg.cudagraph_capture_sizes, cfg.max_cudagraph_capture_size) \
        == (M.NONE, (), 0)
    assert not [r for r in ff_logs.records if r.levelno >= logging.WARNING]


# -- custom_ops and pass_config ----------------------------------------------------------------


@pytest.mark.parametrize("ops", [["none"], ["all"], ["all", "-silu_and_mul"],
                                 ["none", "+rms_norm", "+quant_fp8"], []])
def test_custom_ops_are_accepted_without_effect(ops: list[str]) -> None:
    cfg = CompilationConfig.from_dict({"custom_ops": ops, "backend": "eager"})
    assert cfg.custom_ops == tuple(ops)
    base = CompilationConfig(backend="eager")
    assert cfg.cache_key() == base.cache_key()  # nothing compiled differs
    assert CompilationConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    ("ops", "match"),
    [
        (["quant_fp8"], r"custom_ops: invalid entry 'quant_fp8'; write 'all', 'none', "
                        r"'\+quant_fp8' \(enable\) or '-quant_fp8' \(disable\)"),
        (["all", "none"], r"custom_ops: \['all', 'none'\] names 'all'/'none' more than once"),
        (["+rms_norm", "-rms_norm"], r"custom_ops: \['rms_norm'\] both enabled"),
        ("all", r"custom_ops: expected a list, got 'all'"),
        ([3], r"custom_ops: entry 3 is not a string"),
    ],
)
def test_custom_ops_syntax_errors(ops: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CompilationConfig(custom_ops=ops)


def test_pass_config_switches_that_are_off_are_accepted() -> None:
    cfg = CompilationConfig.from_json(
        '{"pass_config": {"fuse_norm_quant": false, "eliminate_noops": null, "enable_sp": false}}')
    assert dict(cfg.pass_config) == {"fuse_norm_quant": False, "eliminate_noops": None,
                                     "enable_sp": False}
    assert cfg.cache_key() == CompilationConfig().cache_key()
    assert CompilationConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("fuse_norm_quant", True, "true"),
    ("eliminate_noops", True, "true"),
    ("sp_min_token_num", 256, "256"),
])
def test_pass_config_switches_that_are_on_are_not_supported(key: str, value: Any,
                                                            shown: str) -> None:
    with pytest.raises(ConfigError) as exc:
        CompilationConfig.from_dict({"pass_config": {"enable_sp": False, key: value}})
    assert str(exc.value).startswith(f"not supported: pass_config.{key}={shown}; freezeframe "
                                     "runs none of vLLM's compilation passes")
    fix = f"Remove pass_config.{key} or set it to false;" if isinstance(value, bool) \
        else f"Remove pass_config.{key};"
    assert fix in str(exc.value)
    with pytest.raises(ConfigError, match=r"pass_config: expected a mapping"):
        CompilationConfig(pass_config=["fuse_norm_quant"])  # type: ignore[arg-type]


def test_a_collective_as_a_splitting_op_needs_its_wait_too() -> None:
    # Splitting at all_reduce alone let the next piece copy the result before the wait: on
    # two gloo ranks the tensor-parallel Llama's logits were off by 12
    with pytest.raises(ConfigError, match=r"'_c10d_functional::all_reduce' is an asynchronous "
                                          r"collective .* Add '_c10d_functional::wait_tensor'"):
        CompilationConfig(splitting_ops=["silly::attention", "_c10d_functional::all_reduce"])
    cfg = CompilationConfig(splitting_ops=["_c10d_functional.all_reduce",
                                           "_c10d_functional::wait_tensor"])
    assert cfg.splitting_ops == ("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor")
