"""The (tokens, rows) bucket ladder and the bisect that picks a bucket; nothing else."""

from __future__ import annotations

import bisect


def default_buckets(cap: int, smallest: int = 8) -> tuple[int, ...]:
    """Powers of two from `smallest` up to the first one >= cap."""
    buckets = [smallest]
    while buckets[-1] < cap:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    """Smallest bucket >= size (at least the smallest bucket, even for size 0)."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]
