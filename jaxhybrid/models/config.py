"""Model configuration: one `ModelConfig` for all three families (`hf_config` parses it from a config.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Sublayer kinds. A decoder layer is a tuple of them, each preceded by its own pre-norm and followed by a
# residual add: Qwen layers are (mixer, ffn), Nemotron-H blocks are a single kind.
GDN, MAMBA2, ATTENTION, MLP, MOE = "gdn", "mamba2", "attention", "mlp", "moe"
RECURRENT_KINDS = (GDN, MAMBA2)

class ConfigError(ValueError):
    """A config.json that jaxhybrid cannot build a model from; the message names the field."""


@dataclass(frozen=True)
class GDNConfig:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Mamba2Config:
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    proj_bias: bool
    dt_min: float  # lower clamp of the processed dt (HF NemotronH uses (time_step_min, inf))
    dt_max: float

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (transformers' `_compute_yarn_parameters`): frequencies interpolated by `factor` below
    `beta_slow` rotations over `original_max_position_embeddings` and kept above `beta_fast`, a linear ramp
    between; cos and sin scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # 0 = no rotary embedding (Nemotron-H)
    rope_theta: float
    qk_norm: bool
    output_gate: bool
    bias: bool
    yarn: YarnScaling | None = None  # None: plain rope


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool
    router: str  # "softmax" (Qwen3-Next) | "sigmoid" (Nemotron-H, DeepSeek-V3 style)
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_gate: bool = False
    latent_size: int | None = None


@dataclass(frozen=True)
class QuantConfig:
    """An FP8 checkpoint's quantization: e4m3 weights, each with float32 scales (weight = fp8 value * scale).

    `weight_block` is the (rows, columns) of the checkpoint's `[out, in]` weight that one scale covers
    (Qwen's `weight_block_size`, partial blocks at the edges); None: the scale's own shape says (ModelOpt's
    one scale per tensor). The loader keeps whichever weights are stored in FP8 as they are, so
    `not_converted` (the modules the checkpoint left in 16 bits) is informative."""

    method: str  # "fp8" (block-wise, Qwen) | "modelopt" (per tensor, NVIDIA ModelOpt)
    weight_block: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"  # "static": the checkpoint also stores each input's scale (unused)
    not_converted: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[tuple[str, ...], ...]
    norm_eps: float
    zero_centered_norm: bool  # Qwen: y = x̂ (1 + w); Nemotron-H: y = x̂ w
    intermediate_size: int
    mlp_activation: str  # "silu" = gated SwiGLU; "relu2" = non-gated squared ReLU
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    gdn: GDNConfig | None = None
    mamba2: Mamba2Config | None = None
    attention: AttentionConfig | None = None
    moe: MoEConfig | None = None
    mtp_layers: tuple[tuple[str, ...], ...] = ()
    eos_token_id: tuple[int, ...] = ()
    quantization: QuantConfig | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def conv_kernel(self) -> int:
        return (self.gdn or self.mamba2).conv_kernel

    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent state slot (fp32 state + conv window in the activation dtype, 2 B)."""
        per_layer = {GDN: 0, MAMBA2: 0}
        if self.gdn:
            g = self.gdn
            per_layer[GDN] = 4 * g.num_v_heads * g.head_k_dim * g.head_v_dim + 2 * (g.conv_kernel - 1) * g.conv_dim
        if self.mamba2:
            m = self.mamba2
            per_layer[MAMBA2] = 4 * m.num_heads * m.head_dim * m.state_size + 2 * (m.conv_kernel - 1) * m.conv_dim
        return sum(per_layer[k] for layer in self.layers for k in layer if k in per_layer)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token over all attention layers, the MTP layers included."""
        if self.attention is None:
            return 0
        a = self.attention
        num_attention = sum(k == ATTENTION for layer in self.layers + self.mtp_layers for k in layer)
        return num_attention * 2 * a.num_kv_heads * a.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
