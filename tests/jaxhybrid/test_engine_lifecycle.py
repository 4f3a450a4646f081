"""The engine under a long random workload: compiles once per bucket and never after warm-up, frees every
block and slot after aborts (mid-prefill, mid-decode, checkpoint producers with consumers waiting) and
preemptions, and turns bad input into an error for that request while the others finish."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from scheduler import CheckpointMarkerError
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, greedy_continuation, run_to_completion

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _compile_counter() -> list[str]:
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kwargs: compiled.append(event) if event == BACKEND_COMPILE else None)
    return compiled


def test_a_random_workload_compiles_nothing_after_warmup_and_frees_everything():
    """500 requests of mixed lengths, MTP on, prefix caching on, markers on shared anchors, aborts at
    random moments, a KV pool small enough to preempt: after `precompile`, no XLA compilation at all."""
    model = fixture_model("qwen3_next")
    engine = engine_for(model, k=2, ring_size=4, budget=64, num_blocks=20, num_state_slots=40,
                        token_buckets=(16, 64), logits_buckets=(16, 64))
    num_shapes = engine.precompile(progress=False)
    assert engine.runner.compiled_buckets() == num_shapes == 2  # T 16 with L 16; T 64 with L 64 (8 rows of 1 + K)
    compiled = _compile_counter()
    rng = np.random.default_rng(0)
    anchors = [tuple(int(t) for t in rng.integers(0, 256, 40)) for _ in range(4)]
    pending, aborted, steps = list(range(500)), 0, 0
    while (pending or engine.has_unfinished_requests()) and steps < 6000:
        for i in pending[:int(rng.integers(0, 6))]:
            marked = rng.random() < 0.3
            tail = tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(1, 60))))
            prompt = Prompt(anchors[i % 4] + tail, 32) if marked else Prompt(tail + (7,))
            engine.add_request(str(i), prompt, SamplingParams(temperature=float(rng.random() < 0.5),
                                                              max_tokens=int(rng.integers(0, 9)), ignore_eos=True))
        del pending[:6]
        running = list(engine.table.requests)
        if running and rng.random() < 0.15:  # an abort mid-prefill, mid-decode or of a producer
            engine.abort(running[int(rng.integers(len(running)))])
            aborted += 1
        engine.step()
        steps += 1
    assert not pending and steps < 6000
    run_to_completion(engine)  # nothing left; the pools are drained
    assert compiled == [] and engine.runner.compiled_buckets() == num_shapes
    assert aborted > 20 and engine.scheduler.num_preemptions > 0 and engine.stats.hit_copies > 0


def test_an_aborted_producer_hands_its_checkpoint_to_a_waiting_consumer():
    model = fixture_model("nemotron_h")
    engine = engine_for(model, budget=16)  # the producer needs two steps to reach its checkpoint at 32
    anchor = tuple(int(t) for t in np.random.default_rng(1).integers(0, 256, 40))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for name, extra in (("producer", (1, 2)), ("consumer", (3, 4, 5))):
        engine.add_request(name, Prompt(anchor + extra, 32), params)
    engine.step()
    final = engine.abort("producer")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    outputs = run_to_completion(engine)
    prompt = anchor + (3, 4, 5)
    assert outputs["consumer"].outputs[0].token_ids == greedy_continuation(model, prompt, 5)


def test_bad_requests_fail_alone():
    model = fixture_model("qwen3_next")
    engine = engine_for(model, budget=64)
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("before", Prompt(tuple(range(1, 20))), good)
    bad = [
        (Prompt(tuple(range(200))), good, "can never fit|max_model_len"),
        (Prompt((1, 2, 999)), good, r"'bad1': token id 999 is out of vocabulary \[0, 256\)"),
        (Prompt(tuple(range(1, 40)), 30), good, "checkpoint"),
        (Prompt(tuple(range(1, 20))), SamplingParams(logprobs=100), "max_logprobs"),
        (Prompt(tuple(range(1, 20))), SamplingParams(stop=("x",)), "tokenizer"),
    ]
    for i, (prompt, params, message) in enumerate(bad):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad{i}", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("before", Prompt((1, 2)), good)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    engine.add_request("after", Prompt(tuple(range(3, 30))), good)
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["after", "before"]
    assert outputs["after"].outputs[0].token_ids == greedy_continuation(model, tuple(range(3, 30)), 4)
    assert issubclass(CheckpointMarkerError, ValueError)


def test_a_failed_step_fails_the_started_requests_and_requeues_the_waiting():
    """A step that raises leaves unknown pools: the engine starts over. Requests it had started end with
    "error"; one still waiting is queued again and gives exactly its greedy continuation; nothing leaks."""
    model = fixture_model("qwen3_next")
    engine = engine_for(model, budget=64, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for name, start in (("a", 1), ("b", 2), ("waiting", 3)):
        engine.add_request(name, Prompt(tuple(range(start, start + 20))), params)
    engine.step()  # a and b run; max_num_seqs keeps "waiting" waiting
    step = engine.runner.dispatch

    def fail(plan, *args):
        engine.runner.dispatch = step
        raise RuntimeError("injected device failure")

    engine.runner.dispatch = fail
    failed = {o.request_id: o for o in engine.step()}
    assert sorted(failed) == ["a", "b"]
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in failed.values())
    assert engine.stats.failed_steps == 1
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["waiting"]
    assert outputs["waiting"].outputs[0].token_ids == greedy_continuation(model, tuple(range(3, 23)), 6)


def test_a_request_whose_output_fails_ends_alone():
    model = fixture_model("qwen3_next")
    engine = engine_for(model, budget=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("broken", Prompt(tuple(range(1, 20))), params)
    engine.add_request("fine", Prompt(tuple(range(2, 21))), params)
    engine.step()
    engine.table.sequences[engine.table.requests["broken"].sequences[0]].detokenizer = _Exploding()
    outputs = run_to_completion(engine)
    assert outputs["broken"].outputs[0].finish_reason == "error"
    assert outputs["fine"].outputs[0].token_ids == greedy_continuation(model, tuple(range(2, 21)), 5)


class _Exploding:
    def push(self, tokens):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    def flush(self):
        pass

    text = ""
