"""The model presets in configs/models parse, and the real ones have the layer layout and state size of the release."""

import json
from collections import Counter
from itertools import takewhile
from pathlib import Path

import pytest
import yaml

from jaxhybrid.models.config import ATTENTION, GDN, MAMBA2, MLP, MOE
from jaxhybrid.models.hf_config import load_config

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "configs" / "models"
PRESET_PATHS = sorted(PRESETS.glob("*.yaml"))
HF_FIXTURES = REPO / "tests" / "fixtures" / "hf"
TINY = {"tiny_qwen3_next": "qwen3_next", "tiny_qwen3_5_text": "qwen3_5_text", "tiny_nemotron_h": "nemotron_h"}
NEMOTRON_BLOCKS = {"M": MAMBA2, "*": ATTENTION, "-": MLP, "E": MOE}


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def kinds(cfg) -> Counter:
    return Counter(kind for layer in cfg.layers for kind in layer)


def test_presets_exist():
    names = {path.stem for path in PRESET_PATHS}
    assert set(TINY) <= names
    assert {"qwen3_next_80b_a3b_instruct", "nemotron_h_8b_base_8k"} <= names


@pytest.mark.parametrize("path", PRESET_PATHS, ids=lambda path: path.stem)
def test_preset_parses(path):
    cfg = load_config(path)
    text = raw(path)
    text = text.get("text_config", text)
    assert cfg.num_layers == text.get("num_hidden_layers", cfg.num_layers) > 0
    assert cfg.state_bytes_per_slot() > 0
    assert cfg.kv_bytes_per_token() > 0
    if path.stem not in TINY:  # every real preset names its source(s) in its header comment
        header = takewhile(lambda line: line.startswith("#"), path.read_text().splitlines())
        assert "Source" in "\n".join(header)


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_presets_match_fixtures(name):
    fixture = json.loads((HF_FIXTURES / TINY[name] / "config.json").read_text())
    preset = raw(PRESETS / f"{name}.yaml")
    # The JSON fixture spells +inf as {"__float__": "Infinity"}; the YAML preset uses .inf.
    fixture.pop("time_step_limit", None)
    preset.pop("time_step_limit", None)
    assert preset == fixture
    assert load_config(PRESETS / f"{name}.yaml") == load_config(HF_FIXTURES / TINY[name])


def test_qwen3_next_80b_layout_and_state():
    cfg = load_config(PRESETS / "qwen3_next_80b_a3b_instruct.yaml")
    assert cfg.num_layers == 48
    mixers = [layer[0] for layer in cfg.layers]
    assert mixers == [ATTENTION if (i + 1) % 4 == 0 else GDN for i in range(48)]
    assert kinds(cfg) == Counter({GDN: 36, ATTENTION: 12, MOE: 48})
    g = cfg.gdn
    assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel) == (16, 32, 128, 128, 4)
    assert g.conv_dim == 8192
    # 36 GDN layers x (32*128*128 fp32 state + 3*8192 conv values at 2 bytes).
    assert cfg.state_bytes_per_slot() == 36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2) == 77_266_944
    # 12 attention layers x K and V x 2 kv heads x 256 x 2 bytes = 24 KiB per token.
    assert cfg.kv_bytes_per_token(2) == 12 * 2 * 2 * 256 * 2 == 24 * 1024
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (512, 10, 512)


def test_nemotron_h_8b_layout_and_state():
    path = PRESETS / "nemotron_h_8b_base_8k.yaml"
    pattern = raw(path)["hybrid_override_pattern"]
    cfg = load_config(path)
    assert len(pattern) == cfg.num_layers == 52
    counts = Counter(pattern)
    assert (counts["M"], counts["*"], counts["-"]) == (24, 4, 24)
    assert kinds(cfg) == Counter({MAMBA2: 24, ATTENTION: 4, MLP: 24})
    m = cfg.mamba2
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel) == (128, 64, 128, 8, 4)
    assert cfg.state_bytes_per_slot() == 24 * (128 * 64 * 128 * 4 + 3 * (128 * 64 + 2 * 8 * 128) * 2)
    assert cfg.kv_bytes_per_token(2) == 4 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    "path", [p for p in PRESET_PATHS if "hybrid_override_pattern" in raw(p)], ids=lambda path: path.stem
)
def test_nemotron_layers_follow_pattern(path):
    text = raw(path)
    cfg = load_config(path)
    assert len(text["hybrid_override_pattern"]) == text["num_hidden_layers"] == cfg.num_layers
    assert [layer[0] for layer in cfg.layers] == [NEMOTRON_BLOCKS[c] for c in text["hybrid_override_pattern"]]
