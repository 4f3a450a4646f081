"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_reasoning_effort.py: reasoning_effort "none"
sets enable_thinking false for both the chat template and the reasoning parser, unless chat_template_kwargs
say otherwise. vLLM writes it into the request's chat_template_kwargs (and its ChatParams); here the request
keeps what was sent and `template_kwargs()` is what the template and the parser get, so the asserts read it.

Not ported (SKIPS.md): test_non_none_does_not_inject_enable_thinking. Here "low", "medium" and "high" set
enable_thinking true (docs/serving.md), where vLLM leaves the key out."""

from __future__ import annotations

from jaxhybrid.openai.protocol import ChatCompletionRequest


def _build_request(**kwargs) -> ChatCompletionRequest:
    request = ChatCompletionRequest(**{"model": "test-model", "messages": [{"role": "user", "content": "Hello"}],
                                       **kwargs})
    request.check()
    return request


def test_none_injects_enable_thinking_in_request():
    assert _build_request(reasoning_effort="none").template_kwargs()["enable_thinking"] is False


def test_none_preserves_reasoning_effort_in_kwargs():
    assert _build_request(reasoning_effort="none").template_kwargs()["reasoning_effort"] == "none"


def test_no_reasoning_effort_does_not_inject():
    assert "enable_thinking" not in _build_request().template_kwargs()


def test_explicit_enable_thinking_not_overridden():
    """A request's own enable_thinking=True wins over reasoning_effort="none"."""
    request = _build_request(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert request.template_kwargs()["enable_thinking"] is True


def test_none_does_not_override_include_reasoning():
    """reasoning_effort="none" turns thinking off through enable_thinking, not by hiding the reasoning."""
    assert _build_request(reasoning_effort="none").include_reasoning is True


def test_existing_chat_template_kwargs_preserved():
    request = _build_request(reasoning_effort="none", chat_template_kwargs={"custom_key": "value"})
    assert request.template_kwargs()["custom_key"] == "value"
    assert request.template_kwargs()["enable_thinking"] is False
