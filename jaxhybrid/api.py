"""`LLM`: the Python API with vLLM's names. `LLM(model=None)` serves the embedded default model."""

from __future__ import annotations

import json
import logging
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm import tqdm

from jaxhybrid.config import ModelConfig
from jaxhybrid.distributed.tensor_parallel import device_param_bytes, local_config, make_mesh
from jaxhybrid.engine import Engine, Prompt
from jaxhybrid.generation_config import read_generation_config, sampling_defaults
from jaxhybrid.memory import size_pools
from jaxhybrid.model import Model
from jaxhybrid.outputs import RequestOutput
from jaxhybrid.sampling import ROW_DTYPE
from jaxhybrid.sampling_params import SamplingParams
from jaxhybrid.tokenizer import Tokenizer
from jaxhybrid.weights import load_model, resolve_model
from pallas_kernels.common import resolve_backend
from scheduler import SchedulerConfig, parse_checkpoint_marker
from scheduler.buckets import default_buckets

if TYPE_CHECKING:
    from jaxhybrid.score import PromptScores

log = logging.getLogger("jaxhybrid")

CPU_MEMORY_BUDGET = 512 * 2**20  # pool bytes on a platform that reports no device memory
PromptInput = str | Sequence[int] | dict
PROMPT_KEYS = {"prompt", "prompt_token_ids", "messages", "checkpoint_position", "cache_salt"}
DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "half": jnp.float16}


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


def pool_budget(utilization: float, device_bytes: int, weight_bytes: int, in_use: int = 0) -> int:
    """One device's pool bytes: `utilization` of its `device_bytes` less its share of the weights and what
    is already `in_use`."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(utilization * device_bytes) - weight_bytes - in_use


def device_memory_budget(utilization: float, weight_bytes: int) -> int:
    """`pool_budget` on this host's first device; CPU_MEMORY_BUDGET where it reports no memory."""
    stats = jax.devices()[0].memory_stats() or {}
    budget = pool_budget(utilization, stats.get("bytes_limit", 0), weight_bytes, stats.get("bytes_in_use", 0))
    return budget if "bytes_limit" in stats else CPU_MEMORY_BUDGET


def param_bytes(params: Any, cfg: ModelConfig, mesh: Mesh | None) -> int:
    """The params' bytes on one device: all of them, or their shards under tensor parallelism."""
    if mesh is None:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    return device_param_bytes(params, cfg, mesh)


