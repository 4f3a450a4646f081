"""Where a prefill chunk may end: the align-mode split with the MTP lookahead rules built in.

Theory of operation. A recurrent state exists only at chunk ends, and align mode caches it only when
the chunk ends on a Mamba block boundary (invariant I1: the state cached for tokens [0, p) is the
state after exactly p tokens). So every non-final chunk ends on a boundary; a chunk that starts
mid-block (a checkpoint hit, a sub-block step) stops at the next boundary; a chunk never runs past
the last cacheable boundary (one block back under EAGLE/MTP block drop) or past a producer's declared
checkpoint. Multi-module MTP additionally wants L known tokens after every chunk end; a separate clamp
after the split can fight it and stall a request forever, so the split resolves the lookahead itself
(docs/scheduler.md#align-mode-and-the-mtp-lookahead): finish the prefill if the budget allows and no
boundary is crossed from a mid-block start, else stop at the last boundary at or before N - L, else
keep the aligned end.
"""

from __future__ import annotations

from typing import NamedTuple


class SplitInput(NamedTuple):
    """One prefill chunk decision. All values are token counts or positions.

    start: tokens already computed (after any prefix hit). budget: tokens the step can give.
    prefill_end: N, the end of the known tokens. bs: Mamba block size. max_chunk: the step budget cap
    (decides sub-block mode, bs > max_chunk). lookahead: L. block_drop: EAGLE/MTP one-block back-off.
    checkpoint: a producer's declared checkpoint position, or None. align: cache_mode == "align".
    marked: the request carries a checkpoint marker; it caches only that position, so the boundary
    stops (last cacheable boundary, next boundary after a mid-block start) do not apply to it.
    """

    start: int
    budget: int
    prefill_end: int
    bs: int
    max_chunk: int
    lookahead: int = 0
    block_drop: bool = False
    checkpoint: int | None = None
    align: bool = True
    marked: bool = False


def split_chunk(s: SplitInput) -> int:
    """Tokens to schedule for this prefill chunk; 0 means "not this step" (budget too small)."""
    n = min(s.budget, s.prefill_end - s.start)
    if n <= 0:
        return 0
    end = _aligned_end(s, s.start + n) if s.align else s.start + n
    if end > s.start:
        end = _resolve_lookahead(s, end, n)
    if s.checkpoint is not None and s.start < s.checkpoint < end:
        end = s.checkpoint  # producer truncation: the declared state must exist at a chunk end
    return max(end - s.start, 0)


def min_budget(s: SplitInput) -> int:
    """The least budget with which `split_chunk(s)` schedules a token (it does with any budget from there
    on; `s.budget` is not read): the rest of the prefill, or less in align mode, where a chunk that does
    not finish the prefill must reach the next Mamba block boundary, unless a block is wider than any
    chunk (sub-block mode). The stops and the lookahead rules only ever cut an end back to a position
    past `start`, so they never turn a chunk into none. At most `max_chunk`."""
    rest = s.prefill_end - s.start
    if s.align and s.bs <= s.max_chunk:
        return min(rest, s.bs - s.start % s.bs)
    return min(rest, 1)


def last_cacheable_boundary(prefill_end: int, bs: int, block_drop: bool) -> int:
    last = prefill_end - prefill_end % bs
    return max(last - bs, 0) if block_drop else last


def _aligned_end(s: SplitInput, end: int) -> int:
    if end < s.prefill_end:
        aligned = end - end % s.bs
        if aligned > s.start:
            end = aligned
        elif s.bs <= s.max_chunk:
            return s.start  # an aligned chunk fits a full step budget: wait for one
        # else sub-block mode: the block is wider than any chunk; progress privately
    for stop in _stops(s):
        if s.start < stop < end:
            end = stop
    return end


def _stops(s: SplitInput) -> tuple[int, ...]:
    if s.marked:
        return ()
    next_boundary = s.start - s.start % s.bs + s.bs
    stops = (last_cacheable_boundary(s.prefill_end, s.bs, s.block_drop),)
    if s.start % s.bs:
        stops += (next_boundary,)  # a mid-block start never crosses the next boundary
    return stops


def _resolve_lookahead(s: SplitInput, end: int, n: int) -> int:
    """Seed 004 rules when the end falls inside the window (N - L, N); no-op for L <= 1."""
    window_start = s.prefill_end - s.lookahead
    if not window_start < end < s.prefill_end:
        return end
    if not s.align:
        return _reserve(s, end)
    if n >= s.prefill_end - s.start and _crosses_no_boundary_midblock(s):
        return s.prefill_end  # rule 1: finish, giving up the boundary inside the window
    boundary = window_start - window_start % s.bs
    if boundary > s.start:
        return boundary  # rule 2: the last boundary at or before N - L
    if end % s.bs == 0:
        return end  # rule 3: keep the aligned end; the next chunk finishes the prefill
    return _reserve(s, end)


def _crosses_no_boundary_midblock(s: SplitInput) -> bool:
    next_boundary = s.start - s.start % s.bs + s.bs
    return s.start % s.bs == 0 or s.prefill_end <= next_boundary


def _reserve(s: SplitInput, end: int) -> int:
    # an unaligned end (sub-block mode, or no alignment at all) is pulled back to N - L as vLLM's
    # reservation does, but never to <= start: a chunk that cannot move back keeps its end
    reserved = s.prefill_end - s.lookahead
    return reserved if reserved > s.start else end
