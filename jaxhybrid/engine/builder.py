"""Start-up in one place: `build_engine(EngineArgs)` loads the model and its tokenizer, reads the checkpoint's
generation defaults, sets up the reasoning parser, sizes the pools for the device's memory, and builds the
`Engine` once. `LLM`, the server and the batch job each hold what it returns, a `BuiltEngine`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.engine.args import EngineArgs, ParserSetupError, checkpoint_dtype, speculative_tokens
from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.prompts import PromptPreparer
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.cache_dtypes import cache_dtypes
from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.generation_config import read_generation_config, sampling_defaults
from jaxhybrid.models.model import Model
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.models.pools import AUTO_CACHE, CacheDtypes
from jaxhybrid.models.tensor_parallel import local_config, make_mesh
from jaxhybrid.models.weights import load_model, resolve_model
from jaxhybrid.parsers.reasoning import ReasoningParser, get_reasoning_parser
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import ROW_DTYPE
from jaxhybrid.worker.memory import (
    CPU_MEMORY_BUDGET,
    PoolSizes,
    capacity_report,
    device_memory_budget,
    param_bytes,
    reports_memory,
    size_pools,
)
from jaxhybrid.worker.runner import step_temporaries
from pallas_kernels.backend import resolve_backend
from scheduler import SchedulerConfig
from scheduler.config import default_buckets

log = logging.getLogger("jaxhybrid")


@dataclass(frozen=True)
class BuiltEngine:
    """An engine on one checkpoint and what its entry points read beside it."""

    args: EngineArgs
    model: Model
    tokenizer: Tokenizer | None           # None with skip_tokenizer_init: token-id prompts only
    generation_defaults: dict[str, Any]   # the checkpoint's generation_config.json as SamplingParams fields
    reasoning_parser: ReasoningParser | None  # `args.reasoning_parser`'s instance on the tokenizer
    config: SchedulerConfig
    engine: Engine
    prompts: PromptPreparer               # text, token ids, messages -> the engine's Prompt

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's generation_config.json settings over SamplingParams' defaults."""
        return SamplingParams(**self.generation_defaults)


def build_engine(args: EngineArgs, background_compile: bool = False) -> BuiltEngine:
    """The engine `args` describe, with the start-up report logged. With `args.precompile` (and not
    `enforce_eager`) every bucket compiles: before this returns, or with `background_compile` on a worker thread
    while the engine serves (a step whose bucket is not ready compiles or waits for that bucket alone)."""
    start = time.perf_counter()
    if args.compilation_cache_dir is not None:  # compiled steps persist across processes
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    directory = resolve_model(args.model, args.revision, args.download_dir)
    dtype = checkpoint_dtype(directory, args.dtype)
    mesh = make_mesh(args.tensor_parallel_size) if args.tensor_parallel_size > 1 else None
    # one process: each tensor goes straight to its shards; in a multi-host job each process loads whole params
    # and the Runner places its shards
    ops = ModelOps(backend=args.backend, cpu_kernels=args.cpu_kernels, scan_layers=args.scan_layers,
                   cache=cache_dtypes(args.kv_cache_dtype, args.mamba_ssm_cache_dtype, directory))
    model = load_model(directory, dtype=dtype, ops=ops, block_size=args.block_size,
                       hf_overrides=args.hf_overrides, mesh=mesh if jax.process_count() == 1 else None)
    cfg = model.config
    if speculative_tokens(args.speculative_config) and not cfg.mtp_layers:
        raise ValueError(f"speculative_config asks for MTP, but the {cfg.model_type} checkpoint at {directory} "
                         "has no MTP weights (mtp.*)")
    tokenizer = None if args.skip_tokenizer_init else Tokenizer.from_pretrained(
        directory if args.tokenizer is None else resolve_model(args.tokenizer, args.tokenizer_revision,
                                                               args.download_dir))
    if tokenizer is not None and args.chat_template is not None:
        tokenizer.chat_template = chat_template_text(args.chat_template)
    reasoning_parser = _reasoning_parser(args.reasoning_parser, tokenizer)
    # where the device has a memory limit, the largest step's temporaries are measured and kept out of the
    # pools; a CPU has no limit to keep to, and its budget is a fixed size
    temporaries = (lambda config: step_temporaries(model, config, mesh, args.max_sampling_constraints,
                                                   args.max_logprobs)) if reports_memory() else None
    config = scheduler_config(
        args, cfg, lambda: device_memory_budget(args.gpu_memory_utilization, param_bytes(model.params, cfg, mesh)),
        dtype=dtype, step_temporaries=temporaries)
    engine = Engine(model, config, tokenizer, seed=args.seed, max_logprobs=args.max_logprobs, mesh=mesh,
                    async_scheduling=args.async_scheduling, max_sampling_constraints=args.max_sampling_constraints,
                    reasoning_end=None if reasoning_parser is None else reasoning_parser.is_reasoning_end)
    if args.precompile and not args.enforce_eager and background_compile:
        engine.start_background_compile()
    elif args.precompile and not args.enforce_eager:
        compile_start = time.perf_counter()
        count = engine.precompile()
        log.info("compiled %d buckets in %.1f s", count, time.perf_counter() - compile_start)
    built = BuiltEngine(args, model, tokenizer, _generation_defaults(args.generation_config, directory),
                        reasoning_parser, config, engine, PromptPreparer(tokenizer, config.max_model_len,
                                                                         config.hash_unit))
    log.info("engine on %s ready in %.1f s", args.model or "(embedded default)", time.perf_counter() - start)
    _log_report(built)
    return built


