"""The dispatcher table (research notes §7.11) plus LoRA, spec-decode and padding properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freezeframe import BatchDescriptor, CompilationConfig, CompilationMode, CUDAGraphMode
from freezeframe.errors import ConfigError
from freezeframe.runtime import Dispatcher, LoraCase, lora_cases

NONE, PW, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
FDO, FAP = CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE
ALL_MODES = [NONE, PW, FULL, FDO, FAP]


def make(mode: CUDAGraphMode, *, lora: bool = False, **kw: object) -> Dispatcher:
    """The §7.11 mock: capture sizes [1, 8], max_num_seqs 8, LoRA max_loras 4 (specialised)."""
    fields: dict[str, object] = dict(
        mode="piecewise", backend="eager", splitting_ops=["silly::attention"],
        cudagraph_mode=mode, cudagraph_capture_sizes=[1, 8], max_num_seqs=8,
        max_num_tokens=64, max_loras=4 if lora else 0)
    fields.update(kw)
    return Dispatcher(CompilationConfig(**fields))  # type: ignore[arg-type]


# -- construction ----------------------------------------------------------------------------
def test_piecewise_graphs_without_piecewise_compilation_rejected_by_config() -> None:
    with pytest.raises(ConfigError, match="FULL_AND_PIECEWISE captures piecewise graphs"):
        CompilationConfig(mode="dynamo_trace_once", cudagraph_mode="full_and_piecewise")


def test_dispatcher_rechecks_a_config_built_around_validation() -> None:
    cfg = CompilationConfig(mode="piecewise", cudagraph_mode="full_and_piecewise",
                            cudagraph_capture_sizes=[1, 8])
    # as a bypassed/replaced config might (NONE would be a breakable capture, which is valid)
    object.__setattr__(cfg, "mode", CompilationMode.DYNAMO_TRACE_ONCE)
    with pytest.raises(ConfigError, match="FULL_AND_PIECEWISE captures piecewise graphs"):
        Dispatcher(cfg)


# -- key counts --------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_key_counts(mode: CUDAGraphMode, lora: bool) -> None:
    d = make(mode, lora=lora)
    per_mode = 10 if lora else 2
    assert len(d.keys(PW)) == (per_mode if mode in (PW, FAP) else 0)
    assert len(d.keys(FULL)) == (per_mode if mode in (FULL, FDO, FAP) else 0)


def test_lora_cases_specialised_unspecialised_and_spec_decode() -> None:
    counts = [(c.has_lora, c.num_active_loras) for c in lora_cases(4, True, 0)]
    assert counts == [(False, 0), (True, 1), (True, 2), (True, 4), (True, 5)]
    assert lora_cases(8, True, 0)[1:] == [LoraCase(True, n) for n in (1, 2, 4, 8, 9)]
    assert lora_cases(4, False, 0) == [LoraCase(True, 5)]
    assert lora_cases(4, True, 2) == [LoraCase(False, 0), LoraCase(True, 4)]
    assert lora_cases(4, False, 2) == [LoraCase(True, 4)]
    assert lora_cases(0, True, 0) == [LoraCase(False, 0)]


# -- dispatch table ------------------------------------------------------------------------------
def desc(n: int, reqs: int | None = None, uniform: bool = False) -> BatchDescriptor:
    return BatchDescriptor(num_tokens=n, num_reqs=reqs, uniform=uniform)


@pytest.mark.parametrize("mode,expected", [
    (NONE, (NONE, desc(8))),
    (PW, (PW, desc(8))),
    (FULL, (FULL, desc(8, 8))),
    (FDO, (NONE, desc(8))),
    (FAP, (PW, desc(8))),
], ids=lambda v: getattr(v, "name", ""))
def test_dispatch_8_tokens_mixed(mode: CUDAGraphMode, expected: tuple) -> None:
    assert make(mode).dispatch(8, uniform_decode=False) == expected


@pytest.mark.parametrize("mode,expected", [
    (NONE, (NONE, desc(8))),
    (PW, (PW, desc(8))),
    (FULL, (FULL, desc(8, 8))),  # no uniform keys: the mixed FULL key serves it
    (FDO, (FULL, desc(8, 8, uniform=True))),
    (FAP, (FULL, desc(8, 8, uniform=True))),
], ids=lambda v: getattr(v, "name", ""))
def test_dispatch_8_tokens_uniform(mode: CUDAGraphMode, expected: tuple) -> None:
    assert make(mode).dispatch(8, uniform_decode=True) == expected


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("uniform", [False, True])
def test_dispatch_15_tokens_is_eager_and_unpadded(mode: CUDAGraphMode, uniform: bool) -> None:
    assert make(mode).dispatch(15, uniform_decode=uniform) == (NONE, desc(15))


@pytest.mark.parametrize("budget", [100, 300, 4])
def test_every_step_up_to_a_token_budget_off_the_ladder_gets_a_graph(budget: int) -> None:
    """With the default ladder and a token budget between two rungs (96 < 100 < 104, 288 <
    300 < 304; 4 is on it), the budget is the last capture size: no step of the budget falls
    back to eager."""
    d = make(FAP, cudagraph_capture_sizes=None, max_num_tokens=budget, max_num_seqs=256)
    assert d.max_capture_size == budget
    for n in range(1, budget + 1):
        mode, padded = d.dispatch(n)
        assert mode is PW and padded.num_tokens >= n, n
    assert d.dispatch(budget) == (PW, desc(budget))


def test_dispatch_pads_to_the_smallest_capture_size() -> None:
    d = make(FULL)
    assert d.dispatch(2) == (FULL, desc(8, 8))
    assert d.dispatch(1) == (FULL, desc(1, 1))
    assert d.dispatch(0) == (NONE, desc(0))


@pytest.mark.parametrize("mode,expected", [
    (PW, (PW, desc(8))), (FULL, (NONE, desc(8))), (FDO, (NONE, desc(8))), (FAP, (PW, desc(8))),
], ids=lambda v: getattr(v, "name", ""))
def test_dispatch_with_full_invalid(mode: CUDAGraphMode, expected: tuple) -> None:
    assert make(mode).dispatch(8, uniform_decode=True, invalid_modes={FULL}) == expected


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_dispatch_with_only_none_valid(mode: CUDAGraphMode) -> None:
    assert make(mode).dispatch(8, uniform_decode=True, invalid_modes={FULL, PW}) == (NONE, desc(8))


def test_none_cannot_be_invalid() -> None:
    with pytest.raises(ValueError, match="PIECEWISE and FULL only"):
        make(FULL).dispatch(8, invalid_modes={NONE})


# -- LoRA and speculative decoding -----------------------------------------------------------------
def test_lora_counts_round_up_to_a_captured_count() -> None:
    d = make(FAP, lora=True)
    mode, got = d.dispatch(5, has_lora=True, num_active_loras=3)
    assert (mode, got) == (PW, BatchDescriptor(8, None, False, True, 4))
    mode, got = d.dispatch(1, uniform_decode=True, has_lora=True, num_active_loras=5)
    assert (mode, got) == (FULL, BatchDescriptor(1, 1, True, True, 5))
    assert d.dispatch(8, has_lora=False)[1] == desc(8)
    # More adapters than any graph was captured for: no graph.
    assert d.dispatch(8, has_lora=True, num_active_loras=6) == (
        NONE, BatchDescriptor(8, None, False, True, 6))


def test_unspecialised_lora_graph_serves_every_step() -> None:
    d = make(FULL, lora=True, cudagraph_specialize_lora=False)
    assert len(d.keys(FULL)) == 2
    lora5 = BatchDescriptor(8, 8, False, True, 5)
    assert d.dispatch(8) == (FULL, lora5)
    assert d.dispatch(8, has_lora=True, num_active_loras=2) == (FULL, lora5)


def test_spec_decode_query_length_and_lora() -> None:
    # q = 2: capture sizes round up to multiples of 2 ([1, 8] -> [2, 8]).
    d = make(FDO, lora=True, num_speculative_tokens=1)
    assert d.uniform_decode_query_len == 2
    assert d.capture_sizes == (2, 8)
    assert len(d.keys(FULL)) == 4  # 2 sizes x (no LoRA, max_loras)
    assert d.dispatch(3, uniform_decode=True) == (FULL, BatchDescriptor(8, 4, True))
    assert d.dispatch(2, uniform_decode=True, has_lora=True, num_active_loras=1) == (
        FULL, BatchDescriptor(2, 1, True, True, 4))
    assert d.dispatch(3, uniform_decode=False)[0] is NONE


def test_decode_keys_stop_at_max_num_seqs_requests() -> None:
    d = make(FAP, cudagraph_capture_sizes=[1, 2, 4, 8], max_num_seqs=2)
    assert sorted(k.num_tokens for k in d.keys(FULL)) == [1, 2]
    assert d.dispatch(4, uniform_decode=True) == (PW, desc(4))


# -- capture order ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_capture_descriptors_order(mode: CUDAGraphMode, lora: bool) -> None:
    d = make(mode, lora=lora)
    groups = d.capture_descriptors()
    expected_modes = [m for m in (PW, FULL) if d.keys(m)]
    assert [m for m, _ in groups] == expected_modes
    for m, descs in groups:
        assert descs, m
        tokens = [x.num_tokens for x in descs]
        assert tokens == sorted(tokens, reverse=True)
        assert len({x.uniform for x in descs}) == 1
        assert set(descs) == d.keys(m)
    if mode is NONE:
        assert groups == []


def test_capture_descriptors_exact_for_full_and_piecewise() -> None:
    assert make(FAP).capture_descriptors() == [
        (PW, [desc(8), desc(1)]),
        (FULL, [desc(8, 8, True), desc(1, 1, True)]),
    ]


# -- property: padding never shrinks a batch and always lands on a key ----------------------------
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 48), min_size=1, max_size=8),
    mode=st.sampled_from([PW, FULL, FDO, FAP]),
    max_num_seqs=st.integers(1, 64),
    uniform=st.booleans(),
)
def test_padding_property(sizes: list[int], mode: CUDAGraphMode, max_num_seqs: int,
                          uniform: bool) -> None:
    d = make(mode, cudagraph_capture_sizes=sizes, max_num_seqs=max_num_seqs, max_num_tokens=64)
    largest = max(sizes)
    for n in range(1, 65):
        got_mode, got = d.dispatch(n, uniform_decode=uniform)
        padded = min((s for s in sizes if s >= n), default=None)
        if n > largest:
            assert (got_mode, got) == (NONE, desc(n))
            continue
        if got_mode is NONE:
            # Only a batch kind the config captures no graph for may run eagerly.
            assert mode is FDO and padded is not None
            assert not uniform or padded > max_num_seqs
            assert got == desc(n)
            continue
        assert got.num_tokens >= n
        assert got.num_tokens == padded
        assert got in d.keys(got_mode)
        if mode is not FDO:
            assert got_mode is (PW if mode in (PW, FAP) and not (uniform and got.uniform)
                                else FULL)


def test_a_remembered_answer_is_the_same_and_bad_arguments_still_raise() -> None:
    d = make(CUDAGraphMode.FULL_AND_PIECEWISE)
    first = d.dispatch(3, invalid_modes=frozenset({CUDAGraphMode.FULL}))
    again = d.dispatch(3, invalid_modes=frozenset({CUDAGraphMode.FULL}))
    assert again is first  # looked up, not worked out again
    assert first == (CUDAGraphMode.PIECEWISE, desc(8))  # capture sizes [1, 8]
    d.dispatch(1)
    with pytest.raises(TypeError, match="num_tokens must be an int, got True"):
        d.dispatch(True)  # True == 1, but it is no token count
    with pytest.raises(ValueError, match="invalid_modes may hold PIECEWISE and FULL only"):
        d.dispatch(3, invalid_modes=[CUDAGraphMode.NONE])  # an unhashable list: not remembered
