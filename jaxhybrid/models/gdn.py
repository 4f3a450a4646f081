"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 linear attention) over packed varlen tokens."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.config import GDNConfig
from jaxhybrid.models.layers import GatedRMSNorm
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.pools import RecurrentPool, has_snapshots
from jaxhybrid.models.recurrent import Conv, MixerCore, recurrent_layer
from jaxhybrid.plan_transfer import DevicePlan
from pallas_kernels.gdn import gdn_materialise, gdn_verify, gdn_verify_snapshots


class GatedDeltaNet(nn.Module):
    """in_proj -> causal conv1d -> gated delta rule -> gated RMSNorm -> out_proj.

    Parameters use one layout for both families: `in_proj_qkvz` is contiguous `[q | k | v | z]` and
    `in_proj_ba` is `[b | a]`; the loader converts Qwen3-Next's grouped-by-key-head layout once.
    """

    cfg: GDNConfig
    norm_eps: float
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, x: jax.Array, plan: DevicePlan, pool: RecurrentPool) -> tuple[jax.Array, RecurrentPool]:
        cfg, num_tokens, backend = self.cfg, x.shape[0], self.ops.backend
        qkvz = nn.Dense(cfg.conv_dim + cfg.value_dim, use_bias=False, dtype=x.dtype, name="in_proj_qkvz")(x)
        ba = nn.Dense(2 * cfg.num_v_heads, use_bias=False, dtype=x.dtype, name="in_proj_ba")(x)
        conv_weight = self.param("conv1d", nn.initializers.normal(0.2), (cfg.conv_dim, cfg.conv_kernel), jnp.float32)
        z = qkvz[:, cfg.conv_dim :].reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
        b, a = ba[:, : cfg.num_v_heads], ba[:, cfg.num_v_heads :]
        a_log = self.param("A_log", nn.initializers.zeros, (cfg.num_v_heads,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (cfg.num_v_heads,), jnp.float32)
        # Gates in fp32, as HF: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)

        def heads(mixed):
            q = mixed[:, : cfg.key_dim].reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
            k = mixed[:, cfg.key_dim : 2 * cfg.key_dim].reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
            v = mixed[:, 2 * cfg.key_dim :].reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
            return q, k, v, g, beta

        def verify(mixed, cu, state, rings, slots, ring_start, committed, flush, max_query_len):
            op = gdn_verify_snapshots if has_snapshots(rings) else gdn_verify
            out, state, *rings = op(*heads(mixed), cu, state, *rings, slots, ring_start, committed, flush,
                                    max_query_len=max_query_len, backend=backend)
            return out, state, tuple(rings)

        core = MixerCore(
            prefill=lambda mixed, cu, state, slots, has_initial: self.ops.gdn_prefill(
                *heads(mixed), cu, state, slots, has_initial, backend=backend),
            verify=verify,
            materialise=lambda state, rings, *copies: gdn_materialise(state, *rings, *copies, backend=backend),
            out=jax.ShapeDtypeStruct((num_tokens, cfg.num_v_heads, cfg.head_v_dim), x.dtype))
        conv = Conv(conv_weight.astype(x.dtype), None, backend)
        out, pool = recurrent_layer(qkvz[:, : cfg.conv_dim], conv, core, plan, pool)
        out = GatedRMSNorm(self.norm_eps, norm_before_gate=True, name="norm")(out, z)
        out = nn.Dense(x.shape[-1], use_bias=False, dtype=x.dtype, name="out_proj")(out.reshape(num_tokens, -1))
        return out, pool
