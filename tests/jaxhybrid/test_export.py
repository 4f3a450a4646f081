"""export_hf_checkpoint is the exact inverse of the loader, on the HuggingFace Qwen3-Next fixture."""

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from jaxhybrid.models.export import export_hf_checkpoint
from jaxhybrid.models.weights import load_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3_next"


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict


def _flat(params) -> dict[str, np.ndarray]:
    return {"/".join(k.key for k in keys): np.asarray(v) for keys, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_export_writes_the_original_hf_tensors(tmp_path):
    model = load_model(FIXTURE)
    export_hf_checkpoint(model.params, model.hf_config, tmp_path)
    original, exported = _tensors(FIXTURE), _tensors(tmp_path)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    assert json.loads((tmp_path / "config.json").read_text()) == model.hf_config


def test_export_then_load_gives_identical_params(tmp_path):
    model = load_model(FIXTURE)
    export_hf_checkpoint(model.params, model.hf_config, tmp_path)
    reloaded = load_model(tmp_path)
    before, after = _flat(model.params), _flat(reloaded.params)
    assert before.keys() == after.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
