"""The default model's architecture (a HuggingFace qwen3_next config.json) and training hyperparameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    vocab_size: int = 4096
    seq_len: int = 512
    batch_size: int = 4
    num_steps: int = 1600
    warmup_steps: int = 50
    peak_lr: float = 8e-3
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_loss_weight: float = 1.0

    @property
    def warmup(self) -> int:
        return min(self.warmup_steps, self.num_steps - 1)  # short smoke runs still get a decay phase


def hf_config(vocab_size: int, eos_token_id: int, max_len: int) -> dict[str, Any]:
    """A Qwen3-Next config at toy size: 6 layers, full attention every third, dense MLP, one MTP layer.

    Sized so fp32 weights stay under 8 MB (tied embeddings; the 4k-row embedding is a third of the model).
    """
    num_layers = 6
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": num_layers, "full_attention_interval": 3,
        "layer_types": ["full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(num_layers)],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": 0, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": max_len,
        "num_nextn_predict_layers": 1, "eos_token_id": eos_token_id, "bos_token_id": None,
        "pad_token_id": eos_token_id, "initializer_range": 0.02, "use_cache": True,
    }
