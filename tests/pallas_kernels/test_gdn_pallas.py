"""GDN Pallas kernels: interpret mode against the reference, and CUDA lowering at model shapes."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import CHUNK, KERNEL_CHUNK, R, S, T, prefill_inputs
from gdn_replay_op import GdnReplay
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda
from replay_sim import simulate
from varlen_inputs import row_lengths

from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_prefill, gdn_verify, pallas
from tests.tolerances import BFloat16, Float32

ON_GPU = jax.default_backend() == "gpu"
TOL = Float32(depth=T + 16 + KERNEL_CHUNK)  # a row's recurrence, K = 16 state terms, a chunk's triangular solve
BF16_TOL = BFloat16(degree=3)  # q k^T v
# Prefill with half-precision q, k, v against the f32 reference on the same values upcast, so only the
# kernel's own roundings count. The longest chain of them behind one output: o = (q^ k^T . Gamma) v_new
# rounds q^, k^ and their product (3) and reads v_new (1); v_new = u - w h, u = (I + A)^-1 (beta v) rounds
# (I + A)^-1 and beta v and is stored (3); A = beta k^ k^T . Gamma inherits k^'s rounding twice (2), which
# the solve passes on unamplified here: unit keys, beta < 1 and decays keep (I + A)^-1's entries O(1) (the
# w h path is one rounding shorter). 9 factors; BFloat16 adds the output's own rounding. fp16 (u = 2^-11)
# is inside the bf16 bound.
HALF_PREFILL_TOL = BFloat16(degree=9)


def _assert_close(out, ref, tol):
    for x, x_ref in zip(out, ref, strict=True):
        tol.check(np.asarray(x, np.float32), np.asarray(x_ref, np.float32))


def _compare_prefill(inputs, backend, tol, ref_inputs=None, chunk_size=CHUNK):
    """`backend` at chunk_size on inputs against the reference, chunked by its own 16, on ref_inputs
    (default: the same inputs). Returns the kernel's (o, state_pool)."""
    ref_inputs = dict(ref_inputs or inputs, state_pool=inputs["state_pool"].copy())
    ref = gdn_prefill(**ref_inputs, backend="reference")
    out = gdn_prefill(**inputs, chunk_size=chunk_size, backend=backend)
    _assert_close(out, ref, tol)
    return out


@settings(max_examples=4, deadline=None)
@given(lengths=row_lengths(CHUNK, T, R), seed=st.integers(0, 2**16))
def test_prefill_interpret_matches_reference(lengths, seed):
    _compare_prefill(prefill_inputs(lengths, seed), "interpret", TOL)


# Rows of 70 (two chunks of 64), 25 and 1 token fill the bucket: the last chunk runs past T.
EDGE_LENGTHS = [70, 25, 1]


@pytest.mark.parametrize(
    "checkpoint_lens",
    [[64, 25, 0], [32, 0, 1], [70, 17, 1]],
    ids=["chunk-end", "in-chunk-block-edge-and-start", "row-end-and-mid-chunk"],
)
def test_prefill_chunk64_checkpoints(checkpoint_lens):
    inputs = prefill_inputs(EDGE_LENGTHS, 8)
    inputs["has_initial"] = np.array([True, False, True, False])
    inputs["checkpoint_lens"] = np.array(checkpoint_lens + [0], np.int32)
    inputs["checkpoint_slots"] = np.array([9, 10, 11, 0], np.int32)
    inputs["slots"] = np.array([3, 4, 5, 0], np.int32)
    before = inputs["state_pool"].copy()
    _, pool = _compare_prefill(inputs, "interpret", TOL, chunk_size=KERNEL_CHUNK)
    written = [3, 4, 5, 9, 10, 11]
    assert not np.isclose(np.asarray(pool)[written], before[written]).all(axis=(1, 2, 3)).any()
    untouched = np.setdiff1d(np.arange(S), written)
    np.testing.assert_array_equal(np.asarray(pool)[untouched], before[untouched])


