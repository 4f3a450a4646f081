"""Port of vLLM's tests/entrypoints/openai/completion/test_completion_logprobs.py: a sampled token missing
from its step's top-logprobs dict (vLLM: when the top logprobs are all special tokens) is named by the
tokenizer, with null logprobs, rather than failing the response with a KeyError."""

from __future__ import annotations

from jaxhybrid.engine.outputs import Logprob
from jaxhybrid.openai.responses import completion_logprobs


def test_completion_logprobs_handles_sampled_token_absent_from_step():
    decoded = []

    def decode(token: int) -> str:
        decoded.append(token)
        return "<special>"

    # Sampled token 5 is not a key in the step's top-logprobs dict.
    top_logprobs = [{1: Logprob(logprob=-0.1, rank=1, decoded_token="a"),
                     2: Logprob(logprob=-0.2, rank=2, decoded_token="b")}]

    result = completion_logprobs([5], top_logprobs, 0, decode)

    assert result["tokens"] == ["<special>"]
    assert result["token_logprobs"] == [None]
    assert result["top_logprobs"] == [None]
    assert decoded == [5]
