"""Pure functions for the size rules: capture-size ladder, padding table, compile ranges.

Kept free of any config object so each rule can be tested and reasoned about on its own.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import cast

__all__ = [
    "Range",
    "compile_ranges",
    "default_capture_sizes",
    "default_ladder",
    "default_max_capture_size",
    "padded_size",
    "padding_intervals",
    "padding_table",
    "round_sizes_for_spec_decode",
]


@dataclasses.dataclass(frozen=True, order=True)
class Range:
    """An inclusive range of sizes ``[start, end]``; ``Range(s, s)`` is a single size."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start > self.end:
            raise ValueError(f"Range start {self.start} is above its end {self.end}")

    def __contains__(self, size: object) -> bool:
        return isinstance(size, int) and self.start <= size <= self.end

    def is_single_size(self) -> bool:
        return self.start == self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"


def default_max_capture_size(max_num_seqs: int, num_speculative_tokens: int,
                             max_num_tokens: int) -> int:
    """``min(max_num_seqs * (1 + spec) * 2, 512, max_num_tokens)``: twice the largest decode
    batch, capped where graphs stop paying off and by the token budget."""
    decode_query_len = 1 + num_speculative_tokens
    return min(max_num_seqs * decode_query_len * 2, 512, max_num_tokens)


def default_capture_sizes(max_size: int) -> list[int]:
    """The ladder ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``, cut at ``max_size``,
    with ``max_size`` itself as the last rung when the steps miss it.

    Dense at small sizes where decode batches live, sparser above 256 where padding waste is a
    smaller fraction of the batch. Ending at ``max_size`` means every batch of ``1..max_size``
    tokens pads to a captured size: with ``max_num_tokens=100`` a 100-token step gets a graph
    of 100, not an eager fallback past the 96 rung.
    """
    sizes = _grid(max_size)
    if max_size >= 1 and sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def _grid(top: int) -> list[int]:
    """``[1, 2, 4] + range(8, 256, 8) + range(256, top + 1, 16)``, the steps up to ``top``."""
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    return sizes


def default_ladder(max_size: int, max_num_seqs: int, decode_query_len: int) -> list[int]:
    """The default capture sizes (vLLM's rule, speculative decoding included): the token
    ladder up to ``max_size`` (:func:`default_capture_sizes`), joined by the uniform-decode
    sizes ``c * decode_query_len`` for request counts ``c`` on the same steps (``1, 2, 4, 8,
    ..``) up to ``max_num_seqs``, and ``max_num_seqs`` itself, that are not above
    ``max_size``: a decode step of ``c`` requests of ``1 + num_speculative_tokens`` tokens each
    pads to a graph of exactly its size, and every other step to the token ladder. With one
    token per request the decode sizes are request counts, on the ladder but for
    ``max_num_seqs``."""
    counts = {*_grid(max_num_seqs), max_num_seqs} if max_num_seqs >= 1 else set()
    decodes = {c * decode_query_len for c in counts if c * decode_query_len <= max_size}
    return sorted({*default_capture_sizes(max_size), *decodes})


def round_sizes_for_spec_decode(sizes: Sequence[int], multiple: int, max_size: int) -> list[int]:
    """Round every size up to a multiple of ``multiple`` (the decode query length), drop those
    that end above ``max_size``, dedup and sort. If none survive, ``[multiple]`` when it fits.

    Raises ``ValueError`` when not even one graph of ``multiple`` tokens fits under the max.
    """
    rounded = sorted({-(-s // multiple) * multiple for s in sizes})
    kept = [s for s in rounded if s <= max_size]
    if kept:
        return kept
    if multiple <= max_size:
        return [multiple]
    raise ValueError(
        f"no capture size survives rounding to multiples of the decode query length {multiple} "
        f"under max_cudagraph_capture_size={max_size}; raise max_cudagraph_capture_size to at "
        f"least {multiple} or lower num_speculative_tokens"
    )


def padded_size(num_tokens: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= ``num_tokens``, or ``None`` when it is above the largest
    (no graph: the step runs unpadded). ``capture_sizes`` must be sorted ascending."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_tokens == 0:
        return 0
    i = bisect.bisect_left(capture_sizes, num_tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None


def padding_table(capture_sizes: Sequence[int]) -> list[int]:
    """``table[n]`` = :func:`padded_size` of ``n`` for every ``n`` in ``0..max(capture_sizes)``
    (a lookup for the dispatcher's hot path)."""
    top = capture_sizes[-1] if capture_sizes else 0
    return [cast(int, padded_size(n, capture_sizes)) for n in range(top + 1)]


def padding_intervals(capture_sizes: Sequence[int]) -> list[tuple[Range, int]]:
    """The padding table run-length encoded: ``(Range(lo, hi), size)`` for each capture size,
    meaning every batch of ``lo..hi`` tokens pads to ``size``. Batches above the last ``hi``
    run without a graph."""
    out, prev = [], 0
    for size in capture_sizes:
        out.append((Range(prev + 1, size), size))
        prev = size
    return out


def compile_ranges(endpoints: Iterable[int], max_num_tokens: int) -> list[Range]:
    """Consecutive inclusive ranges ending at each endpoint and at ``max_num_tokens``.

    Endpoints ``[8, 32]`` with ``max_num_tokens`` 8192 give ``[1,8] [9,32] [33,8192]``;
    endpoints at or above ``max_num_tokens`` add nothing.
    """
    # Endpoint 1 adds nothing: the first range starts at 1, and a symbolic [1, 1] is
    # specialised by Dynamo anyway (vLLM drops it too).
    ends = sorted({e for e in endpoints if 1 < e < max_num_tokens} | {max_num_tokens})
    ranges, prev = [], 0
    for end in ends:
        ranges.append(Range(prev + 1, end))
        prev = end
    return ranges
