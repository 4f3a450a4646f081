"""Mamba2 mixer (Nemotron-H) over packed varlen tokens."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.config import Mamba2Config
from jaxhybrid.models.gdn import RecurrentState
from jaxhybrid.models.layers import GatedRMSNorm
from jaxhybrid.models.ops import CHUNKED, ModelOps


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt] -> causal conv1d on xBC -> SSD -> gate-then-norm (grouped) -> out_proj."""

    cfg: Mamba2Config
    norm_eps: float
    ops: ModelOps = CHUNKED

    @nn.compact
    def __call__(self, x: jax.Array, cu_seqlens: jax.Array, state: RecurrentState) -> tuple[jax.Array, RecurrentState]:
        cfg, num_tokens = self.cfg, x.shape[0]
        inner, groups_width = cfg.intermediate_size, cfg.n_groups * cfg.state_size
        proj = nn.Dense(inner + cfg.conv_dim + cfg.num_heads, use_bias=cfg.proj_bias, dtype=x.dtype,
                        name="in_proj")(x)
        z, xbc, dt = proj[:, :inner], proj[:, inner : inner + cfg.conv_dim], proj[:, inner + cfg.conv_dim :]
        conv_weight = self.param("conv1d", nn.initializers.normal(0.2), (cfg.conv_dim, cfg.conv_kernel), jnp.float32)
        conv_bias = (self.param("conv1d_bias", nn.initializers.zeros, (cfg.conv_dim,), jnp.float32)
                     if cfg.use_conv_bias else None)
        xbc, conv_window = self.ops.conv1d(xbc, conv_weight.astype(x.dtype),
                                         None if conv_bias is None else conv_bias.astype(x.dtype), cu_seqlens,
                                         state.conv)
        xs = xbc[:, :inner].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        b = xbc[:, inner : inner + groups_width].reshape(num_tokens, cfg.n_groups, cfg.state_size)
        c = xbc[:, inner + groups_width :].reshape(num_tokens, cfg.n_groups, cfg.state_size)
        a_log = self.param("A_log", nn.initializers.zeros, (cfg.num_heads,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (cfg.num_heads,), jnp.float32)
        d = self.param("D", nn.initializers.ones, (cfg.num_heads,), jnp.float32)
        # Mirrors HF mamba2_chunk_scan: softplus(dt + dt_bias), clamped to (time_step_min, inf).
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + dt_bias), cfg.dt_min, cfg.dt_max)
        y, ssm = self.ops.ssd(xs, dt, -jnp.exp(a_log), b, c, d, cu_seqlens, state.ssm, chunk_size=cfg.chunk_size)
        y = GatedRMSNorm(self.norm_eps, norm_before_gate=False, group_size=inner // cfg.n_groups, name="norm")(
            y.reshape(num_tokens, inner), z)
        out = nn.Dense(x.shape[-1], use_bias=cfg.proj_bias, dtype=x.dtype, name="out_proj")(y)
        return out, RecurrentState(conv_window, ssm)
