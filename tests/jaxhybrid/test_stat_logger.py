"""The operator's lines and the wait/preemption accounting behind two of vLLM's series: the stats line's numbers
over its interval, DEBUG for a line with nothing new, the request log, the per-request preemptions the engine
attributes after a schedule (against the scheduler's own preemptions), and the series that export them."""

from __future__ import annotations

import importlib
import logging
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxhybrid.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.stat_logger import RecentHitRate, RequestLogger, StatLogger, log_stats_interval
from jaxhybrid.engine.stats import EngineLoad, EngineStats, count_preemptions
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve.metrics import ServerMetrics
from scheduler.sim import simulate
from scheduler.sim.simulator import Workload, run_seed

# the modules, not the package's functions of the same names
EVENTS, PASS_STATE, SCHEDULE = (importlib.import_module(f"scheduler.{name}") for name in ("events", "pass_state",
                                                                                          "schedule"))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stats_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "jaxhybrid.stats" and "Avg prompt throughput" in r.getMessage()]


def test_the_stats_line_reports_the_interval(caplog):
    clock, stats = Clock(), EngineStats(prefill_tokens=500, generation_tokens=40)  # before the logger started
    logger = StatLogger(interval=10.0, device="GPU", clock=clock)
    logger.reset(stats, EngineLoad(0, 0, 0.0, 0.0, num_preemptions=4))
    stats.prefill_tokens += 300
    stats.generation_tokens += 50
    stats.prefix_cache_requests, stats.prefix_cache_queries, stats.cached_tokens = 3, 400, 100
    stats.checkpoint_queries, stats.checkpoint_hits = 4, 3
    load = EngineLoad(running=2, waiting=5, kv_cache_usage=0.25, state_slot_usage=0.5, num_preemptions=5, deferred=2)
    caplog.set_level(logging.INFO, "jaxhybrid.stats")
    clock.now = 9.9
    assert not logger.maybe_log(stats, load)  # within the interval: one clock read, nothing else
    clock.now = 10.0
    assert logger.maybe_log(stats, load)
    (record,) = stats_lines(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "Engine 000: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 5 reqs, Deferred: 2 reqs, Preemptions: 1, GPU KV cache usage: 25.0%, State slot usage: 50.0%, "
        "Prefix cache hit rate: 25.0%, Checkpoint hit rate: 75.0%")


def test_a_line_with_nothing_new_goes_to_debug(caplog):
    clock, stats = Clock(), EngineStats()
    logger = StatLogger(interval=1.0, device="CPU", clock=clock)
    caplog.set_level(logging.DEBUG, "jaxhybrid.stats")
    idle = EngineLoad(0, 0, 0.0, 0.0, 0)
    levels = []
    for step, (tokens, load) in enumerate([(0, idle), (10, idle), (0, idle), (0, idle), (0, idle._replace(waiting=3)),
                                           (0, idle._replace(waiting=3))]):
        stats.generation_tokens += tokens
        clock.now = step + 1.0
        logger.maybe_log(stats, load)
        levels.append(stats_lines(caplog)[-1].levelno)
    # idle from the start; tokens; the interval after tokens (its throughput was not zero); idle; a new queue; the same
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO, logging.DEBUG, logging.INFO, logging.DEBUG]


def test_mtp_intervals_add_vllms_spec_decoding_line(caplog):
    clock, stats = Clock(), EngineStats()
    logger = StatLogger(num_spec_tokens=2, interval=2.0, device="GPU", clock=clock)
    caplog.set_level(logging.INFO, "jaxhybrid.stats")
    stats.draft_tokens, stats.accepted_tokens, stats.generation_tokens = 20, 15, 25  # 10 verify rows of 2 drafts
    clock.now = 2.0
    logger.maybe_log(stats, EngineLoad(1, 0, 0.1, 0.1, 0))
    spec = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding")]
    assert spec == ["SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 7.50 tokens/s, "
                    "Drafted throughput: 10.00 tokens/s, Accepted: 15 tokens, Drafted: 20 tokens, "
                    "Avg Draft acceptance rate: 75.0%"]


def test_hit_rates_follow_the_most_recent_requests():
    rate = RecentHitRate(max_requests=10)
    assert rate.empty
    rate.observe(10, 100, 100)
    rate.observe(0, 0, 0)  # an interval without lookups keeps the window
    assert rate.rate == 1.0
    rate.observe(10, 100, 0)  # the first 10 fall out
    assert (rate.requests, rate.rate) == (10, 0.0)


