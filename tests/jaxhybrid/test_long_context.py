"""Long context: max_model_len defaults to the model's own and start-up names the longest that fits; YaRN rope
matches transformers; --hf-overrides is merged into config.json before it is parsed."""

from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxhybrid
from jaxhybrid.engine.args import EngineArgs
from jaxhybrid.engine.builder import scheduler_config
from jaxhybrid.models.config import ConfigError
from jaxhybrid.models.hf_config import load_config, merge_overrides
from jaxhybrid.models.layers import rope_frequencies
from jaxhybrid.models.model import Model
from jaxhybrid.serve.__main__ import parse_args
from tests.hf_fixtures import HF_FIXTURES
from tests.tolerances import assert_float32_close, model_depth

YARN = HF_FIXTURES / "qwen3_next_yarn"  # made by tests/fixtures/make_yarn_reference.py
OVERRIDES = json.loads((YARN / "hf_overrides.json").read_text())
POOLS = dict(num_blocks=64, num_state_slots=16)  # counts given: no sizing, the budget is never asked


@pytest.fixture(scope="module")
def yarn_model() -> Model:
    """The qwen3_next fixture loaded with the YaRN overrides, as --hf-overrides passes them."""
    return jaxhybrid.load_model(HF_FIXTURES / "qwen3_next", hf_overrides=OVERRIDES)


def test_hf_overrides_give_the_yarn_checkpoint_and_its_transformers_logits(yarn_model):
    """The overrides make the config.json transformers saved for the YaRN fixture (the nested rope dict merged,
    not replaced), and the logits are transformers' on it; the plain rope's logits for the same tokens are not
    within the tolerance, so the check sees the scaling."""
    assert yarn_model.config == load_config(YARN) and yarn_model.config.attention.yarn is not None
    assert yarn_model.hf_config["rope_parameters"]["rope_theta"] == 10000.0
    reference, plain = np.load(YARN / "reference.npz"), np.load(HF_FIXTURES / "qwen3_next" / "reference.npz")
    depth = model_depth(yarn_model.config, 130)
    logits = np.asarray(yarn_model(reference["tokens_L130"]))
    assert_float32_close(logits, reference["logits_L130"], depth, "yarn L130")
    assert (reference["tokens_L130"] == plain["tokens_L130"]).all()
    with pytest.raises(AssertionError):
        assert_float32_close(plain["logits_L130"], reference["logits_L130"], depth, "plain rope")


def test_merge_overrides_merges_nested_objects_and_replaces_the_rest():
    config = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "f": [1], "g": 4}
    merged = merge_overrides(config, {"a": {"c": {"d": 5}}, "f": [2], "h": {"i": 6}})
    assert merged == {"a": {"b": 1, "c": {"d": 5, "e": 3}}, "f": [2], "g": 4, "h": {"i": 6}}
    assert config["a"]["c"]["d"] == 2  # the input is left as it was


def test_hf_overrides_flag_is_json():
    args = parse_args(["--hf-overrides", '{"max_position_embeddings": 8192, "rope_scaling": {"factor": 2.0}}'])
    assert args.hf_overrides == {"max_position_embeddings": 8192, "rope_scaling": {"factor": 2.0}}
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineArgs(hf_overrides=[1])


def _yarn(rope: dict, **top) -> object:
    return load_config(HF_FIXTURES / "qwen3_next", {"rope_parameters": {"rope_type": "yarn", **rope}, **top}
                       ).attention.yarn


def test_yarn_defaults_are_transformers():
    """`_compute_yarn_parameters`' defaults: beta 32 / 1, attention factor 0.1 ln(factor) + 1 or the mscale
    ratio, factor from max_position_embeddings / original_max_position_embeddings, the legacy `type` key."""
    plain = _yarn({"factor": 4.0, "original_max_position_embeddings": 256})
    assert (plain.beta_fast, plain.beta_slow, plain.truncate) == (32.0, 1.0, True)
    assert plain.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    ratio = _yarn({"factor": 4.0, "original_max_position_embeddings": 256, "mscale": 2.0, "mscale_all_dim": 1.0})
    assert ratio.attention_factor == pytest.approx((0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1))
    implied = _yarn({"original_max_position_embeddings": 256})  # max_position_embeddings 1024
    assert implied.factor == 4.0
    legacy = load_config(HF_FIXTURES / "qwen3_next", {"rope_parameters": None, "rope_scaling": {
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}})
    assert legacy.attention.yarn.factor == 2.0 and legacy.attention.rope_theta == 10000.0
    with pytest.raises(ConfigError, match="'linear' is not supported"):
        load_config(HF_FIXTURES / "qwen3_next", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}})


def test_yarn_frequencies_ramp_from_kept_to_interpolated():
    """Dims that turn more than beta_fast times over the original length keep their frequency, those that
    turn fewer than beta_slow times are divided by the factor, and the ramp between is linear."""
    plain, _ = rope_frequencies(16, 10000.0)
    yarn, scale = rope_frequencies(16, 10000.0, load_config(YARN).attention.yarn)
    # correction dims for theta 1e4, d 16, original 256: beta_fast 32 -> 0.21 (floor 0), beta_slow 1 -> 3.2 (ceil 4)
    ramp = np.clip(np.arange(8) / 4, 0, 1)
    np.testing.assert_allclose(yarn, plain * (1 - ramp) + plain / 4 * ramp, rtol=1e-6)
    assert scale == pytest.approx(0.1 * math.log(4) + 1)


def test_max_model_len_defaults_to_the_model_s_own():
    cfg = load_config(HF_FIXTURES / "qwen3_next")
    for length in (1024, 262144):
        config = scheduler_config(EngineArgs(**POOLS), dataclasses.replace(cfg, max_position_embeddings=length),
                                  lambda: 0, dtype=jnp.dtype(jnp.float32))
        assert config.max_model_len == length
    assert scheduler_config(EngineArgs(max_model_len=300, **POOLS), cfg, lambda: 0,
                            dtype=jnp.dtype(jnp.float32)).max_model_len == 300


def test_a_max_model_len_the_pools_cannot_hold_names_the_longest_that_fits():
    """One line naming --max-model-len and the longest length that fits: that one sizes, one more does not."""
    cfg = load_config(HF_FIXTURES / "qwen3_next")
    budget, dtype = 2**20, jnp.dtype(jnp.float32)
    with pytest.raises(ValueError) as error:
        scheduler_config(EngineArgs(max_model_len=1 << 20), cfg, lambda: budget, dtype=dtype)
    message = str(error.value)
    assert "\n" not in message and "max_model_len 1048576 does not fit" in message
    longest = int(message.split("pass --max-model-len ")[1].split()[0])
    assert 0 < longest < 1 << 20
    assert scheduler_config(EngineArgs(max_model_len=longest), cfg, lambda: budget, dtype=dtype).max_model_len
    with pytest.raises(ValueError, match="does not fit"):
        scheduler_config(EngineArgs(max_model_len=longest + 1), cfg, lambda: budget, dtype=dtype)


def test_start_up_stops_where_the_model_s_own_length_does_not_fit():
    """build_engine reads --hf-overrides: a max_position_embeddings no CPU budget holds stops the start-up."""
    with pytest.raises(ValueError, match="pass --max-model-len"):
        jaxhybrid.LLM(str(HF_FIXTURES / "qwen3_next"), skip_tokenizer_init=True,
                      hf_overrides={"max_position_embeddings": 1 << 24})
