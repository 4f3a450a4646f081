"""One schedule pass's scratch space and the steps shared by running and newly admitted prefills."""

from __future__ import annotations

from scheduler.assemble import PrefillRow
from scheduler.checkpoints import CheckpointEvent, CheckpointStatus, advance
from scheduler.lifecycle import preempt
from scheduler.slots import SlotKind
from scheduler.transaction import StateEdit


class Pass:
    """What one `schedule` call has decided so far (budget left, rows, copy lists, commitments)."""

    def __init__(self, edit: StateEdit) -> None:
        self.edit = edit
        self.budget = edit.cfg.max_num_batched_tokens
        self.logits_budget = edit.cfg.max_num_logits  # >= budget unless the config caps the logits
        self.query_len = 1 + edit.cfg.num_spec_tokens
        self.prefills: list[PrefillRow] = []
        self.hit_copies: list[tuple[int, int]] = []
        self.pair_copies: list[tuple[int, int]] = []
        self.publishes: list[tuple[int, int]] = []
        self.materializes: list[tuple[int, int, int, int]] = []
        self.ready_slots: list[int] = []
        self.checkpoint_keys: list[bytes] = []
        self.decode_ids: list[str] = []  # the running requests scheduled as decode/verify rows
        self.scheduled: set[str] = set()  # prefill rows scheduled so far

    def checkpoint_key(self, rid: str, row: int) -> bytes | None:
        c = int(self.edit.rows.checkpoint[row])
        return self.edit.hashes(rid)[c // self.edit.cfg.hash_unit - 1] if c else None

    def producer_checkpoint(self, rid: str, row: int) -> int | None:
        """The checkpoint position if `rid` is its PRODUCING owner (its chunks stop there)."""
        key = self.checkpoint_key(rid, row)
        claim = self.edit.claims.get(key) if key is not None else None
        if claim is None or claim.producer_id != rid or claim.status is not CheckpointStatus.PRODUCING:
            return None
        return int(self.edit.rows.checkpoint[row])


def chunk_limits(p: Pass, logits_from: int, start: int) -> tuple[int, int]:
    """(budget, max_chunk) of a prefill chunk from `start`: what this step and a whole step may give it.
    Every position from `logits_from` on also takes a logit, so the logits budget bounds those too."""
    free = max(logits_from - start, 0)
    cfg = p.edit.cfg
    return (min(p.budget, p.logits_budget + free),
            min(cfg.max_num_batched_tokens, cfg.max_num_logits + free))


def chunk_logits(start: int, end: int, logits_from: int) -> int:
    """Logits a prefill chunk [start, end) asks for: one per position from `logits_from` on."""
    return max(end - max(start, logits_from), 0)


def make_room(p: Pass, rid: str, row: int, end: int) -> bool:
    """Give `rid` KV blocks up to `end`, preempting the newest unscheduled running requests;
    if only `rid` itself is left to preempt, it is preempted and False is returned."""
    edit = p.edit
    need = -(-end // edit.cfg.block_size) - int(edit.rows.num_blocks[row])
    while need > edit.blocks.num_free:
        scheduled = p.scheduled.union(p.decode_ids)  # memory pressure is rare: built only here
        victims = [v for v in edit.running if v not in scheduled and v != rid]
        preempt(edit, victims[-1] if victims else rid)
        if not victims:
            return False
    append_blocks(edit, row, max(need, 0))
    return True


def append_blocks(edit: StateEdit, row: int, count: int) -> None:
    held = int(edit.rows.num_blocks[row])
    edit.rows.edit("block_table")[row, held:held + count] = edit.blocks.allocate(count)
    edit.rows.num_blocks[row] = held + count


def emit_prefill(p: Pass, rid: str, row: int, start: int, n: int) -> None:
    """Add the chunk [start, start + n) of `rid` to the plan, publishing its end state if cacheable."""
    edit, end = p.edit, start + n
    prefill_end = int(edit.rows.prefill_end[row])
    num_logits = chunk_logits(start, end, int(edit.rows.logits_from[row]))
    phase = _publish_chunk_end(p, rid, row, end) if edit.cfg.align else 2
    log = edit.logs[rid]  # a prefill reads only tokens below prefill_end, all in the log
    samples = end == prefill_end
    # at least one token: the device's prompt logprobs and MTP pass read the token after the chunk
    lookahead = log.slice(end, end if samples else min(end + max(edit.cfg.num_lookahead, 1), prefill_end))
    p.prefills.append(PrefillRow(row, rid, start, log.slice(start, end), num_logits, phase, start > 0,
                                 int(edit.rows.running_slot[row]), lookahead))
    p.budget -= n
    p.logits_budget -= num_logits
    p.scheduled.add(rid)


def _publish_chunk_end(p: Pass, rid: str, row: int, end: int) -> int:
    """Publish the running state at `end` if it is cacheable; returns the row's phase (1 = producer)."""
    edit = p.edit
    if edit.rows.checkpoint[row]:
        return _publish_checkpoint(p, rid, row, end)  # marked requests cache only their checkpoint
    if end % edit.cfg.mamba_block_size:
        return 2
    key = edit.hashes(rid)[end // edit.cfg.hash_unit - 1]
    if key in edit.slots.hash_to_slot or key in edit.claims or edit.slots.num_available() == 0:
        return 2
    _publish(p, row, edit.slots.allocate(SlotKind.PENDING, key))
    return 2


def _publish_checkpoint(p: Pass, rid: str, row: int, end: int) -> int:
    if p.producer_checkpoint(rid, row) != end:
        return 2
    key = p.checkpoint_key(rid, row)
    claim = p.edit.claims[key]
    status = advance(claim.status, CheckpointEvent.SCHEDULE_END, key)
    p.edit.claims[key] = claim._replace(status=status, producer_row=row)
    p.edit.slots.kind[claim.slot] = SlotKind.PENDING
    p.checkpoint_keys.append(key)
    _publish(p, row, claim.slot)
    return 1


def _publish(p: Pass, row: int, dst: int) -> None:
    p.publishes.append((int(p.edit.rows.running_slot[row]), dst))
    p.ready_slots.append(dst)
