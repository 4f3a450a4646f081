"""schedule(state) -> (state, BatchPlan): decode rows, materializations, prefill chunks, admission.

Theory of operation. One pass spends the token budget in a fixed order:
  1. running decode/verify rows (vectorised, 1 + K tokens each, oldest first), leaving the oldest
     running prefill its reserve (below); if their new KV blocks do not fit, the newest running
     request is preempted (recompute) until they do;
  2. materializations asked for by the last `update` (pure slot work, no tokens);
  3. running prefill rows, oldest first, each cut by the align split (`split.py`);
  4. waiting requests, FCFS: prefix hit or checkpoint role first, then the split, then capacity.
     A consumer whose checkpoint is still PRODUCING, or a request whose longer prefix state is
     being written in this step, is skipped (`continue`); anything short of budget or memory stops
     admission (`break`) so the queue head is never overtaken forever.
Every cache slot written by the step is PENDING until `update`, so nothing reads a state before
the step that writes it has run; only a paired consumer reads a checkpoint in the same step, and it
runs in phase 2 after its producer.

Progress bound for running prefills. Running requests are served in admission order, as vLLM's running
queue serves them: a decode row of a request admitted after the oldest running prefill P does not take
what P's next chunk needs. That least chunk is need(P) = min(N - start, bs - start mod bs) tokens in
align mode (the rest of the prefill, or up to the next Mamba block boundary), 1 token in sub-block or
"none" mode, and the logits of its positions from `logits_from` on (`split.min_budget`, which
split_chunk meets with any budget from need(P) on, test_split). Decode rows admitted before P still
go first, and younger ones are held back only in a step where P can then run. So, unless P is
preempted (memory pressure; recompute preemption requeues it):
  * the oldest running request is scheduled in every step: a decode row fits any accepted config
    (max_num_batched_tokens, max_num_logits >= 1 + K), and so does need(P) (at most a whole step's
    chunk cap), before any younger row;
  * in every step a running prefill P is not scheduled, a request admitted before it is, so W(P), the
    tokens those requests may still compute (the sum of max_len - num_computed), shrinks by at least
    one; admission and readmission append to the running queue, so nothing adds to W(P);
  * hence P is scheduled within W(P) + 1 <= (max_num_seqs - 1) * max_model_len + 1 steps of any
    step, and within one step once it is the oldest running request. test_progress.py checks the
    step property over random accepted configs and workloads.
"""

from __future__ import annotations

import numpy as np

from scheduler.admit import admit_waiting
from scheduler.assemble import Copies, DecodeBatch, assemble
from scheduler.lifecycle import preempt
from scheduler.pass_state import Pass, chunk_limits, chunk_logits, emit_prefill, make_room
from scheduler.plan import BatchPlan
from scheduler.replay import flush_flags
from scheduler.slots import SlotKind
from scheduler.split import SplitInput, min_budget, split_chunk
from scheduler.state import (
    COMMITTED,
    LAST_TOKEN,
    MAX_LEN,
    NUM_BLOCKS,
    NUM_COMPUTED,
    RING_START,
    RUNNING_SLOT,
    InFlight,
    SchedulerState,
)
from scheduler.transaction import StateEdit


def schedule(state: SchedulerState) -> tuple[SchedulerState, BatchPlan]:
    """Choose the next step. Raises RuntimeError if the previous plan has not been `update`d."""
    if state.in_flight is not None:
        raise RuntimeError(f"schedule: step {state.in_flight.step_id} is still in flight; call update first")
    with StateEdit(state) as edit:
        edit.step += 1
        p = Pass(edit)
        decode = _schedule_decodes(p)
        _issue_materializations(p)
        _schedule_running_prefills(p)
        admit_waiting(p)
        edit.in_flight = InFlight(edit.step, tuple(p.ready_slots), tuple(p.checkpoint_keys))
        copies = Copies(p.hit_copies, p.pair_copies, p.publishes, p.materializes)
        plan = assemble(edit.cfg, edit.step, decode, p.prefills, copies, edit.rows.block_table, edit.rows.num_blocks,
                        edit.rows.data)
        return edit.freeze(), plan


def _decode_rows(p: Pass) -> tuple[list[str], np.ndarray]:
    """Running requests past their prefill, oldest first, as many as `_num_decode_rows` says."""
    running, all_rows = p.edit.running, p.edit.running_rows()
    decoding = p.edit.rows.prefill_done[all_rows]
    index = decoding.nonzero()[0][:_num_decode_rows(p, decoding, all_rows)]
    if len(index) == len(running):
        return list(running), all_rows
    return list(map(running.__getitem__, index.tolist())), all_rows[index]


def _num_decode_rows(p: Pass, decoding: np.ndarray, all_rows: np.ndarray) -> int:
    """How many decode rows run, oldest first: as many as the budgets hold, except that rows admitted after
    the oldest running prefill leave it the least its next chunk needs, if the rows before it leave that."""
    q = p.query_len
    fit = min(p.budget, p.logits_budget) // q
    if decoding.all():
        return fit
    older = int(decoding.argmin())  # the oldest running prefill's place: every row before it decodes
    if older >= fit:
        return fit
    tokens, logits = _prefill_reserve(p, p.edit.running[older], int(all_rows[older]))
    tokens_left, logits_left = p.budget - older * q, p.logits_budget - older * q
    if tokens_left < tokens or logits_left < logits:
        return fit  # it cannot run this step whatever the younger rows do
    return older + min(tokens_left - tokens, logits_left - logits) // q


def _prefill_reserve(p: Pass, rid: str, row: int) -> tuple[int, int]:
    """Tokens and logits of the least chunk with which running prefill `rid` is scheduled (split.min_budget)."""
    start = int(p.edit.rows.num_computed[row])
    need = min_budget(_split_input(p, rid, row, start))
    return need, chunk_logits(start, start + need, int(p.edit.rows.logits_from[row]))


