"""An FP8 checkpoint's weights on the device: which stay FP8 and in what layout, one rule for the loader
(`weights.convert_checkpoint`, from the tensors it reads) and for the params of a model whose checkpoint is not
here (`model.abstract_params`, from its config alone).

A checkpoint stores in FP8 the weights of its linear modules but those its `quantization_config` leaves out
(`QuantConfig.not_converted`). Of its FP8 weights, those a matmul reads (`layers.Dense` kernels, routed expert
stacks: `is_matmul_weight`) stay FP8 on the device: a kernel float8_e4m3fn [..., blocks, block, out] (rows past `in`
zero) with float32 scales `<name>_scale` [..., blocks, out], the layout of `pallas_kernels.fp8_matmul`. Any
other FP8 weight (the MoE router) is dequantized into the serving dtype, as is a param assembled from several
checkpoint tensors of which one is 16-bit.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.models.config import ModelConfig, QuantConfig
from jaxhybrid.models.layers import SCALE_SUFFIX
from jaxhybrid.models.stack import is_stacked, layer_segments

Path_ = tuple[str, ...]
FP8 = jnp.dtype(jnp.float8_e4m3fn)
EXPERT_STACKS = ("up_proj", "down_proj", "gate_proj")
# Checkpoint prefixes that all mean "the language model".
_PREFIXES = (("model.language_model.", "model."), ("backbone.", "model."), ("language_model.model.", "model."))
# Our sublayer kinds -> Qwen's module names; Nemotron-H's blocks, of one sublayer each, call theirs `mixer`.
_QWEN_SUBLAYERS = {"gdn": "linear_attn", "attention": "self_attn", "mlp": "mlp", "moe": "mlp"}
# Params the name map assembles from several checkpoint modules (Qwen3.5's split GDN projections).
_SOURCES = {"in_proj_qkvz": ("in_proj_qkvz", "in_proj_qkv", "in_proj_z"),
            "in_proj_ba": ("in_proj_ba", "in_proj_b", "in_proj_a")}


def canonical_name(name: str) -> str:
    """A checkpoint name with its language model's prefix spelled `model.`."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def is_matmul_weight(path: Path_) -> bool:
    """Whether the param at `path` is a matmul's weight, a `Dense` kernel or a routed expert stack: an FP8
    checkpoint's stay FP8, and the CPU kernels take them packed (`pallas_kernels.matmul.cpu.packed_params`)."""
    return path[-1] == "kernel" or (len(path) > 1 and path[-2] == "moe" and path[-1] in EXPERT_STACKS)


