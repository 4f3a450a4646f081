"""The abstract params of an FP8 config (`abstract_params`: the weights of a compile without the checkpoint) are
what the loader makes of a checkpoint with that quantization_config: the same tree, shapes and dtypes, FP8
kernels and scales exactly where the checkpoint keeps its weights FP8."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import pytest

import jaxhybrid
from jaxhybrid.models.config import QuantConfig
from jaxhybrid.models.fp8_weights import unconverted
from jaxhybrid.models.model import abstract_params
from tests.fixtures.make_fp8_fixture import QWEN_BLOCK, dequantize_blockwise, read_safetensors, write_safetensors
from tests.hf_fixtures import HF_FIXTURES

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def described(params) -> dict:
    """Each param's '/'-joined path -> (shape, dtype)."""
    return {"/".join(str(k.key) for k in path): (tuple(leaf.shape), jnp.dtype(leaf.dtype))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def assert_abstract_is_loaded(directory) -> dict:
    model = jaxhybrid.load_model(directory, jnp.bfloat16)
    abstract = abstract_params(model.config, jnp.bfloat16)
    assert jax.tree.structure(abstract) == jax.tree.structure(model.params)
    assert described(abstract) == described(model.params)
    return described(abstract)


@pytest.mark.parametrize("family", ["qwen3_next_fp8", "nemotron_h_fp8"])
def test_abstract_params_are_the_fp8_load(family):
    """Qwen's block-wise fixture (blocks of 16 x 24, its lm_head and shared_expert_gate left bf16 by bare module
    names) and ModelOpt's per-tensor one (lm_head excluded): FP8 kernels of [blocks, block, out] beside float32
    scales, the routed expert stacks FP8, everything else in the serving dtype."""
    params = assert_abstract_is_loaded(HF_FIXTURES / family)
    assert params["lm_head/kernel"][1] == jnp.bfloat16
    assert any(dtype == FP8 for name, (_, dtype) in params.items() if name.endswith("moe/up_proj"))


def test_abstract_params_follow_modules_named_layer_by_layer(tmp_path):
    """Qwen's released FP8 checkpoints name each module they leave in bf16 in full, layer by layer
    (`model.layers.0.linear_attn.in_proj_ba`, `mtp.fc`): the fixture rewritten so, those kernels bf16 in the
    load and in the abstract tree, the other GDN and MTP kernels FP8."""
    shutil.copytree(HF_FIXTURES / "qwen3_next_fp8", tmp_path, dirs_exist_ok=True)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    left = [f"model.layers.{i}.linear_attn.in_proj_ba" for i, kind in enumerate(config["layer_types"])
            if kind == "linear_attention"] + ["mtp.fc"]
    for module in left:
        weight, scale = tensors[f"{module}.weight"], tensors.pop(f"{module}.weight_scale_inv")
        tensors[f"{module}.weight"] = dequantize_blockwise(weight, scale, QWEN_BLOCK).astype(ml_dtypes.bfloat16)
    write_safetensors(tensors, tmp_path / "model.safetensors")
    gates = [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(len(config["layer_types"]))]
    config["quantization_config"]["modules_to_not_convert"] = [
        "lm_head", "model.embed_tokens", *left, *gates, "mtp.layers.0.mlp.shared_expert_gate"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    params = assert_abstract_is_loaded(tmp_path)
    assert params["segment_0/layers_0/gdn/in_proj_ba/kernel"][1] == jnp.bfloat16
    assert params["mtp/fc/kernel"][1] == jnp.bfloat16
    assert params["segment_0/layers_0/gdn/in_proj_qkvz/kernel"][1] == FP8
    assert params["mtp/layers_0/attention/q_proj/kernel"][1] == FP8


def test_modules_left_unconverted_match_whole_names():
    """An entry names a module, a module it lies in, or its last names, by whole dot-separated names; prefixes
    that mean the language model (`backbone.`) are the loader's `model.`; `*` is a wildcard (ModelOpt)."""
    quant = QuantConfig(method="fp8", not_converted=(
        "lm_head", "shared_expert_gate", "model.layers.1.linear_attn.in_proj_ba", "backbone.layers.2.mixer",
        "model.layers.4*"))
    assert unconverted("lm_head", quant)
    assert unconverted("model.layers.0.mlp.shared_expert_gate", quant)
    assert not unconverted("model.layers.0.mlp.shared_expert.gate_proj", quant)
    assert unconverted("model.layers.1.linear_attn.in_proj_ba", quant)
    assert not unconverted("model.layers.11.linear_attn.in_proj_ba", quant)
    assert not unconverted("model.layers.1.linear_attn.in_proj_qkvz", quant)
    assert unconverted("model.layers.2.mixer.in_proj", quant)
    assert not unconverted("model.layers.21.mixer.in_proj", quant)
    assert unconverted("model.layers.40.mixer.out_proj", quant)
    assert not unconverted("model.layers.5.mixer.out_proj", quant)
