"""FP8 checkpoints (tests/fixtures/make_fp8_fixture.py): Qwen's block-wise format and NVIDIA ModelOpt's
per-tensor one load with their weights kept in FP8 on the device, compute the model of their dequantized
twin, and load straight into shards under tensor parallelism."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxhybrid
from jaxhybrid.models.config import ConfigError
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.tensor_parallel import param_sharding
from jaxhybrid.models.weights import CheckpointError
from jaxhybrid.worker.memory import param_bytes
from pallas_kernels.fp8_matmul import dequantize, fp8_matmul, matmul_scaled
from tests.fixtures.make_fp8_fixture import (
    WHOLE_BLOCK,
    checkpoint_digest,
    decode_e4m3,
    make_block_fp8,
    write_dequantized_twin,
)
from tests.hf_fixtures import HF_FIXTURES
from tests.jaxhybrid.distributed.workers import WORKER_TIMEOUT, worker_env
from tests.tolerances import assert_float32_close, float32_atol, model_depth

FP8 = jnp.dtype(jnp.float8_e4m3fn)


@pytest.mark.parametrize("family", ["qwen3_next_fp8", "nemotron_h_fp8"])
def test_fp8_load_computes_its_dequantized_twin(family, tmp_path):
    """Logits of the FP8 load against its dequantized twin (each FP8 weight times its scales, stored in f32).

    The tolerance: both hold the same weights. The twin's are NumPy's float32 products decode(q) * s; the FP8
    model forms kernel.astype(f32) * scale inside the step, the same IEEE product of the same two float32
    numbers (an e4m3 value has 4 significant bits, so its float32 is exact), rounded the same way. Only the
    order of the float32 sums may differ (XLA fuses the dequantization into a dot in one program and not the
    other), so they agree within the float32 bound of test_hf_parity: 2 * depth * 2^-24 * max|logit|.
    e4m3's own rounding is a relative 2^-4 per weight (3 mantissa bits), so a wrong scale (a transposed or
    shifted block grid, a partial edge block scaled as a full one) moves the logits by about 2^-4 of their size,
    some 10^5 times this bound: the original float32 model, which differs by exactly that rounding, lies far
    outside it.
    """
    fp8 = jaxhybrid.load_model(HF_FIXTURES / family)
    write_dequantized_twin(HF_FIXTURES / family, tmp_path / "twin")
    twin = jaxhybrid.load_model(tmp_path / "twin")
    # the matmuls' weights stay FP8 on the device, routed experts included, with their float32 scales
    leaves = {"/".join(str(k.key) for k in path): leaf
              for path, leaf in jax.tree_util.tree_leaves_with_path(fp8.params)}
    quantized = [name for name, leaf in leaves.items() if leaf.dtype == FP8]
    assert any(name.endswith("moe/up_proj") for name in quantized) and any("kernel" in n for n in quantized)
    assert all(leaves[name + "_scale"].dtype == jnp.float32 for name in quantized)
    assert not any("router" in name or "embed" in name for name in quantized)
    assert param_bytes(fp8.params, fp8.config, None) == sum(leaf.nbytes for leaf in leaves.values())
    # a byte a weight, plus the scales (4 bytes per 24 columns here, per 128 in Qwen's) and partial blocks' padding
    fp8_bytes = sum(leaves[n].nbytes + leaves[n + "_scale"].nbytes for n in quantized)
    assert fp8_bytes < 0.75 * sum(2 * _twin_size(twin, n) for n in quantized)  # against bf16

    reference = np.load(HF_FIXTURES / family.removesuffix("_fp8") / "reference.npz")
    tokens = reference["tokens_L63"]
    logits, expected = np.asarray(fp8(tokens)), np.asarray(twin(tokens))
    depth = model_depth(fp8.config, tokens.shape[1])
    assert_float32_close(logits, expected, depth, family)
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))  # greedy tokens
    bound = float32_atol(depth, np.abs(expected).max())
    assert np.abs(logits - reference["logits_L63"]).max() > 100 * bound  # the original, before e4m3 rounding


def _twin_size(twin, name: str) -> int:
    """Elements of the twin's param `name` (a '/'-joined path)."""
    node = twin.params
    for key in name.split("/"):
        node = node[key]
    return node.size


def test_fp8_load_matches_transformers(tmp_path):
    """Logits of a Qwen block-wise FP8 load against transformers' for the same checkpoint
    (tests/fixtures/make_fp8_transformers_reference.py): the qwen3_next weights in blocks of WHOLE_BLOCK, as
    transformers cannot read the partial blocks of qwen3_next_fp8. Rebuilt here byte for byte (NumPy only).

    The tolerance: transformers (on CPU) dequantizes each FP8 weight at load to decode(q) * weight_scale_inv in
    float32, the IEEE product of the same two float32 numbers our step forms, so both models hold the same
    weights (the script checks transformers' equal the dequantized twin's bit for bit) and differ only in the
    order of their float32 sums, PyTorch's GDN recurrence included: the bound of test_hf_parity,
    2 * depth * 2^-24 * max|logit|. Reading the format otherwise (scales divided, the block grid transposed or
    shifted, a module's scales missed) changes weights by e4m3's step or more, a relative 2^-4: the original
    float32 model, which differs by e4m3's rounding alone, lies far outside the bound.
    """
    make_block_fp8(HF_FIXTURES / "qwen3_next", tmp_path, block=WHOLE_BLOCK)
    reference = np.load(HF_FIXTURES / "qwen3_next_fp8_whole_blocks" / "reference.npz")
    # the checkpoint transformers read: a change to make_fp8_fixture.py needs the reference regenerated
    assert checkpoint_digest(tmp_path) == str(reference["checkpoint_sha256"])
    model = jaxhybrid.load_model(tmp_path)
    tokens, expected = reference["tokens_L63"], reference["logits_L63"]
    depth = model_depth(model.config, tokens.shape[1])
    assert_float32_close(np.asarray(model(tokens)), expected, depth, "FP8 load against transformers")
    original = np.load(HF_FIXTURES / "qwen3_next" / "reference.npz")
    assert np.array_equal(original["tokens_L63"], tokens)
    bound = float32_atol(depth, np.abs(expected).max())
    assert np.abs(original["logits_L63"] - expected).max() > 100 * bound


