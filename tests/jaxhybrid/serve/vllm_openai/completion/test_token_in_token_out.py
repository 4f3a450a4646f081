"""Port of vLLM's tests/entrypoints/openai/completion/test_token_in_token_out.py: a server started with
--skip-tokenizer-init takes token ids, echoes them and returns the prompt's and completion's token ids
(vLLM loads dummy weights; this server loads the embedded model, without its tokenizer, in the session
engine's configuration, so its compiled step comes from the compilation cache)."""

from __future__ import annotations

import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, decode, make_client, start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = start_server(tmp_path_factory, "token-in-token-out", ["--skip-tokenizer-init"])
    yield process
    stop_server(process)


def test_token_in_token_out_and_logprobs(server, tokenizer):
    """Token in, token ids out; the prompt's token ids decode back to the text they came from."""
    text = "Hello, world! How are you today?"
    token_ids = tokenizer.encode(text).ids
    completion = make_client(server).completions.create(model=MODEL_NAME, prompt=token_ids, max_tokens=20,
                                                         temperature=0, echo=True,
                                                         extra_body={"return_token_ids": True})

    assert completion.choices[0].token_ids is not None and 0 < len(completion.choices[0].token_ids) <= 20
    assert completion.choices[0].prompt_token_ids is not None

    if completion.choices[0].prompt_token_ids:
        prompt_text = decode(tokenizer, completion.choices[0].prompt_token_ids)
        # The decoded prompt should match or close to original prompt
        assert prompt_text == text
