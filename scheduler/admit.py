"""Admission of waiting requests: prefix hit or checkpoint role, chunk split, capacity, commit.

A request is admitted only if everything it needs this step fits at once (row, running slot, a
reserved checkpoint slot for a producer, KV blocks for its first chunk), so admission never
half-succeeds and never preempts a running request.

Waiting requests are taken first come, first served, with one exception that keeps one client from
starving the others: a request whose group (`SequenceSpec.group`, the n samples and prompts of one client
request) already holds its fair share of the rows, max_num_seqs over the groups running or waiting, waits
behind the requests of other groups; it is admitted in the same step if rows and budget are left after them.
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import NamedTuple

import numpy as np

from scheduler.checkpoints import CheckpointEvent, CheckpointStatus, Claim, advance, checkpoint_status
from scheduler.history import start_tail
from scheduler.journal import frozen
from scheduler.lifecycle import free_row, logits_from, max_len
from scheduler.pass_state import Pass, append_blocks, chunk_limits, emit_prefill
from scheduler.prefix_cache import NO_HIT, PrefixHit, cached_units, checkpoint_hit, find_hit
from scheduler.publish import publish_full_blocks
from scheduler.slots import SlotKind
from scheduler.split import SplitInput, split_chunk
from scheduler.state import (
    CHECKPOINT,
    EOS,
    LOGITS_FROM,
    MAX_LEN,
    NUM_BLOCKS,
    NUM_COMPUTED,
    NUM_PROMPT,
    NUM_TOKENS,
    PREFILL_END,
    PUBLISHED,
    RUNNING_SLOT,
)
from scheduler.transaction import StateEdit


class Verdict(enum.Enum):
    ADMITTED = "admitted"
    SKIP = "skip"  # waits for a checkpoint or a PENDING state: later requests may go first
    STOP = "stop"  # short of budget or memory: nobody behind it goes first


class Role(enum.Enum):
    NONE = "none"
    PRODUCER = "producer"
    PAIRED = "paired"  # consumer sharing this step's producer chunk (phase 2 of the same step)


class Admission(NamedTuple):
    hit: PrefixHit
    role: Role
    key: bytes | None
    pair_src: int  # producer running slot for a paired consumer


def admit_waiting(p: Pass) -> None:
    waiting = tuple(p.edit.waiting)  # a snapshot: admissions remove from the queue
    if not waiting or len(p.edit.running) >= p.edit.cfg.max_num_seqs or p.budget <= 0:
        return
    group_of = lambda rid: p.edit.requests[rid].group_id
    share, others_wait = _fair_share(p, waiting, group_of)
    held = Counter(map(group_of, p.edit.running))
    published, behind = False, []
    for rid in waiting:
        group = group_of(rid)
        if others_wait and held[group] >= share:
            behind.append(rid)  # past its share while another group waits
            continue
        verdict, published = _admit_next(p, rid, published)
        if verdict is Verdict.STOP:
            return
        held[group] += verdict is Verdict.ADMITTED
    for rid in behind:
        verdict, published = _admit_next(p, rid, published)
        if verdict is Verdict.STOP:
            return


def _fair_share(p: Pass, waiting: tuple[str, ...], group_of) -> tuple[int, bool]:
    """(the rows a group may hold while others wait: max_num_seqs over the groups running or waiting,
    whether more than one group waits). Counting stops at max_num_seqs groups (a share of one row), so a long
    queue of single requests costs a batch's worth of lookups, not the queue's."""
    cap, first = p.edit.cfg.max_num_seqs, group_of(waiting[0])
    groups, others_wait = set(map(group_of, p.edit.running)), False
    for rid in waiting:
        group = group_of(rid)
        groups.add(group)
        others_wait = others_wait or group != first
        if others_wait and len(groups) >= cap:
            break
    return max(1, cap // len(groups)), others_wait


def _admit_next(p: Pass, rid: str, published: bool) -> tuple[Verdict, bool]:
    """`rid`'s verdict, STOP once the rows or the step's budget are used up; (verdict, published)."""
    if len(p.edit.running) >= p.edit.cfg.max_num_seqs or p.budget <= 0:
        return Verdict.STOP, published
    if not published:  # a prefix lookup sees every full block, decoded ones included
        publish_full_blocks(p.edit, p.edit.running_rows(), p.edit.running)
    return _admit_one(p, rid), True


def _admit_one(p: Pass, rid: str) -> Verdict:
    if p.edit.cfg.num_spec_tokens and _unresolved(p.edit, rid):
        return Verdict.STOP  # resumes once `resolve` has placed its accepted drafts (a step later)
    plan = _plan_admission(p, rid)
    if plan is None:
        return Verdict.SKIP
    prefill_end = p.edit.num_tokens(rid)
    start = plan.hit.num_tokens
    request = p.edit.requests[rid]
    checkpoint = request.checkpoint_position if plan.role is Role.PRODUCER else None
    cfg = p.edit.cfg
    marked = cfg.align and request.checkpoint_position is not None
    budget, max_chunk = chunk_limits(p, logits_from(request, prefill_end), start)
    n = split_chunk(SplitInput(start, budget, prefill_end, cfg.mamba_block_size, max_chunk,
                               cfg.num_lookahead, cfg.eagle_block_drop, checkpoint, cfg.align, marked))
    if n == 0 or not _fits(p, plan, start + n):
        return Verdict.STOP
    row = _commit(p, rid, plan, prefill_end)
    append_blocks(p.edit, row, -(-(start + n) // p.edit.cfg.block_size) - len(plan.hit.block_ids))
    emit_prefill(p, rid, row, start, n)
    return Verdict.ADMITTED


def _unresolved(edit: StateEdit, rid: str) -> bool:
    """A request preempted while its last step was unresolved: its last token is a placeholder, and with
    drafts even its position is unknown (scheduler/resolve.py)."""
    num_tokens = edit.num_tokens(rid)
    return num_tokens > edit.requests[rid].num_prompt_tokens and edit.logs[rid].slice(num_tokens - 1, num_tokens)[0] < 0


def _plan_admission(p: Pass, rid: str) -> Admission | None:
    """Hit and checkpoint role of `rid`, or None if it must wait this step."""
    edit = p.edit
    if not edit.cfg.align:
        return Admission(NO_HIT, Role.NONE, None, 0)
    unit, c = edit.cfg.hash_unit, edit.requests[rid].checkpoint_position
    if c is not None and _waits_for_producer(edit, rid, c // unit):
        return None  # consumer waits for READY without blocking anyone else
    hashes = edit.hashes(rid)
    # a hit stops at the first position that asks for a logit, keeping at least one token to compute
    num_cached = cached_units(edit.blocks, hashes, logits_from(edit.requests[rid], edit.num_tokens(rid)) + 1, unit)
    hit = find_hit(edit.blocks, edit.slots, hashes, num_cached, unit, edit.cfg.eagle_block_drop)
    if hit.deferred and hit.num_tokens == c:  # the state being written is our checkpoint: pair with it
        return _checkpoint_role(p, hashes, c, NO_HIT, num_cached)
    if hit.deferred:
        return None  # same-step deferral: the longer state is written by this very step
    if c is None or hit.num_tokens >= c:
        return Admission(hit, Role.NONE, None, 0)
    return _checkpoint_role(p, hashes, c, hit, num_cached)


def _waits_for_producer(edit: StateEdit, rid: str, units: int) -> bool:
    """The checkpoint after `units` hash units is PRODUCING and no cached KV prefix of `rid` reaches
    past it, so no hit can reach it (its own state is RESERVED): exactly the consumers `_checkpoint_role`
    makes wait, found with a few lookups instead of a prefix search. A long queue of consumers is looked
    at every step while its producer prefills."""
    hashes = edit.logs[rid].hashes  # may run past the request's tokens: bounded below
    claim = edit.claims.get(hashes[units - 1])
    return (claim is not None and claim.status is CheckpointStatus.PRODUCING
            and (edit.num_tokens(rid) // edit.cfg.hash_unit <= units or hashes[units] not in edit.blocks.hash_to_block))


def _checkpoint_role(p: Pass, hashes: list[int], c: int, hit: PrefixHit, num_cached: int) -> Admission | None:
    edit, key = p.edit, hashes[c // p.edit.cfg.hash_unit - 1]
    status = checkpoint_status(edit.claims, edit.slots.ready_slot(key), key)
    if status is CheckpointStatus.PRODUCING:
        return None  # consumer waits for READY without blocking anyone else
    if status is CheckpointStatus.ABSENT and key in edit.slots.hash_to_slot:
        return None  # an unmarked request or a materialization writes this very state in this step
    if status is CheckpointStatus.UNREADY:
        return _pair(p, key, c)
    if status is CheckpointStatus.READY:
        ready = checkpoint_hit(edit.blocks, edit.slots, hashes, c, edit.cfg.hash_unit, num_cached)
        return Admission(ready if ready.num_tokens else hit, Role.NONE, None, 0)
    return Admission(hit, Role.PRODUCER, key, 0)


def _pair(p: Pass, key: bytes, c: int) -> Admission:
    """Share the producer's KV blocks for [0, c) and its state after phase 1 of this step."""
    rows, producer_row = p.edit.rows, p.edit.claims[key].producer_row
    block_ids = frozen(rows.block_table[producer_row, :c // p.edit.cfg.block_size].copy())
    hit = PrefixHit(c, block_ids, 0, False)
    return Admission(hit, Role.PAIRED, key, int(rows.running_slot[producer_row]))


def _fits(p: Pass, plan: Admission, end: int) -> bool:
    edit = p.edit
    slots_needed = 1 + (plan.role is Role.PRODUCER) + (plan.hit.slot != 0 and plan.hit.slot not in edit.slots.pinned)
    if edit.slots.num_available() < slots_needed:
        return False
    new_blocks = -(-end // edit.cfg.block_size) - len(plan.hit.block_ids)
    return edit.blocks.num_free_after_taking(plan.hit.block_ids) >= new_blocks


def _commit(p: Pass, rid: str, plan: Admission, prefill_end: int) -> int:
    edit = p.edit
    if plan.hit.slot:
        edit.slots.pin(plan.hit.slot, edit.step)  # pinned before any allocation can evict it
    slot = edit.slots.allocate(SlotKind.RUNNING)
    row = _claim_row(p, rid, plan.hit, prefill_end, slot)
    edit.blocks.take(plan.hit.block_ids)
    edit.rows.edit("block_table")[row, :len(plan.hit.block_ids)] = plan.hit.block_ids
    if plan.hit.slot:
        p.hit_copies.append((plan.hit.slot, slot))  # copy on use: the cached slot is only read
    if plan.role is Role.PAIRED:
        p.pair_copies.append((plan.pair_src, slot))
    if plan.role is Role.PRODUCER:
        status = advance(CheckpointStatus.ABSENT, CheckpointEvent.CLAIM, plan.key)
        edit.claims[plan.key] = Claim(status, rid, edit.slots.allocate(SlotKind.RESERVED, plan.key))
    return row


_ADMISSION_COLUMNS = [NUM_COMPUTED, NUM_BLOCKS, PUBLISHED, NUM_TOKENS, PREFILL_END, NUM_PROMPT, MAX_LEN,
                      CHECKPOINT, EOS, RUNNING_SLOT, LOGITS_FROM]


def _claim_row(p: Pass, rid: str, hit: PrefixHit, prefill_end: int, slot: int) -> int:
    edit, request, cfg = p.edit, p.edit.requests[rid], p.edit.cfg
    params, num_prompt = request.stop_params, request.num_prompt_tokens
    row, rows = free_row(edit), edit.rows
    eos = -1 if params.stopping_eos is None else params.stopping_eos
    checkpoint = (request.checkpoint_position or 0) if cfg.align else 0
    rows.ints[_ADMISSION_COLUMNS, row] = (hit.num_tokens, len(hit.block_ids), len(hit.block_ids), prefill_end,
                                          prefill_end, num_prompt, max_len(cfg, request), checkpoint, eos, slot,
                                          logits_from(request, prefill_end))
    rows.data[row] = np.frombuffer(request.row_data, np.uint8)
    rows.active[row] = True
    rows.has_stop[row] = bool(params.stop_token_ids)
    start_tail(edit.logs[rid], rows, row, prefill_end, cfg.log_unit)
    edit.row_of[rid] = row
    edit.writable_waiting().remove(rid)
    edit.running.append(rid)
    edit.parked.pop(rid)
    return row