def test_fp8_matmul_block_forms_agree_on_partial_blocks():
    """Dequantize-then-dot and the per-block scaled dot (the fused kernel's form) against a float64 product,
    on a weight of 40 rows in blocks of 16 (the last one partial, its padding zero)."""
    rng = np.random.default_rng(0)
    kernel = np.zeros((3, 16, 24), ml_dtypes.float8_e4m3fn)
    kernel.reshape(48, 24)[:40] = rng.normal(0, 50, (40, 24)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.001, 0.01, (3, 24)).astype(np.float32)
    x = rng.normal(0, 1, (5, 40)).astype(np.float32)
    weight = decode_e4m3(kernel).astype(np.float64).reshape(48, 24)[:40] * np.repeat(scale, 16, axis=0)[:40]
    np.testing.assert_array_equal(np.asarray(dequantize(kernel, scale, 40, jnp.float32)), weight.astype(np.float32))
    exact = x.astype(np.float64) @ weight
    for product in (fp8_matmul, matmul_scaled):  # 40 products summed, 3 block sums, one scaling: depth 44
        assert_float32_close(np.asarray(jax.jit(product)(x, kernel, scale)), exact, 44, product.__name__)


def test_scales_split_with_their_kernels():
    """Under tensor parallelism an FP8 kernel's scales split on the same axis: columns with columns, rows by
    whole blocks where tp divides the blocks, else the kernel within each block and the scales replicated."""
    cfg = jaxhybrid.load_config(HF_FIXTURES / "qwen3_next_fp8")
    spec = lambda path, shape, dtype, tp: tuple(param_sharding(path, shape, dtype, cfg,
                                                               jax.sharding.AbstractMesh((tp,), ("tp",))).spec)
    up = ("segment_0", "layers_0", "mlp", "up_proj")
    assert spec((*up, "kernel"), (1, 3, 24, 64), FP8, 4) == (None, None, None, "tp")
    assert spec((*up, "kernel_scale"), (1, 3, 64), jnp.float32, 4) == (None, None, "tp")
    down = ("segment_0", "layers_0", "mlp", "down_proj")
    assert spec((*down, "kernel"), (1, 4, 24, 64), FP8, 4) == (None, "tp", None, None)
    assert spec((*down, "kernel_scale"), (1, 4, 64), jnp.float32, 4) == (None, "tp", None)
    assert spec((*down, "kernel"), (1, 3, 24, 64), FP8, 4) == (None, None, "tp", None)
    assert spec((*down, "kernel_scale"), (1, 3, 64), jnp.float32, 4) == ()


def test_fp8_loads_straight_into_shards():
    """On 4 host devices, each tensor of the FP8 fixtures goes to its shards in the tensor-parallel layout (equal
    to the one-device load laid out and placed as the runner does), and no device holds more than its share of
    the params plus one tensor's shard while loading (fp8_load_worker.py says what is measured)."""
    worker = Path(__file__).parent / "distributed" / "fp8_load_worker.py"
    done = subprocess.run([sys.executable, str(worker), "qwen3_next_fp8=2,4"], env=worker_env(4),
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    for case, run in json.loads(done.stdout.splitlines()[-1]).items():
        assert run["same_as_runner_layout"], case
        assert run["restored_same"] and run["tp_layout"] == int(case.split("/")[1]), case  # a save_params copy too
        assert run["refuses_direct_calls"], case
        assert run["split_fp8_leaves"] > 0, case
        assert run["peak"] <= run["share"] + run["largest_shard"], (case, run)


def test_quantization_configs():
    base = json.loads((HF_FIXTURES / "qwen3_next" / "config.json").read_text())
    quant = parse_hf_config({**base, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                             "weight_block_size": [128, 128]}}).quantization
    assert quant.method == "fp8" and quant.weight_block == (128, 128)
    modelopt = parse_hf_config(base, {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}})
    assert modelopt.quantization.method == "modelopt" and modelopt.quantization.not_converted == ("lm_head",)
    assert parse_hf_config({**base, "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}
                           ).quantization.method == "modelopt"
    for bad, match in [({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"), ({"quant_method": "awq"}, "'awq'"),
                       ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'NVFP4'")]:
        with pytest.raises(ConfigError, match=match):
            parse_hf_config({**base, "quantization_config": bad})


def test_fp8_tensors_need_a_quantization_config_and_scales(tmp_path):
    directory = tmp_path / "fp8"
    shutil.copytree(HF_FIXTURES / "qwen3_next_fp8", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match="declares no FP8 quantization"):
        jaxhybrid.load_model(directory)
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **config["quantization_config"], "weight_block_size": [24, 16]}}))  # the grid transposed
    with pytest.raises(CheckpointError, match="has scales of shape"):
        jaxhybrid.load_model(directory)
