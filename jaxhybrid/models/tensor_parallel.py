"""Tensor parallelism inside one engine: a 1-D mesh axis "tp", weights and pools sharded by heads.

Every attention and recurrent mixer runs its kernels in `jax.shard_map` on its device's own heads
(`ModelOps.mesh`; a Pallas kernel cannot be partitioned by XLA): the projections into a mixer are
column-parallel, the one out of it row-parallel (XLA adds the partial sums after the shard_map), per-head
vectors, conv weights and the pools split with the heads, and the plan is replicated. A mixer splits when
tp divides its smallest head count (GDN key heads, Mamba2 groups, attention kv heads; the others are
multiples of it); otherwise the whole mixer is replicated, as vLLM replicates kv heads when tp exceeds
them. MLP and MoE projections stay with XLA's partitioner (column/row parallel where tp divides). The
outputs equal the one-device step's up to float reassociation.

Head-aligned layout: the conv channels are [q | k | v] (Mamba2 [x | B | C]), so an even split of that
axis would not give a device its own heads' channels. For tp > 1 the runner permutes the params once
(`to_tp_layout`) into per-shard blocks: conv channels [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] and the input
projection's columns [q_0 k_0 v_0 z_0 | ...] (Mamba2 [z_0 x_0 B_0 C_0 dt_0 | ...]). Each device's block
then has the one-device layout with its local head counts, so the mixer body is the same code, and the
conv pools (window, conv ring), which start at zero, hold their channels in that layout too.

FP8 kernels (`layers.Dense`: float8 [blocks, block, out] and float32 scales [blocks, out], one per row block
and column) split with their scales: columns on their last axes, and rows by whole blocks where tp divides the
blocks (else within each block, the scales replicated; else replicated). The scales are per column, so the
head-aligned column order applies to them as to their kernel.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.models.config import ATTENTION, GDN, MAMBA2, AttentionConfig, GDNConfig, Mamba2Config, ModelConfig
from jaxhybrid.models.layers import SCALE_SUFFIX
from jaxhybrid.models.pools import DeviceState, KVPool, RecurrentPool
from jaxhybrid.models.stack import is_stacked, layer_segments

AXIS = "tp"
MixerConfig = GDNConfig | Mamba2Config | AttentionConfig
# MLP kernels [D, I] / [I, D] and the routed experts' stacks [E, D, I] / [E, I, D]: split on I (and their
# FP8 scales with them)
_COLUMN = re.compile(r"(gate_proj|up_proj)('\]\['kernel|)(_scale)?'\]$")
_ROW = re.compile(r"down_proj('\]\['kernel|)(_scale)?'\]$")
# per mixer kind, its params (path below the mixer) that split with the heads, and on which axis
_HEAD_AXES = {
    GDN: {"in_proj_qkvz/kernel": 1, "in_proj_ba/kernel": 1, "conv1d": 0, "A_log": 0, "dt_bias": 0,
          "out_proj/kernel": 0},
    MAMBA2: {"in_proj/kernel": 1, "in_proj/bias": 0, "conv1d": 0, "conv1d_bias": 0, "A_log": 0, "dt_bias": 0,
             "D": 0, "norm/weight": 0, "out_proj/kernel": 0},
    ATTENTION: {"q_proj/kernel": 1, "k_proj/kernel": 1, "v_proj/kernel": 1, "q_proj/bias": 0, "k_proj/bias": 0,
                "v_proj/bias": 0, "o_proj/kernel": 0},
}


def make_mesh(size: int) -> Mesh:
    devices = jax.devices()
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices; this host has {len(devices)} "
                         f"({devices[0].platform})")
    return Mesh(np.array(devices[:size]), (AXIS,))


def _head_counts(mixer: MixerConfig) -> dict[str, int]:
    """A mixer's head counts by config field, the smallest first (the others are multiples of it)."""
    if isinstance(mixer, GDNConfig):
        return dict(num_k_heads=mixer.num_k_heads, num_v_heads=mixer.num_v_heads)
    if isinstance(mixer, Mamba2Config):
        return dict(n_groups=mixer.n_groups, num_heads=mixer.num_heads)
    return dict(num_kv_heads=mixer.num_kv_heads, num_heads=mixer.num_heads)


def head_shards(mixer: MixerConfig, tp: int) -> int:
    """How many ways a mixer's heads split over `tp` devices: tp, or 1 (replicated) where tp does not
    divide its smallest head count."""
    smallest = next(iter(_head_counts(mixer).values()))
    return tp if smallest % tp == 0 else 1


