"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 linear attention) over packed varlen tokens."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.config import GDNConfig
from jaxhybrid.models.layers import GatedRMSNorm
from jaxhybrid.models.ops import CHUNKED, ModelOps


class RecurrentState(NamedTuple):
    """Per-row state of one recurrent layer (GDN or Mamba2)."""

    conv: jax.Array  # [R, Kc-1, conv_dim]; last Kc-1 pre-conv inputs, oldest first
    ssm: jax.Array  # [R, HV, K, V] f32 (GDN) | [R, NH, P, N] f32 (Mamba2)


class GatedDeltaNet(nn.Module):
    """in_proj -> causal conv1d -> gated delta rule -> gated RMSNorm -> out_proj.

    Parameters use one layout for both families: `in_proj_qkvz` is contiguous `[q | k | v | z]` and
    `in_proj_ba` is `[b | a]`; the loader converts Qwen3-Next's grouped-by-key-head layout once.
    """

    cfg: GDNConfig
    norm_eps: float
    ops: ModelOps = CHUNKED

    @nn.compact
    def __call__(self, x: jax.Array, cu_seqlens: jax.Array, state: RecurrentState) -> tuple[jax.Array, RecurrentState]:
        cfg, num_tokens = self.cfg, x.shape[0]
        qkvz = nn.Dense(cfg.conv_dim + cfg.value_dim, use_bias=False, dtype=x.dtype, name="in_proj_qkvz")(x)
        ba = nn.Dense(2 * cfg.num_v_heads, use_bias=False, dtype=x.dtype, name="in_proj_ba")(x)
        conv_weight = self.param("conv1d", nn.initializers.normal(0.2), (cfg.conv_dim, cfg.conv_kernel), jnp.float32)
        mixed, conv_window = self.ops.conv1d(qkvz[:, : cfg.conv_dim], conv_weight.astype(x.dtype), None, cu_seqlens,
                                           state.conv)
        q = mixed[:, : cfg.key_dim].reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
        k = mixed[:, cfg.key_dim : 2 * cfg.key_dim].reshape(num_tokens, cfg.num_k_heads, cfg.head_k_dim)
        v = mixed[:, 2 * cfg.key_dim :].reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
        z = qkvz[:, cfg.conv_dim :].reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim)
        b, a = ba[:, : cfg.num_v_heads], ba[:, cfg.num_v_heads :]
        a_log = self.param("A_log", nn.initializers.zeros, (cfg.num_v_heads,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (cfg.num_v_heads,), jnp.float32)
        # Gates in fp32, as HF: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
        out, ssm = self.ops.gdn(q, k, v, g, beta, cu_seqlens, state.ssm)
        out = GatedRMSNorm(self.norm_eps, norm_before_gate=True, name="norm")(out, z)
        out = nn.Dense(x.shape[-1], use_bias=False, dtype=x.dtype, name="out_proj")(out.reshape(num_tokens, -1))
        return out, RecurrentState(conv_window, ssm)