def scale_layout(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                 weight_block: tuple[int, int] | None) -> tuple[int, int] | None:
    """(rows, columns) of an FP8 weight [..., out, in] that one of its checkpoint scales covers, from the scales'
    shape: the whole weight for one scale, (1, in) for one per row, `weight_block` for one per block (the edge
    blocks partial); None for any other shape."""
    *lead, out, cols = weight_shape
    if math.prod(scale_shape) == 1:
        return out, cols
    if tuple(scale_shape) in ((*lead, out), (*lead, out, 1)):
        return 1, cols
    if weight_block is not None and tuple(scale_shape) == (*lead, -(-out // weight_block[0]),
                                                           -(-cols // weight_block[1])):
        return weight_block
    return None


def device_shapes(kernel_shape: tuple[int, ...], block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The FP8 kernel's and its scales' shapes on the device, for a kernel [..., in, out] of `block` input
    columns per scale."""
    *lead, rows, out = kernel_shape
    blocks = -(-rows // block)
    return (*lead, blocks, block, out), (*lead, blocks, out)


def _checkpoint_block(inputs: int, outputs: int, quant: QuantConfig) -> int:
    """Input columns per scale of a weight [outputs, inputs] as `quant`'s checkpoints store it: one scale per
    `weight_block` block, or (no block size: ModelOpt's) one per tensor."""
    block = quant.weight_block
    scales = () if block is None else (-(-outputs // block[0]), -(-inputs // block[1]))
    return scale_layout((outputs, inputs), scales, block)[1]


@functools.cache
def _unconverted_index(entries: tuple[str, ...]) -> tuple[dict[str, list[tuple[str, ...]]], list[tuple[str, ...]]]:
    """`modules_to_not_convert` as dot-separated parts, by last part (those with wildcards apart)."""
    by_last: dict[str, list[tuple[str, ...]]] = {}
    wild = []
    for entry in entries:
        parts = tuple(canonical_name(entry).split("."))
        if "*" in entry or "?" in entry:
            wild.append(parts)
        else:
            by_last.setdefault(parts[-1], []).append(parts)
    return by_last, wild


def _ends_at(entry: tuple[str, ...], parts: list[str], end: int) -> bool:
    """Whether the names of `entry` are those of `parts` that end at `end`."""
    start = end - len(entry) + 1
    return start >= 0 and all(fnmatch.fnmatchcase(part, pattern)
                              for part, pattern in zip(parts[start:end + 1], entry, strict=True))


def unconverted(module: str, quant: QuantConfig) -> bool:
    """Whether the checkpoint module `module` (its canonical name) is one that `quant` leaves in 16 bits: an
    entry names it, a module it lies in, or its last names (`lm_head`, `shared_expert_gate`,
    `model.layers.3.mlp`), compared by whole dot-separated names, `*` matching any characters (ModelOpt)."""
    by_last, wild = _unconverted_index(quant.not_converted)
    parts = module.split(".")
    return (any(_ends_at(entry, parts, end) for end, part in enumerate(parts) for entry in by_last.get(part, ()))
            or any(_ends_at(entry, parts, end) for entry in wild for end in range(len(parts))))


def checkpoint_modules(path: Path_, cfg: ModelConfig) -> list[str]:
    """The checkpoint modules (canonical names) whose weights the name map (`weights.translate`) makes into the
    kernel or routed expert stack at `path`, in the checkpoint's per-layer layout (`layers_{i}/...`)."""
    if path[0] == "lm_head":
        return ["lm_head"]
    if path[0] == "mtp" and not path[1].startswith("layers_"):
        return [f"mtp.{path[1]}"]
    mtp = path[0] == "mtp"
    layer = int(path[mtp].removeprefix("layers_"))
    kinds = (cfg.mtp_layers if mtp else cfg.layers)[layer]
    kind, *inner = path[mtp + 1 :]
    prefix = f"{'mtp' if mtp else 'model'}.layers.{layer}.{_QWEN_SUBLAYERS[kind] if len(kinds) > 1 else 'mixer'}"
    if inner[0] == "shared_expert":
        return [f"{prefix}.{shared}.{inner[1]}" for shared in ("shared_expert", "shared_experts")]
    if inner[-1] != "kernel":  # a routed expert stack: per-expert weights, or Qwen3.5's stacked ones
        stacked = ("gate_up_proj",) if inner[0] != "down_proj" else ("down_proj",)
        return ([f"{prefix}.experts.{e}.{inner[0]}" for e in range(cfg.moe.num_experts)]
                + [f"{prefix}.experts.{name}" for name in stacked])
    return [f"{prefix}.{source}" for source in _SOURCES.get(inner[0], (inner[0],))]


def _stays_fp8(path: Path_, cfg: ModelConfig) -> bool:
    """Whether the param at `path` (stacked or not) of a checkpoint of `cfg.quantization` stays FP8: a kernel or
    expert stack whose checkpoint weights are all FP8, in every layer of its stack (the loader refuses a stack of
    FP8 and 16-bit layers)."""
    if not is_matmul_weight(path):
        return False
    if is_stacked(path):
        segment = layer_segments(cfg.layers)[int(path[0].removeprefix("segment_"))]
        j = int(path[1].removeprefix("layers_"))
        layers = [(f"layers_{segment.layer(j, r)}", *path[2:]) for r in range(segment.repeats)]
    else:
        layers = [path]
    fp8 = [not any(unconverted(m, cfg.quantization) for m in checkpoint_modules(p, cfg)) for p in layers]
    if any(fp8) != all(fp8):
        raise ValueError(f"{'/'.join(path)}: the quantization config leaves some of its layers in 16 bits and "
                         f"quantizes others, which cannot share one stack")
    return all(fp8)


def quantized_params(params: Any, cfg: ModelConfig) -> Any:
    """The abstract params (ShapeDtypeStructs of the unquantized model) as a checkpoint of `cfg.quantization`
    loads: each param that stays FP8 as its FP8 kernel and `<name>_scale`."""
    if cfg.quantization is None:
        return params
    out: dict = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(k.key for k in keys)
        parent = functools.reduce(lambda tree, key: tree.setdefault(key, {}), path[:-1], out)
        if not _stays_fp8(path, cfg):
            parent[path[-1]] = leaf
            continue
        *_, inputs, outputs = leaf.shape
        kernel, scale = device_shapes(leaf.shape, _checkpoint_block(inputs, outputs, cfg.quantization))
        parent[path[-1]] = jax.ShapeDtypeStruct(kernel, FP8)
        parent[path[-1] + SCALE_SUFFIX] = jax.ShapeDtypeStruct(scale, jnp.float32)
    return out
