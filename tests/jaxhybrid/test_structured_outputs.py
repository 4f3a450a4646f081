"""Structured outputs through the engine on the embedded model, whose text is random by design, so the grammar
must carry every output: each output is checked by an independent matcher (and `json.loads`/`jsonschema`),
greedy output is the same for K = 0, 1, 3, serially and one step ahead, constrained and unconstrained rows
share steps (the unconstrained ones still equal the full forward's continuation), preemption and abort keep
each grammar right, and a step with no constrained row runs the one-program step it always ran."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams
from jaxhybrid.structured_output import GrammarCompiler
from tests.jaxhybrid.engine_helpers import (
    default_model,
    default_tokenizer,
    engine_for,
    greedy_continuation,
    run_to_completion,
)

CAR = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 8},
                                        "model": {"type": "string", "maxLength": 8},
                                        "car_type": {"type": "string", "enum": ["sedan", "SUV", "Truck", "Coupe"]}},
       "required": ["brand", "model", "car_type"], "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=CAR, disable_any_whitespace=True),
    "choice": StructuredOutputsParams(choice=("red", "green", "blue")),
    "regex": StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-z]{3}"),
    "grammar": StructuredOutputsParams(grammar='start: "(" item "," item ")"\nitem: /[a-z]{1,3}/'),
}
PROMPTS = ["Describe a car as JSON:", "def colour():\n    return", "Order number:", "A tuple of words:"]


@functools.cache
def compiler() -> GrammarCompiler:
    config = default_model().config
    return GrammarCompiler(default_tokenizer().to_json(), config.vocab_size, config.eos_token_id)


def prompt(text: str) -> Prompt:
    return Prompt(tuple(default_tokenizer().encode(text)), text=text)


def check_output(name: str, text: str) -> None:
    """The output satisfies its constraint, by an implementation other than the engine's matcher."""
    if name == "json":
        jsonschema.validate(json.loads(text), CAR)
    elif name == "choice":
        assert text in ("red", "green", "blue"), text
    else:
        matcher = compiler().compile(CONSTRAINTS[name])
        tokens = default_tokenizer().encode(text)
        assert matcher.consume_tokens(tokens) and matcher.is_accepting(), text


def run(engine, constraints: dict[str, StructuredOutputsParams | None], temperature: float = 0.0,
        max_tokens: int = 48, seed: int = 0, n: int = 1, prompts: list[str] = PROMPTS) -> dict[str, list[list[int]]]:
    for i, (name, constraint) in enumerate(constraints.items()):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, n=n,
                                structured_outputs=constraint)
        engine.add_request(name, prompt(prompts[i % len(prompts)]), params)
    finished = run_to_completion(engine)
    assert not engine.structured.grammars  # every grammar forgotten with its sequence
    for name, constraint in constraints.items():
        for completion in finished[name].outputs:
            if constraint is not None:
                assert completion.finish_reason == "stop", (name, completion.text)
                check_output(name, completion.text)
    return {name: [list(c.token_ids) for c in finished[name].outputs] for name in constraints}


@pytest.fixture(scope="module")
def greedy_reference() -> dict[str, list[list[int]]]:
    return run(engine_for(default_model(), tokenizer=default_tokenizer(), async_scheduling=False), CONSTRAINTS)


@pytest.mark.parametrize(("k", "async_scheduling"), [(0, True), (1, True), (3, True), (3, False)])
def test_greedy_output_is_the_same_in_every_mode(greedy_reference, k, async_scheduling):
    engine = engine_for(default_model(), tokenizer=default_tokenizer(), k=k, async_scheduling=async_scheduling)
    assert run(engine, CONSTRAINTS) == greedy_reference


def test_unconstrained_rows_share_the_step_untouched():
    model, engine = default_model(), engine_for(default_model(), tokenizer=default_tokenizer(), k=3)
    got = run(engine, {"json": CONSTRAINTS["json"], "free": None, "regex": CONSTRAINTS["regex"]})
    assert got["free"][0] == greedy_continuation(model, prompt(PROMPTS[1]), 48)[:len(got["free"][0])]
    assert engine.runner._forward._cache_size() == 1  # the constrained steps ran in two halves


def test_a_step_without_constrained_rows_compiles_nothing_new():
    engine = engine_for(default_model(), tokenizer=default_tokenizer())
    run(engine, {"free": None, "other": None}, max_tokens=8)
    assert engine.runner._forward._cache_size() == 0 and engine.runner._sampling._cache_size() == 0


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_outputs_satisfy_their_constraints(k):
    """Temperature 1.0, two samples per request: the grammar alone keeps random text inside the constraint."""
    engine = engine_for(default_model(), tokenizer=default_tokenizer(), k=k)
    for seed in range(2):
        run(engine, CONSTRAINTS, temperature=1.0, max_tokens=64, seed=10 * seed, n=2)


