"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_extra_content_fields.py: with
--chat-template-content-format openai, the fields of a content part beyond its text (TranslateGemma's
`source_lang_code` / `target_lang_code`) reach the chat template. vLLM's test serves TranslateGemma and
checks that its reply is Spanish; this checkpoint's template reads one text, so the module's server renders
with a template that reads those fields as TranslateGemma's does, and the test checks the rendered prompt
(/tokenize, and the chat request's prompt_tokens) against that template rendered here by jinja2."""

from __future__ import annotations

import httpx
import jinja2
import pytest

from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR
from jaxhybrid.openai.render import content_format
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, SERVER_FLAGS, InProcessServer, make_client

TRANSLATE_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}<start_of_turn>{{ message['role'] }}\n"
    "Translate from {{ part['source_lang_code'] }} to {{ part['target_lang_code'] }}: {{ part['text'] }}"
    "<end_of_turn>\n{% endfor %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox jumps over the lazy dog.",
                                          "source_lang_code": "en", "target_lang_code": "es"}]}]


@pytest.fixture(scope="module")
def server(session_engine):
    """The session engine rendering with TRANSLATE_TEMPLATE (its own restored after the module), served with
    the content format that template asks for."""
    tokenizer = session_engine.tokenizer
    own = tokenizer.chat_template
    tokenizer.chat_template = TRANSLATE_TEMPLATE
    try:
        process = InProcessServer(session_engine, SERVER_FLAGS,
                                  content_format=content_format(session_engine.tokenizer, "openai"))
        yield process
        process.stop()
    finally:
        tokenizer.chat_template = own


def test_translategemma_extra_lang_code_fields(server, tokenizer):
    """The part's language codes are in the prompt the model is given."""
    expected = jinja2.Environment().from_string(TRANSLATE_TEMPLATE).render(messages=MESSAGES,
                                                                            add_generation_prompt=True)
    assert "Translate from en to es: The quick brown fox" in expected
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokens == tokenizer.encode(expected, add_special_tokens=False).ids

    completion = make_client(server).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                                             temperature=0.0)
    content = completion.choices[0].message.content
    assert content is not None
    assert completion.usage.prompt_tokens == len(tokens)


def test_auto_content_format_follows_the_template():
    """vLLM's default, auto: "openai" for a template that loops over a message's content parts (as
    TranslateGemma's), "string" for this checkpoint's, which reads one text."""
    assert content_format(Tokenizer.from_pretrained(DEFAULT_MODEL_DIR), "auto") == "string"
    translating = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    translating.chat_template = TRANSLATE_TEMPLATE
    assert content_format(translating, "auto") == "openai"
    assert content_format(translating, "string") == "string"
    assert content_format(None, "auto") == "string"  # no tokenizer, no template
