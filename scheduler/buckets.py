"""The bisect that picks a bucket of a ladder, and the (tokens, rows, logits) buckets of a step (the ladders'
defaults are `config.default_buckets`)."""

from __future__ import annotations

import bisect

from scheduler.config import SchedulerConfig


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    """Smallest bucket >= size (at least the smallest bucket, even for size 0)."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def step_buckets(cfg: SchedulerConfig, num_tokens: int, num_rows: int, num_logits: int) -> tuple[int, int, int]:
    """(tokens, rows, logits) buckets of a step of `num_rows` rows (copy lists included).

    The token bucket also holds the rows (up to the largest), and the logits take one of two sizes per (tokens,
    rows) pair: the rows' (1 + K each, what decode rows ask for) or the tokens' (prompt logprobs). So a step's
    shape is one of the few of `bucket_shapes`, each compiled, and finer token ladders stay affordable: token
    padding costs a step more than row padding (docs/benchmarks.md#where-a-cpu-decode-step-goes)."""
    rows = pick_bucket(cfg.row_buckets, num_rows)
    tokens = pick_bucket(cfg.token_buckets, max(num_tokens, min(num_rows, cfg.token_buckets[-1])))
    low, high = _logits_sizes(cfg, tokens, rows)
    return tokens, rows, low if num_logits <= low else high


def bucket_shapes(cfg: SchedulerConfig) -> list[tuple[int, int, int]]:
    """Every (tokens, rows, logits) triple `step_buckets` can return."""
    shapes = []
    for tokens in cfg.token_buckets:
        last = tokens == cfg.token_buckets[-1]  # the only bucket that may hold fewer tokens than rows
        most_rows = cfg.row_buckets[-1] if last else pick_bucket(cfg.row_buckets, min(tokens, cfg.row_buckets[-1]))
        for rows in (r for r in cfg.row_buckets if r <= most_rows):
            shapes += [(tokens, rows, logits) for logits in sorted(set(_logits_sizes(cfg, tokens, rows)))]
    return shapes


def _logits_sizes(cfg: SchedulerConfig, tokens: int, rows: int) -> tuple[int, int]:
    largest = cfg.logits_buckets[-1]
    return (pick_bucket(cfg.logits_buckets, min(rows * (1 + cfg.num_spec_tokens), tokens, largest)),
            pick_bucket(cfg.logits_buckets, min(tokens, largest)))