def test_prefill_near_identical_keys():
    inputs = prefill_inputs(EDGE_LENGTHS, 6)
    inputs["k"] = inputs["k"][:1] + 0.01 * inputs["k"]  # (I + A) ~ all-ones lower triangle, see reference test
    inputs["g"], inputs["beta"] = np.zeros_like(inputs["g"]), np.ones_like(inputs["beta"])
    _compare_prefill(inputs, "interpret", TOL, chunk_size=KERNEL_CHUNK)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_prefill_half_precision_inputs_fp32_state(dtype):
    inputs = prefill_inputs(EDGE_LENGTHS, 4, dtype)
    upcast = {name: inputs[name].astype(jnp.float32) for name in ("q", "k", "v")}
    o, pool = _compare_prefill(inputs, "interpret", HALF_PREFILL_TOL, dict(inputs, **upcast), KERNEL_CHUNK)
    assert o.dtype == dtype and pool.dtype == jnp.float32


@pytest.mark.parametrize("chunk_size", [8, 48])
def test_prefill_kernel_rejects_chunks_not_made_of_16_row_blocks(chunk_size):
    with pytest.raises(ValueError, match="power of two >= 16"):
        gdn_prefill(**prefill_inputs([5], 0), chunk_size=chunk_size, backend="interpret")


@settings(max_examples=3, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_verify_interpret_matches_reference(max_drafts, seed):
    runs = [simulate(GdnReplay(b), 4, max_drafts, seed, seed + 1, steps=12) for b in ("reference", "interpret")]
    (rows_ref, pools_ref, _), (rows, pools, _) = runs
    for row_ref, row in zip(rows_ref, rows, strict=True):
        for (_, o_ref), (_, o) in zip(row_ref.outputs, row.outputs, strict=True):
            TOL.check(o, o_ref)
    for pool_ref, pool in zip(pools_ref, pools, strict=True):
        TOL.check(pool, pool_ref)


@pytest.mark.parametrize(
    "backend",
    [
        "interpret",
        pytest.param("pallas", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]),
    ],
)
def test_decode_and_materialize_match_reference(backend):
    rng = np.random.default_rng(5)
    pools = GdnReplay.make_pools(4, rng)
    tokens = GdnReplay.tokens(rng, 4)
    cu, slots = np.array([0, 1, 2, 2], np.int32), np.array([3, 1, 0], np.int32)
    o_ref, state_ref = gdn_decode(*tokens, cu, pools[0].copy(), slots, backend="reference")
    o, state = gdn_decode(*tokens, cu, pools[0].copy(), slots, backend=backend)
    TOL.check(o, o_ref)
    TOL.check(state, state_ref)
    args = (slots, np.array([2, 5, 0], np.int32), np.array([3, 1, 0], np.int32), np.array([4, 2, 0], np.int32))
    expected = gdn_materialize(*[p.copy() for p in pools], *args, backend="reference")
    TOL.check(gdn_materialize(*pools, *args, backend=backend), expected)


def test_width_one_interpret_is_bit_identical_to_plain_decoding():
    rng = np.random.default_rng(3)
    pools = GdnReplay.make_pools(1, rng)
    plain = pools[0].copy()
    slots, committed = np.array([3, 1, 0], np.int32), np.zeros(3, np.int32)
    for _ in range(5):
        tokens = GdnReplay.tokens(rng, 3)
        cu = np.array([0, 1, 2, 2], np.int32)
        o, *pools = gdn_verify(*tokens, cu, *pools, slots, 0 * slots, committed, committed > 0, backend="interpret")
        o_plain, plain = gdn_decode(*tokens, cu, plain, slots, backend="interpret")
        np.testing.assert_array_equal(o[:2], o_plain[:2])
        committed = np.array([1, 1, 0], np.int32)


def test_bf16_inputs_fp32_state():
    rng = np.random.default_rng(9)
    pools = GdnReplay.make_pools(4, rng)
    exact = GdnReplay.tokens(rng, 6)
    tokens = [x.astype(jnp.bfloat16) if i < 3 else x for i, x in enumerate(exact)]  # q, k, v in bf16
    cu, slots = np.array([0, 3, 5, 5], np.int32), np.array([3, 1, 0], np.int32)
    trackers = (slots, np.array([1, 3, 0], np.int32), np.array([1, 0, 0], np.int32), np.array([False, True, False]))
    ref = gdn_verify(*exact, cu, *[p.copy() for p in pools], *trackers, backend="reference")
    out = gdn_verify(*tokens, cu, *pools, *trackers, backend="interpret")
    assert out[0].dtype == jnp.bfloat16
    _assert_close(out, ref, BF16_TOL)


