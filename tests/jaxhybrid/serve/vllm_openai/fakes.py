"""Engine outputs made by hand, for the ports of vLLM's tests that feed the serving layer a mocked engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

from jaxhybrid.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput


class FakeStream:
    """A `RequestStream` stand-in: yields the given outputs, then ends."""

    def __init__(self, outputs: list[RequestOutput]):
        self._outputs = iter(outputs)
        self.closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return next(self._outputs)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self.closed = True


def output(text: str, token_ids: list[int], finish_reason: str | None,
           logprobs: list[PositionLogprobs] | None = None, prompt: str = "Test prompt",
           prompt_token_ids: tuple[int, ...] = (1, 2, 3)) -> RequestOutput:
    completion = CompletionOutput(index=0, text=text, token_ids=list(token_ids), cumulative_logprob=None,
                                  logprobs=logprobs, finish_reason=finish_reason)
    return RequestOutput(request_id="test-id", prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                         prompt_logprobs=None, outputs=[completion], finished=finish_reason is not None,
                         metrics=RequestMetrics(arrival_time=0.0))


def server_state(**flags) -> SimpleNamespace:
    """What the serving functions read of a `ServerState` (its flags off unless given): no engine loop, and
    an engine without a tokenizer (the hand-made outputs name their logprob tokens themselves)."""
    built = SimpleNamespace(tokenizer=None)
    return SimpleNamespace(built=built, loop=None, **{"prompt_tokens_details": False, "force_include_usage": False,
                                                       **flags})


def prompt(token_ids: tuple[int, ...] = (1, 2, 3)) -> SimpleNamespace:
    """What the chat stream reads of a `Prompt`."""
    return SimpleNamespace(token_ids=token_ids, text=None)


def collect(events: AsyncIterator) -> list:
    async def drain() -> list:
        return [event async for event in events]

    return asyncio.run(drain())
