"""Port of vLLM's tests/entrypoints/openai/completion/test_serving_completion.py (its cached_tokens part):
prompt_tokens_details.cached_tokens adds up over the prompts of a multi-prompt request, and a stream
counts each prompt once however many chunks it sends. vLLM's local/external cached-token split (KV
connectors) and its "no cache info" case (our outputs always count cached tokens) are in SKIPS.md."""

from __future__ import annotations

import json

from jaxhybrid.openai import responses
from jaxhybrid.openai.protocol import CompletionRequest, StreamOptions
from jaxhybrid.serve import streaming
from tests.jaxhybrid.serve.vllm_openai.fakes import FakeStream, collect, output, server_state


def _output(num_cached_tokens: int):
    request_output = output("", [], "length", prompt="hi", prompt_token_ids=(1, 2, 3))
    request_output.num_cached_tokens = num_cached_tokens
    return request_output


def test_prompt_tokens_details_aggregates_across_prompts():
    request = CompletionRequest(model="test", prompt="hi", max_tokens=1)
    response = responses.completion_response(request, [_output(3), _output(5), _output(0)], "test",
                                             prompt_tokens_details=True)  # vLLM's test: enabled

    assert response["usage"]["prompt_tokens"] == 9
    assert response["usage"]["prompt_tokens_details"] is not None
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


def test_streaming_aggregates_cache_once_per_prompt():
    request = CompletionRequest(model="test", prompt=["hi", "hi"], max_tokens=1, stream=True,
                                stream_options=StreamOptions(include_usage=True))
    # each prompt's stream sends several chunks carrying the same prefill value: counted once per prompt
    streams = [FakeStream([_output(4 + prompt_idx) for _ in range(3)]) for prompt_idx in range(2)]
    state = server_state(prompt_tokens_details=True)  # as vLLM's test sets enable_prompt_tokens_details
    events = collect(streaming.completion_chunks(state, streams, [None, None], request, "test", "cmpl-test"))

    usages = [json.dumps(event["usage"]) for event in events if "usage" in event]
    assert len(usages) == 1
    assert '"cached_tokens": 9' in usages[0]
