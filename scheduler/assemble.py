"""Turn one pass's decisions (a vectorised decode batch, prefill rows, copy lists) into a BatchPlan.

Runs every step, so it is written for few numpy calls: decode rows (all 1 + K tokens) are packed
through [n, 1 + K] views of the output arrays, straight from the one column gather `schedule` made;
prefill rows (a few per step) are collected in Python and packed with np.repeat. The [R] int32
fields share one buffer, the [T] ones another, and each buffer is frozen once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from scheduler.buckets import pick_bucket, step_buckets
from scheduler.config import SchedulerConfig
from scheduler.journal import frozen
from scheduler.plan import BatchPlan, RowKind
from scheduler.state import COMMITTED, LAST_TOKEN, NUM_COMPUTED, RING_START, RUNNING_SLOT


class DecodeBatch(NamedTuple):
    """Running decode/verify rows, all with 1 + K tokens."""

    rows: np.ndarray           # [n] row ids into the state's row table
    request_ids: list[str]
    cols: np.ndarray           # [C, n] int32 the rows' columns (state.INT_COLUMNS) before this step
    drafts: np.ndarray         # [n, K] int32 the drafts to verify
    flush: np.ndarray          # [n] bool


class PrefillRow(NamedTuple):
    row: int
    request_id: str
    start: int
    token_ids: np.ndarray      # [n] int32
    num_logits: int            # logits at the chunk's last tokens: 1 if it ends the prefill, more for prompt logprobs
    phase: int
    has_initial_state: bool
    state_slot: int
    lookahead: np.ndarray      # [<= L] int32 the known tokens after the chunk


class Copies(NamedTuple):
    hit: list[tuple[int, int]]
    pair: list[tuple[int, int]]
    publish: list[tuple[int, int]]
    materialize: list[tuple[int, int, int, int]]   # (src, dst, ring_start, count)


# the [R] int32 fields, in buffer order: decode rows fill 0-1 with 1 + K and 2-5 from their columns
_ROW_FIELDS = ("query_lens", "num_logits", "context_lens", "state_slots", "ring_start", "ring_committed",
               "num_lookahead_tokens")
_FROM_COLUMNS = np.array([NUM_COMPUTED, RUNNING_SLOT, RING_START, COMMITTED])
_COPY_FIELDS = ("hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst", "publish_src", "publish_dst",
                "materialize_src", "materialize_dst", "materialize_ring_start", "materialize_count")


def assemble(cfg: SchedulerConfig, step_id: int, decode: DecodeBatch, prefills: list[PrefillRow],
             copies: Copies, block_table: np.ndarray, num_blocks: np.ndarray, row_data: np.ndarray) -> BatchPlan:
    """Build the padded plan; decode rows come first, then the checkpoint producers of phase 1, then the
    other prefill rows, each group in scheduling order (the device runs each group as one contiguous
    call). `block_table` / `num_blocks` / `row_data` are the state's, block tables already grown for this step."""
    prefills = sorted(prefills, key=lambda p: p.phase)  # stable
    n, q = len(decode.rows), 1 + cfg.num_spec_tokens
    row_ids = np.concatenate([decode.rows, [p.row for p in prefills]]).astype(np.int64)  # owned, not a view
    num_tokens = n * q + sum(len(p.token_ids) for p in prefills)
    num_logits = n * q + sum(p.num_logits for p in prefills)
    tokens_b, rows_b, logits_b = step_buckets(cfg, num_tokens, max(len(row_ids), *map(len, copies)), num_logits)
    ints = np.zeros((len(_ROW_FIELDS) + len(_COPY_FIELDS), rows_b), np.int32)
    ints[:2, :n] = q
    ints[2:6, :n] = decode.cols[_FROM_COLUMNS]
    if prefills:
        ints[[0, 1, 2, 3, 6], n:len(row_ids)] = np.array(
            [(len(p.token_ids), p.num_logits, p.start, p.state_slot, len(p.lookahead)) for p in prefills]).T
    _fill_copies(ints[len(_ROW_FIELDS):], copies)
    cu_seqlens = np.zeros(rows_b + 1, np.int32)
    ints[0].cumsum(out=cu_seqlens[1:])
    tokens = _token_fields(cfg, decode, prefills, row_ids, cu_seqlens, block_table, num_tokens, tokens_b)
    table = _block_table(cfg, row_ids, block_table, num_blocks, rows_b)
    fields = dict(zip(_ROW_FIELDS + _COPY_FIELDS, frozen(ints), strict=True))  # views of a frozen buffer
    data = np.zeros((rows_b, row_data.shape[1]), np.uint8)
    data[:len(row_ids)] = row_data[row_ids]
    return BatchPlan(step_id=step_id, num_rows=len(row_ids), num_tokens=num_tokens,
                     request_ids=tuple(decode.request_ids) + tuple(p.request_id for p in prefills),
                     row_ids=frozen(row_ids), cu_seqlens=frozen(cu_seqlens), block_table=frozen(table),
                     row_data=frozen(data), **_row_flags(cfg, decode, prefills, rows_b), **tokens,
                     **_logits_fields(ints[1], cu_seqlens, logits_b), **_draft_fields(cfg, decode, prefills, rows_b),
                     **fields,
                     **{f"num_{name}": len(c) for name, c in zip(
                         ("hit_copies", "pair_copies", "publishes", "materializations"), copies, strict=True)})


