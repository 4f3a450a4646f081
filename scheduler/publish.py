"""Block publication: full, committed KV blocks enter the prefix cache under chained keys."""

from __future__ import annotations

from hashlib import blake2b

import numpy as np

from scheduler.prefix_cache import KEY_BYTES
from scheduler.state import NUM_COMPUTED, NUM_TOKENS, PUBLISHED, TokenLog
from scheduler.transaction import StateEdit


def publish_full_blocks(edit: StateEdit, row_ids: np.ndarray, request_ids) -> None:
    """Publish every full KV block that the rows have computed and committed: decode leaves them to be
    published here, right before anything looks them up (admission) or lets them go (release), so a
    steady decode batch hashes nothing while every lookup sees every full block."""
    cols = edit.rows.ints.take(row_ids, axis=1)
    full = np.minimum(cols[NUM_COMPUTED], cols[NUM_TOKENS]) // edit.cfg.hash_unit
    todo = (full > cols[PUBLISHED]).nonzero()[0]
    if todo.size:
        register_blocks(edit, [request_ids[i] for i in todo.tolist()], row_ids[todo], full[todo])


def register_blocks(edit: StateEdit, request_ids, row_ids: np.ndarray, last: np.ndarray) -> None:
    """Publish the KV blocks of each request i, running in row_ids[i], from its first unpublished one up
    to last[i], under their chained keys; all must be full, committed and computed by a step that has run."""
    rows = edit.rows
    first = rows.published[row_ids]
    last = np.maximum(last, first)
    rows.published[row_ids] = last
    counts = last - first
    if not counts.any():
        return
    logs = [edit.logs[rid] for rid in request_ids]
    have = np.array([len(log.hashes) for log in logs])
    todo = (last > have).nonzero()[0]
    if todo.size:
        _chain_tail_keys(edit, [logs[i] for i in todo.tolist()], row_ids[todo], have[todo], last[todo])
    keys = [key for log, lo, hi in zip(logs, first.tolist(), last.tolist(), strict=True) for key in log.hashes[lo:hi]]
    offsets = np.arange(len(keys)) - np.repeat(counts.cumsum() - counts - first, counts)  # block index in its row
    table = rows.block_table
    edit.blocks.register(table.take(np.repeat(row_ids, counts) * table.shape[1] + offsets).tolist(), keys)


def _chain_tail_keys(edit: StateEdit, logs: list[TokenLog], row_ids: np.ndarray, have: np.ndarray,
                     last: np.ndarray) -> None:
    """Chain the keys of units [have[i], last[i]) onto each log from its row's tail: a KV block is
    published before its log block moves into the log, and each unit is hashed once. Decode fills ~1
    block per row every few steps, so this is the per-row part of a decode step: the tokens are gathered
    and serialised in one call, and the common case costs one digest per row."""
    h, unit, tail = edit.cfg.hash_unit, edit.cfg.log_unit, edit.rows.tail
    counts = last - have
    start = have * h - edit.rows.num_tokens[row_ids] // unit * unit  # the tail begins at its log block
    columns = start[:, None] + np.arange(int(counts.max()) * h)
    data = tail.take(row_ids[:, None] * tail.shape[1] + np.minimum(columns, tail.shape[1] - 1)).astype("<i4")
    data, stride, size = data.tobytes(), 4 * columns.shape[1], 4 * h
    edit.hash_marks.extend((log.hashes, len(log.hashes)) for log in logs)
    for i, (log, count) in enumerate(zip(logs, counts.tolist(), strict=True)):
        hashes, parent = log.hashes, log.hashes[-1] if log.hashes else log.root
        for j in range(count):
            parent = blake2b(parent + data[i * stride + j * size:i * stride + (j + 1) * size],
                             digest_size=KEY_BYTES).digest()
            hashes.append(parent)
