"""Checkpoint loading: sharded files, orbax round trip, dtype, streaming memory, and bad directories."""

import json
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxhybrid
from jaxhybrid.models.config import ConfigError
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.models.weights import CheckpointError
from tests.hf_fixtures import HF_FIXTURES, fixture_model

TOKENS = np.random.default_rng(0).integers(0, 256, (1, 20))


def _copy_checkpoint(tmp_path, family="qwen3_next", tensors=None):
    directory = tmp_path / family
    directory.mkdir()
    shutil.copy(HF_FIXTURES / family / "config.json", directory)
    tensors = load_file(HF_FIXTURES / family / "model.safetensors") if tensors is None else tensors
    save_file(tensors, directory / "model.safetensors")
    return directory


def _assert_same_params(a, b):
    same = jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)
    assert all(jax.tree_util.tree_leaves(same))


def test_sharded_checkpoint_with_index(tmp_path):
    tensors = load_file(HF_FIXTURES / "qwen3_next" / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    directory = tmp_path / "sharded"
    directory.mkdir()
    shutil.copy(HF_FIXTURES / "qwen3_next" / "config.json", directory)
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, directory / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same_params(jaxhybrid.load_model(directory).params, fixture_model("qwen3_next").params)


def test_orbax_round_trip(tmp_path):
    model = fixture_model("nemotron_h")
    jaxhybrid.save_params(model, tmp_path / "converted")
    restored = jaxhybrid.load_model(tmp_path / "converted")
    _assert_same_params(restored.params, model.params)
    np.testing.assert_array_equal(np.asarray(restored(TOKENS)), np.asarray(model(TOKENS)))


@pytest.mark.parametrize(("family", "backend"), [("qwen3_5_text", "reference"), ("qwen3_next", "interpret"),
                                                ("nemotron_h", "interpret")])
def test_bfloat16_load_stays_close_to_float32(family, backend):
    """bf16 weights and activations with f32 recurrent state, through the XLA references and through the Pallas
    kernels (interpreted: their bf16 dots, tiles and f32 accumulation), against the f32 model."""
    low = jaxhybrid.load_model(HF_FIXTURES / family, dtype=jnp.bfloat16, ops=ModelOps(backend=backend))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(low.params)} == {jnp.dtype(jnp.bfloat16)}
    full = np.asarray(fixture_model(family)(TOKENS))
    # agreement of the predicted token and of the scale
    logits = np.asarray(low(TOKENS), np.float32)
    assert np.abs(logits - full).max() < 0.1 * np.abs(full).max()
    assert (logits.argmax(-1) == full.argmax(-1)).mean() >= 0.9


def test_loading_streams_one_tensor_at_a_time(tmp_path):
    """Host numpy memory peaks near the largest tensor, not at the size of the checkpoint."""
    directory = _copy_checkpoint(tmp_path, "qwen3_5_text")
    total = sum(t.nbytes for t in load_file(directory / "model.safetensors").values())
    jaxhybrid.load_model(directory)  # warm the per-config caches: only the tensors' own traffic is measured
    tracemalloc.start()
    jaxhybrid.load_model(directory)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 0.5 * total, f"peak host allocation {peak} bytes for a {total}-byte checkpoint"


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        jaxhybrid.load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        jaxhybrid.load_model(tmp_path)


def test_no_safetensors(tmp_path):
    shutil.copy(HF_FIXTURES / "qwen3_next" / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        jaxhybrid.load_model(tmp_path)


def test_unknown_architecture(tmp_path):
    directory = _copy_checkpoint(tmp_path)
    (directory / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="unknown model_type 'mamba'"):
        jaxhybrid.load_model(directory)


def test_wrong_shapes_are_listed(tmp_path):
    tensors = load_file(HF_FIXTURES / "qwen3_next" / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    tensors["model.norm.weight"] = np.zeros(7, np.float32)
    with pytest.raises(CheckpointError, match="wrong shapes") as error:
        jaxhybrid.load_model(_copy_checkpoint(tmp_path, tensors=tensors))
    assert "model.layers.1.mlp.up_proj.weight" in str(error.value) and "model.norm.weight" in str(error.value)


def test_missing_tensors_are_listed(tmp_path):
    tensors = load_file(HF_FIXTURES / "nemotron_h" / "model.safetensors")
    del tensors["backbone.layers.2.mixer.D"]
    with pytest.raises(CheckpointError, match="missing 1 tensors.*layers_2/mamba2/D"):
        jaxhybrid.load_model(_copy_checkpoint(tmp_path, "nemotron_h", tensors))


def test_unexpected_tensor_is_named(tmp_path):
    tensors = load_file(HF_FIXTURES / "qwen3_next" / "model.safetensors")
    tensors["model.layers.0.linear_attn.surprise.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match="surprise"):
        jaxhybrid.load_model(_copy_checkpoint(tmp_path, tensors=tensors))
