"""The engine's running totals and its load, as the server's metrics read them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import scheduler
from jaxhybrid.engine.requests import Request, RequestTable
from scheduler import BatchPlan, RowKind
from scheduler.checkpoints import CheckpointStatus


@dataclass
class EngineStats:
    """Running totals since start."""

    steps: int = 0
    prefill_tokens: int = 0      # prompt tokens computed (prefix hits excluded, recomputation included)
    prefix_cache_requests: int = 0  # requests scheduled for the first time
    prefix_cache_queries: int = 0  # ... their prompt tokens
    cached_tokens: int = 0       # ... of them served from the prefix cache or a checkpoint (the hits)
    checkpoint_queries: int = 0  # requests with a checkpoint marker scheduled for the first time
    checkpoint_hits: int = 0     # ... of them that started at or beyond their checkpoint
    generation_tokens: int = 0
    hit_copies: int = 0          # prefix-cache and checkpoint hits (state pages copied in)
    pair_copies: int = 0         # consumers paired with their producer in one step
    publishes: int = 0
    materializations: int = 0
    draft_tokens: int = 0        # MTP drafts verified
    accepted_tokens: int = 0     # ... and accepted
    failed_steps: int = 0        # steps that raised (the engine started over)
    # each recent step's computed tokens (prompt + generated), for the server's per-step histogram to drain
    step_tokens: deque[int] = field(default_factory=lambda: deque(maxlen=4096))

    def count_step(self, plan: BatchPlan, result: scheduler.StepResult, outputs: scheduler.StepOutputs,
                   num_spec_tokens: int) -> None:
        rows = plan.num_rows
        prefill = plan.row_kind[:rows] == RowKind.PREFILL
        verify = plan.row_kind[:rows] == RowKind.VERIFY
        self.steps += 1
        prefill_tokens, generated = int(plan.query_lens[:rows][prefill].sum()), int(outputs.num_new_tokens.sum())
        self.prefill_tokens += prefill_tokens
        self.generation_tokens += generated
        self.step_tokens.append(prefill_tokens + generated)
        self.hit_copies += plan.num_hit_copies
        self.pair_copies += plan.num_pair_copies
        self.publishes += plan.num_publishes
        self.materializations += plan.num_materializations
        self.draft_tokens += int(verify.sum()) * num_spec_tokens
        self.accepted_tokens += int(result.num_accepted[:rows][verify].sum())

    def count_cache_query(self, request: Request) -> None:
        """A request's first schedule: its prompt against what the prefix cache and its checkpoint served."""
        checkpoint = request.readable_checkpoint()
        self.prefix_cache_requests += 1
        self.prefix_cache_queries += len(request.prompt.token_ids)
        self.cached_tokens += request.num_cached_tokens
        if checkpoint:
            self.checkpoint_queries += 1
            self.checkpoint_hits += request.num_cached_tokens >= checkpoint


class EngineLoad(NamedTuple):
    """What the engine holds now; sequences count once per completion (n > 1 counts n)."""

    running: int
    waiting: int
    kv_cache_usage: float    # KV blocks held by requests, of all (blocks only the prefix cache holds are free)
    state_slot_usage: float  # state slots held by requests, the same way
    num_preemptions: int
    deferred: int = 0        # ... of the waiting: consumers held back while their checkpoint is produced


def num_deferred(state: scheduler.SchedulerState) -> int:
    """Waiting sequences that admission skips until their checkpoint's producer has computed it (vLLM's
    "deferred" waiting requests); the rest wait for capacity. The scheduler's own test (`admit._waits_for_producer`):
    the checkpoint is PRODUCING and no cached KV prefix of the sequence reaches past it. Free while no checkpoint
    is being produced; otherwise a few lookups per waiting sequence, as admission itself does each step."""
    producing = {key for key, claim in state.claims.items() if claim.status is CheckpointStatus.PRODUCING}
    if not producing:
        return 0
    unit, cached = state.config.hash_unit, state.blocks.hash_to_block
    count = 0
    for rid in state.waiting:
        checkpoint = state.requests[rid].checkpoint_position
        if checkpoint is None:
            continue
        hashes, units = state.logs[rid].hashes, checkpoint // unit
        count += hashes[units - 1] in producing and (state.num_tokens(rid) // unit <= units
                                                      or hashes[units] not in cached)
    return count


def count_preemptions(running_before: tuple[str, ...], state: scheduler.SchedulerState, num_before: int,
                      table: RequestTable) -> None:
    """After a `schedule` that preempted: one more preemption on each preempted sequence's request
    (`RequestMetrics.num_preemptions`). A schedule keeps the running sequences it did not preempt in their
    order, at the front, and appends the ones it admits; it preempts a sequence at most once (admission, its last
    phase, never preempts). So the first len(running_before) - preempted of `state.running` are the survivors, and
    a sequence preempted and readmitted in the same pass counts too."""
    num_preempted = state.num_preemptions - num_before
    survivors = set(state.running[:len(running_before) - num_preempted])
    for sequence_id in running_before:
        sequence = table.sequences.get(sequence_id)
        if sequence_id not in survivors and sequence is not None:
            sequence.request.metrics.num_preemptions += 1
