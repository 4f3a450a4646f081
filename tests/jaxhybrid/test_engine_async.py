"""One step ahead of the device (scheduler/resolve.py) on the embedded model, with and without MTP drafts: a
request that ends by eos, a stop token, a stop string or max_tokens emits exactly what the serial loop emits
(the end is noticed one step late, and the tokens computed past it never leak out), and an abort while a
step is in flight frees everything once that step has completed. Output processing (detokenization, stop
strings) runs on the output thread while steps are dispatched."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.engine.core import OUTPUT_THREAD
from scheduler.sim.invariants import check_drained
from tests.jaxhybrid.engine_helpers import ANCHOR, CANDIDATES

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=[0, 3], ids=["K=0", "K=3"])
def llm(request):
    """The embedded model without drafts, and with its MTP head drafting 3 (a stop may fall inside the run of
    drafts a step accepted, which the host learns a step late)."""
    k = request.param
    return LLM(num_blocks=128, num_state_slots=40, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
               mamba_block_size=16, token_buckets=(64,), row_buckets=(4,),
               speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)


def generate(llm, ahead: bool, prompts, params):
    llm.engine.async_scheduling = ahead  # nothing is in flight between generate calls
    return llm.generate(prompts, params, use_tqdm=False)


def test_every_way_of_ending_emits_what_the_serial_loop_emits(llm, monkeypatch):
    prompts = [ANCHOR + c for c in CANDIDATES]
    greedy = dict(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    free = [o.outputs[0] for o in generate(llm, False, prompts, SamplingParams(**greedy))]
    eos = free[0].token_ids[5]  # the eos of this run: the first prompt meets it at its sixth token
    monkeypatch.setattr(llm.model, "config", dataclasses.replace(llm.model.config, eos_token_id=(eos,)))
    endings, expected = [], []
    for prompt, out in zip(prompts, free, strict=True):
        stop_token, stop_text = out.token_ids[3], out.text[len(out.text) // 2:len(out.text) // 2 + 3]
        endings += [(prompt, SamplingParams(**{**greedy, "ignore_eos": False})),
                    (prompt, SamplingParams(**greedy, stop_token_ids=[stop_token])),
                    (prompt, SamplingParams(**greedy, stop=[stop_text])),
                    (prompt, SamplingParams(**{**greedy, "max_tokens": 7}))]
        cut = out.token_ids.index(eos) + 1 if eos in out.token_ids else NEW_TOKENS
        expected += [out.token_ids[:cut], out.token_ids[:out.token_ids.index(stop_token) + 1], None,
                     out.token_ids[:7]]
    prompts, params = [p for p, _ in endings], [s for _, s in endings]
    serial = [o.outputs[0] for o in generate(llm, False, prompts, params)]
    ahead = [o.outputs[0] for o in generate(llm, True, prompts, params)]
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in ahead] == [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in serial]
    for out, want, param in zip(ahead, expected, params, strict=True):
        if want is not None:
            assert out.token_ids == want
        if param.stop:  # the text ends right before the stop string
            assert out.finish_reason == "stop" and out.stop_reason == param.stop[0] and param.stop[0] not in out.text
    assert ahead[0].finish_reason == "stop" and ahead[0].token_ids[-1] == eos and ahead[0].stop_reason is None
    assert ahead[3].finish_reason == "length" and len(ahead[3].token_ids) == 7
    assert not check_drained(llm.engine.scheduler)
    assert (llm.engine.stats.accepted_tokens > 0) == bool(llm.engine.config.num_spec_tokens)


def test_an_abort_while_a_step_is_in_flight_frees_everything_once_it_completes(llm):
    engine = llm.engine
    engine.async_scheduling = True
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, candidate in enumerate(CANDIDATES[:3]):
        engine.add_request(f"abort-{i}", llm.parse_prompt(ANCHOR + candidate), params)
    seen = {}
    for _ in range(8):  # prefills (64 tokens a step), then decode steps
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    assert engine.on_device and len(seen) == 3 and min(seen.values()) > 0
    aborted = [engine.abort(f"abort-{i}") for i in range(3)]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    assert engine.has_unfinished_requests()  # the step in flight still runs them
    assert engine.step() == []  # it completes: its tokens are dropped
    assert not engine.has_unfinished_requests() and not engine.on_device
    assert not check_drained(engine.scheduler) and engine.load()[:4] == (0, 0, 0.0, 0.0)


def test_detokenization_runs_on_the_output_thread_while_steps_run(llm, monkeypatch):
    """Every decode before the last dispatch happens on the output thread (the engine's thread processes
    outputs itself only once nothing runs: the last step's)."""
    engine = llm.engine
    engine.async_scheduling = True
    decoded_on, decode, dispatch = [], engine.tokenizer.decode, engine.runner.dispatch
    decodes_at_dispatch = []

    def recording_decode(*args, **kwargs):
        decoded_on.append(threading.current_thread().name)
        return decode(*args, **kwargs)

    def recording_dispatch(plan, *args):
        decodes_at_dispatch.append(len(decoded_on))
        return dispatch(plan, *args)

    monkeypatch.setattr(engine.tokenizer, "decode", recording_decode)
    monkeypatch.setattr(engine.runner, "dispatch", recording_dispatch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([ANCHOR + c for c in CANDIDATES[:3]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS and o.outputs[0].text for o in outputs)
    before_last_dispatch = decoded_on[:decodes_at_dispatch[-1]]
    assert before_last_dispatch and set(before_last_dispatch) == {f"{OUTPUT_THREAD}_0"}


def test_output_processing_that_outlasts_a_step_holds_up_nothing_and_an_abort_outdates_it(llm, monkeypatch):
    """The output thread is held inside a decode: `step()` returns meanwhile (the outputs come with a later
    step), an abort then waits for that processing, and the snapshot it made of the aborted request never
    reaches the caller after the abort's final output."""
    engine, gate, entered = llm.engine, threading.Event(), threading.Event()
    settled = threading.Event()  # the output thread is held in a decode, or has finished the step it was handed
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [ANCHOR + c for c in CANDIDATES[:2]]
    serial = generate(llm, False, prompts, params)
    decode = engine.tokenizer.decode

    def gated_decode(*args, **kwargs):
        if threading.current_thread().name.startswith(OUTPUT_THREAD) and not gate.is_set():
            entered.set()
            settled.set()
            assert gate.wait(60), "the engine's thread waited for the output thread"
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "decode", gated_decode)
    engine.async_scheduling = True
    for name, prompt in zip("kept aborted".split(), prompts, strict=True):
        engine.add_request(name, llm.parse_prompt(prompt), params)
    for _ in range(8):  # bounded: prefills, then the first decode steps
        settled.clear()
        assert engine.step() == []  # nothing is processed yet: the output thread stops at its first decode
        handed = engine.processing  # the step handed to the output thread as this one was dispatched
        if handed is not None:  # however slowly that thread runs: it is held, or done, before the next step
            handed.add_done_callback(lambda _: settled.set())
            assert settled.wait(60)
        if entered.is_set():
            break
    assert entered.is_set() and not gate.is_set()  # step() returned while the output thread was held
    gate.set()
    final = engine.abort("aborted")
    assert final.finished and final.outputs[0].finish_reason == "abort" and final.outputs[0].token_ids
    seen = {"kept": [], "aborted": []}
    for _ in range(4 * NEW_TOKENS):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            seen[output.request_id].append(output)
    assert seen["aborted"] == []
    assert seen["kept"][-1].outputs[0].token_ids == serial[0].outputs[0].token_ids
    assert seen["kept"][-1].outputs[0].text == serial[0].outputs[0].text
    assert not check_drained(engine.scheduler) and engine.load()[:4] == (0, 0, 0.0, 0.0)