def _model_shapes(num_heads):
    """Qwen3-Next-like GDN layer: dk = dv = 128, H = HV / 2, 64 tokens in 16 verify rows, W = 8."""
    sd, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    tokens, rows, slots, width, h = 64, 16, 33, 8, num_heads // 2
    token_args = (sd((tokens, h, 128), jnp.bfloat16),) * 2 + (
        sd((tokens, num_heads, 128), jnp.bfloat16), sd((tokens, num_heads), f32), sd((tokens, num_heads), f32),
    )  # fmt: skip
    pools = (
        sd((slots, num_heads, 128, 128), f32), sd((slots, h, width, 128), f32),
        sd((slots, num_heads, width, 128), f32), sd((slots, num_heads, width), f32),
    )  # fmt: skip
    return token_args, sd((rows + 1,), i32), pools, sd((rows,), i32)


@settings(max_examples=2, deadline=None)
@given(num_heads=st.sampled_from([16, 32]))
def test_kernels_lower_for_cuda(num_heads):
    token_args, cu, pools, per_row = _model_shapes(num_heads)
    flush = jax.ShapeDtypeStruct(per_row.shape, jnp.bool_)
    verify = functools.partial(pallas.gdn_verify, interpret=False)
    assert TRITON_CALL in lower_for_cuda(verify, *token_args, cu, *pools, per_row, per_row, per_row, flush)
    decode = functools.partial(pallas.gdn_decode, interpret=False)
    assert TRITON_CALL in lower_for_cuda(decode, *token_args, cu, pools[0], per_row)
    materialize = functools.partial(pallas.gdn_materialize, interpret=False)
    assert TRITON_CALL in lower_for_cuda(materialize, *pools, *(per_row,) * 4)


@pytest.mark.parametrize(("dtype", "chunk"), [(jnp.bfloat16, 64), (jnp.float32, 16)])
def test_prefill_lowers_for_cuda_at_qwen3_next_shapes(dtype, chunk):
    """H 16, HV 32, K = V = 128, an 8k-token bucket of 4 rows: all three calls reach Triton, in chunks of 64, or
    of 16 for f32 activations, whose 3xTF32 dots spill in longer chunks (benchmarks/aot_kernels.py)."""
    sd, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    tokens, rows, slots = 8192, 4, 9
    token_args = (sd((tokens, 16, 128), dtype),) * 2 + (
        sd((tokens, 32, 128), dtype), sd((tokens, 32), f32), sd((tokens, 32), f32),
    )  # fmt: skip
    per_row = sd((rows,), i32)
    row_args = (per_row, sd((rows,), jnp.bool_), per_row, per_row)
    prefill = functools.partial(gdn_prefill, backend="pallas")
    text = lower_for_cuda(prefill, *token_args, sd((rows + 1,), i32), sd((slots, 32, 128, 128), f32), *row_args)
    assert text.count(TRITON_CALL) == 3
    assert len(set(re.findall(rf'name = "gdn_prefill_\w+_chunk_size_{chunk}"', text))) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_compiled_kernels_match_reference():
    _compare_prefill(prefill_inputs([0, 1, 15, 16, 17, 33][:R], seed=0), "pallas", TOL)
    rows_ref, pools_ref, _ = simulate(GdnReplay("reference"), 4, 3, 1, 2, steps=12)
    rows, pools, _ = simulate(GdnReplay("pallas"), 4, 3, 1, 2, steps=12)
    for row_ref, row in zip(rows_ref, rows, strict=True):
        _assert_close([o for _, o in row.outputs], [o for _, o in row_ref.outputs], TOL)
    _assert_close(pools, pools_ref, TOL)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_nan_in_an_unused_slot_reaches_nothing(backend):
    inputs = prefill_inputs([CHUNK + 1, 0, 3], seed=2)
    unused = np.setdiff1d(np.arange(1, S), np.concatenate([inputs["slots"], inputs["checkpoint_slots"]]))[0]
    inputs["state_pool"][unused] = np.nan
    o, pool = gdn_prefill(**inputs, chunk_size=CHUNK, backend=backend)
    assert np.isfinite(o).all()
    assert np.isnan(np.asarray(pool)[unused]).all()
    assert np.isfinite(np.delete(np.asarray(pool), unused, axis=0)).all()
