"""A fake device that executes BatchPlans on tagged state slots, to check the scheduler without a GPU.

Every slot holds a tag instead of a tensor: the token count its checkpoint state S0 represents, a
fingerprint of exactly those tokens (a hash chain, so a state computed over different tokens gets a
different tag), and a ReplaySSM ring of token entries. The device follows the plan's operation
order (materialize, hit copies, phase 1, pair copies, phase 2, publishes) and checks that every
state it reads is the state after exactly `context_len` tokens of that request. In particular every
cache hit is checked against I1, and every hit copy must read a READY (CACHED) slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.plan import BatchPlan, RowKind, StepResult
from scheduler.slots import SlotKind
from scheduler.state import SchedulerState

FP_ROOT = 17


def fold(tag: tuple[int, int], tokens) -> tuple[int, int]:
    count, fp = tag
    for token in tokens:
        count, fp = count + 1, hash((fp, -1 if token is None else int(token)))  # None: never written
    return count, fp


@dataclass
class SlotTag:
    s0: tuple[int, int] = (0, FP_ROOT)
    ring: dict[int, int] = field(default_factory=dict)  # physical ring index -> token

    def copy(self) -> SlotTag:
        return SlotTag(self.s0, dict(self.ring))


def device_plan(plan: BatchPlan, previous: StepResult | None) -> BatchPlan:
    """The plan as the device runs it one step ahead (what the runner's jitted step does first, resolve.py):
    placeholder P(r, 0) is the last token row r of the step before emitted, P(r, j) its draft j, and a
    verify row that starts with P(r, 0) moves on by the drafts row r accepted. `previous`: that step's result."""
    if previous is None or (plan.token_ids >= 0).all():
        return plan
    width = previous.sampled_token_ids.shape[1]
    rows = np.arange(len(previous.num_accepted))
    carried = np.concatenate([previous.sampled_token_ids[rows, previous.num_accepted][:, None],
                              previous.draft_token_ids], axis=1).reshape(-1)
    real = lambda tokens: np.where(tokens < 0, carried[np.maximum(-1 - tokens, 0)], tokens)
    first = plan.token_ids[np.minimum(plan.cu_seqlens[:-1], plan.token_bucket - 1)]
    moved = (plan.row_kind == RowKind.VERIFY) & (first < 0)
    shift = np.where(moved, previous.num_accepted[np.where(moved, (-1 - first) // width, 0)], 0).astype(np.int32)
    return plan._replace(token_ids=real(plan.token_ids), draft_token_ids=real(plan.draft_token_ids),
                         context_lens=plan.context_lens + shift, ring_committed=plan.ring_committed + shift)


class FakeDevice:
    """Executes plans on slot tags; `errors` collects every wrong-state read."""

    def __init__(self, num_slots: int, ring_rows: int) -> None:
        self.slots = [SlotTag() for _ in range(num_slots)]
        self.ring_rows = ring_rows
        self.errors: list[str] = []
        self.hits_checked = 0
        self._fps: dict[str, list[tuple[int, int]]] = {}

    def expected(self, state: SchedulerState, rid: str, count: int) -> tuple[int, int]:
        """Tag of the state after the first `count` committed tokens of `rid`."""
        fps = self._fps.setdefault(rid, [(0, FP_ROOT)])
        if len(fps) <= count:
            tokens = state.token_ids(rid)
            for token in tokens[len(fps) - 1:count]:
                fps.append(fold(fps[-1], [token]))
        return fps[count]

    def forget(self, rid: str) -> None:
        self._fps.pop(rid, None)

    def run(self, state: SchedulerState, plan: BatchPlan) -> None:
        self._materialize(plan)
        self._hit_copies(state, plan)
        rows = range(plan.num_rows)
        for r in (r for r in rows if plan.phase[r] == 1):
            self._row(state, plan, r)
        for i in range(plan.num_pair_copies):
            self.slots[plan.pair_copy_dst[i]] = self.slots[plan.pair_copy_src[i]].copy()
        for r in (r for r in rows if plan.phase[r] == 2):
            self._row(state, plan, r)
        for i in range(plan.num_publishes):
            self.slots[plan.publish_dst[i]] = SlotTag(self.slots[plan.publish_src[i]].s0)

    def _materialize(self, plan: BatchPlan) -> None:
        for i in range(plan.num_materializations):
            src = self.slots[plan.materialize_src[i]]
            start, count = int(plan.materialize_ring_start[i]), int(plan.materialize_count[i])
            entries = [src.ring.get((start + j) % self.ring_rows) for j in range(count)]
            self.slots[plan.materialize_dst[i]] = SlotTag(fold(src.s0, entries))

    def _hit_copies(self, state: SchedulerState, plan: BatchPlan) -> None:
        owner = {int(plan.state_slots[r]): r for r in range(plan.num_rows)}
        for i in range(plan.num_hit_copies):
            src, dst = int(plan.hit_copy_src[i]), int(plan.hit_copy_dst[i])
            if state.slots.kind[src] != SlotKind.CACHED:
                self.errors.append(f"step {plan.step_id}: hit copy reads slot {src} that is not READY")
            r = owner[dst]
            want = self.expected(state, plan.request_ids[r], int(plan.context_lens[r]))
            self.hits_checked += 1
            if self.slots[src].s0 != want or self.slots[src].ring:
                self.errors.append(f"step {plan.step_id}: I1 violated: {plan.request_ids[r]!r} hit at "
                                   f"{plan.context_lens[r]} but the slot holds state@{self.slots[src].s0[0]}")
            self.slots[dst] = self.slots[src].copy()

    def _row(self, state: SchedulerState, plan: BatchPlan, r: int) -> None:
        slot, context = self.slots[int(plan.state_slots[r])], int(plan.context_lens[r])
        lo, hi = int(plan.cu_seqlens[r]), int(plan.cu_seqlens[r + 1])
        tokens = plan.token_ids[lo:hi].tolist()
        if plan.row_kind[r] == RowKind.PREFILL:
            live = slot.s0 if plan.has_initial_state[r] else (0, FP_ROOT)
            self._check(state, plan, r, live, context)
            slot.s0, slot.ring = fold(live, tokens), {}
            return
        start, committed = int(plan.ring_start[r]), int(plan.ring_committed[r])
        if plan.flush[r]:
            slot.s0 = fold(slot.s0, self._entries(slot, start, committed))
            start, committed = (start + committed) % self.ring_rows, 0
        self._check(state, plan, r, fold(slot.s0, self._entries(slot, start, committed)), context)
        for t, token in enumerate(tokens):
            slot.ring[(start + committed + t) % self.ring_rows] = token

    def _entries(self, slot: SlotTag, start: int, count: int) -> list[int | None]:
        return [slot.ring.get((start + j) % self.ring_rows) for j in range(count)]

    def _check(self, state, plan, r, live, context) -> None:
        if plan.request_ids[r] in state.aborting:
            return  # ended while the host ran ahead (resolve.py): the row's outputs are dropped
        want = self.expected(state, plan.request_ids[r], context)
        if live != want:
            self.errors.append(f"step {plan.step_id}: row {plan.request_ids[r]!r} reads state@{live[0]} "
                               f"(fingerprint {'ok' if live[1] == want[1] else 'wrong'}) at context {context}")
