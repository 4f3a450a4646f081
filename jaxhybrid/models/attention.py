"""Full attention over the paged KV pool: Qwen3-Next gated attention and Nemotron-H plain GQA."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxhybrid.models.config import AttentionConfig
from jaxhybrid.models.layers import Dense, RMSNorm, apply_rotary
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import KVPool
from jaxhybrid.models.tensor_parallel import kv_pool_specs


class Attention(nn.Module):
    cfg: AttentionConfig
    norm_eps: float
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, x: jax.Array, plan: DevicePlan, pool: KVPool) -> tuple[jax.Array, KVPool]:
        cfg, num_tokens = self.cfg, x.shape[0]
        dense = lambda n, name: Dense(n, use_bias=cfg.bias, dtype=x.dtype, name=name)
        q_width = cfg.num_heads * cfg.head_dim * (2 if cfg.output_gate else 1)
        q = dense(q_width, "q_proj")(x).reshape(num_tokens, cfg.num_heads, -1)
        k = dense(cfg.num_kv_heads * cfg.head_dim, "k_proj")(x).reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = dense(cfg.num_kv_heads * cfg.head_dim, "v_proj")(x).reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        # Qwen3-Next splits q_proj per head into [query | gate] (HF `torch.chunk(..., 2, dim=-1)`).
        q, gate = (q[..., : cfg.head_dim], q[..., cfg.head_dim :]) if cfg.output_gate else (q, None)
        if cfg.qk_norm:
            q = RMSNorm(self.norm_eps, zero_centered=True, name="q_norm")(q)
            k = RMSNorm(self.norm_eps, zero_centered=True, name="k_norm")(k)
        q = apply_rotary(q, plan.positions, cfg.rotary_dim, cfg.rope_theta, cfg.yarn)
        k = apply_rotary(k, plan.positions, cfg.rotary_dim, cfg.rope_theta, cfg.yarn)
        _, heads = self.ops.local_heads(cfg)
        attend = self.ops.on_local_heads(functools.partial(_attend, self.ops, cfg.head_dim**-0.5),
                                         in_specs=(P(None, heads),) * 3 + (kv_pool_specs(heads), P()),
                                         out_specs=(P(None, heads), *kv_pool_specs(heads)))
        out, k_pool, v_pool = attend(q, k, v, pool, plan)
        out = out.reshape(num_tokens, cfg.num_heads * cfg.head_dim)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.reshape(out.shape).astype(jnp.float32)).astype(out.dtype)
        return dense(x.shape[-1], "o_proj")(out), KVPool(k_pool, v_pool)


def _attend(ops: ModelOps, scale: float, q: jax.Array, k: jax.Array, v: jax.Array, pool: KVPool,
            plan: DevicePlan) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel on the heads it is given: under tensor parallelism each device's own query heads and
    their kv heads (the pool split on its kv-head axis), or all of them where tp does not divide the kv
    heads (pool and heads replicated)."""
    # fp8 pools' scales only where they are not 1: a swapped attention op (training's) takes none
    cache = ops.cache
    scales = {} if cache.k_scale == cache.v_scale == 1.0 else {"k_scale": cache.k_scale, "v_scale": cache.v_scale}
    return ops.attention(q, k, v, pool.k, pool.v, plan.slot_mapping, plan.block_table, plan.cu_seqlens,
                         plan.context_lens, scale=scale, backend=ops.backend, **scales)
