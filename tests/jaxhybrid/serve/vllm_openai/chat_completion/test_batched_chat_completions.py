"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py: POST
/v1/chat/completions/batch answers each conversation by one choice indexed by its position, with logprobs
named as tokens (or ids when asked), echoes only a trailing reply-role message, and refuses what one
request cannot carry for several conversations; a strict json_schema response_format constrains every
conversation's reply. Its harmony, parser and logprob_token_ids cases are in SKIPS.md; vLLM's
`kv_transfer_params` case is refused here as every unsupported field is (naming `kv_transfer_params`)."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxhybrid.openai import responses
from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import BatchChatCompletionRequest
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME
from tests.jaxhybrid.serve.vllm_openai.fakes import output


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions/batch", json=body, timeout=600)


def test_batched_chat_completions(server):
    conversations = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
                     [{"role": "user", "content": "Reply with exactly the word: beta"}]]
    response = _post(server, {"model": MODEL_NAME, "messages": conversations})

    assert response.status_code == 200, response.text
    data = response.json()

    choices = data["choices"]
    assert len(choices) == 2

    indices = {choice["index"] for choice in choices}
    assert indices == {0, 1}

    # Each conversation should produce a non-empty text response.
    for choice in choices:
        assert choice["message"]["content"]


def test_batched_chat_completions_with_json_schema(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    conversations = [[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                     [{"role": "user", "content": "Is fire cold? Answer in JSON."}]]
    # seeded, and JSON without whitespace: the random model would write whitespace to max_model_len
    response = _post(server, {"model": MODEL_NAME, "messages": conversations, "seed": 0,
                              "structured_outputs": {"disable_any_whitespace": True},
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "answer", "schema": schema, "strict": True}}})

    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        parsed = json.loads(choice["message"]["content"])
        assert "answer" in parsed
        assert parsed["answer"] in ("yes", "no")


def test_batched_chat_completions_logprobs_not_token_id_placeholders(server):
    # Regression test: requesting `return_token_ids` alongside logprobs must not corrupt the logprob `token`
    # fields into "token_id:{id}" placeholders, which `return_tokens_as_token_ids` (unset here) controls.
    conversations = [[{"role": "user", "content": "Reply with exactly the word: alpha"}]]
    response = _post(server, {"model": MODEL_NAME, "messages": conversations, "logprobs": True, "top_logprobs": 1,
                              "return_token_ids": True})

    assert response.status_code == 200, response.text
    data = response.json()

    content = data["choices"][0]["logprobs"]["content"]
    assert content
    for entry in content:
        assert not entry["token"].startswith("token_id:")
        for top in entry["top_logprobs"]:
            assert not top["token"].startswith("token_id:")


def test_batched_chat_completions_return_tokens_as_token_ids(server):
    # Complementary check: when `return_tokens_as_token_ids` is set, the logprob tokens are "token_id:{id}"
    # placeholders, proving the field is wired through.
    conversations = [[{"role": "user", "content": "Reply with exactly the word: alpha"}]]
    response = _post(server, {"model": MODEL_NAME, "messages": conversations, "logprobs": True, "top_logprobs": 1,
                              "return_tokens_as_token_ids": True})

    assert response.status_code == 200, response.text
    data = response.json()

    content = data["choices"][0]["logprobs"]["content"]
    assert content
    assert all(entry["token"].startswith("token_id:") for entry in content)


def test_batched_echo_does_not_prepend_user_prompt():
    """Echo must only echo the assistant turn, never the user's prompt: with `add_generation_prompt` (the
    default) the reply's role is the assistant's while the last message is the user's, so there is nothing
    to echo."""
    request = BatchChatCompletionRequest(model="test-model", messages=[[{"role": "user", "content": "USER PROMPT"}]],
                                         echo=True)
    response = responses.batch_chat_response(request.conversations(), [output("ASSISTANT ANSWER", [4, 5], "stop")],
                                             "test-model", "req-echo")

    assert response["choices"][0]["message"]["content"] == "ASSISTANT ANSWER"


def test_batched_echo_prepends_matching_assistant_prefix():
    """A trailing assistant turn is a real prefix and must still be echoed."""
    conversations = [[{"role": "user", "content": "USER PROMPT"}, {"role": "assistant", "content": "PREFIX "}]]
    request = BatchChatCompletionRequest(model="test-model", messages=conversations, echo=True,
                                         add_generation_prompt=False, continue_final_message=True)
    response = responses.batch_chat_response(request.conversations(), [output("ASSISTANT ANSWER", [4, 5], "stop")],
                                             "test-model", "req-echo-2")

    assert response["choices"][0]["message"]["content"] == "PREFIX ASSISTANT ANSWER"


def test_batch_rejects_kv_transfer_prompt_token_ids():
    """One pre-tokenized prompt cannot stand in for every conversation (here kv_transfer_params is refused
    whatever it holds)."""
    request = BatchChatCompletionRequest(model="test-model", messages=[[{"role": "user", "content": "first"}],
                                                                       [{"role": "user", "content": "second"}]],
                                         kv_transfer_params={"prompt_token_ids": [10, 20, 30]})
    with pytest.raises(BadRequest, match="kv_transfer_params") as error:
        request.check()
    assert error.value.param == "kv_transfer_params"


# -- beyond vLLM's file ----------------------------------------------------------------------------------------

def test_batched_choices_are_those_of_single_chat_requests(server):
    """Each choice is what /v1/chat/completions answers its conversation alone (greedy), and the usage adds
    up both."""
    conversations = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
                     [{"role": "user", "content": "Write a function that reads a file."}]]
    common = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    batch = _post(server, {**common, "messages": conversations}).json()
    singles = [httpx.post(f"{server.url}/v1/chat/completions", json={**common, "messages": m}, timeout=600).json()
               for m in conversations]

    assert [c["message"] for c in batch["choices"]] == [s["choices"][0]["message"] for s in singles]
    assert [c["token_ids"] for c in batch["choices"]] == [s["choices"][0]["token_ids"] for s in singles]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][field] == sum(s["usage"][field] for s in singles)
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")


@pytest.mark.parametrize(("extra", "param"), [({"stream": True}, "stream"), ({"n": 2}, "n"),
                                              ({"prompt_logprobs": 1}, "prompt_logprobs"),
                                              ({"prompt_token_ids": [1, 2]}, "prompt_token_ids"),
                                              ({"messages": []}, "messages"), ({"messages": [[]]}, "messages"),
                                              ({"top_logprobs": 2}, "top_logprobs"),
                                              ({"use_beam_search": True}, "use_beam_search")])
def test_batched_chat_refuses_what_it_cannot_do(server, extra: dict, param: str):
    """A 400 naming the field, and the server answers the next batch."""
    body = {"model": MODEL_NAME, "messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 2}
    response = _post(server, {**body, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["type"] == "BadRequestError"
    assert _post(server, body).status_code == 200
