"""Reasoning and tool-call parsers: they split a chat model's output text into reasoning, content and tool calls,
whole (`extract_*`) or delta by delta as it streams (`extract_*_streaming`, then `finish_streaming`), with the
method names, semantics and OpenAI field names of vLLM's parsers.

`reasoning.get_reasoning_parser(name)` and `tools.get_tool_parser(name)` give the classes; build one per request.
This package imports nothing of jaxhybrid's: a tokenizer and a request are taken by what they offer
(`messages.TokenizerLike`, `messages.ParserRequest`).
"""
