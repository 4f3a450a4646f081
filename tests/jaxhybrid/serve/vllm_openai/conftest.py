"""Servers, clients and reference tokenization for the ports of vLLM's OpenAI-server tests.

One default server for the whole session (the ports' modules share it, as CI's two cores cannot afford a
server per module); the few vLLM modules that start a server with other flags get their own, through
`start_server`. The reference tokenizer is the checkpoint's `tokenizer.json` read by the `tokenizers`
library itself, so expected token ids never come from the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import openai
import pytest
from tokenizers import Tokenizer

from jaxhybrid.weights import DEFAULT_MODEL_DIR
from tests.jaxhybrid.serve.server_process import ServerProcess

MODEL_NAME = "jaxhybrid-default"  # the served name of the embedded model without --served-model-name
_CONFIG = json.loads((Path(DEFAULT_MODEL_DIR) / "config.json").read_text())
_TOKENIZER_CONFIG = json.loads((Path(DEFAULT_MODEL_DIR) / "tokenizer_config.json").read_text())
VOCAB_SIZE: int = _CONFIG["vocab_size"]


def start_server(tmp_path_factory, name: str, args: list[str]) -> ServerProcess:
    tmp = tmp_path_factory.mktemp(name)
    return ServerProcess(args, tmp / "server.log", tmp_path_factory.getbasetemp() / "compile-cache")


def stop_server(server: ServerProcess) -> None:
    assert server.stop() in (0, -15), server.log()


def make_client(server: ServerProcess, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0,
                         **{"timeout": 120, **kwargs})


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    process = start_server(tmp_path_factory, "vllm-openai", [])
    yield process
    stop_server(process)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return make_client(server)


@pytest.fixture(scope="session")
def vocab_logprobs_client(tmp_path_factory) -> openai.OpenAI:
    """A server whose --max-logprobs is the whole vocabulary (vLLM's tests give the vocabulary size or -1)."""
    process = start_server(tmp_path_factory, "vocab-logprobs", ["--max-logprobs", str(VOCAB_SIZE)])
    yield make_client(process)
    stop_server(process)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(Path(DEFAULT_MODEL_DIR) / "tokenizer.json"))


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """HuggingFace's `tokenizer.decode(ids)`: special tokens kept."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def render_chat(messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """HuggingFace's `apply_chat_template(..., tokenize=False)` on the checkpoint's template: the template
    rendered as is, cut after the last message's content when continuing it."""
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(_TOKENIZER_CONFIG["chat_template"])
    text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           eos_token=_TOKENIZER_CONFIG.get("eos_token"))
    if continue_final_message:
        final = messages[-1]["content"]
        text = text[:text.rindex(final) + len(final)]
    return text
