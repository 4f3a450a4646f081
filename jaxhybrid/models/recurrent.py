"""One recurrent layer (GDN or Mamba2) on its slot pool, in the order `scheduler/plan.py` documents.

Materializations and hit copies first, then the layer's rows: decode and verify rows (the first rows of
every plan) through the ReplaySSM ops with their ring trackers, prefill rows through the chunked prefill
ops in two phases around the pair copies, and last the publishes. Each step touches only this layer's
pages, so running that order layer by layer equals running it over all layers at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import RecurrentPool, copy_pages, for_each_entry, has_snapshots
from pallas_kernels.conv1d import conv1d_materialize, conv1d_prefill, conv1d_replay
from pallas_kernels.grouped_prefill import grouped_prefill
from pallas_kernels.rings import snapshot_materialize
from scheduler.plan import RowKind
from scheduler.replay import max_committed


class MixerCore(NamedTuple):
    """The mixer's state op after the conv, with its per-token inputs (gates, heads) already bound."""

    # (conv_out [T, D], cu_seqlens, state_pool, slots, has_initial) -> (out [T, ...], state_pool)
    prefill: Callable
    # (conv_out, cu_seqlens, state_pool, rings, slots, ring_start, committed, flush, max_query_len, max_committed)
    #   -> (out, state_pool, rings); the static bounds of every row's tokens and committed entries
    verify: Callable
    # (state_pool, rings, src, dst, ring_start, count, *, max_committed) -> state_pool; snapshots need no family op
    materialize: Callable
    out: jax.ShapeDtypeStruct  # the outputs' [T, ...] shape and dtype


def ring_verify(replay_op: Callable, snapshot_op: Callable, inputs: Callable, backend: str | None) -> Callable:
    """`MixerCore.verify` of a family's op pair: `replay_op` on ReplaySSM rings, `snapshot_op` on the snapshot
    baseline's whole states; `inputs(conv_out)` gives the op's per-token arguments."""

    def verify(mixed, cu, state, rings, slots, ring_start, committed, flush, max_query_len, max_committed):
        op = snapshot_op if has_snapshots(rings) else functools.partial(replay_op, max_committed=max_committed)
        out, state, *rings = op(*inputs(mixed), cu, state, *rings, slots, ring_start, committed, flush,
                                max_query_len=max_query_len, backend=backend)
        return out, state, tuple(rings)

    return verify


class Conv(NamedTuple):
    weight: jax.Array      # [D, Kc]
    bias: jax.Array | None
    backend: str | None


def recurrent_layer(conv_in: jax.Array, conv: Conv, core: MixerCore, plan: DevicePlan,
                    pool: RecurrentPool) -> tuple[jax.Array, RecurrentPool]:
    """conv_in [T, D] pre-conv inputs -> (the core's outputs [T, ...], the layer's pool after the step)."""
    # Each stage reads pages that the next one writes: the barriers order them, or XLA copies whole pools
    # to keep the old values alive. For the same reason decode rows run unconditionally (cheap: at most
    # W + 1 + K entries per row); only the prefill path sits behind a cond.
    pool = jax.lax.optimization_barrier(_materialize(core, plan, pool))
    pool = jax.lax.optimization_barrier(copy_pages(pool, plan.hit_copy_src, plan.hit_copy_dst, plan.num_hit_copies))
    decode = plan.row_kind >= RowKind.DECODE
    num_decode = jnp.sum(decode, dtype=jnp.int32)  # decode and verify rows come first in every plan
    split = plan.cu_seqlens[num_decode]
    out_decode, pool = _decode_rows(conv_in, conv, core, plan, decode, split, pool)
    pool = jax.lax.optimization_barrier(pool)
    any_prefill = jnp.any(plan.row_kind == RowKind.PREFILL)
    out_prefill, pool = jax.lax.cond(any_prefill, lambda p: _prefill_rows(conv_in, conv, core, plan, num_decode, p),
                                     lambda p: (jnp.zeros(core.out.shape, core.out.dtype), p), pool)
    before = (jnp.arange(conv_in.shape[0]) < split).reshape((-1,) + (1,) * (out_decode.ndim - 1))
    out = jnp.where(before, out_decode, out_prefill)
    pool = jax.lax.optimization_barrier(pool)
    return out, copy_pages(pool, plan.publish_src, plan.publish_dst, plan.num_publishes)


