"""The hybrid layer stack for all three families, driven by `ModelConfig.layers` cut into segments of a
repeating period (`stack.py`): each segment is one scan over its repeats, so a step's program holds each
period once and its compile time does not grow with depth."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.models.attention import Attention
from jaxhybrid.models.config import ATTENTION, GDN, MAMBA2, ModelConfig
from jaxhybrid.models.gdn import GatedDeltaNet
from jaxhybrid.models.layers import Dense, RMSNorm, make_ffn
from jaxhybrid.models.mamba2 import Mamba2Mixer
from jaxhybrid.models.ops import DEFAULT_OPS, ModelOps
from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.models.pools import DeviceState, KVPool, LayerPool, repeat_view
from jaxhybrid.models.stack import Layers, Segment, layer_segments, segment_key


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


class Period(nn.Module):
    """One period of a segment: its layers in order, each on repeat `repeat`'s pages of its stacked pool."""

    cfg: ModelConfig
    period: Layers
    repeats: int
    ops: ModelOps = DEFAULT_OPS

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, tuple[LayerPool, ...]], repeat: jax.Array,
                 plan: DevicePlan) -> tuple[tuple[jax.Array, tuple[LayerPool, ...]], None]:
        x, pools = carry
        updated = []
        for j, (kinds, pool) in enumerate(zip(self.period, pools, strict=True)):
            layer_plan, pages, restack = repeat_view(plan, pool, repeat, self.repeats)
            x, pages = DecoderLayer(self.cfg, kinds, self.ops, name=f"layers_{j}")(x, layer_plan, pages)
            updated.append(restack(pages))
        return (x, tuple(updated)), None


def _segment(cfg: ModelConfig, segment: Segment, ops: ModelOps, name: str) -> nn.Module:
    """The segment's period scanned over its repeats, params stacked on a leading axis; unrolled (one copy
    of the period per repeat) where `ops.scan_layers` is off."""
    scan = nn.scan(Period, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=(0, nn.broadcast),
                   length=segment.repeats, unroll=1 if ops.scan_layers else segment.repeats)
    return scan(cfg, segment.period, segment.repeats, ops, name=name)


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
        x = Dense(cfg.hidden_size, use_bias=False, dtype=hidden.dtype, name="fc")(x)
        x, pool = DecoderLayer(cfg, cfg.mtp_layers[layer], self.ops, name=f"layers_{layer}")(x, plan, pool)
        return norm("norm")(x), pool


class HybridLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head and the optional MTP head over packed tokens."""

    cfg: ModelConfig
    ops: ModelOps = DEFAULT_OPS

    def setup(self) -> None:
        cfg = self.cfg
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(0.02))
        self.segments = [_segment(cfg, segment, self.ops, segment_key(k))
                         for k, segment in enumerate(layer_segments(cfg.layers))]
        self.norm = RMSNorm(cfg.norm_eps, cfg.zero_centered_norm)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense(cfg.vocab_size, use_bias=False)
        if cfg.mtp_layers:
            self.mtp = MTPHead(cfg, self.ops)

    def __call__(self, token_ids: jax.Array, plan: DevicePlan, state: DeviceState) -> tuple[jax.Array, DeviceState]:
        """token_ids: [T] i32 -> (hidden [T, D] after the final norm, the pools after these tokens)."""
        x = self.embed_tokens(token_ids)
        segments = []
        for scan, segment, pools in zip(self.segments, layer_segments(self.cfg.layers), state.layers, strict=True):
            (x, pools), _ = scan((x, pools), jnp.arange(segment.repeats, dtype=jnp.int32), plan)
            segments.append(pools)
        return self.norm(x), state._replace(layers=tuple(segments))

    def logits(self, hidden: jax.Array) -> jax.Array:
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def mtp_hidden(self, next_token_ids: jax.Array, hidden: jax.Array, plan: DevicePlan, state: DeviceState,
                   layer: int = 0) -> tuple[jax.Array, DeviceState]:
        """Draft hidden states predicting token t+2 from `h_t` and token t+1 (its KV goes to state.mtp)."""
        out, pool = self.mtp(self.embed_tokens(next_token_ids), hidden, plan, state.mtp[layer], layer=layer)
        return out, state._replace(mtp=state.mtp[:layer] + (pool,) + state.mtp[layer + 1 :])

