"""MTP speculative decoding: K greedy drafts per row from the model's MTP layer, inside the step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.plan_transfer import DevicePlan, next_tokens
from jaxhybrid.models.pools import DeviceState
from scheduler import RowKind


def draft(module: HybridLM, variables: Any, hidden: jax.Array, plan: DevicePlan, sampled: jax.Array,
          accepted: jax.Array, state: DeviceState, k: int, block_size: int) -> tuple[jax.Array, DeviceState]:
    """K greedy MTP drafts per row (a greedy drafter keeps verification lossless with a one-hot q).

    The first pass runs the MTP layer over every token with its true next token (the chunk's next, the
    lookahead after a chunk, the sampled token after a prompt, a verify row's emitted tokens), writing the
    MTP KV of every position; the row's first draft comes from its last committed position. Drafts 2..K
    are one-token passes; their KV writes are transient (the next step rewrites those positions before
    reading them) and stay inside the blocks of this step's tokens: beyond them they go to the null block.
    """
    num_tokens = hidden.shape[0]
    following = next_tokens(plan, sampled)
    out, state = module.apply(variables, following, hidden, plan, state, method=HybridLM.mtp_hidden)
    verify = plan.row_kind == RowKind.VERIFY
    source = jnp.clip(jnp.where(verify, plan.cu_seqlens[:-1] + accepted, plan.cu_seqlens[1:] - 1), 0, num_tokens - 1)
    h = out[source]
    draft = jnp.argmax(module.apply(variables, h, method=HybridLM.logits), axis=-1).astype(jnp.int32)
    drafts, position = [draft], plan.positions[source]
    num_rows = plan.row_kind.shape[0]
    written = plan.context_lens + plan.query_lens  # tokens with KV blocks in this step
    for _ in range(1, k):
        position = position + 1
        column = jnp.minimum(position // block_size, plan.block_table.shape[1] - 1)
        block = plan.block_table[jnp.arange(num_rows), column]
        chain = plan._replace(
            cu_seqlens=jnp.arange(num_rows + 1, dtype=jnp.int32), positions=position,
            slot_mapping=jnp.where(position < written, block * block_size + position % block_size, 0),
            query_lens=jnp.ones(num_rows, jnp.int32),
            context_lens=jnp.maximum(jnp.minimum(position + 1, written), 1) - 1)
        h, state = module.apply(variables, drafts[-1], h, chain, state, method=HybridLM.mtp_hidden)
        drafts.append(jnp.argmax(module.apply(variables, h, method=HybridLM.logits), axis=-1).astype(jnp.int32))
    return jnp.stack(drafts, axis=1), state
