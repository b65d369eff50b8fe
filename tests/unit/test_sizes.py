"""The pure size rules: ladder, spec-decode rounding, padding table, compile ranges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freezeframe.sizes import (
    Range,
    compile_ranges,
    default_capture_sizes,
    default_max_capture_size,
    padded_size,
    padding_intervals,
    padding_table,
    round_sizes_for_spec_decode,
)

# -- Range ------------------------------------------------------------------------------------


def test_range_is_inclusive() -> None:
    r = Range(9, 32)
    assert 9 in r and 32 in r and 20 in r
    assert 8 not in r and 33 not in r
    assert "9" not in r
    assert not r.is_single_size()
    assert Range(16, 16).is_single_size()
    assert str(r) == "[9, 32]"


def test_range_rejects_reversed_bounds() -> None:
    with pytest.raises(ValueError, match="start 5 is above its end 4"):
        Range(5, 4)


# -- ladder -----------------------------------------------------------------------------------


def test_default_max_formula() -> None:
    assert default_max_capture_size(256, 0, 8192) == 512
    assert default_max_capture_size(128, 0, 2048) == 256
    assert default_max_capture_size(64, 1, 8192) == 256  # 64 * 2 * 2
    assert default_max_capture_size(256, 0, 100) == 100  # capped by the token budget
    assert default_max_capture_size(8, 0, 8) == 8


def test_ladder_for_512_has_51_sizes() -> None:
    sizes = default_capture_sizes(512)
    assert len(sizes) == 51
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[33:37] == [248, 256, 272, 288]
    assert sizes[-1] == 512
    assert sizes == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def test_ladder_cut_points() -> None:
    assert default_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    # a maximum the steps miss is the last rung itself
    assert default_capture_sizes(257) == [*default_capture_sizes(256), 257]
    assert default_capture_sizes(100) == [1, 2, 4, *range(8, 97, 8), 100]
    assert default_capture_sizes(15) == [1, 2, 4, 8, 15]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(0) == []
    assert default_capture_sizes(300)[-4:] == [256, 272, 288, 300]
    assert default_capture_sizes(304)[-3:] == [272, 288, 304]


@settings(deadline=None)
@given(st.integers(1, 2048))
def test_ladder_ends_at_its_maximum(max_size: int) -> None:
    sizes = default_capture_sizes(max_size)
    assert sizes[-1] == max_size
    assert sizes == sorted(set(sizes))
    assert all(padded_size(n, sizes) is not None for n in range(1, max_size + 1))


# -- spec-decode rounding ---------------------------------------------------------------------


def test_spec_decode_rounds_up_and_drops_above_max() -> None:
    assert round_sizes_for_spec_decode([1, 2, 4, 8], 2, 8) == [2, 4, 8]
    assert round_sizes_for_spec_decode([1, 2, 4, 8, 15], 3, 15) == [3, 6, 9, 15]
    # 8 -> 9 (above 8): dropped
    assert round_sizes_for_spec_decode([1, 2, 4, 8], 3, 8) == [3, 6]


def test_spec_decode_falls_back_to_one_multiple() -> None:
    # every size rounds above the max, but one graph of `multiple` tokens fits
    assert round_sizes_for_spec_decode([5], 4, 5) == [4]


def test_spec_decode_error_when_nothing_fits() -> None:
    with pytest.raises(ValueError, match="decode query length 4") as exc:
        round_sizes_for_spec_decode([1, 2], 4, 2)
    assert "raise max_cudagraph_capture_size to at least 4" in str(exc.value)


# -- padding ----------------------------------------------------------------------------------


def test_padded_size_examples() -> None:
    caps = [1, 2, 4, 8]
    assert [padded_size(n, caps) for n in range(10)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, None]
    assert padded_size(3, []) is None
    with pytest.raises(ValueError, match="must be >= 0"):
        padded_size(-1, caps)


def test_padding_table_and_intervals() -> None:
    caps = [1, 2, 4, 8]
    assert padding_table(caps) == [0, 1, 2, 4, 4, 8, 8, 8, 8]
    assert padding_table([]) == [0]
    assert padding_intervals(caps) == [
        (Range(1, 1), 1), (Range(2, 2), 2), (Range(3, 4), 4), (Range(5, 8), 8)]
    assert padding_intervals([]) == []


capture_lists = st.lists(st.integers(1, 600), min_size=1, max_size=40, unique=True).map(sorted)


@settings(deadline=None)  # the machine is shared; timing is not under test
@given(capture_lists, st.integers(0, 700))
def test_padding_property(caps: list[int], n: int) -> None:
    padded = padded_size(n, caps)
    if n == 0:
        assert padded == 0
    elif n > caps[-1]:
        assert padded is None
    else:
        assert padded is not None
        assert padded >= n
        assert padded in caps
        # the smallest such size
        assert all(c < n for c in caps if c < padded)
        assert padding_table(caps)[n] == padded


@settings(deadline=None)
@given(capture_lists)
def test_padding_table_matches_padded_size(caps: list[int]) -> None:
    table = padding_table(caps)
    assert len(table) == caps[-1] + 1
    assert table == [padded_size(n, caps) for n in range(caps[-1] + 1)]
    covered = [n for r, _ in padding_intervals(caps) for n in range(r.start, r.end + 1)]
    assert covered == list(range(1, caps[-1] + 1))


# -- compile ranges ---------------------------------------------------------------------------


def test_compile_ranges_example() -> None:
    assert compile_ranges([8, 32], 8192) == [Range(1, 8), Range(9, 32), Range(33, 8192)]


def test_compile_ranges_edge_endpoints() -> None:
    assert compile_ranges([], 8192) == [Range(1, 8192)]
    assert compile_ranges([32, 8, 8], 8192) == [Range(1, 8), Range(9, 32), Range(33, 8192)]
    assert compile_ranges([8192, 9000], 8192) == [Range(1, 8192)]
    assert compile_ranges([1, 2], 16) == [Range(1, 2), Range(3, 16)]
