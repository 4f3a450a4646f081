"""Drive a ReplaySSM op the way the engine does: verify rows, random acceptance, host-side commits."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Row:
    """One request: its true input stream and the scheduler's trackers for its slot."""

    slot: int
    stream: tuple  # true per-token inputs, each [L, ...]
    position: int = 0  # tokens committed so far (the checkpoint S0 is at position - committed)
    ring_start: int = 0
    committed: int = 0
    wraps: int = 0  # times the ring start passed index W - 1
    outputs: list = field(default_factory=list)  # (stream position, output) of accepted tokens


def _pack(rows_tokens, num_tokens):
    """Per-row token tuples -> packed arrays over a fixed bucket, and cu_seqlens."""
    lengths = [len(t[0]) for t in rows_tokens]
    packed = []
    for i in range(len(rows_tokens[0])):
        x = np.concatenate([t[i] for t in rows_tokens])
        pad = np.zeros((num_tokens - len(x),) + x.shape[1:], x.dtype)
        packed.append(np.concatenate([x, pad]))
    return packed, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def run_steps(op, rows, pools, width, max_drafts, num_steps, rng, garbage_rng, num_tokens):
    """Run `num_steps` verify calls over all rows (plus one zero-length padding row); returns pools.

    `op.verify(packed, cu, pools, slots, ring_start, committed, flush) -> (out, pools)`; `op.tokens(rng,
    n)` makes rejected drafts from `garbage_rng`. Each row verifies 1 + k tokens and accepts a random
    prefix of them (acceptance drawn from `rng`).
    """
    for _ in range(num_steps):
        batch, accepted = [], []
        for row in rows:
            drafts = int(rng.integers(0, max_drafts + 1))
            num_accepted = int(rng.integers(0, drafts + 1)) + 1
            true = tuple(x[row.position : row.position + num_accepted] for x in row.stream)
            garbage = op.tokens(garbage_rng, 1 + drafts - num_accepted)
            batch.append(tuple(np.concatenate([t, gb]) for t, gb in zip(true, garbage, strict=True)))
            accepted.append(num_accepted)
        packed, cu = _pack(batch + [op.tokens(garbage_rng, 0)], num_tokens)
        lengths = np.diff(cu)[:-1]
        trackers = np.array([[r.slot, r.ring_start, r.committed] for r in rows] + [[0, 0, 0]], np.int32).T
        flush = np.append(trackers[2, :-1] + lengths > width, False)
        out, pools = op.verify(packed, cu, pools, *trackers, flush)
        for i, row in enumerate(rows):
            n = accepted[i]
            row.outputs += [(row.position + j, np.asarray(out[cu[i] + j])) for j in range(n)]
            row.position += n
            if flush[i]:
                row.wraps += row.ring_start + row.committed >= width
                row.ring_start, row.committed = (row.ring_start + row.committed) % width, n
            else:
                row.committed += n
    return pools
