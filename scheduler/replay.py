"""ReplaySSM trackers: the flush rule, commit/rollback after acceptance, and materialization counts.

Per running slot the device keeps a checkpoint state S0 and a ring of the last inputs; the scheduler
owns two trackers per row: `ring_start` (ring index of the first committed entry) and `committed`
(entries after S0 that are accepted). The live state is S0 advanced by `committed` entries, so
S0 is the state after `num_computed - committed` tokens. A verify row of T tokens flushes (folds the
committed entries into S0) when `committed + T > W`; rejecting drafts is a cursor move: rejected
entries sit beyond `committed` and are overwritten next step. A prefill chunk writes S0 directly
and leaves an empty ring (both trackers 0), as does a copy from a cache slot (cached states are
canonical). All functions here are vectorised over rows.
"""

from __future__ import annotations

import numpy as np


def ring_rows(ring_size: int, num_spec_tokens: int) -> int:
    """Physical ring entries per slot: a flushing verify step reads W committed entries while writing
    T = 1 + k new ones after them (FlashInfer's R = W + 1 + k). With W = 0 every step flushes and reads
    only the entries the step before wrote, before it overwrites them: 1 + k."""
    return ring_size + 1 + num_spec_tokens


def max_committed(num_ring_rows: int, num_spec_tokens: int) -> int:
    """The most entries a row has committed when a step starts, for a ring of `ring_rows(W, k)` rows: a step
    that does not flush leaves at most W, one that flushes its 1 + k newest at most. The reference ops fold
    this many entries, masked, as their static bound."""
    return max(num_ring_rows - 1 - num_spec_tokens, 1 + num_spec_tokens)


def flush_flags(committed: np.ndarray, query_len: int, ring_size: int) -> np.ndarray:
    """[R] bool: the verify step folds the committed entries into S0 before appending."""
    return committed + query_len > ring_size


def commit(ring_start: np.ndarray, committed: np.ndarray, flush: np.ndarray, num_committed_tokens:
           np.ndarray, num_ring_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Trackers after a verify step that committed `num_committed_tokens` (= 1 + accepted drafts)."""
    new_start = np.where(flush, (ring_start + committed) % num_ring_rows, ring_start)
    new_committed = np.where(flush, num_committed_tokens, committed + num_committed_tokens)
    return new_start.astype(np.int32), new_committed.astype(np.int32)


def crossed_boundary(computed_before: np.ndarray, computed_after: np.ndarray, bs: int) -> np.ndarray:
    """[R] int: the last Mamba block boundary b with computed_before < b <= computed_after, else 0."""
    boundary = computed_after - computed_after % bs
    return np.where(boundary > computed_before, boundary, 0)


def materialize_count(boundary: np.ndarray, computed_after: np.ndarray, committed_after: np.ndarray
                      ) -> np.ndarray:
    """Ring entries to fold into S0 to reach `boundary`: S0 sits at computed_after - committed_after."""
    return boundary - (computed_after - committed_after)
