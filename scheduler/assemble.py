"""Turn one pass's decisions (a vectorised decode batch, prefill rows, copy lists) into a BatchPlan.

Runs every step, so it is written for few numpy calls: the [R] int32 fields share one zero-filled
buffer, and decode and prefill rows go through the same vectorised packing code; only the prefill
rows' own values are collected in Python, and a step has few of them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from scheduler.buckets import pick_bucket
from scheduler.config import SchedulerConfig
from scheduler.plan import BatchPlan, RowKind


class DecodeBatch(NamedTuple):
    """Running decode/verify rows, all with 1 + K tokens. Arrays are [n] unless noted."""

    rows: np.ndarray           # row ids into the state's row table
    request_ids: list[str]
    context_lens: np.ndarray
    token_ids: np.ndarray      # [n, 1+K] last sampled token, then drafts
    state_slots: np.ndarray
    ring_start: np.ndarray
    committed: np.ndarray
    flush: np.ndarray


class PrefillRow(NamedTuple):
    row: int
    request_id: str
    start: int
    token_ids: np.ndarray      # [n] int32
    samples: bool              # the chunk ends the prefill: one logit at its last token
    phase: int
    has_initial_state: bool
    state_slot: int
    lookahead: np.ndarray      # [<= L] int32 the known tokens after the chunk


class Copies(NamedTuple):
    hit: list[tuple[int, int]]
    pair: list[tuple[int, int]]
    publish: list[tuple[int, int]]
    materialize: list[tuple[int, int, int, int]]   # (src, dst, ring_start, count)


_ROW_FIELDS = ("query_lens", "context_lens", "state_slots", "num_logits", "num_lookahead_tokens", "ring_start",
               "ring_committed")
_COPY_FIELDS = ("hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst", "publish_src", "publish_dst",
                "materialize_src", "materialize_dst", "materialize_ring_start", "materialize_count")


def assemble(cfg: SchedulerConfig, step_id: int, decode: DecodeBatch, prefills: list[PrefillRow],
             copies: Copies, block_table: np.ndarray, num_blocks: np.ndarray) -> BatchPlan:
    """Build the padded plan; decode rows come first, then prefill rows in scheduling order.
    `block_table` / `num_blocks` are the state's columns, already grown for this step."""
    row_ids = np.concatenate([decode.rows, np.array([p.row for p in prefills], np.int64)]) if prefills else decode.rows
    rows_b = pick_bucket(cfg.row_buckets, max(len(row_ids), *map(len, copies)))
    ints = np.zeros((len(_ROW_FIELDS) + len(_COPY_FIELDS), rows_b), np.int32)
    fields = dict(zip(_ROW_FIELDS + _COPY_FIELDS, ints, strict=True))
    flags = _fill_rows(cfg, fields, decode, prefills, rows_b)
    _fill_copies(fields, copies)
    cu_seqlens = np.zeros(rows_b + 1, np.int32)
    np.cumsum(fields["query_lens"], out=cu_seqlens[1:])
    tokens = _token_fields(cfg, decode, prefills, row_ids, cu_seqlens, block_table)
    sampling = _sampling_fields(cfg, decode, prefills, cu_seqlens, fields)
    width = pick_bucket(cfg.block_table_buckets, int(num_blocks[row_ids].max(initial=0)))
    table = np.zeros((rows_b, width), np.int32)  # padding rows: the null block everywhere
    table[:len(row_ids)] = block_table[row_ids, :width]
    for array in (row_ids, cu_seqlens, table, *fields.values(), *flags.values(), *tokens.values(),
                  *sampling.values()):
        array.flags.writeable = False
    request_ids = tuple(decode.request_ids) + tuple(p.request_id for p in prefills)
    return BatchPlan(step_id=step_id, num_rows=len(row_ids), num_tokens=int(cu_seqlens[-1]),
                     request_ids=request_ids, row_ids=row_ids, cu_seqlens=cu_seqlens, block_table=table,
                     **flags, **tokens, **sampling, **fields, **{f"num_{name}": len(c) for name, c in zip(
                         ("hit_copies", "pair_copies", "publishes", "materializations"), copies, strict=True)})


