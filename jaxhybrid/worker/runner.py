"""The runner owns the plan-to-device contract: one `BatchPlan` in, one `StepResult` out.

`Runner.dispatch(plan)` packs the plan into one int32 transfer and calls the compiled step (`step.run_step`) of
its bucket (the packed layout is the static argument) with the `DeviceState` donated; `fetch` reads the tokens.
The runner also owns the pools, their tensor-parallel placement, precompilation and the multi-host channel.

Each bucket's step is compiled once, ahead of its first call, into `_executables` (one XLA executable per plan
layout): by `precompile` before serving, by a `BackgroundCompile` thread while the engine serves, or by the
first step that needs it. Whichever thread comes first compiles; another that needs the same bucket meanwhile
waits for that compile, so no bucket is ever compiled twice.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxhybrid.models.fp8_weights import is_matmul_weight
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.model import Model
from jaxhybrid.models.plan_transfer import PlanLayout, pack_plan
from jaxhybrid.models.pools import DeviceState, init_device_state
from jaxhybrid.models.stack import flatten_params
from jaxhybrid.models.tensor_parallel import AXIS, param_shardings, shard_params, state_shardings
from jaxhybrid.sample.sampler import DEFAULT_CONSTRAINT_WIDTH, ROW_DTYPE, Logprobs, batch_constraints
from jaxhybrid.worker.buckets import padding_plan, plan_shapes
from jaxhybrid.worker.memory import check_maps_suffice, memory_maps
from jaxhybrid.worker.multihost import Message, PlanChannel, is_leader
from jaxhybrid.worker.step import Carried, Forwarded, StepOutput, run_forward, run_sampling, run_step
from pallas_kernels.matmul import cpu as matmul_cpu
from scheduler import BatchPlan, SchedulerConfig, StepResult
from scheduler.replay import ring_rows

log = logging.getLogger("jaxhybrid")

COMPILE_THREAD = "jaxhybrid-compile"


class Runner:
    """A model's params and device pools, sized by a `SchedulerConfig`, stepping its plans."""

    def __init__(self, model: Model, config: SchedulerConfig, *, max_logprobs: int = 20, mesh: Mesh | None = None,
                 constraint_width: int = DEFAULT_CONSTRAINT_WIDTH):
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
        if constraint_width < 1:
            raise ValueError(f"max_sampling_constraints must be >= 1, got {constraint_width}")
        self.model, self.config, self.mesh, self.constraint_width = model, config, mesh, constraint_width
        vocab = model.config.vocab_size
        self.num_logprobs = vocab if max_logprobs == -1 else min(max_logprobs, vocab)  # vLLM's -1: no cap
        self.params, self.module = model.params, model.module
        ops = model.module.ops
        # params given as ShapeDtypeStructs (`abstract_params`, with a sharding on the devices compiled for):
        # a runner that holds no arrays and only lowers its step (`lower`), for a GPU this host may not have
        self.abstract = isinstance(jax.tree.leaves(model.params)[0], jax.ShapeDtypeStruct)
        # multi-host: every process runs every step; the leader sends the others its plans (multihost.py)
        self.channel = PlanChannel() if jax.process_count() > 1 else None
        self._layouts: dict[tuple[int, int, int, int], PlanLayout] = {}
        shardings, halves = {}, ({}, {})
        if mesh is not None:  # tensor parallel: weights and pools sharded by heads, outputs replicated
            self.params = self._sharded_params(model.params)
            ops = dataclasses.replace(ops, mesh=mesh)
            self.module = HybridLM(model.config, ops)
            replicated = NamedSharding(mesh, PartitionSpec())
            shardings = dict(out_shardings=(self._state_shardings(), replicated, replicated))
            halves = (dict(out_shardings=(self._state_shardings(), replicated)), shardings)
        if not self.abstract and ops.cpu_matmuls():  # in the CPU kernel's layout; the model shares it (one copy)
            model.params = self.params = matmul_cpu.packed_params(self.params, is_matmul_weight)
        # the nested params dict flattened once: the jitted call then takes a flat list, and does not sort
        # every dict's keys again on each step (0.1 ms of the host's step on the embedded model); an unrolled
        # step on CPU takes each layer's weights as views of their stack (`stack.flatten_params`)
        repeat_views = not self.abstract and mesh is None and ops.platform() == "cpu" and not ops.scan_layers
        self.param_leaves, self._param_layout = flatten_params(self.params, repeat_views=repeat_views)
        # what each bucket's step is lowered for: the params', pools' and carried tokens' shapes and placements
        # (never the arrays themselves, which the engine's thread donates while another thread compiles)
        self._param_specs = [_spec(leaf, getattr(leaf, "sharding", None)) for leaf in self.param_leaves]
        self._pool_specs = self._abstract_pools()
        self._fresh_pools()
        self._no_constraints: dict[int, jax.Array] = {}  # rows -> all padding, on the device once
        step = functools.partial(run_step, self.module, self._param_layout, config, self.num_logprobs)
        options = self.module.ops.compiler_options()
        self._step = jax.jit(step, static_argnums=3, donate_argnums=(1, 2), compiler_options=options, **shardings)
        self._executables: dict[PlanLayout, jax.stages.Compiled] = {}  # read without the lock by `_executable`
        self._compiling: dict[PlanLayout, Future] = {}  # a bucket's compile in progress, for others to wait on
        self._compile_lock = threading.Lock()
        self.compiles = 0  # executables this runner built (compiled, or read from the persistent cache)
        # a step is compiling its bucket, or waiting for another thread's compile of it: busy, not stuck
        self.step_compiling = False
        self.background: BackgroundCompile | None = None
        # a step with token masks runs in two halves: the host fills the masks while the device runs the first
        # (compiled on first use: a step without masks never needs them)
        forward = functools.partial(run_forward, self.module, self._param_layout, config)
        self._forward = jax.jit(forward, static_argnums=3, donate_argnums=1, compiler_options=options, **halves[0])
        sampling = functools.partial(run_sampling, self.module, self._param_layout, config, self.num_logprobs)
        self._sampling = jax.jit(sampling, donate_argnums=(1, 2), compiler_options=options, **halves[1])
        self.mask_words = (model.config.vocab_size + 31) // 32
        # the sampling half reads the params only to draft: without MTP its call passes none (a shorter dispatch)
        self._drafter_params = self.param_leaves if config.num_spec_tokens else []

    def _sharded_params(self, params: Any) -> Any:
        """The params in the head-aligned layout, placed by `param_shardings` (abstract ones only annotated:
        the layout permutes within axes, so their shapes stand)."""
        cfg, mesh = self.model.config, self.mesh
        if self.abstract:
            return _sharded_specs(params, param_shardings(params, cfg, mesh))
        if self.model.tp_layout == mesh.shape[AXIS]:  # loaded straight into this mesh's shards
            return params
        if self.model.tp_layout != 1:
            raise ValueError(f"the model's params are laid out for tensor parallelism {self.model.tp_layout}, "
                             f"the engine runs {mesh.shape[AXIS]}")
        params = params if self.channel is None else jax.tree.map(np.asarray, params)  # from the host
        return shard_params(params, cfg, mesh)

    def _state_shardings(self) -> DeviceState:
        return state_shardings(jax.eval_shape(self._fresh_state), self.model.config, self.mesh)

    def _fresh_state(self) -> DeviceState:
        config = self.config
        return init_device_state(
            self.model.config, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_state_slots, ring_entries=ring_rows(config.ring_size, config.num_spec_tokens),
            history_len=config.max_model_len + config.num_spec_tokens, dtype=self.model.dtype,
            snapshots=config.ring_size == 0, cache=self.model.module.ops.cache)

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

    def _fresh_carried(self) -> Carried:
        rows, width = max(self.config.row_buckets), 1 + self.config.num_spec_tokens
        return Carried(np.zeros(rows * width, np.int32), np.zeros(rows, np.int32))

    def _abstract_pools(self) -> tuple[DeviceState, Carried]:
        """The pools' and carried tokens' shapes, on the devices the params are for; nothing allocated."""
        shapes = jax.eval_shape(self._fresh_state)
        state = (_specs(shapes, self._replicated()) if self.mesh is None
                 else _sharded_specs(shapes, self._state_shardings()))
        return state, _specs(self._fresh_carried(), self._replicated())

    def _fresh_pools(self) -> None:
        carried = self._fresh_carried()
        if self.abstract:
            self.state, self.carried = self._pool_specs
        elif self.mesh is None:
            self.state, self.carried = self._fresh_state(), jax.device_put(carried)
        else:  # built in place on the mesh, never whole on one device
            self.state = jax.jit(self._fresh_state, out_shardings=self._state_shardings())()
            self.carried = jax.device_put(carried, NamedSharding(self.mesh, PartitionSpec()))

    def dispatch(self, plan: BatchPlan, constraints: np.ndarray | None = None) -> StepOutput:
        """Start `plan` on the device and the copy of its tokens to the host; returns at once. `constraints`:
        its rows' constraint entries [R, E, 4] (`sampling.batch_constraints`), None for none."""
        buffer, layout = pack_plan(plan)
        self._send(Message.STEP, plan, buffer, layout, constraints)
        constraints = (self._padding_constraints(plan.row_kind.shape[0]) if constraints is None
                       else self._placed(constraints))
        self.state, self.carried, out = self._executable(layout)(self.param_leaves, self.state, self.carried, buffer,
                                                                 constraints)
        out.tokens.copy_to_host_async()
        return out

    def _send(self, message: Message, plan: BatchPlan, buffer: np.ndarray, layout: PlanLayout,
              constraints: np.ndarray | None) -> None:
        """Multi-host: the other processes run each step too, so they get its plan first."""
        if self.channel is None:
            return
        if not is_leader():
            raise RuntimeError("in a multi-host job only process 0 dispatches; the others call follow()")
        bucket = (plan.token_bucket, plan.row_bucket, plan.block_table_bucket, plan.logits_bucket)
        assert layout == self._layout_of(bucket), "a plan's layout must follow from its bucket"
        self.channel.send(message, bucket, buffer, constraints)

    def forward(self, plan: BatchPlan, constraints: np.ndarray | None = None) -> PendingStep:
        """Start the first half of `plan` (its layers and logits) on the device; `finish` samples it."""
        buffer, layout = pack_plan(plan)
        self._send(Message.FORWARD, plan, buffer, layout, constraints)
        placed = (self._padding_constraints(plan.row_kind.shape[0]) if constraints is None
                  else self._placed(constraints))
        self.state, forwarded = self._forward(self.param_leaves, self.state, self.carried, layout, buffer)
        return PendingStep(placed, forwarded)

    def finish(self, pending: PendingStep, token_mask: np.ndarray) -> StepOutput:
        """Sample a step `forward` started, under `token_mask` ([L, mask_words] int32); returns at once."""
        if self.channel is not None:
            self.channel.send(Message.SAMPLE, token_mask=token_mask)
        self.state, self.carried, out = self._sampling(self._drafter_params, self.state, self.carried,
                                                       pending.forwarded, pending.placed_constraints,
                                                       self._placed(token_mask))
        out.tokens.copy_to_host_async()
        return out

    def _padding_constraints(self, rows: int) -> jax.Array | np.ndarray:
        """A step's constraint entries when no row has any: all padding, transferred once per row bucket."""
        if rows not in self._no_constraints:
            padding = batch_constraints([], rows, self.constraint_width)
            if self.abstract:
                return padding
            self._no_constraints[rows] = self._placed(padding)
        return self._no_constraints[rows]

    def _placed(self, constraints: np.ndarray) -> jax.Array:
        """Constraint entries (or token masks) on the device, placed alike with and without a constrained row
        (uncommitted without a mesh, replicated over it), so that both steps run one executable."""
        return jnp.asarray(constraints) if self.mesh is None else jax.device_put(constraints, self._replicated())

    def fetch(self, out: StepOutput) -> StepResult:
        """The host's StepResult of a dispatched step (waits for it)."""
        tokens, width = to_host(out.tokens), 1 + self.config.num_spec_tokens
        return StepResult(tokens[:, :width], tokens[:, width], tokens[:, width + 1:])

    def follow(self) -> int:
        """Run the leader's steps until it stops (multi-host, every process but the leader); returns how many."""
        if self.channel is None or is_leader():
            raise RuntimeError("follow() is for the processes other than process 0 of a multi-host job")
        steps, pending = 0, None
        while True:
            message, layout, buffer, constraints, token_mask = self.channel.receive(self._layout_of, self.mask_words)
            if message is Message.STOP:
                return steps
            if message is Message.RESET:
                self._fresh_pools()
                continue
            if message is Message.SAMPLE:  # the second half of the FORWARD before it
                self.state, self.carried, _ = self._sampling(self._drafter_params, self.state, self.carried,
                                                             *pending, self._placed(token_mask))
                steps += 1
                continue
            constraints = (self._padding_constraints(layout.num_rows()) if constraints is None
                           else self._placed(constraints))
            if message is Message.FORWARD:
                self.state, forwarded = self._forward(self.param_leaves, self.state, self.carried, layout, buffer)
                pending = (forwarded, constraints)
                continue
            self.state, self.carried, _ = self._executable(layout)(self.param_leaves, self.state, self.carried, buffer,
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
        return len(self._executables)

    def _executable(self, layout: PlanLayout) -> jax.stages.Compiled:
        """The step of this layout's bucket, compiled on first use (`_compile_once`)."""
        executable = self._executables.get(layout)
        if executable is not None:
            return executable
        self.step_compiling = True
        try:
            return self._compile_once(layout)[0]
        finally:
            self.step_compiling = False

    def _compile_once(self, layout: PlanLayout) -> tuple[jax.stages.Compiled, bool]:
        """(the bucket's executable, whether this call compiled it): compiled here unless it is compiled already
        or another thread is compiling it, whose compile this call then waits for. A failed compile is not kept:
        its waiters raise its error, and the next call tries again."""
        with self._compile_lock:
            if layout in self._executables:
                return self._executables[layout], False
            pending = self._compiling.get(layout)
            if pending is None:
                pending = self._compiling[layout] = Future()
                pending.set_running_or_notify_cancel()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result(), False
        try:
            executable = self._lowered(layout).compile()
        except BaseException as error:
            with self._compile_lock:
                del self._compiling[layout]
            pending.set_exception(error)
            raise
        with self._compile_lock:
            self._executables[layout] = executable
            del self._compiling[layout]
            self.compiles += 1
        pending.set_result(executable)
        return executable, True

    def _lowered(self, layout: PlanLayout) -> jax.stages.Lowered:
        return self._traced(layout).lower()

    def _traced(self, layout: PlanLayout) -> jax.stages.Traced:
        """The step of this layout traced for the runner's argument specs (no array is read: any thread may)."""
        buffer = jax.ShapeDtypeStruct((layout.size,), np.int32, sharding=self._replicated())
        constraints = jax.ShapeDtypeStruct((layout.num_rows(), self.constraint_width, 4), np.int32,
                                           sharding=self._replicated())
        return self._step.trace(self._param_specs, *self._pool_specs, layout, buffer, constraints)

    def maps_between_compiles(self) -> tuple[tuple[int, int] | None, int] | None:
        """(`memory_maps()`, executables compiled so far) while no compile runs; None while one does."""
        with self._compile_lock:
            return None if self._compiling else (memory_maps(), self.compiles)

    def compile_bucket(self, bucket: tuple[int, int, int, int]) -> bool:
        """Compile the step of this (T, R, B, L) bucket without running it; False if it was compiled already
        (or another thread compiled it while this one waited)."""
        return self._compile_once(self._layout_of(bucket))[1]

    def precompile(self, progress: bool = True) -> int:
        """Compile the step for every bucket a plan of this config can have (running an all-padding plan,
        which changes no real state); returns how many shapes there are. Multi-host: the leader's steps
        reach every follower, which compiles each bucket as it follows."""
        shapes = plan_shapes(self.config)
        if self.channel is not None and not is_leader():
            return len(shapes)  # a follower compiles as it follows the leader's precompile
        before = memory_maps()
        for i, shape in enumerate(tqdm(shapes, desc="compile", unit="bucket", disable=not progress)):
            self.step(padding_plan(self.config, *shape))
            if i == 0:  # a clear error now rather than a crash in a later compile
                check_maps_suffice(before, memory_maps(), len(shapes) - 1)
        return len(shapes)

    def start_background_compile(self) -> BackgroundCompile:
        """Compile every bucket on a worker thread, smallest first, while this runner steps (`BackgroundCompile`).
        Every process of a multi-host job starts its own: each compiles the programs the leader's steps will run."""
        if self.background is None:
            self.background = BackgroundCompile(self, plan_shapes(self.config))
            self.background.start()
        return self.background

    def trace(self, bucket: tuple[int, int, int, int]) -> jax.stages.Traced:
        """The step of this (T, R, B, L) bucket traced as it is compiled (an all-padding plan, no constraints):
        its jaxpr (`benchmarks/estimate.py` sums its kernels' cost estimates) and `lower()`."""
        return self._traced(self._layout_of(bucket))

    def lower(self, bucket: tuple[int, int, int, int]) -> jax.stages.Lowered:
        """The step of this bucket lowered for the runner's devices (`trace`); with abstract params it compiles
        for a device this host need not have (`benchmarks/aot_step.py`)."""
        return self.trace(bucket).lower()


class BackgroundCompile(threading.Thread):
    """A daemon thread that compiles `buckets` in order (`Runner.compile_bucket`) while the engine serves: each
    one that a step has not compiled first. After its first compile that no other overlapped it projects the
    memory maps of the rest (`check_maps_suffice`) and, past the limit, stops with that error; the buckets left
    then compile as steps need them. An error ends the walk, is logged, and is kept in `error`."""

    def __init__(self, runner: Runner, buckets: list[tuple[int, int, int, int]]):
        super().__init__(name=COMPILE_THREAD, daemon=True)
        self.runner, self.buckets = runner, buckets
        self.compiled = 0  # buckets this thread compiled (the others a step compiled first)
        self.error: BaseException | None = None

    def run(self) -> None:
        start = time.perf_counter()
        try:
            checked = False
            for index, bucket in enumerate(self.buckets):
                before = self.runner.maps_between_compiles()
                if not self.runner.compile_bucket(bucket):
                    continue
                self.compiled += 1
                after = self.runner.maps_between_compiles()
                # the maps one compile took, measured where no other compile overlapped it (a step's may have)
                if not checked and before and after and after[1] == before[1] + 1:
                    check_maps_suffice(before[0], after[0], len(self.buckets) - index - 1)
                    checked = True
        except BaseException as error:
            self.error = error
            log.error("background compile stopped; the buckets left compile when a step needs them: %s", error)
            return
        log.info("every bucket compiled: %d of %d on the compile thread, the rest by steps, in %.1f s", self.compiled,
                 len(self.buckets), time.perf_counter() - start)


class PendingStep(NamedTuple):
    """A step whose first half is on the device (`Runner.forward`), waiting for its token masks."""

    placed_constraints: jax.Array
    forwarded: Forwarded


def step_temporaries(model: Model, config: SchedulerConfig, mesh: Mesh | None = None,
                     constraint_width: int = DEFAULT_CONSTRAINT_WIDTH, max_logprobs: int = 20) -> int:
    """Bytes of temporaries XLA allocates for `config`'s largest step (its last bucket). The step the runner
    jits is lowered on abstract arguments (`jax.ShapeDtypeStruct`s placed as a runner places its arrays)
    and compiled, so nothing is allocated and no runner is built before the pools are sized. Its pools have
    the fewest pages (2 KV blocks, 4 state slots): no temporary grows with the pools, and test_memory.py
    checks the figure against a runner's own compiled step. The pools get the budget less this (vLLM's
    profile run measures the same peak by running a step)."""
    config, cfg = fewest_pages(config), model.config
    num_logprobs = cfg.vocab_size if max_logprobs == -1 else min(max_logprobs, cfg.vocab_size)
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=getattr(p, "sharding", None)),
                          model.params)
    state = jax.eval_shape(functools.partial(
        init_device_state, cfg, num_blocks=config.num_blocks, block_size=config.block_size,
        num_slots=config.num_state_slots, ring_entries=ring_rows(config.ring_size, config.num_spec_tokens),
        history_len=config.max_model_len + config.num_spec_tokens, dtype=model.dtype,
        snapshots=config.ring_size == 0, cache=model.module.ops.cache))
    module, out_shardings = model.module, {}
    if mesh is None:  # everything where the params are (`Runner._replicated`)
        replicated = getattr(jax.tree.leaves(model.params)[0], "sharding", None)
        state = _specs(state, replicated)
    else:  # weights and pools sharded by heads, the rest replicated (`Runner.__init__`)
        module = HybridLM(cfg, dataclasses.replace(model.module.ops, mesh=mesh))
        replicated = NamedSharding(mesh, PartitionSpec())
        params = _sharded_specs(params, param_shardings(params, cfg, mesh))
        pool_shardings = state_shardings(state, cfg, mesh)
        state = _sharded_specs(state, pool_shardings)
        out_shardings = dict(out_shardings=(pool_shardings, replicated, replicated))
    leaves, tree = flatten_params(params, repeat_views=False)
    step = jax.jit(functools.partial(run_step, module, tree, config, num_logprobs), static_argnums=3,
                   donate_argnums=(1, 2), compiler_options=module.ops.compiler_options(), **out_shardings)
    bucket = plan_shapes(config)[-1]
    buffer, layout = pack_plan(padding_plan(config, *bucket))
    rows, width = max(config.row_buckets), 1 + config.num_spec_tokens
    carried = Carried(np.zeros(rows * width, np.int32), np.zeros(rows, np.int32))
    arguments = _specs((carried, buffer, batch_constraints([], bucket[1], constraint_width)), replicated)
    compiled = step.lower(leaves, state, arguments[0], layout, *arguments[1:]).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def fewest_pages(config: SchedulerConfig) -> SchedulerConfig:
    """`config` with pools of 2 KV blocks and 4 state slots: a step whose other shapes are `config`'s."""
    return dataclasses.replace(config, num_blocks=2, num_state_slots=4)


def _spec(array: Any, sharding: jax.sharding.Sharding | None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)


def _specs(tree: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """`tree`'s arrays as ShapeDtypeStructs, all with `sharding` (None: jit's default device)."""
    return jax.tree.map(lambda a: _spec(a, sharding), tree)


def _sharded_specs(tree: Any, shardings: Any) -> Any:
    """`tree`'s arrays as ShapeDtypeStructs with the shardings of a tree of the same structure."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def to_host(tree: Any) -> Any:
    """Host copies of a step's outputs, which are replicated: this process's own copy (under multi-host the
    others' are not addressable)."""
    return jax.tree.map(lambda array: np.asarray(array.addressable_data(0)), tree)
