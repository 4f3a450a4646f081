"""HuggingFace safetensors -> jaxhybrid params (one name-map table), streamed; orbax save/restore.

Checkpoints in float32, bfloat16 or float16 load in the serving dtype. FP8 checkpoints (e4m3 weights with
float32 scales: Qwen's block-wise `weight_scale_inv`, NVIDIA ModelOpt's per-tensor `weight_scale`) keep every
FP8 weight that a matmul reads (`layers.Dense` kernels, routed experts) in FP8 on the device, with its scales
(`pallas_kernels.fp8_matmul`); an FP8 weight anywhere else is dequantized on the host (the rule and the layout:
`fp8_weights`, shared with `model.abstract_params`). With a mesh, each tensor goes straight to its shards in the
tensor-parallel layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.models.config import GDNConfig, ModelConfig, QuantConfig
from jaxhybrid.models.fp8_weights import canonical_name, device_shapes, is_matmul_weight, scale_layout
from jaxhybrid.models.generation_config import read_generation_config
from jaxhybrid.models.hf_config import eos_token_ids, load_config, merge_overrides, parse_hf_config
from jaxhybrid.models.layers import SCALE_SUFFIX
from jaxhybrid.models.model import Model, abstract_params
from jaxhybrid.models.safetensors_reader import SafetensorsError, TensorEntry, read_header
from jaxhybrid.models.stack import is_stacked, layer_location, layer_segments, segment_key
from jaxhybrid.models.tensor_parallel import AXIS, param_sharding, shard_params, tp_layout_leaf
from pallas_kernels.matmul.cpu import unpacked_params

Path_ = tuple[str, ...]
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# A quantized weight's scales (Qwen's block-wise inverse scales, ModelOpt's per-tensor ones), and the scales of
# static FP8 activations and KV cache, which are no params: activations stay in the serving dtype, and an fp8 KV
# cache reads k_scale / v_scale itself (`cache_dtypes.checkpoint_kv_scales`).
_WEIGHT_SCALES = ("weight_scale_inv", "weight_scale")
_UNUSED_SCALES = ("input_scale", "k_scale", "v_scale")


class Quantized(NamedTuple):
    """An FP8 weight and its float32 scales, one per weight row and block of `block` input columns: in the
    checkpoint's layout weight [..., out, in] and scale [..., out, in_blocks] (`quantized`); after the
    name map's transposes, a kernel [..., in, out] and scale [..., in_blocks, out]. Row permutations and
    concatenations of the weight (fused projections) apply to its scale unchanged."""

    weight: np.ndarray
    scale: np.ndarray
    block: int

    def dequantized(self, input_axis: int) -> np.ndarray:
        """The float32 weight, its input axis being `input_axis` (-1: the checkpoint's layout, -2: a kernel's)."""
        size = self.weight.shape[input_axis]
        scale = np.repeat(self.scale, self.block, axis=input_axis)
        return self.weight.astype(np.float32) * np.take(scale, np.arange(size), axis=input_axis)

    def device_form(self) -> tuple[np.ndarray, np.ndarray]:
        """A kernel's (float8 [..., blocks, block, out], rows past `in` zero; float32 scale [..., blocks, out]),
        the layout of `pallas_kernels.fp8_matmul`."""
        *lead, rows, out = self.weight.shape
        shape, _ = device_shapes(self.weight.shape, self.block)
        padded = shape[-3] * self.block
        kernel = self.weight
        if padded != rows:
            kernel = np.zeros((*lead, padded, out), FP8)
            kernel[..., :rows, :] = self.weight
        return kernel.reshape(shape), np.ascontiguousarray(self.scale, np.float32)


Tensor = np.ndarray | Quantized
# A converted tensor, or one part of a tensor assembled from several checkpoint tensors.
Piece = tuple[Path_, Any, Tensor]  # (param path, part key or None, array)


DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "assets" / "default_model"
# What a checkpoint is served from, fetched from the hub (as vLLM fetches them): config, generation config,
# tokenizer and chat template, the safetensors and their index.
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "*.safetensors", "*.safetensors.index.json",
             "hf_quant_config.json"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or tensors."""


