"""bf16 recurrent states (--mamba-ssm-cache-dtype bfloat16): the kernels read a slot's state as f32, compute in
f32 and round once when they store it; the pool keeps its dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from gdn_replay_op import GdnReplay
from lowering import TRITON_CALL, lower_for_cuda

from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_prefill
from pallas_kernels.gdn import pallas as gdn_pallas
from pallas_kernels.mamba2 import pallas as ssd_pallas
from pallas_kernels.mamba2 import pallas_prefill as ssd_prefill
from tests.tolerances import BFloat16

CU, SLOTS = np.array([0, 1, 2, 2], np.int32), np.array([3, 1, 0], np.int32)
MATERIALIZE = (SLOTS, np.array([2, 5, 0], np.int32), np.array([3, 1, 0], np.int32), np.array([4, 2, 0], np.int32))


def _bf16_pools(seed):
    """GDN pools whose states are bf16 values, as an f32 and a bf16 state pool, and two decode tokens."""
    rng = np.random.default_rng(seed)
    pools = GdnReplay.make_pools(4, rng)
    pools[0] = pools[0].astype(jnp.bfloat16).astype(np.float32)
    return pools, [pools[0].astype(jnp.bfloat16), *pools[1:]], GdnReplay.tokens(rng, 2)


def test_reference_rounds_the_f32_result_once():
    f32, bf16, tokens = _bf16_pools(1)
    o_ref, state_ref = gdn_decode(*tokens, CU, f32[0].copy(), SLOTS, backend="reference")
    o, state = gdn_decode(*tokens, CU, bf16[0].copy(), SLOTS, backend="reference")
    assert state.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))  # the same f32 state read
    np.testing.assert_array_equal(np.asarray(state), np.asarray(state_ref.astype(jnp.bfloat16)))
    expected = gdn_materialize(*[p.copy() for p in f32], *MATERIALIZE, backend="reference")
    got = gdn_materialize(*bf16, *MATERIALIZE, backend="reference")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected.astype(jnp.bfloat16)))


def test_interpret_kernels_on_a_bf16_state_pool_match_the_f32_reference():
    f32, bf16, tokens = _bf16_pools(2)
    o_ref, state_ref = gdn_decode(*tokens, CU, f32[0].copy(), SLOTS, backend="reference")
    o, state = gdn_decode(*tokens, CU, bf16[0], SLOTS, backend="interpret")
    assert state.dtype == jnp.bfloat16
    BFloat16(degree=1).check(np.asarray(o), np.asarray(o_ref))  # f32 math on the same state: only fold order
    BFloat16(degree=1).check(np.asarray(state, np.float32), np.asarray(state_ref))


def _spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_kernels_lower_for_cuda_with_bf16_state_pools():
    """Every kernel that reads or writes a state pool in place: GDN and Mamba2 prefill, decode, verify, materialize."""
    i32, bf16, rows, slots = jnp.int32, jnp.bfloat16, 4, 9
    per_row, cu, width = _spec(rows, dtype=i32), _spec(rows + 1, dtype=i32), 4
    flush = _spec(rows, dtype=jnp.bool_)
    tokens = 16
    # GDN: 2 qk heads, 4 value heads, K = V = 16
    gdn_tokens = (_spec(tokens, 2, 16, dtype=bf16),) * 2 + (_spec(tokens, 4, 16, dtype=bf16), _spec(tokens, 4),
                                                            _spec(tokens, 4))
    state = _spec(slots, 4, 16, 16, dtype=bf16)
    rings = (_spec(slots, 2, width, 16), _spec(slots, 4, width, 16), _spec(slots, 4, width))
    gdn = [
        (functools.partial(gdn_pallas.gdn_decode, interpret=False), (*gdn_tokens, cu, state, per_row)),
        (functools.partial(gdn_pallas.gdn_verify, interpret=False),
         (*gdn_tokens, cu, state, *rings, per_row, per_row, per_row, flush)),
        (functools.partial(gdn_pallas.gdn_materialize, interpret=False), (state, *rings, *(per_row,) * 4)),
        (functools.partial(gdn_prefill, backend="pallas"),
         (*gdn_tokens, cu, state, per_row, flush, per_row, per_row)),
    ]
    # Mamba2: 16 heads of P 16, 2 groups of N 16
    ssd_tokens = (_spec(tokens, 16, 16, dtype=bf16), _spec(tokens, 16), _spec(16), _spec(tokens, 2, 16, dtype=bf16),
                  _spec(tokens, 2, 16, dtype=bf16), _spec(16))
    ssd_state = _spec(slots, 16, 16, 16, dtype=bf16)
    ssd_rings = (_spec(slots, 16, width, 16), _spec(slots, 16, width), _spec(slots, 2, width, 16))
    ssd = [
        (functools.partial(ssd_pallas.ssd_decode, block_p=16), (*ssd_tokens, cu, ssd_state, per_row)),
        (functools.partial(ssd_pallas.ssd_verify, block_p=16),
         (*ssd_tokens, cu, ssd_state, *ssd_rings, per_row, per_row, per_row, flush)),
        (functools.partial(ssd_pallas.ssd_materialize, block_p=16),
         (ssd_state, *ssd_rings, _spec(16), *(per_row,) * 4)),
        (functools.partial(ssd_prefill.ssd_prefill, chunk_size=16, block_p=16),
         (*ssd_tokens, cu, ssd_state, per_row, flush, per_row, per_row)),
    ]
    for fn, args in gdn + ssd:
        assert TRITON_CALL in lower_for_cuda(fn, *args)
