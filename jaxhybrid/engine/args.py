"""`EngineArgs`: every engine setting, declared once with its default, its help and its flag's keywords.

`LLM(model, **kwargs)` takes the fields as keywords, and `engine.builder.build_engine` builds an engine from
them. The programs get one flag per field (`jaxhybrid.flags`); `CLI_DEFAULTS` lists what they start with
differently, and why.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxhybrid.models.ops import CPU_KERNELS
from jaxhybrid.models.pools import KV_CACHE_DTYPES, MAMBA_SSM_CACHE_DTYPES
from jaxhybrid.parsers.reasoning import REASONING_PARSERS
from jaxhybrid.sample.sampler import DEFAULT_CONSTRAINT_WIDTH

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
    max_model_len: int | None = _arg(
        None, "default: the model's own (config.json max_position_embeddings, with --hf-overrides); start-up fails "
        "where one request that long does not fit the pools", type=int)
    max_logprobs: int = _arg(20, type=int)
    max_sampling_constraints: int = _arg(
        DEFAULT_CONSTRAINT_WIDTH, "entries a sequence's logit_bias, allowed_token_ids, bad_words and min_tokens bans "
        "may take; steps are compiled for this many, and a request needing more gets a 400", type=int)
    enable_prefix_caching: bool = _arg(True, "align-mode prefix caching of KV blocks and recurrent states")
    speculative_config: dict | None = _arg(None, 'MTP, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'',
                                           type=json.loads)
    hf_overrides: dict | None = _arg(
        None, 'JSON merged into the checkpoint\'s config.json before it is parsed (nested objects merge), e.g. '
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'',
        type=json.loads)
    replayssm_window: int | None = _arg(
        None, "W, the ReplaySSM ring (default: 16 with Pallas kernels, 1 + K on CPU, where folding an entry costs "
        "a pass over the state); 0: no ReplaySSM, verify snapshots the state at every position (the baseline)",
        type=int)
    gpu_memory_utilization: float = _arg(0.92, "the device memory share of weights and pools", type=float,
                                         aliases=("--device-memory-utilization",))
    num_blocks: int | None = _arg(None, "KV blocks (default: sized from gpu_memory_utilization)", type=int)
    num_state_slots: int | None = _arg(None, "recurrent state slots (default: sized from gpu_memory_utilization)",
                                       type=int)
    block_size: int = _arg(16, "tokens per KV block", type=int)
    mamba_block_size: int = _arg(64, "the grid of cached recurrent states, in tokens", type=int)
    tensor_parallel_size: int = _arg(1, "shard weights and pools by heads over this many devices", type=int,
                                     aliases=("-tp",))
    backend: str | None = _arg(None, "the kernels (default: pallas on GPU, reference on CPU)",
                               choices=("reference", "pallas", "interpret"))
    cpu_kernels: str = _arg("auto", "on CPU, the GDN and Mamba2 prefill/decode/verify ops and, with --no-scan-layers, "
                            "bf16 projections and routed experts: "
                            "ffi (C++ kernels built on first use; start-up fails without them), reference, or auto "
                            "(ffi where they build)",
                            choices=CPU_KERNELS)
    scan_layers: bool = _arg(True, "compile each segment of repeating layers as one loop over its repeats (compile "
                             "time flat in depth); --no-: every layer its own copy, which on CPU reads each layer's "
                             "weights in place (faster steps; compile time grows with depth)")
    token_buckets: tuple[int, ...] = _arg((), "step token buckets (default: a ladder up to max_num_batched_tokens)",
                                          type=int, nargs="+")
    row_buckets: tuple[int, ...] = _arg((), "step row buckets (default: a ladder up to max_num_seqs)",
                                        type=int, nargs="+")
    bucket_growth: int = _arg(2, "ratio between default buckets", type=int)
    precompile: bool = _arg(False, "compile every bucket at start-up (the server: on a worker thread while it "
                            "serves; --no-: each bucket when a step first needs it)")
    compilation_cache_dir: str | None = _arg(None, "compiled steps persist here across runs ('' turns it off)")
    async_scheduling: bool = _arg(True, "schedule one step ahead of the device (--no-: the serial loop, for "
                                  "debugging)")
    reasoning_parser: str | None = _arg(None, "split chat output into reasoning and content, and start a structured "
                                        "output's grammar where the reasoning ends", choices=tuple(REASONING_PARSERS))
    chat_template: str | None = _arg(None, "the chat template: a Jinja file or the template itself (default: the "
                                     "checkpoint's)")
    generation_config: str = _arg("auto", '"auto": sampling defaults from the checkpoint\'s generation_config.json; '
                                  '"vllm": none (SamplingParams\' own); a directory: its generation_config.json')
    kv_cache_dtype: str = _arg("auto", "the KV cache's dtype: auto (the model's) or fp8 (= fp8_e4m3: float8 e4m3 "
                               "with per-tensor scales, the checkpoint's k_scale/v_scale or 1.0)",
                               choices=tuple(KV_CACHE_DTYPES))
    mamba_ssm_cache_dtype: str = _arg("auto", "the recurrent states' dtype: float32 (auto) or bfloat16; the kernels "
                                      "compute in float32", choices=tuple(MAMBA_SSM_CACHE_DTYPES))
    tokenizer_mode: str = _arg("auto", "the checkpoint's tokenizer.json (auto and hf read it alike)",
                               choices=("auto", "hf"))
    enable_chunked_prefill: bool = _arg(True, "long prompts run in chunks of max_num_batched_tokens; always on here "
                                        "(prefix states and checkpoints are taken at chunk ends)")
    enforce_eager: bool = _arg(False, "compile no step ahead of use: each bucket compiles when a step first needs it")
    trust_remote_code: bool = _arg(False, "accepted for vLLM command lines: jaxhybrid runs no code from a checkpoint "
                                   "(it reads config.json itself)")
    language_model_only: bool = _arg(False, "accepted for vLLM command lines: jaxhybrid loads text models only")

    def __post_init__(self) -> None:
        speculative_tokens(self.speculative_config)
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {self.hf_overrides!r}")
        for name, choices in (("kv_cache_dtype", KV_CACHE_DTYPES), ("mamba_ssm_cache_dtype", MAMBA_SSM_CACHE_DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=False (--no-enable-chunked-prefill) is not supported: jaxhybrid "
                             "always runs long prompts in "
                             "chunks (its cached prefix states and checkpoints are taken at chunk ends)")


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
    method = speculative_config.get("method") if isinstance(speculative_config, dict) else None
    if not isinstance(method, str) or not (method == "mtp" or method.endswith("_mtp")):  # vLLM: qwen3_next_mtp, ...
        raise ValueError(f"speculative_config: only the model's own MTP layers are supported ({{'method': 'mtp', "
                         f"'num_speculative_tokens': K}}), got {speculative_config!r}")
    k = speculative_config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
    return k


# What the programs start with differently from `LLM`. The programs compile every bucket (the server in the
# background; `LLM` compiles only the buckets it meets), and a server is restarted often, so they keep compiled
# steps on disk (`LLM` leaves its process's JAX cache settings alone). Their ladders are as fine as `LLM`'s: token
# padding costs a step more than row padding (docs/benchmarks.md#where-a-cpu-decode-step-goes).
CLI_DEFAULTS = {
    "precompile": True,
    "compilation_cache_dir": str(Path.home() / ".cache" / "jaxhybrid" / "xla"),
}