def _fill_rows(cfg: SchedulerConfig, fields: dict, decode: DecodeBatch, prefills: list[PrefillRow],
               rows_b: int) -> dict:
    """Write the per-row int32 fields; returns the int8/bool ones (row_kind, phase, ...)."""
    n, q = len(decode.rows), 1 + cfg.num_spec_tokens
    kinds = np.zeros(rows_b, np.int8)
    kinds[:n] = RowKind.VERIFY if cfg.num_spec_tokens else RowKind.DECODE
    phase = np.full(rows_b, 2, np.int8)  # decode, padding and ordinary prefill rows run in phase 2
    has_initial_state, flush = np.zeros((2, rows_b), bool)
    for name, values in (("query_lens", q), ("num_logits", q), ("context_lens", decode.context_lens),
                         ("state_slots", decode.state_slots), ("ring_start", decode.ring_start),
                         ("ring_committed", decode.committed)):
        fields[name][:n] = values
    has_initial_state[:n] = decode.context_lens > 0
    flush[:n] = decode.flush
    if prefills:
        end = n + len(prefills)
        kinds[n:end] = RowKind.PREFILL
        phase[n:end] = [p.phase for p in prefills]
        has_initial_state[n:end] = [p.has_initial_state for p in prefills]
        fields["query_lens"][n:end] = [len(p.token_ids) for p in prefills]
        fields["num_logits"][n:end] = [p.samples for p in prefills]
        fields["context_lens"][n:end] = [p.start for p in prefills]
        fields["state_slots"][n:end] = [p.state_slot for p in prefills]
        fields["num_lookahead_tokens"][n:end] = [len(p.lookahead) for p in prefills]
    return dict(row_kind=kinds, phase=phase, has_initial_state=has_initial_state, flush=flush)


def _fill_copies(fields: dict, copies: Copies) -> None:
    for prefix, pairs in (("hit_copy", copies.hit), ("pair_copy", copies.pair), ("publish", copies.publish)):
        if pairs:
            fields[f"{prefix}_src"][:len(pairs)], fields[f"{prefix}_dst"][:len(pairs)] = zip(*pairs, strict=True)
    if copies.materialize:
        for name, values in zip(_COPY_FIELDS[-4:], zip(*copies.materialize, strict=True), strict=True):
            fields[name][:len(values)] = values


def _token_fields(cfg: SchedulerConfig, decode: DecodeBatch, prefills: list[PrefillRow], row_ids: np.ndarray,
                  cu_seqlens: np.ndarray, block_table: np.ndarray) -> dict:
    num_rows = len(row_ids)
    num_tokens = int(cu_seqlens[num_rows])
    tokens_b = pick_bucket(cfg.token_buckets, num_tokens)
    token_ids, positions, slot_mapping = np.zeros((3, tokens_b), np.int32)
    query_lens = cu_seqlens[1:num_rows + 1] - cu_seqlens[:num_rows]
    context_lens = np.concatenate([decode.context_lens, np.array([p.start for p in prefills], np.int32)])
    # position of token t of row r: context_lens[r] + (t - cu_seqlens[r])
    positions[:num_tokens] = np.repeat(context_lens - cu_seqlens[:num_rows], query_lens) + np.arange(num_tokens)
    num_decode_tokens = decode.token_ids.size
    token_ids[:num_decode_tokens] = decode.token_ids.ravel()
    if prefills:
        token_ids[num_decode_tokens:num_tokens] = np.concatenate([p.token_ids for p in prefills])
    size = cfg.block_size
    blocks = block_table[np.repeat(row_ids, query_lens), positions[:num_tokens] // size]
    slot_mapping[:num_tokens] = blocks * size + positions[:num_tokens] % size
    return dict(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping)


def _sampling_fields(cfg: SchedulerConfig, decode: DecodeBatch, prefills: list[PrefillRow], cu_seqlens: np.ndarray,
                     fields: dict) -> dict:
    k, n = cfg.num_spec_tokens, len(decode.rows)
    rows_b = len(cu_seqlens) - 1
    logits = np.zeros((rows_b, 1 + k), np.int32)
    logits[:n] = cu_seqlens[:n, None] + np.arange(1 + k)
    drafts = np.zeros((rows_b, k), np.int32)
    drafts[:n] = decode.token_ids[:, 1:]
    lookahead = np.zeros((rows_b, max(cfg.num_lookahead, 1)), np.int32)
    for i, p in enumerate(prefills, start=n):
        if p.samples:
            logits[i, 0] = cu_seqlens[i + 1] - 1
        lookahead[i, :len(p.lookahead)] = p.lookahead
    return dict(logits_indices=logits, draft_token_ids=drafts, lookahead_token_ids=lookahead)
