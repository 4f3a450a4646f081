"""The hybrid layer stack for all three families, driven by `ModelConfig.layers`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.models.attention import Attention
from jaxhybrid.models.config import ATTENTION, GDN, MAMBA2, ModelConfig
from jaxhybrid.models.gdn import GatedDeltaNet
from jaxhybrid.models.layers import RMSNorm, make_ffn
from jaxhybrid.models.mamba2 import Mamba2Mixer
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import DeviceState, KVPool, LayerPool


class DecoderLayer(nn.Module):
    """Sublayers in order, each `x + sublayer(norm_j(x))`; at most one of them carries a cache."""

    cfg: ModelConfig
    kinds: tuple[str, ...]
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, x: jax.Array, plan: DevicePlan, pool: LayerPool) -> tuple[jax.Array, LayerPool]:
        cfg = self.cfg
        for j, kind in enumerate(self.kinds):
            h = RMSNorm(cfg.norm_eps, cfg.zero_centered_norm, name=f"norm_{j}")(x)
            if kind == GDN:
                h, pool = GatedDeltaNet(cfg.gdn, cfg.norm_eps, self.ops, name=kind)(h, plan, pool)
            elif kind == MAMBA2:
                h, pool = Mamba2Mixer(cfg.mamba2, cfg.norm_eps, self.ops, name=kind)(h, plan, pool)
            elif kind == ATTENTION:
                h, pool = Attention(cfg.attention, cfg.norm_eps, self.ops, name=kind)(h, plan, pool)
            else:
                h = make_ffn(kind, cfg, name=kind, platform=self.ops.platform())(h)
            x = x + h
        return x, pool


class MTPHead(nn.Module):
    """Multi-token prediction: `fc([norm(embed(t+1)), norm(h_t)])` -> one attention decoder layer -> norm."""

    cfg: ModelConfig
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, embeds: jax.Array, hidden: jax.Array, plan: DevicePlan, pool: KVPool, *,
                 layer: int = 0) -> tuple[jax.Array, KVPool]:
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.norm_eps, cfg.zero_centered_norm, name=name)
        # vLLM qwen3_next_mtp: embedding first, hidden second.
        x = jnp.concatenate([norm("pre_fc_norm_embedding")(embeds), norm("pre_fc_norm_hidden")(hidden)], axis=-1)
        x = nn.Dense(cfg.hidden_size, use_bias=False, dtype=hidden.dtype, name="fc")(x)
        x, pool = DecoderLayer(cfg, cfg.mtp_layers[layer], self.ops, name=f"layers_{layer}")(x, plan, pool)
        return norm("norm")(x), pool


class HybridLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head and the optional MTP head over packed tokens."""

    cfg: ModelConfig
    ops: ModelOps = DEFAULT_OPS

    def setup(self) -> None:
        cfg = self.cfg
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(0.02))
        self.layers = [DecoderLayer(cfg, kinds, self.ops) for kinds in cfg.layers]
        self.norm = RMSNorm(cfg.norm_eps, cfg.zero_centered_norm)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False)
        if cfg.mtp_layers:
            self.mtp = MTPHead(cfg, self.ops)

    def __call__(self, token_ids: jax.Array, plan: DevicePlan, state: DeviceState) -> tuple[jax.Array, DeviceState]:
        """token_ids: [T] i32 -> (hidden [T, D] after the final norm, the pools after these tokens)."""
        x = self.embed_tokens(token_ids)
        new_layers = []
        for layer, pool in zip(self.layers, state.layers, strict=True):
            x, pool = layer(x, plan, pool)
            new_layers.append(pool)
        return self.norm(x), state._replace(layers=tuple(new_layers))

    def logits(self, hidden: jax.Array) -> jax.Array:
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def mtp_hidden(self, next_token_ids: jax.Array, hidden: jax.Array, plan: DevicePlan, state: DeviceState,
                   layer: int = 0) -> tuple[jax.Array, DeviceState]:
        """Draft hidden states predicting token t+2 from `h_t` and token t+1 (its KV goes to state.mtp)."""
        out, pool = self.mtp(self.embed_tokens(next_token_ids), hidden, plan, state.mtp[layer], layer=layer)
        return out, state._replace(mtp=state.mtp[:layer] + (pool,) + state.mtp[layer + 1 :])

