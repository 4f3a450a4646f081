"""Port of vLLM's tests/entrypoints/openai/completion/test_completion_text_offset.py: with a stop string the
detokenizer holds text back, so streamed text lags the tokens; the streamed logprobs' text_offset must
still equal the non-streamed one (offsets count the tokens' own texts). The serving layer is fed
hand-made outputs, as vLLM's test does."""

from __future__ import annotations

from jaxhybrid.engine.outputs import Logprob
from jaxhybrid.openai import responses
from jaxhybrid.openai.protocol import CompletionRequest
from jaxhybrid.serve import streaming
from tests.jaxhybrid.serve.vllm_openai.fakes import FakeStream, collect, output, server_state

TOKENS = [(1, "abc"), (2, " de"), (3, "!")]
# Text deltas as the detokenizer streams them with stop=["\n\n"]: one char is held back until the request
# finishes, so the text lags the tokens.
TEXT_DELTAS = ["ab", "c d", "e!"]


def _logprobs(i: int) -> dict[int, Logprob]:
    token_id, token = TOKENS[i]
    return {token_id: Logprob(logprob=-1.0, rank=1, decoded_token=token)}


def _output(text: str, idxs: list[int], finished: bool):
    """The cumulative output after the tokens `idxs` (our outputs carry the text and tokens so far)."""
    return output(text, [TOKENS[i][0] for i in idxs], "stop" if finished else None,
                  logprobs=[_logprobs(i) for i in idxs], prompt="Hi", prompt_token_ids=(9,))


def _request(stream: bool) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Hi", max_tokens=8, logprobs=0, stop=["\n\n"], stream=stream)


def test_stream_text_offset_matches_non_stream_with_stop_holdback():
    cumulative = [_output("".join(TEXT_DELTAS[:i + 1]), list(range(i + 1)), i == len(TEXT_DELTAS) - 1)
                  for i in range(len(TEXT_DELTAS))]
    events = collect(streaming.completion_chunks(server_state(), [FakeStream(cumulative)], [None],
                                                 _request(stream=True), "m", "cmpl-test"))
    stream_offsets = [offset for event in events for choice in event["choices"]
                      for offset in choice["logprobs"]["text_offset"]]

    response = responses.completion_response(_request(stream=False), [cumulative[-1]], "m")
    assert response["choices"][0]["logprobs"] is not None
    assert response["choices"][0]["logprobs"]["text_offset"] == [0, 3, 6]
    assert stream_offsets == [0, 3, 6]
