"""Committed tokens of running requests: the TokenLog plus a per-row numpy tail.

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

from collections.abc import Callable

import numpy as np

from scheduler.journal import UndoArray, frozen
from scheduler.state import Rows, TokenLog, num_logged

WritableLog = Callable[[str], TokenLog]  # request id -> its log, its appends undone if the transition raises


def start_tail(log: TokenLog, rows: Rows, row: int, num_tokens: int, unit: int) -> None:
    """Seed the tail of a newly admitted row from the log's first `num_tokens` tokens."""
    start = num_tokens // unit * unit
    rows.edit("tail")[row, :num_tokens - start] = log.slice(start, num_tokens)


def append_tokens(logs: WritableLog, rows: Rows, unit: int, hash_unit: int, request_ids: tuple[str, ...],
                  row_ids: np.ndarray, token_ids: np.ndarray, before: np.ndarray, counts: np.ndarray) -> None:
    """Commit the first counts[i] of token_ids[i] (shape [n, W], W <= 1 + K) to rows holding before[i]."""
    tail = rows.edit("tail")
    offset = before % unit  # where the row's tail ends
    # the whole width is stored (entries past counts[i] land beyond num_tokens, where nobody reads),
    # through flat indices: one fast `put` instead of a broadcast 2-D fancy index
    starts = row_ids * tail.view.shape[1] + offset
    tail.put(starts[:, None] + np.arange(token_ids.shape[1], dtype=starts.dtype), token_ids)
    rows.num_tokens[row_ids] = before + counts
    full = (offset + counts >= unit).nonzero()[0]
    while full.size:  # more than one round only when 1 + K > unit
        _log_blocks(logs, tail, rows, [request_ids[j] for j in full.tolist()], row_ids[full],
                    (before - offset)[full], unit, hash_unit)
        offset[full] -= unit
        full = full[offset[full] + counts[full] >= unit]


def _log_blocks(logs: WritableLog, tail: UndoArray, rows: Rows, request_ids: list[str],
                row_ids: np.ndarray, starts: np.ndarray, unit: int, hash_unit: int) -> None:
    """Move each row's full first tail block [start, start + unit) into its log and shift the
    tails left by a block."""
    blocks = tail[row_ids, :unit]
    tail[row_ids, :-unit] = tail[row_ids, unit:]
    logged = np.maximum(starts, rows.prefill_end[row_ids])  # the prompt part is in the log already
    _append_blocks(logs, blocks, request_ids, starts, logged, starts + unit, hash_unit)


def park_tails(logs: WritableLog, rows: Rows, request_ids: list[str], row_ids: np.ndarray, unit: int,
               hash_unit: int) -> None:
    """Move the tails of rows that are being released into their logs (a parked request has only that)."""
    total = rows.num_tokens[row_ids]
    _append_blocks(logs, rows.tail[row_ids, :unit], request_ids, total // unit * unit,
                   num_logged(rows, row_ids, unit), total, hash_unit)


def _append_blocks(logs: WritableLog, blocks: np.ndarray, request_ids: list[str], starts: np.ndarray,
                   logged: np.ndarray, ends: np.ndarray, hash_unit: int) -> None:
    """Append tokens [logged[i], ends[i]) of each request to its log, taken from blocks[i] (a private
    [n, unit] copy of tail blocks, block i starting at token starts[i])."""
    blocks = frozen(blocks)  # the logs keep views of its rows
    for request_id, block, start, begin, end in zip(
            request_ids, blocks, starts.tolist(), logged.tolist(), ends.tolist(), strict=True):
        if end > begin:
            logs(request_id).extend(block[begin - start:end - start], hash_unit)
