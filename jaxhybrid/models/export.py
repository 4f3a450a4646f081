"""jaxhybrid params -> a HuggingFace Qwen3-Next checkpoint directory (the inverse of `weights.translate`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxhybrid.models.config import GDNConfig, ModelConfig
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.stack import layer_segments, per_layer

# Our kind-independent sublayer names -> Qwen checkpoint module names.
_SUBLAYERS = {"norm_0": "input_layernorm", "norm_1": "post_attention_layernorm", "gdn": "linear_attn",
              "attention": "self_attn", "mlp": "mlp", "moe": "mlp"}
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def _group_qkvz(w: np.ndarray, gdn: GDNConfig) -> np.ndarray:
    """Contiguous `[q | k | v | z]` rows -> Qwen3-Next's `[q_g | k_g | v_g | z_g]` per key head g."""
    widths = [gdn.key_dim, gdn.key_dim, gdn.value_dim, gdn.value_dim]
    parts = np.split(w, np.cumsum(widths)[:-1], axis=0)
    grouped = [p.reshape(gdn.num_k_heads, -1, w.shape[-1]) for p in parts]
    return np.concatenate(grouped, axis=1).reshape(w.shape)


def _group_ba(w: np.ndarray, gdn: GDNConfig) -> np.ndarray:
    b, a = (p.reshape(gdn.num_k_heads, -1, w.shape[-1]) for p in np.split(w, 2, axis=0))
    return np.concatenate([b, a], axis=1).reshape(w.shape)


def _module_tensors(name: str, module: str, leaf: str, w: np.ndarray,
                    cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """One param of a module; `name` is the checkpoint prefix of the module's parent."""
    if leaf == "conv1d":
        yield f"{name}.conv1d.weight", w.reshape(w.shape[0], 1, -1)
    elif leaf == "conv1d_bias":
        yield f"{name}.conv1d.bias", w
    elif leaf == "router":
        yield f"{name}.gate.weight", w.T
    elif leaf == "e_score_correction_bias":
        yield f"{name}.gate.e_score_correction_bias", w
    elif leaf in _EXPERT_WEIGHTS:  # stacked [E, in, out] -> per-expert [out, in]
        for e, expert in enumerate(w):
            yield f"{name}.experts.{e}.{leaf}.weight", expert.T
    elif module == "in_proj_qkvz":
        yield f"{name}.{module}.weight", _group_qkvz(w.T, cfg.gdn)
    elif module == "in_proj_ba":
        yield f"{name}.{module}.weight", _group_ba(w.T, cfg.gdn)
    elif leaf == "kernel":
        yield f"{name}.{module}.weight", w.T
    elif module:
        yield f"{name}.{module}.{leaf}", w
    else:
        yield f"{name}.{leaf}", w


def _layer_tensors(prefix: str, path: tuple[str, ...], w: np.ndarray,
                   cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """A decoder-layer param: path is (sublayer, [module...,] leaf) below the layer."""
    if path[0].startswith("norm_"):
        yield f"{prefix}.{_SUBLAYERS[path[0]]}.weight", w
        return
    name = f"{prefix}.{_SUBLAYERS[path[0]]}"
    inner = path[1:]
    if inner[0] == "shared_expert" and len(inner) > 2:
        name, inner = f"{name}.shared_expert", inner[1:]
    module = ".".join(inner[:-1])
    yield from _module_tensors(name, module, inner[-1], w, cfg)


def hf_tensors(params: Any, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Every param as (HuggingFace Qwen3-Next tensor name, float array in HF layout)."""
    flat = jax.tree_util.tree_flatten_with_path(per_layer(params, layer_segments(cfg.layers)))[0]
    for keys, leaf in flat:
        path, w = tuple(k.key for k in keys), np.asarray(leaf)
        if path == ("embed_tokens", "embedding"):
            yield "model.embed_tokens.weight", w
        elif path == ("norm", "weight"):
            yield "model.norm.weight", w
        elif path == ("lm_head", "kernel"):
            yield "lm_head.weight", w.T
        elif path[0].startswith("layers_"):
            yield from _layer_tensors(f"model.layers.{path[0].removeprefix('layers_')}", path[1:], w, cfg)
        elif path[0] == "mtp" and path[1].startswith("layers_"):
            yield from _layer_tensors(f"mtp.layers.{path[1].removeprefix('layers_')}", path[2:], w, cfg)
        elif path[0] == "mtp":
            yield from _module_tensors("mtp", path[1], path[2], w, cfg)
        else:
            raise ValueError(f"no HuggingFace name for parameter {'/'.join(path)}")


def export_hf_checkpoint(params: Any, hf_config: dict[str, Any], directory: str | Path) -> None:
    """Write `config.json` and `model.safetensors` under HuggingFace Qwen3-Next names (MTP under `mtp.*`)."""
    cfg = parse_hf_config(hf_config)
    if not cfg.model_type.startswith("qwen3_next"):
        raise ValueError(f"export supports model_type 'qwen3_next', got {cfg.model_type!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(w) for name, w in hf_tensors(params, cfg)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only; it ships in the wheel
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