def test_preempted_requests_resume_their_grammar():
    """Pools too small for the batch (12 blocks of 16 for four prompts of about 60 tokens and their outputs):
    the scheduler preempts (recompute) and each grammar goes on where it was."""
    long_prompts = [f"# {text}\n" * 8 + text for text in PROMPTS]
    roomy = engine_for(default_model(), tokenizer=default_tokenizer(), k=3)
    tight = engine_for(default_model(), tokenizer=default_tokenizer(), k=3, num_blocks=12, num_state_slots=8)
    assert run(tight, CONSTRAINTS, prompts=long_prompts) == run(roomy, CONSTRAINTS, prompts=long_prompts)
    assert tight.scheduler.num_preemptions > 0


def test_abort_forgets_the_grammar():
    engine = engine_for(default_model(), tokenizer=default_tokenizer(), k=3)
    engine.add_request("a", prompt(PROMPTS[0]), SamplingParams(max_tokens=40, n=2,
                                                                structured_outputs=CONSTRAINTS["json"]))
    for _ in range(3):
        engine.step()
    assert len(engine.structured.grammars) == 2
    engine.abort("a")
    run_to_completion(engine)
    assert not engine.structured.grammars


def test_a_grammar_that_does_not_compile_queues_nothing():
    engine = engine_for(default_model(), tokenizer=default_tokenizer())
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add_request("bad", prompt("x"), SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))
    assert not engine.has_unfinished_requests() and not engine.structured.grammars


CAR_DESCRIPTION = {  # vLLM's CarDescription (pydantic's schema of brand: str, model: str, car_type: CarType)
    "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}},
    "properties": {"brand": {"title": "Brand", "type": "string"}, "model": {"title": "Model", "type": "string"},
                   "car_type": {"$ref": "#/$defs/CarType"}},
    "required": ["brand", "model", "car_type"], "title": "CarDescription", "type": "object"}
CAR_PROMPT = "Generate a JSON with the brand, model and car_type of the most iconic car from the 90's"


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_car_descriptions_validate(k):
    """Temperature 1.0, a batch of 8 replies: every reply that ends is a CarDescription (json + jsonschema), and
    one cut at max_tokens is one the grammar still accepts. The schema's strings have no bound, so where a random
    model's reply ends is up to its strings: objects closed and whitespace off (vLLM's
    disable_additional_properties and disable_any_whitespace) leave them the only free part. Most replies end
    within 256 tokens (their median is about 150); `benchmarks/structured_outputs.py` counts 100 replies."""
    engine = engine_for(default_model(), tokenizer=default_tokenizer(), k=k, max_num_seqs=8, max_model_len=320,
                        num_blocks=200, num_state_slots=24)
    structured = StructuredOutputsParams(json=CAR_DESCRIPTION, disable_any_whitespace=True,
                                         disable_additional_properties=True)
    for i in range(8):
        engine.add_request(str(i), prompt(CAR_PROMPT), SamplingParams(temperature=1.0, seed=i, max_tokens=256,
                                                                      structured_outputs=structured))
    finished = run_to_completion(engine, max_steps=1000)
    assert len(finished) == 8
    ended = [output.outputs[0] for output in finished.values() if output.outputs[0].finish_reason == "stop"]
    assert len(ended) >= 5
    for completion in ended:
        jsonschema.validate(json.loads(completion.text), CAR_DESCRIPTION)
    for output in finished.values():
        matcher = compiler().compile(structured)
        assert matcher.consume_tokens([t for t in output.outputs[0].token_ids if t != default_tokenizer().eos_token_id])


def test_a_request_without_reasoning_is_constrained_from_its_first_token():
    """With a reasoning parser whose reasoning never ends here, the grammar waits for it, unless the request
    turned its reasoning off (`grammar_after_reasoning=False`: include_reasoning false, enable_thinking false)."""
    engine = engine_for(default_model(), tokenizer=default_tokenizer())
    engine.structured.reasoning_end = lambda token_ids: False
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"])
    engine.add_request("waits", prompt(PROMPTS[1]), params)
    engine.add_request("at once", prompt(PROMPTS[1]), params, grammar_after_reasoning=False)
    finished = run_to_completion(engine)
    assert finished["at once"].outputs[0].text in ("red", "green", "blue")
    free = greedy_continuation(default_model(), prompt(PROMPTS[1]), 8)
    assert finished["waits"].outputs[0].token_ids == free[:len(finished["waits"].outputs[0].token_ids)]
