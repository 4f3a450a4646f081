"""Committed tokens of running requests: the shared TokenLog buffer plus a per-row numpy tail.

A running row keeps the tokens of its current, partial log block in `rows.tail`: from the block
start `U * (num_tokens // U)` to `num_tokens`, with U = `config.log_unit` (the Mamba block size).
`update` writes a step's tokens into every row's tail with one vectorised store; only a row whose
tail filled its block moves the block into its log and hashes the block's KV hash units. With
k = 3 drafts and U = 256 that is ~1 row in 100 per step instead of Python work for every row.

The log holds tokens [0, num_logged) with num_logged = max(block start, prefill_end): the whole
prompt (or everything committed before a preemption) from admission, whole log blocks afterwards,
and the chained hashes of all its full hash units. Tokens between the block start and num_logged
are in both places. Parking a row moves (and hashes) its tail into the log.
"""

from __future__ import annotations

import numpy as np

from scheduler.persistent import PArrayEdit
from scheduler.state import Rows, TokenLog, num_logged


def start_tail(log: TokenLog, rows: Rows, row: int, num_tokens: int, unit: int) -> None:
    """Seed the tail of a newly admitted row from the log's first `num_tokens` tokens."""
    start = num_tokens // unit * unit
    rows.edit("tail")[row, :num_tokens - start] = log.slice(start, num_tokens)


def append_tokens(logs: dict[str, TokenLog], rows: Rows, unit: int, hash_unit: int, request_ids: tuple[str, ...],
                  row_ids: np.ndarray, token_ids: np.ndarray, counts: np.ndarray) -> None:
    """Commit the first counts[i] of token_ids[i] (shape [n, W], W <= 1 + K) to each row."""
    tail = rows.edit("tail")
    before = rows.num_tokens[row_ids]
    block_start = before // unit * unit
    # the whole width is stored: entries past counts[i] land beyond num_tokens, where nobody reads
    tail[row_ids[:, None], (before - block_start)[:, None] + np.arange(token_ids.shape[1])] = token_ids
    after = before + counts
    rows.num_tokens[row_ids] = after
    full = np.flatnonzero(after - block_start >= unit)
    for j, row, start, end in zip(full.tolist(), row_ids[full].tolist(), block_start[full].tolist(),
                                  after[full].tolist(), strict=True):
        for block_start_j in range(start, end - unit + 1, unit):  # more than one only when 1 + K > unit
            _log_block(logs, tail, rows, request_ids[j], row, block_start_j, unit, hash_unit)


def _log_block(logs: dict[str, TokenLog], tail: PArrayEdit, rows: Rows, request_id: str, row: int, start: int,
               unit: int, hash_unit: int) -> None:
    """Move the row's full first tail block [start, start + unit) into its log and shift the tail left."""
    logged = max(start, int(rows.prefill_end[row]))
    _append_to_log(logs, request_id, logged, tail[row, logged - start:unit], hash_unit)
    tail[row, :-unit] = tail[row, unit:]


def _append_to_log(logs: dict[str, TokenLog], request_id: str, logged: int, tokens: np.ndarray,
                   hash_unit: int) -> None:
    """Append a copy of `tokens` to the request's log, which holds `logged` tokens in this state's view."""
    log = logs[request_id]
    if log.length != logged:  # another state appended to this buffer first: branch off a copy
        log = logs[request_id] = log.branch(logged, hash_unit)
    log.extend(tokens.copy(), hash_unit)


def park_tail(logs: dict[str, TokenLog], rows: Rows, request_id: str, row: int, unit: int, hash_unit: int) -> None:
    """Move the tail of a row that is being released into the log (a parked request has only that)."""
    total, logged = int(rows.num_tokens[row]), int(num_logged(rows, row, unit))
    if total > logged:
        start = total // unit * unit
        _append_to_log(logs, request_id, logged, rows.tail[row, logged - start:total - start], hash_unit)
