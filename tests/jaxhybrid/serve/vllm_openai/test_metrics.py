"""Port of vLLM's tests/entrypoints/openai/test_metrics.py (text model; the multimodal server and run_batch
are out of scope, SKIPS.md): /metrics counts what requests did, carries vLLM's series, and its running,
waiting and KV-usage gauges return to zero once aborted requests are gone. vLLM's `vllm:` names are this
server's `jaxhybrid:` ones; its chunked-prefill, frontend and hidden-metrics server variants
have no counterpart, so the deprecated hidden series are not expected. vLLM reads a fresh server; the
session's server has served other tests, so counts are compared as differences across the requests."""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from jaxhybrid.serve.metrics import PREFIX
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME

_PROMPT = "Hello my name is Robert and I love magic"


def _name(vllm_name: str) -> str:
    return vllm_name.replace("vllm:", PREFIX, 1)


def _get_expected_values(num_requests: int, prompt_ids: list[int], max_tokens: int) -> dict:
    num_prompt_tokens = len(prompt_ids)
    # {metric_family: [(suffix, expected_value)]}
    expected = {
        "vllm:time_to_first_token_seconds": [("_count", num_requests)],
        "vllm:time_per_output_token_seconds": [("_count", num_requests * (max_tokens - 1))],
        "vllm:e2e_request_latency_seconds": [("_count", num_requests)],
        "vllm:request_queue_time_seconds": [("_count", num_requests)],
        "vllm:request_inference_time_seconds": [("_count", num_requests)],
        "vllm:request_prefill_time_seconds": [("_count", num_requests)],
        "vllm:request_decode_time_seconds": [("_count", num_requests)],
        "vllm:request_prompt_tokens": [("_sum", num_requests * num_prompt_tokens), ("_count", num_requests)],
        "vllm:request_generation_tokens": [("_sum", num_requests * max_tokens), ("_count", num_requests)],
        "vllm:request_params_n": [("_count", num_requests)],
        "vllm:request_params_max_tokens": [("_sum", num_requests * max_tokens), ("_count", num_requests)],
        "vllm:iteration_tokens_total": [("_sum", num_requests * (num_prompt_tokens + max_tokens)),
                                        ("_count", num_requests * max_tokens)],
        "vllm:prompt_tokens": [("_total", num_requests * num_prompt_tokens)],
        "vllm:generation_tokens": [("_total", num_requests * max_tokens)],
        "vllm:request_success": [("_total", num_requests)],
    }
    return {_name(family): [(suffix, value) for suffix, value in values] for family, values in expected.items()}


EXPECTED_METRICS_V1 = [_name(name) for name in [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:request_success_total", "vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_bucket",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_bucket",
    "vllm:request_generation_tokens_count", "vllm:request_params_n_sum", "vllm:request_params_n_bucket",
    "vllm:request_params_n_count", "vllm:request_params_max_tokens_sum", "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_max_tokens_count", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_sum", "vllm:request_inference_time_seconds_bucket",
    "vllm:request_inference_time_seconds_count", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_decode_time_seconds_count",
    # vLLM's V1 series this list (of vLLM's test) predates
    "vllm:num_requests_waiting_by_reason", "vllm:request_num_preemptions_sum", "vllm:request_num_preemptions_bucket",
    "vllm:request_num_preemptions_count"]]

HIDDEN_DEPRECATED_METRICS = [_name(name) for name in [
    "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count"]]


def _metrics_text(server) -> str:
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == HTTPStatus.OK
    return response.text


def _first_samples(text: str) -> dict[str, dict[str, float]]:
    """family -> sample name -> the first sample's value (vLLM reads the first of each name)."""
    families: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples.setdefault(sample.name, sample.value)
    return families


