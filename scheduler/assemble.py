"""Turn one pass's decisions (a vectorised decode batch, prefill rows, copy lists) into a BatchPlan."""

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
    token_ids: list[int]
    samples: bool              # the chunk ends the prefill: one logit at its last token
    phase: int
    has_initial_state: bool
    state_slot: int
    lookahead: list[int]


class Copies(NamedTuple):
    hit: list[tuple[int, int]]
    pair: list[tuple[int, int]]
    publish: list[tuple[int, int]]
    materialize: list[tuple[int, int, int, int]]   # (src, dst, ring_start, count)


def _ro(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def assemble(cfg: SchedulerConfig, step_id: int, decode: DecodeBatch, prefills: list[PrefillRow],
             copies: Copies, block_table: np.ndarray) -> BatchPlan:
    """Build the padded plan; decode rows come first, then prefill rows in scheduling order."""
    query_lens = _query_lens(cfg, decode, prefills)
    num_rows, num_tokens = len(query_lens), int(query_lens.sum())
    counts = [len(c) for c in copies]
    rows_b = pick_bucket(cfg.row_buckets, max([num_rows, *counts]))
    tokens_b = pick_bucket(cfg.token_buckets, num_tokens)
    row_ids = np.concatenate([decode.rows, np.array([p.row for p in prefills], np.int64)]).astype(np.int64)
    table = block_table[row_ids]
    if rows_b > num_rows:  # padding rows: null block everywhere
        table = np.concatenate([table, np.zeros((rows_b - num_rows, block_table.shape[1]), np.int32)])
    fields = _row_fields(cfg, decode, prefills, query_lens, rows_b)
    fields.update(_token_fields(cfg, decode, prefills, fields, table, tokens_b, num_tokens))
    fields.update(_sampling_fields(cfg, decode, prefills, fields, rows_b))
    fields.update(_copy_fields(copies, rows_b))
    request_ids = tuple(decode.request_ids) + tuple(p.request_id for p in prefills)
    return BatchPlan(step_id=step_id, num_rows=num_rows, num_tokens=num_tokens, request_ids=request_ids,
                     row_ids=_ro(row_ids), block_table=_ro(table), **{k: _ro(v) if isinstance(v, np.ndarray) else v
                                                for k, v in fields.items()})


def _query_lens(cfg: SchedulerConfig, decode: DecodeBatch, prefills: list[PrefillRow]) -> np.ndarray:
    lens = np.full(len(decode.rows), 1 + cfg.num_spec_tokens, np.int32)
    return np.concatenate([lens, np.array([len(p.token_ids) for p in prefills], np.int32)])


def _padded(values, size: int, dtype) -> np.ndarray:
    out = np.zeros(size, dtype)
    out[:len(values)] = values
    return out


def _row_fields(cfg, decode, prefills, query_lens, rows_b) -> dict:
    n_dec, num_rows = len(decode.rows), len(query_lens)
    kind = RowKind.VERIFY if cfg.num_spec_tokens else RowKind.DECODE
    kinds = [int(kind)] * n_dec + [int(RowKind.PREFILL)] * len(prefills)
    cu = np.full(rows_b + 1, int(query_lens.sum()), np.int32)
    cu[0] = 0
    cu[1:num_rows + 1] = np.cumsum(query_lens)
    decode_init = decode.context_lens > 0
    return dict(
        row_kind=_padded(kinds, rows_b, np.int8),
        phase=_phases(prefills, n_dec, rows_b),
        cu_seqlens=cu, query_lens=_padded(query_lens, rows_b, np.int32),
        context_lens=_padded(np.concatenate([decode.context_lens, [p.start for p in prefills]]), rows_b, np.int32),
        state_slots=_padded(np.concatenate([decode.state_slots, [p.state_slot for p in prefills]]), rows_b, np.int32),
        has_initial_state=_padded(np.concatenate([decode_init, [p.has_initial_state for p in prefills]]),
                                  rows_b, bool),
        ring_start=_padded(decode.ring_start, rows_b, np.int32),
        ring_committed=_padded(decode.committed, rows_b, np.int32),
        flush=_padded(decode.flush, rows_b, bool),
    )


def _phases(prefills: list[PrefillRow], n_dec: int, rows_b: int) -> np.ndarray:
    phase = np.full(rows_b, 2, np.int8)  # decode, padding and ordinary prefill rows run in phase 2
    phase[n_dec:n_dec + len(prefills)] = [p.phase for p in prefills]
    return phase


def _token_fields(cfg, decode, prefills, fields, tables, tokens_b, num_tokens) -> dict:
    q = 1 + cfg.num_spec_tokens
    dec_pos = (decode.context_lens[:, None] + np.arange(q)).ravel()
    pre_pos = [np.arange(p.start, p.start + len(p.token_ids)) for p in prefills]
    positions = np.concatenate([dec_pos, *pre_pos]).astype(np.int64)
    tokens = np.concatenate([decode.token_ids.ravel(), *[p.token_ids for p in prefills]])
    num_rows = len(decode.rows) + len(prefills)
    token_row = np.repeat(np.arange(num_rows), fields["query_lens"][:num_rows])
    blocks = tables[token_row, positions // cfg.block_size] if num_tokens else positions
    slots = blocks.astype(np.int64) * cfg.block_size + positions % cfg.block_size
    return dict(token_ids=_padded(tokens, tokens_b, np.int32), positions=_padded(positions, tokens_b, np.int32),
                slot_mapping=_padded(slots, tokens_b, np.int32))


def _sampling_fields(cfg, decode, prefills, fields, rows_b) -> dict:
    k, n_dec = cfg.num_spec_tokens, len(decode.rows)
    cu = fields["cu_seqlens"]
    logits = np.zeros((rows_b, 1 + k), np.int32)
    num_logits = np.zeros(rows_b, np.int32)
    logits[:n_dec] = cu[:n_dec, None] + np.arange(1 + k)
    num_logits[:n_dec] = 1 + k
    drafts = np.zeros((rows_b, k), np.int32)
    drafts[:n_dec] = decode.token_ids[:, 1:]
    width = max(cfg.num_lookahead, 1)
    lookahead = np.zeros((rows_b, width), np.int32)
    num_lookahead = np.zeros(rows_b, np.int32)
    for i, p in enumerate(prefills, start=n_dec):
        if p.samples:
            logits[i, 0], num_logits[i] = cu[i + 1] - 1, 1
        lookahead[i, :len(p.lookahead)], num_lookahead[i] = p.lookahead, len(p.lookahead)
    return dict(logits_indices=logits, num_logits=num_logits, draft_token_ids=drafts,
                lookahead_token_ids=lookahead, num_lookahead_tokens=num_lookahead)


def _copy_fields(copies: Copies, rows_b: int) -> dict:
    out = {}
    for name, pairs in (("hit_copy", copies.hit), ("pair_copy", copies.pair), ("publish", copies.publish)):
        out[f"{name}_src"] = _padded([s for s, _ in pairs], rows_b, np.int32)
        out[f"{name}_dst"] = _padded([d for _, d in pairs], rows_b, np.int32)
    for i, name in enumerate(("src", "dst", "ring_start", "count")):
        out[f"materialize_{name}"] = _padded([m[i] for m in copies.materialize], rows_b, np.int32)
    out.update(num_hit_copies=len(copies.hit), num_pair_copies=len(copies.pair),
               num_publishes=len(copies.publish), num_materializations=len(copies.materialize))
    return out
