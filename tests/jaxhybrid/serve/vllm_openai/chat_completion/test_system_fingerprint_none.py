"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_system_fingerprint_none.py: without a
fingerprint, plain chat and completion responses omit `system_fingerprint` (no null) and keep their other
fields. vLLM checks its response models' dumps; this server builds plain dicts, so the check is on the
JSON it sends. Its "fingerprint is set" cases are in SKIPS.md (no --fingerprint-mode here)."""

from __future__ import annotations

import httpx

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


class TestChatCompletionFingerprintNone:
    def test_key_absent_when_fingerprint_is_none(self, server):
        assert "system_fingerprint" not in _post(server, "/v1/chat/completions", CHAT)

    def test_other_fields_unaffected_when_fingerprint_excluded(self, server):
        dumped = _post(server, "/v1/chat/completions", CHAT)
        assert dumped["model"] == MODEL_NAME
        assert len(dumped["choices"]) == 1
        assert dumped["usage"]["total_tokens"] == dumped["usage"]["prompt_tokens"] + 1


class TestCompletionFingerprintNone:
    def test_key_absent_when_fingerprint_is_none(self, server):
        assert "system_fingerprint" not in _post(server, "/v1/completions", COMPLETION)

    def test_other_fields_unaffected_when_fingerprint_excluded(self, server):
        dumped = _post(server, "/v1/completions", COMPLETION)
        assert dumped["model"] == MODEL_NAME
        assert len(dumped["choices"]) == 1
        assert dumped["usage"]["total_tokens"] == dumped["usage"]["prompt_tokens"] + 1
