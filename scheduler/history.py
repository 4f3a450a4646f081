"""Committed tokens of running requests: the shared TokenLog buffer plus a per-row numpy tail.

A running row keeps the tokens of its current, partial hash block in `rows.tail` (from the block
start `unit * (num_tokens // unit)` to `num_tokens`). `update` writes a step's tokens into every
row's tail with one vectorised store and, only for rows whose tail filled a block, hashes the block
(the chained hash of its parent `rows.last_hash`) and appends it to the log: with k = 3 drafts and
16-token blocks that is about one row in six, instead of a Python append for every row every step.

The log holds tokens [0, num_logged) with num_logged = max(block start, prefill_end): the whole
prompt (or everything committed before a preemption) from admission, full blocks afterwards. Tokens
between the block start and num_logged are in both places. Parking a row moves its tail into the log.
"""

from __future__ import annotations

import numpy as np

from scheduler.prefix_cache import ROOT_HASH
from scheduler.state import Rows, TokenLog, num_logged


def start_tail(log: TokenLog, rows: Rows, row: int, num_tokens: int, unit: int) -> None:
    """Seed the tail of a newly admitted row from the log's first `num_tokens` tokens."""
    start = num_tokens // unit * unit
    rows.tail[row, :num_tokens - start] = log.tokens[start:num_tokens]
    rows.last_hash[row] = log.hashes[start // unit - 1] if start else ROOT_HASH


def append_tokens(logs: dict[str, TokenLog], rows: Rows, unit: int, request_ids: tuple[str, ...],
                  row_ids: np.ndarray, token_ids: np.ndarray, counts: np.ndarray) -> None:
    """Commit the first counts[i] of token_ids[i] (shape [n, W], W <= 1 + K) to each row."""
    before = rows.num_tokens[row_ids]
    block_start = before // unit * unit
    # the whole width is stored: entries past counts[i] land beyond num_tokens, where nobody reads
    rows.tail[row_ids[:, None], (before - block_start)[:, None] + np.arange(token_ids.shape[1])] = token_ids
    after = before + counts
    rows.num_tokens[row_ids] = after
    full = np.flatnonzero(after - block_start >= unit)
    while full.size:  # more than one round only when 1 + K > unit
        _log_first_block(logs, rows, unit, [request_ids[j] for j in full.tolist()], row_ids[full], block_start[full])
        block_start[full] += unit
        full = full[after[full] - block_start[full] >= unit]


def _log_first_block(logs: dict[str, TokenLog], rows: Rows, unit: int, request_ids: list[str],
                     row_ids: np.ndarray, block_start: np.ndarray) -> None:
    """Hash each row's full first tail block, append it to the log and shift the tail left by it."""
    blocks = rows.tail[row_ids, :unit].tolist()
    # same chained hash as prefix_cache.new_hashes, computed by C-level map calls for all rows at once
    keys = list(map(hash, zip(rows.last_hash[row_ids].tolist(), map(tuple, blocks), strict=True)))
    logged = np.maximum(block_start, rows.prefill_end[row_ids])
    for rid, tokens, key, start, skip in zip(request_ids, blocks, keys, logged.tolist(),
                                             (logged - block_start).tolist(), strict=True):
        log = logs[rid]
        if len(log.tokens) != start:  # another state appended to this buffer first: branch off a copy
            log = logs[rid] = log.branch(start, unit)
        log.tokens += tokens[skip:]
        log.hashes.append(key)
    rows.last_hash[row_ids] = keys
    rows.tail[row_ids, :-unit] = rows.tail[row_ids, unit:]


def park_tail(logs: dict[str, TokenLog], rows: Rows, request_id: str, row: int, unit: int) -> None:
    """Move the tail of a row that is being released into the log (a parked request has only that)."""
    total, logged = int(rows.num_tokens[row]), int(num_logged(rows, row, unit))
    if total == logged:
        return
    log = logs[request_id]
    if len(log.tokens) != logged:
        log = logs[request_id] = log.branch(logged, unit)
    start = total // unit * unit
    log.tokens += rows.tail[row, logged - start:total - start].tolist()
