"""The arithmetic of a kernel's `pl.CostEstimate`: bytes of arrays and of pool rows, and ring entries folded."""

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl


def nbytes(*arrays) -> int:
    """Bytes of whole arrays (anything with a shape and a dtype)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def rows_bytes(array, rows: int) -> int:
    """Bytes of `rows` entries of `array`'s first axis: the slots of a pool a kernel reads or writes."""
    return rows * math.prod(array.shape[1:]) * jnp.dtype(array.dtype).itemsize


def cost(flops: float, transcendentals: float, bytes_accessed: float) -> pl.CostEstimate:
    """A pallas_call's CostEstimate (XLA wants integers); each op's `cost` module says what it counts."""
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(bytes_accessed))


def folded_entries(ring_entries: int, num_tokens: int, num_rows: int) -> int:
    """Ring entries a ReplaySSM row folds on average, from shapes alone: its committed entries, which grow from
    0 to W between flushes (W / 2 on average), where a ring of E = W + 1 + K entries serves rows of 1 + K tokens
    (`scheduler.replay.ring_rows`; a bucket of T tokens over R rows: 1 + K = ceil(T / R)). Decoding's one-entry
    dummy rings fold none."""
    return max(ring_entries - -(-num_tokens // num_rows), 0) // 2
