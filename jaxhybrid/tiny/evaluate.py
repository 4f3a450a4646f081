"""Held-out metrics of a trained model through the inference ops: loss, perplexity, top-1 of both heads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.tiny.train import forward

EVAL_BATCH = 4


@dataclass(frozen=True)
class HeldOutMetrics:
    num_tokens: int  # next-token targets scored
    loss: float  # mean next-token cross-entropy, nats
    accuracy: float  # next-token top-1
    mtp_loss: float  # MTP cross-entropy for token t+2, nats
    mtp_accuracy: float  # MTP top-1 for token t+2
    unigram_loss: float  # cross-entropy of add-one unigram frequencies from the training stream

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def unigram_perplexity(self) -> float:
        return math.exp(self.unigram_loss)


def _sums(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, number of top-1 hits) of logits [..., V] against targets [...]."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return nll.sum(), (jnp.argmax(logits, axis=-1) == targets).sum()


def _batch_sums(module: HybridLM, params: Any, tokens: jax.Array) -> jax.Array:
    logits, mtp_logits = forward(module, params, tokens)
    main = _sums(logits[:, :-1], tokens[:, 1:])
    mtp = _sums(mtp_logits[:, :-2], tokens[:, 2:])
    return jnp.stack([*main, *mtp]).astype(jnp.float32)


def unigram_loss(train_stream: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    return float(-np.mean(np.log(counts[targets] / counts.sum())))


def evaluate(cfg: ModelConfig, params: Any, held_out: np.ndarray, train_stream: np.ndarray) -> HeldOutMetrics:
    """Score held-out windows [N, L] (each an independent sequence) with the inference ops."""
    module = HybridLM(cfg)
    step = jax.jit(lambda p, t: _batch_sums(module, p, t))
    num_batches = len(held_out) // EVAL_BATCH
    totals = np.zeros(4)
    for i in range(num_batches):
        totals += np.asarray(step(params, jnp.asarray(held_out[i * EVAL_BATCH : (i + 1) * EVAL_BATCH])), np.float64)
    used = held_out[: num_batches * EVAL_BATCH]
    num_main, num_mtp = used[:, 1:].size, used[:, 2:].size
    return HeldOutMetrics(
        num_tokens=num_main, loss=totals[0] / num_main, accuracy=totals[1] / num_main,
        mtp_loss=totals[2] / num_mtp, mtp_accuracy=totals[3] / num_mtp,
        unigram_loss=unigram_loss(train_stream, used[:, 1:].reshape(-1), cfg.vocab_size),
    )
