"""The micro-batch slicing table: where a batch is cut, which requests each slice holds, how the
last slice is padded, when the split is declined, and the per-slice attention metadata."""

from __future__ import annotations

import pytest
import torch

from freezeframe.config import CompilationConfig
from freezeframe.runtime.ubatch.slicing import (
    MicroBatchSlice,
    agree_across_dp,
    create_slices,
    dp_micro_batch_metadata,
    last_micro_batch_empty,
    pad_last_slice,
    plan_micro_batches,
    should_micro_batch,
    slice_attention_metadata,
    split_points,
)


def _cfg(**kw: object) -> CompilationConfig:
    base: dict[str, object] = dict(
        micro_batching=True, micro_batch_decode_threshold=4, micro_batch_prefill_threshold=16
    )
    base.update(kw)
    return CompilationConfig(**base)  # type: ignore[arg-type]


def S(t0: int, t1: int, r0: int, r1: int) -> MicroBatchSlice:
    return MicroBatchSlice(t0, t1, r0, r1)


# (scheduled tokens per request, cut offsets) -> expected slices
SLICE_TABLE = [
    # cut on a request boundary: no straddling
    ([4, 4], [4], [S(0, 4, 0, 1), S(4, 8, 1, 2)]),
    # request 1 (tokens 3..7) straddles the cut at 4
    ([3, 5, 2, 6], [8], [S(0, 8, 0, 2), S(8, 16, 2, 4)]),
    ([3, 5, 2, 6], [4], [S(0, 4, 0, 2), S(4, 16, 1, 4)]),
    # one long prefill request split in two: both slices hold request 0
    ([10], [5], [S(0, 5, 0, 1), S(5, 10, 0, 1)]),
    # uniform decode: one token per request
    ([1] * 6, [3], [S(0, 3, 0, 3), S(3, 6, 3, 6)]),
    # three micro-batches; request 0 straddles two cuts
    ([7, 2], [3, 6], [S(0, 3, 0, 1), S(3, 6, 0, 1), S(6, 9, 0, 2)]),
    # mixed: decode requests then a prefill that straddles
    ([1, 1, 6], [4], [S(0, 4, 0, 3), S(4, 8, 2, 3)]),
]


@pytest.mark.parametrize(("tokens", "cuts", "expected"), SLICE_TABLE)
def test_slice_table(tokens: list[int], cuts: list[int], expected: list[MicroBatchSlice]) -> None:
    assert create_slices(tokens, cuts) == expected


def test_split_points_default_and_given() -> None:
    assert split_points(16, 2) == [8]
    assert split_points(17, 2) == [8]
    assert split_points(12, 3) == [4, 8]
    assert split_points(16, 2, 6) == [6]
    assert split_points(12, 3, [2, 9]) == [2, 9]
    with pytest.raises(ValueError, match="strictly increasing"):
        split_points(12, 3, [9, 2])
    with pytest.raises(ValueError, match="cut offsets"):
        split_points(12, 3, [4])
    with pytest.raises(ValueError, match="cannot be split"):
        split_points(1, 2)


def test_pad_last_slice() -> None:
    slices = create_slices([1] * 6, [4])
    assert slices == [S(0, 4, 0, 4), S(4, 6, 4, 6)]
    assert pad_last_slice(slices, 8, 8) == [S(0, 4, 0, 4), S(4, 8, 4, 8)]
    with pytest.raises(ValueError, match="padding only grows"):
        pad_last_slice(slices, 5, 8)


def test_plan_pads_last_slice_and_tiles_the_padded_batch() -> None:
    plan = plan_micro_batches(_cfg(), [1] * 6, 8, 8, uniform_decode=True)
    assert plan is not None
    assert plan.slices == (S(0, 4, 0, 4), S(4, 6, 4, 6))
    assert plan.padded_slices == (S(0, 4, 0, 4), S(4, 8, 4, 8))
    assert sum(s.num_tokens for s in plan.padded_slices) == 8
    assert plan.num_tokens == 6 and plan.num_tokens_padded == 8
    assert plan.num_micro_batches == 2
    assert plan.dp is None  # no process group


@pytest.mark.parametrize(
    ("num_tokens", "padded", "n", "empty"),
    [
        (5, 8, 2, False),  # cut at 4 < 5
        (4, 8, 2, True),  # cut at 4: the second micro-batch would be all padding
        (3, 8, 2, True),
        (9, 12, 3, False),  # cuts at 4, 8; 8 < 9: the last one holds token 8
        (8, 12, 3, True),
        (1, 1, 2, True),  # smaller than the number of micro-batches
    ],
)
def test_last_micro_batch_empty(num_tokens: int, padded: int, n: int, empty: bool) -> None:
    assert last_micro_batch_empty(num_tokens, padded, n) is empty


