"""On a GPU: the compiled kernels against their pure-JAX references where the per-op GPU tests stop at f32 or leave an
op out (bf16 through GDN's prefill and the GDN and SSD token steps, the snapshot-every-position baseline, grouped
prefill), and the Triton calls of the public ops' lowering on this GPU (the kernels run compiled, not interpreted).

Run on a lent GPU by `benchmarks/gpu_session.sh` (`pytest -m gpu`); skipped without one. The cases and tolerances
are the per-op tests', with backend "pallas" (Triton) in place of "interpret".
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import KERNEL_CHUNK, prefill_inputs
from gdn_replay_op import GdnReplay
from lowering import TRITON_CALL
from test_gdn_pallas import BF16_TOL, EDGE_LENGTHS, HALF_PREFILL_TOL, TOL, _assert_close, _compare_prefill
from test_mamba2_pallas import _check_decode, _check_verify
from test_snapshots import PAIRS, simulate_op

from pallas_kernels.gdn import gdn_decode, gdn_prefill, gdn_verify
from pallas_kernels.grouped_prefill import grouped_prefill

ON_GPU = jax.default_backend() == "gpu"
BACKEND = "pallas"  # the public ops' GPU path: Pallas lowered to Triton
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]


def test_public_ops_lower_to_triton_on_this_gpu():
    rng = np.random.default_rng(0)
    pool, tokens = GdnReplay.make_pools(4, rng)[0], GdnReplay.tokens(rng, 3)
    cu, slots = np.arange(4, dtype=np.int32), np.array([1, 2, 3], np.int32)
    lowered = jax.jit(lambda *t: gdn_decode(*t, cu, pool, slots, backend=BACKEND)).lower(*tokens)
    assert jax.devices()[0].platform == "gpu" and TRITON_CALL in lowered.as_text()


def test_gdn_prefill_bf16():
    inputs = prefill_inputs(EDGE_LENGTHS, 4, jnp.bfloat16)
    upcast = {name: inputs[name].astype(jnp.float32) for name in ("q", "k", "v")}
    o, pool = _compare_prefill(inputs, BACKEND, HALF_PREFILL_TOL, dict(inputs, **upcast), KERNEL_CHUNK)
    assert o.dtype == jnp.bfloat16 and pool.dtype == jnp.float32


def test_gdn_token_steps_bf16():
    """Verify (one row flushing) and decode with bf16 q, k, v, f32 states, against f32 on the same values."""
    rng = np.random.default_rng(9)
    pools = GdnReplay.make_pools(4, rng)
    exact = GdnReplay.tokens(rng, 6)
    tokens = [x.astype(jnp.bfloat16) if i < 3 else x for i, x in enumerate(exact)]
    cu, slots = np.array([0, 3, 5, 5], np.int32), np.array([3, 1, 0], np.int32)
    trackers = (slots, np.array([1, 3, 0], np.int32), np.array([1, 0, 0], np.int32), np.array([False, True, False]))
    ref = gdn_verify(*exact, cu, *[p.copy() for p in pools], *trackers, backend="reference")
    _assert_close(gdn_verify(*tokens, cu, *[p.copy() for p in pools], *trackers, backend=BACKEND), ref, BF16_TOL)
    one = np.array([0, 1, 2, 2], np.int32)
    ref = gdn_decode(*exact, one, pools[0].copy(), slots, backend="reference")
    _assert_close(gdn_decode(*tokens, one, pools[0].copy(), slots, backend=BACKEND), ref, BF16_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ssd_token_steps(dtype):
    """(T_r, committed, ring_start, flush wanted) rows as test_mamba2_pallas draws them."""
    _check_verify([(3, 1, 2, False), (1, 4, 0, True), (4, 0, 3, False)], 5, dtype, interpret=BACKEND != "pallas")
    _check_decode([1, 0, 1], 5, dtype, interpret=BACKEND != "pallas")


@pytest.mark.parametrize("family", PAIRS)
def test_snapshot_baseline(family):
    op = PAIRS[family][1]
    (rows_ref, pools_ref, _), (rows, pools, _) = (simulate_op(op(backend), 3, 1) for backend in ("reference", BACKEND))
    for row_ref, row in zip(rows_ref, rows, strict=True):
        _assert_close([o for _, o in row.outputs], [o for _, o in row_ref.outputs], TOL)
    _assert_close(pools, pools_ref, TOL)


def test_grouped_prefill():
    """A producer and two consumers that start from its state, through the GDN prefill kernel."""
    inputs = prefill_inputs([40, 20, 17], 3)
    rows = dict(num_producers=np.int32(1), slots=inputs["slots"], has_initial=np.array([False, True, True, False]),
                copy_src=inputs["slots"][[0, 0]], copy_dst=inputs["slots"][1:3])
    tokens = [inputs[name] for name in ("q", "k", "v", "g", "beta")]

    def grouped(backend):
        run = lambda cu, pool, slots, has_initial: gdn_prefill(*tokens, cu, pool, slots, has_initial, backend=backend)
        return grouped_prefill(run, inputs["cu_seqlens"], pool=inputs["state_pool"].copy(), **rows)

    _assert_close(grouped(BACKEND), grouped("reference"), TOL)
