"""Sampling a step's rows: constraints, then penalties (vLLM's order), then a sample or a verification of drafts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxhybrid.models.plan_transfer import DevicePlan
from jaxhybrid.sample.sampler import (
    Constraint,
    SamplingRows,
    apply_constraints,
    apply_penalties,
    has_penalties,
    sample,
    verify_greedy,
    verify_random,
)
from scheduler import RowKind


def _penalized(target: jax.Array, plan: DevicePlan, rows: SamplingRows, history: jax.Array,
               predicted: jax.Array) -> jax.Array:
    """vLLM's penalties at each target logit: prompt tokens, and output tokens before the drawn position."""
    num_rows, width, vocab = target.shape
    sequence = history[plan.state_slots]  # [R, H]
    position = jnp.arange(sequence.shape[1])
    before = position[None, None, :] < predicted[:, :, None]  # [R, 1+K, H]
    in_prompt = (position[None, :] < rows.prompt_len[:, None])[:, None, :]
    index = (jnp.arange(num_rows)[:, None, None], jnp.arange(width)[None, :, None], sequence[:, None, :])
    counts = jnp.zeros((num_rows, width, vocab), jnp.int32).at[index].add((before & ~in_prompt).astype(jnp.int32))
    prompt_mask = jnp.zeros((num_rows, width, vocab), bool).at[index].max(before & in_prompt)
    per_logit = SamplingRows(*(jnp.repeat(field, width) for field in rows))
    flat = lambda x: x.reshape(num_rows * width, vocab)
    return apply_penalties(flat(target), per_logit, flat(prompt_mask), flat(counts)).reshape(target.shape)


def _constrained(target: jax.Array, rows: SamplingRows, history: jax.Array, state_slots: jax.Array,
                 predicted: jax.Array, constraints: jax.Array) -> jax.Array:
    """Each row's constraint entries applied at each of its target logits ([R, 1+K, V]), bad words matched
    against the output tokens before the drawn position."""
    num_rows, width, vocab = target.shape
    sequence = history[state_slots]  # [R, H]
    back_at = predicted[:, :, None] - constraints[:, None, :, 3]  # [R, 1+K, E] positions `back` before
    earlier = jnp.take_along_axis(sequence[:, None, :], jnp.clip(back_at, 0, sequence.shape[1] - 1), axis=2)
    earlier = jnp.where(back_at >= rows.prompt_len[:, None, None], earlier, -1)
    repeat = lambda x: jnp.repeat(x, width, axis=0)
    logits = apply_constraints(target.reshape(num_rows * width, vocab), repeat(constraints),
                               earlier.reshape(num_rows * width, -1),
                               (predicted - rows.prompt_len[:, None]).reshape(-1), repeat(rows.min_tokens))
    return logits.reshape(target.shape)


def sample_rows(logits: jax.Array, plan: DevicePlan, rows: SamplingRows, history: jax.Array, constraints: jax.Array,
                k: int, token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """[R, 1+K] tokens and [R] accepted drafts: verify rows verify their drafts at their 1 + K logits, every
    other row samples at its last logit (update ignores rows whose prefill goes on). A grammar's token mask
    ([L, words], one bit per token at each logit entry) comes first, then constraints and penalties (vLLM's
    order), these two skipped at run time in a step where no row has any."""
    verify = plan.row_kind == RowKind.VERIFY
    last = plan.cu_logits[1:] - 1
    first = jnp.where(verify, plan.cu_logits[:-1], last)
    entry = jnp.clip(first[:, None] + jnp.arange(1 + k), 0, logits.shape[0] - 1)  # [R, 1+K]
    predicted = plan.positions[plan.logits_indices[entry]] + 1  # position of the token each logit draws
    real = plan.row_kind != RowKind.PADDING
    # padding rows hold zero records: no penalty, and no top-p filter (which would sort every row's vocabulary)
    rows = rows._replace(repetition_penalty=jnp.where(real, rows.repetition_penalty, 1.0),
                         top_p=jnp.where(real, rows.top_p, 1.0))
    target = logits[entry]
    if token_mask is not None:  # a draft the grammar refuses has probability 0, so it is never accepted
        target = jnp.where(allowed_tokens(token_mask[entry], target.shape[-1]), target, -jnp.inf)
    target = jax.lax.cond(jnp.any(constraints[..., 0] != Constraint.NONE),
                          lambda: _constrained(target, rows, history, plan.state_slots, predicted, constraints),
                          lambda: target)
    target = jax.lax.cond(jnp.any(has_penalties(rows) & real),
                          lambda: _penalized(target, plan, rows, history, predicted), lambda: target)
    greedy = jnp.all(rows.temperature <= 0)
    tokens = jax.lax.cond(greedy, lambda: jnp.argmax(target[:, 0], axis=-1).astype(jnp.int32),
                          lambda: sample(target[:, 0], rows, predicted[:, 0]))
    sampled = jnp.zeros((tokens.shape[0], 1 + k), jnp.int32).at[:, 0].set(tokens)
    if not k:
        return sampled, jnp.zeros_like(tokens)
    drafts = plan.draft_token_ids
    verified = jax.lax.cond(
        greedy, lambda: verify_greedy(target, drafts),
        # a greedy drafter's q is one-hot at its draft: accept with p(d), resample from norm(max(p - q, 0))
        lambda: verify_random(target, jax.nn.one_hot(drafts, logits.shape[-1]), drafts, rows, predicted[:, 0]))
    return (jnp.where(verify[:, None], verified.tokens, sampled),
            jnp.where(verify, verified.num_accepted, 0).astype(jnp.int32))


def allowed_tokens(words: jax.Array, vocab: int) -> jax.Array:
    """[..., words] int32 bit masks (token t is bit t % 32 of word t // 32) as [..., vocab] bools."""
    token = jnp.arange(vocab)
    return ((words[..., token // 32] >> (token % 32)) & 1).astype(bool)
