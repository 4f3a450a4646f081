"""Servers, clients and reference tokenization for the ports of vLLM's OpenAI-server tests.

Compiling the engine's step is what a server costs (tens of seconds a configuration on two cores), and vLLM's
modules start servers with flags that contradict each other, so the ports serve in process: two built engines for
the session, each module an app of its own on one of them with its module's flags, on a uvicorn thread
(starting one costs milliseconds). The session engine is SMALL's server; the long one has what the other
cannot: --max-logprobs at the vocabulary size (vLLM's tests that give -1; the default limit of 20 is
asserted elsewhere) and the cancellation test's --max-model-len (vLLM's tokenization tests assert a
max_model_len within the tokenizer's 512, and its chat tests without max_tokens would generate to it). Only
--skip-tokenizer-init needs a process of its own (`start_server`); its compiled step, the session engine's,
comes from the session's compilation cache. The reference tokenizer is the checkpoint's `tokenizer.json`
read by the `tokenizers` library itself, so expected token ids never come from the code under test.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jinja2
import openai
import pytest
import uvicorn
from tokenizers import Tokenizer

from jaxhybrid.models.weights import DEFAULT_MODEL_DIR
from tests.jaxhybrid.serve.server_process import SMALL, ServerProcess, free_port

MODEL_NAME = "jaxhybrid-default"  # the served name of the embedded model without --served-model-name
_CONFIG = json.loads((Path(DEFAULT_MODEL_DIR) / "config.json").read_text())
_TOKENIZER_CONFIG = json.loads((Path(DEFAULT_MODEL_DIR) / "tokenizer_config.json").read_text())
VOCAB_SIZE: int = _CONFIG["vocab_size"]
# The chat echo tests' request. vLLM's samples until the model's end of sequence, which this random model reaches
# only after 500 to 2,500 tokens (a minute or two here), so the port ends the same request at its first "."
# (seeded: a few dozen tokens), which gives the same finish_reason "stop"; max_tokens bounds it should a "." never
# come.
BOUNDED = {"seed": 0, "stop": ["."], "max_tokens": 200}
SERVER_FLAGS = {"tokenizer_info": True, "server_load_tracking": True}  # `build_app`'s, on every module's app
MAX_MODEL_LEN = int(SMALL[SMALL.index("--max-model-len") + 1])  # the session engine's
LONG_MODEL_LEN = 10100  # vLLM's cancellation test asks for 10000 tokens; 700 KV blocks hold one such sequence


def start_server(tmp_path_factory, name: str, args: list[str]) -> ServerProcess:
    tmp = tmp_path_factory.mktemp(name)
    return ServerProcess(args, tmp / "server.log", _compile_cache(tmp_path_factory))


def _compile_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "compile-cache"


def stop_server(server: ServerProcess) -> None:
    assert server.stop() in (0, -15), server.log()


def make_client(server: ServerProcess, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0,
                         **{"timeout": 600, **kwargs})  # the openai client's own default: a hang bound


def _engine(tmp_path_factory, flags: list[str]):
    """The engine `python -m jaxhybrid.serve` builds with SMALL's flags, then `flags`."""
    from jaxhybrid.engine.builder import build_engine
    from jaxhybrid.flags import from_namespace
    from jaxhybrid.serve.__main__ import parse_args

    return build_engine(from_namespace(parse_args([*SMALL, "--compilation-cache-dir",
                                                   str(_compile_cache(tmp_path_factory)), *flags])))


@pytest.fixture(scope="session")
def session_engine(tmp_path_factory):
    return _engine(tmp_path_factory, [])


@pytest.fixture(scope="session")
def long_engine(tmp_path_factory):
    """--max-logprobs at the vocabulary size and the long --max-model-len."""
    return _engine(tmp_path_factory, ["--max-logprobs", str(VOCAB_SIZE), "--max-model-len", str(LONG_MODEL_LEN),
                                   "--num-blocks", "700"])


@pytest.fixture(scope="module")
def server(session_engine):
    """The module's server: the session engine with SERVER_FLAGS."""
    process = InProcessServer(session_engine, SERVER_FLAGS)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return make_client(server)


class InProcessServer:
    """An app on an engine built in this process, served by uvicorn on a thread at `url` (the url a
    `ServerProcess` has, so `make_client` takes either); `app_flags` are `build_app`'s, `model_names` and
    `state_flags` `ServerState`'s."""

    def __init__(self, built, app_flags: dict | None = None, model_names: tuple[str, ...] = (MODEL_NAME,),
                 **state_flags):
        from jaxhybrid.serve.app import build_app
        from jaxhybrid.serve.engine_loop import EngineLoop
        from jaxhybrid.serve.metrics import ServerMetrics, cache_config_info
        from jaxhybrid.serve.state import ServerState

        config = built.config
        loop = EngineLoop(built.engine, ServerMetrics(MODEL_NAME, config.max_model_len, 0, cache_config_info(config)))
        state = ServerState(built, loop, model_names, str(DEFAULT_MODEL_DIR), config.max_model_len, **state_flags)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(build_app(state, **(app_flags or {})), host="127.0.0.1",
                                                     port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="in-process-server", daemon=True)
        self._thread.start()
        for _ in range(600):  # started: the lifespan (the engine loop) is up and the socket listens
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.05)
        assert self._server.started, "the in-process server did not start"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)
        assert not self._thread.is_alive(), "the in-process server did not stop"


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
