"""The MTP head: drafts token t+2 from h_t and token t+1; its KV cache carries across chunks."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.model import contiguous_batch
from tests.hf_fixtures import fixture_model
from tests.tolerances import assert_float32_close, model_depth

LENGTH = 40


def _mtp_logits(model, tokens, chunks):
    """Target forward once, then the MTP head over positions 0..L-2 in the given chunks."""
    max_blocks = -(-LENGTH // model.block_size)
    cache = model.init_cache(1, LENGTH)
    _, hidden, cache = model.step(jnp.asarray(tokens), contiguous_batch([LENGTH], [0], model.block_size, max_blocks),
                                  cache)
    done, out = 0, []
    for n in chunks:
        batch = contiguous_batch([n], [done], model.block_size, max_blocks)
        logits, _, cache = model.mtp(jnp.asarray(tokens[done + 1 : done + 1 + n]), hidden[done : done + n], batch,
                                     cache)
        out.append(np.asarray(logits))
        done += n
    return np.concatenate(out)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_mtp_chunked_equals_one_call(family):
    model = fixture_model(family)
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, LENGTH).astype(np.int32)
    whole = _mtp_logits(model, tokens, [LENGTH - 1])
    # The MTP layer adds one attention layer and the fc projection to the target's depth.
    depth = model_depth(model.config, LENGTH) + LENGTH + 2 * model.config.hidden_size
    assert_float32_close(_mtp_logits(model, tokens, [20, 1, 1, 17]), whole, depth)
    target = np.asarray(model(tokens[None]))[0]
    assert np.abs(whole - target[:-1]).max() > 1.0  # the MTP head is its own module, not the LM head again


def test_mtp_without_mtp_layers_is_an_error():
    model = fixture_model("nemotron_h")
    with pytest.raises(ValueError, match="no MTP layers"):
        model.mtp(None, None, None, None)
