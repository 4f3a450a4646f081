"""One full forward == chunked prefill with carried states == prefill + one-token decode steps (float32).

The paths compute the same maths in different orders (a chunk's WY form, the token recurrence, other
matmul blockings), so they agree to float32 rounding, which grows with the number of recurrent steps a
logit went through: `tests.tolerances.model_depth(config, steps)` rounds deep (the positions summed by
every mixer plus the projections on the way), checked with `assert_float32_close`. A wrong carried
state is off by O(|logit|), three orders of magnitude above that bound.
"""

import functools

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings

from jaxhybrid.model import Model, contiguous_batch
from jaxhybrid.models.ops import RECURRENT
from tests.hf_fixtures import fixture_model
from tests.tolerances import assert_float32_close, model_depth

MAX_LEN = 160
CHUNK_BUCKET = 64  # every multi-token chunk is padded to one bucket, so each model compiles twice
FAMILIES = st.sampled_from(["qwen3_next", "nemotron_h", "qwen3_5_text"])


@functools.cache
def _sequence_and_full_logits(family: str) -> tuple[np.ndarray, np.ndarray]:
    model = fixture_model(family)
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, MAX_LEN)
    return tokens, np.asarray(model(tokens[None]))[0]


def _run_chunks(model: Model, tokens: np.ndarray, chunk_lens: list[int]) -> np.ndarray:
    """Feed one row chunk by chunk with its cache carried between calls; returns the logits of every token."""
    max_blocks = -(-MAX_LEN // model.block_size)
    cache, done, logits = model.init_cache(1, MAX_LEN), 0, []
    for n in chunk_lens:
        bucket = 1 if n == 1 else CHUNK_BUCKET
        padded = np.zeros(bucket, np.int32)
        padded[:n] = tokens[done : done + n]
        batch = contiguous_batch([n], [done], model.block_size, max_blocks, num_tokens=bucket)
        out, _, cache = model.step(jnp.asarray(padded), batch, cache)
        logits.append(np.asarray(out[:n]))
        done += n
    return np.concatenate(logits)


@st.composite
def chunkings(draw):
    """A prefix length and a split of it into chunks: fixed sizes 1/7/64, random sizes, or prefill + decode."""
    length = draw(st.integers(1, MAX_LEN))
    kind = draw(st.sampled_from(["fixed", "random", "decode"]))
    if kind == "fixed":
        size = draw(st.sampled_from([1, 7, 64]))
        chunks = [size] * (length // size) + ([length % size] if length % size else [])
    elif kind == "decode":
        prefill = draw(st.integers(1, min(length, CHUNK_BUCKET)))
        chunks = [prefill] + [1] * (length - prefill)
    else:
        chunks = []
        while sum(chunks) < length:
            chunks.append(min(draw(st.integers(1, CHUNK_BUCKET)), length - sum(chunks)))
    return chunks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=FAMILIES, chunks=chunkings())
def test_chunked_prefill_and_decode_match_full_forward(family, chunks):
    tokens, full = _sequence_and_full_logits(family)
    logits = _run_chunks(fixture_model(family), tokens, chunks)
    model = fixture_model(family)
    assert_float32_close(logits, full[: sum(chunks)], model_depth(model.config, sum(chunks)), f"{family} {chunks}")


@settings(max_examples=6, deadline=None)
@given(family=FAMILIES, progress=st.lists(st.integers(0, 40), min_size=2, max_size=3))
def test_packed_rows_match_single_rows(family, progress):
    """Rows at different offsets (some with zero new tokens) packed in one call equal their own full forwards."""
    model, (tokens, full) = fixture_model(family), _sequence_and_full_logits(family)
    num_rows, new = len(progress), 8
    max_blocks = -(-MAX_LEN // model.block_size)
    cache = model.init_cache(num_rows, MAX_LEN)
    # Bring each row to its own context length with one packed prefill, then run `new` tokens for all of them.
    for query_lens, before in ((progress, [0] * num_rows), ([new] * num_rows, progress)):
        padded = np.zeros(128, np.int32)
        cu = np.concatenate([[0], np.cumsum(query_lens)])
        for r in range(num_rows):
            padded[cu[r] : cu[r + 1]] = tokens[before[r] : before[r] + query_lens[r]]
        batch = contiguous_batch(list(query_lens), list(before), model.block_size, max_blocks, num_tokens=128)
        out, _, cache = model.step(jnp.asarray(padded), batch, cache)
    for r in range(num_rows):
        expected = full[progress[r] : progress[r] + new]
        depth = model_depth(model.config, progress[r] + new)
        assert_float32_close(out[cu[r] : cu[r + 1]], expected, depth, f"{family} row {r} of {progress}")


def test_recurrent_kernels_match_chunked_kernels():
    """The token-recurrent GDN / SSD path (decode) gives the chunked path's logits."""
    for family in ("qwen3_next", "nemotron_h"):
        chunked = fixture_model(family)
        recurrent = Model(chunked.config, chunked.params, ops=RECURRENT)
        tokens, full = _sequence_and_full_logits(family)
        assert_float32_close(_run_chunks(recurrent, tokens, [40, 1, 1, 1]), full[:43], model_depth(chunked.config, 43))
