"""A HuggingFace config.json (or a preset YAML of its fields) to a `ModelConfig`, per model family."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml

from jaxhybrid.models.config import (
    ATTENTION,
    GDN,
    MAMBA2,
    MLP,
    MOE,
    AttentionConfig,
    ConfigError,
    GDNConfig,
    Mamba2Config,
    ModelConfig,
    MoEConfig,
    QuantConfig,
    YarnScaling,
)

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "nemotron_h")

_NEMOTRON_BLOCKS = {"M": MAMBA2, "*": ATTENTION, "-": MLP, "E": MOE}
_NEMOTRON_LAYER_TYPES = {
    "linear_attention": MAMBA2, "mamba": MAMBA2, "full_attention": ATTENTION, "attention": ATTENTION,
    "mlp": MLP, "moe": MOE,
}


def _require(cfg: dict[str, Any], name: str, model_type: str) -> Any:
    if name not in cfg or cfg[name] is None:
        raise ConfigError(f"config.json for model_type {model_type!r} is missing required field {name!r}")
    return cfg[name]


def _rope(cfg: dict[str, Any], head_dim: int) -> tuple[int, float, YarnScaling | None]:
    # transformers 5's `rope_parameters`, with an older `rope_scaling` (as --hf-overrides may add) over it
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope", "yarn"):
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default' and 'yarn')")
    yarn = _yarn(rope, cfg) if rope_type == "yarn" else None
    return int(head_dim * factor), float(theta), yarn


def _yarn(rope: dict[str, Any], cfg: dict[str, Any]) -> YarnScaling:
    """YaRN's parameters with transformers' defaults: `original_max_position_embeddings` from the config's top
    level first, else the rope dict, else `max_position_embeddings`; a missing `factor` is the ratio of the two;
    `attention_factor` from `mscale` / `mscale_all_dim` where both are set, else 0.1 ln(factor) + 1."""
    max_len = cfg.get("max_position_embeddings", 32768)
    original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_len
    factor = rope.get("factor") or max_len / original
    if factor < 1:
        raise ConfigError(f"rope_parameters.factor must be at least 1 for 'yarn', got {factor}")

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        both = rope.get("mscale") and rope.get("mscale_all_dim")
        attention_factor = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"]) if both else mscale(1)
    return YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                       beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                       attention_factor=float(attention_factor), truncate=bool(rope.get("truncate", True)))


def eos_token_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    """A config's (config.json or generation_config.json) `eos_token_id`, one id or a list, as a tuple."""
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _qwen_layer_types(cfg: dict[str, Any], model_type: str) -> list[str]:
    num_layers = _require(cfg, "num_hidden_layers", model_type)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = cfg.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}")
    unknown = set(layer_types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"layer_types has unknown entries {sorted(unknown)}")
    return layer_types


def _parse_qwen(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    req = lambda name: _require(cfg, name, model_type)
    head_dim = cfg.get("head_dim") or req("hidden_size") // req("num_attention_heads")
    rotary_dim, theta, yarn = _rope(cfg, head_dim)
    num_experts = cfg.get("num_experts", 0) if model_type == "qwen3_next" else 0
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    sparse_step = cfg.get("decoder_sparse_step", 1)

    def ffn(i: int) -> str:
        return MOE if num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 else MLP

    mixers = {"linear_attention": GDN, "full_attention": ATTENTION}
    layers = tuple((mixers[t], ffn(i)) for i, t in enumerate(_qwen_layer_types(cfg, model_type)))
    moe = None
    if num_experts > 0:
        moe = MoEConfig(
            num_experts=num_experts, top_k=req("num_experts_per_tok"),
            intermediate_size=req("moe_intermediate_size"),
            shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True), router="softmax", shared_expert_gate=True,
        )
    num_mtp = cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers", 0)) or 0
    mtp_ffn = MOE if moe is not None else MLP
    return ModelConfig(
        model_type=model_type, vocab_size=req("vocab_size"), hidden_size=req("hidden_size"), layers=layers,
        norm_eps=cfg.get("rms_norm_eps", 1e-6), zero_centered_norm=True,
        intermediate_size=cfg.get("intermediate_size") or 0, mlp_activation="silu", mlp_bias=False,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        gdn=GDNConfig(
            num_k_heads=req("linear_num_key_heads"), num_v_heads=req("linear_num_value_heads"),
            head_k_dim=req("linear_key_head_dim"), head_v_dim=req("linear_value_head_dim"),
            conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        ),
        attention=AttentionConfig(
            num_heads=req("num_attention_heads"), num_kv_heads=req("num_key_value_heads"), head_dim=head_dim,
            rotary_dim=rotary_dim, rope_theta=theta, qk_norm=True, output_gate=True,
            bias=cfg.get("attention_bias", False), yarn=yarn,
        ),
        moe=moe, mtp_layers=((ATTENTION, mtp_ffn),) * num_mtp, eos_token_id=eos_token_ids(cfg),
    )


