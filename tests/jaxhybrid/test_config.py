"""HuggingFace config.json parsing for every family, and errors that name the problem."""

import json

import pytest

from jaxhybrid.models.config import ATTENTION, GDN, MAMBA2, MLP, MOE, ConfigError
from jaxhybrid.models.hf_config import load_config, parse_hf_config
from tests.hf_fixtures import HF_FIXTURES


def _raw(family: str) -> dict:
    return json.loads((HF_FIXTURES / family / "config.json").read_text())


def test_qwen3_next_layers_follow_layer_types_and_mlp_only_layers():
    cfg = load_config(HF_FIXTURES / "qwen3_next")
    assert cfg.layers == ((GDN, MOE), (GDN, MLP), (GDN, MOE), (ATTENTION, MOE))
    assert cfg.zero_centered_norm and cfg.attention.output_gate and cfg.attention.qk_norm
    assert cfg.attention.rotary_dim == 4  # head_dim 16 x partial_rotary_factor 0.25
    assert cfg.moe.router == "softmax" and cfg.moe.shared_expert_gate
    assert cfg.mtp_layers == ((ATTENTION, MOE),)


def test_full_attention_interval_when_layer_types_absent():
    raw = _raw("qwen3_next") | {"num_hidden_layers": 8, "full_attention_interval": 4, "num_experts": 0}
    del raw["layer_types"]
    cfg = parse_hf_config(raw)
    assert [layer[0] for layer in cfg.layers] == [GDN, GDN, GDN, ATTENTION] * 2
    assert all(layer[1] == MLP for layer in cfg.layers)


def test_qwen3_5_composite_uses_text_config():
    composite, text = load_config(HF_FIXTURES / "qwen3_5"), load_config(HF_FIXTURES / "qwen3_5_text")
    assert composite.model_type == "qwen3_5_text"
    assert composite.layers == text.layers and composite.gdn == text.gdn
    assert all(layer[1] == MLP for layer in text.layers)


def test_nemotron_pattern_and_list_forms_agree():
    cfg = load_config(HF_FIXTURES / "nemotron_h")
    assert cfg.layers == ((MAMBA2,), (ATTENTION,), (MAMBA2,), (MLP,), (MAMBA2,), (MOE,))
    assert not cfg.zero_centered_norm and cfg.attention.rotary_dim == 0 and cfg.moe.router == "sigmoid"
    pattern = {k: v for k, v in _raw("nemotron_h").items() if k != "layers_block_type"}
    pattern["hybrid_override_pattern"] = "M*M-ME"
    assert parse_hf_config(pattern).layers == cfg.layers


def test_nemotron_legacy_field_names():
    raw = _raw("nemotron_h")
    raw["mamba_n_groups"], raw["mamba_d_conv"] = raw.pop("n_groups"), raw.pop("conv_kernel")
    cfg = parse_hf_config(raw)
    assert cfg.mamba2 == load_config(HF_FIXTURES / "nemotron_h").mamba2


def test_unknown_model_type_is_named():
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        parse_hf_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="no 'model_type'"):
        parse_hf_config({"hidden_size": 8})


@pytest.mark.parametrize(("family", "field"), [
    ("qwen3_next", "linear_num_key_heads"), ("qwen3_next", "vocab_size"), ("qwen3_5_text", "hidden_size"),
    ("nemotron_h", "ssm_state_size"), ("nemotron_h", "n_routed_experts"), ("qwen3_5", "text_config"),
])
def test_missing_field_is_named(family, field):
    raw = _raw(family)
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        parse_hf_config(raw)


def test_bad_layer_descriptions_are_named():
    with pytest.raises(ConfigError, match="hybrid_override_pattern has unknown characters"):
        parse_hf_config({k: v for k, v in _raw("nemotron_h").items() if k != "layers_block_type"}
                        | {"hybrid_override_pattern": "M*X"})
    with pytest.raises(ConfigError, match="layer_types has 2 entries"):
        parse_hf_config(_raw("qwen3_next") | {"layer_types": ["linear_attention", "full_attention"]})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)


def test_memory_planning_numbers():
    cfg = load_config(HF_FIXTURES / "qwen3_next")
    gdn = cfg.gdn
    per_gdn_layer = 4 * gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim + 2 * 3 * gdn.conv_dim
    assert cfg.state_bytes_per_slot() == 3 * per_gdn_layer
    # one target attention layer + one MTP layer, K and V, bf16
    assert cfg.kv_bytes_per_token() == 2 * 2 * cfg.attention.num_kv_heads * cfg.attention.head_dim * 2