def chat_template_text(setting: str) -> str:
    """vLLM's --chat-template: a file's text, or the setting itself where it is a template (it has Jinja's
    braces or a line break); a path to no file is an error rather than a template that renders the path."""
    path = Path(setting)
    if path.is_file():
        return path.read_text()
    if any(c in setting for c in "{}\n"):
        return setting
    raise ValueError(f"chat_template: no file at {setting!r}, and it is no Jinja template either")


def _generation_defaults(setting: str, directory: Path) -> dict[str, Any]:
    """vLLM's --generation-config: "auto" reads the checkpoint's generation_config.json, "vllm" reads none, and
    a directory is read instead of the checkpoint's."""
    if setting == "vllm":
        return {}
    return sampling_defaults(read_generation_config(directory if setting == "auto" else Path(setting)))


def _reasoning_parser(name: str | None, tokenizer: Tokenizer | None) -> ReasoningParser | None:
    """The engine's instance of `name`, built once: its `is_reasoning_end` tells the engine where a structured
    output's grammar starts. A tokenizer it cannot work with is a ParserSetupError."""
    if name is None:
        return None
    parser = get_reasoning_parser(name)
    if tokenizer is None:
        raise ParserSetupError(f"reasoning_parser {name!r} needs the model's tokenizer (skip_tokenizer_init is set)")
    try:
        return parser(tokenizer)
    except ValueError as error:
        raise ParserSetupError(f"reasoning_parser {name!r} cannot be used with this tokenizer: {error}") from error


def _log_report(built: BuiltEngine) -> None:
    config = built.config
    ring = f"ReplaySSM W={config.ring_size}" if config.ring_size else "snapshots at every position"
    log.info("cache mode %s; %d KV blocks of %d tokens; %d state slots (%s, MTP K=%d); max_num_seqs %d; "
             "max_model_len %d; %s scheduling; token buckets %s, row buckets %s", config.cache_mode,
             config.num_blocks - 1, config.block_size, config.num_state_slots - 1, ring, config.num_spec_tokens,
             config.max_num_seqs, config.max_model_len,
             "one-step-ahead" if built.engine.async_scheduling else "serial", config.token_buckets,
             config.row_buckets)


def scheduler_config(args: EngineArgs, cfg: ModelConfig, budget: Callable[[], int], *, dtype: jnp.dtype,
                     step_temporaries: Callable[[SchedulerConfig], int] | None = None) -> SchedulerConfig:
    """The engine's SchedulerConfig for `args`: pools sized by `size_pools` for one device's `budget()` bytes
    and that device's share of a slot and a block (the pools split by heads over `tensor_parallel_size`
    devices) unless both counts are given, bucket ladders, W for the backend. `step_temporaries(config)`:
    bytes the largest step of `config` needs besides its arguments (`runner.step_temporaries`), left out of
    the pools' budget so that the step has room to run."""
    k = speculative_tokens(args.speculative_config)
    # vLLM's default: the model's own length (YaRN's max_position_embeddings is already the scaled one)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    window = args.replayssm_window
    if window is None:  # the reference ops fold a ring entry with a whole pass over the state
        window = 16 if resolve_backend(args.backend) == "pallas" else 1
    ring_size = window and max(window, 1 + k)  # 0: the snapshot baseline
    pools = _Pools(args, cfg, k, ring_size, max_model_len)
    num_blocks, num_state_slots, max_num_seqs = args.num_blocks, args.num_state_slots, args.max_num_seqs
    if num_blocks is None or num_state_slots is None:
        available = budget()
        if step_temporaries is not None:  # measured at the ladders of the whole budget: the largest step
            probe = pools.size_or_explain(available, dtype)
            reserved = step_temporaries(pools.config(probe.num_blocks, probe.num_state_slots, probe.max_num_seqs))
            log.info("the largest step's temporaries: %.2f GiB, kept out of the pools", reserved / 2**30)
            available -= reserved
        sizes = pools.size_or_explain(available, dtype)
        num_blocks, num_state_slots, max_num_seqs = (num_blocks or sizes.num_blocks,
                                                     num_state_slots or sizes.num_state_slots, sizes.max_num_seqs)
        log.info("pools: %s", sizes.describe())
        for line in pools.capacity_gained(available, dtype, sizes):
            log.info(line)
    return pools.config(num_blocks, num_state_slots, max_num_seqs)


