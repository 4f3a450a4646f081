"""What the server's handlers share: the built engine, the engine loop, the flags, the worker threads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from jaxhybrid.engine.builder import BuiltEngine
from jaxhybrid.openai.chat_parsing import ChatParsers
from jaxhybrid.serve.engine_loop import EngineLoop

T = TypeVar("T")


@dataclass
class ServerState:
    """The server's engine (what `build_engine` returned: the engine, tokenizer, config, generation defaults,
    prompt preparer), the loop that steps it, and the flags the handlers read."""

    built: BuiltEngine  # the engine, its tokenizer, config, generation defaults and prompts
    loop: EngineLoop
    model_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    prompt_tokens_details: bool = False  # vLLM's --enable-prompt-tokens-details
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage
    server_load: int = 0  # generation requests being served (GET /load with --enable-server-load-tracking)
    content_format: str = "string"  # vLLM's --chat-template-content-format, resolved: "string" or "openai"
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser: used with --enable-auto-tool-choice
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag: tool_choice "none" hides the tools
    # templating and (de)tokenizing: two threads, so the event loop stays free and a burst of large prompts
    # queues here instead of taking every core from the engine
    workers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="jaxhybrid-prepare"))

    parsers: ChatParsers = field(init=False, default_factory=ChatParsers)  # none unless the flags name some

    def __post_init__(self) -> None:
        """The parsers, tried on the tokenizer now: a flag that cannot work with it ends start-up."""
        if self.reasoning_parser or self.enable_auto_tool_choice:
            self.parsers = ChatParsers.from_flags(self.built.tokenizer, self.reasoning_parser, self.tool_call_parser,
                                                  self.enable_auto_tool_choice)

    async def off_loop(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.workers, work)
