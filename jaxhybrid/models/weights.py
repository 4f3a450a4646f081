"""HuggingFace safetensors -> jaxhybrid params (one name-map table), streamed; orbax save/restore."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxhybrid.models.config import GDNConfig, ModelConfig
from jaxhybrid.models.generation_config import read_generation_config
from jaxhybrid.models.hf_config import eos_token_ids, load_config, parse_hf_config
from jaxhybrid.models.model import Model, abstract_params
from jaxhybrid.models.stack import is_stacked, layer_location, layer_segments, segment_key

Path_ = tuple[str, ...]
# A converted tensor, or one part of a tensor assembled from several checkpoint tensors.
Piece = tuple[Path_, Any, np.ndarray]  # (param path, part key or None, array)


DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "assets" / "default_model"
# What a checkpoint is served from, fetched from the hub (as vLLM fetches them): config, generation config,
# tokenizer and chat template, the safetensors and their index.
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "*.safetensors", "*.safetensors.index.json"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or tensors."""


# Checkpoint prefixes that all mean "the language model".
_PREFIXES = (("model.language_model.", "model."), ("backbone.", "model."), ("language_model.model.", "model."))
_IGNORED = re.compile(r"^(model\.visual\.|visual\.|.*rotary_emb\.inv_freq$)")
# Sublayer module names in checkpoints -> our kind-independent slot in the layer.
_QWEN_SUBLAYERS = {"input_layernorm": "norm_0", "post_attention_layernorm": "norm_1"}
_QWEN_MODULES = {"linear_attn": 0, "self_attn": 0, "mlp": 1}
_NORM_NAMES = ("norm", "q_norm", "k_norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm_0", "norm_1")