def _max_committed(plan: DevicePlan, pool: RecurrentPool) -> int:
    """The fold's static bound, from the ring's rows and the plan's draft width."""
    return max_committed(pool.rings[0].shape[2], plan.draft_token_ids.shape[1])


def _materialize(core: MixerCore, plan: DevicePlan, pool: RecurrentPool) -> RecurrentPool:
    def one(pool: RecurrentPool, *entry) -> RecurrentPool:
        state = (snapshot_materialize(pool.state, *pool.rings, *entry) if has_snapshots(pool.rings)
                 else core.materialize(pool.state, pool.rings, *entry, max_committed=_max_committed(plan, pool)))
        return pool._replace(state=state, window=conv1d_materialize(pool.window, pool.conv_ring, *entry))

    return for_each_entry(plan.num_materializations, one, pool, plan.materialize_src, plan.materialize_dst,
                          plan.materialize_ring_start, plan.materialize_count)


def _decode_rows(conv_in, conv: Conv, core: MixerCore, plan: DevicePlan, decode, split,
                 pool: RecurrentPool) -> tuple[jax.Array, RecurrentPool]:
    # A decode or verify row has 1 + K tokens at most (K = the plan's static draft width) and these rows come
    # first, so their tokens lie in the bucket's first R (1 + K): a mixed bucket's other tokens are prefill's.
    max_query_len = 1 + plan.draft_token_ids.shape[1]
    head = min(conv_in.shape[0], plan.row_kind.shape[0] * max_query_len)
    cu = jnp.minimum(plan.cu_seqlens, split)
    slots = jnp.where(decode, plan.state_slots, 0)
    trackers = (plan.ring_start, plan.ring_committed, plan.flush & decode)
    conv_out, window, conv_ring = conv1d_replay(conv_in[:head], conv.weight, conv.bias, cu, pool.window,
                                                pool.conv_ring, slots, *trackers, backend=conv.backend)
    out, state, rings = core.verify(conv_out, cu, pool.state, pool.rings, slots, *trackers, max_query_len,
                                    _max_committed(plan, pool))
    out = jnp.pad(out, ((0, conv_in.shape[0] - head),) + ((0, 0),) * (out.ndim - 1))
    return out, RecurrentPool(window, state, rings, conv_ring)


def _prefill_rows(conv_in, conv: Conv, core: MixerCore, plan: DevicePlan, num_decode,
                  pool: RecurrentPool) -> tuple[jax.Array, RecurrentPool]:
    prefill = plan.row_kind == RowKind.PREFILL
    # prefill rows are ordered phase 1 (producers cut at their checkpoint) first; decode rows become empty
    num_first = num_decode + jnp.sum(prefill & (plan.phase == 1), dtype=jnp.int32)

    def run(cu, pages, slots, has_initial):
        window, state = pages
        conv_out, window = conv1d_prefill(conv_in, conv.weight, conv.bias, cu, window, slots, has_initial,
                                          backend=conv.backend)
        out, state = core.prefill(conv_out, cu, state, slots, has_initial)
        return out, (window, state)

    out, (window, state) = grouped_prefill(
        run, jnp.maximum(plan.cu_seqlens, plan.cu_seqlens[num_decode]), num_first, (pool.window, pool.state),
        jnp.where(prefill, plan.state_slots, 0), plan.has_initial_state & prefill, plan.pair_copy_src,
        plan.pair_copy_dst)
    return out, pool._replace(window=window, state=state)