def _schedule_decodes(p: Pass) -> DecodeBatch:
    rows, size = p.edit.rows, p.edit.cfg.block_size
    while True:
        ids, row_ids = _decode_rows(p)
        cols = rows.ints.take(row_ids, axis=1)  # every column of the decode rows in one gather
        computed, committed = _with_unresolved_drafts(p, cols)
        need = np.maximum(-(-(computed + p.query_len) // size) - cols[NUM_BLOCKS], 0)
        if int(need.sum()) <= p.edit.blocks.num_free:
            break
        preempt(p.edit, p.edit.running[-1])  # the newest running request gives its memory back
    _grow_block_tables(p, row_ids, need, cols[NUM_BLOCKS])
    p.budget -= len(ids) * p.query_len
    p.logits_budget -= len(ids) * p.query_len
    p.decode_ids = ids
    flush = flush_flags(committed, p.query_len, p.edit.cfg.ring_size)
    return DecodeBatch(row_ids, ids, cols, rows.drafts[row_ids], flush)


def _with_unresolved_drafts(p: Pass, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Computed tokens and committed ring entries of decode rows, at most: a row whose last step is not
    resolved yet (its last token a placeholder, scheduler/resolve.py) may have accepted up to K more drafts,
    which the device adds to the plan's positions. Blocks and the flush rule are sized for all K; a running
    request has computed fewer than max_len tokens."""
    k = p.edit.cfg.num_spec_tokens
    if not k:
        return cols[NUM_COMPUTED], cols[COMMITTED]
    unresolved = np.where(cols[LAST_TOKEN] < 0, k, 0)
    computed = np.minimum(cols[NUM_COMPUTED] + unresolved, np.maximum(cols[MAX_LEN] - 1, cols[NUM_COMPUTED]))
    return computed, cols[COMMITTED] + unresolved


def _grow_block_tables(p: Pass, row_ids: np.ndarray, need: np.ndarray, held: np.ndarray) -> None:
    new_blocks = p.edit.blocks.allocate(int(need.sum()))
    if not new_blocks.size:
        return
    rows, table = p.edit.rows, p.edit.rows.edit("block_table")
    if need.max() == 1:  # the usual case: at most one new block per row, vectorised
        grow = need.nonzero()[0]
        grow_rows, grow_held = row_ids[grow], held[grow]
        table.put(grow_rows * table.view.shape[1] + grow_held, new_blocks)
        rows.num_blocks[grow_rows] = grow_held + 1
        return
    offset = 0
    for row, count in zip(row_ids[need > 0].tolist(), need[need > 0].tolist(), strict=True):
        start = int(rows.num_blocks[row])
        table[row, start:start + count] = new_blocks[offset:offset + count]
        rows.num_blocks[row] = start + count
        offset += count


def _issue_materializations(p: Pass) -> None:
    """Publish decode-crossed boundary states: S0 + `count` ring entries into a fresh cache slot,
    applied before this step's layers (so before its flush changes S0)."""
    edit, asks = p.edit, p.edit.materializations
    edit.materializations = ()
    if not asks:
        return
    rows = [edit.row_of.get(m.request_id) for m in asks]
    # the slot a running request reads from now (a preempted and readmitted one has another), and its ring
    # (an ask `resolve` made a step late reads past the step in between, which may have flushed it)
    cols = edit.rows.ints[[RUNNING_SLOT, NUM_COMPUTED, COMMITTED, RING_START]][:, [row or 0 for row in rows]].tolist()
    cached, wanted = edit.slots.hash_to_slot, {}
    for m, row, slot, *trackers in zip(asks, rows, *cols, strict=True):  # best effort: skip what is cached
        if not m.released:
            m = m.against(*trackers) if row is not None and slot == m.running_slot else None
        if m is not None and m.key not in cached and m.key not in wanted:
            wanted[m.key] = m
    chosen = list(wanted.values())[:edit.slots.num_available()]
    dsts = edit.slots.allocate_many(SlotKind.PENDING, len(chosen), [m.key for m in chosen])
    p.materializes += [(m.running_slot, dst, m.ring_start, m.count) for m, dst in zip(chosen, dsts, strict=True)]
    p.ready_slots += dsts
    for m in asks:  # materialize reads them first thing in the step, before anything can write them
        if m.released:
            edit.slots.release(m.running_slot)


def _schedule_running_prefills(p: Pass) -> None:
    edit = p.edit
    # decode rows have finished their prefill: only the others need a look, one by one
    pending = (~edit.rows.prefill_done[edit.running_rows()]).nonzero()[0]
    for rid in [edit.running[i] for i in pending.tolist()]:
        row = edit.row_of.get(rid)
        if row is None or p.budget <= 0:  # preempted to make room for an older request, or no budget
            continue
        start = int(edit.rows.num_computed[row])
        n = split_chunk(_split_input(p, rid, row, start))
        if n > 0 and make_room(p, rid, row, start + n):
            emit_prefill(p, rid, row, start, n)


def _split_input(p: Pass, rid: str, row: int, start: int) -> SplitInput:
    cfg = p.edit.cfg
    budget, max_chunk = chunk_limits(p, int(p.edit.rows.logits_from[row]), start)
    return SplitInput(start=start, budget=budget, prefill_end=int(p.edit.rows.prefill_end[row]),
                      bs=cfg.mamba_block_size, max_chunk=max_chunk,
                      lookahead=cfg.num_lookahead, block_drop=cfg.eagle_block_drop,
                      checkpoint=p.producer_checkpoint(rid, row), align=cfg.align,
                      marked=bool(p.edit.rows.checkpoint[row]))