def _nemotron_layers(cfg: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    if cfg.get("layers_block_type") is not None:
        names = cfg["layers_block_type"]
        unknown = set(names) - set(_NEMOTRON_LAYER_TYPES)
        if unknown:
            raise ConfigError(f"layers_block_type has unknown entries {sorted(unknown)}")
        return tuple((_NEMOTRON_LAYER_TYPES[n],) for n in names)
    pattern = _require(cfg, "hybrid_override_pattern", "nemotron_h")
    unknown = set(pattern) - set(_NEMOTRON_BLOCKS)
    if unknown:
        raise ConfigError(f"hybrid_override_pattern has unknown characters {sorted(unknown)}")
    return tuple((_NEMOTRON_BLOCKS[c],) for c in pattern)


def _parse_nemotron(cfg: dict[str, Any]) -> ModelConfig:
    req = lambda name: _require(cfg, name, "nemotron_h")
    layers = _nemotron_layers(cfg)
    kinds = {k for layer in layers for k in layer}
    get = lambda new, old, default: cfg.get(new, cfg.get(old, default))
    mamba = None
    if MAMBA2 in kinds:
        mamba = Mamba2Config(
            num_heads=req("mamba_num_heads"), head_dim=req("mamba_head_dim"), state_size=req("ssm_state_size"),
            n_groups=get("n_groups", "mamba_n_groups", 8), conv_kernel=get("conv_kernel", "mamba_d_conv", 4),
            chunk_size=get("chunk_size", "mamba_chunk_size", 128),
            use_conv_bias=get("use_conv_bias", "mamba_conv_bias", True),
            proj_bias=cfg.get("use_bias", cfg.get("mamba_proj_bias", False)),
            dt_min=float(get("time_step_min", "mamba_dt_min", 0.001)), dt_max=math.inf,
        )
    attention = None
    if ATTENTION in kinds:
        num_heads = req("num_attention_heads")
        attention = AttentionConfig(
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or req("hidden_size") // num_heads, rotary_dim=0, rope_theta=0.0,
            qk_norm=False, output_gate=False, bias=cfg.get("attention_bias", False),
        )
    moe = None
    if MOE in kinds:
        moe = MoEConfig(
            num_experts=req("n_routed_experts"), top_k=req("num_experts_per_tok"),
            intermediate_size=req("moe_intermediate_size"),
            shared_intermediate_size=req("moe_shared_expert_intermediate_size"),
            norm_topk_prob=cfg.get("norm_topk_prob", True), router="sigmoid",
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
            latent_size=cfg.get("moe_latent_size"),
        )
    mlp_act = cfg.get("mlp_hidden_act", "relu2")
    if mlp_act != "relu2":
        raise ConfigError(f"mlp_hidden_act {mlp_act!r} is not supported for nemotron_h (only 'relu2')")
    return ModelConfig(
        model_type="nemotron_h", vocab_size=req("vocab_size"), hidden_size=req("hidden_size"), layers=layers,
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5), zero_centered_norm=False,
        intermediate_size=cfg.get("intermediate_size") or 0, mlp_activation="relu2",
        mlp_bias=cfg.get("mlp_bias", False), tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        mamba2=mamba, attention=attention, moe=moe, eos_token_id=eos_token_ids(cfg),
    )


