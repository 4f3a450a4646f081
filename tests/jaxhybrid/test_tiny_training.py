"""The training-only ops compute the same model as the inference ops on fixed [B, L] batches."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.hybrid import HybridLM
from jaxhybrid.models.model import init_params
from jaxhybrid.tiny.fast_ops import TRAINING_OPS
from jaxhybrid.tiny.recipe import hf_config
from jaxhybrid.tiny.train import forward, windows
from tests.tolerances import assert_float32_close, model_depth


def test_training_ops_match_inference_ops():
    # The default model's recipe cut to one GDN, GDN, attention group to keep compile times short.
    config = hf_config(vocab_size=256, eos_token_id=0, max_len=256)
    config.update(num_hidden_layers=3, layer_types=config["layer_types"][:3])
    cfg = parse_hf_config(config)
    params = init_params(cfg, seed=1)
    # Move every param off its init (zero-centred norms, A_log = 0, ...) so no convention hides.
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = tree.unflatten([p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 128)), jnp.int32)
    expected = jax.jit(lambda p, t: forward(HybridLM(cfg), p, t))(params, tokens)
    trained = jax.jit(lambda p, t: forward(HybridLM(cfg, TRAINING_OPS), p, t))(params, tokens)
    for want, got in zip(expected, trained, strict=True):  # same maths, other op orders: float32 rounding
        assert_float32_close(got, want, model_depth(cfg, tokens.shape[1]))


def test_windows_drop_the_short_tail():
    assert windows(np.arange(10, dtype=np.int32), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
