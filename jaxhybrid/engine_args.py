"""The engine's command-line flags, shared by `python -m jaxhybrid.serve` and `python -m jaxhybrid.score`
(vLLM's names where the concept exists; both `--max-num-seqs` and `--max_num_seqs`; `--no-` forms for
booleans; `--config FILE` reads the same flags from YAML and the command line wins), and the `LLM` they build.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import yaml

log = logging.getLogger("jaxhybrid")

# flag -> argparse keywords; the dest is the flag's name with underscores
ENGINE_FLAGS: dict[str, dict] = {
    "--model": dict(default=None, help="checkpoint directory or Hugging Face hub id (default: the embedded model)"),
    "--revision": dict(default=None, help="with a hub id: the branch, tag or commit"),
    "--download-dir": dict(default=None, help="with a hub id: the download cache (default: huggingface_hub's)"),
    "--tokenizer": dict(default=None, help="tokenizer directory or hub id (default: the model's)"),
    "--tokenizer-revision": dict(default=None, help="with a tokenizer hub id: the branch, tag or commit"),
    "--skip-tokenizer-init": dict(action=argparse.BooleanOptionalAction, default=False,
                                  help="token-id prompts only (no tokenizer files needed)"),
    "--max-num-seqs": dict(type=int, default=32),
    "--max-num-batched-tokens": dict(type=int, default=512),
    "--max-model-len": dict(type=int, default=None),
    "--enable-prefix-caching": dict(action=argparse.BooleanOptionalAction, default=True),
    "--speculative-config": dict(type=json.loads, default=None,
                                 help='e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\''),
    "--replayssm-window": dict(type=int, default=None,
                               help="W, the ReplaySSM ring (default: 16 with Pallas kernels, 1 + K on CPU); 0: "
                                    "no ReplaySSM, verify snapshots the state at every position (the baseline)"),
    "--seed": dict(type=int, default=0),
    "--gpu-memory-utilization": dict(type=float, default=0.9),
    "--num-blocks": dict(type=int, default=None),
    "--num-state-slots": dict(type=int, default=None),
    "--block-size": dict(type=int, default=16),
    "--mamba-block-size": dict(type=int, default=64),
    "--max-logprobs": dict(type=int, default=20),
    "--dtype": dict(default="auto", help="\"auto\": the checkpoint's own; float32, bfloat16 or float16"),
    "--tensor-parallel-size": dict(type=int, default=1),
    "--token-buckets": dict(type=int, nargs="+", default=None, help="step token buckets (default: a ladder)"),
    "--row-buckets": dict(type=int, nargs="+", default=None),
    "--bucket-growth": dict(type=int, default=4, help="ratio between default buckets (fewer shapes to compile)"),
    "--precompile": dict(action=argparse.BooleanOptionalAction, default=True,
                         help="compile every bucket before the first request"),
    "--compilation-cache-dir": dict(default=str(Path.home() / ".cache" / "jaxhybrid" / "xla"),
                                    help="compiled steps persist here across runs ('' turns it off)"),
    "--async-scheduling": dict(action=argparse.BooleanOptionalAction, default=True,
                               help="schedule one step ahead of the device (--no-: the serial loop, for debugging)"),
    "--config": dict(default=None, help="YAML file of these flags (command-line flags win)"),
}
_LLM_ARGS = ("tokenizer", "revision", "tokenizer_revision", "download_dir", "skip_tokenizer_init",
             "enable_prefix_caching", "speculative_config", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "seed", "gpu_memory_utilization", "num_blocks", "num_state_slots", "replayssm_window", "block_size",
             "mamba_block_size", "max_logprobs", "dtype", "bucket_growth", "tensor_parallel_size", "async_scheduling")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def make_parser(prog: str, description: str, flags: dict[str, dict]) -> argparse.ArgumentParser:
    """A parser of the engine's flags plus `flags` (the program's own), each in both spellings."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for flag, keywords in {**ENGINE_FLAGS, **flags}.items():
        parser.add_argument(flag, *(["--" + _dest(flag)] if "-" in flag[2:] else []), **keywords)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags from `argv`, over the YAML `--config` file, over the defaults."""
    args = parser.parse_args(argv)
    if args.config:
        values = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(values, dict):
            parser.error(f"--config {args.config}: expected a mapping of flag names to values")
        defaults = {_dest(name): value for name, value in values.items()}
        unknown = sorted(set(defaults) - set(vars(args)))
        if unknown:
            parser.error(f"--config {args.config}: unknown keys {unknown}")
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    return args


def non_default(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The arguments that differ from their defaults, secrets redacted (for the start-up log)."""
    return {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()
            if v != parser.get_default(k)}


def build_llm(args: argparse.Namespace):
    """The `LLM` the flags describe, compiled when `--precompile`, with the start-up report logged."""
    from jaxhybrid.api import LLM

    start = time.perf_counter()
    llm = LLM(args.model, **{name: getattr(args, name) for name in _LLM_ARGS},
              token_buckets=tuple(args.token_buckets or ()), row_buckets=tuple(args.row_buckets or ()),
              compilation_cache_dir=args.compilation_cache_dir or None)
    loaded = time.perf_counter()
    config = llm.config
    log.info("model %s loaded in %.1f s", args.model or "(embedded default)", loaded - start)
    ring = f"ReplaySSM W={config.ring_size}" if config.ring_size else "snapshots at every position"
    log.info("cache mode %s; %d KV blocks of %d tokens; %d state slots (%s, MTP K=%d); max_num_seqs %d; "
             "max_model_len %d; %s scheduling", config.cache_mode, config.num_blocks - 1, config.block_size,
             config.num_state_slots - 1, ring, config.num_spec_tokens, config.max_num_seqs,
             config.max_model_len, "one-step-ahead" if llm.engine.async_scheduling else "serial")
    if args.precompile:
        count = llm.engine.precompile()
        log.info("compiled %d buckets in %.1f s (token buckets %s, row buckets %s)", count,
                 time.perf_counter() - loaded, config.token_buckets, config.row_buckets)
    return llm
