"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 linear attention) over packed varlen tokens."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxhybrid.models.config import GDNConfig
from jaxhybrid.models.layers import Dense, GatedRMSNorm
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import RecurrentPool
from jaxhybrid.models.recurrent import Conv, MixerCore, recurrent_layer, ring_verify
from jaxhybrid.models.tensor_parallel import recurrent_pool_specs
from pallas_kernels.gdn import gdn_materialize, gdn_verify, gdn_verify_snapshots


class GatedDeltaNet(nn.Module):
    """in_proj -> causal conv1d -> gated delta rule -> gated RMSNorm -> out_proj.

    Parameters use one layout for both families: `in_proj_qkvz` is contiguous `[q | k | v | z]` and
    `in_proj_ba` is `[b | a]`; the loader converts Qwen3-Next's grouped-by-key-head layout once. Under
    tensor parallelism both are in per-device blocks of that layout (`tensor_parallel.to_tp_layout`), and
    everything between the projections runs on each device's own heads.
    """

    cfg: GDNConfig
    norm_eps: float
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, x: jax.Array, plan: DevicePlan, pool: RecurrentPool) -> tuple[jax.Array, RecurrentPool]:
        cfg, num_tokens = self.cfg, x.shape[0]
        qkvz = Dense(cfg.conv_dim + cfg.value_dim, use_bias=False, dtype=x.dtype, name="in_proj_qkvz")(x)
        ba = Dense(2 * cfg.num_v_heads, use_bias=False, dtype=x.dtype, name="in_proj_ba")(x)
        conv_weight = self.param("conv1d", nn.initializers.normal(0.2), (cfg.conv_dim, cfg.conv_kernel), jnp.float32)
        a_log = self.param("A_log", nn.initializers.zeros, (cfg.num_v_heads,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (cfg.num_v_heads,), jnp.float32)
        local, heads = self.ops.local_heads(cfg)
        pool_specs = recurrent_pool_specs(pool, heads)
        mix = self.ops.on_local_heads(
            functools.partial(_mix, local, self.ops),
            in_specs=(P(None, heads), P(None, heads), P(heads), P(heads), P(heads), P(), pool_specs),
            out_specs=(P(None, heads), P(None, heads), pool_specs))
        out, z, pool = mix(qkvz, ba, conv_weight.astype(x.dtype), a_log, dt_bias, plan, pool)
        out = GatedRMSNorm(self.norm_eps, norm_before_gate=True, name="norm")(out, z)
        out = Dense(x.shape[-1], use_bias=False, dtype=x.dtype, name="out_proj")(out.reshape(num_tokens, -1))
        return out, pool


def _mix(cfg: GDNConfig, ops: ModelOps, qkvz: jax.Array, ba: jax.Array, conv_weight: jax.Array, a_log: jax.Array,
         dt_bias: jax.Array, plan: DevicePlan, pool: RecurrentPool) -> tuple[jax.Array, jax.Array, RecurrentPool]:
    """The mixer between its projections on the heads `cfg` counts -> (core out [T, HV, V], gate z [T, HV, V],
    the pool after the step)."""
    num_tokens = qkvz.shape[0]
    z = qkvz[:, cfg.conv_dim :].reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
    b, a = ba[:, : cfg.num_v_heads], ba[:, cfg.num_v_heads :]
    # Gates in fp32, as HF: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
    core = _core(cfg, ops, g, beta, jax.ShapeDtypeStruct(z.shape, z.dtype))
    out, pool = recurrent_layer(qkvz[:, : cfg.conv_dim], Conv(conv_weight, None, ops.backend), core, plan, pool)
    return out, z, pool


def _core(cfg: GDNConfig, ops: ModelOps, g: jax.Array, beta: jax.Array, out_shape: jax.ShapeDtypeStruct) -> MixerCore:
    backend = ops.backend

    def heads(mixed):  # mixed: the step's first tokens (all of them, or the decode rows' head)
        num_tokens = mixed.shape[0]
        q = mixed[:, : cfg.key_dim].reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
        k = mixed[:, cfg.key_dim : 2 * cfg.key_dim].reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
        v = mixed[:, 2 * cfg.key_dim :].reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
        return q, k, v, g[:num_tokens], beta[:num_tokens]

    return MixerCore(
        prefill=lambda mixed, cu, state, slots, has_initial: ops.gdn_prefill(
            *heads(mixed), cu, state, slots, has_initial, backend=ops.state_backend()),
        verify=ring_verify(gdn_verify, gdn_verify_snapshots, heads, ops.state_backend()),
        materialize=lambda state, rings, *copies, max_committed: gdn_materialize(
            state, *rings, *copies, max_committed=max_committed, backend=backend),
        out=out_shape)
