"""Pallas Mamba2 kernels: interpret mode against the reference, CUDA lowering, and the GPU run.

Every hypothesis test keeps one fixed bucket per kernel (and per dtype), so each kernel compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda
from replay_sim import simulate
from ssd_cases import CHUNK, T_PREFILL, T_VERIFY, A, D, G, N, R, S, W, prefill_case, random_pools, random_tokens
from ssd_replay_op import SsdReplay
from varlen_inputs import cu_seqlens, row_lengths

from pallas_kernels.mamba2 import pallas, pallas_prefill, reference
from pallas_kernels.tiles import Dots
from pallas_kernels.varlen import chunk_table
from tests.tolerances import BFloat16, Float32

ON_GPU = jax.default_backend() == "gpu"
# f32: a row's recurrence, N state terms and a chunk's sums.
F32 = Float32(depth=T_PREFILL + N + CHUNK)
# The token-step kernels (decode, verify) compute in f32 on the same bf16 inputs as the reference: only the
# bf16 store of y may differ, by one ulp = 2 u_bf16 (degree 1: bfloat16_atol's (1 + 1) u).
TOLERANCE = {jnp.float32: F32, jnp.bfloat16: BFloat16(degree=1)}
# Prefill dots take activation-dtype operands. A y term has at most 2 rounded factors (y_off = C . bf16(state)
# with the state summed from bf16(x dt decay) . B; y_diag = bf16(CB decay dt) . x), and y is stored in bf16
# (bfloat16_atol's + 1). The f32 state's terms have one. fp16 rounds less (2^-11) than bf16, so the bf16
# bounds hold for it too.
PREFILL_Y = {jnp.float32: F32, jnp.bfloat16: BFloat16(degree=2), jnp.float16: BFloat16(degree=2)}
PREFILL_STATE = {jnp.float32: F32, jnp.bfloat16: BFloat16(degree=1), jnp.float16: BFloat16(degree=1)}
BLOCK_P = 16


def _slots(rng, num_real, count=R):
    """Distinct nonzero slots for the first num_real rows, the null slot for padding rows."""
    return np.where(np.arange(count) < num_real, rng.permutation(np.arange(1, S))[:count], 0).astype(np.int32)


def _as_f32(args):
    """The reference upcasts its inputs first, so fp32 copies give its exact results and one compile."""
    low = (jnp.bfloat16, jnp.float16)
    return {k: (v.astype(jnp.float32) if getattr(v, "dtype", None) in low else v) for k, v in args.items()}


def _assert_close(actual, expected, tolerance):
    tolerance.check(actual, expected)


verify_rows = st.lists(
    st.tuples(st.integers(0, W), st.integers(0, W), st.integers(0, W - 1), st.booleans()), min_size=1, max_size=R
)  # (T_r, committed, ring_start, flush wanted)


def _verify_case(rows, rng, dtype):
    lengths, committed, ring_start, flush = (np.array(v + (0,) * (R - len(rows))) for v in zip(*rows, strict=True))
    args = dict(
        zip(("x", "dt", "B", "C"), random_tokens(rng, T_VERIFY, dtype), strict=True),
        A=A, D=D, cu_seqlens=cu_seqlens(list(lengths), R), slots=_slots(rng, len(rows)),
        ring_start=ring_start.astype(np.int32), committed=committed.astype(np.int32),
        flush=flush.astype(bool) | (committed + lengths > W),  # the contract: no room -> flush
    )  # fmt: skip
    return args, random_pools(rng)


def _check_verify(rows, seed, dtype, interpret):
    args, pools = _verify_case(rows, np.random.default_rng(seed), dtype)
    y_ref, *pools_ref = reference.ssd_verify(**_as_f32(args), **_named_pools(pools))
    y, *pools_out = pallas.ssd_verify(**args, **_named_pools(pools), block_p=BLOCK_P, interpret=interpret)
    _assert_close(y, y_ref, TOLERANCE[dtype])
    _assert_close(pools_out[0], pools_ref[0], F32)
    kept = np.setdiff1d(np.arange(S), args["slots"][args["flush"]])  # only a flush writes S0
    np.testing.assert_array_equal(np.asarray(pools_out[0])[kept], pools[0][kept])
    for ring, ring_ref in zip(pools_out[1:], pools_ref[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(ring), np.asarray(ring_ref))  # appends are exact copies


def _named_pools(pools):
    names = ("state_pool", "ring_x", "ring_dt", "ring_B")
    return {n: jnp.array(p) for n, p in zip(names, pools, strict=True)}


@settings(max_examples=6, deadline=None)
@given(rows=verify_rows, seed=st.integers(0, 2**16), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_verify_interpret_matches_reference(rows, seed, dtype):
    _check_verify(rows, seed, dtype, interpret=True)


def _check_decode(lengths, seed, dtype, interpret):
    rng = np.random.default_rng(seed)
    tokens = dict(zip(("x", "dt", "B", "C"), random_tokens(rng, R, dtype), strict=True))
    args = dict(tokens, A=A, D=D, cu_seqlens=cu_seqlens(lengths, R), slots=_slots(rng, len(lengths)))
    pool = random_pools(rng)[0]
    y_ref, pool_ref = reference.ssd_decode(**args, state_pool=jnp.array(pool))
    y, pool_out = pallas.ssd_decode(**args, state_pool=jnp.array(pool), block_p=BLOCK_P, interpret=interpret)
    _assert_close(y, y_ref, TOLERANCE[dtype])
    _assert_close(pool_out, pool_ref, F32)


@settings(max_examples=4, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 1), min_size=1, max_size=R),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_decode_interpret_matches_reference(lengths, seed, dtype):
    _check_decode(lengths, seed, dtype, interpret=True)


def test_width_one_verify_is_bit_identical_to_decode():
    """ReplaySSM with W = 1 must reproduce plain decoding exactly (docs/kernels.md#replayssm); both kernels share
    one token step."""
    rng = np.random.default_rng(3)
    pools = random_pools(rng)
    pools[1:] = [p[..., :1, :] if p.ndim == 4 else p[..., :1] for p in pools[1:]]  # W = 1
    pools = _named_pools(pools)
    plain, slots, committed = jnp.array(pools["state_pool"]), np.array([3, 1, 0, 0], np.int32), np.zeros(R, np.int32)
    for _ in range(4):
        x, dt, b, c = random_tokens(rng, R, jnp.float32)
        args = (x, dt, A, b, c, D, np.array([0, 1, 2, 2, 2], np.int32))
        y, *rest = pallas.ssd_verify(*args, **pools, slots=slots, ring_start=np.zeros(R, np.int32),
                                     committed=committed, flush=committed > 0, interpret=True)  # fmt: skip
        pools = dict(zip(pools, rest, strict=True))
        y_plain, plain = pallas.ssd_decode(*args, plain, slots, interpret=True)
        np.testing.assert_array_equal(np.asarray(y)[:2], np.asarray(y_plain)[:2])
        committed = np.array([1, 1, 0, 0], np.int32)
    state = pallas.ssd_materialize(**pools, A=A, src_slots=slots, dst_slots=np.array([2, 5, 0, 0], np.int32),
                                   ring_start=np.zeros(R, np.int32), num_entries=committed, interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(state)[[2, 5]], np.asarray(plain)[[3, 1]])


def _check_materialize(num_entries, seed, interpret):
    rng = np.random.default_rng(seed)
    pools, m = random_pools(rng), len(num_entries)
    slot_ids = rng.permutation(np.arange(1, S))
    src, dst = slot_ids[:m].astype(np.int32), slot_ids[m : 2 * m].astype(np.int32)
    dst[rng.uniform(size=m) < 0.3] = 0  # dst 0: skip
    args = dict(A=A, src_slots=src, dst_slots=dst, ring_start=rng.integers(0, W, m).astype(np.int32),
                num_entries=np.array(num_entries, np.int32))  # fmt: skip
    expected = reference.ssd_materialize(**_named_pools(pools), **args)
    state = pallas.ssd_materialize(**_named_pools(pools), **args, block_p=BLOCK_P, interpret=interpret)
    _assert_close(state, expected, F32)
    kept = np.setdiff1d(np.arange(S), dst)
    np.testing.assert_array_equal(np.asarray(state)[kept], pools[0][kept])


@settings(max_examples=5, deadline=None)
@given(num_entries=st.lists(st.integers(0, W), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_materialize_interpret_matches_reference(num_entries, seed):
    _check_materialize(num_entries, seed, interpret=True)


def _check_prefill(lengths, seed, dtype, interpret, block_t=CHUNK, state_parts=1, **overrides):
    """Kernel against the reference (chunk CHUNK) on one case; `overrides` replace its per-row arguments."""
    args, pool = prefill_case(lengths, np.random.default_rng(seed), dtype)
    args.update(overrides)
    y_ref, pool_ref = reference.ssd_prefill(**_as_f32(args), state_pool=jnp.array(pool), chunk_size=CHUNK)
    y, pool_out = pallas_prefill.ssd_prefill(
        **args, state_pool=jnp.array(pool), chunk_size=CHUNK, block_p=BLOCK_P, block_t=block_t,
        state_parts=state_parts, interpret=interpret,
    )  # fmt: skip
    assert y.dtype == dtype
    PREFILL_Y[dtype].check(y, y_ref, "y")
    PREFILL_STATE[dtype].check(pool_out, pool_ref, "state_pool")


# Short rows at the chunk edges, and rows of up to the whole bucket (8 chunks) with edge cases around 4 chunks.
prefill_lengths = st.one_of(row_lengths(CHUNK, T_PREFILL, R), row_lengths(4 * CHUNK, T_PREFILL, R))


@settings(max_examples=8, deadline=None)
@given(lengths=prefill_lengths, seed=st.integers(0, 2**16), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_prefill_interpret_matches_reference(lengths, seed, dtype):
    _check_prefill(lengths, seed, dtype, interpret=True)


def test_prefill_chunk_edge_lengths():
    _check_prefill([CHUNK - 1, CHUNK, CHUNK + 1, 1], seed=5, dtype=jnp.float32, interpret=True)


@pytest.mark.parametrize("state_parts", [1, 2])
def test_prefill_checkpoints_inside_chunks(state_parts):
    """Checkpoints mid-chunk in a row's third chunk, on a chunk boundary, at 0 (the start state), at the end;
    also with the state's N columns split between two programs (f32 at N 256 on a GPU)."""
    lengths, seed = [4 * CHUNK + 3, 2 * CHUNK + 7, CHUNK, 6], 7
    running = prefill_case(lengths, np.random.default_rng(seed), jnp.float32)[0]["slots"]
    spare = np.setdiff1d(np.arange(1, S), running)[:R].astype(np.int32)
    checkpoint_lens = np.array([2 * CHUNK + 5, CHUNK, 0, 6], np.int32)
    _check_prefill(lengths, seed, jnp.float32, interpret=True, state_parts=state_parts,
                   checkpoint_lens=checkpoint_lens, checkpoint_slots=spare)


@pytest.mark.parametrize("state_parts", [1, 2])
def test_prefill_tokens_before_the_first_row_are_padding(state_parts):
    """A grouped prefill's second phase starts at cu_seqlens[0] > 0: the tokens before it must come out zero."""
    lengths = [CHUNK + 3, 2, 0, 20]
    _check_prefill(lengths, seed=4, dtype=jnp.float32, interpret=True, state_parts=state_parts,
                   cu_seqlens=cu_seqlens(lengths, R) + 7)


def test_prefill_state_parts_must_divide_n():
    args, pool = prefill_case([4, 4, 4, 4], np.random.default_rng(0), jnp.float32)
    with pytest.raises(ValueError, match="state_parts=3 must divide the state's N=16"):
        pallas_prefill.ssd_prefill(**args, state_pool=jnp.array(pool), state_parts=3, interpret=True)


def test_prefill_fp16_in_chunks_smaller_than_chunk_size():
    """block_t < chunk_size: the kernel's chunks split the reference's, which changes only the rounding."""
    _check_prefill([3 * CHUNK + 1, CHUNK - 1, 2, 40], seed=9, dtype=jnp.float16, interpret=True, block_t=CHUNK // 2)


def test_chunk_cb_holds_c_bt_of_every_chunk_and_group():
    lengths = [CHUNK + 5, 0, 2 * CHUNK, 3]
    _, _, b, c = random_tokens(np.random.default_rng(2), T_PREFILL, jnp.float32)
    table = chunk_table(cu_seqlens(lengths, R), T_PREFILL, CHUNK)
    cb = np.asarray(pallas_prefill._chunk_cb(b, c, table.starts, table.lengths, block_t=CHUNK,
                                              dots=Dots(jnp.float32, interpret=True)))
    b, c = np.asarray(b), np.asarray(c)
    for j in np.flatnonzero(np.asarray(table.lengths)):
        tokens = slice(int(table.starts[j]), int(table.starts[j] + table.lengths[j]))
        expected = np.zeros((G, CHUNK, CHUNK), np.float32)
        expected[:, : table.lengths[j], : table.lengths[j]] = np.einsum("lgn,sgn->gls", c[tokens], b[tokens])
        Float32(depth=N).check(cb[j], expected, f"chunk {j}")


# Nemotron-H Mamba2: 128 heads of P = 64, state N = 128, 8 groups, chunk 128.
NEMO_NH, NEMO_P, NEMO_G, NEMO_N, NEMO_S, NEMO_R = 128, 64, 8, 128, 9, 8


def _spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _nemotron_tokens(num_tokens, dtype=jnp.bfloat16):
    return [
        _spec(num_tokens, NEMO_NH, NEMO_P, dtype=dtype),
        _spec(num_tokens, NEMO_NH),
        _spec(NEMO_NH),
        _spec(num_tokens, NEMO_G, NEMO_N, dtype=dtype),
        _spec(num_tokens, NEMO_G, NEMO_N, dtype=dtype),
        _spec(NEMO_NH),
        _spec(NEMO_R + 1, dtype=jnp.int32),
    ]


def _nemotron_rings(width):
    return [
        _spec(NEMO_S, NEMO_NH, width, NEMO_P),
        _spec(NEMO_S, NEMO_NH, width),
        _spec(NEMO_S, NEMO_G, width, NEMO_N),
    ]


@pytest.mark.parametrize("block_p, dtype", [(16, jnp.bfloat16), (32, jnp.bfloat16), (16, jnp.float32)])
def test_verify_lowers_for_cuda_at_model_shapes(block_p, dtype):
    width, rows = 8, [_spec(NEMO_R, dtype=jnp.int32)] * 3 + [_spec(NEMO_R, dtype=jnp.bool_)]
    pool = _spec(NEMO_S, NEMO_NH, NEMO_P, NEMO_N)
    args = [*_nemotron_tokens(NEMO_R * 4, dtype), pool, *_nemotron_rings(width), *rows]
    assert TRITON_CALL in lower_for_cuda(functools.partial(pallas.ssd_verify, block_p=block_p), *args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_decode_lowers_for_cuda_at_model_shapes(dtype):
    args = [*_nemotron_tokens(NEMO_R, dtype), _spec(NEMO_S, NEMO_NH, NEMO_P, NEMO_N), _spec(NEMO_R, dtype=jnp.int32)]
    assert TRITON_CALL in lower_for_cuda(functools.partial(pallas.ssd_decode, block_p=16), *args)


def test_materialize_lowers_for_cuda_at_model_shapes():
    entries = [_spec(4, dtype=jnp.int32)] * 4
    args = [_spec(NEMO_S, NEMO_NH, NEMO_P, NEMO_N), *_nemotron_rings(8), _spec(NEMO_NH), *entries]
    assert TRITON_CALL in lower_for_cuda(functools.partial(pallas.ssd_materialize, block_p=32), *args)


_PREFILL_ROWS = [_spec(NEMO_R, dtype=jnp.int32), _spec(NEMO_R, dtype=jnp.bool_)] + [_spec(NEMO_R, dtype=jnp.int32)] * 2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("block_t", [64, 128])
def test_prefill_lowers_for_cuda_at_model_shapes(block_t, dtype):
    """8k tokens: two Triton kernels (C Bᵀ per chunk and group, then the scan), the tokens passed unpadded."""
    args = [*_nemotron_tokens(8192, dtype), _spec(NEMO_S, NEMO_NH, NEMO_P, NEMO_N), *_PREFILL_ROWS]
    fn = functools.partial(pallas_prefill.ssd_prefill, chunk_size=128, block_p=32, block_t=block_t)
    text = lower_for_cuda(fn, *args)
    assert text.count(TRITON_CALL) == 2
    assert "stablehlo.pad" not in text


def test_prefill_rejects_mixed_activation_dtypes():
    args = [*_nemotron_tokens(256), _spec(NEMO_S, NEMO_NH, NEMO_P, NEMO_N), *_PREFILL_ROWS]
    args[3] = _spec(256, NEMO_G, NEMO_N)  # f32 B beside bf16 x and C
    with pytest.raises(ValueError, match="share one dtype"):
        lower_for_cuda(pallas_prefill.ssd_prefill, *args)


def test_prefill_at_head_dim_80_lowers_with_16_wide_tiles():
    """Nemotron-Nano-9B-v2 has P = 80: five P tiles of 16."""
    rows = [_spec(NEMO_R, dtype=jnp.int32), _spec(NEMO_R, dtype=jnp.bool_)]
    tokens = _nemotron_tokens(256)
    tokens[0] = _spec(256, NEMO_NH, 80, dtype=jnp.bfloat16)
    args = [*tokens, _spec(NEMO_S, NEMO_NH, 80, NEMO_N), *rows]
    assert TRITON_CALL in lower_for_cuda(functools.partial(pallas_prefill.ssd_prefill, block_p=32), *args)


def test_prefill_rejects_tiles_too_small_for_triton_dots():
    rows = [_spec(NEMO_R, dtype=jnp.int32), _spec(NEMO_R, dtype=jnp.bool_)]
    args = [*_nemotron_tokens(256), _spec(NEMO_S, NEMO_NH, NEMO_P, NEMO_N), *rows]
    with pytest.raises(ValueError, match="tiles >= 16"):
        lower_for_cuda(functools.partial(pallas_prefill.ssd_prefill, chunk_size=8), *args)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@settings(max_examples=5, deadline=None)
@given(
    rows=verify_rows,
    num_entries=st.lists(st.integers(0, W), min_size=3, max_size=3),
    lengths=prefill_lengths,
    seed=st.integers(0, 2**16),
)
def test_compiled_kernels_match_reference_on_gpu(rows, num_entries, lengths, seed):
    _check_verify(rows, seed, jnp.float32, interpret=False)
    _check_decode([1, 0, 1], seed, jnp.float32, interpret=False)
    _check_materialize(num_entries, seed, interpret=False)
    _check_prefill(lengths, seed, jnp.float32, interpret=False)
    _check_prefill(lengths, seed, jnp.bfloat16, interpret=False)


def test_public_ops_dispatch_to_the_kernel_in_a_replay_stream():
    """The public ops with backend="interpret" through the engine's verify/commit loop (test_mamba2_replay)."""
    rows, _, initial = simulate(SsdReplay(backend="interpret"), 4, 3, seed=11, garbage_seed=12, steps=10)
    assert max(r.wraps for r in rows) >= 1
    for row in rows:
        y_ref, _ = SsdReplay.oracle(row.stream, initial[0][row.slot], len(row.stream[0]))
        for position, y in row.outputs:
            F32.check(y, y_ref[position])


@pytest.mark.parametrize(("state_size", "dtype", "tiles"), [
    (NEMO_N, jnp.bfloat16, "block_p_32_block_t_64_state_parts_1"),
    (256, jnp.bfloat16, "block_p_16_block_t_32_state_parts_1"),
    (NEMO_N, jnp.float32, "block_p_32_block_t_16_state_parts_1"),
    (256, jnp.float32, "block_p_16_block_t_16_state_parts_2")])
def test_prefill_default_tiles_shrink_at_state_size_256_and_for_f32(state_size, dtype, tiles):
    """Nemotron-H 47B/56B have N = 256, where the 32 x 64 tiles spilled registers on sm_90 and 16 x 32 did not;
    f32's 3xTF32 dots spill at every block_t above 16, and at N 256 unless two programs split the state
    (benchmarks/aot_kernels.py)."""
    rows = [_spec(NEMO_R, dtype=jnp.int32), _spec(NEMO_R, dtype=jnp.bool_)]
    tokens = _nemotron_tokens(256, dtype)
    tokens[3:5] = [_spec(256, NEMO_G, state_size, dtype=dtype)] * 2
    args = [*tokens, _spec(NEMO_S, NEMO_NH, NEMO_P, state_size), *rows]
    assert f"ssd_prefill_{tiles}" in lower_for_cuda(pallas_prefill.ssd_prefill, *args)