def test_metrics_counts(server, client, tokenizer):
    prompt_ids = tokenizer.encode(_PROMPT).ids
    num_requests = 10
    max_tokens = 10
    before = _first_samples(_metrics_text(server))

    for _ in range(num_requests):
        # sending a request triggers the metrics to be logged.
        client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=max_tokens)

    after = _first_samples(_metrics_text(server))
    # vLLM's loop, kept as is: only families named in EXPECTED_METRICS_V1 are checked
    for metric_family, suffix_values_list in _get_expected_values(num_requests, prompt_ids, max_tokens).items():
        if metric_family not in EXPECTED_METRICS_V1 or metric_family in HIDDEN_DEPRECATED_METRICS:
            continue
        assert metric_family in after, f"Did not find {metric_family} in prom endpoint"
        for suffix, expected_value in suffix_values_list:
            name = f"{metric_family}{suffix}"
            assert name in after[metric_family], f"Did not find {name} in prom endpoint"
            value = after[metric_family][name] - before.get(metric_family, {}).get(name, 0.0)
            assert value == expected_value, (
                f"{name} expected value of {expected_value} did not match found value {value}")


def test_metrics_exist(server, client):
    # sending a request triggers the metrics to be logged.
    client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=5, temperature=0.0)

    text = _metrics_text(server)
    for metric in EXPECTED_METRICS_V1:
        if metric in HIDDEN_DEPRECATED_METRICS:
            continue
        assert metric in text


def test_waiting_by_reason_and_request_preemptions(server, client, tokenizer):
    """vLLM's reasons, 'capacity' and 'deferred', add up to num_requests_waiting; every finished request is one
    observation of request_num_preemptions (none preempted in this pool)."""
    prompt_ids = tokenizer.encode(_PROMPT).ids
    num_requests = 3
    before = _first_samples(_metrics_text(server))
    for _ in range(num_requests):
        client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=2)
    text = _metrics_text(server)
    after = _first_samples(text)
    histogram = _name("vllm:request_num_preemptions")
    for suffix, expected in (("_count", num_requests), ("_sum", 0)):
        name = histogram + suffix
        assert after[histogram][name] - before.get(histogram, {}).get(name, 0.0) == expected, name
    by_reason = {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
                 if family.name == _name("vllm:num_requests_waiting_by_reason") for sample in family.samples}
    waiting = _name("vllm:num_requests_waiting")
    assert set(by_reason) == {"capacity", "deferred"}
    assert sum(by_reason.values()) == after[waiting][waiting]


def _get_running_metrics_from_api(server) -> tuple[float, float, float]:
    """(running, waiting, KV-cache usage)."""
    samples = _first_samples(_metrics_text(server))
    names = [_name("vllm:num_requests_running"), _name("vllm:num_requests_waiting"), _name("vllm:kv_cache_usage_perc")]
    values = tuple(samples.get(name, {}).get(name) for name in names)
    assert None not in values, values
    return values


def _poll(server, done, seconds: float = 60.0) -> tuple[float, float, float]:
    """The gauges once `done(gauges)` holds, or after `seconds` of polls (vLLM sleeps a fixed time)."""
    deadline = time.monotonic() + seconds
    gauges = _get_running_metrics_from_api(server)
    while not done(gauges) and time.monotonic() < deadline:
        time.sleep(0.05)
        gauges = _get_running_metrics_from_api(server)
    return gauges


def test_abort_metrics_reset(server, tokenizer):
    prompt_ids = tokenizer.encode(_PROMPT).ids

    running_requests, waiting_requests, kv_cache_usage = _get_running_metrics_from_api(server)
    # Expect no running requests or kvcache usage
    assert running_requests == 0
    assert waiting_requests == 0
    assert kv_cache_usage == 0.0

    async def start_then_abort() -> tuple[tuple, tuple]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0) as client:
            # long-running requests that we can abort
            tasks = [asyncio.create_task(client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=100,
                                                                   temperature=0.0)) for _ in range(3)]
            running = await asyncio.to_thread(_poll, server, lambda gauges: gauges[0] > 0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        after = await asyncio.to_thread(_poll, server, lambda gauges: not any(gauges))
        return running, after

    (running_requests, _, kv_cache_usage), after = asyncio.run(start_then_abort())
    # Expect running requests and kvcache usage
    assert running_requests > 0
    assert kv_cache_usage > 0

    running_requests_after, waiting_requests_after, kv_cache_usage_after = after
    assert running_requests_after == 0, f"Expected 0 running requests after abort, got {running_requests_after}"
    assert waiting_requests_after == 0, f"Expected 0 waiting requests after abort, got {waiting_requests_after}"
    assert kv_cache_usage_after == 0, f"Expected 0% KV cache usage after abort, got {kv_cache_usage_after}"