def head_axis(mixer: MixerConfig, tp: int) -> str | None:
    """The mesh axis a mixer's head axes split over; None: replicated."""
    return AXIS if head_shards(mixer, tp) > 1 else None


def local_heads(mixer: MixerConfig, shards: int) -> MixerConfig:
    """The mixer's config on one device's heads, when its heads split `shards` ways."""
    counts = _head_counts(mixer)
    return dataclasses.replace(mixer, **{name: count // shards for name, count in counts.items()})


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model config with every mixer's heads as one device of `tp` holds them (split, or all where
    replicated): one device's bytes per state slot and per KV block (the pools split by heads, not slots)."""
    mixers = {"gdn": cfg.gdn, "mamba2": cfg.mamba2, "attention": cfg.attention}
    return dataclasses.replace(cfg, **{name: local_heads(mixer, head_shards(mixer, tp))
                                       for name, mixer in mixers.items() if mixer is not None})


def _keys(path: Any) -> tuple[str, ...]:
    return tuple(str(getattr(key, "key", key)) for key in path)


def device_param_bytes(params: Any, cfg: ModelConfig, mesh: Mesh) -> int:
    """Bytes of the params (arrays or ShapeDtypeStructs) on one device of `mesh` under `param_shardings`."""
    shardings = jax.tree.leaves(param_shardings(params, cfg, mesh))
    return sum(math.prod(sharding.shard_shape(p.shape)) * p.dtype.itemsize
               for p, sharding in zip(jax.tree.leaves(params), shardings, strict=True))


def recurrent_pool_specs(pool: RecurrentPool, axis: str | None) -> RecurrentPool:
    """A slot pool's partition specs, split over `axis` by heads (None: replicated); slots are never split."""
    return RecurrentPool(window=P(None, None, axis),  # [S, Kc-1, conv_dim] head-aligned channels
                         state=P(None, axis),  # [S, heads, ...]
                         rings=tuple(P(None, axis) for _ in pool.rings),  # [S, heads, W, ...]
                         conv_ring=P(None, None, None, axis))  # [S, 1, W, conv_dim]


def kv_pool_specs(axis: str | None) -> KVPool:
    spec = P(None, None, axis)  # [NB, BS, KVH, Dh]
    return KVPool(spec, spec)


def block_order(widths: Sequence[int], shards: int) -> np.ndarray:
    """Concatenated parts [p_0 | p_1 | ...] of these widths -> per-shard blocks [p_0^0 p_1^0 ... | p_0^1 ...]:
    the source index of each position of the head-aligned layout."""
    starts = np.cumsum([0, *widths[:-1]])
    parts = [(start + np.arange(width)).reshape(shards, -1) for start, width in zip(starts, widths, strict=True)]
    return np.concatenate(parts, axis=1).reshape(-1)


def layout_orders(cfg: ModelConfig, kind: str, shards: int) -> dict[str, tuple[int, np.ndarray]]:
    """A mixer's permuted params (path below the mixer) -> (axis, block_order along it) for `shards` blocks."""
    if kind == GDN:
        g = cfg.gdn
        qkv = (g.key_dim, g.key_dim, g.value_dim)
        return {"in_proj_qkvz/kernel": (1, block_order((*qkv, g.value_dim), shards)),  # [q | k | v | z]
                "in_proj_ba/kernel": (1, block_order((g.num_v_heads,) * 2, shards)),  # [b | a]
                "conv1d": (0, block_order(qkv, shards))}
    if kind == MAMBA2:
        m = cfg.mamba2
        xbc = (m.intermediate_size, m.n_groups * m.state_size, m.n_groups * m.state_size)
        proj = block_order((m.intermediate_size, *xbc, m.num_heads), shards)  # [z | x | B | C | dt]
        conv = block_order(xbc, shards)
        return {"in_proj/kernel": (1, proj), "in_proj/bias": (0, proj), "conv1d": (0, conv), "conv1d_bias": (0, conv)}
    return {}


def _mixer_config(cfg: ModelConfig, kind: str) -> MixerConfig:
    return {GDN: cfg.gdn, MAMBA2: cfg.mamba2, ATTENTION: cfg.attention}[kind]


def _mixer_param(path: Any) -> tuple[str | None, str]:
    """(the mixer kind a param belongs to or None, its path below the mixer)."""
    keys = _keys(path)
    for i, key in enumerate(keys):
        if key in _HEAD_AXES:
            return key, "/".join(keys[i + 1 :])
    return None, ""


def tp_layout_leaf(path: Any, leaf: Any, cfg: ModelConfig, tp: int) -> Any:
    """One param (at `path`, stacked or a layer's own) in the head-aligned layout."""
    kind, name = _mixer_param(path)
    if kind is None:
        return leaf
    name = name.removesuffix(SCALE_SUFFIX)
    axis, order = layout_orders(cfg, kind, head_shards(_mixer_config(cfg, kind), tp)).get(name, (0, None))
    if order is None:
        return leaf
    # a kernel's permuted axis is its columns: the last axis of the kernel, of its FP8 form and of its scales
    axis = leaf.ndim - 1 if name.endswith("kernel") else axis + is_stacked(path)
    return leaf[(slice(None),) * axis + (order,)]


def to_tp_layout(params: Any, cfg: ModelConfig, tp: int) -> Any:
    """The params with every split mixer's conv channels and input projection in the head-aligned layout."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: tp_layout_leaf(path, leaf, cfg, tp), params)


def _split(mesh: Mesh, shape: tuple[int, ...], axis: int) -> NamedSharding:
    """Shard `axis` over tp when it divides evenly, else replicate."""
    spec = [None] * len(shape)
    if shape and shape[axis] % mesh.shape[AXIS] == 0:
        spec[axis] = AXIS
    return NamedSharding(mesh, P(*spec))


def _split_rows(mesh: Mesh, shape: tuple[int, ...], quantized: bool) -> NamedSharding:
    """An FP8 kernel [..., blocks, block, out] or its scales [..., blocks, out] split on rows: by whole blocks
    where tp divides them, else a kernel within each block (its scales replicated), else replicated."""
    tp, blocks = mesh.shape[AXIS], len(shape) - (3 if quantized else 2)
    if shape[blocks] % tp == 0:
        return _split(mesh, shape, blocks)
    return _split(mesh, shape, blocks + 1) if quantized else NamedSharding(mesh, P())


def param_sharding(path: Any, shape: tuple[int, ...], dtype: Any, cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Where the param at `path` (stacked or a layer's own, keys or strings) of this shape and dtype lives."""
    tp, ndim = mesh.shape[AXIS], len(shape)
    quantized = jnp.dtype(dtype) == jnp.float8_e4m3fn
    fp8 = quantized or _keys(path)[-1].endswith(SCALE_SUFFIX)
    kind, name = _mixer_param(path)
    if kind is not None:
        axis = _HEAD_AXES[kind].get(name.removesuffix(SCALE_SUFFIX))
        heads = head_axis(_mixer_config(cfg, kind), tp)
        if axis is None or heads is None:
            return NamedSharding(mesh, P())
        if fp8:  # a kernel's columns (axis 1) or rows (axis 0)
            return _split(mesh, shape, ndim - 1) if axis == 1 else _split_rows(mesh, shape, quantized)
        return NamedSharding(mesh, P(*[None] * (axis + is_stacked(path)), heads))
    name = "".join(f"['{key}']" for key in _keys(path))
    if _COLUMN.search(name):
        return _split(mesh, shape, ndim - 1)
    if _ROW.search(name):
        return _split_rows(mesh, shape, quantized) if fp8 else _split(mesh, shape, ndim - 2)
    return NamedSharding(mesh, P())


def param_shardings(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: param_sharding(path, leaf.shape, leaf.dtype, cfg, mesh), params)


def shard_params(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """Whole params (on the host or one device) in the head-aligned layout, placed by `param_shardings`."""
    params = to_tp_layout(params, cfg, mesh.shape[AXIS])
    return jax.device_put(params, param_shardings(params, cfg, mesh))


def state_shardings(state: DeviceState, cfg: ModelConfig, mesh: Mesh) -> DeviceState:
    tp = mesh.shape[AXIS]
    named = lambda specs: jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)

    def pool(layer, kinds, stacked=True):
        if isinstance(layer, KVPool):
            specs = kv_pool_specs(head_axis(cfg.attention, tp))
        elif isinstance(layer, RecurrentPool):
            kind = next(k for k in kinds if k in (GDN, MAMBA2))
            specs = recurrent_pool_specs(layer, head_axis(_mixer_config(cfg, kind), tp))
        else:
            return None
        return named(jax.tree.map(lambda spec: P(None, *spec), specs) if stacked else specs)

    layers = tuple(tuple(pool(layer, kinds, segment.repeats > 1) for layer, kinds in zip(pools, segment.period,
                                                                                           strict=True))
                   for pools, segment in zip(state.layers, layer_segments(cfg.layers), strict=True))
    return DeviceState(layers, tuple(pool(p, (), stacked=False) for p in state.mtp), NamedSharding(mesh, P()))