_IGNORED = re.compile(r"^(model\.visual\.|visual\.|.*rotary_emb\.inv_freq$)")
# Sublayer module names in checkpoints -> our kind-independent slot in the layer.
_QWEN_SUBLAYERS = {"input_layernorm": "norm_0", "post_attention_layernorm": "norm_1"}
_QWEN_MODULES = {"linear_attn": 0, "self_attn": 0, "mlp": 1}
_NORM_NAMES = ("norm", "q_norm", "k_norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm_0", "norm_1")


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
    name = canonical_name(name)
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
    join = functools.partial(np.concatenate, axis=-1) if isinstance(order[0], str) else np.stack
    if all(isinstance(a, Quantized) for a in arrays) and len({a.block for a in arrays}) == 1:
        return Quantized(join([a.weight for a in arrays]), join([a.scale for a in arrays]), arrays[0].block)
    # 16-bit parts beside FP8 ones: all of them dequantized (kernels: input axis -2)
    return join([a.dequantized(-2) if isinstance(a, Quantized) else a for a in arrays])


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


def _read(entry: TensorEntry) -> np.ndarray:
    try:
        return entry.read()
    except SafetensorsError as error:
        raise CheckpointError(str(error)) from error


def _iter_tensors(files: list[Path], quant: QuantConfig | None = None) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the files, read one at a time; an FP8 weight comes with its scales (`Quantized`)."""
    entries: dict[str, TensorEntry] = {}
    for path in files:
        try:
            entries.update(read_header(path))
        except SafetensorsError as error:
            raise CheckpointError(str(error)) from error
    for name, entry in entries.items():
        module, _, leaf = name.rpartition(".")
        if quant is not None and leaf in _WEIGHT_SCALES + _UNUSED_SCALES:
            if leaf in _WEIGHT_SCALES and entries.get(f"{module}.weight", entry).dtype != "F8_E4M3":
                raise CheckpointError(f"{name} scales a weight that is not float8_e4m3fn")
            continue
        if entry.dtype.startswith("F8") and (quant is None or entry.dtype != "F8_E4M3"):
            why = "config.json declares no FP8 quantization" if quant is None else "only e4m3 FP8 is supported"
            raise CheckpointError(f"{name} is {entry.dtype}: {why}")
        array = _read(entry)
        yield name, quantized(name, array, _weight_scale(name, entries), quant) if array.dtype == FP8 else array


def _weight_scale(name: str, entries: dict[str, TensorEntry]) -> np.ndarray:
    module = name.removesuffix(".weight")
    for leaf in _WEIGHT_SCALES:
        if f"{module}.{leaf}" in entries:
            return _read(entries[f"{module}.{leaf}"])
    raise CheckpointError(f"FP8 tensor {name} has no scales ({' or '.join(f'{module}.{s}' for s in _WEIGHT_SCALES)})")


def quantized(name: str, weight: np.ndarray, scale: np.ndarray, quant: QuantConfig) -> Quantized:
    """An FP8 weight [..., out, in] with its checkpoint scales: one per `quant.weight_block` block (the edge
    blocks partial), one for the whole tensor, or one per row; each repeated over its block's rows."""
    *lead, out, cols = weight.shape
    layout = scale_layout(weight.shape, scale.shape, quant.weight_block)
    if layout is None:
        raise CheckpointError(f"FP8 tensor {name} of shape {list(weight.shape)} has scales of shape "
                              f"{list(scale.shape)}, neither per tensor, per row, nor per {quant.weight_block} block")
    rows, block = layout
    grid = (*lead, -(-out // rows), -(-cols // block))
    scale = scale.astype(np.float32).reshape(grid) if scale.size > 1 else np.full(grid, scale.reshape(()), np.float32)
    return Quantized(weight, np.repeat(scale, rows, axis=-2)[..., :out, :], block)


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


def convert_checkpoint(tensors: Callable[[], Iterator[tuple[str, Tensor]]], cfg: ModelConfig,
                       dtype: jnp.dtype, mesh: Mesh | None = None) -> dict:
    """Stream checkpoint tensors into a params tree of device arrays; each tensor is converted once, and a
    layer's tensor is written into its repeat of the segment's stacked param, in place. FP8 weights stay FP8
    (`Quantized`), with their scales beside them as `<name>_scale`.

    With a `mesh`, the params come in the tensor-parallel layout (`tensor_parallel.to_tp_layout`) and placed by
    `tensor_parallel.param_shardings`: each tensor is permuted on the host and each device is sent only its
    shard, so no device holds more than its share plus one tensor's shard."""
    expected = _per_layer_shapes(cfg)
    params: dict = {}
    loaded: set[Path_] = set()
    wrong_shapes = []
    for name, path, array in _converted(tensors, cfg):
        if path not in expected:
            raise CheckpointError(f"tensor {name!r} maps to unknown parameter {'/'.join(path)}")
        shape = array.weight.shape if isinstance(array, Quantized) else array.shape
        if tuple(shape) != expected[path]:
            wrong_shapes.append(f"{name} -> {'/'.join(path)}: {tuple(shape)} != {expected[path]}")
            continue
        if isinstance(array, Quantized):
            kernel, scale = array.device_form()
            _place(params, path, kernel, cfg, kernel.dtype, mesh)
            _place(params, (*path[:-1], path[-1] + SCALE_SUFFIX), scale, cfg, scale.dtype, mesh)
        else:
            _place(params, path, array, cfg, dtype, mesh)
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
    pending: dict[Path_, dict[Any, Tensor]] = {}
    for name, tensor in tensors():
        for path, part, array in _translate(name, tensor, cfg):
            if part is not None:
                pending.setdefault(path, {})[part] = array
                array = _combine(path, pending[path], cfg)
                if array is None:
                    continue
                del pending[path]
            yield name, path, array


def _translate(name: str, tensor: Tensor, cfg: ModelConfig) -> Iterator[Piece]:
    """`translate`, an FP8 weight's scales mapped as its weight is (same rows, same transposes), and dequantized
    on the host where it goes to a param that no FP8 matmul reads."""
    if not isinstance(tensor, Quantized):
        yield from translate(name, tensor, cfg)
        return
    pieces = list(translate(name, tensor.weight, cfg))
    if not all(is_matmul_weight(path) for path, _, _ in pieces):
        yield from translate(name, tensor.dequantized(-1), cfg)
        return
    for (path, part, weight), (_, _, scale) in zip(pieces, translate(name, tensor.scale, cfg), strict=True):
        yield path, part, Quantized(weight, scale, tensor.block)


def _per_layer_shapes(cfg: ModelConfig) -> dict[Path_, tuple[int, ...]]:
    """Every param's path and shape in the checkpoint's per-layer layout (`layers_{i}/...`)."""
    shapes = {}
    # the checkpoint's weights as they are read, an FP8 one before it takes its device layout
    for path, leaf in _flatten(abstract_params(dataclasses.replace(cfg, quantization=None))).items():
        if not is_stacked(path):
            shapes[path] = leaf.shape
            continue
        k, j = int(path[0].removeprefix("segment_")), int(path[1].removeprefix("layers_"))
        segment = layer_segments(cfg.layers)[k]
        for r in range(segment.repeats):
            shapes[(f"layers_{segment.layer(j, r)}", *path[2:])] = leaf.shape[1:]
    return shapes


def _place(params: dict, path: Path_, array: np.ndarray, cfg: ModelConfig, dtype: Any, mesh: Mesh | None) -> None:
    """params[path] = the host `array` in `dtype` on the device(s), a layer's param going into its repeat of the
    stacked one."""
    if mesh is not None:
        array = tp_layout_leaf(path, array, cfg, mesh.shape[AXIS])
    if not path[0].startswith("layers_"):
        sharding = None if mesh is None else param_sharding(path, array.shape, dtype, cfg, mesh)
        _set(params, path, _to_device(array, dtype, sharding))
        return
    segments = layer_segments(cfg.layers)
    k, j, r = layer_location(int(path[0].removeprefix("layers_")), segments)
    stacked_path = (segment_key(k), f"layers_{j}", *path[1:])
    parent, leaf = _parent(params, stacked_path), stacked_path[-1]
    shape, stacked = (segments[k].repeats, *array.shape), parent.get(leaf, None)
    sharding = None if mesh is None else param_sharding(stacked_path, shape, dtype, cfg, mesh)
    if stacked is None:
        stacked = _zeros(shape, jnp.dtype(dtype), sharding)
    elif stacked.dtype != jnp.dtype(dtype):
        raise CheckpointError(f"{'/'.join(path)} is {jnp.dtype(dtype)} but the same param of an earlier layer of "
                              f"its segment is {stacked.dtype}: FP8 and 16-bit layers cannot share one stack")
    value = _to_device(array, dtype, None if sharding is None else NamedSharding(mesh, P(*sharding.spec[1:])))
    parent[leaf] = _set_repeat(sharding)(stacked, value, r)


def _to_device(array: np.ndarray, dtype: Any, sharding: NamedSharding | None) -> jax.Array:
    """The host array in `dtype`, on the default device, or each device sent only its shard (converted there)."""
    if sharding is None:
        return jnp.asarray(array, dtype)
    return jax.make_array_from_callback(array.shape, sharding,
                                        lambda index: np.asarray(array[index]).astype(dtype, copy=False))


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding | None) -> jax.Array:
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)()  # each device its shard


