"""Compiling the buckets on a worker thread while the engine steps (`Engine.start_background_compile`): the
worker covers every bucket, a step whose bucket is not compiled yet compiles that one or waits for the
worker's compile of it, no bucket is compiled twice, and the outputs are a precompiled engine's.

The tests that count compiles hand the runner the executables a precompiled engine of the same config built
(`_reuse_executables`): what they check is which thread compiles which bucket and how often, not XLA."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.worker.buckets import padding_plan, plan_shapes
from jaxhybrid.worker.runner import COMPILE_THREAD, BackgroundCompile
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, run_to_completion

# test_engine_lifecycle.py's engine: 2 buckets (T 16 with L 16, T 64 with L 64), compiled once per session
CONFIG = dict(k=2, ring_size=4, budget=64, num_blocks=20, num_state_slots=40, token_buckets=(16, 64),
              logits_buckets=(16, 64))
DECODE, PREFILL = 0, 1  # the buckets' places in plan_shapes
LONG_PROMPT = Prompt(tuple(range(3, 43)))  # 40 tokens: prefilled in the T 64 bucket, decoded in T 16


@pytest.fixture(scope="module")
def precompiled() -> Engine:
    engine = engine_for(fixture_model("qwen3_next"), seed=1, **CONFIG)
    engine.precompile(progress=False)
    return engine


def _reuse_executables(engine: Engine, precompiled: Engine) -> list[tuple[str, object]]:
    """`engine`'s compiles take `precompiled`'s executables; returns the (thread, layout) of each compile."""
    compiles, executables = [], precompiled.runner._executables

    def lowered(layout):
        compiles.append((threading.current_thread().name, layout))
        return SimpleNamespace(compile=lambda: executables[layout])

    engine.runner._lowered = lowered
    return compiles


def _add_requests(engine: Engine) -> None:
    engine.add_request("greedy", LONG_PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2))
    engine.add_request("sampled", Prompt((5, 6, 7)), SamplingParams(temperature=1.0, seed=3, max_tokens=5,
                                                                    ignore_eos=True))


def _outputs(engine: Engine, async_scheduling: bool) -> dict:
    engine.async_scheduling = async_scheduling
    engine.reset_prefix_cache()  # each run computes its prompts afresh
    _add_requests(engine)
    return {request_id: (output.outputs[0].token_ids, output.outputs[0].logprobs)
            for request_id, output in run_to_completion(engine).items()}


def test_a_step_compiles_its_bucket_or_waits_for_the_worker_and_no_bucket_compiles_twice(precompiled):
    """The worker walks T 64, then T 16, and is held inside its compile of T 64. A step in T 16, which nobody
    compiles yet, compiles it on the engine's thread; a step in T 64 waits for the worker's compile of it;
    the worker then finds T 16 compiled and moves on."""
    engine = engine_for(fixture_model("qwen3_next"), **CONFIG)
    runner, config = engine.runner, engine.config
    compiles = _reuse_executables(engine, precompiled)
    shapes = plan_shapes(config)
    decode, prefill = (runner._layout_of(shape) for shape in shapes)
    held, release = threading.Event(), threading.Event()
    lowered = runner._lowered

    def held_while_prefill_compiles(layout):
        if layout == prefill:
            held.set()
            release.wait(30)
        return lowered(layout)

    runner._lowered = held_while_prefill_compiles
    worker = BackgroundCompile(runner, shapes[::-1])
    worker.start()
    assert held.wait(30)
    runner.step(padding_plan(config, *shapes[DECODE]))
    busy = []  # what the watchdog can read while the step waits

    def release_once_the_step_waits():
        deadline = time.monotonic() + 30
        while not runner.step_compiling and time.monotonic() < deadline:
            time.sleep(0.01)
        busy.append(runner.step_compiling)
        release.set()

    threading.Thread(target=release_once_the_step_waits).start()
    runner.step(padding_plan(config, *shapes[PREFILL]))  # waits for the worker
    worker.join(30)

    assert not worker.is_alive() and worker.error is None
    assert sorted(compiles) == sorted([(COMPILE_THREAD, prefill), (threading.main_thread().name, decode)])  # once
    assert runner.compiled_buckets() == runner.compiles == 2 and worker.compiled == 1
    assert busy == [True] and not runner.step_compiling


def test_the_worker_stops_before_the_memory_maps_run_out_and_steps_still_compile(precompiled, monkeypatch):
    """After its first compile the worker projects the maps of the rest (`check_maps_suffice`): past the
    limit it stops with that error, and the buckets left compile when a step needs them."""
    engine = engine_for(fixture_model("qwen3_next"), **CONFIG)
    compiles = _reuse_executables(engine, precompiled)
    readings = iter([(1000, 2000), (1600, 2000)])  # 600 maps per compiled step, 1 more to come
    monkeypatch.setattr("jaxhybrid.worker.runner.memory_maps", lambda: next(readings))
    worker = engine.start_background_compile()
    worker.join(30)
    assert isinstance(worker.error, RuntimeError) and "vm.max_map_count" in str(worker.error)
    assert engine.runner.compiled_buckets() == 1
    engine.add_request("a", LONG_PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(run_to_completion(engine)["a"].outputs[0].token_ids) == 2
    assert [thread for thread, _ in compiles] == [COMPILE_THREAD, threading.main_thread().name]


def test_outputs_with_a_background_compile_equal_a_precompiled_engine(precompiled):
    """Compiled for real on the worker: one step ahead and serial, the tokens and logprobs of a precompiled
    engine, and every bucket compiled once."""
    engine = engine_for(fixture_model("qwen3_next"), seed=1, **CONFIG)
    worker = engine.start_background_compile()
    for async_scheduling in (True, False):
        assert _outputs(engine, async_scheduling) == _outputs(precompiled, async_scheduling), async_scheduling
    worker.join(60)
    assert worker.error is None and engine.runner.compiled_buckets() == engine.runner.compiles == 2
