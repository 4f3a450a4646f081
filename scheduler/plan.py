"""BatchPlan (what one device step computes) and StepResult (what the device step returns).

Conventions used everywhere:
  * Shapes use T = token bucket, R = row bucket, B = block-table bucket (>= the most KV blocks of any
    row in the step), L = logits bucket, K = num_spec_tokens, Lw = max(num_lookahead, 1), D =
    row_data_bytes; T, R, B and L are the static shape of the step (the config's ladders). Rows [0, num_rows) are real;
    tokens [0, num_tokens) are real and packed row after row in `cu_seqlens` order. Everything past
    them is padding.
  * Padding rows have kind PADDING, zero lengths, state slot 0 (the null slot, all zeros and never
    written) and block table rows of block 0 (the null block). Padding tokens have id 0, position
    0 and KV write slot 0 (inside the null block). Padding copy entries are 0 -> 0 with count 0.
  * A verify row holds `1 + K` tokens: the last sampled token, then the K drafts, and asks for
    logits at all of them. `StepResult.num_accepted[r]` counts accepted DRAFTS only (0..K), never
    the bonus token: the row emits `sampled_token_ids[r, :num_accepted[r] + 1]`, where the first
    `num_accepted[r]` equal the drafts and the last one is the bonus/correction token.
  * Order of state operations inside the step (the scheduler relies on it):
      1. materialize (reads running slots' S0 + ring, writes cache slots),
      2. hit copies (cache slot -> running slot, whole page),
      3. layers; in each recurrent layer phase 1 rows run first, then the pair copies (producer
         running slot -> consumer running slot, that layer's state only), then phase 2 rows;
         attention layers write all new K/V before reading any (paired consumers read the
         producer's prefix K/V written in the same step),
      4. publishes (running slot -> cache slot, whole page, after all layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class RowKind:
    """Plain ints, like `slots.SlotKind`: numpy compares an IntEnum member ~10x slower."""

    PADDING = 0
    PREFILL = 1  # a chunk of known tokens; samples (1 logit) only when it ends the prefill
    DECODE = 2   # K == 0: one token, one logit
    VERIFY = 3   # K > 0: last sampled token + K drafts, 1 + K logits


class BatchPlan(NamedTuple):
    """One device step. All arrays are read-only numpy; see the module docstring for conventions.
    (A NamedTuple, not a frozen dataclass: it is built every step, and this builds in one C call.)"""

    step_id: int
    num_rows: int
    num_tokens: int
    request_ids: tuple[str, ...]          # host only: request of each real row
    row_ids: np.ndarray                   # host only: [num_rows] int64 row-table row of each real row
    # rows
    row_kind: np.ndarray                  # [R] int8 RowKind; padding 0
    phase: np.ndarray                     # [R] int8: 1 = checkpoint producer ending at its checkpoint, 2 = rest
    cu_seqlens: np.ndarray                # [R+1] int32 token offsets; padding rows repeat num_tokens
    query_lens: np.ndarray                # [R] int32 tokens of the row in this step; padding 0
    context_lens: np.ndarray              # [R] int32 tokens already in KV/state before this step; padding 0
    state_slots: np.ndarray               # [R] int32 running state slot; padding 0 (null)
    has_initial_state: np.ndarray         # [R] bool False: start from the zero state; padding False
    block_table: np.ndarray               # [R, B] int32 KV blocks of the row (position p in block p // block_size);
                                          # padding rows 0; entries past a row's last block are not meaningful
    # tokens
    token_ids: np.ndarray                 # [T] int32; padding 0
    positions: np.ndarray                 # [T] int32 absolute position; padding 0
    slot_mapping: np.ndarray              # [T] int32 KV write slot block * block_size + offset; padding 0
    # sampling and drafts
    draft_token_ids: np.ndarray           # [R, K] int32 drafts being verified (also in token_ids); padding 0
    num_logits: np.ndarray                # [R] int32 logits at the row's last tokens: 0 (non-final prefill chunk),
                                          # 1 (final chunk / decode), 1+K (verify), more (prompt logprobs)
    cu_logits: np.ndarray                 # [R+1] int32: row r's logits are entries cu_logits[r]..cu_logits[r+1]
    logits_indices: np.ndarray            # [L] int32 packed token index of each logit; unused 0. A sampling
                                          # row samples from its last logit(s): the last 1 (+K) of its entries
    row_data: np.ndarray                  # [R, D] uint8 each row's opaque SequenceSpec.row_data; padding 0
    lookahead_token_ids: np.ndarray       # [R, Lw] int32 the next known tokens after a prefill chunk; padding 0
    num_lookahead_tokens: np.ndarray      # [R] int32 valid entries of lookahead_token_ids
    # ReplaySSM trackers of verify/decode rows (prefill rows: 0, 0, False -> they reset the ring)
    ring_start: np.ndarray                # [R] int32 ring index of the first committed entry
    ring_committed: np.ndarray            # [R] int32 committed ring entries after S0
    flush: np.ndarray                     # [R] bool fold the committed entries into S0 first
    # state-slot copies (each list padded with 0 -> 0)
    hit_copy_src: np.ndarray              # [R] int32 cached slot of a prefix hit ...
    hit_copy_dst: np.ndarray              # [R] int32 ... copied into the running slot before the layers
    pair_copy_src: np.ndarray             # [R] int32 producer running slot (state at its checkpoint) ...
    pair_copy_dst: np.ndarray             # [R] int32 ... copied into a paired consumer between phases
    publish_src: np.ndarray               # [R] int32 running slot whose chunk ended on a cacheable position ...
    publish_dst: np.ndarray               # [R] int32 ... copied into a fresh cache slot after the layers
    materialize_src: np.ndarray           # [R] int32 running slot whose accepted tokens crossed a boundary
    materialize_dst: np.ndarray           # [R] int32 cache slot receiving S0 advanced by `count` entries
    materialize_ring_start: np.ndarray    # [R] int32 ring index of the first entry to fold
    materialize_count: np.ndarray         # [R] int32 entries to fold (0 = exact copy of S0)
    num_hit_copies: int
    num_pair_copies: int
    num_publishes: int
    num_materializations: int

    @property
    def token_bucket(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def row_bucket(self) -> int:
        return int(self.row_kind.shape[0])

    @property
    def logits_bucket(self) -> int:
        return int(self.logits_indices.shape[0])

    @property
    def block_table_bucket(self) -> int:
        return int(self.block_table.shape[1])


@dataclass(frozen=True, slots=True, eq=False)
class StepResult:
    """What the runner returns for a plan (rows as in the plan; non-sampling rows are ignored).

    sampled_token_ids: [R, 1+K] int32 emitted tokens, see the module docstring.
    num_accepted: [R] int32 accepted drafts (0..K, bonus not counted); 0 for prefill/decode rows.
    draft_token_ids: [R, K] int32 the MTP module's drafts for the row's next verify step.
    """

    sampled_token_ids: np.ndarray
    num_accepted: np.ndarray
    draft_token_ids: np.ndarray


def check_result_rows(result: StepResult, rows: int, num_spec_tokens: int) -> None:
    """Raise ValueError unless `result` has `rows` rows of 1 + K tokens, K drafts and num_accepted in [0, K]."""
    if result.sampled_token_ids.shape[0] < rows or result.sampled_token_ids.shape[1] != 1 + num_spec_tokens:
        raise ValueError(f"sampled_token_ids shape {result.sampled_token_ids.shape} does not fit "
                         f"{rows} rows x {1 + num_spec_tokens}")
    accepted = result.num_accepted[:rows]
    if accepted.shape[0] < rows or rows and (accepted.min() < 0 or accepted.max() > num_spec_tokens):
        raise ValueError(f"num_accepted must be in [0, {num_spec_tokens}] for {rows} rows")
    if result.draft_token_ids.shape[0] < rows or result.draft_token_ids.shape[1] != num_spec_tokens:
        raise ValueError(f"draft_token_ids shape {result.draft_token_ids.shape} does not fit K={num_spec_tokens}")


def check_step_result(plan: BatchPlan, result: StepResult, num_spec_tokens: int) -> None:
    """Raise ValueError if `result` cannot belong to `plan`."""
    rows = plan.num_rows
    check_result_rows(result, rows, num_spec_tokens)
    accepted = result.num_accepted[:rows]
    echoed = np.arange(num_spec_tokens, dtype=accepted.dtype) < accepted[:, None]
    mismatch = echoed & (result.sampled_token_ids[:rows, :num_spec_tokens] != plan.draft_token_ids[:rows])
    if mismatch.any():
        raise ValueError(f"rows {np.flatnonzero(mismatch.any(axis=1)).tolist()}: accepted drafts must be echoed "
                         "in sampled_token_ids")
