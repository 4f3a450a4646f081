"""The engine step on device, under the plan's own names.

The layers run on the pools (each recurrent layer in the plan's order: materialize, hit copies, decode/verify
rows, two-phase prefill, publishes); logits are computed only at `logits_indices`; every row samples or verifies
its drafts; with MTP the module drafts K tokens for every row; logprobs only in steps where a row asks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.plan_transfer import DevicePlan, PlanLayout, next_tokens, row_of, unpack_plan
from jaxhybrid.models.pools import DeviceState, copy_pages
from jaxhybrid.models.stack import ParamLayout, unflatten_params
from jaxhybrid.sample.rows import sample_rows
from jaxhybrid.sample.sampler import ROW_DTYPE, Logprobs, SamplingRows, logprobs
from jaxhybrid.spec_decode.mtp import draft
from scheduler import RowKind, SchedulerConfig


class StepOutput(NamedTuple):
    """What one step returns, on device until fetched (rows and logits as in the plan)."""

    tokens: jax.Array   # [R, 2 + 2K] i32: each row's sampled tokens [1+K], accepted drafts [1] and drafts [K],
                        # one array so that the host fetches a step's StepResult in one copy
    logprobs: Logprobs  # per logit entry [L]: its token's logprob (the sampled one, or the next prompt
                        # token), and the top-n; zeros in steps where no row asks


class Carried(NamedTuple):
    """What one step leaves on device for the next, whose plan may name it by placeholders (scheduler/resolve.py)."""

    tokens: jax.Array    # [R_max * (1+K)] row r's last emitted token at r * (1+K), its drafts after it
    accepted: jax.Array  # [R_max] row r's accepted drafts


def run_step(module: HybridLM, param_layout: ParamLayout, config: SchedulerConfig, num_logprobs: int,
             param_leaves: list[jax.Array], state: DeviceState, carried: Carried, layout: PlanLayout,
             buffer: jax.Array, constraints: jax.Array) -> tuple[DeviceState, Carried, StepOutput]:
    """One step (the runner jits it per bucket: `layout` static, the state and the carried tokens donated)."""
    state, forwarded = run_forward(module, param_layout, config, param_leaves, state, carried, layout, buffer)
    return run_sampling(module, param_layout, config, num_logprobs, param_leaves, state, carried, forwarded,
                        constraints, None)


class Forwarded(NamedTuple):
    """The layers' work of a step, which its sampling half reads (a step with token masks runs in two halves)."""

    plan: DevicePlan  # placeholders replaced
    hidden: jax.Array  # [T, D]
    logits: jax.Array  # [L, V]


def run_forward(module: HybridLM, param_layout: ParamLayout, config: SchedulerConfig, param_leaves: list[jax.Array],
                state: DeviceState, carried: Carried, layout: PlanLayout,
                buffer: jax.Array) -> tuple[DeviceState, Forwarded]:
    """The layers and the logits of a step."""
    plan = with_carried(unpack_plan(buffer, layout, ROW_DTYPE.itemsize), carried, config.num_spec_tokens,
                        config.block_size)
    variables = {"params": unflatten_params(param_leaves, param_layout)}
    state = state._replace(token_history=record_history(state.token_history, plan))
    hidden, state = module.apply(variables, plan.token_ids, plan, state)
    logits = module.apply(variables, hidden[plan.logits_indices], method=HybridLM.logits)  # [L, V]
    return state, Forwarded(plan, hidden, logits)


def run_sampling(module: HybridLM, param_layout: ParamLayout, config: SchedulerConfig, num_logprobs: int,
                 param_leaves: list[jax.Array], state: DeviceState, carried: Carried, forwarded: Forwarded,
                 constraints: jax.Array, token_mask: jax.Array | None) -> tuple[DeviceState, Carried, StepOutput]:
    """Sampling (under `token_mask` [L, words], if given), logprobs, MTP drafts and the tokens carried on. The
    params are read by the MTP drafter only (without it `param_leaves` may be empty)."""
    plan, hidden, logits = forwarded
    rows = SamplingRows.from_bytes(plan.row_data)
    sampled, accepted = sample_rows(logits, plan, rows, state.token_history, constraints, config.num_spec_tokens,
                                    token_mask)
    real = plan.row_kind != RowKind.PADDING
    wanted, with_top = jnp.any((rows.logprobs > 0) & real), jnp.any((rows.logprobs > 1) & real)
    reported = jax.lax.cond(wanted, lambda: _logprobs(logits, plan, sampled, num_logprobs, with_top),
                            lambda: _no_logprobs(logits.shape[0], num_logprobs))
    drafts = jnp.zeros((plan.row_kind.shape[0], 0), jnp.int32)
    if config.num_spec_tokens:
        variables = {"params": unflatten_params(param_leaves, param_layout)}
        drafts, state = draft(module, variables, hidden, plan, sampled, accepted, state, config.num_spec_tokens,
                              config.block_size)
    # penalties read the history before the publishes write it (the barrier orders them; without it
    # XLA copies the whole history to keep both)
    history, _ = jax.lax.optimization_barrier((state.token_history, sampled))
    history = copy_pages(history, plan.publish_src, plan.publish_dst, plan.num_publishes)
    emitted = sampled[jnp.arange(sampled.shape[0]), accepted]  # each row's last emitted token
    last = jnp.concatenate([emitted[:, None], drafts], axis=1).reshape(-1)
    carried = Carried(jnp.zeros_like(carried.tokens).at[:last.shape[0]].set(last),
                      jnp.zeros_like(carried.accepted).at[:accepted.shape[0]].set(accepted))
    tokens = jnp.concatenate([sampled, accepted[:, None], drafts], axis=1)
    return state._replace(token_history=history), carried, StepOutput(tokens, reported)


