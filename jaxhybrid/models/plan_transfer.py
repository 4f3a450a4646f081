"""A `BatchPlan` on device in one transfer: every device field packed into one int32 buffer on the host,
cut back into arrays of the plan's own names inside the jitted step (static offsets: free views).

The layout depends only on the plan's buckets (T, R, B, L) and the config's K, Lw and D, so it is the
static part of the step's jit: one compilation per bucket, never per plan.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scheduler import BatchPlan, RowKind

_COUNTS = ("num_rows", "num_tokens", "num_hit_copies", "num_pair_copies", "num_publishes", "num_materializations")
# the plan fields the device reads, by name (host-only fields: step_id, request_ids, row_ids)
_ARRAYS = ("row_kind", "phase", "cu_seqlens", "query_lens", "context_lens", "state_slots", "has_initial_state",
           "block_table", "token_ids", "positions", "slot_mapping", "draft_token_ids", "num_logits", "cu_logits",
           "logits_indices", "lookahead_token_ids", "num_lookahead_tokens", "ring_start", "ring_committed", "flush",
           "hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst", "publish_src", "publish_dst",
           "materialize_src", "materialize_dst", "materialize_ring_start", "materialize_count")


# the fields that index state slots; the KV pool's are block_table and slot_mapping
_SLOT_FIELDS = ("state_slots", "hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst", "publish_src",
                "publish_dst", "materialize_src", "materialize_dst")


class PlanLayout(NamedTuple):
    """(name, offset, shape, dtype) of every packed field, in int32 words; hashable, a static jit argument."""

    fields: tuple[tuple[str, int, tuple[int, ...], str], ...]
    size: int

    def num_rows(self) -> int:
        """R, the row bucket of the plans packed this way."""
        return next(shape[0] for name, _, shape, _ in self.fields if name == "row_kind")


class DevicePlan(NamedTuple):
    """The device fields of a `BatchPlan` under the same names (docs/engine.md#inside-the-jitted-step), as jax arrays;
    the counts are int32 scalars, `row_data` [R, D] uint8."""

    num_rows: jax.Array
    num_tokens: jax.Array
    num_hit_copies: jax.Array
    num_pair_copies: jax.Array
    num_publishes: jax.Array
    num_materializations: jax.Array
    row_kind: jax.Array
    phase: jax.Array
    cu_seqlens: jax.Array
    query_lens: jax.Array
    context_lens: jax.Array
    state_slots: jax.Array
    has_initial_state: jax.Array
    block_table: jax.Array
    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    draft_token_ids: jax.Array
    num_logits: jax.Array
    cu_logits: jax.Array
    logits_indices: jax.Array
    lookahead_token_ids: jax.Array
    num_lookahead_tokens: jax.Array
    ring_start: jax.Array
    ring_committed: jax.Array
    flush: jax.Array
    hit_copy_src: jax.Array
    hit_copy_dst: jax.Array
    pair_copy_src: jax.Array
    pair_copy_dst: jax.Array
    publish_src: jax.Array
    publish_dst: jax.Array
    materialize_src: jax.Array
    materialize_dst: jax.Array
    materialize_ring_start: jax.Array
    materialize_count: jax.Array
    row_data: jax.Array

    def on_slots(self, offset: jax.Array) -> DevicePlan:
        """The plan with every real state slot s at s + offset (null slot 0 stays 0)."""
        shift = lambda slots: jnp.where(slots > 0, slots + offset, 0)
        return self._replace(**{name: shift(getattr(self, name)) for name in _SLOT_FIELDS})

    def on_blocks(self, offset: jax.Array, *, block_size: int) -> DevicePlan:
        """The plan with every real KV block b at b + offset (null block 0, and writes into it, stay put)."""
        return self._replace(block_table=jnp.where(self.block_table > 0, self.block_table + offset, 0),
                             slot_mapping=jnp.where(self.slot_mapping >= block_size,
                                                    self.slot_mapping + offset * block_size, self.slot_mapping))


def pack_plan(plan: BatchPlan) -> tuple[np.ndarray, PlanLayout]:
    """One int32 buffer holding every device field of `plan`, and its layout."""
    arrays = [getattr(plan, name) for name in _ARRAYS]
    key = (*((array.shape, array.dtype) for array in arrays), plan.row_data.shape)
    layout = _LAYOUTS.get(key) or _LAYOUTS.setdefault(key, _layout(arrays, plan.row_data.shape))
    buffer = np.zeros(layout.size, np.int32)
    buffer[:len(_COUNTS)] = [getattr(plan, name) for name in _COUNTS]
    for (_, offset, _, _), array in zip(layout.fields[len(_COUNTS):-1], arrays, strict=True):
        buffer[offset:offset + array.size] = array.reshape(-1)  # widened to int32 on the way
    _, offset, (rows, words), _ = layout.fields[-1]
    if words:  # each row's bytes, padded to whole words
        row_bytes = buffer[offset:offset + rows * words].view(np.uint8).reshape(rows, -1)
        row_bytes[:, :plan.row_data.shape[1]] = plan.row_data
    return buffer, layout


_LAYOUTS: dict[tuple, PlanLayout] = {}  # a plan's layout by its fields' shapes and dtypes: one per bucket


def _layout(arrays: list[np.ndarray], row_data_shape: tuple[int, int]) -> PlanLayout:
    """Counts first (a word each), then every array as int32 words, then row_data's bytes padded to words."""
    fields, offset = [], 0
    shapes = [(name, (), "int32") for name in _COUNTS] + [
        (name, array.shape, str(array.dtype)) for name, array in zip(_ARRAYS, arrays, strict=True)]
    shapes.append(("row_data", (row_data_shape[0], -(-row_data_shape[1] // 4)), "uint8"))
    for name, shape, dtype in shapes:
        fields.append((name, offset, shape, dtype))
        offset += int(np.prod(shape, dtype=np.int64))
    return PlanLayout(tuple(fields), offset)


def unpack_plan(buffer: jax.Array, layout: PlanLayout, row_data_bytes: int) -> DevicePlan:
    """Inside the jitted step: the packed buffer back as named arrays of their own dtypes."""
    out = {}
    for name, offset, shape, dtype in layout.fields:
        words = jax.lax.slice(buffer, (offset,), (offset + int(np.prod(shape, dtype=np.int64)),)).reshape(shape)
        if name == "row_data":
            out[name] = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape[0], -1)[:, :row_data_bytes]
        elif dtype == "bool":
            out[name] = words != 0
        else:
            out[name] = words.astype(dtype)
    return DevicePlan(**out)


def row_of(offsets: jax.Array, index: jax.Array) -> jax.Array:
    """The row r with offsets[r] <= index < offsets[r + 1] ([R+1] cumulative offsets)."""
    return jnp.clip(jnp.searchsorted(offsets[1:], index, side="right"), 0, offsets.shape[0] - 2)


def next_tokens(plan: DevicePlan, sampled: jax.Array) -> jax.Array:
    """[T] the token after each packed token: the next one in its chunk, the first lookahead token after a
    chunk, the sampled token after a prompt (or a decode row's token), a verify row's emitted tokens."""
    num_tokens = plan.token_ids.shape[0]
    tok = jnp.arange(num_tokens)
    row = row_of(plan.cu_seqlens, tok)
    after_chunk = jnp.where(plan.num_lookahead_tokens[row] > 0, plan.lookahead_token_ids[row, 0], sampled[row, 0])
    next_prompt = jnp.where(tok + 1 == plan.cu_seqlens[row + 1], after_chunk,
                            plan.token_ids[jnp.minimum(tok + 1, num_tokens - 1)])
    emitted = sampled[row, jnp.clip(tok - plan.cu_seqlens[row], 0, sampled.shape[1] - 1)]
    return jnp.where(plan.row_kind[row] == RowKind.VERIFY, emitted, next_prompt)
