"""`LLM`: the Python API with vLLM's names. `LLM(model=None)` serves the embedded default model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from tqdm import tqdm

from jaxhybrid.engine.args import EngineArgs
from jaxhybrid.engine.builder import BuiltEngine, build_engine
from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.prompts import PromptInput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.model import Model
from jaxhybrid.parsers.reasoning import ReasoningParser
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.scoring import PromptScores, read_scores, scoring_requests
from scheduler import SchedulerConfig


class LLM:
    """An engine on one checkpoint: `generate` and `chat` run prompts to completion, in input order.

    `model` and the keywords are `EngineArgs`' fields (vLLM's names where the concept exists); an unknown
    keyword raises TypeError. `built` is what `build_engine` made of them.
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any):
        self.built: BuiltEngine = build_engine(EngineArgs(model=model, **kwargs))
        self._counter = 0

    @property
    def args(self) -> EngineArgs:
        return self.built.args

    @property
    def model(self) -> Model:
        return self.built.model

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.built.tokenizer

    @property
    def config(self) -> SchedulerConfig:
        return self.built.config

    @property
    def engine(self) -> Engine:
        return self.built.engine

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.built.generation_defaults

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        return self.built.reasoning_parser

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's generation_config.json settings over SamplingParams' defaults."""
        return self.built.default_sampling_params()

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
        keep = None if params is None else params.truncate_prompt_tokens
        return self.built.prompts.prepare(prompt, keep, truncation_side, add_special_tokens)

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
        scoring = scoring_requests(self.built.prompts, prompt if isinstance(prompt, str) else list(prompt),
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
        prompts = [self.built.prompts.chat_text(m, add_generation_prompt, continue_final_message, chat_template,
                                                chat_template_kwargs, tools) for m in conversations]
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
