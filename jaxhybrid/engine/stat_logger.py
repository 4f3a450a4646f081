"""The lines a server operator reads: vLLM's periodic stats line (`LoggingStatLogger`) and its request log
(`--enable-log-requests`), from what the engine already counts (`EngineStats`, `Engine.load()`).

Both are called from the server's engine thread between steps, never from inside a step: a stats check is
one clock read, and a line costs a few subtractions of running totals every `interval` seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable

import jax

from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.stats import EngineLoad, EngineStats
from jaxhybrid.sample.params import SamplingParams

log = logging.getLogger("jaxhybrid.stats")
request_log = logging.getLogger("jaxhybrid.requests")

DEFAULT_INTERVAL = 10.0
_RECENT_REQUESTS = 1000  # vLLM's hit rates are over the most recent 1000 requests that looked the cache up


def log_stats_interval() -> float:
    """vLLM's VLLM_LOG_STATS_INTERVAL: seconds between stats lines (10 unless a positive number is set)."""
    try:
        interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL
    return interval if interval > 0 else DEFAULT_INTERVAL


class RecentHitRate:
    """Hits over queries of the most recent requests (vLLM's `CachingMetrics`): a long-running server's rate
    follows its current traffic rather than everything since start."""

    def __init__(self, max_requests: int = _RECENT_REQUESTS):
        self.max_requests = max_requests
        self._recent: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits) per observation
        self.requests = self.queries = self.hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if not requests:  # an empty interval would push useful ones out
            return
        self._recent.append((requests, queries, hits))
        self.requests, self.queries, self.hits = self.requests + requests, self.queries + queries, self.hits + hits
        while self.requests > self.max_requests and len(self._recent) > 1:
            old_requests, old_queries, old_hits = self._recent.popleft()
            self.requests -= old_requests
            self.queries -= old_queries
            self.hits -= old_hits

    @property
    def empty(self) -> bool:
        return not self.queries

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class StatLogger:
    """Every `interval` seconds, vLLM's stats line over the interval: prompt and generation throughput,
    running and waiting sequences (and the waiting ones deferred for their checkpoint), preemptions, KV-block
    and state-slot usage, prefix-cache and checkpoint hit rates; with MTP, vLLM's SpecDecoding line.

    As vLLM does, a line that says nothing new goes to DEBUG: no tokens computed in this interval nor in the
    one before, and the same running and waiting counts as the line before."""

    def __init__(self, num_spec_tokens: int = 0, interval: float | None = None, device: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`interval`: seconds between lines (default: `log_stats_interval()`); `device`: the KV cache's, as vLLM
        names it (default: JAX's backend: GPU, TPU or CPU)."""
        self.num_spec_tokens, self._clock = num_spec_tokens, clock
        self.device = device or jax.default_backend().upper()
        self.interval = log_stats_interval() if interval is None else interval
        self._last_time = clock()
        self._last = EngineStats()
        self._last_load = EngineLoad(0, 0, 0.0, 0.0, 0)  # a fresh engine's: a server that never serves stays quiet
        self._last_throughput = (0.0, 0.0)
        self.prefix_hits, self.checkpoint_hits = RecentHitRate(), RecentHitRate()

    def reset(self, stats: EngineStats, load: EngineLoad) -> None:
        """Start the interval now, from the engine's totals and load so far (a server's start)."""
        self._last_time, self._last, self._last_load = self._clock(), dataclasses.replace(stats), load

    def maybe_log(self, stats: EngineStats, load: EngineLoad) -> bool:
        """Log a line if `interval` has passed since the last one; returns whether it did (at any level)."""
        now = self._clock()
        if now - self._last_time < self.interval:
            return False
        self.log(stats, load, now)
        return True

    def log(self, stats: EngineStats, load: EngineLoad, now: float | None = None) -> None:
        """The line over the interval since the last one (or `reset`), which ends `now`."""
        now = self._clock() if now is None else now
        elapsed, last = max(now - self._last_time, 1e-9), self._last
        prompt = (stats.prefill_tokens - last.prefill_tokens) / elapsed
        generation = (stats.generation_tokens - last.generation_tokens) / elapsed
        preemptions = _gained(load.num_preemptions, self._last_load.num_preemptions)
        self.prefix_hits.observe(stats.prefix_cache_requests - last.prefix_cache_requests,
                                 stats.prefix_cache_queries - last.prefix_cache_queries,
                                 stats.cached_tokens - last.cached_tokens)
        checkpoint_queries = stats.checkpoint_queries - last.checkpoint_queries
        self.checkpoint_hits.observe(checkpoint_queries, checkpoint_queries,
                                     stats.checkpoint_hits - last.checkpoint_hits)
        idle = not any((prompt, generation, *self._last_throughput)) and load[:2] == self._last_load[:2]
        log_fn = log.debug if idle else log.info
        parts, values = self._line(prompt, generation, load, preemptions)
        log_fn("Engine 000: " + ", ".join(parts), *values)
        self._log_spec_decoding(stats, elapsed, log_fn)
        self._last_time, self._last, self._last_load = now, dataclasses.replace(stats), load
        self._last_throughput = (prompt, generation)

    def _line(self, prompt: float, generation: float, load: EngineLoad, preemptions: int) -> tuple[list, list]:
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        values: list = [prompt, generation, load.running, load.waiting]
        if load.deferred:
            parts.append("Deferred: %d reqs")
            values.append(load.deferred)
        if preemptions:
            parts.append("Preemptions: %d")
            values.append(preemptions)
        parts += ["%s KV cache usage: %.1f%%", "State slot usage: %.1f%%"]
        values += [self.device, load.kv_cache_usage * 100, load.state_slot_usage * 100]
        if not self.prefix_hits.empty:
            parts.append("Prefix cache hit rate: %.1f%%")
            values.append(self.prefix_hits.rate * 100)
        if not self.checkpoint_hits.empty:
            parts.append("Checkpoint hit rate: %.1f%%")
            values.append(self.checkpoint_hits.rate * 100)
        return parts, values

    def _log_spec_decoding(self, stats: EngineStats, elapsed: float, log_fn: Callable) -> None:
        """vLLM's SpecDecoding line, for an interval with MTP drafts (without its per-position rates, which
        the engine does not count)."""
        drafted = stats.draft_tokens - self._last.draft_tokens
        if not self.num_spec_tokens or not drafted:
            return
        accepted = stats.accepted_tokens - self._last.accepted_tokens
        log_fn("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
               "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
               "Avg Draft acceptance rate: %.1f%%", 1 + accepted / (drafted / self.num_spec_tokens),
               accepted / elapsed, drafted / elapsed, accepted, drafted, accepted / drafted * 100)


def _gained(total: int, last: int) -> int:
    """What a running total gained since `last`; a total that went back (the engine started over with a fresh
    scheduler) counts from zero."""
    return total - last if total >= last else total


class RequestLogger:
    """vLLM's `--enable-log-requests`: a line when a request arrives (its prompt's length, its sampling
    parameters and its text cut to `max_log_len` characters) and one when it finishes."""

    def __init__(self, max_log_len: int | None = None):
        self.max_log_len = max_log_len

    def log_received(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        if not request_log.isEnabledFor(logging.INFO):
            return
        text = prompt.text
        if text is not None and self.max_log_len is not None:
            text = text[:self.max_log_len]
        request_log.info("Received request %s: prompt: %r, prompt_tokens: %d, params: %s", request_id, text,
                         len(prompt.token_ids), params)

    def log_finished(self, output: RequestOutput) -> None:
        if not request_log.isEnabledFor(logging.INFO):
            return
        reasons = ",".join(str(c.finish_reason) for c in output.outputs)
        generated = sum(len(c.token_ids) for c in output.outputs)
        request_log.info("Finished request %s: finish_reason: %s, prompt_tokens: %d, generation_tokens: %d, "
                         "cached_tokens: %d", output.request_id, reasons, len(output.prompt_token_ids), generated,
                         output.num_cached_tokens)
