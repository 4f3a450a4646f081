"""Port of vLLM's tests/entrypoints/openai/test_tokenization.py: /tokenize of a prompt and of chats (generation
prompt, continued final message, special tokens, tools), token_strs, /detokenize, and /tokenizer_info's schema,
all against the reference tokenizer. The embedded chat template does not read `tools`, so the reference
rendering of a chat with tools is the one without them, as HuggingFace's would be (that tools reach a template
that reads them is tests/jaxhybrid/serve/test_agents.py's). vLLM's max_model_len of 8192 is the session `LLM`'s
(conftest.MAX_MODEL_LEN); vLLM serves /tokenizer_info only with --enable-tokenizer-info-endpoint, which every
module's server has (conftest.SERVER_FLAGS)."""

from __future__ import annotations

import httpx

from tests.jaxhybrid.serve.vllm_openai.conftest import MAX_MODEL_LEN, MODEL_NAME, render_chat


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}/{path}", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def _get(server, path: str) -> dict:
    response = httpx.get(f"{server.url}/{path}", timeout=60)
    response.raise_for_status()
    return response.json()


def test_tokenize_completions(server, tokenizer):
    for add_special in [False, True]:
        prompt = "vllm1 This is a test prompt."
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special).ids

        result = _post(server, "tokenize", {"add_special_tokens": add_special, "model": MODEL_NAME, "prompt": prompt})
        assert result["tokens"] == tokens
        assert result["count"] == len(tokens)
        assert result["max_model_len"] == MAX_MODEL_LEN
        assert result["token_strs"] is None


def _check_tokenize_chat(server, tokenizer, first_turns: list[dict], extra: dict) -> None:
    """vLLM's loop over add_generation_prompt x add_special_tokens x continue_final_message: /tokenize of the
    conversation (with `extra` fields) gives the reference tokenizer's ids of the rendered chat."""
    for add_generation in [False, True]:
        for add_special in [False, True]:
            conversation = list(first_turns)
            for continue_final in [False, True]:
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})

                prompt = render_chat(conversation, add_generation, continue_final)
                tokens = tokenizer.encode(prompt, add_special_tokens=add_special).ids

                result = _post(server, "tokenize", {"add_generation_prompt": add_generation,
                                                    "continue_final_message": continue_final,
                                                    "add_special_tokens": add_special, "messages": conversation,
                                                    "model": MODEL_NAME, **extra})
                assert result["tokens"] == tokens
                assert result["count"] == len(tokens)
                assert result["max_model_len"] == MAX_MODEL_LEN
                assert result["token_strs"] is None


def test_tokenize_chat(server, tokenizer):
    _check_tokenize_chat(server, tokenizer, [{"role": "user", "content": "Hi there!"},
                                             {"role": "assistant", "content": "Nice to meet you!"},
                                             {"role": "user", "content": "Can I ask a question? vllm1"}], {})


def test_tokenize_chat_with_tools(server, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]
    _check_tokenize_chat(server, tokenizer, [{"role": "user", "content": "What's the weather like in Paris today?"}],
                         {"tools": tools})


def test_tokenize_with_return_token_strs(server, tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    result = _post(server, "tokenize", {"prompt": prompt, "model": MODEL_NAME, "return_token_strs": True})

    tokens = tokenizer.encode(prompt, add_special_tokens=True).ids
    tokens_str = [tokenizer.id_to_token(t) for t in tokens]  # HF convert_ids_to_tokens
    assert result["tokens"] == tokens
    assert result["count"] == len(tokens)
    assert result["max_model_len"] == MAX_MODEL_LEN
    assert result["token_strs"] == tokens_str


def test_detokenize(server, tokenizer):
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert _post(server, "detokenize", {"model": MODEL_NAME, "tokens": tokens}) == {"prompt": prompt}


def test_tokenizer_info_basic(server):
    result = _get(server, "tokenizer_info")
    assert "tokenizer_class" in result
    assert isinstance(result["tokenizer_class"], str)
    assert result["tokenizer_class"]


def test_tokenizer_info_schema(server):
    result = _get(server, "tokenizer_info")
    field_types = {"add_bos_token": bool, "add_prefix_space": bool, "clean_up_tokenization_spaces": bool,
                   "split_special_tokens": bool, "bos_token": str, "eos_token": str, "pad_token": str,
                   "unk_token": str, "chat_template": str, "errors": str, "model_max_length": int,
                   "additional_special_tokens": list, "added_tokens_decoder": dict}
    for field, expected_type in field_types.items():
        if field in result and result[field] is not None:
            assert isinstance(result[field], expected_type), f"{field} should be {expected_type.__name__}"


def test_tokenizer_info_added_tokens_structure(server):
    added_tokens = _get(server, "tokenizer_info").get("added_tokens_decoder")
    if added_tokens:
        for token_id, token_info in added_tokens.items():
            assert isinstance(token_id, str), "Token IDs should be strings"
            assert isinstance(token_info, dict), "Token info should be a dict"
            assert "content" in token_info, "Token info should have content"
            assert "special" in token_info, "Token info should have special flag"
            assert isinstance(token_info["special"], bool), "Special flag should be boolean"


def test_tokenizer_info_consistency_with_tokenize(server):
    info = _get(server, "tokenizer_info")
    tokenize_result = _post(server, "tokenize", {"model": MODEL_NAME, "prompt": "Hello world!"})
    info_max_len = info.get("model_max_length")
    tokenize_max_len = tokenize_result.get("max_model_len")
    if info_max_len and tokenize_max_len:
        assert info_max_len >= tokenize_max_len, "Info max length should be >= tokenize max length"


def test_tokenizer_info_chat_template(server):
    chat_template = _get(server, "tokenizer_info").get("chat_template")
    if chat_template:
        assert isinstance(chat_template, str), "Chat template should be a string"
        assert chat_template.strip(), "Chat template should not be empty"
