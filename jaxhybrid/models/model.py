"""`Model`: a loaded checkpoint as a plain full-sequence function, run through the serving path (a plan of
prefill rows over fresh slots and blocks), so parity tests of `load_model` test the engine's layers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.fp8_weights import quantized_params
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import init_device_state
from scheduler.plan import RowKind


def length_bucket(length: int) -> int:
    """Power-of-two token bucket (at least 16): nearby lengths share one compilation."""
    return max(16, 1 << (length - 1).bit_length())


def fresh_plan(query_lens: Sequence[int], block_size: int, *, num_spec_tokens: int = 0) -> DevicePlan:
    """A plan of prefill rows from empty states: row r runs in slot r + 1 on blocks 1 + r * B + j, with
    B = its longest row's blocks, and asks for no logits (the caller reads the hidden states)."""
    num_rows, width = len(query_lens), max(-(-max(query_lens) // block_size), 1)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    block_table = 1 + np.arange(num_rows * width, dtype=np.int32).reshape(num_rows, width)
    row = np.repeat(np.arange(num_rows), query_lens)
    positions = (np.arange(cu[-1]) - cu[row]).astype(np.int32)
    zeros = lambda *shape: np.zeros(shape, np.int32)
    fields = dict(
        num_rows=num_rows, num_tokens=cu[-1], num_hit_copies=0, num_pair_copies=0, num_publishes=0,
        num_materializations=0, row_kind=np.full(num_rows, RowKind.PREFILL, np.int8), phase=np.full(num_rows, 2),
        cu_seqlens=cu, query_lens=np.asarray(query_lens, np.int32), context_lens=zeros(num_rows),
        state_slots=np.arange(1, num_rows + 1, dtype=np.int32), has_initial_state=np.zeros(num_rows, bool),
        block_table=block_table, token_ids=zeros(cu[-1]), positions=positions,
        slot_mapping=block_table[row, positions // block_size] * block_size + positions % block_size,
        draft_token_ids=zeros(num_rows, num_spec_tokens), num_logits=zeros(num_rows), cu_logits=zeros(num_rows + 1),
        logits_indices=zeros(1), lookahead_token_ids=zeros(num_rows, max(num_spec_tokens, 1)),
        num_lookahead_tokens=zeros(num_rows), ring_start=zeros(num_rows), ring_committed=zeros(num_rows),
        flush=np.zeros(num_rows, bool), row_data=np.zeros((num_rows, 0), np.uint8),
        **{name: zeros(num_rows) for name in ("hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst",
                                              "publish_src", "publish_dst", "materialize_src", "materialize_dst",
                                              "materialize_ring_start", "materialize_count")})
    return DevicePlan(**{name: jnp.asarray(value) for name, value in fields.items()})


def full_forward(module: HybridLM, params: Any, token_ids: jax.Array, block_size: int, *,
                 with_mtp: bool) -> tuple[jax.Array, jax.Array | None]:
    """token_ids [B, L] (independent sequences) -> (logits [B, L, V], MTP logits [B, L, V] or None), as one
    plan of prefill rows over fresh pools. MTP at position t reads h_t and token t+1 (a dummy 0 after the
    last) and predicts token t+2."""
    num_rows, length = token_ids.shape
    plan = fresh_plan([length] * num_rows, block_size)
    state = init_device_state(module.cfg, num_blocks=1 + plan.block_table.size, block_size=block_size,
                              num_slots=1 + num_rows, ring_entries=1, dtype=jax.tree.leaves(params)[0].dtype)
    variables = {"params": params}
    hidden, state = module.apply(variables, token_ids.reshape(-1), plan, state)
    logits = module.apply(variables, hidden, method=HybridLM.logits).reshape(num_rows, length, -1)
    if not with_mtp:
        return logits, None
    shifted = jnp.pad(token_ids[:, 1:], ((0, 0), (0, 1))).reshape(-1)
    mtp_hidden, _ = module.apply(variables, shifted, hidden, plan, state, method=HybridLM.mtp_hidden)
    return logits, module.apply(variables, mtp_hidden, method=HybridLM.logits).reshape(logits.shape)


class Model:
    """A checkpoint's config and params: `model(token_ids[B, L]) -> logits[B, L, V]` runs full sequences
    as one plan of prefill rows over fresh pools (the engine's code path); `mtp_logits` adds the MTP head."""

    def __init__(self, config: ModelConfig, params: Any, *, ops: ModelOps = DEFAULT_OPS, block_size: int = 16,
                 tp_layout: int = 1):
        self.config = config
        self.params = params
        # the tensor-parallel size whose head-aligned layout the params are in (`tensor_parallel.to_tp_layout`),
        # and placed for; 1: the checkpoint's own layout, which this model's own forward reads
        self.tp_layout = tp_layout
        self.block_size = block_size
        self.module = HybridLM(config, ops)
        self._forward = jax.jit(self._forward_fn, static_argnames="with_mtp")

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    def _forward_fn(self, params: Any, token_ids: jax.Array, with_mtp: bool) -> tuple[jax.Array, jax.Array | None]:
        return full_forward(self.module, params, token_ids, self.block_size, with_mtp=with_mtp)

    def _padded(self, token_ids: Any) -> tuple[jax.Array, int]:
        if self.tp_layout != 1:  # the split mixers read their heads in the checkpoint's order here
            raise ValueError(f"this model's params are laid out for tensor parallelism {self.tp_layout}: serve "
                             "it with an engine on that mesh, or load it without a mesh to call it directly")
        token_ids = np.asarray(token_ids, np.int32)
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be [batch, length], got shape {token_ids.shape}")
        if np.any(token_ids < 0) or np.any(token_ids >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        # Rows are right-padded to a bucket: causality keeps the real positions exact.
        length = token_ids.shape[1]
        padded = np.zeros((token_ids.shape[0], length_bucket(length)), np.int32)
        padded[:, :length] = token_ids
        return jnp.asarray(padded), length

    def __call__(self, token_ids: Any) -> jax.Array:
        """token_ids [B, L] -> logits [B, L, V] (float32)."""
        padded, length = self._padded(token_ids)
        return self._forward(self.params, padded, with_mtp=False)[0][:, :length]

    def mtp_logits(self, token_ids: Any) -> jax.Array:
        """token_ids [B, L] -> the MTP head's logits [B, L, V] for token t+2 at each position t, given the
        true token t+1 (a dummy 0 at the last position, as in training)."""
        if not self.config.mtp_layers:
            raise ValueError(f"this {self.config.model_type} checkpoint has no MTP layers")
        padded, length = self._padded(token_ids)
        # the dummy token after the last real position is the bucket's padding 0
        return self._forward(self.params, padded, with_mtp=True)[1][:, :length]


def _init(config: ModelConfig, rng: jax.Array) -> Any:
    plan = fresh_plan([1], 16)
    state = init_device_state(config, num_blocks=2, block_size=16, num_slots=2, ring_entries=1)
    tokens, hidden = jnp.zeros((1,), jnp.int32), jnp.zeros((1, config.hidden_size))

    def every_entry_point(module: HybridLM) -> Any:
        out = module.logits(module(tokens, plan, state)[0])
        return (out, module.mtp_hidden(tokens, hidden, plan, state)) if config.mtp_layers else out

    return HybridLM(config).init(rng, method=every_entry_point)["params"]


@functools.cache
def abstract_params(config: ModelConfig, dtype: jnp.dtype = jnp.float32) -> Any:
    """The params pytree as `jax.ShapeDtypeStruct`s of `dtype`, without allocating it (the loader's target,
    and the weights of a compile for a GPU this host does not have). With an FP8 `config.quantization`, the
    weights its checkpoints keep in FP8 are FP8 kernels and their scales, as the loader makes them
    (`fp8_weights.quantized_params`)."""
    shapes = jax.eval_shape(functools.partial(_init, config), jax.random.key(0))
    return quantized_params(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), shapes), config)


def init_params(config: ModelConfig, seed: int = 0, dtype: jnp.dtype = jnp.float32) -> Any:
    """Random params with the shapes the loader produces (for tests and training from scratch)."""
    params = _init(config, jax.random.key(seed))
    return jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