def scheduler_config(cfg: ModelConfig, budget: Callable[[], int], *, dtype: jnp.dtype, num_spec_tokens: int = 0,
                     max_num_seqs: int = 32, max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                     num_blocks: int | None = None, num_state_slots: int | None = None,
                     replayssm_window: int | None = None, block_size: int = 16, mamba_block_size: int = 64,
                     backend: str | None = None, enable_prefix_caching: bool = True,
                     token_buckets: tuple[int, ...] = (), row_buckets: tuple[int, ...] = (),
                     bucket_growth: int = 2, tensor_parallel_size: int = 1) -> SchedulerConfig:
    """The engine's SchedulerConfig from `LLM`'s arguments (defaults as there): pools sized by `size_pools`
    for one device's `budget()` bytes and that device's share of a slot and a block (the pools split by
    heads over `tensor_parallel_size` devices) unless both counts are given, bucket ladders, W for the
    backend."""
    k = num_spec_tokens
    max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
    if replayssm_window is None:  # the reference ops fold a ring entry with a whole pass over the state
        replayssm_window = 16 if resolve_backend(backend) == "pallas" else 1
    ring_size = replayssm_window and max(replayssm_window, 1 + k)  # 0: the snapshot baseline
    if num_blocks is None or num_state_slots is None:
        sizes = size_pools(local_config(cfg, tensor_parallel_size), budget(), block_size=block_size,
                           ring_size=ring_size, num_spec_tokens=k, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, dtype_bytes=dtype.itemsize)
        num_blocks, num_state_slots, max_num_seqs = (num_blocks or sizes.num_blocks,
                                                     num_state_slots or sizes.num_state_slots, sizes.max_num_seqs)
        log.info("pools: %s", sizes.describe())
    # one block-table width and logits buckets on the token ladder keep the compiled shapes few; row
    # buckets start at 2 (see Runner)
    token_buckets = token_buckets or default_buckets(max_num_batched_tokens, growth=bucket_growth)
    row_buckets = row_buckets or tuple(sorted({max(b, 2) for b in default_buckets(max_num_seqs,
                                                                                  growth=bucket_growth)}))
    return SchedulerConfig(
        block_size=block_size, mamba_block_size=mamba_block_size, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_blocks=num_blocks,
        num_state_slots=num_state_slots, num_spec_tokens=k, cache_mode="align" if enable_prefix_caching else "none",
        ring_size=ring_size, vocab_size=cfg.vocab_size, row_data_bytes=ROW_DTYPE.itemsize,
        token_buckets=token_buckets, row_buckets=row_buckets, logits_buckets=token_buckets,
        block_table_buckets=(-(-(max_model_len + k) // block_size),))


class LLM:
    """An engine on one checkpoint: `generate` and `chat` run prompts to completion, in input order.

    Arguments follow vLLM's where the concept exists: `model` and `tokenizer` are directories or Hugging
    Face hub ids (`revision`, `tokenizer_revision`, `download_dir`; `jaxhybrid.weights.resolve_model`).
    Beyond them: `num_blocks` / `num_state_slots` size the pools explicitly (else from
    `gpu_memory_utilization`), `replayssm_window` is W (default 16 with the Pallas kernels; on the reference
    path, where folding an entry costs a pass over the state, the smallest window, 1 + K; 0 runs the
    snapshot-every-position baseline instead of ReplaySSM: ring entries are whole states, as many as a
    verify row has tokens), `mamba_block_size` the grid of cached recurrent states, `backend` the kernels'
    ("reference", "pallas", "interpret"), `token_buckets` / `row_buckets` the step shapes (default: ladders
    growing by `bucket_growth` up to `max_num_batched_tokens` / `max_num_seqs`), `tensor_parallel_size`
    shards weights and pools by heads over that many devices (`jaxhybrid.distributed.tensor_parallel`),
    `precompile` compiles every shape at start-up and `compilation_cache_dir` keeps compiled steps across runs.
    """

    def __init__(self, model: str | Path | None = None, *, tokenizer: str | Path | None = None,
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 download_dir: str | Path | None = None, skip_tokenizer_init: bool = False,
                 enable_prefix_caching: bool = True, speculative_config: dict | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512,
                 max_model_len: int | None = None, seed: int = 0, gpu_memory_utilization: float = 0.9,
                 num_blocks: int | None = None, num_state_slots: int | None = None, replayssm_window: int | None = None,
                 block_size: int = 16, mamba_block_size: int = 64, max_logprobs: int = 20,
                 dtype: str = "auto", backend: str | None = None, token_buckets: tuple[int, ...] = (),
                 row_buckets: tuple[int, ...] = (), bucket_growth: int = 2, tensor_parallel_size: int = 1,
                 precompile: bool = False, compilation_cache_dir: str | None = None, async_scheduling: bool = True):
        from jaxhybrid.models.ops import ModelOps

        if compilation_cache_dir is not None:  # compiled steps persist across processes
            jax.config.update("jax_compilation_cache_dir", str(compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        directory = resolve_model(model, revision, download_dir)
        dtype = checkpoint_dtype(directory, dtype)
        self.model: Model = load_model(directory, dtype=dtype, ops=ModelOps(backend=backend), block_size=block_size)
        self.generation_defaults = sampling_defaults(read_generation_config(directory))
        cfg = self.model.config
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(
            directory if tokenizer is None else resolve_model(tokenizer, tokenizer_revision, download_dir))
        k = speculative_tokens(speculative_config)
        if k and not cfg.mtp_layers:
            raise ValueError(f"speculative_config asks for MTP, but the {cfg.model_type} checkpoint at {directory} "
                             "has no MTP weights (mtp.*)")
        mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
        self.config = scheduler_config(
            cfg, lambda: device_memory_budget(gpu_memory_utilization, param_bytes(self.model.params, cfg, mesh)),
            dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            num_spec_tokens=k, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, num_blocks=num_blocks, num_state_slots=num_state_slots,
            replayssm_window=replayssm_window, block_size=block_size, mamba_block_size=mamba_block_size,
            backend=backend, enable_prefix_caching=enable_prefix_caching, token_buckets=token_buckets,
            row_buckets=row_buckets, bucket_growth=bucket_growth)
        self.engine = Engine(self.model, self.config, self.tokenizer, seed=seed, max_logprobs=max_logprobs, mesh=mesh,
                             async_scheduling=async_scheduling)
        self._counter = 0
        if precompile:
            start = time.perf_counter()
            count = self.engine.precompile()
            log.info("compiled %d buckets in %.1f s", count, time.perf_counter() - start)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's generation_config.json settings over SamplingParams' defaults."""
        return SamplingParams(**self.generation_defaults)

    @property
    def llm_engine(self) -> Engine:
        """vLLM's name for the engine (`add_request`, `step`, `abort`, ...)."""
        return self.engine

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix state and checkpoint; False (and nothing forgotten) while requests run."""
        if self.engine.has_unfinished_requests():
            return False
        self.engine.reset_prefix_cache()
        return True

    def parse_prompt(self, prompt: PromptInput, params: SamplingParams | None = None,
                     truncation_side: Literal["left", "right"] = "left", add_special_tokens: bool = False) -> Prompt:
        """Text, token ids, `{"prompt": text}`, `{"prompt_token_ids": ids}` (optionally with
        "checkpoint_position") or `{"messages": [...]}` (the chat template) -> the engine's Prompt, cut to
        `params.truncate_prompt_tokens` from `truncation_side`; `add_special_tokens` has the tokenizer add
        its special tokens to a text (vLLM's request field)."""
        parsed = self._parse(prompt, add_special_tokens)
        keep = None if params is None else params.truncate_prompt_tokens
        return parsed if keep is None else self._truncated(parsed, keep, truncation_side)

    def _truncated(self, prompt: Prompt, keep: int, side: Literal["left", "right"]) -> Prompt:
        """The prompt's last (side "left", vLLM's default) or first `keep` tokens (-1: max_model_len). A cut
        prompt has no text (echo decodes what is left) and no checkpoint (its marker may be cut off)."""
        limit = self.config.max_model_len
        if keep > limit:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens ({keep}) is greater than max_model_len "
                             f"({limit}); select a smaller truncation size")
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
        keep = limit if keep == -1 else keep
        if len(prompt.token_ids) <= keep:
            return prompt
        return Prompt(prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep])

    def _parse(self, prompt: PromptInput, add_special_tokens: bool = False) -> Prompt:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt dict keys {unknown} are not supported (known: {sorted(PROMPT_KEYS)})")
            if "messages" in prompt:
                text = self._require_tokenizer("chat").apply_chat_template(prompt["messages"])
                return self._parse(text, add_special_tokens)
            if "prompt" in prompt:
                return self._parse(prompt["prompt"], add_special_tokens)
            if "prompt_token_ids" in prompt:
                return self._token_prompt(prompt["prompt_token_ids"], prompt.get("checkpoint_position"))
            raise ValueError(f"a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages', got {sorted(prompt)}")
        if isinstance(prompt, str):
            parsed = self._require_tokenizer("text prompts").encode_prompt(prompt, self.config.hash_unit,
                                                                                     add_special_tokens)
            return Prompt(parsed.token_ids, parsed.checkpoint_position, prompt)
        return self._token_prompt(prompt, None)

    def _token_prompt(self, token_ids: Sequence[int], checkpoint_position: int | None) -> Prompt:
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {type(token_ids).__name__}")
        wrong = next((t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if wrong is not None:  # before the marker is looked for: 7.0 is no marker id
            raise ValueError(f"prompt_token_ids must be a list of integers, got {wrong!r}")
        token_ids = [int(t) for t in token_ids]
        if checkpoint_position is not None:  # checked with the request, by the scheduler
            return Prompt(tuple(token_ids), checkpoint_position)
        marker = self.tokenizer.token_id("<|mamba_checkpoint|>") if self.tokenizer else None
        if marker is None:
            return Prompt(tuple(token_ids))
        parsed = parse_checkpoint_marker(token_ids, marker, self.config.hash_unit)
        return Prompt(parsed.token_ids, parsed.checkpoint_position)

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer; this LLM runs with skip_tokenizer_init=True")
        return self.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order."""
        single = isinstance(prompts, str | dict) or (isinstance(prompts, Sequence) and prompts and
                                                     isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        sampling_params = sampling_params or self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        params = [p or self.get_default_sampling_params() for p in params]
        requests = ((self.parse_prompt(prompt, p), p, prompt.get("cache_salt") if isinstance(prompt, dict) else None)
                    for prompt, p in zip(prompts, params, strict=True))
        return self._add_and_run(requests, use_tqdm)

    def score_candidates(self, prompt: str | Sequence[int], candidates: Sequence[str | Sequence[int]], *,
                         top_logprobs: int | None = None, reuse: bool = True) -> PromptScores:
        """Each candidate continuation's total and per-token log-probabilities given `prompt`, which is
        computed once (a checkpoint at its end) unless `reuse=False`; `top_logprobs` adds the k most likely
        next tokens after it. (vLLM's `score` is cross-encoder scoring, which this engine does not do.)"""
        from jaxhybrid.score import read_scores, scoring_requests  # it builds on this module

        scoring = scoring_requests(self, prompt if isinstance(prompt, str) else list(prompt),
                                   [c if isinstance(c, str) else list(c) for c in candidates], top_logprobs, reuse)
        outputs = self._add_and_run(((p, params, None) for p, params in scoring.requests), use_tqdm=False,
                                    prompt_logprobs_from=scoring.prompt_logprobs_from)
        return read_scores(outputs, scoring.prompt_len, top_logprobs)

    def score(self, *args: Any, **kwargs: Any) -> NoReturn:
        """vLLM's `LLM.score(data_1, data_2)` scores pairs with a cross-encoder or embedding model."""
        raise NotImplementedError("LLM.score (vLLM's cross-encoder / embedding scoring) is not supported: this "
                                  "engine runs generative models. To score candidate continuations of a prompt by "
                                  "their log-probabilities, use LLM.score_candidates(prompt, candidates).")

    def _add_and_run(self, requests: Iterable[tuple[Prompt, SamplingParams, str | None]], use_tqdm: bool,
                     prompt_logprobs_from: int = 0) -> list[RequestOutput]:
        """Queue (prompt, params, cache_salt) requests and run them to completion; outputs in their order.
        A request that cannot be queued raises, and nothing of the call stays queued."""
        ids = []
        try:
            for prompt, params, cache_salt in requests:
                ids.append(f"{self._counter}")
                self._counter += 1
                self.engine.add_request(ids[-1], prompt, params, cache_salt=cache_salt,
                                        prompt_logprobs_from=prompt_logprobs_from)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`generate` over conversations rendered with the checkpoint's chat template (or `chat_template`),
        with vLLM's options: `continue_final_message` lets the model carry on the last message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self._require_tokenizer("chat")
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt, continue_final_message, chat_template,
                                                 **(chat_template_kwargs or {})) for m in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id not in done:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]
