"""Joint next-token + MTP training of a `HybridLM` on fixed [B, L] windows, with optax AdamW."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.model import full_forward
from jaxhybrid.tiny.fast_ops import TRAINING_OPS
from jaxhybrid.tiny.recipe import TrainSettings

BLOCK_SIZE = 16


def windows(token_ids: np.ndarray, length: int) -> np.ndarray:
    """[N] -> [N // length, length]; the tail shorter than one window is dropped."""
    count = len(token_ids) // length
    return token_ids[: count * length].reshape(count, length)


def forward(module: HybridLM, params: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [B, L] -> (next-token logits [B, L, V], MTP logits [B, L, V]); rows are independent sequences."""
    return full_forward(module, params, tokens, BLOCK_SIZE, with_mtp=True)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean CE (nats) of logits [..., V] against integer targets [...]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def losses(module: HybridLM, params: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(next-token CE over positions 0..L-2, MTP CE for token t+2 over positions 0..L-3)."""
    logits, mtp_logits = forward(module, params, tokens)
    return cross_entropy(logits[:, :-1], tokens[:, 1:]), cross_entropy(mtp_logits[:, :-2], tokens[:, 2:])


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.peak_lr, settings.warmup, settings.num_steps,
        end_value=settings.peak_lr * settings.final_lr_fraction,
    )
    # No decay on norms, gates' scalars and other vectors; only on matrices.
    decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(settings.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay, mask=decay_mask),
    )


def compile_train_step(module: HybridLM, optimizer: optax.GradientTransformation, mtp_weight: float,
                       params: Any, opt_state: Any, tokens: jax.ShapeDtypeStruct) -> Callable:
    """`step(params, opt_state, tokens[B, L]) -> (params, opt_state, next-token loss, MTP loss)`, compiled
    once (params and optimizer state donated); `module` is built with the training ops."""

    def objective(params, tokens):
        main, mtp = losses(module, params, tokens)
        return main + mtp_weight * mtp, (main, mtp)

    def step(params, opt_state, tokens):
        grads, (main, mtp) = jax.grad(objective, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, main, mtp

    return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()


def train(cfg: ModelConfig, params: Any, data: np.ndarray,
          settings: TrainSettings) -> tuple[Any, list[tuple[float, float]], float]:
    """Run `settings.num_steps` steps over shuffled windows `data` [N, L].

    Returns (params, per-step (next-token loss, MTP loss), seconds spent training).
    """
    module = HybridLM(cfg, TRAINING_OPS)
    optimizer = make_optimizer(settings)
    opt_state = optimizer.init(params)
    tokens_spec = jax.ShapeDtypeStruct((settings.batch_size, settings.seq_len), jnp.int32)
    step = compile_train_step(module, optimizer, settings.mtp_loss_weight, params, opt_state, tokens_spec)
    order = _batch_order(len(data), settings)
    history: list[tuple[float, float]] = []
    tokens_per_step = settings.batch_size * settings.seq_len
    start = time.perf_counter()
    with tqdm(range(settings.num_steps), desc="train", unit="step") as bar:
        for i in bar:
            params, opt_state, main, mtp = step(params, opt_state, jnp.asarray(data[order[i]]))
            history.append((float(main), float(mtp)))
            rate = tokens_per_step * (i + 1) / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{history[-1][0]:.3f}", mtp=f"{history[-1][1]:.3f}", tok_s=f"{rate:.0f}")
    return params, history, time.perf_counter() - start


def _batch_order(num_windows: int, settings: TrainSettings) -> np.ndarray:
    """[num_steps, B] window indices: epochs of seeded permutations, concatenated."""
    rng = np.random.default_rng(settings.seed)
    needed = settings.num_steps * settings.batch_size
    epochs = [rng.permutation(num_windows) for _ in range(-(-needed // num_windows))]
    return np.concatenate(epochs)[:needed].reshape(settings.num_steps, settings.batch_size)
