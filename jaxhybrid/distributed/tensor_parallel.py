"""Tensor parallelism inside one engine: a 1-D mesh axis "tp", weights and pools sharded by heads.

Column-parallel projections (q/k/v, the fused GDN and Mamba2 input projections, MLP gate/up) split their
output features, row-parallel ones (o_proj, out_proj, down_proj) their input features, per-head vectors
and the conv weights their head/channel axis; KV pools split the kv-head axis and recurrent slot pools
their head (or channel) axis. An axis that `tp` does not divide stays replicated, as vLLM replicates KV
heads when tp exceeds them. The plan and the token history are replicated. The step is one `jax.jit`
whose shardings XLA's partitioner propagates (collectives where a sharded axis meets a replicated one),
so the outputs equal the one-device step's up to float reassociation.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.models.pools import DeviceState, KVPool, RecurrentPool

AXIS = "tp"
_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|in_proj_qkvz|in_proj_ba|in_proj|gate_proj|up_proj)'\]\['kernel")
_ROW = re.compile(r"(o_proj|out_proj|down_proj)'\]\['kernel")
_PER_HEAD = re.compile(r"\['(A_log|dt_bias|D|conv1d|conv1d_bias)'\]$")


def make_mesh(size: int) -> Mesh:
    devices = jax.devices()
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices; this host has {len(devices)} "
                         f"({devices[0].platform})")
    return Mesh(np.array(devices[:size]), (AXIS,))


def _split(mesh: Mesh, shape: tuple[int, ...], axis: int) -> NamedSharding:
    """Shard `axis` over tp when it divides evenly, else replicate."""
    spec = [None] * len(shape)
    if shape and shape[axis] % mesh.shape[AXIS] == 0:
        spec[axis] = AXIS
    return NamedSharding(mesh, P(*spec))


def param_shardings(params: Any, mesh: Mesh) -> Any:
    def rule(path, leaf) -> NamedSharding:
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 2 and _COLUMN.search(name):
            return _split(mesh, leaf.shape, 1)
        if leaf.ndim == 2 and _ROW.search(name):
            return _split(mesh, leaf.shape, 0)
        if _PER_HEAD.search(name):
            return _split(mesh, leaf.shape, 0)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(rule, params)


def state_shardings(state: DeviceState, mesh: Mesh) -> DeviceState:
    def pool(layer):
        if isinstance(layer, KVPool):  # [NB, BS, KVH, Dh]
            return KVPool(*(_split(mesh, a.shape, 2) for a in layer))
        if isinstance(layer, RecurrentPool):
            return RecurrentPool(window=_split(mesh, layer.window.shape, 2),  # [S, Kc-1, conv_dim]
                                 state=_split(mesh, layer.state.shape, 1),  # [S, heads, ...]
                                 rings=tuple(_split(mesh, r.shape, 1) for r in layer.rings),
                                 conv_ring=_split(mesh, layer.conv_ring.shape, 3))  # [S, 1, W, conv_dim]
        return None

    return DeviceState(tuple(pool(layer) for layer in state.layers), tuple(pool(p) for p in state.mtp),
                       NamedSharding(mesh, P()))
