"""The hybrid layer stack for all three families, driven by `ModelConfig.layers`."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.config import ATTENTION, GDN, MAMBA2, MLP, MOE, ModelConfig
from jaxhybrid.models.attention import Attention, AttentionBatch, KVPool
from jaxhybrid.models.gdn import GatedDeltaNet, RecurrentState
from jaxhybrid.models.layers import RMSNorm, make_ffn
from jaxhybrid.models.mamba2 import Mamba2Mixer
from jaxhybrid.models.ops import CHUNKED, ModelOps

LayerCache = RecurrentState | KVPool | None


class ModelCache(NamedTuple):
    layers: tuple[LayerCache, ...]  # one entry per decoder layer: its recurrent state, KV pool, or None
    mtp: tuple[KVPool, ...]  # one KV pool per MTP layer


class DecoderLayer(nn.Module):
    """Sublayers in order, each `x + sublayer(norm_j(x))`; at most one of them carries a cache."""

    cfg: ModelConfig
    kinds: tuple[str, ...]
    ops: ModelOps = CHUNKED

    @nn.compact
    def __call__(self, x: jax.Array, batch: AttentionBatch, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        cfg = self.cfg
        for j, kind in enumerate(self.kinds):
            h = RMSNorm(cfg.norm_eps, cfg.zero_centered_norm, name=f"norm_{j}")(x)
            if kind == GDN:
                h, cache = GatedDeltaNet(cfg.gdn, cfg.norm_eps, self.ops, name=kind)(h, batch.cu_seqlens, cache)
            elif kind == MAMBA2:
                h, cache = Mamba2Mixer(cfg.mamba2, cfg.norm_eps, self.ops, name=kind)(h, batch.cu_seqlens, cache)
            elif kind == ATTENTION:
                h, cache = Attention(cfg.attention, cfg.norm_eps, self.ops, name=kind)(h, batch, cache)
            else:
                h = make_ffn(kind, cfg, name=kind)(h)
            x = x + h
        return x, cache


class MTPHead(nn.Module):
    """Multi-token prediction: `fc([norm(embed(t+1)), norm(h_t)])` -> one attention decoder layer -> norm."""

    cfg: ModelConfig
    ops: ModelOps = CHUNKED

    @nn.compact
    def __call__(self, embeds: jax.Array, hidden: jax.Array, batch: AttentionBatch, pool: KVPool, *,
                 layer: int = 0) -> tuple[jax.Array, KVPool]:
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.norm_eps, cfg.zero_centered_norm, name=name)
        # vLLM qwen3_next_mtp: embedding first, hidden second.
        x = jnp.concatenate([norm("pre_fc_norm_embedding")(embeds), norm("pre_fc_norm_hidden")(hidden)], axis=-1)
        x = nn.Dense(cfg.hidden_size, use_bias=False, dtype=hidden.dtype, name="fc")(x)
        x, pool = DecoderLayer(cfg, cfg.mtp_layers[layer], self.ops, name=f"layers_{layer}")(x, batch, pool)
        return norm("norm")(x), pool


class HybridLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head and the optional MTP head over packed tokens."""

    cfg: ModelConfig
    ops: ModelOps = CHUNKED

    def setup(self) -> None:
        cfg = self.cfg
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(0.02))
        self.layers = [DecoderLayer(cfg, kinds, self.ops) for kinds in cfg.layers]
        self.norm = RMSNorm(cfg.norm_eps, cfg.zero_centered_norm)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False)
        if cfg.mtp_layers:
            self.mtp = MTPHead(cfg, self.ops)

    def __call__(self, token_ids: jax.Array, batch: AttentionBatch,
                 cache: ModelCache) -> tuple[jax.Array, ModelCache]:
        """token_ids: [T] i32 -> (hidden [T, D] after the final norm, cache after these tokens)."""
        x = self.embed_tokens(token_ids)
        new_layers = []
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x, layer_cache = layer(x, batch, layer_cache)
            new_layers.append(layer_cache)
        return self.norm(x), ModelCache(tuple(new_layers), cache.mtp)

    def logits(self, hidden: jax.Array) -> jax.Array:
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def mtp_hidden(self, next_token_ids: jax.Array, hidden: jax.Array, batch: AttentionBatch, cache: ModelCache,
                   layer: int = 0) -> tuple[jax.Array, ModelCache]:
        """Draft hidden states predicting token t+2 from `h_t` and token t+1 (its KV goes to cache.mtp)."""
        out, pool = self.mtp(self.embed_tokens(next_token_ids), hidden, batch, cache.mtp[layer], layer=layer)
        mtp = cache.mtp[:layer] + (pool,) + cache.mtp[layer + 1 :]
        return out, ModelCache(cache.layers, mtp)


def _zero_kv(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> KVPool:
    a = cfg.attention
    shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
    return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _zero_recurrent(cfg: ModelConfig, kind: str, num_rows: int, dtype: jnp.dtype) -> RecurrentState:
    mixer = cfg.gdn if kind == GDN else cfg.mamba2
    conv = jnp.zeros((num_rows, mixer.conv_kernel - 1, mixer.conv_dim), dtype)
    if kind == GDN:
        ssm_shape = (num_rows, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    else:
        ssm_shape = (num_rows, mixer.num_heads, mixer.head_dim, mixer.state_size)
    return RecurrentState(conv, jnp.zeros(ssm_shape, jnp.float32))


def init_cache(cfg: ModelConfig, num_rows: int, num_blocks: int, block_size: int,
               dtype: jnp.dtype = jnp.float32) -> ModelCache:
    """Zero recurrent states for `num_rows` rows and zero KV pools of `num_blocks` blocks (block 0 null)."""
    layers = []
    for kinds in cfg.layers:
        stateful = [k for k in kinds if k not in (MLP, MOE)]
        if not stateful:
            layers.append(None)
        elif stateful[0] == ATTENTION:
            layers.append(_zero_kv(cfg, num_blocks, block_size, dtype))
        else:
            layers.append(_zero_recurrent(cfg, stateful[0], num_rows, dtype))
    mtp = tuple(_zero_kv(cfg, num_blocks, block_size, dtype) for _ in cfg.mtp_layers)
    return ModelCache(tuple(layers), mtp)
