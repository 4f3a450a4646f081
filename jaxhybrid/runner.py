"""The runner owns the plan-to-device contract: one `BatchPlan` in, one `StepResult` out.

`Runner.step(plan)` packs the plan into one int32 transfer and calls one jitted step per bucket (the
packed layout is its static argument) with the `DeviceState` donated. Inside the step, under the plan's
own names: the layers run on the pools (each recurrent layer in the plan's order: materialise, hit
copies, decode/verify rows, two-phase prefill, publishes), logits are computed only at
`logits_indices`, every row samples or verifies its drafts, and with MTP the module drafts K tokens
for every row; logprobs are computed only in steps where a row asks for them.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxhybrid.distributed.multihost import Message, PlanChannel, is_leader
from jaxhybrid.distributed.tensor_parallel import AXIS, param_shardings, state_shardings, to_tp_layout
from jaxhybrid.model import Model
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.pools import DeviceState, copy_pages, init_device_state
from jaxhybrid.plan_transfer import DevicePlan, PlanLayout, pack_plan, unpack_plan
from jaxhybrid.sampling import (
    ROW_DTYPE,
    Constraint,
    Logprobs,
    SamplingRows,
    apply_constraints,
    apply_penalties,
    batch_constraints,
    has_penalties,
    logprobs,
    sample,
    verify_greedy,
    verify_random,
)
from scheduler import BatchPlan, RowKind, SchedulerConfig, StepResult
from scheduler.replay import ring_rows


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


class Runner:
    """A model's params and device pools, sized by a `SchedulerConfig`, stepping its plans."""

    def __init__(self, model: Model, config: SchedulerConfig, *, max_logprobs: int = 20, mesh: Mesh | None = None):
        if config.row_data_bytes != ROW_DTYPE.itemsize:
            raise ValueError(f"SchedulerConfig.row_data_bytes must be {ROW_DTYPE.itemsize} (sampling.ROW_DTYPE), "
                             f"got {config.row_data_bytes}")
        if min(config.row_buckets) < 2:
            # a one-row step makes every per-row pool write a one-index scatter, which XLA turns into a
            # dynamic-update-slice and copies the whole pool around; a padding row costs nothing
            raise ValueError(f"SchedulerConfig.row_buckets must all be >= 2, got {config.row_buckets}")
        if config.num_spec_tokens and not model.config.mtp_layers:
            raise ValueError(f"num_spec_tokens={config.num_spec_tokens} needs MTP weights (mtp.*), which this "
                             f"{model.config.model_type} checkpoint does not have")
        self.model, self.config, self.mesh = model, config, mesh
        vocab = model.config.vocab_size
        self.num_logprobs = vocab if max_logprobs == -1 else min(max_logprobs, vocab)  # vLLM's -1: no cap
        self.params, self.module = model.params, model.module
        # params given as ShapeDtypeStructs (`abstract_params`, with a sharding on the devices compiled for):
        # a runner that holds no arrays and only lowers its step (`lower`), for a GPU this host may not have
        self.abstract = isinstance(jax.tree.leaves(model.params)[0], jax.ShapeDtypeStruct)
        # multi-host: every process runs every step; the leader sends the others its plans (multihost.py)
        self.channel = PlanChannel() if jax.process_count() > 1 else None
        self._layouts: dict[tuple[int, int, int, int], PlanLayout] = {}
        shardings = {}
        if mesh is not None:  # tensor parallel: weights and pools sharded by heads, outputs replicated
            self.params = self._sharded_params(model.params)
            self.module = HybridLM(model.config, dataclasses.replace(model.module.ops, mesh=mesh))
            replicated = NamedSharding(mesh, PartitionSpec())
            shardings = dict(out_shardings=(self._state_shardings(), replicated, replicated))
        # the nested params dict flattened once: the jitted call then takes a flat list, and does not sort
        # every dict's keys again on each step (0.1 ms of the host's step on the embedded model)
        self.param_leaves, self._param_tree = jax.tree.flatten(self.params)
        self._fresh_pools()
        self._step = jax.jit(self._step_fn, static_argnums=3, donate_argnums=(1, 2), **shardings)

    def _sharded_params(self, params: Any) -> Any:
        """The params in the head-aligned layout, placed by `param_shardings` (abstract ones only annotated:
        the layout permutes within axes, so their shapes stand)."""
        cfg, mesh = self.model.config, self.mesh
        if self.abstract:
            return _sharded_specs(params, param_shardings(params, cfg, mesh))
        params = params if self.channel is None else jax.tree.map(np.asarray, params)  # from the host
        params = to_tp_layout(params, cfg, mesh.shape[AXIS])
        return jax.device_put(params, param_shardings(params, cfg, mesh))

    def _state_shardings(self) -> DeviceState:
        return state_shardings(jax.eval_shape(self._fresh_state), self.model.config, self.mesh)

    def _fresh_state(self) -> DeviceState:
        config = self.config
        return init_device_state(
            self.model.config, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_state_slots, ring_entries=ring_rows(config.ring_size, config.num_spec_tokens),
            history_len=config.max_model_len + config.num_spec_tokens, dtype=self.model.dtype,
            snapshots=config.ring_size == 0)

    def reset_state(self) -> None:
        """Fresh, all-zero pools, after a failed step may have consumed the donated ones (followers too)."""
        if self.channel is not None:
            self.channel.send(Message.RESET)
        self._fresh_pools()

    def _replicated(self) -> jax.sharding.Sharding | None:
        """Where the unsharded arguments live: replicated over the mesh, else with the params."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, PartitionSpec())
        return getattr(self.param_leaves[0], "sharding", None)

    def _fresh_pools(self) -> None:
        rows, width = max(self.config.row_buckets), 1 + self.config.num_spec_tokens
        carried = Carried(np.zeros(rows * width, np.int32), np.zeros(rows, np.int32))
        if self.abstract:  # the pools' shapes, on the devices the params are for; nothing allocated
            shapes = jax.eval_shape(self._fresh_state)
            self.state = (_specs(shapes, self._replicated()) if self.mesh is None
                          else _sharded_specs(shapes, self._state_shardings()))
            self.carried = _specs(carried, self._replicated())
        elif self.mesh is None:
            self.state, self.carried = self._fresh_state(), jax.device_put(carried)
        else:  # built in place on the mesh, never whole on one device
            self.state = jax.jit(self._fresh_state, out_shardings=self._state_shardings())()
            self.carried = jax.device_put(carried, NamedSharding(self.mesh, PartitionSpec()))

    def dispatch(self, plan: BatchPlan, constraints: np.ndarray | None = None) -> StepOutput:
        """Start `plan` on the device and the copy of its tokens to the host; returns at once. `constraints`:
        its rows' constraint entries [R, E, 4] (`sampling.batch_constraints`), None for none."""
        buffer, layout = pack_plan(plan)
        if constraints is None:
            constraints = batch_constraints([], plan.row_kind.shape[0])
        if self.channel is not None:  # the other processes run the step too: they get the plan first
            if not is_leader():
                raise RuntimeError("in a multi-host job only process 0 dispatches; the others call follow()")
            bucket = (plan.token_bucket, plan.row_bucket, plan.block_table_bucket, plan.logits_bucket)
            assert layout == self._layout_of(bucket), "a plan's layout must follow from its bucket"
            self.channel.send(Message.STEP, bucket, buffer, constraints)
        self.state, self.carried, out = self._step(self.param_leaves, self.state, self.carried, layout, buffer,
                                                   constraints)
        out.tokens.copy_to_host_async()
        return out

    def fetch(self, out: StepOutput) -> StepResult:
        """The host's StepResult of a dispatched step (waits for it)."""
        tokens, width = to_host(out.tokens), 1 + self.config.num_spec_tokens
        return StepResult(tokens[:, :width], tokens[:, width], tokens[:, width + 1:])

    def follow(self) -> int:
        """Run the leader's steps until it stops (multi-host, every process but the leader); returns how many."""
        if self.channel is None or is_leader():
            raise RuntimeError("follow() is for the processes other than process 0 of a multi-host job")
        steps = 0
        while True:
            message, layout, buffer, constraints = self.channel.receive(self._layout_of)
            if message is Message.STOP:
                return steps
            if message is Message.RESET:
                self._fresh_pools()
                continue
            self.state, self.carried, _ = self._step(self.param_leaves, self.state, self.carried, layout, buffer,
                                                     constraints)
            steps += 1

    def _layout_of(self, bucket: tuple[int, int, int, int]) -> PlanLayout:
        if bucket not in self._layouts:
            self._layouts[bucket] = pack_plan(padding_plan(self.config, *bucket))[1]
        return self._layouts[bucket]

    def step(self, plan: BatchPlan) -> tuple[StepResult, Logprobs]:
        """Run `plan`; returns the host's StepResult and the step's logprobs, still on device."""
        out = self.dispatch(plan)
        return self.fetch(out), out.logprobs

    def compiled_buckets(self) -> int:
        """Executables compiled so far (one per plan layout)."""
        return self._step._cache_size()

    def precompile(self, progress: bool = True) -> int:
        """Compile the step for every bucket a plan of this config can have (running an all-padding plan,
        which changes no real state); returns how many shapes there are."""
        shapes = plan_shapes(self.config)
        if self.channel is not None and not is_leader():
            return len(shapes)  # a follower compiles as it follows the leader's precompile
        for shape in tqdm(shapes, desc="compile", unit="bucket", disable=not progress):
            self.step(padding_plan(self.config, *shape))
        return len(shapes)

    def trace(self, bucket: tuple[int, int, int, int]) -> jax.stages.Traced:
        """The step of this (T, R, B, L) bucket traced as `precompile` compiles it (an all-padding plan, no
        constraints): its jaxpr (`benchmarks/estimate.py` sums its kernels' cost estimates) and `lower()`."""
        buffer, layout = pack_plan(padding_plan(self.config, *bucket))
        constraints = batch_constraints([], bucket[1])
        return self._step.trace(self.param_leaves, self.state, self.carried, layout,
                                *_specs((buffer, constraints), self._replicated()))

    def lower(self, bucket: tuple[int, int, int, int]) -> jax.stages.Lowered:
        """The step of this bucket lowered for the runner's devices (`trace`); with abstract params it compiles
        for a device this host need not have (`benchmarks/aot_step.py`)."""
        return self.trace(bucket).lower()

    def _step_fn(self, param_leaves: list[jax.Array], state: DeviceState, carried: Carried, layout: PlanLayout,
                 buffer: jax.Array, constraints: jax.Array) -> tuple[DeviceState, Carried, StepOutput]:
        plan = _with_carried(unpack_plan(buffer, layout, ROW_DTYPE.itemsize), carried, self.config.num_spec_tokens,
                             self.config.block_size)
        module, variables = self.module, {"params": jax.tree.unflatten(self._param_tree, param_leaves)}
        state = state._replace(token_history=_record_history(state.token_history, plan))
        hidden, state = module.apply(variables, plan.token_ids, plan, state)
        logits = module.apply(variables, hidden[plan.logits_indices], method=HybridLM.logits)  # [L, V]
        rows = SamplingRows.from_bytes(plan.row_data)
        sampled, accepted = _sample_rows(logits, plan, rows, state.token_history, constraints,
                                         self.config.num_spec_tokens)
        wanted = jnp.any((rows.logprobs > 0) & (plan.row_kind != RowKind.PADDING))
        reported = jax.lax.cond(wanted, lambda: _logprobs(logits, plan, sampled, self.num_logprobs),
                                lambda: _no_logprobs(logits.shape[0], self.num_logprobs))
        drafts = jnp.zeros((plan.row_kind.shape[0], 0), jnp.int32)
        if self.config.num_spec_tokens:
            drafts, state = _draft(module, variables, hidden, plan, sampled, accepted, state,
                                   self.config.num_spec_tokens, self.config.block_size)
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


