"""Cut one padded token batch into micro-batches.

Micro-batching (dual-batch overlap) runs a batch as ``N`` slices so that one slice's
communication can run while another slice computes. Everything here is plain arithmetic on token
and request counts, so it is tested without threads, streams or graphs:

* the batch is cut at *token* boundaries (multiples of ``padded_tokens // N`` unless a split point
  is given), not at request boundaries, so the slices are equal in size and a FULL graph captured
  for one padded size has the same slice shapes every time; a request whose tokens cross a cut
  *straddles* two micro-batches;
* each slice's requests are found by binary search on the cumulative token counts;
* the last slice is padded out to the padded token and request counts, so the slices together
  cover exactly the padded batch the graph was captured for;
* the batch runs unsplit when micro-batching is off, the batch is under its threshold, the last
  micro-batch would hold only padding, or any data-parallel rank declines (every rank must run the
  same number of micro-batches, or their collectives would pair up wrongly and hang).

Per-slice attention metadata (:func:`slice_attention_metadata`) rebases the query start offsets
and trims the lengths of straddling requests on *copies*: the full batch's tensors may be the
static buffers a graph was captured on, and mutating them would corrupt the next replay.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from freezeframe.batch import DPMicroBatchMetadata, MicroBatchPlan, MicroBatchSlice
from freezeframe.errors import ConfigError
from freezeframe.runtime.dist import dp_active

if TYPE_CHECKING:  # pragma: no cover
    from freezeframe.config import CompilationConfig

__all__ = [
    "DPMicroBatchMetadata",
    "MicroBatchPlan",
    "MicroBatchSlice",
    "SliceAttentionMetadata",
    "agree_across_dp",
    "create_slices",
    "dp_micro_batch_metadata",
    "last_micro_batch_empty",
    "pad_last_slice",
    "plan_for_step",
    "plan_micro_batches",
    "should_micro_batch",
    "slice_attention_metadata",
    "split_points",
]

logger = logging.getLogger(__name__)


# -- decisions ---------------------------------------------------------------------------------


def should_micro_batch(config: CompilationConfig, num_tokens: int, uniform_decode: bool) -> bool:
    """Whether this rank wants to split a batch of ``num_tokens`` (before any DP agreement).

    Uniform-decode batches use ``micro_batch_decode_threshold``; prefill and mixed batches use
    ``micro_batch_prefill_threshold``. A batch at or above its threshold is split: small batches
    gain nothing from overlap and pay the threading overhead.
    """
    if not config.micro_batching:
        return False
    threshold = (
        config.micro_batch_decode_threshold if uniform_decode
        else config.micro_batch_prefill_threshold
    )
    return num_tokens >= threshold


def split_points(
    num_tokens_padded: int, num_micro_batches: int, split_point: int | Sequence[int] | None = None
) -> list[int]:
    """The ``num_micro_batches - 1`` token offsets where the padded batch is cut.

    Default: multiples of ``num_tokens_padded // num_micro_batches``. An int ``split_point`` gives
    the stride; a sequence gives the cut offsets themselves (strictly increasing, inside the batch).
    """
    if num_micro_batches < 2:
        raise ConfigError(
            f"num_micro_batches: needs at least 2 micro-batches, got {num_micro_batches}; "
            "set num_micro_batches >= 2 or turn micro_batching off"
        )
    if split_point is None:
        split_point = num_tokens_padded // num_micro_batches
    if isinstance(split_point, int):
        if split_point <= 0:
            raise ValueError(
                f"split_point: must be > 0, got {split_point} (padded tokens "
                f"{num_tokens_padded}, {num_micro_batches} micro-batches); a batch smaller "
                "than the number of micro-batches cannot be split"
            )
        points = [split_point * i for i in range(1, num_micro_batches)]
    else:
        points = [int(p) for p in split_point]
        if len(points) != num_micro_batches - 1:
            raise ValueError(
                f"split_point: {num_micro_batches} micro-batches need "
                f"{num_micro_batches - 1} cut offsets, got {points}"
            )
    prev = 0
    for p in points:
        if not prev < p < num_tokens_padded:
            raise ValueError(
                f"split_point: cut offsets must be strictly increasing and inside (0, "
                f"{num_tokens_padded}), got {points}"
            )
        prev = p
    return points


def last_micro_batch_empty(
    num_tokens: int,
    num_tokens_padded: int,
    num_micro_batches: int,
    split_point: int | Sequence[int] | None = None,
) -> bool:
    """True when the last micro-batch would hold only padding (its cut is at or past the last
    scheduled token). Splitting then would run a micro-batch of pure padding, and a zero-token
    micro-batch would have no request to attend for, so the step runs unsplit instead."""
    if num_tokens_padded < num_micro_batches:
        return True
    points = split_points(num_tokens_padded, num_micro_batches, split_point)
    return points[-1] >= num_tokens


# -- slicing -----------------------------------------------------------------------------------


def _cumulative(num_scheduled_tokens: Sequence[int]) -> list[int]:
    """``[0, n0, n0+n1, ...]``: request ``r`` owns tokens ``[cu[r], cu[r+1])``."""
    cu = [0]
    for r, n in enumerate(num_scheduled_tokens):
        n = int(n)
        if n < 0:
            raise ValueError(f"num_scheduled_tokens[{r}] = {n}: token counts must be >= 0")
        cu.append(cu[-1] + n)
    return cu


def create_slices(
    num_scheduled_tokens: Sequence[int], points: Sequence[int]
) -> list[MicroBatchSlice]:
    """Cut the scheduled tokens at ``points`` and find each window's requests.

    A window ``[start, stop)`` holds the requests whose tokens overlap it: the first is the one
    that owns token ``start`` (so a request cut at ``start`` appears in both neighbours), the last
    is the one before the first request starting at or after ``stop``. Both are binary searches on
    the cumulative counts. A zero-token request sitting exactly on a cut computes nothing and lands
    in neither window (zero-token requests only occur as padding, which the last slice absorbs).
    """
    cu = _cumulative(num_scheduled_tokens)
    total = cu[-1]
    slices = []
    start = 0
    for stop in [*points, total]:
        if stop < start:
            raise ValueError(
                f"create_slices: cut offset {stop} is before the previous one ({start}) or past "
                f"the {total} scheduled tokens; check last_micro_batch_empty() first"
            )
        # last r with cu[r] <= start: the request owning token `start`
        req_start = bisect.bisect_right(cu, start) - 1
        # first r with cu[r] >= stop: requests from there on start at or after the window end
        req_stop = bisect.bisect_left(cu, stop)
        req_start = min(req_start, len(num_scheduled_tokens))
        slices.append(MicroBatchSlice(start, stop, req_start, max(req_stop, req_start)))
        start = stop
    return slices


def pad_last_slice(
    slices: Sequence[MicroBatchSlice], num_tokens_padded: int, num_reqs_padded: int
) -> list[MicroBatchSlice]:
    """Stretch the last slice to the padded token and request counts, so the slices tile the
    whole padded batch a graph is captured for (padding tokens run in the last micro-batch)."""
    if not slices:
        raise ValueError("pad_last_slice: no slices to pad")
    last = slices[-1]
    if num_tokens_padded < last.token_stop or num_reqs_padded < last.req_stop:
        raise ValueError(
            f"pad_last_slice: padded sizes (tokens {num_tokens_padded}, requests "
            f"{num_reqs_padded}) are smaller than the scheduled batch (tokens "
            f"{last.token_stop}, requests {last.req_stop}); padding only grows a batch"
        )
    padded = MicroBatchSlice(last.token_start, num_tokens_padded, last.req_start, num_reqs_padded)
    return [*slices[:-1], padded]


def plan_micro_batches(
    config: CompilationConfig,
    num_scheduled_tokens: Sequence[int],
    num_tokens_padded: int | None = None,
    num_reqs_padded: int | None = None,
    *,
    uniform_decode: bool = False,
    split_point: int | Sequence[int] | None = None,
    dp_group: Any = None,
    sync: bool = True,
) -> MicroBatchPlan | None:
    """Decide whether to split this step and, if so, how. ``None`` means: run it unsplit.

    ``num_scheduled_tokens[r]`` is request ``r``'s token count; the padded counts default to the
    scheduled ones. When ``torch.distributed`` is initialised every rank of ``dp_group`` (default:
    the world) must call this for the same step: the ranks vote, and one "no" makes everybody run
    unsplit. The vote and the per-micro-batch token counts travel in a single all-reduce.
    ``sync=False`` decides locally (for processes whose process group is not data parallel).
    """
    num_tokens = sum(int(n) for n in num_scheduled_tokens)
    if num_tokens_padded is None:
        num_tokens_padded = num_tokens
    if num_reqs_padded is None:
        num_reqs_padded = len(num_scheduled_tokens)
    if num_tokens_padded < num_tokens:
        raise ValueError(
            f"plan_micro_batches: num_tokens_padded={num_tokens_padded} is below the "
            f"{num_tokens} scheduled tokens"
        )
    n = config.num_micro_batches
    wanted = (
        should_micro_batch(config, num_tokens, uniform_decode)
        and not last_micro_batch_empty(num_tokens, num_tokens_padded, n, split_point)
    )
    plan: MicroBatchPlan | None = None
    if wanted:
        points = split_points(num_tokens_padded, n, split_point)
        slices = create_slices(num_scheduled_tokens, points)
        padded = pad_last_slice(slices, num_tokens_padded, num_reqs_padded)
        plan = MicroBatchPlan(tuple(slices), tuple(padded), num_tokens, num_tokens_padded)
    local_counts = [s.num_tokens for s in plan.padded_slices] if plan is not None else [0] * n
    agreed, across = (_exchange(plan is not None, local_counts, dp_group) if sync
                      else (plan is not None, None))
    if not agreed:
        if plan is not None:
            logger.debug("micro-batching declined by another data-parallel rank; running unsplit")
        return None
    assert plan is not None  # agreed implies this rank voted yes
    if across is not None:
        plan = dataclasses.replace(plan, dp=tuple(dp_micro_batch_metadata_from_rows(across)))
    return plan


def plan_for_step(
    config: CompilationConfig,
    num_tokens: int,
    num_reqs: int | None,
    num_tokens_padded: int,
    num_reqs_padded: int | None,
    *,
    uniform_decode: bool,
    query_len: int = 1,
    num_scheduled_tokens: Sequence[int] | None = None,
    dp_group: Any = None,
    sync: bool = True,
) -> MicroBatchPlan | None:
    """The plan for one runner step (the runner's hook; see :class:`~freezeframe.runtime.
    GraphRunner`). ``None`` when micro-batching is off (decided without any collective: every
    rank has the same config) or the step runs unsplit.

    Per-request token counts come from ``num_scheduled_tokens`` when the caller knows them
    (the runner's ``num_scheduled_tokens`` step argument); a uniform-decode step has
    ``query_len`` tokens per request; otherwise the layout is unknown and the step is treated as
    one request (token slicing is unaffected; only request slices need the real layout).
    """
    if not config.micro_batching:
        return None
    if num_scheduled_tokens is not None:
        counts = [int(n) for n in num_scheduled_tokens]
        if sum(counts) != num_tokens:
            raise ValueError(
                f"num_scheduled_tokens sums to {sum(counts)} but the step has {num_tokens} "
                "tokens; pass one count per request, in request order")
    elif uniform_decode and num_reqs:
        counts = [query_len] * num_reqs
    else:
        counts = [num_tokens]
    reqs_padded = max(num_reqs_padded or 0, len(counts))
    return plan_micro_batches(config, counts, num_tokens_padded, reqs_padded,
                              uniform_decode=uniform_decode, dp_group=dp_group, sync=sync)


# -- data parallel -----------------------------------------------------------------------------


def _exchange(
    vote: bool, counts: Sequence[int], group: Any
) -> tuple[bool, list[list[int]] | None]:
    """One all-reduce carrying every rank's vote and per-micro-batch token counts.

    Row ``r`` of a ``[world, 1 + N]`` int64 tensor is filled by rank ``r`` only (zeros elsewhere),
    so a SUM all-reduce is an all-gather that works on every backend (gloo included). Column 0 is
    the vote; the step is split only if every rank voted yes.
    """
    if not dp_active(group):
        return vote, None
    dist = torch.distributed
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    table = torch.zeros(world, 1 + len(counts), dtype=torch.int64)
    table[rank, 0] = int(vote)
    table[rank, 1:] = torch.tensor(list(counts), dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        table = table.cuda()
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    rows = table.cpu().tolist()
    agreed = all(row[0] == 1 for row in rows)
    return agreed, [row[1:] for row in rows]


def agree_across_dp(vote: bool, group: Any = None) -> bool:
    """True only if every rank of ``group`` votes True (always ``vote`` without distributed)."""
    agreed, _ = _exchange(vote, [], group)
    return agreed


def dp_micro_batch_metadata_from_rows(rows: Sequence[Sequence[int]]) -> list[DPMicroBatchMetadata]:
    """Transpose ``rows[rank][ubatch]`` into one :class:`DPMicroBatchMetadata` per micro-batch."""
    num = len(rows[0]) if rows else 0
    return [DPMicroBatchMetadata(tuple(int(row[u]) for row in rows)) for u in range(num)]


def dp_micro_batch_metadata(
    slices: Sequence[MicroBatchSlice], group: Any = None
) -> list[DPMicroBatchMetadata]:
    """Per-micro-batch token counts on every rank (one all-reduce). Without distributed, a
    single-rank view of ``slices``."""
    counts = [s.num_tokens for s in slices]
    _, rows = _exchange(True, counts, group)
    return dp_micro_batch_metadata_from_rows(rows if rows is not None else [counts])


# -- per-slice attention metadata -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SliceAttentionMetadata:
    """Attention metadata of one micro-batch.

    ``query_start_loc`` ([num_reqs + 1], starts at 0) is rebased to the micro-batch's first token;
    ``seq_lens`` ([num_reqs]) has the straddling last request trimmed (its later tokens are not in
    this micro-batch, so it attends to fewer keys). Both are fresh tensors whenever they differ from
    a plain view of the batch's tensors.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int
    seq_lens: torch.Tensor | None  # [num_reqs] int
    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int | None
    splits_first_request: bool
    splits_last_request: bool


def slice_attention_metadata(
    sl: MicroBatchSlice, query_start_loc: torch.Tensor, seq_lens: torch.Tensor | None = None
) -> SliceAttentionMetadata:
    """Metadata for one (possibly padded) slice of a batch described by ``query_start_loc``
    ([num_reqs + 1], cumulative token offsets) and ``seq_lens`` ([num_reqs]).

    Requests past the end of ``query_start_loc`` (padding requests of a padded last slice) get
    zero query tokens. The inputs are never written.
    """
    locs = _request_offsets(sl, query_start_loc)
    first_req, last_req = sl.req_start, sl.req_stop - 1
    splits_first = sl.token_start > locs[first_req]
    # the padded last slice may end past its last request (padding tokens): not a split
    splits_last = sl.token_stop < locs[last_req + 1]
    trimmed_tail = locs[last_req + 1] - sl.token_stop if splits_last else 0
    rebased = _rebased_offsets(sl, locs, trimmed_tail)
    # keep the caller's device and dtype
    qsl_out = torch.tensor(rebased, dtype=query_start_loc.dtype, device=query_start_loc.device)
    lens = [b - a for a, b in itertools.pairwise(rebased)]
    seq_out = None if seq_lens is None else _sliced_seq_lens(sl, seq_lens, trimmed_tail)
    return SliceAttentionMetadata(
        query_start_loc=qsl_out,
        seq_lens=seq_out,
        num_tokens=sl.num_tokens,
        num_reqs=sl.num_reqs,
        max_query_len=max(lens) if lens else 0,
        max_seq_len=None if seq_out is None else (
            int(seq_out.max().item()) if seq_out.numel() else 0),
        splits_first_request=splits_first,
        splits_last_request=splits_last,
    )


def _request_offsets(sl: MicroBatchSlice, query_start_loc: torch.Tensor) -> list[int]:
    """The batch's cumulative token offsets as ints, checked against ``sl`` and extended with
    the zero-length padding requests a padded last slice may hold (up to ``sl.req_stop``)."""
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise ValueError(
            f"query_start_loc must be 1-D with at least one entry, got shape "
            f"{tuple(query_start_loc.shape)}"
        )
    if sl.is_empty():
        raise ValueError(f"slice_attention_metadata: slice {sl} is empty; empty micro-batches are "
                         "never planned (see last_micro_batch_empty)")
    locs = [int(x) for x in query_start_loc.detach().cpu().tolist()]
    # extend with zero-length padding requests: they all start (and end) at the last real offset
    need = sl.req_stop + 1
    if len(locs) < need:
        locs = locs + [locs[-1]] * (need - len(locs))
    first_req = sl.req_start
    if not locs[first_req] <= sl.token_start < locs[first_req + 1]:
        raise ValueError(
            f"slice_attention_metadata: slice {sl} starts at token {sl.token_start}, outside its "
            f"first request {first_req} (tokens [{locs[first_req]}, {locs[first_req + 1]}))"
        )
    return locs


def _rebased_offsets(sl: MicroBatchSlice, locs: Sequence[int], trimmed_tail: int) -> list[int]:
    """``sl``'s query start offsets, starting at 0: its straddling first request loses the
    tokens before ``sl.token_start``, its straddling last request the ``trimmed_tail``."""
    window = locs[sl.req_start:sl.req_stop + 1]
    base = window[0]
    rebased = [x - base for x in window]
    if sl.token_start > base:  # the first request straddles the cut
        skipped = sl.token_start - base
        rebased = [0] + [x - skipped for x in rebased[1:]]
    rebased[-1] -= trimmed_tail
    return rebased


def _sliced_seq_lens(sl: MicroBatchSlice, seq_lens: torch.Tensor,
                     trimmed_tail: int) -> torch.Tensor:
    """``sl``'s rows of ``seq_lens``: padding requests attend to nothing, and a straddling last
    request to ``trimmed_tail`` fewer keys (on a copy)."""
    seq_out = seq_lens[sl.req_start:min(sl.req_stop, seq_lens.numel())]
    if seq_out.numel() < sl.num_reqs:  # padding requests attend to nothing
        pad = torch.zeros(sl.num_reqs - seq_out.numel(), dtype=seq_lens.dtype,
                          device=seq_lens.device)
        seq_out = torch.cat([seq_out, pad])
    if trimmed_tail:
        seq_out = seq_out.clone()  # never write the (possibly captured) batch tensor
        seq_out[-1] -= trimmed_tail
    return seq_out