def parse_quantization(cfg: dict[str, Any], hf_quant_config: dict[str, Any] | None = None) -> QuantConfig | None:
    """The FP8 quantization a config.json's `quantization_config` (or ModelOpt's hf_quant_config.json, which
    takes precedence, as in vLLM) declares; None for an unquantized checkpoint. Other methods and formats
    (e5m2, NVFP4, AWQ, ...) are a ConfigError rather than weights read as something they are not."""
    if hf_quant_config is not None:
        section = hf_quant_config.get("quantization", hf_quant_config)
        return _modelopt(section, section.get("exclude_modules") or [])
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt(quant, quant.get("ignore") or quant.get("exclude_modules") or [])
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8' and 'modelopt' "
                          f"FP8 checkpoints)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return QuantConfig(method="fp8", weight_block=None if block is None else (block[0], block[1]),
                       activation_scheme=quant.get("activation_scheme", "dynamic"),
                       not_converted=tuple(quant.get("modules_to_not_convert") or ()))


def _modelopt(section: dict[str, Any], excluded: list[str]) -> QuantConfig:
    algo = str(section.get("quant_algo", "")).upper()
    if algo != "FP8":
        raise ConfigError(f"ModelOpt quant_algo {algo or None!r} is not supported (only 'FP8', per-tensor scales)")
    return QuantConfig(method="modelopt", activation_scheme="static", not_converted=tuple(excluded))


def parse_hf_config(cfg: dict[str, Any], hf_quant_config: dict[str, Any] | None = None) -> ModelConfig:
    """Build a `ModelConfig` from the dict of a HuggingFace config.json (or a YAML preset of one), with the
    quantization it (or a ModelOpt hf_quant_config.json) declares."""
    model = _parse_architecture(cfg)
    quantization = parse_quantization(cfg, hf_quant_config)
    return model if quantization is None else dataclasses.replace(model, quantization=quantization)


def _parse_architecture(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ConfigError("config.json has no 'model_type' field")
    if model_type == "qwen3_5":
        text = cfg.get("text_config")
        if text is None:
            raise ConfigError("config.json for model_type 'qwen3_5' is missing required field 'text_config'")
        text = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **text}
        return _parse_qwen(text, "qwen3_5_text")
    if model_type in ("qwen3_next", "qwen3_5_text"):
        return _parse_qwen(cfg, model_type)
    if model_type == "nemotron_h":
        return _parse_nemotron(cfg)
    raise ConfigError(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def merge_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's --hf-overrides: `overrides` over `config`, nested dicts merged key by key, anything else replaced."""
    merged = dict(config)
    for key, value in (overrides or {}).items():
        old = merged.get(key)
        merged[key] = merge_overrides(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged


def read_raw_config(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], Path]:
    """A checkpoint directory's config.json, a config.json file, or a YAML preset as a dict with `overrides`
    merged in (`merge_overrides`), and the file it was read from."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"no config.json at {path}")
    text = path.read_text()
    raw = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    return merge_overrides(raw, overrides), path


def load_config(path: str | Path, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    """Parse a checkpoint directory's config.json, a config.json file, or a YAML preset, with `hf_overrides`
    merged into it first (`merge_overrides`)."""
    raw, path = read_raw_config(path, hf_overrides)
    modelopt = path.parent / "hf_quant_config.json"
    return parse_hf_config(raw, json.loads(modelopt.read_text()) if modelopt.is_file() else None)