def test_plan_declines_when_last_micro_batch_empty() -> None:
    # 4 decode tokens padded to 8: the cut at 4 leaves only padding in micro-batch 1
    assert plan_micro_batches(_cfg(), [1] * 4, 8, 8, uniform_decode=True) is None
    assert plan_micro_batches(_cfg(), [1] * 5, 8, 8, uniform_decode=True) is not None


@pytest.mark.parametrize(
    ("num_tokens", "uniform", "expected"),
    [
        (3, True, False),
        (4, True, True),  # at the decode threshold
        (15, False, False),
        (16, False, True),  # at the prefill threshold
        (8, False, False),  # above decode threshold but a mixed batch
    ],
)
def test_thresholds(num_tokens: int, uniform: bool, expected: bool) -> None:
    assert should_micro_batch(_cfg(), num_tokens, uniform) is expected


def test_micro_batching_off_never_splits() -> None:
    cfg = _cfg(micro_batching=False)
    assert should_micro_batch(cfg, 10_000, True) is False
    assert plan_micro_batches(cfg, [1] * 64, uniform_decode=True) is None


def test_plan_below_threshold_is_none() -> None:
    assert plan_micro_batches(_cfg(), [3, 3], uniform_decode=False) is None  # 6 < 16
    plan = plan_micro_batches(_cfg(), [10, 6], uniform_decode=False)
    assert plan is not None and plan.slices == (S(0, 8, 0, 1), S(8, 16, 0, 2))


def test_three_micro_batches() -> None:
    plan = plan_micro_batches(_cfg(num_micro_batches=3), [2] * 5, 12, 6, uniform_decode=True)
    assert plan is not None
    assert plan.slices == (S(0, 4, 0, 2), S(4, 8, 2, 4), S(8, 10, 4, 5))
    assert plan.padded_slices == (S(0, 4, 0, 2), S(4, 8, 2, 4), S(8, 12, 4, 6))


def test_no_dist_agreement_is_local_vote() -> None:
    assert agree_across_dp(True) is True
    assert agree_across_dp(False) is False
    meta = dp_micro_batch_metadata([S(0, 4, 0, 4), S(4, 8, 4, 8)])
    assert [m.num_tokens_across_dp for m in meta] == [(4,), (4,)]
    assert meta[0].dp_size == 1 and meta[0].max_tokens_across_dp == 4


# -- attention metadata -------------------------------------------------------------------------


def test_attention_metadata_straddling_request_is_trimmed_on_copies() -> None:
    # requests of 3, 5, 2, 6 tokens; seq_lens include 10 earlier tokens each
    qsl = torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32)
    seq_lens = torch.tensor([13, 15, 12, 16], dtype=torch.int32)
    qsl_before, seq_before = qsl.clone(), seq_lens.clone()
    first, second = create_slices([3, 5, 2, 6], [4])

    m0 = slice_attention_metadata(first, qsl, seq_lens)
    # request 1 keeps only its first token (token 3) in micro-batch 0
    assert m0.query_start_loc.tolist() == [0, 3, 4]
    assert m0.query_start_loc.dtype == torch.int32
    assert m0.seq_lens is not None and m0.seq_lens.tolist() == [13, 11]  # 15 - 4 later tokens
    assert (m0.splits_first_request, m0.splits_last_request) == (False, True)
    assert m0.max_query_len == 3 and m0.max_seq_len == 13
    assert m0.num_tokens == 4 and m0.num_reqs == 2

    m1 = slice_attention_metadata(second, qsl, seq_lens)
    # request 1's remaining 4 tokens, then requests 2 and 3, rebased to token 4
    assert m1.query_start_loc.tolist() == [0, 4, 6, 12]
    assert m1.seq_lens is not None and m1.seq_lens.tolist() == [15, 12, 16]
    assert (m1.splits_first_request, m1.splits_last_request) == (True, False)
    assert m1.max_query_len == 6

    # the batch tensors (possibly captured static buffers) were never written
    assert torch.equal(qsl, qsl_before) and torch.equal(seq_lens, seq_before)


def test_attention_metadata_padded_last_slice() -> None:
    # 6 decode requests padded to 8 tokens / 8 requests
    qsl = torch.arange(7, dtype=torch.int64)
    seq_lens = torch.full((6,), 9, dtype=torch.int64)
    plan = plan_micro_batches(_cfg(), [1] * 6, 8, 8, uniform_decode=True)
    assert plan is not None
    m1 = slice_attention_metadata(plan.padded_slices[1], qsl, seq_lens)
    # real requests 4, 5 then two zero-length padding requests
    assert m1.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    assert m1.seq_lens is not None and m1.seq_lens.tolist() == [9, 9, 0, 0]
    assert m1.num_tokens == 4 and m1.num_reqs == 4
    assert not m1.splits_last_request


def test_attention_metadata_rejects_bad_slice() -> None:
    qsl = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="outside its first request"):
        slice_attention_metadata(S(4, 8, 0, 2), qsl)
    with pytest.raises(ValueError, match="empty"):
        slice_attention_metadata(S(4, 4, 1, 1), qsl)
