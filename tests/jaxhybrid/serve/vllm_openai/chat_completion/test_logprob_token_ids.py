"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py: `logprob_token_ids`
pins the vocabulary ids whose logprobs a response carries, whatever their rank; without it the top-k are
the natural ones. vLLM's server runs with --max-logprobs -1; this one with the vocabulary size, the same
limit for this checkpoint."""

from __future__ import annotations

import math

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME


def _logprob_entries(resp) -> list:
    """The top_logprobs of the first generated position."""
    return resp.choices[0].logprobs.content[0].top_logprobs


def test_logprob_token_ids_returns_requested_ids(vocab_logprobs_client):
    """The requested ids appear in top_logprobs; the sampled token takes the first slot, so when it is not
    one of them, the last requested id may be displaced: at least len(requested) - 1 must appear."""
    requested_ids = [100, 1000, 2000]  # vLLM's [100, 1000, 5000]; 5000 is past this vocabulary
    resp = vocab_logprobs_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, temperature=0,
        logprobs=True, top_logprobs=len(requested_ids),
        extra_body={"logprob_token_ids": requested_ids, "return_tokens_as_token_ids": True})
    entries = _logprob_entries(resp)

    returned_token_ids: set[int] = set()
    for e in entries:
        assert e.token.startswith("token_id:"), (
            f"expected return_tokens_as_token_ids=True to yield the `token_id:<int>` form, got {e.token!r}")
        returned_token_ids.add(int(e.token.removeprefix("token_id:")))

    requested_present = returned_token_ids.intersection(requested_ids)
    sampled_in_requested = bool(returned_token_ids - set(requested_ids)) is False
    expected_min = len(requested_ids) if sampled_in_requested else len(requested_ids) - 1
    assert len(requested_present) >= expected_min, (
        f"requested {requested_ids}, returned {sorted(returned_token_ids)}, "
        f"matched {sorted(requested_present)} (expected at least {expected_min})")

    for e in entries:  # finite raw logprobs
        assert isinstance(e.logprob, float)
        assert not math.isnan(e.logprob)
        assert not math.isinf(e.logprob)


def test_logprob_token_ids_default_behavior_unchanged(vocab_logprobs_client):
    """Without logprob_token_ids the response carries the natural top-k."""
    resp = vocab_logprobs_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, temperature=0, logprobs=True,
        top_logprobs=5)
    entries = _logprob_entries(resp)
    assert len(entries) == 5
    for e in entries:  # raw logprobs: all <= 0
        assert e.logprob <= 0.0
