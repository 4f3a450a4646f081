"""`LLM`: the Python API with vLLM's names. `LLM(model=None)` serves the embedded default model."""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import jax
from tqdm import tqdm

from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.engine_args import EngineArgs, ParserSetupError, checkpoint_dtype, speculative_tokens
from jaxhybrid.models.generation_config import read_generation_config, sampling_defaults
from jaxhybrid.models.model import Model
from jaxhybrid.models.tensor_parallel import make_mesh
from jaxhybrid.models.weights import load_model, resolve_model
from jaxhybrid.parsers.reasoning import ReasoningParser, get_reasoning_parser
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.worker.memory import device_memory_budget, param_bytes, reports_memory
from jaxhybrid.worker.runner import step_temporaries
from scheduler import parse_checkpoint_marker

if TYPE_CHECKING:
    from jaxhybrid.scoring import PromptScores

log = logging.getLogger("jaxhybrid")

PromptInput = str | Sequence[int] | dict
PROMPT_KEYS = {"prompt", "prompt_token_ids", "messages", "checkpoint_position", "cache_salt"}


class LLM:
    """An engine on one checkpoint: `generate` and `chat` run prompts to completion, in input order.

    `model` and the keywords are `EngineArgs`' fields (vLLM's names where the concept exists); an unknown
    keyword raises TypeError.
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any):
        from jaxhybrid.models.ops import ModelOps

        self.args = args = EngineArgs(model=model, **kwargs)
        if args.compilation_cache_dir is not None:  # compiled steps persist across processes
            jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        directory = resolve_model(model, args.revision, args.download_dir)
        dtype = checkpoint_dtype(directory, args.dtype)
        self.model: Model = load_model(directory, dtype=dtype, ops=ModelOps(backend=args.backend),
                                       block_size=args.block_size)
        self.generation_defaults = sampling_defaults(read_generation_config(directory))
        cfg = self.model.config
        self.tokenizer = None if args.skip_tokenizer_init else Tokenizer.from_pretrained(
            directory if args.tokenizer is None else resolve_model(args.tokenizer, args.tokenizer_revision,
                                                                   args.download_dir))
        self.reasoning_parser = self._reasoning_parser(args.reasoning_parser)
        if speculative_tokens(args.speculative_config) and not cfg.mtp_layers:
            raise ValueError(f"speculative_config asks for MTP, but the {cfg.model_type} checkpoint at {directory} "
                             "has no MTP weights (mtp.*)")
        tp = args.tensor_parallel_size
        mesh = make_mesh(tp) if tp > 1 else None
        # where the device has a memory limit, the largest step's temporaries are measured and kept out of the
        # pools; a CPU has no limit to keep to, and its budget is a fixed size
        width = args.max_sampling_constraints
        temporaries = (lambda config: step_temporaries(self.model, config, mesh, width)) if reports_memory() else None
        self.config = args.scheduler_config(
            cfg, lambda: device_memory_budget(args.gpu_memory_utilization, param_bytes(self.model.params, cfg, mesh)),
            dtype=dtype, step_temporaries=temporaries)
        reasoning_end = None if self.reasoning_parser is None else self.reasoning_parser.is_reasoning_end
        self.engine = Engine(self.model, self.config, self.tokenizer, seed=args.seed, max_logprobs=args.max_logprobs,
                             mesh=mesh, async_scheduling=args.async_scheduling,
                             max_sampling_constraints=args.max_sampling_constraints, reasoning_end=reasoning_end)
        self._counter = 0
        if args.precompile:
            start = time.perf_counter()
            count = self.engine.precompile()
            log.info("compiled %d buckets in %.1f s", count, time.perf_counter() - start)

    def _reasoning_parser(self, name: str | None) -> ReasoningParser | None:
        """The engine's instance of `reasoning_parser`, built once: its `is_reasoning_end` tells the engine where
        a structured output's grammar starts. A tokenizer it cannot work with is a ParserSetupError."""
        if name is None:
            return None
        parser = get_reasoning_parser(name)
        if self.tokenizer is None:
            raise ParserSetupError(f"reasoning_parser {name!r} needs the model's tokenizer (skip_tokenizer_init is "
                                   "set)")
        try:
            return parser(self.tokenizer)
        except ValueError as error:
            raise ParserSetupError(f"reasoning_parser {name!r} cannot be used with this tokenizer: {error}") from error

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
        from jaxhybrid.scoring import read_scores, scoring_requests  # it builds on this module

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
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """`generate` over conversations rendered with the checkpoint's chat template (or `chat_template`),
        with vLLM's options: `continue_final_message` lets the model carry on the last message, `tools` (OpenAI's
        function definitions) are the template's `tools`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self._require_tokenizer("chat")
        template_kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt, continue_final_message, chat_template,
                                                 **template_kwargs) for m in conversations]
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
