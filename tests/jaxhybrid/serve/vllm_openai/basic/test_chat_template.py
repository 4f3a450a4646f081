"""Port of vLLM's tests/entrypoints/openai/basic/test_chat_template.py (its prompt-rendering cases; vLLM's
chat-template file loader has no counterpart here, SKIPS.md): the ChatML template renders a conversation
with and without the generation prompt, and continues a final assistant message."""

from __future__ import annotations

import pytest

from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR

# vLLM's examples/template_chatml.jinja (the text vLLM's test_load_chat_template pins)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}"
          "{% if (loop.last and add_generation_prompt) or not loop.last %}{{ '<|im_end|>' + '\\n'}}{% endif %}"
          "{% endfor %}\n"
          "{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")

# (add_generation_prompt, continue_final_message, expected output)
TEMPLATE_GENERATION_OUTPUT = [
    (True, False, """<|im_start|>user
Hello<|im_end|>
<|im_start|>assistant
Hi there!<|im_end|>
<|im_start|>user
What is the capital of<|im_end|>
<|im_start|>assistant
"""),
    (False, False, """<|im_start|>user
Hello<|im_end|>
<|im_start|>assistant
Hi there!<|im_end|>
<|im_start|>user
What is the capital of"""),
    (False, True, """<|im_start|>user
Hello<|im_end|>
<|im_start|>assistant
Hi there!<|im_end|>
<|im_start|>user
What is the capital of<|im_end|>
<|im_start|>assistant
The capital of"""),
]

TEST_MESSAGES = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
                 {"role": "user", "content": "What is the capital of"}]
ASSISTANT_MESSAGE_TO_CONTINUE = {"role": "assistant", "content": "The capital of"}


@pytest.fixture(scope="module")
def chat_tokenizer():
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("add_generation_prompt,continue_final_message,expected_output", TEMPLATE_GENERATION_OUTPUT)
def test_get_gen_prompt(chat_tokenizer, add_generation_prompt, continue_final_message, expected_output):
    messages = TEST_MESSAGES + [ASSISTANT_MESSAGE_TO_CONTINUE] if continue_final_message else TEST_MESSAGES
    result = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, chat_template=CHATML)
    assert result == expected_output, "The generated prompt does not match the expected output"
