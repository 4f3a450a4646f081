"""The (tokens, rows) bucket ladder and the bisect that picks a bucket; nothing else."""

from __future__ import annotations

import bisect


def default_buckets(cap: int, smallest: int = 8, growth: int = 2) -> tuple[int, ...]:
    """`smallest` times powers of `growth` up to the first one >= cap. Each bucket is one compiled step
    per combination with the other ladders, so a coarser growth trades padding for warm-up time."""
    buckets = [smallest]
    while buckets[-1] < cap:
        buckets.append(buckets[-1] * growth)
    return tuple(buckets)


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    """Smallest bucket >= size (at least the smallest bucket, even for size 0)."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]
