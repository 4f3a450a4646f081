"""`EngineArgs`: every engine setting, declared once with its default and its help.

`LLM(model, **kwargs)` takes the fields as keywords. `python -m jaxhybrid.serve` and `python -m jaxhybrid.run_batch`
get one flag per field (vLLM's names; `--max-num-seqs` and `--max_num_seqs`; `--no-` forms for booleans) and
read the same names from a YAML `--config` file; the command line wins. `CLI_DEFAULTS` lists what the programs
start with differently, and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import yaml

from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.tensor_parallel import local_config
from jaxhybrid.parsers.reasoning import REASONING_PARSERS
from jaxhybrid.parsers.tools import TOOL_PARSERS
from jaxhybrid.sample.sampler import DEFAULT_CONSTRAINT_WIDTH, ROW_DTYPE
from jaxhybrid.worker.memory import PoolSizes, size_pools
from pallas_kernels.common import resolve_backend
from scheduler import SchedulerConfig
from scheduler.buckets import default_buckets

log = logging.getLogger("jaxhybrid")

DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "half": jnp.float16}


def _arg(default: Any, help: str | None = None, **argparse_keywords: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **argparse_keywords})


class ParserSetupError(ValueError):
    """A parser flag (--reasoning-parser, --tool-call-parser) names a parser that cannot work with the model's
    tokenizer (a marker token it lacks); the programs end their start-up with its message."""


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    model: str | None = _arg(None, "checkpoint directory or Hugging Face hub id (default: the embedded model)")
    revision: str | None = _arg(None, "with a hub id: the branch, tag or commit")
    download_dir: str | None = _arg(None, "with a hub id: the download cache (default: huggingface_hub's)")
    tokenizer: str | None = _arg(None, "tokenizer directory or hub id (default: the model's)")
    tokenizer_revision: str | None = _arg(None, "with a tokenizer hub id: the branch, tag or commit")
    skip_tokenizer_init: bool = _arg(False, "token-id prompts only (no tokenizer files needed)")
    dtype: str = _arg("auto", '"auto": the checkpoint\'s own; float32, bfloat16 or float16')
    seed: int = _arg(0, type=int)
    max_num_seqs: int = _arg(32, type=int)
    max_num_batched_tokens: int = _arg(512, type=int)
    max_model_len: int | None = _arg(None, "default: the model's, at most 4096", type=int)
    max_logprobs: int = _arg(20, type=int)
    max_sampling_constraints: int = _arg(
        DEFAULT_CONSTRAINT_WIDTH, "entries a sequence's logit_bias, allowed_token_ids, bad_words and min_tokens bans "
        "may take; steps are compiled for this many, and a request needing more gets a 400", type=int)
    enable_prefix_caching: bool = _arg(True, "align-mode prefix caching of KV blocks and recurrent states")
    speculative_config: dict | None = _arg(None, 'MTP, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'',
                                           type=json.loads)
    replayssm_window: int | None = _arg(
        None, "W, the ReplaySSM ring (default: 16 with Pallas kernels, 1 + K on CPU, where folding an entry costs "
        "a pass over the state); 0: no ReplaySSM, verify snapshots the state at every position (the baseline)",
        type=int)
    gpu_memory_utilization: float = _arg(0.9, "the device memory share of weights and pools", type=float)
    num_blocks: int | None = _arg(None, "KV blocks (default: sized from gpu_memory_utilization)", type=int)
    num_state_slots: int | None = _arg(None, "recurrent state slots (default: sized from gpu_memory_utilization)",
                                       type=int)
    block_size: int = _arg(16, "tokens per KV block", type=int)
    mamba_block_size: int = _arg(64, "the grid of cached recurrent states, in tokens", type=int)
    tensor_parallel_size: int = _arg(1, "shard weights and pools by heads over this many devices", type=int)
    backend: str | None = _arg(None, "the kernels (default: pallas on GPU, reference on CPU)",
                               choices=("reference", "pallas", "interpret"))
    token_buckets: tuple[int, ...] = _arg((), "step token buckets (default: a ladder up to max_num_batched_tokens)",
                                          type=int, nargs="+")
    row_buckets: tuple[int, ...] = _arg((), "step row buckets (default: a ladder up to max_num_seqs)",
                                        type=int, nargs="+")
    bucket_growth: int = _arg(2, "ratio between default buckets", type=int)
    precompile: bool = _arg(False, "compile every bucket at start-up")
    compilation_cache_dir: str | None = _arg(None, "compiled steps persist here across runs ('' turns it off)")
    async_scheduling: bool = _arg(True, "schedule one step ahead of the device (--no-: the serial loop, for "
                                  "debugging)")
    reasoning_parser: str | None = _arg(None, "split chat output into reasoning and content, and start a structured "
                                        "output's grammar where the reasoning ends", choices=tuple(REASONING_PARSERS))

    def scheduler_config(self, cfg: ModelConfig, budget: Callable[[], int], *, dtype: jnp.dtype,
                         step_temporaries: Callable[[SchedulerConfig], int] | None = None) -> SchedulerConfig:
        """The engine's SchedulerConfig for these arguments: pools sized by `size_pools` for one device's
        `budget()` bytes and that device's share of a slot and a block (the pools split by heads over
        `tensor_parallel_size` devices) unless both counts are given, bucket ladders, W for the backend.
        `step_temporaries(config)`: bytes the largest step of `config` needs besides its arguments
        (`runner.step_temporaries`), left out of the pools' budget so that the step has room to run."""
        k = speculative_tokens(self.speculative_config)
        max_model_len = self.max_model_len or min(cfg.max_position_embeddings, 4096)
        window = self.replayssm_window
        if window is None:  # the reference ops fold a ring entry with a whole pass over the state
            window = 16 if resolve_backend(self.backend) == "pallas" else 1
        ring_size = window and max(window, 1 + k)  # 0: the snapshot baseline
        num_blocks, num_state_slots, max_num_seqs = self.num_blocks, self.num_state_slots, self.max_num_seqs
        if num_blocks is None or num_state_slots is None:
            def size(available: int) -> PoolSizes:
                return size_pools(local_config(cfg, self.tensor_parallel_size), available, block_size=self.block_size,
                                  ring_size=ring_size, num_spec_tokens=k, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, dtype_bytes=dtype.itemsize)

            available = budget()
            if step_temporaries is not None:  # measured at the ladders of the whole budget: the largest step
                probe = size(available)
                reserved = step_temporaries(self._config(cfg, k, ring_size, max_model_len, probe.num_blocks,
                                                         probe.num_state_slots, probe.max_num_seqs))
                log.info("the largest step's temporaries: %.2f GiB, kept out of the pools", reserved / 2**30)
                available -= reserved
            sizes = size(available)
            num_blocks, num_state_slots, max_num_seqs = (num_blocks or sizes.num_blocks,
                                                         num_state_slots or sizes.num_state_slots, sizes.max_num_seqs)
            log.info("pools: %s", sizes.describe())
        return self._config(cfg, k, ring_size, max_model_len, num_blocks, num_state_slots, max_num_seqs)

    def _config(self, cfg: ModelConfig, k: int, ring_size: int, max_model_len: int, num_blocks: int,
                num_state_slots: int, max_num_seqs: int) -> SchedulerConfig:
        """The SchedulerConfig of these pools, with the bucket ladders they imply."""
        block_size = self.block_size
        # One block-table width keeps the compiled shapes few. Tokens start at 2: XLA:CPU makes a bf16 matmul of
        # one row a convert of the whole weight to f32 and a multiply-reduce (batch-1 decode 2.3x slower than at
        # 2 tokens, 1.3x at 8). Rows and logits set no matmul's rows and start at 8, since every bucket they add
        # multiplies the compiled steps (see Runner.precompile).
        ladder = lambda cap, smallest: default_buckets(cap, smallest=smallest, growth=self.bucket_growth)
        token_buckets = self.token_buckets or ladder(self.max_num_batched_tokens, 2)
        row_buckets = self.row_buckets or ladder(max_num_seqs, 8)
        logits_buckets = self.token_buckets or ladder(self.max_num_batched_tokens, 8)
        return SchedulerConfig(
            block_size=block_size, mamba_block_size=self.mamba_block_size,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            num_blocks=num_blocks, num_state_slots=num_state_slots, num_spec_tokens=k,
            cache_mode="align" if self.enable_prefix_caching else "none",
            ring_size=ring_size, vocab_size=cfg.vocab_size, row_data_bytes=ROW_DTYPE.itemsize,
            token_buckets=token_buckets, row_buckets=row_buckets, logits_buckets=logits_buckets,
            block_table_buckets=(-(-(max_model_len + k) // block_size),))


def checkpoint_dtype(directory: Path, dtype: str) -> jnp.dtype:
    """vLLM's `dtype`: "auto" is the checkpoint's own (config.json `dtype` / `torch_dtype`; float32 if unset)."""
    if dtype == "auto":
        config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return jnp.dtype(DTYPES[dtype])


def speculative_tokens(speculative_config: dict | None) -> int:
    """K from vLLM's `speculative_config` ({"method": "mtp", "num_speculative_tokens": K}); 0 without one."""
    if not speculative_config:
        return 0
    if not isinstance(speculative_config, dict) or speculative_config.get("method") != "mtp":
        raise ValueError(f"speculative_config: only {{'method': 'mtp', 'num_speculative_tokens': K}} is supported, "
                         f"got {speculative_config!r}")
    k = speculative_config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
    return k


# What the programs start with differently from `LLM`. A server compiles every bucket before it listens (`LLM`
# compiles only the buckets it meets), and it is restarted often, so it keeps compiled steps on disk (`LLM` leaves
# its process's JAX cache settings alone). Its ladders are as fine as `LLM`'s: a batch of 16 decode rows in a
# 32-token bucket took 20.5 ms a step against 14.9 in a 16-token one.
CLI_DEFAULTS = {
    "precompile": True,
    "compilation_cache_dir": str(Path.home() / ".cache" / "jaxhybrid" / "xla"),
}
FIELDS = {field.name: field for field in dataclasses.fields(EngineArgs)}

# The tool-call flags of the programs that answer chat (the server, the batch job's chat lines): vLLM's names.
TOOL_FLAGS: dict[str, dict] = {
    "--enable-auto-tool-choice": dict(action=argparse.BooleanOptionalAction, default=False,
                                      help='parse tool calls out of chat output (tool_choice "auto", "required" '
                                      "and named functions); needs --tool-call-parser"),
    "--tool-call-parser": dict(default=None, choices=tuple(TOOL_PARSERS),
                               help="the model's tool-call format, for --enable-auto-tool-choice"),
}


def check_tool_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """vLLM's rule: --enable-auto-tool-choice names its parser; without one, start-up ends with one line."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.exit(2, f"{parser.prog}: error: --enable-auto-tool-choice requires --tool-call-parser\n")


def _add(parser: argparse.ArgumentParser, name: str, keywords: dict) -> None:
    flag = "--" + name.replace("_", "-")
    if isinstance(keywords.get("default"), bool) and "action" not in keywords:
        keywords = {**keywords, "action": argparse.BooleanOptionalAction}
    parser.add_argument(*([flag, "--" + name] if "_" in name else [flag]), **keywords)


def make_parser(prog: str, description: str, flags: dict[str, dict]) -> argparse.ArgumentParser:
    """A parser of every `EngineArgs` field, `--config`, and `flags` (the program's own: flag -> keywords)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, field in FIELDS.items():
        _add(parser, name, {**field.metadata, "default": CLI_DEFAULTS.get(name, field.default)})
    _add(parser, "config", {"help": "YAML file of these flags (command-line flags win)"})
    for flag, keywords in flags.items():
        _add(parser, flag.lstrip("-").replace("-", "_"), keywords)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags from `argv`, over the YAML `--config` file, over the defaults."""
    args = parser.parse_args(argv)
    if args.config:
        values = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(values, dict):
            parser.error(f"--config {args.config}: expected a mapping of flag names to values")
        defaults = {name.lstrip("-").replace("-", "_"): value for name, value in values.items()}
        unknown = sorted(set(defaults) - set(vars(args)))
        if unknown:
            parser.error(f"--config {args.config}: unknown keys {unknown}")
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    return args


def from_namespace(args: argparse.Namespace) -> EngineArgs:
    """The engine's part of parsed flags (lists become tuples; an empty cache directory turns the cache off)."""
    values = {name: getattr(args, name) for name in FIELDS}
    values["token_buckets"], values["row_buckets"] = tuple(args.token_buckets), tuple(args.row_buckets)
    values["compilation_cache_dir"] = args.compilation_cache_dir or None
    return EngineArgs(**values)


def non_default(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The arguments that differ from their defaults, secrets redacted (for the start-up log)."""
    return {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()
            if v != parser.get_default(k)}


def build_llm(args: argparse.Namespace):
    """The `LLM` the flags describe, with the start-up report logged."""
    from jaxhybrid.llm import LLM

    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(from_namespace(args)))
    config = llm.config
    log.info("engine on %s ready in %.1f s", args.model or "(embedded default)", time.perf_counter() - start)
    ring = f"ReplaySSM W={config.ring_size}" if config.ring_size else "snapshots at every position"
    log.info("cache mode %s; %d KV blocks of %d tokens; %d state slots (%s, MTP K=%d); max_num_seqs %d; "
             "max_model_len %d; %s scheduling; token buckets %s, row buckets %s", config.cache_mode,
             config.num_blocks - 1, config.block_size, config.num_state_slots - 1, ring, config.num_spec_tokens,
             config.max_num_seqs, config.max_model_len, "one-step-ahead" if llm.engine.async_scheduling else "serial",
             config.token_buckets, config.row_buckets)
    return llm
