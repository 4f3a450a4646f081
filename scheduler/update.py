"""update(state, plan, result) -> (state, outputs): commit accepted tokens, advance trackers, finish.

Order: first the step's commitments become visible (PENDING cache slots -> CACHED, UNREADY
checkpoints -> READY), then verify/decode rows are committed vectorised (accepted drafts plus the
bonus token; rejected drafts are a ReplaySSM cursor move), then prefill rows. A prefill chunk's
KV blocks are published under their chained keys here; the blocks decode fills are published right
before the next prefix lookup or their release (`publish_full_blocks`), so every lookup sees every
full block while a steady decode batch hashes nothing. A verify row whose accepted tokens cross a
Mamba block boundary asks the next `schedule` to materialize that boundary's state. Rows of requests
aborted (or ended by `resolve`) while the step was in flight count what the step computed but commit
and emit no token; they are released last, publishing their computed blocks and states.
Per-row work is vectorised over the step's rows: the outputs are one `StepOutputs` of arrays and new
tokens go to the row tails (history.py), so Python loops run only over the rows that finish or cross
a Mamba block boundary (with k = 3 and 256-token blocks, ~1 row in 100).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from scheduler.checkpoints import CheckpointEvent, advance
from scheduler.history import append_tokens
from scheduler.journal import frozen
from scheduler.lifecycle import forget, release_rows
from scheduler.plan import BatchPlan, RowKind, StepResult, check_step_result
from scheduler.publish import register_blocks
from scheduler.replay import commit, crossed_boundary, materialize_count, ring_rows
from scheduler.request import LENGTH_CODE, STOP_CODE, StepOutputs
from scheduler.slots import SlotKind
from scheduler.state import (
    CHECKPOINT,
    COMMITTED,
    EOS,
    MAX_LEN,
    NUM_COMPUTED,
    NUM_TOKENS,
    RING_START,
    RUNNING_SLOT,
    InFlight,
    Materialize,
    SchedulerState,
)
from scheduler.transaction import StateEdit


class _Live(NamedTuple):
    """Plan rows [lo, hi) whose request still runs (an abort while the step was in flight drops it)."""

    index: np.ndarray | slice  # plan rows; a slice (views, no gathers) when every row is live
    rids: tuple[str, ...]
    rows: np.ndarray           # [n] row-table row


def update(state: SchedulerState, plan: BatchPlan, result: StepResult) -> tuple[SchedulerState, StepOutputs]:
    """Apply one executed step; raises ValueError (state unchanged) for a foreign plan or bad result."""
    if state.in_flight is None or state.in_flight.step_id != plan.step_id:
        raise ValueError(f"update: plan {plan.step_id} is not the step in flight ({state.in_flight})")
    check_step_result(plan, result, state.config.num_spec_tokens)
    with StateEdit(state) as edit:
        _complete_in_flight(edit, state.in_flight)
        edit.in_flight = None
        num_decode = int(np.count_nonzero(plan.row_kind[:plan.num_rows] >= RowKind.DECODE))
        outputs = []
        if num_decode:
            outputs.append(_update_decodes(edit, plan, result, _live(edit, plan, 0, num_decode)))
        if plan.num_rows > num_decode:
            outputs.append(_update_prefills(edit, plan, result, _live(edit, plan, num_decode, plan.num_rows)))
        outputs = _join(outputs, 1 + edit.cfg.num_spec_tokens)
        if edit.aborting:
            outputs = _release_aborted(edit, outputs)
        return edit.freeze(), outputs


def _live(edit: StateEdit, plan: BatchPlan, lo: int, hi: int) -> _Live:
    # a row freed by an in-flight abort stays inactive until the next `schedule`, so `active` suffices
    rows = plan.row_ids[lo:hi]
    alive = edit.rows.active[rows]
    if alive.all():
        return _Live(slice(lo, hi), plan.request_ids[lo:hi], rows)
    index = alive.nonzero()[0]
    return _Live(index + lo, tuple(plan.request_ids[lo + i] for i in index.tolist()), rows[index])


def _complete_in_flight(edit: StateEdit, in_flight: InFlight) -> None:
    for slot in in_flight.ready_slots:
        if edit.slots.kind[slot] == SlotKind.PENDING:
            edit.slots.make_ready(slot, edit.step)
    for key in in_flight.checkpoint_keys:
        advance(edit.claims[key].status, CheckpointEvent.STEP_DONE, key)
        del edit.claims[key]  # READY is the cached slot itself


def _update_decodes(edit: StateEdit, plan: BatchPlan, result: StepResult, live: _Live) -> StepOutputs:
    rows, cfg = edit.rows, edit.cfg
    cols = rows.ints.take(live.rows, axis=1)  # every column of the step's rows in one gather
    sampled = np.array(result.sampled_token_ids[live.index])  # the outputs own their tokens
    accepted = np.add(result.num_accepted[live.index], 1, dtype=np.int32)  # computed tokens incl. the bonus
    computed = cols[NUM_COMPUTED] + accepted
    ring_start, committed = commit(cols[RING_START], cols[COMMITTED], plan.flush[live.index], accepted,
                                   ring_rows(cfg.ring_size, cfg.num_spec_tokens))
    width = sampled.shape[1]  # the last accepted token of row i sits at flat index i * width + accepted - 1
    last_token = sampled.reshape(-1).take(np.arange(-1, len(accepted) * width - 1, width) + accepted)
    for column, values in ((rows.num_computed, computed), (rows.ring_start, ring_start),
                           (rows.committed, committed), (rows.last_token, last_token)):
        column[live.rows] = values  # 1-D scatters take numpy's fast path, a 2-D one does not
    rows.drafts[live.rows] = result.draft_token_ids[live.index]
    outputs = _emit(edit, live, cols, sampled, np.where(aborting_mask(edit.aborting, live.rids), 0, accepted))
    materialize_crossed_boundaries(edit, live.rids, live.rows, cols[NUM_COMPUTED], computed,
                                   cols[NUM_TOKENS] + outputs.num_new_tokens)
    _finish_rows(edit, outputs)
    return outputs


def _update_prefills(edit: StateEdit, plan: BatchPlan, result: StepResult, live: _Live) -> StepOutputs:
    rows = edit.rows
    rows.num_computed[live.rows] += plan.query_lens[live.index]
    ended = rows.num_computed[live.rows] == rows.prefill_end[live.rows]
    sampling = _subset(live, ended & ~aborting_mask(edit.aborting, live.rids))
    rows.prefill_done[sampling.rows] = True
    rows.last_token[sampling.rows] = result.sampled_token_ids[sampling.index, 0]
    rows.drafts[sampling.rows] = result.draft_token_ids[sampling.index]
    outputs = _emit(edit, sampling, rows.ints[:, sampling.rows], result.sampled_token_ids[sampling.index],
                    np.ones(len(sampling.rids), np.int32))
    last = np.minimum(rows.num_computed[live.rows], rows.num_tokens[live.rows]) // edit.cfg.hash_unit
    register_blocks(edit, live.rids, live.rows, last)
    _finish_rows(edit, outputs)
    return outputs


def aborting_mask(aborting: tuple[str, ...], request_ids: tuple[str, ...]) -> np.ndarray:
    """[n] bool: which of `request_ids` are aborting (none, the usual case, costs one allocation)."""
    if not aborting:
        return np.zeros(len(request_ids), bool)
    return np.fromiter(map(set(aborting).__contains__, request_ids), bool, len(request_ids))


def _subset(live: _Live, mask: np.ndarray) -> _Live:
    keep = mask.nonzero()[0]
    index = keep + live.index.start if type(live.index) is slice else live.index[keep]
    return _Live(index, tuple(live.rids[j] for j in keep.tolist()), live.rows[keep])


def _emit(edit: StateEdit, live: _Live, cols: np.ndarray, sampled: np.ndarray, counts: np.ndarray) -> StepOutputs:
    """Commit each row's emitted tokens, cut at max_len and after the first eos/stop token.
    `cols` holds the rows' columns from before the step."""
    before, max_len = cols[NUM_TOKENS], cols[MAX_LEN]
    eos_hits = (sampled == cols[EOS][:, None]) & (sampled >= 0)  # EOS -1: none; tokens < 0: placeholders
    ending = before + counts >= max_len
    if eos_hits.any() or ending.any() or edit.rows.has_stop[live.rows].any():
        keep, codes = _cut(edit, live, before, max_len, sampled, counts, eos_hits)
    else:  # the usual step: nobody stops, every row keeps all its tokens
        keep, codes = counts, np.zeros(len(counts), np.int8)
    append_tokens(edit.writable_log, edit.rows, edit.cfg.log_unit, edit.cfg.hash_unit, live.rids, live.rows, sampled,
                  before, keep)
    return StepOutputs(live.rids, frozen(sampled), frozen(keep), frozen(codes))


