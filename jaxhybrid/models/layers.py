"""Small Flax building blocks shared by every family: norms, rotary embedding, MLP and MoE."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.models.config import ModelConfig, MoEConfig, YarnScaling
from jaxhybrid.models.experts import ExpertWeights, routed_experts
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.matmul import cpu as matmul_cpu
from pallas_kernels.moe import cpu as experts_cpu
from pallas_kernels.moe.reference import ACTIVATIONS

SCALE_SUFFIX = "_scale"  # an FP8 param `name` has its float32 scales beside it as `name + SCALE_SUFFIX`


class Dense(nn.Dense):
    """`nn.Dense`, whose kernel may be an FP8 checkpoint's: where the params hold `kernel_scale` beside
    `kernel`, the kernel is float8 [blocks, block, in -> out] with scales [blocks, out]
    (`pallas_kernels.fp8_matmul`), kept so on the device and dequantized inside the step. A kernel packed for
    the CPU kernel (`pallas_kernels.matmul.cpu.packed_params`) runs that kernel."""

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.get_variable("params", "kernel")  # None while initialising
        if kernel is not None and matmul_cpu.is_packed(kernel):
            y = matmul_cpu.matmul(inputs.astype(self.dtype or jnp.result_type(inputs, kernel)), kernel)
        elif self.has_variable("params", "kernel" + SCALE_SUFFIX):
            # XLA's dot on every platform: it is split under tensor parallelism, and reads a scanned layer's weight
            # in place (docs/kernels.md#fp8-weight-matmul)
            scale = self.get_variable("params", "kernel" + SCALE_SUFFIX)
            y = fp8_matmul(inputs.astype(self.dtype or inputs.dtype), kernel, scale, backend="reference")
        else:
            return super().__call__(inputs)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,), self.param_dtype).astype(y.dtype)
        return y


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm in fp32. Qwen's is zero-centred, `x̂ (1 + w)` with w initialised to 0; Nemotron-H's is `x̂ w`."""

    eps: float
    zero_centered: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), jnp.float32)
        scale = 1.0 + weight if self.zero_centered else weight
        return (rms_normalize(x, self.eps) * scale).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated RMSNorm with a plain (ones-initialised) weight.

    GDN normalises then gates, per value head (`norm_before_gate=True`); Mamba2 gates then normalises within
    each of `n_groups` contiguous channel groups (mirrors HF `NemotronHRMSNormGated`).
    """

    eps: float
    norm_before_gate: bool
    group_size: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        silu_gate = jax.nn.silu(gate.astype(jnp.float32))
        if self.norm_before_gate:
            return (rms_normalize(x, self.eps) * weight * silu_gate).astype(x.dtype)
        y = x.astype(jnp.float32) * silu_gate
        group = self.group_size or x.shape[-1]
        grouped = y.reshape(*y.shape[:-1], y.shape[-1] // group, group)
        y = rms_normalize(grouped, self.eps).reshape(y.shape)
        return (y * weight).astype(x.dtype)


def rope_frequencies(rotary_dim: int, theta: float, yarn: YarnScaling | None = None) -> tuple[np.ndarray, float]:
    """The inverse frequencies (float32 [rotary_dim // 2]) of NeoX RoPE and the factor cos and sin are scaled
    by: plain RoPE's `theta ** (-2i / d)` and 1, or YaRN's (transformers' `_compute_yarn_parameters`)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
    extrapolated = (1.0 / pos_freqs).astype(np.float32)
    if yarn is None:
        return extrapolated, 1.0
    interpolated = (1.0 / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns
        return (rotary_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp  # 1: extrapolated (high-frequency dims), 0: interpolated by `factor`
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), yarn.attention_factor


def apply_rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float,
                 yarn: YarnScaling | None = None) -> jax.Array:
    """NeoX rotate-half RoPE (YaRN-scaled where `yarn` is given) on the first `rotary_dim` dims of each head.
    x: [T, heads, D], positions: [T]."""
    if rotary_dim == 0:
        return x
    inv_freq, scale = rope_frequencies(rotary_dim, theta, yarn)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], axis=-1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], axis=-1))[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    rot, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([(rot * cos + rotated * sin).astype(x.dtype), rest], axis=-1)


class MLP(nn.Module):
    """SwiGLU `down(silu(gate(x)) * up(x))` (Qwen) or non-gated `down(relu²(up(x)))` (Nemotron-H)."""

    intermediate_size: int
    activation: str
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda n, name: Dense(n, use_bias=self.use_bias, dtype=x.dtype, name=name)
        up = dense(self.intermediate_size, "up_proj")(x)
        if self.activation == "silu":
            hidden = jax.nn.silu(dense(self.intermediate_size, "gate_proj")(x)) * up
        else:
            hidden = ACTIVATIONS[self.activation](up)
        return dense(x.shape[-1], "down_proj")(hidden)


def _softmax_router(logits: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    # Mirrors HF Qwen3NextTopKRouter: softmax over all experts in fp32, top-k, optional renormalisation.
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.top_k)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def _sigmoid_group_router(logits: jax.Array, bias: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    # Mirrors HF NemotronHTopkRouter (DeepSeek-V3): the bias only steers the choice, weights come from sigmoid.
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    per_group = choice.reshape(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
    group_scores = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    group_mask = jnp.zeros_like(group_scores).at[jnp.arange(group_scores.shape[0])[:, None], top_groups].set(1.0)
    expert_mask = jnp.repeat(group_mask, cfg.num_experts // cfg.n_group, axis=-1) > 0
    _, experts = jax.lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), cfg.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts plus a shared expert (Qwen3-Next: SwiGLU with a sigmoid gate; Nemotron-H: relu² MLP).

    Experts are stacked `[E, in, out]`; each token runs through its top-k experts only (`routed_experts`).
    """

    cfg: MoEConfig
    activation: str
    use_bias: bool = False
    platform: str | None = None  # whose constants lay out the experts (`plan_experts`); None: the default backend's

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        router = self.param("router", nn.initializers.normal(0.02), (x.shape[-1], cfg.num_experts), jnp.float32)
        logits = x.astype(jnp.float32) @ router
        if cfg.router == "softmax":
            weights, experts = _softmax_router(logits, cfg)
        else:
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (cfg.num_experts,), jnp.float32)
            weights, experts = _sigmoid_group_router(logits, bias, cfg)
        routed_in = x if cfg.latent_size is None else Dense(
            cfg.latent_size, use_bias=self.use_bias, dtype=x.dtype, name="fc1_latent_proj")(x)
        params = self._expert_weights(routed_in.shape[-1])
        if matmul_cpu.is_packed(params.up):  # packed for the CPU kernel (`Runner`)
            routed = experts_cpu.routed_experts(routed_in, weights, experts, params.up, params.down, params.gate,
                                                activation=self.activation)
        else:
            routed = routed_experts(routed_in, weights, experts, params, ACTIVATIONS[self.activation],
                                    platform=self.platform)
        if cfg.latent_size is not None:
            routed = Dense(x.shape[-1], use_bias=self.use_bias, dtype=x.dtype, name="fc2_latent_proj")(routed)
        shared = MLP(cfg.shared_intermediate_size, self.activation, self.use_bias, name="shared_expert")(x)
        if cfg.shared_expert_gate:
            gate = Dense(1, use_bias=False, dtype=x.dtype, name="shared_expert_gate")(x)
            shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype) * shared
        return routed + shared

    def _expert_weights(self, dim: int) -> ExpertWeights:
        """The stacked experts, with their scales where the checkpoint's are FP8 (as in `Dense`), or packed."""
        experts, inter = self.cfg.num_experts, self.cfg.intermediate_size
        shapes = {"up_proj": (experts, dim, inter), "down_proj": (experts, inter, dim)}
        if self.activation == "silu":
            shapes["gate_proj"] = (experts, dim, inter)
        stored = self.get_variable("params", "up_proj")  # None while initialising
        packed = stored is not None and matmul_cpu.is_packed(stored)
        if packed or self.has_variable("params", "up_proj" + SCALE_SUFFIX):
            arrays = {key: self.get_variable("params", key) for n in shapes for key in (n, n + SCALE_SUFFIX)}
        else:
            arrays = {n: self.param(n, nn.initializers.normal(0.02), shape, jnp.float32) for n, shape in shapes.items()}
        return ExpertWeights(arrays["up_proj"], arrays["down_proj"], arrays.get("gate_proj"),
                             *(arrays.get(n + SCALE_SUFFIX) for n in ("up_proj", "down_proj", "gate_proj")))


def make_ffn(kind: str, cfg: ModelConfig, name: str, platform: str | None = None) -> nn.Module:
    if kind == "moe":
        return MoE(cfg.moe, cfg.mlp_activation, cfg.mlp_bias, platform, name=name)
    return MLP(cfg.intermediate_size, cfg.mlp_activation, cfg.mlp_bias, name=name)
