"""Mamba2 mixer (Nemotron-H) over packed varlen tokens."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxhybrid.models.config import Mamba2Config
from jaxhybrid.models.layers import Dense, GatedRMSNorm
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import RecurrentPool
from jaxhybrid.models.recurrent import Conv, MixerCore, recurrent_layer, ring_verify
from jaxhybrid.models.tensor_parallel import recurrent_pool_specs
from pallas_kernels.mamba2 import ssd_materialize, ssd_prefill, ssd_verify, ssd_verify_snapshots


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt] -> causal conv1d on xBC -> SSD -> gate-then-norm (grouped) -> out_proj.

    Under tensor parallelism `in_proj` and the conv are in per-device blocks of that layout, by groups
    (`tensor_parallel.to_tp_layout`), and everything between the projections runs on each device's heads.
    """

    cfg: Mamba2Config
    norm_eps: float
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, x: jax.Array, plan: DevicePlan, pool: RecurrentPool) -> tuple[jax.Array, RecurrentPool]:
        cfg, num_tokens = self.cfg, x.shape[0]
        inner = cfg.intermediate_size
        proj = Dense(inner + cfg.conv_dim + cfg.num_heads, use_bias=cfg.proj_bias, dtype=x.dtype,
                        name="in_proj")(x)
        conv_weight = self.param("conv1d", nn.initializers.normal(0.2), (cfg.conv_dim, cfg.conv_kernel), jnp.float32)
        conv_bias = (self.param("conv1d_bias", nn.initializers.zeros, (cfg.conv_dim,), jnp.float32)
                     if cfg.use_conv_bias else None)
        a_log = self.param("A_log", nn.initializers.zeros, (cfg.num_heads,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (cfg.num_heads,), jnp.float32)
        d = self.param("D", nn.initializers.ones, (cfg.num_heads,), jnp.float32)
        conv = (conv_weight.astype(x.dtype), None if conv_bias is None else conv_bias.astype(x.dtype))
        local, heads = self.ops.local_heads(cfg)
        pool_specs = recurrent_pool_specs(pool, heads)
        mix = self.ops.on_local_heads(
            functools.partial(_mix, local, self.ops),
            in_specs=(P(None, heads), P(heads), P(heads), P(heads), P(heads), P(), pool_specs),
            out_specs=(P(None, heads), P(None, heads), pool_specs))
        y, z, pool = mix(proj, conv, a_log, dt_bias, d, plan, pool)
        y = GatedRMSNorm(self.norm_eps, norm_before_gate=False, group_size=inner // cfg.n_groups, name="norm")(
            y.reshape(num_tokens, inner), z)
        out = Dense(x.shape[-1], use_bias=cfg.proj_bias, dtype=x.dtype, name="out_proj")(y)
        return out, pool


def _mix(cfg: Mamba2Config, ops: ModelOps, proj: jax.Array, conv: tuple[jax.Array, jax.Array | None],
         a_log: jax.Array, dt_bias: jax.Array, d: jax.Array, plan: DevicePlan,
         pool: RecurrentPool) -> tuple[jax.Array, jax.Array, RecurrentPool]:
    """The mixer between its projections on the heads `cfg` counts -> (SSD out [T, NH, P], gate z [T, NH * P],
    the pool after the step)."""
    inner = cfg.intermediate_size
    z, xbc, dt = proj[:, :inner], proj[:, inner : inner + cfg.conv_dim], proj[:, inner + cfg.conv_dim :]
    # Mirrors HF mamba2_chunk_scan: softplus(dt + dt_bias), clamped to (time_step_min, inf).
    dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + dt_bias), cfg.dt_min, cfg.dt_max)
    out_shape = jax.ShapeDtypeStruct((proj.shape[0], cfg.num_heads, cfg.head_dim), proj.dtype)
    core = _core(cfg, ops, dt, -jnp.exp(a_log), d, out_shape)
    y, pool = recurrent_layer(xbc, Conv(*conv, ops.backend), core, plan, pool)
    return y, z, pool


def _core(cfg: Mamba2Config, ops: ModelOps, dt: jax.Array, a: jax.Array, d: jax.Array,
          out_shape: jax.ShapeDtypeStruct) -> MixerCore:
    backend = ops.backend
    inner, groups_width = cfg.intermediate_size, cfg.n_groups * cfg.state_size

    def inputs(mixed):  # mixed: the step's first tokens (all of them, or the decode rows' head)
        num_tokens = mixed.shape[0]
        xs = mixed[:, :inner].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        b = mixed[:, inner : inner + groups_width].reshape(num_tokens, cfg.n_groups, cfg.state_size)
        c = mixed[:, inner + groups_width :].reshape(num_tokens, cfg.n_groups, cfg.state_size)
        return xs, dt[:num_tokens], a, b, c, d

    return MixerCore(
        prefill=lambda mixed, cu, state, slots, has_initial: ssd_prefill(
            *inputs(mixed), cu, state, slots, has_initial, chunk_size=cfg.chunk_size, backend=ops.state_backend()),
        verify=ring_verify(ssd_verify, ssd_verify_snapshots, inputs, ops.state_backend()),
        materialize=lambda state, rings, *copies, max_committed: ssd_materialize(
            state, *rings, a, *copies, max_committed=max_committed, backend=backend),
        out=out_shape)