@functools.cache
def _set_repeat(sharding: NamedSharding | None) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """stacked.at[repeat].set(value), in place (the stack donated), keeping the stack's placement."""
    placed = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(lambda stacked, value, repeat: stacked.at[repeat].set(value), donate_argnums=0, **placed)


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
               download_dir: str | Path | None = None, mesh: Mesh | None = None,
               hf_overrides: dict[str, Any] | None = None, **model_kwargs: Any) -> Model:
    """Load a HuggingFace checkpoint (or one saved by `save_params`) as a `Model`: a directory or a hub id
    (`resolve_model`). With no path, loads the embedded default model shipped in `jaxhybrid/assets/`.
    `dtype` is the serving dtype; an FP8 checkpoint's FP8 weights stay FP8 (`convert_checkpoint`). With a
    `mesh`, the params come in the tensor-parallel layout, each tensor sent straight to its shards.
    `hf_overrides` (vLLM's --hf-overrides) is merged into config.json before it is parsed.
    """
    directory = resolve_model(path, revision, download_dir)
    config = load_config(directory, hf_overrides)
    if (directory / "params").is_dir():
        params = restore_params(directory / "params", config, dtype)
        params = params if mesh is None else shard_params(params, config, mesh)
    else:
        files = _checkpoint_files(directory)
        params = convert_checkpoint(lambda: _iter_tensors(files, config.quantization), config, dtype, mesh)
    extra_eos = [t for t in eos_token_ids(read_generation_config(directory)) if t not in config.eos_token_id]
    model = Model(dataclasses.replace(config, eos_token_id=config.eos_token_id + tuple(extra_eos)), params,
                  tp_layout=1 if mesh is None else mesh.shape[AXIS], **model_kwargs)
    model.hf_config = merge_overrides(json.loads((directory / "config.json").read_text()), hf_overrides)
    return model


def save_params(model: Model, directory: str | Path) -> None:
    """Write `config.json` and the converted params (orbax) so a large checkpoint is converted once."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", unpacked_params(model.params, is_matmul_weight), force=True)


def restore_params(directory: str | Path, config: ModelConfig, dtype: Any = jnp.float32) -> dict:
    import orbax.checkpoint as ocp

    # an FP8 model's tree (which weights are FP8) is the checkpoint's: it is restored as saved
    target = None if config.quantization else abstract_params(config, dtype)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(directory).absolute(), target)


__all__ = ["CheckpointError", "load_model", "resolve_model", "save_params", "restore_params", "convert_checkpoint",
           "parse_hf_config"]
