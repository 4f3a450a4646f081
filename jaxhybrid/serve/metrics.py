"""Prometheus series for the server, under vLLM's names with the `jaxhybrid:` prefix, plus the hybrid ones:
state-slot usage, state-page hits and checkpoint hits.

Gauges are set from `Engine.load()` after every step; counters follow `EngineStats` (the engine's running
totals, so a counter can never drift from what the engine did); histograms are observed per request
from its `RequestMetrics` when it finishes, per streamed step for inter-token latency, and per engine step
for the tokens it computed.
"""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.stats import EngineLoad, EngineStats
from jaxhybrid.sample.params import SamplingParams
from scheduler import SchedulerConfig

PREFIX = "jaxhybrid:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's: never and once preempted share the first
# vLLM's reasons a sequence waits: for capacity (rows, budget, memory), or deferred by a transient constraint,
# which here is a checkpoint whose producer has not computed it yet
WAITING_CAPACITY, WAITING_DEFERRED = "capacity", "deferred"
# EngineStats field -> counter (name, help); vLLM's names where the concept is theirs
_COUNTERS = {
    "prefill_tokens": ("prompt_tokens", "Prompt tokens computed (prefix hits excluded)."),
    "generation_tokens": ("generation_tokens", "Generated tokens."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "cached_tokens": ("prefix_cache_hits", "Prompt tokens served from the prefix cache or a checkpoint."),
    "checkpoint_queries": ("checkpoint_queries", "Requests with a checkpoint marker, first scheduled."),
    "checkpoint_hits": ("checkpoint_hits", "... of them started from a stored checkpoint state."),
    "hit_copies": ("state_hit_copies", "Recurrent state pages copied in for a prefix or checkpoint hit."),
    "pair_copies": ("checkpoint_pairings", "Consumers run in the same step as their checkpoint's producer."),
    "steps": ("engine_steps", "Engine steps run."),
    "failed_steps": ("engine_failed_steps", "Engine steps that raised (the engine started over)."),
    "draft_tokens": ("spec_decode_num_draft_tokens", "MTP draft tokens verified."),
    "accepted_tokens": ("spec_decode_num_accepted_tokens", "MTP draft tokens accepted."),
}


def cache_config_info(config: SchedulerConfig) -> dict[str, str]:
    """The labels of `cache_config_info`: vLLM's (block_size, num_gpu_blocks, kv_cache_size_tokens) and the
    hybrid's (state slots, the ReplaySSM window, the MTP drafts)."""
    num_gpu_blocks = config.num_blocks - 1  # block 0 is the null block
    return {"block_size": str(config.block_size), "mamba_block_size": str(config.mamba_block_size),
            "cache_mode": config.cache_mode, "num_gpu_blocks": str(num_gpu_blocks),
            "kv_cache_size_tokens": str(num_gpu_blocks * config.block_size),
            "num_state_slots": str(config.num_state_slots - 1), "replayssm_window": str(config.ring_size),
            "num_speculative_tokens": str(config.num_spec_tokens)}


def _power_buckets(limit: int) -> list[int]:
    """1-2-5 buckets up to `limit` (vLLM's request token histograms)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class ServerMetrics:
    """Every series of one server, in its own registry (so several servers can live in one process)."""

    def __init__(self, model_name: str, max_model_len: int, num_spec_tokens: int, cache_info: dict[str, str]):
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        waiting_by_reason = Gauge(PREFIX + "num_requests_waiting_by_reason",
                                  "Waiting sequences by reason: 'capacity' = waiting for scheduling capacity; "
                                  "'deferred' = waiting for their checkpoint's producer. Sum of all reasons equals "
                                  f"{PREFIX}num_requests_waiting.", names + ["reason"], registry=registry)
        self.waiting_capacity = waiting_by_reason.labels(**labels, reason=WAITING_CAPACITY)
        self.waiting_deferred = waiting_by_reason.labels(**labels, reason=WAITING_DEFERRED)
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).")
        self.state_slot_usage = gauge("state_slot_usage_perc", "Fraction of state slots held by requests (0-1).")
        info = Gauge(PREFIX + "cache_config_info", "Cache configuration (labels).", list(cache_info),
                     registry=registry)
        info.labels(**cache_info).set(1)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Running requests preempted.", names,
                                   registry=registry).labels(**labels)
        self.counters = {field: Counter(PREFIX + name, doc, names, registry=registry).labels(**labels)
                         for field, (name, doc) in _COUNTERS.items()}
        self.drafts = Counter(PREFIX + "spec_decode_num_drafts", "MTP verify rows.", names,
                              registry=registry).labels(**labels)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                names + ["finished_reason"], registry=registry)
        self.disconnects = Counter(PREFIX + "http_requests_client_disconnected", "Clients gone before the end.",
                                   names, registry=registry).labels(**labels)
        self.rejected = Counter(PREFIX + "num_requests_rejected", "Requests refused because the queue was full.",
                                names, registry=registry).labels(**labels)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens.",
                             _TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Per request: decode time / (tokens - 1).",
                              _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                        _LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          _ITERATION_TOKEN_BUCKETS)
        self.request_preemptions = histogram("request_num_preemptions",
                                             "Per request: the times its sequences were preempted.",
                                             _PREEMPTION_BUCKETS)
        self.params_n = histogram("request_params_n", "The n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter (when set).",
                                           _power_buckets(max_model_len))
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Per request: the most tokens one of its n completions generated.",
                                               _power_buckets(max_model_len))
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                       _power_buckets(max_model_len))
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                           _power_buckets(max_model_len))
        self._labels, self._num_spec_tokens = labels, num_spec_tokens
        self._stats = EngineStats()
        self._preemptions = 0

    def observe_engine(self, load: EngineLoad, stats: EngineStats) -> None:
        """After a step: gauges from the load, counters advanced by what the engine's totals gained."""
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.waiting_capacity.set(load.waiting - load.deferred)
        self.waiting_deferred.set(load.deferred)
        self.kv_cache_usage.set(load.kv_cache_usage)
        self.state_slot_usage.set(load.state_slot_usage)
        # a scheduler started over (after a failed step) counts from zero again
        previous = self._preemptions if load.num_preemptions >= self._preemptions else 0
        self.preemptions.inc(load.num_preemptions - previous)
        self._preemptions = load.num_preemptions
        while stats.step_tokens:  # the engine's output thread appends; only this thread takes
            self.iteration_tokens.observe(stats.step_tokens.popleft())
        for field, counter in self.counters.items():
            gained = getattr(stats, field) - getattr(self._stats, field)
            if gained:
                counter.inc(gained)
        if self._num_spec_tokens:  # each verify row checks K drafts
            self.drafts.inc((stats.draft_tokens - self._stats.draft_tokens) // self._num_spec_tokens)
        self._stats = dataclasses.replace(stats)

    def observe_finished(self, output: RequestOutput, params: SamplingParams | None = None) -> None:
        """A finished (or aborted) request; each phase only once the engine has timed both its ends."""
        metrics = output.metrics
        for completion in output.outputs:
            self._success.labels(**self._labels, finished_reason=completion.finish_reason).inc()
        self.e2e.observe(time.time() - metrics.arrival_time)
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        longest = max(len(c.token_ids) for c in output.outputs)
        self.max_generation_tokens.observe(longest)
        self.request_preemptions.observe(metrics.num_preemptions)
        if params is not None:
            self.params_n.observe(params.n)
            if params.max_tokens is not None:
                self.params_max_tokens.observe(params.max_tokens)
        scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
        if scheduled is not None:
            self.queue.observe(scheduled - metrics.arrival_time)
        if first is not None:
            self.ttft.observe(first - metrics.arrival_time)
            self.decode_time.observe(last - first)
            if scheduled is not None:
                self.prefill_time.observe(first - scheduled)
                self.inference_time.observe(last - scheduled)
            if longest > 1:
                self.tpot.observe((last - first) / (longest - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
