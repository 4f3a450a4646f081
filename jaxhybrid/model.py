"""`Model`: a loaded checkpoint as a plain function, full-sequence or packed with carried caches."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.config import ModelConfig
from jaxhybrid.models.attention import AttentionBatch
from jaxhybrid.models.hybrid import HybridLM, ModelCache, init_cache
from jaxhybrid.models.ops import CHUNKED, ModelOps


def length_bucket(length: int) -> int:
    """Power-of-two token bucket (at least 16): nearby lengths share one compilation."""
    return max(16, 1 << (length - 1).bit_length())


def contiguous_batch(query_lens: list[int], context_before: list[int], block_size: int, max_blocks: int,
                     num_tokens: int | None = None) -> AttentionBatch:
    """Metadata for rows whose KV blocks are laid out contiguously: row r owns blocks 1 + r*max_blocks + j.

    Used by the full-sequence call and by tests; the engine builds the same fields from its block tables.
    """
    num_rows = len(query_lens)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = num_tokens or int(cu[-1])
    block_tables = 1 + np.arange(num_rows * max_blocks, dtype=np.int32).reshape(num_rows, max_blocks)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
    for r, (qlen, before) in enumerate(zip(query_lens, context_before, strict=True)):
        pos = before + np.arange(qlen)
        positions[cu[r] : cu[r + 1]] = pos
        slot_mapping[cu[r] : cu[r + 1]] = block_tables[r, pos // block_size] * block_size + pos % block_size
    context_lens = np.asarray(context_before, np.int32) + np.asarray(query_lens, np.int32)
    return AttentionBatch(*(jnp.asarray(a) for a in (positions, cu, slot_mapping, block_tables, context_lens)))


class Model:
    """A checkpoint's config and params with jitted entry points.

    `model(token_ids[B, L]) -> logits[B, L, V]` runs full sequences; `model.step` runs packed varlen tokens
    with per-row recurrent states and a paged KV pool carried in a `ModelCache`, so chunked prefill and
    one-token decode are the same code path as the full forward.
    """

    def __init__(self, config: ModelConfig, params: Any, *, ops: ModelOps = CHUNKED, block_size: int = 16):
        self.config = config
        self.params = params
        self.block_size = block_size
        self.module = HybridLM(config, ops)
        self._step = jax.jit(self._step_fn)
        self._mtp = jax.jit(self._mtp_fn, static_argnames="layer")

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    def _step_fn(self, params: Any, token_ids: jax.Array, batch: AttentionBatch,
                 cache: ModelCache) -> tuple[jax.Array, jax.Array, ModelCache]:
        hidden, cache = self.module.apply({"params": params}, token_ids, batch, cache)
        logits = self.module.apply({"params": params}, hidden, method=HybridLM.logits)
        return logits, hidden, cache

    def _mtp_fn(self, params: Any, next_token_ids: jax.Array, hidden: jax.Array, batch: AttentionBatch,
                cache: ModelCache, layer: int) -> tuple[jax.Array, jax.Array, ModelCache]:
        variables = {"params": params}
        out, cache = self.module.apply(variables, next_token_ids, hidden, batch, cache, layer,
                                       method=HybridLM.mtp_hidden)
        return self.module.apply(variables, out, method=HybridLM.logits), out, cache

    def init_cache(self, num_rows: int, max_len: int) -> ModelCache:
        """Zero cache for `num_rows` rows of up to `max_len` tokens, laid out as `contiguous_batch` expects."""
        max_blocks = -(-max_len // self.block_size)
        return init_cache(self.config, num_rows, 1 + num_rows * max_blocks, self.block_size, self.dtype)

    def step(self, token_ids: jax.Array, batch: AttentionBatch,
             cache: ModelCache) -> tuple[jax.Array, jax.Array, ModelCache]:
        """Packed tokens [T] -> (logits [T, V] f32, hidden [T, D], cache after the tokens)."""
        return self._step(self.params, token_ids, batch, cache)

    def mtp(self, next_token_ids: jax.Array, hidden: jax.Array, batch: AttentionBatch, cache: ModelCache,
            layer: int = 0) -> tuple[jax.Array, jax.Array, ModelCache]:
        """MTP draft logits [T, V] for token t+2 from the target's hidden at t and token t+1."""
        if not self.config.mtp_layers:
            raise ValueError(f"this {self.config.model_type} checkpoint has no MTP layers")
        return self._mtp(self.params, next_token_ids, hidden, batch, cache, layer=layer)

    def __call__(self, token_ids: Any) -> jax.Array:
        """token_ids [B, L] -> logits [B, L, V] (float32)."""
        token_ids = np.asarray(token_ids, np.int32)
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be [batch, length], got shape {token_ids.shape}")
        if np.any(token_ids < 0) or np.any(token_ids >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        num_rows, length = token_ids.shape
        # Rows are right-padded to a bucket: causality keeps the real positions exact.
        bucket = length_bucket(length)
        padded = np.zeros((num_rows, bucket), np.int32)
        padded[:, :length] = token_ids
        batch = contiguous_batch([bucket] * num_rows, [0] * num_rows, self.block_size, bucket // self.block_size)
        logits, _, _ = self.step(jnp.asarray(padded.reshape(-1)), batch, self.init_cache(num_rows, bucket))
        return logits.reshape(num_rows, bucket, -1)[:, :length]


def _init(config: ModelConfig, rng: jax.Array) -> Any:
    tokens, cache, batch = jnp.zeros((1,), jnp.int32), init_cache(config, 1, 2, 16), contiguous_batch([1], [0], 16, 1)
    hidden = jnp.zeros((1, config.hidden_size))

    def every_entry_point(module: HybridLM) -> Any:
        out = module.logits(module(tokens, batch, cache)[0])
        return (out, module.mtp_hidden(tokens, hidden, batch, cache)) if config.mtp_layers else out

    return HybridLM(config).init(rng, method=every_entry_point)["params"]


@functools.cache
def abstract_params(config: ModelConfig) -> Any:
    """The params pytree as `jax.ShapeDtypeStruct`s (float32), without allocating it."""
    return jax.eval_shape(functools.partial(_init, config), jax.random.key(0))


def init_params(config: ModelConfig, seed: int = 0, dtype: jnp.dtype = jnp.float32) -> Any:
    """Random params with the shapes the loader produces (for tests and training from scratch)."""
    params = _init(config, jax.random.key(seed))
    return jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
