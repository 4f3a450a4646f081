"""What `LLM.generate` and the engine hand back, with vLLM's names (`vllm.outputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Logprob(NamedTuple):
    logprob: float
    rank: int                  # 1 = the most likely token
    decoded_token: str | None  # None without a tokenizer


# one position: token id -> Logprob, holding the top-n and the token actually there
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times the scheduler preempted one of its sequences (recomputed since)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a checkpoint