def _block_table(cfg: SchedulerConfig, row_ids: np.ndarray, block_table: np.ndarray, num_blocks: np.ndarray,
                 rows_b: int) -> np.ndarray:
    n = len(row_ids)
    first = int(row_ids[0]) if n else 0
    # rows admitted in order and never reshuffled (a steady decode batch) are one slice: a memcpy
    # instead of an element-wise gather of up to R x max_blocks entries
    in_order = n and int(row_ids[-1]) == first + n - 1 and bool((row_ids[1:] > row_ids[:-1]).all())
    rows = slice(first, first + n) if in_order else row_ids
    width = pick_bucket(cfg.block_table_buckets, int(num_blocks[rows].max(initial=0)))
    table = np.empty((rows_b, width), np.int32)
    table[:n] = block_table[rows, :width]
    table[n:] = 0  # padding rows: the null block everywhere
    return table


def _row_flags(cfg: SchedulerConfig, decode: DecodeBatch, prefills: list[PrefillRow], rows_b: int) -> dict:
    n, end = len(decode.rows), len(decode.rows) + len(prefills)
    flags = np.zeros((4, rows_b), np.int8)  # one buffer: row_kind, phase, has_initial_state, flush
    kinds, phase, has_initial_state, flush = flags
    kinds[:n] = RowKind.VERIFY if cfg.num_spec_tokens else RowKind.DECODE
    phase[:] = 2  # decode, padding and ordinary prefill rows run in phase 2
    has_initial_state[:n] = decode.cols[NUM_COMPUTED] > 0
    flush[:n] = decode.flush
    if prefills:
        kinds[n:end] = RowKind.PREFILL
        phase[n:end] = [p.phase for p in prefills]
        has_initial_state[n:end] = [p.has_initial_state for p in prefills]
    kinds, phase, has_initial_state, flush = frozen(flags)  # views taken after freezing are read-only
    return dict(row_kind=kinds, phase=phase, has_initial_state=has_initial_state.view(bool), flush=flush.view(bool))


def _fill_copies(fields: np.ndarray, copies: Copies) -> None:
    """fields: the [10, R] copy-list rows of the int buffer, in _COPY_FIELDS order."""
    for index, pairs in enumerate(copies):
        if pairs:
            first = 2 * index
            fields[first:first + len(pairs[0]), :len(pairs)] = np.array(pairs).T


def _token_fields(cfg: SchedulerConfig, decode: DecodeBatch, prefills: list[PrefillRow], row_ids: np.ndarray,
                  cu_seqlens: np.ndarray, block_table: np.ndarray, num_tokens: int, bucket: int) -> dict:
    n, q, size = len(decode.rows), 1 + cfg.num_spec_tokens, cfg.block_size
    buffer = np.zeros((3, bucket), np.int32)
    token_ids, positions, slot_mapping = buffer[:, :n * q].reshape(3, n, q)  # the decode rows' tokens
    token_ids[:, 0] = decode.cols[LAST_TOKEN]
    token_ids[:, 1:] = decode.drafts
    np.add(decode.cols[NUM_COMPUTED][:, None], np.arange(q, dtype=np.int32), out=positions)
    slot_mapping[:] = _kv_write_slots(block_table, decode.rows[:, None], positions, size)
    if prefills:
        rows, starts = row_ids[n:], cu_seqlens[n:len(row_ids)]
        lens = cu_seqlens[n + 1:len(row_ids) + 1] - starts
        first = (np.array([p.start for p in prefills]) - starts).repeat(lens)  # position - token index
        position = first + np.arange(n * q, num_tokens, dtype=np.int32)
        buffer[0, n * q:num_tokens] = np.concatenate([p.token_ids for p in prefills])
        buffer[1, n * q:num_tokens] = position
        buffer[2, n * q:num_tokens] = _kv_write_slots(block_table, rows.repeat(lens), position, size)
    token_ids, positions, slot_mapping = frozen(buffer)
    return dict(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping)


def _kv_write_slots(block_table: np.ndarray, rows: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    """block * size + offset of each position, for `rows` broadcast against `positions`; the block is
    looked up by flat index, one fast `take` instead of a broadcast 2-D fancy index."""
    block, offset = np.divmod(positions, size)
    return block_table.take(rows * block_table.shape[1] + block) * size + offset


def _logits_fields(num_logits: np.ndarray, cu_seqlens: np.ndarray, bucket: int) -> dict:
    """Row r asks for the logits of its last num_logits[r] tokens: entries cu_logits[r]..cu_logits[r+1]
    of the flat, bucket-padded `logits_indices` (packed token indices)."""
    cu_logits = np.zeros(len(num_logits) + 1, np.int32)
    num_logits.cumsum(out=cu_logits[1:])
    total = int(cu_logits[-1])
    owner = np.repeat(np.arange(len(num_logits), dtype=np.int32) + 1, num_logits)  # row r + 1 of each logit
    indices = np.zeros(bucket, np.int32)
    indices[:total] = cu_seqlens[owner] - cu_logits[owner] + np.arange(total, dtype=np.int32)
    return dict(logits_indices=frozen(indices), cu_logits=frozen(cu_logits))


def _draft_fields(cfg: SchedulerConfig, decode: DecodeBatch, prefills: list[PrefillRow], rows_b: int) -> dict:
    k, n = cfg.num_spec_tokens, len(decode.rows)
    drafts = np.zeros((rows_b, k), np.int32)
    drafts[:n] = decode.drafts
    lookahead = np.zeros((rows_b, max(cfg.num_lookahead, 1)), np.int32)
    for i, p in enumerate(prefills, start=n):
        lookahead[i, :len(p.lookahead)] = p.lookahead
    return dict(draft_token_ids=frozen(drafts), lookahead_token_ids=frozen(lookahead))
