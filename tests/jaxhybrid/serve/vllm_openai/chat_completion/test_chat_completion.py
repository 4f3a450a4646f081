"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_chat_completion.py (its prompt-truncation
test; the structured-output tests are out of scope, SKIPS.md): truncate_prompt_tokens keeps the first or
the last tokens of the rendered chat, as truncation_side says."""

from __future__ import annotations

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME


def test_chat_completion_truncation_side_controls_prompt_truncation(client) -> None:
    messages = [{"role": "user", "content": "Summarize how prompt truncation works in one sentence."}]

    full_completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                                     temperature=0.0, extra_body={"return_token_ids": True})
    full_token_ids = full_completion.prompt_token_ids
    assert full_token_ids is not None
    assert len(full_token_ids) > 4

    right_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "right"})
    assert right_completion.prompt_token_ids == full_token_ids[:4]

    left_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert left_completion.prompt_token_ids == full_token_ids[-4:]