@dataclass(frozen=True)
class _Pools:
    """What the pools' sizes and the SchedulerConfig of any such sizes follow from."""

    args: EngineArgs
    cfg: ModelConfig
    k: int
    ring_size: int
    max_model_len: int

    def size(self, available: int, dtype: jnp.dtype) -> PoolSizes:
        args = self.args
        return size_pools(local_config(self.cfg, args.tensor_parallel_size), available, block_size=args.block_size,
                          ring_size=self.ring_size, num_spec_tokens=self.k, max_num_seqs=args.max_num_seqs,
                          max_model_len=self.max_model_len, dtype_bytes=dtype.itemsize,
                          kv_bytes=self.cache.kv_dtype(dtype).itemsize, state_bytes=self.cache.state_dtype().itemsize)

    @property
    def cache(self) -> CacheDtypes:
        return CacheDtypes(self.args.kv_cache_dtype, self.args.mamba_ssm_cache_dtype)

    def capacity_gained(self, available: int, dtype: jnp.dtype, sizes: PoolSizes) -> list[str]:
        """The start-up lines comparing `sizes` with the pools of auto cache dtypes on the same budget."""
        if self.cache == AUTO_CACHE:
            return []
        auto = dataclasses.replace(self, args=dataclasses.replace(self.args, kv_cache_dtype="auto",
                                                                  mamba_ssm_cache_dtype="auto"))
        return capacity_report(sizes, auto.size(available, dtype), self.args.kv_cache_dtype,
                               self.args.mamba_ssm_cache_dtype, dtype.name)

    def size_or_explain(self, available: int, dtype: jnp.dtype) -> PoolSizes:
        """`size`, or where one request of max_model_len does not fit `available` bytes, a one-line ValueError
        with the bytes it needs and the largest --max-model-len that fits (vLLM's start-up check)."""
        try:
            return self.size(available, dtype)
        except ValueError:
            fits = self._longest_fitting(available, dtype)
            if fits == 0 or fits >= self.max_model_len:  # not a length that fails: the error is another one
                raise
            needed = self._smallest_budget(available, dtype)
        raise ValueError(
            f"max_model_len {self.max_model_len} does not fit: one request that long needs {needed / 2**30:.2f} GiB of "
            f"KV blocks and recurrent state slots, but the pools have {available / 2**30:.2f} GiB; the largest length "
            f"that fits is {fits}: pass --max-model-len {fits} (or less), or give the pools more memory "
            f"(--gpu-memory-utilization on a GPU; on a CPU they have a fixed {CPU_MEMORY_BUDGET // 2**20} MiB)"
        ) from None

    def _fits(self, available: int, dtype: jnp.dtype) -> bool:
        try:
            self.size(available, dtype)
        except ValueError:
            return False
        return True

    def _longest_fitting(self, available: int, dtype: jnp.dtype) -> int:
        """The largest max_model_len below this one whose request fits `available` bytes; 0 if none does."""
        low, high = 0, self.max_model_len  # low fits (or is 0), high does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if dataclasses.replace(self, max_model_len=middle)._fits(available, dtype) \
                else (low, middle)
        return low

    def _smallest_budget(self, available: int, dtype: jnp.dtype) -> int:
        """The fewest bytes that hold one request of max_model_len (more than `available`)."""
        high = 2 * available + 1
        while not self._fits(high, dtype):
            high *= 2
        low = available  # does not fit
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if self._fits(middle, dtype) else (middle, high)
        return high

    def config(self, num_blocks: int, num_state_slots: int, max_num_seqs: int) -> SchedulerConfig:
        """The SchedulerConfig of these pools, with the bucket ladders they imply."""
        args, k, max_model_len = self.args, self.k, self.max_model_len
        # One block-table width keeps the compiled shapes few. Tokens start at 2: XLA:CPU makes a bf16 matmul of
        # one row a convert of the whole weight to f32 and a multiply-reduce (batch-1 decode 2.3x slower than at
        # 2 tokens, 1.3x at 8). Rows and logits set no matmul's rows and start at 8, since every bucket they add
        # multiplies the compiled steps (see Runner.precompile).
        ladder = lambda cap, smallest: default_buckets(cap, smallest=smallest, growth=args.bucket_growth)  # noqa: E731
        return SchedulerConfig(
            block_size=args.block_size, mamba_block_size=args.mamba_block_size,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            num_blocks=num_blocks, num_state_slots=num_state_slots, num_spec_tokens=k,
            cache_mode="align" if args.enable_prefix_caching else "none",
            ring_size=self.ring_size, vocab_size=self.cfg.vocab_size, row_data_bytes=ROW_DTYPE.itemsize,
            token_buckets=args.token_buckets or ladder(args.max_num_batched_tokens, 2),
            row_buckets=args.row_buckets or ladder(max_num_seqs, 8),
            logits_buckets=args.token_buckets or ladder(args.max_num_batched_tokens, 8),
            block_table_buckets=(-(-(max_model_len + k) // args.block_size),))

