"""SamplingParams: vLLM's names and defaults, every bad value refused with the field named, and the parts
handed to the scheduler (stop conditions) and the device (the per-row record)."""

import numpy as np
import pytest

import scheduler
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import ROW_DTYPE, SamplingRows


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (1, 16, 1.0, 1.0, 0, None, ())
    assert SamplingParams(stop="\n").stop == ("\n",)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("max_tokens", -1), ("max_tokens", 2.0), ("temperature", -0.5), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", 1.2), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", True),
    ("stop", ("",)),    ("stop_token_ids", (1, -3)), ("ignore_eos", 1), ("logprobs", -2), ("prompt_logprobs", 1.0),
    ("prompt_logprobs", -2), ("min_tokens", -1), ("min_tokens", 17), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: float("inf")}), ("allowed_token_ids", []), ("allowed_token_ids", [3, -1]),
    ("bad_words", ["ok", " "]),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def test_vllm_constraint_fields_are_kept_normalised():
    """logit_bias is clamped to [-100, 100] as vLLM does; -1 logprobs (the whole vocabulary) is accepted."""
    p = SamplingParams(max_tokens=4, min_tokens=4, logit_bias={3: 250.0, 4: -1e4, 5: 0.5},
                       allowed_token_ids=[1, 2], bad_words=["x"], logprobs=-1, prompt_logprobs=-1)
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}
    assert (p.allowed_token_ids, p.bad_words, p.logprobs, p.prompt_logprobs) == ((1, 2), ("x",), -1, -1)
    assert np.frombuffer(p.row_data(seed=0, prompt_len=3), ROW_DTYPE)[0]["min_tokens"] == 4


def test_the_scheduler_gets_stop_conditions_and_the_device_a_record():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=0.5, frequency_penalty=-0.25, stop_token_ids=[5, 6], ignore_eos=True)
    assert p.scheduler_params(12, eos_token_id=0) == scheduler.StopParams(12, 0, (5, 6), True)
    record = np.frombuffer(p.row_data(seed=2**40 + 3, prompt_len=5), ROW_DTYPE)[0]
    assert record["top_k"] == 0 and (record["seed"], record["seed_high"]) == (3, 2**8)  # top_k -1: off, as 0
    rows = SamplingRows.from_records(np.frombuffer(p.row_data(seed=9, prompt_len=5), np.uint8).reshape(1, -1))
    np.testing.assert_allclose([float(f[0]) for f in rows[:7]], [0.7, 0.9, 0, 0.05, 1.1, 0.5, -0.25], rtol=1e-6)