def with_carried(plan: DevicePlan, carried: Carried, k: int, block_size: int) -> DevicePlan:
    """The plan with the tokens the host had not read when it scheduled it (one step ahead, scheduler/resolve.py):
    placeholder -(1 + r * (1+K) + j) is row r's last emitted token (j = 0) or its draft j of the step before,
    and a verify row starting with row r's placeholder moves on by the drafts row r accepted."""
    raw = plan.token_ids
    real = lambda tokens: jnp.where(tokens < 0, carried.tokens[jnp.maximum(-1 - tokens, 0)], tokens)
    plan = plan._replace(token_ids=real(raw), draft_token_ids=real(plan.draft_token_ids))
    if not k:
        return plan
    first = raw[jnp.minimum(plan.cu_seqlens[:-1], raw.shape[0] - 1)]
    moved = (plan.row_kind == RowKind.VERIFY) & (first < 0)
    shift = jnp.where(moved, carried.accepted[jnp.maximum(-1 - first, 0) // (1 + k)], 0)
    tok = jnp.arange(raw.shape[0])
    row = row_of(plan.cu_seqlens, tok)
    token_shift = jnp.where(tok < plan.cu_seqlens[-1], shift[row], 0)
    positions = plan.positions + token_shift
    block = plan.block_table[row, jnp.minimum(positions // block_size, plan.block_table.shape[1] - 1)]
    return plan._replace(positions=positions, context_lens=plan.context_lens + shift,
                         ring_committed=plan.ring_committed + shift,
                         slot_mapping=jnp.where(token_shift > 0, block * block_size + positions % block_size,
                                                plan.slot_mapping))


def record_history(history: jax.Array, plan: DevicePlan) -> jax.Array:
    """Each slot's token history after this step's copies and tokens, in the plan's order: materialized
    and hit pages copied in, phase-1 tokens written, pair copies, then everyone else's tokens."""
    history = copy_pages(history, plan.materialize_src, plan.materialize_dst, plan.num_materializations)
    history = copy_pages(history, plan.hit_copy_src, plan.hit_copy_dst, plan.num_hit_copies)
    producer = (plan.row_kind == RowKind.PREFILL) & (plan.phase == 1)
    history = _write_tokens(history, plan, producer)
    history = copy_pages(history, plan.pair_copy_src, plan.pair_copy_dst, plan.num_pair_copies)
    return _write_tokens(history, plan, ~producer)


def _write_tokens(history: jax.Array, plan: DevicePlan, rows: jax.Array) -> jax.Array:
    tok = jnp.arange(plan.token_ids.shape[0])
    row = row_of(plan.cu_seqlens, tok)
    slot = plan.state_slots[row]
    keep = (tok < plan.cu_seqlens[-1]) & rows[row] & (slot > 0)
    return history.at[jnp.where(keep, slot, history.shape[0]), plan.positions].set(plan.token_ids, mode="drop")


def _logprobs(logits: jax.Array, plan: DevicePlan, sampled: jax.Array, num_top: int, with_top: jax.Array) -> Logprobs:
    """Each logit entry's token is the one after its packed token: emitted where the row samples, the next
    prompt token elsewhere."""
    return logprobs(logits, next_tokens(plan, sampled)[plan.logits_indices], num_top, with_top)


def _no_logprobs(num_entries: int, num_top: int) -> Logprobs:
    return Logprobs(jnp.zeros(num_entries), jnp.zeros((num_entries, num_top), jnp.int32),
                    jnp.zeros((num_entries, num_top)), jnp.zeros(num_entries, jnp.int32))