def _canonical(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _regroup_qkvz(w: np.ndarray, gdn: GDNConfig) -> np.ndarray:
    """Qwen3-Next grouped-by-key-head `[q_g | k_g | v_g | z_g]` rows -> contiguous `[q | k | v | z]`."""
    r = gdn.num_v_heads // gdn.num_k_heads
    widths = [gdn.head_k_dim, gdn.head_k_dim, r * gdn.head_v_dim, r * gdn.head_v_dim]
    grouped = w.reshape(gdn.num_k_heads, sum(widths), -1)
    parts = np.split(grouped, np.cumsum(widths)[:-1], axis=1)
    return np.concatenate([p.reshape(-1, w.shape[-1]) for p in parts], axis=0)


def _regroup_ba(w: np.ndarray, gdn: GDNConfig) -> np.ndarray:
    r = gdn.num_v_heads // gdn.num_k_heads
    grouped = w.reshape(gdn.num_k_heads, 2 * r, -1)
    return np.concatenate([grouped[:, :r].reshape(-1, w.shape[-1]), grouped[:, r:].reshape(-1, w.shape[-1])])


def _module_tensor(path: Path_, leaf: str, w: np.ndarray, cfg: ModelConfig) -> Iterator[Piece]:
    """One tensor of a module (`path` is our module path, `leaf` the checkpoint's last name parts)."""
    module = path[-1]
    if leaf == "weight" and module in _NORM_NAMES:
        yield path + ("weight",), None, w
    elif leaf == "weight" and module == "conv1d":
        yield path[:-1] + ("conv1d",), None, w.reshape(w.shape[0], -1)
    elif leaf == "bias" and module == "conv1d":
        yield path[:-1] + ("conv1d_bias",), None, w
    elif module == "in_proj_qkvz":
        yield path + ("kernel",), None, _regroup_qkvz(w, cfg.gdn).T
    elif module == "in_proj_ba":
        yield path + ("kernel",), None, _regroup_ba(w, cfg.gdn).T
    elif module in ("in_proj_qkv", "in_proj_z"):  # Qwen3.5 split projections -> one [q|k|v|z] kernel
        yield path[:-1] + ("in_proj_qkvz", "kernel"), module, w.T
    elif module in ("in_proj_b", "in_proj_a"):
        yield path[:-1] + ("in_proj_ba", "kernel"), module, w.T
    elif module == "gate" and leaf == "weight":  # MoE router
        yield path[:-1] + ("router",), None, w.T
    elif module == "gate" and leaf == "e_score_correction_bias":
        yield path[:-1] + ("e_score_correction_bias",), None, w
    elif leaf in ("weight", "bias"):
        yield path + ("kernel" if leaf == "weight" else "bias",), None, w.T if leaf == "weight" else w
    else:
        yield path + (leaf,), None, w


def _expert_tensor(path: Path_, rest: list[str], w: np.ndarray) -> Iterator[Piece]:
    """Routed experts, per-expert (`experts.3.up_proj.weight`) or stacked (`experts.gate_up_proj`)."""
    if rest[0].isdigit():
        yield path + (rest[1],), int(rest[0]), w.T
    elif rest[0] == "gate_up_proj":
        gate, up = np.split(w, 2, axis=1)
        yield path + ("gate_proj",), None, gate.transpose(0, 2, 1)
        yield path + ("up_proj",), None, up.transpose(0, 2, 1)
    else:
        yield path + (rest[0],), None, w.transpose(0, 2, 1)


def _layer_tensor(prefix: Path_, kinds: tuple[str, ...], parts: list[str], w: np.ndarray,
                  cfg: ModelConfig) -> Iterator[Piece]:
    if parts[0] in _QWEN_SUBLAYERS:
        yield prefix + (_QWEN_SUBLAYERS[parts[0]], "weight"), None, w
        return
    if parts[0] == "norm":  # Nemotron-H block pre-norm
        yield prefix + ("norm_0", "weight"), None, w
        return
    slot = _QWEN_MODULES.get(parts[0], 0)  # Nemotron-H: "mixer" is the block's only sublayer
    if slot >= len(kinds):
        raise CheckpointError(f"tensor for sublayer {parts[0]!r} but this layer only has {kinds}")
    path, rest = prefix + (kinds[slot],), parts[1:]
    if rest[0] in ("shared_expert", "shared_experts"):
        path, rest = path + ("shared_expert",), rest[1:]
    if rest[0] == "experts":
        yield from _expert_tensor(path, rest[1:], w)
        return
    yield from _module_tensor(path + tuple(rest[:-1]), rest[-1], w, cfg)


def translate(name: str, w: np.ndarray, cfg: ModelConfig) -> Iterator[Piece]:
    """Map one checkpoint tensor to the params it contributes to. Raises CheckpointError on unknown names."""
    name = _canonical(name)
    if _IGNORED.match(name):
        return
    parts = name.split(".")
    if name in ("model.embed_tokens.weight", "model.embeddings.weight"):
        yield ("embed_tokens", "embedding"), None, w
    elif name in ("model.norm.weight", "model.norm_f.weight"):
        yield ("norm", "weight"), None, w
    elif name == "lm_head.weight":
        if not cfg.tie_word_embeddings:
            yield ("lm_head", "kernel"), None, w.T
    elif parts[:2] == ["model", "layers"] and len(parts) > 3 and int(parts[2]) < cfg.num_layers:
        yield from _layer_tensor((f"layers_{parts[2]}",), cfg.layers[int(parts[2])], parts[3:], w, cfg)
    elif parts[0] == "mtp" and parts[1] == "layers" and int(parts[2]) < len(cfg.mtp_layers):
        yield from _layer_tensor(("mtp", f"layers_{parts[2]}"), cfg.mtp_layers[int(parts[2])], parts[3:], w, cfg)
    elif parts[0] == "mtp" and len(parts) == 3 and cfg.mtp_layers:
        yield from _module_tensor(("mtp", parts[1]), parts[2], w, cfg)
    elif parts[0] == "mtp" and not cfg.mtp_layers:
        return  # a checkpoint's MTP weights when the config declares no MTP layers
    else:
        raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")


# Multi-part params: how the parts combine, in order.
def _combine(path: Path_, parts: dict[Any, np.ndarray], cfg: ModelConfig) -> np.ndarray | None:
    module = path[-2] if path[-1] == "kernel" else path[-1]
    if module == "in_proj_qkvz":
        order = ["in_proj_qkv", "in_proj_z"]
    elif module == "in_proj_ba":
        order = ["in_proj_b", "in_proj_a"]
    else:
        order = list(range(cfg.moe.num_experts))
    if not all(key in parts for key in order):
        return None
    arrays = [parts.pop(key) for key in order]
    return np.concatenate(arrays, axis=1) if isinstance(order[0], str) else np.stack(arrays)


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"safetensors files listed in the index are missing: {missing}")
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def _parent(tree: dict, path: Path_) -> dict:
    """The dict that holds `path`'s last key, created on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    return tree


def _set(tree: dict, path: Path_, value: Any) -> None:
    _parent(tree, path)[path[-1]] = value


def _flatten(tree: Any) -> dict[Path_, Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in keys): leaf for keys, leaf in flat}


def convert_checkpoint(tensors: Callable[[], Iterator[tuple[str, np.ndarray]]], cfg: ModelConfig,
                       dtype: jnp.dtype) -> dict:
    """Stream checkpoint tensors into a params tree of device arrays; each tensor is converted once, and a
    layer's tensor is written into its repeat of the segment's stacked param, in place."""
    expected = _per_layer_shapes(cfg)
    params: dict = {}
    loaded: set[Path_] = set()
    wrong_shapes = []
    for name, path, array in _converted(tensors, cfg):
        if path not in expected:
            raise CheckpointError(f"tensor {name!r} maps to unknown parameter {'/'.join(path)}")
        if tuple(array.shape) != expected[path]:
            wrong_shapes.append(f"{name} -> {'/'.join(path)}: {tuple(array.shape)} != {expected[path]}")
            continue
        _place(params, path, jnp.asarray(array, dtype), cfg)
        loaded.add(path)
    if wrong_shapes:
        raise CheckpointError("tensors with wrong shapes:\n  " + "\n  ".join(wrong_shapes))
    missing = sorted("/".join(p) for p in set(expected) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: {missing[:20]}")
    return params


def _converted(tensors: Callable[[], Iterator[tuple[str, np.ndarray]]],
               cfg: ModelConfig) -> Iterator[tuple[str, Path_, np.ndarray]]:
    """(checkpoint name, param path in the per-layer layout, array) of each param, multi-part ones once whole."""
    pending: dict[Path_, dict[Any, np.ndarray]] = {}
    for name, tensor in tensors():
        for path, part, array in translate(name, tensor, cfg):
            if part is not None:
                pending.setdefault(path, {})[part] = array
                array = _combine(path, pending[path], cfg)
                if array is None:
                    continue
                del pending[path]
            yield name, path, array


def _per_layer_shapes(cfg: ModelConfig) -> dict[Path_, tuple[int, ...]]:
    """Every param's path and shape in the checkpoint's per-layer layout (`layers_{i}/...`)."""
    shapes = {}
    for path, leaf in _flatten(abstract_params(cfg)).items():
        if not is_stacked(path):
            shapes[path] = leaf.shape
            continue
        k, j = int(path[0].removeprefix("segment_")), int(path[1].removeprefix("layers_"))
        segment = layer_segments(cfg.layers)[k]
        for r in range(segment.repeats):
            shapes[(f"layers_{segment.layer(j, r)}", *path[2:])] = leaf.shape[1:]
    return shapes


def _place(params: dict, path: Path_, value: jax.Array, cfg: ModelConfig) -> None:
    """params[path] = value, a layer's param going into its repeat of the stacked one."""
    if not path[0].startswith("layers_"):
        _set(params, path, value)
        return
    segments = layer_segments(cfg.layers)
    k, j, r = layer_location(int(path[0].removeprefix("layers_")), segments)
    stacked_path = (segment_key(k), f"layers_{j}", *path[1:])
    parent, leaf = _parent(params, stacked_path), stacked_path[-1]
    stacked = parent.get(leaf, None)
    if stacked is None:
        stacked = jnp.zeros((segments[k].repeats, *value.shape), value.dtype)
    parent[leaf] = _set_repeat(stacked, value, r)