def _specs(tree: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """`tree`'s arrays as ShapeDtypeStructs, all with `sharding` (None: jit's default device)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _sharded_specs(tree: Any, shardings: Any) -> Any:
    """`tree`'s arrays as ShapeDtypeStructs with the shardings of a tree of the same structure."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def to_host(tree: Any) -> Any:
    """Host copies of a step's outputs, which are replicated: this process's own copy (under multi-host the
    others' are not addressable)."""
    return jax.tree.map(lambda array: np.asarray(array.addressable_data(0)), tree)


def plan_shapes(config: SchedulerConfig) -> list[tuple[int, int, int, int]]:
    """Every (T, R, B, L) bucket a plan can have: the ladders' product, with no logits bucket beyond the
    first that holds T logits (a step has at most one logit per token)."""
    shapes = []
    for tokens in config.token_buckets:
        logits = [b for b in config.logits_buckets if b < tokens]
        logits += [b for b in config.logits_buckets if b >= tokens][:1]
        shapes += [(tokens, *rest) for rest in itertools.product(config.row_buckets, config.block_table_buckets,
                                                                   logits)]
    return shapes


def padding_plan(config: SchedulerConfig, tokens: int, rows: int, blocks: int, logits: int) -> BatchPlan:
    """A plan of these buckets with padding rows only (null slot, null block, no copies)."""
    ints = lambda *shape: np.zeros(shape, np.int32)
    flags = lambda dtype: np.zeros(rows, dtype)
    copies = ("hit_copy_src", "hit_copy_dst", "pair_copy_src", "pair_copy_dst", "publish_src", "publish_dst",
              "materialize_src", "materialize_dst", "materialize_ring_start", "materialize_count")
    return BatchPlan(
        step_id=0, num_rows=0, num_tokens=0, request_ids=(), row_ids=np.zeros(0, np.int64), row_kind=flags(np.int8),
        phase=flags(np.int8), cu_seqlens=ints(rows + 1), query_lens=ints(rows), context_lens=ints(rows),
        state_slots=ints(rows), has_initial_state=flags(bool), block_table=ints(rows, blocks),
        token_ids=ints(tokens), positions=ints(tokens), slot_mapping=ints(tokens),
        draft_token_ids=ints(rows, config.num_spec_tokens), num_logits=ints(rows), cu_logits=ints(rows + 1),
        logits_indices=ints(logits), row_data=np.zeros((rows, config.row_data_bytes), np.uint8),
        lookahead_token_ids=ints(rows, max(config.num_lookahead, 1)), num_lookahead_tokens=ints(rows),
        ring_start=ints(rows), ring_committed=ints(rows), flush=flags(bool), **{name: ints(rows) for name in copies},
        num_hit_copies=0, num_pair_copies=0, num_publishes=0, num_materializations=0)


def _row_of(offsets: jax.Array, index: jax.Array) -> jax.Array:
    """The row r with offsets[r] <= index < offsets[r + 1] ([R+1] cumulative offsets)."""
    return jnp.clip(jnp.searchsorted(offsets[1:], index, side="right"), 0, offsets.shape[0] - 2)


def _with_carried(plan: DevicePlan, carried: Carried, k: int, block_size: int) -> DevicePlan:
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
    row = _row_of(plan.cu_seqlens, tok)
    token_shift = jnp.where(tok < plan.cu_seqlens[-1], shift[row], 0)
    positions = plan.positions + token_shift
    block = plan.block_table[row, jnp.minimum(positions // block_size, plan.block_table.shape[1] - 1)]
    return plan._replace(positions=positions, context_lens=plan.context_lens + shift,
                         ring_committed=plan.ring_committed + shift,
                         slot_mapping=jnp.where(token_shift > 0, block * block_size + positions % block_size,
                                                plan.slot_mapping))


def _record_history(history: jax.Array, plan: DevicePlan) -> jax.Array:
    """Each slot's token history after this step's copies and tokens, in the plan's order: materialised
    and hit pages copied in, phase-1 tokens written, pair copies, then everyone else's tokens."""
    history = copy_pages(history, plan.materialize_src, plan.materialize_dst, plan.num_materializations)
    history = copy_pages(history, plan.hit_copy_src, plan.hit_copy_dst, plan.num_hit_copies)
    producer = (plan.row_kind == RowKind.PREFILL) & (plan.phase == 1)
    history = _write_tokens(history, plan, producer)
    history = copy_pages(history, plan.pair_copy_src, plan.pair_copy_dst, plan.num_pair_copies)
    return _write_tokens(history, plan, ~producer)


def _write_tokens(history: jax.Array, plan: DevicePlan, rows: jax.Array) -> jax.Array:
    tok = jnp.arange(plan.token_ids.shape[0])
    row = _row_of(plan.cu_seqlens, tok)
    slot = plan.state_slots[row]
    keep = (tok < plan.cu_seqlens[-1]) & rows[row] & (slot > 0)
    return history.at[jnp.where(keep, slot, history.shape[0]), plan.positions].set(plan.token_ids, mode="drop")


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


def _sample_rows(logits: jax.Array, plan: DevicePlan, rows: SamplingRows, history: jax.Array, constraints: jax.Array,
                 k: int) -> tuple[jax.Array, jax.Array]:
    """[R, 1+K] tokens and [R] accepted drafts: verify rows verify their drafts at their 1 + K logits, every
    other row samples at its last logit (update ignores rows whose prefill goes on). Constraints (vLLM's
    order) come before penalties, each skipped at run time in a step where no row has any."""
    verify = plan.row_kind == RowKind.VERIFY
    last = plan.cu_logits[1:] - 1
    first = jnp.where(verify, plan.cu_logits[:-1], last)
    entry = jnp.clip(first[:, None] + jnp.arange(1 + k), 0, logits.shape[0] - 1)  # [R, 1+K]
    predicted = plan.positions[plan.logits_indices[entry]] + 1  # position of the token each logit draws
    real = plan.row_kind != RowKind.PADDING
    rows = rows._replace(repetition_penalty=jnp.where(real, rows.repetition_penalty, 1.0))  # padding: zero records
    target = logits[entry]
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


def _next_tokens(plan: DevicePlan, sampled: jax.Array) -> jax.Array:
    """[T] the token after each packed token: the next one in its chunk, the first lookahead token after a
    chunk, the sampled token after a prompt (or a decode row's token), a verify row's emitted tokens."""
    num_tokens = plan.token_ids.shape[0]
    tok = jnp.arange(num_tokens)
    row = _row_of(plan.cu_seqlens, tok)
    after_chunk = jnp.where(plan.num_lookahead_tokens[row] > 0, plan.lookahead_token_ids[row, 0], sampled[row, 0])
    next_prompt = jnp.where(tok + 1 == plan.cu_seqlens[row + 1], after_chunk,
                            plan.token_ids[jnp.minimum(tok + 1, num_tokens - 1)])
    emitted = sampled[row, jnp.clip(tok - plan.cu_seqlens[row], 0, sampled.shape[1] - 1)]
    return jnp.where(plan.row_kind[row] == RowKind.VERIFY, emitted, next_prompt)


def _logprobs(logits: jax.Array, plan: DevicePlan, sampled: jax.Array, num_top: int) -> Logprobs:
    """Each logit entry's token is the one after its packed token: emitted where the row samples, the next
    prompt token elsewhere."""
    return logprobs(logits, _next_tokens(plan, sampled)[plan.logits_indices], num_top)


def _no_logprobs(num_entries: int, num_top: int) -> Logprobs:
    return Logprobs(jnp.zeros(num_entries), jnp.zeros((num_entries, num_top), jnp.int32),
                    jnp.zeros((num_entries, num_top)), jnp.zeros(num_entries, jnp.int32))


def _draft(module: HybridLM, variables: Any, hidden: jax.Array, plan: DevicePlan, sampled: jax.Array,
           accepted: jax.Array, state: DeviceState, k: int, block_size: int) -> tuple[jax.Array, DeviceState]:
    """K greedy MTP drafts per row (a greedy drafter keeps verification lossless with a one-hot q).

    The first pass runs the MTP layer over every token with its true next token (the chunk's next, the
    lookahead after a chunk, the sampled token after a prompt, a verify row's emitted tokens), writing the
    MTP KV of every position; the row's first draft comes from its last committed position. Drafts 2..K
    are one-token passes; their KV writes are transient (the next step rewrites those positions before
    reading them) and stay inside the blocks of this step's tokens: beyond them they go to the null block.
    """
    num_tokens = hidden.shape[0]
    next_tokens = _next_tokens(plan, sampled)
    out, state = module.apply(variables, next_tokens, hidden, plan, state, method=HybridLM.mtp_hidden)
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