@pytest.mark.parametrize("value, interval", [(None, 10.0), ("2.5", 2.5), ("0", 10.0), ("x", 10.0)])
def test_the_interval_is_vllms_environment_variable(monkeypatch, value, interval):
    if value is None:
        monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
    assert log_stats_interval() == interval


def _output(num_preemptions: int = 0) -> RequestOutput:
    return RequestOutput("r-1", "hi", [1, 2, 3], None, [CompletionOutput(0, "ab", [7, 8], None, None, "length")], True,
                         RequestMetrics(arrival_time=0.0, num_preemptions=num_preemptions), num_cached_tokens=2)


def test_the_request_log_cuts_the_prompt_and_reports_the_end(caplog):
    caplog.set_level(logging.INFO, "jaxhybrid.requests")
    logger = RequestLogger(max_log_len=5)
    logger.log_received("r-1", Prompt((1, 2, 3), text="hello world"), SamplingParams(max_tokens=2))
    logger.log_finished(_output())
    received, finished = (r.getMessage() for r in caplog.records)
    assert received.startswith("Received request r-1: prompt: 'hello', prompt_tokens: 3, params: SamplingParams(")
    assert "max_tokens=2" in received
    assert finished == ("Finished request r-1: finish_reason: length, prompt_tokens: 3, generation_tokens: 2, "
                        "cached_tokens: 2")


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}


def test_waiting_by_reason_and_request_preemptions_series():
    metrics = ServerMetrics("m", 128, 0, {"cache_mode": "align"})
    metrics.observe_engine(EngineLoad(2, 5, 0.5, 0.5, 3, deferred=2), EngineStats())
    metrics.observe_finished(_output(num_preemptions=0))
    metrics.observe_finished(_output(num_preemptions=2))
    samples = _samples(metrics)
    waiting = "jaxhybrid:num_requests_waiting_by_reason"
    assert samples[(waiting, (("model_name", "m"), ("reason", "capacity")))] == 3
    assert samples[(waiting, (("model_name", "m"), ("reason", "deferred")))] == 2
    preemptions = "jaxhybrid:request_num_preemptions"
    assert samples[(preemptions + "_count", (("model_name", "m"),))] == 2
    assert samples[(preemptions + "_sum", (("model_name", "m"),))] == 2
    assert samples[(preemptions + "_bucket", (("le", "1.0"), ("model_name", "m")))] == 1
    assert samples[(preemptions + "_bucket", (("le", "2.0"), ("model_name", "m")))] == 2
    # a scheduler that started over counts its preemptions from zero; the counter only grows
    metrics.observe_engine(EngineLoad(0, 0, 0.0, 0.0, 1), EngineStats())
    assert _samples(metrics)[("jaxhybrid:num_preemptions_total", (("model_name", "m"),))] == 4


class _Table:
    """`RequestTable.sequences` for the simulator's sequences: one request (and its metrics) per sequence."""

    def __init__(self):
        self.sequences: dict[str, types.SimpleNamespace] = {}

    def add(self, sequence_id: str) -> types.SimpleNamespace:
        return self.sequences.setdefault(sequence_id, types.SimpleNamespace(request=types.SimpleNamespace(
            metrics=RequestMetrics(arrival_time=0.0))))


def test_preemptions_are_attributed_to_the_sequences_the_scheduler_preempted(monkeypatch):
    """Memory pressure in the simulator; every sequence the scheduler's `preempt` took, against the ones
    `count_preemptions` finds from the running queues before and after each schedule."""
    preempted, table = {}, _Table()
    real_preempt, real_schedule = SCHEDULE.preempt, EVENTS.schedule

    def recording_preempt(edit, request_id):
        preempted[request_id] = preempted.get(request_id, 0) + 1
        real_preempt(edit, request_id)

    def attributing_schedule(state):
        running, num_preemptions = state.running, state.num_preemptions
        for sequence_id in running:
            table.add(sequence_id)
        state, plan = real_schedule(state)
        count_preemptions(running, state, num_preemptions, table)
        return state, plan

    monkeypatch.setattr(SCHEDULE, "preempt", recording_preempt)
    monkeypatch.setattr(PASS_STATE, "preempt", recording_preempt)
    monkeypatch.setattr(EVENTS, "schedule", attributing_schedule)
    args = simulate.parse_args(["--num-blocks", "70", "--num-state-slots", "8", "--max-num-seqs", "8"])
    report = run_seed(simulate.config_from(args), Workload(steps=120), seed=3)
    attributed = {sequence_id: entry.request.metrics.num_preemptions
                  for sequence_id, entry in table.sequences.items() if entry.request.metrics.num_preemptions}
    assert report.ok and sum(preempted.values()) > 0
    assert attributed == preempted

