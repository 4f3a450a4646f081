"""Drive a ReplaySSM op the way the engine does (verify rows, random acceptance, host-side commits), and
the op-independent checks built on it. Each op plugs in through a `ReplayOp` subclass."""

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from scheduler.replay import max_committed, ring_rows
from tests.tolerances import Float32

NUM_ROWS, STREAM, NUM_TOKENS = 3, 64, 32
# A stream of STREAM tokens through a state of K or N terms per output; the kernels sum over the ring too.
TOL = Float32(depth=STREAM + 2 * 16)


class ReplayOp:
    """Adapter of one op family to the checks below; every call uses `backend` (None: pallas on GPU).

    Subclasses provide `num_slots` and `tokens(rng, n)`, `make_pools(width, rng)`, `oracle(stream, state,
    length) -> (out, final)`, `verify(packed, cu, pools, slots, ring_start, committed, flush) -> (out,
    pools)`, `decode(packed, cu, state_pool, slots) -> (out, state_pool)` and `materialize(pools, src, dst,
    ring_start, num_entries) -> state_pool`.
    """

    def __init__(self, backend="reference", max_query_len=None, max_committed=None):
        # verify's static bounds on a row's tokens and on its committed entries (materialize's too)
        self.backend, self.max_query_len, self.max_committed = backend, max_query_len, max_committed


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


def run_steps(op, rows, pools, width, max_drafts, num_steps, rng, garbage_rng, num_tokens, window=None):
    """Run `num_steps` verify calls over all rows (plus one zero-length padding row); returns pools.

    A row flushes when its committed entries and new tokens pass `window` (W; None: the ring's `width`, E).

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
        flush = np.append(trackers[2, :-1] + lengths > (width if window is None else window), False)
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


def simulate(op, width, max_drafts, seed, garbage_seed, steps, window=None):
    """`run_steps` over NUM_ROWS rows in random running slots; returns (rows, final pools, initial pools)."""
    rng = np.random.default_rng(seed)
    pools = op.make_pools(width, rng)
    initial = [p.copy() for p in pools]
    slots = rng.permutation(np.arange(1, op.num_slots))  # random running slots; the ones left over get materializations
    rows = [Row(slot=int(s), stream=op.tokens(rng, STREAM)) for s in slots[:NUM_ROWS]]
    pools = run_steps(op, rows, pools, width, max_drafts, steps, rng, np.random.default_rng(garbage_seed), NUM_TOKENS,
                      window)
    return rows, [np.asarray(p) for p in pools], initial


def check_verify_matches_recurrent_decoding(op, max_drafts, seed, data, width=4, window=None):
    rows, pools, initial = simulate(op, width, max_drafts, seed, seed + 1, steps=3 * width + 2, window=window)
    for row in rows:
        out_ref, _ = op.oracle(row.stream, initial[0][row.slot], STREAM)
        for position, out in row.outputs:
            TOL.check(out, out_ref[position])
    # materialize(n) == the state after exactly n more tokens than the checkpoint, source untouched
    entries = [data.draw(st.integers(0, r.committed)) for r in rows]
    free = np.setdiff1d(np.arange(1, op.num_slots), [r.slot for r in rows])
    src = np.array([r.slot for r in rows], np.int32)
    out = np.asarray(op.materialize(
        [p.copy() for p in pools], src, np.append(free, 0).astype(np.int32),
        np.array([r.ring_start for r in rows], np.int32), np.array(entries, np.int32),
    ))  # fmt: skip
    for row, n, dst in zip(rows[:2], entries[:2], free, strict=True):
        _, state = op.oracle(row.stream, initial[0][row.slot], row.position - row.committed + n)
        TOL.check(out[dst], state)
    np.testing.assert_array_equal(np.delete(out, free, axis=0), np.delete(pools[0], free, axis=0))
    for pool in pools:
        assert not pool[0].any()  # null slot never written


def check_the_engines_static_bounds_change_nothing(make_op, window, max_drafts, seed, data):
    """The engine's ring (E = W + 1 + K rows, a flush at committed + T > W) with the static bounds the model
    passes, max_query_len = 1 + K and `scheduler.replay.max_committed`: no row needs a step or a fold past them."""
    width = ring_rows(window, max_drafts)
    op = make_op(max_query_len=1 + max_drafts, max_committed=max_committed(width, max_drafts))
    check_verify_matches_recurrent_decoding(op, max_drafts, seed, data, width=width, window=window)


def check_ring_wraps_and_rejected_entries_do_not_matter(op):
    width = 4
    runs = [simulate(op, width, 3, seed=7, garbage_seed=g, steps=5 * width) for g in (1, 2)]
    assert max(r.wraps for r in runs[0][0]) >= 1
    for row_a, row_b in zip(runs[0][0], runs[1][0], strict=True):
        for (pa, oa), (pb, ob) in zip(row_a.outputs, row_b.outputs, strict=True):
            assert pa == pb
            np.testing.assert_array_equal(oa, ob)


def check_width_one_is_bit_identical_to_plain_decoding(op):
    rng = np.random.default_rng(3)
    pools = op.make_pools(1, rng)
    plain = pools[0].copy()
    slots = np.array([3, 1, 0], np.int32)
    committed = np.zeros(3, np.int32)
    for _ in range(7):
        tokens = op.tokens(rng, 3)
        cu = np.array([0, 1, 2, 2], np.int32)  # third row is padding
        flush = committed + 1 > 1
        out, pools = op.verify(tokens, cu, pools, slots, np.zeros(3, np.int32), committed, flush)
        out_plain, plain = op.decode(tokens, cu, plain, slots)
        np.testing.assert_array_equal(out[:2], out_plain[:2])
        committed = np.array([1, 1, 0], np.int32)
    state = op.materialize(pools, slots, np.array([2, 5, 0], np.int32), np.zeros(3, np.int32), committed)
    np.testing.assert_array_equal(np.asarray(state)[[2, 5]], np.asarray(plain)[[3, 1]])
