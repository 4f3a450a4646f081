"""The step's buckets: every (T, R, B, L) shape a plan of a config can have, and an all-padding plan of each
(what `Runner.precompile` runs and `Runner.trace` lowers)."""

from __future__ import annotations

import numpy as np

from scheduler import BatchPlan, SchedulerConfig
from scheduler.buckets import bucket_shapes


def plan_shapes(config: SchedulerConfig) -> list[tuple[int, int, int, int]]:
    """Every (T, R, B, L) bucket a plan can have: `scheduler.buckets.bucket_shapes` with each block-table width."""
    return [(tokens, rows, width, logits) for tokens, rows, logits in bucket_shapes(config)
            for width in config.block_table_buckets]


def padding_plan(config: SchedulerConfig, tokens: int, rows: int, blocks: int, logits: int) -> BatchPlan:
    """A plan of these buckets with padding rows only (null slot, null block, no copies)."""
    ints = lambda *shape: np.zeros(shape, np.int32)
    flags = lambda dtype: np.zeros(rows, dtype)
    copies = ("hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst", "publish_src", "publish_dst",
              "materialize_src", "materialize_dst", "materialize_ring_start", "materialize_count")
    return BatchPlan(
        step_id=0, num_rows=0, num_tokens=0, request_ids=(), row_ids=np.zeros(0, np.int64), row_kind=flags(np.int8),
        phase=flags(np.int8), cu_seqlens=ints(rows + 1), query_lens=ints(rows), context_lens=ints(rows),
        state_slots=ints(rows), has_initial_state=flags(bool), block_table=ints(rows, blocks),
        token_ids=ints(tokens), positions=ints(tokens), slot_mapping=ints(tokens),
        draft_token_ids=ints(rows, config.num_spec_tokens), num_logits=ints(rows), cu_logits=ints(rows + 1),
        logits_indices=ints(logits), row_data=np.zeros((rows, config.row_data_bytes), np.uint8),
        lookahead_token_ids=ints(rows, max(config.num_lookahead, 1)), num_lookahead_tokens=ints(rows),
        ring_start=ints(rows), ring_committed=ints(rows), flush=flags(bool), **{name: ints(rows) for name in copies},
        num_hit_copies=0, num_pair_copies=0, num_publishes=0, num_materializations=0)