def _cut(edit: StateEdit, live: _Live, before: np.ndarray, max_len: np.ndarray, sampled: np.ndarray,
         counts: np.ndarray, eos_hits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kept token counts and finish codes when some row reaches max_len or samples a stop token."""
    hits = eos_hits.copy()
    for j in edit.rows.has_stop[live.rows].nonzero()[0].tolist():  # extra stop ids: rare, per row
        hits[j] |= np.isin(sampled[j], list(edit.requests[live.rids[j]].stop_params.stop_ids))
    return cut_at_stops(hits, counts, before, max_len)


def cut_at_stops(hits: np.ndarray, counts: np.ndarray, before: np.ndarray, max_len: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Of counts[i] new tokens after before[i], how many row i keeps (up to max_len[i] and through its first
    stop token, hits[i, j] marking those) and its finish code. A row given no token (aborting) does not end."""
    keep = np.minimum(counts, max_len - before)
    hits = (np.arange(hits.shape[1], dtype=np.int32) < keep[:, None]) & hits
    first = hits.argmax(axis=1)
    stop = np.where(hits[np.arange(len(first)), first], first, -1)
    keep = np.where(stop >= 0, stop + 1, keep).astype(np.int32)
    at_max_len = (counts > 0) & (before + keep >= max_len)
    codes = np.where(stop >= 0, STOP_CODE, np.where(at_max_len, LENGTH_CODE, 0)).astype(np.int8)
    return keep, codes


def materialize_crossed_boundaries(edit: StateEdit, request_ids: tuple[str, ...], row_ids: np.ndarray,
                                   before: np.ndarray, after: np.ndarray, num_tokens: np.ndarray) -> None:
    """In align mode, rows whose computed and committed tokens crossed a Mamba block boundary (going from
    `before` to `after` computed tokens) ask for that boundary's state, under the key of the block before
    it (published now: the others wait for `publish_full_blocks`). A row cut by a stop token may have
    computed past its last token: it ends now, and release_rows publishes what it committed."""
    if not edit.cfg.align:
        return
    boundary = crossed_boundary(before, after, edit.cfg.log_unit)
    crossed = ((boundary > 0) & (boundary <= num_tokens)).nonzero()[0]
    if crossed.size:
        rids = [request_ids[j] for j in crossed.tolist()]
        register_blocks(edit, rids, row_ids[crossed], boundary[crossed] // edit.cfg.hash_unit)
        _ask_materializations(edit, rids, row_ids[crossed], boundary[crossed])


def _ask_materializations(edit: StateEdit, request_ids: list[str], row_ids: np.ndarray, boundary: np.ndarray) -> None:
    cols = edit.rows.ints.take(row_ids, axis=1)
    count = materialize_count(boundary, cols[NUM_COMPUTED], cols[COMMITTED])
    cached, unit, asks = edit.slots.hash_to_slot, edit.cfg.hash_unit, list(edit.materializations)
    for rid, position, slot, ring_start, entries, marked in zip(
            request_ids, boundary.tolist(), cols[RUNNING_SLOT].tolist(), cols[RING_START].tolist(),
            count.tolist(), cols[CHECKPOINT].tolist(), strict=True):
        if marked:
            continue  # marked requests cache only their checkpoint
        key = edit.logs[rid].hashes[position // unit - 1]
        if key not in cached and key not in edit.claims:
            asks.append(Materialize(rid, slot, key, position, ring_start, entries))
    edit.materializations = tuple(asks)


def _finish_rows(edit: StateEdit, outputs: StepOutputs) -> None:
    finished = outputs.finished_ids
    if finished:
        release_rows(edit, finished)
        for i in outputs.finish_codes.nonzero()[0].tolist():
            rid = outputs.request_ids[i]
            if outputs.num_new_tokens[i] and outputs.token_ids[i, 0] < 0:  # reached max_len on a placeholder
                edit.unresolved_ends[rid] = edit.requests[rid].stop_params.stop_ids
            forget(edit, rid)


def _release_aborted(edit: StateEdit, outputs: StepOutputs) -> StepOutputs:
    """Release the requests aborted while the step ran, now that it has: they emit nothing."""
    aborted, edit.aborting = list(edit.aborting), ()
    release_rows(edit, aborted)
    for rid in aborted:
        forget(edit, rid)
    return outputs.without(set(aborted))


def _join(parts: list[StepOutputs], width: int) -> StepOutputs:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return StepOutputs((), *(frozen(np.zeros(shape, dtype)) for shape, dtype in
                                 (((0, width), np.int32), (0, np.int32), (0, np.int8))))
    arrays = [frozen(np.concatenate([getattr(part, name) for part in parts]))
              for name in ("token_ids", "num_new_tokens", "finish_codes")]
    return StepOutputs(sum((part.request_ids for part in parts), ()), *arrays)

