"""The engine's runner on CPU with the FFI kernels and unrolled layers packs a bf16 model's matmul weights for them
(`pallas_kernels.matmul.cpu.packed_params`), shares the packed params with its model, and serves from them."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxhybrid
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.models.fp8_weights import is_matmul_weight
from jaxhybrid.models.model import Model
from jaxhybrid.models.ops import ModelOps
from pallas_kernels.matmul import cpu as matmul_cpu
from tests.hf_fixtures import HF_FIXTURES, fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, run_to_completion

TOKENS = np.random.default_rng(0).integers(0, 256, (1, 20))


def _packed_paths(params) -> set[str]:
    return {jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            if matmul_cpu.is_packed(leaf)}


def test_a_bf16_engine_packs_its_matmul_weights_and_serves_from_them():
    low = jaxhybrid.load_model(HF_FIXTURES / "qwen3_next", dtype=jnp.bfloat16)
    unpacked = low(TOKENS)
    expected = {jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(low.params)[0]
                if is_matmul_weight(tuple(str(key.key) for key in path)) and matmul_cpu.packs(leaf)}
    assert len(expected) > 10
    for ops in (ModelOps(cpu_kernels="reference", scan_layers=False), ModelOps(cpu_kernels="ffi")):
        other = Model(low.config, low.params, ops=ops)
        engine_for(other)
        assert not _packed_paths(other.params)  # the reference path, and a layer scan, keep the checkpoint's layout

    model = Model(low.config, low.params, ops=ModelOps(cpu_kernels="ffi", scan_layers=False))
    engine = engine_for(model)
    assert _packed_paths(model.params) == expected  # every Dense kernel and expert stack of whole strips
    # the full forward on the packed params runs the kernels and agrees with the checkpoint's layout as the bf16
    # load agrees with f32 (tests/jaxhybrid/test_weights.py)
    packed, full = np.asarray(model(TOKENS), np.float32), np.asarray(fixture_model("qwen3_next")(TOKENS))
    assert np.abs(packed - np.asarray(unpacked, np.float32)).max() < 0.1 * np.abs(full).max()
    assert (packed.argmax(-1) == full.argmax(-1)).mean() >= 0.9
    # the engine's steps read the same packed weights: each greedy token is the full forward's best on the same
    # tokens, or within the bf16 bound above of it (a decode step's XLA ops round apart from a prefill's)
    prompt = [int(t) for t in TOKENS[0]]
    engine.add_request("r", Prompt(tuple(prompt)), jaxhybrid.SamplingParams(max_tokens=6, temperature=0.0,
                                                                            ignore_eos=True))
    tokens = list(run_to_completion(engine)["r"].outputs[0].token_ids)
    assert len(tokens) == 6
    logits = np.asarray(model(np.array([prompt + tokens])), np.float32)[0, len(prompt) - 1:-1]
    chosen = logits[np.arange(len(tokens)), tokens]
    assert (chosen >= logits.max(-1) - 0.1 * np.abs(full).max()).all(), (chosen, logits.max(-1))