@functools.partial(jax.jit, donate_argnums=0)
def _set_repeat(stacked: jax.Array, value: jax.Array, repeat: int) -> jax.Array:
    return stacked.at[repeat].set(value)


def resolve_model(model: str | Path | None, revision: str | None = None, download_dir: str | Path | None = None
                  ) -> Path:
    """The checkpoint directory `model` names: the embedded default model for None, an existing directory
    as it is, else a Hugging Face hub id (`org/name`) fetched at `revision` with `huggingface_hub`, into
    `download_dir` or its cache (HF_HUB_CACHE / HF_HOME); with HF_HUB_OFFLINE=1 only from that cache."""
    if model is None:
        return DEFAULT_MODEL_DIR
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(str(model), revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES,
                                      local_files_only=offline))
    except (OSError, ValueError) as error:  # not found, offline and not cached, not a valid id, ...
        at = f" at revision {revision!r}" if revision else ""
        where = " (HF_HUB_OFFLINE is set: only the local cache was searched)" if offline else ""
        raise CheckpointError(f"checkpoint directory {str(model)!r} does not exist, and as a Hugging Face hub id it "
                              f"could not be fetched{at}{where}: {type(error).__name__}: {error}") from error


def load_model(path: str | Path | None = None, dtype: Any = jnp.float32, *, revision: str | None = None,
               download_dir: str | Path | None = None, **model_kwargs: Any) -> Model:
    """Load a HuggingFace checkpoint (or one saved by `save_params`) as a `Model`: a directory or a hub id
    (`resolve_model`). With no path, loads the embedded default model shipped in `jaxhybrid/assets/`.
    """
    directory = resolve_model(path, revision, download_dir)
    config = load_config(directory)
    if (directory / "params").is_dir():
        params = restore_params(directory / "params", config, dtype)
    else:
        params = convert_checkpoint(lambda: _iter_tensors(_checkpoint_files(directory)), config, dtype)
    extra_eos = [t for t in eos_token_ids(read_generation_config(directory)) if t not in config.eos_token_id]
    model = Model(dataclasses.replace(config, eos_token_id=config.eos_token_id + tuple(extra_eos)), params,
                  **model_kwargs)
    model.hf_config = json.loads((directory / "config.json").read_text())
    return model


def save_params(model: Model, directory: str | Path) -> None:
    """Write `config.json` and the converted params (orbax) so a large checkpoint is converted once."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", model.params, force=True)


def restore_params(directory: str | Path, config: ModelConfig, dtype: Any = jnp.float32) -> dict:
    import orbax.checkpoint as ocp

    target = abstract_params(config, dtype)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(directory).absolute(), target)


__all__ = ["CheckpointError", "load_model", "resolve_model", "save_params", "restore_params", "convert_checkpoint",
           "parse_hf_config"]
