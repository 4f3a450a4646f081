"""Scoring candidates given a prompt: one request per candidate, all sharing the prompt's checkpoint, and
their prompt logprobs read back as scores (`LLM.score_candidates`, the scoring lines of the batch job). The
requests come from an engine's `PromptPreparer`, so this module needs no `LLM`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.prompts import PromptPreparer
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.openai import render
from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.sample.params import SamplingParams


@dataclass(frozen=True)
class CandidateScore:
    logprob: float               # sum of token_logprobs
    token_logprobs: list[float]  # log P(token | prompt, earlier candidate tokens), one per candidate token


@dataclass(frozen=True)
class PromptScores:
    candidates: list[CandidateScore]
    top_logprobs: list[dict] | None  # [{"token_id", "token", "logprob"}] after the prompt, most likely first


def _tokens(prompts: PromptPreparer, value: Any, name: str) -> list[int]:
    if isinstance(value, str):
        return render.require_tokenizer(prompts.tokenizer, name).encode(value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise BadRequest(f"{name} must be a non-empty string or a non-empty list of token ids", name)


class ScoringRequests(NamedTuple):
    requests: list[tuple[Prompt, SamplingParams]]
    prompt_len: int            # the prompt's tokens: the candidates' start
    prompt_logprobs_from: int  # `Engine.add_request`'s: the candidates' positions, or (no reuse) all of them


def scoring_requests(prompts: PromptPreparer, prompt: str | list[int], candidates: list,
                     top_logprobs: int | None = None, reuse: bool = True) -> ScoringRequests:
    """The requests that score `candidates` given `prompt`. Without reuse they ask for the logits of every
    prompt position, so that each computes its whole prompt (the baseline reuse is measured against)."""
    if not isinstance(candidates, list) or not candidates:
        raise BadRequest("candidates must be a non-empty list", "candidates")
    if top_logprobs is not None and (not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool)
                                     or top_logprobs < 0):
        raise BadRequest("top_logprobs must be an integer >= 0", "top_logprobs")
    context = _tokens(prompts, prompt, "prompt")
    unit = prompts.hash_unit
    # the checkpoint stays before the prompt's last token: that token's logits score every first token
    checkpoint = (len(context) - 1) // unit * unit if reuse else 0
    # greedy: no token is drawn (max_tokens 0), so the step need not prepare a draw
    params = SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=top_logprobs or 0)
    requests = []
    for i, candidate in enumerate(candidates):
        tokens = context + _tokens(prompts, candidate, f"candidates[{i}]")
        prompt_ids = {"prompt_token_ids": tokens, "checkpoint_position": checkpoint or None}
        requests.append((render.prompt_for(prompts, prompt_ids, params), params))
    return ScoringRequests(requests, len(context), len(context) if reuse else 0)


def read_scores(outputs: list[RequestOutput], prompt_len: int, top_logprobs: int | None) -> PromptScores:
    """Per candidate: the logprobs of its tokens (positions from `prompt_len` on) given what precedes them."""
    scores = []
    for output in outputs:
        positions = range(prompt_len, len(output.prompt_token_ids))
        values = [output.prompt_logprobs[p][output.prompt_token_ids[p]].logprob for p in positions]
        scores.append(CandidateScore(sum(values), values))
    top = None
    if top_logprobs is not None:
        first = output.prompt_logprobs[prompt_len]
        ranked = sorted(first.items(), key=lambda item: item[1].rank)
        top = [{"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob}
               for t, lp in ranked if lp.rank <= top_logprobs]
    return PromptScores(scores, top)
