"""DeviceState: the pools one engine step reads and writes (docs/engine.md#memory-model).

Per attention layer (the MTP layers included) a paged KV pool (the model's dtype or fp8, `CacheDtypes`); per
recurrent layer a state-slot pool whose slot is one page: the conv window at S0, the state S0 (fp32 or bf16), and
the fp32 ReplaySSM rings of the mixer's inputs and of the pre-conv inputs after S0. Slot 0 and block 0 are null:
all zeros, never written by a real row. The runner donates the whole pytree to every step.

Pools follow the layer stack's segments (`stack.py`): per segment, one pool per period position, stacked
on a leading `repeats` axis, `[repeats, S, ...]`, where the segment repeats. (A segment of one repeat keeps
its pools unstacked: XLA:CPU copies a donated pool whose leading axis of one sits beside other axes of one.)
Inside the step a layer sees its repeat's pages through `repeat_view`: the stack as one flat pool
`[repeats * S, ...]` (a free reshape, so the kernels still update it in place) and a plan whose slot or block
indices point at its repeat's pages. Null indices stay 0, the first repeat's null page, which the kernels
never write; the other repeats' null pages go unused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxhybrid.models.config import ATTENTION, GDN, MLP, MOE, ModelConfig
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.stack import layer_segments

KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}  # vLLM's spellings
MAMBA_SSM_CACHE_DTYPES = {"auto": jnp.float32, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


class CacheDtypes(NamedTuple):
    """What the pools store, by vLLM's --kv-cache-dtype and --mamba-ssm-cache-dtype names, and the KV pools'
    per-tensor scales: an fp8 pool holds K / k_scale and V / v_scale (vLLM's default scale is 1.0)."""

    kv: str = "auto"      # "auto": the model's dtype
    state: str = "auto"   # "auto": float32
    k_scale: float = 1.0
    v_scale: float = 1.0

    def kv_dtype(self, model_dtype: jnp.dtype) -> jnp.dtype:
        return jnp.dtype(KV_CACHE_DTYPES[self.kv] or model_dtype)

    def state_dtype(self) -> jnp.dtype:
        return jnp.dtype(MAMBA_SSM_CACHE_DTYPES[self.state])


AUTO_CACHE = CacheDtypes()


class KVPool(NamedTuple):
    k: jax.Array  # [num_blocks, block_size, kv_heads, head_dim]; block 0 is the null block
    v: jax.Array


class RecurrentPool(NamedTuple):
    """One recurrent layer's slot pages; every ring has W + 1 + K entries on its axis 2."""

    window: jax.Array             # [S, Kc-1, conv_dim] the conv window at S0, oldest first
    state: jax.Array              # [S, HV, K, V] (GDN) | [S, NH, P, N] (Mamba2) S0, f32 or bf16 (computed in f32)
    # GDN (k^, u, g) | Mamba2 (x, dt, B), see pallas_kernels.gdn / .mamba2; with W = 0 (snapshots,): the
    # whole state after each entry, [S, heads, E, ...]
    rings: tuple[jax.Array, ...]
    conv_ring: jax.Array          # [S, 1, W, conv_dim] pre-conv inputs after S0


LayerPool = RecurrentPool | KVPool | None


class DeviceState(NamedTuple):
    # per segment of the layer stack, per period position: its slot pool, KV pool, or None (stacked on a leading
    # repeats axis where the segment repeats)
    layers: tuple[tuple[LayerPool, ...], ...]
    mtp: tuple[KVPool, ...]        # one KV pool per MTP layer
    token_history: jax.Array       # [S, H] i32 the token at each position of each slot's sequence (penalties)


def layer_pools(state: DeviceState) -> list[LayerPool]:
    """Every layer position's stacked pool (None for a layer without one), segment by segment."""
    return [pool for segment in state.layers for pool in segment]


def repeat_view(plan: DevicePlan, pool: LayerPool, repeat: jax.Array,
                repeats: int) -> tuple[DevicePlan, LayerPool, Callable]:
    """(the plan with its indices on repeat `repeat`'s pages, the stacked pool as one flat pool, a function
    that stacks a flat pool back). A segment of one repeat keeps its pools unstacked: the pool itself."""
    if pool is None or repeats == 1:
        return plan, pool, lambda pages: pages
    per_repeat = jax.tree.leaves(pool)[0].shape[1]
    flat = jax.tree.map(lambda a: a.reshape(repeats * per_repeat, *a.shape[2:]), pool)
    restack = lambda pages: jax.tree.map(lambda a: a.reshape(repeats, per_repeat, *a.shape[1:]), pages)
    offset = repeat * per_repeat
    if isinstance(pool, KVPool):
        return plan.on_blocks(offset, block_size=pool.k.shape[2]), flat, restack
    return plan.on_slots(offset), flat, restack


def copy_pages(pool: Any, src: jax.Array, dst: jax.Array, count: jax.Array) -> Any:
    """pool[dst[i]] = pool[src[i]] for i < count, for every array of the pytree `pool`. A loop over the real
    entries only: the lists are padded to the row bucket, and gathering that many whole pages every step
    would cost more than the step."""

    def one(i, pool):
        move = lambda p: jax.lax.dynamic_update_index_in_dim(p, jax.lax.dynamic_index_in_dim(p, src[i]), dst[i], 0)
        return jax.tree.map(move, pool)

    return jax.lax.fori_loop(0, count, one, pool)


def for_each_entry(count: jax.Array, fn: Callable, pool: Any, *lists: jax.Array) -> Any:
    """pool <- fn(pool, *(l[i:i+1] for l in lists)) for i < count: a per-entry op over the real entries of
    padded lists only."""

    def one(i, pool):
        return fn(pool, *(jax.lax.dynamic_slice_in_dim(values, i, 1) for values in lists))

    return jax.lax.fori_loop(0, count, one, pool)


def _kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> KVPool:
    a = cfg.attention
    shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
    return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def has_snapshots(rings: tuple[jax.Array, ...]) -> bool:
    """The snapshot-every-position baseline's pages keep one ring, of whole states."""
    return len(rings) == 1


def _recurrent_pool(cfg: ModelConfig, kind: str, num_slots: int, ring_entries: int, dtype: jnp.dtype,
                    state_dtype: jnp.dtype, snapshots: bool) -> RecurrentPool:
    s, w = num_slots, ring_entries
    if kind == GDN:
        g = cfg.gdn
        state = (s, g.num_v_heads, g.head_k_dim, g.head_v_dim)
        rings = ((s, g.num_k_heads, w, g.head_k_dim), (s, g.num_v_heads, w, g.head_v_dim), (s, g.num_v_heads, w))
        mixer = g
    else:
        m = cfg.mamba2
        state = (s, m.num_heads, m.head_dim, m.state_size)
        rings = ((s, m.num_heads, w, m.head_dim), (s, m.num_heads, w), (s, m.n_groups, w, m.state_size))
        mixer = m
    if snapshots:
        rings = ((s, state[1], w, *state[2:]),)
    return RecurrentPool(jnp.zeros((s, mixer.conv_kernel - 1, mixer.conv_dim), dtype),
                         jnp.zeros(state, state_dtype), tuple(jnp.zeros(shape, jnp.float32) for shape in rings),
                         jnp.zeros((s, 1, w, mixer.conv_dim), dtype))


def init_device_state(cfg: ModelConfig, *, num_blocks: int, block_size: int, num_slots: int, ring_entries: int,
                      history_len: int = 1, dtype: jnp.dtype = jnp.float32, snapshots: bool = False,
                      cache: CacheDtypes = AUTO_CACHE) -> DeviceState:
    """Zero pools: `num_blocks` KV blocks and `num_slots` state slots (nulls included), rings of
    `ring_entries` = W + 1 + K entries (whole states with `snapshots`), token histories of `history_len`
    positions. Activations (conv windows, rings) in `dtype`; KV pools and states as `cache` says."""

    def pool(kinds: tuple[str, ...]) -> LayerPool:
        stateful = [k for k in kinds if k not in (MLP, MOE)]
        if not stateful:
            return None
        if stateful[0] == ATTENTION:
            return _kv_pool(cfg, num_blocks, block_size, cache.kv_dtype(dtype))
        return _recurrent_pool(cfg, stateful[0], num_slots, ring_entries, dtype, cache.state_dtype(), snapshots)

    def stacked(kinds: tuple[str, ...], repeats: int) -> LayerPool:
        if repeats == 1:
            return pool(kinds)
        return jax.tree.map(lambda a: jnp.zeros((repeats, *a.shape), a.dtype), jax.eval_shape(lambda: pool(kinds)))

    layers = tuple(tuple(stacked(kinds, segment.repeats) for kinds in segment.period)
                   for segment in layer_segments(cfg.layers))
    mtp = tuple(pool((ATTENTION,)) for _ in cfg.mtp_layers)
    return DeviceState(layers, mtp, jnp.zeros((num_slots, history_len), jnp.int32))
