"""The snapshot-every-position baseline (ring entries are whole states) against plain recurrent decoding,
against ReplaySSM, and the Pallas kernels in interpret mode and lowered for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import replay_sim
from gdn_replay_op import GdnReplay
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda
from ssd_replay_op import A as SSD_A
from ssd_replay_op import D as SSD_D
from ssd_replay_op import SsdReplay

from pallas_kernels.gdn import gdn_verify_snapshots
from pallas_kernels.gdn import pallas as gdn_pallas
from pallas_kernels.mamba2 import pallas as ssd_pallas
from pallas_kernels.mamba2 import ssd_verify_snapshots
from pallas_kernels.rings import snapshot_materialize


class Snapshots:
    """Mixin over a `ReplayOp`: pools = (state_pool, snapshots [S, H, E, ...])."""

    @classmethod
    def make_pools(cls, width, rng):
        # The ring op's draws first, so a simulation sees the same streams and S0 as the ring op's.
        state = super().make_pools(width, rng)[0]
        shape = (state.shape[0], state.shape[1], width, *state.shape[2:])
        garbage = np.random.default_rng(width).standard_normal(shape)
        garbage[0] = 0
        return [state, garbage.astype(np.float32)]

    def materialize(self, pools, src, dst, ring_start, num_entries):
        return snapshot_materialize(*pools, src, dst, ring_start, num_entries)


class GdnSnapshots(Snapshots, GdnReplay):
    def verify(self, packed, cu, pools, slots, ring_start, committed, flush):
        o, *pools = gdn_verify_snapshots(*packed, cu, *pools, slots, ring_start, committed, flush,
                                         max_query_len=self.max_query_len, backend=self.backend)
        return o, pools


class SsdSnapshots(Snapshots, SsdReplay):
    def verify(self, packed, cu, pools, slots, ring_start, committed, flush):
        x, dt, b, c = packed
        y, *pools = ssd_verify_snapshots(x, dt, SSD_A, b, c, SSD_D, cu, *pools, slots, ring_start, committed, flush,
                                         max_query_len=self.max_query_len, backend=self.backend)
        return y, pools


PAIRS = {"gdn": (GdnReplay, GdnSnapshots), "mamba2": (SsdReplay, SsdSnapshots)}


@pytest.mark.parametrize("family", PAIRS)
@settings(max_examples=3, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_verify_matches_recurrent_decoding(family, max_drafts, seed, data):
    replay_sim.check_verify_matches_recurrent_decoding(PAIRS[family][1](), max_drafts, seed, data)


@pytest.mark.parametrize("family", PAIRS)
@settings(max_examples=3, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_outputs_bit_identical_to_replay(family, max_drafts, seed):
    """Both keep the same pinned token step, so the baseline and ReplaySSM agree exactly on the reference."""
    ring, snapshots = (simulate_op(op(), max_drafts, seed) for op in PAIRS[family])
    for row_ring, row in zip(ring[0], snapshots[0], strict=True):
        for (p_ring, o_ring), (p, o) in zip(row_ring.outputs, row.outputs, strict=True):
            assert p == p_ring
            np.testing.assert_array_equal(o, o_ring)
    np.testing.assert_array_equal(snapshots[1][0], ring[1][0])  # S0 after the same flushes


def simulate_op(op, max_drafts, seed):
    return replay_sim.simulate(op, 4, max_drafts, seed, seed + 1, steps=10)


@pytest.mark.parametrize("family", PAIRS)
@settings(max_examples=2, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_interpret_matches_reference(family, max_drafts, seed):
    op = PAIRS[family][1]
    runs = (simulate_op(op(backend), max_drafts, seed) for backend in ("reference", "interpret"))
    (rows_ref, pools_ref, _), (rows, pools, _) = runs
    for row_ref, row in zip(rows_ref, rows, strict=True):
        for (_, o_ref), (_, o) in zip(row_ref.outputs, row.outputs, strict=True):
            replay_sim.TOL.check(o, o_ref)
    for pool_ref, pool in zip(pools_ref, pools, strict=True):
        replay_sim.TOL.check(pool, pool_ref)


@pytest.mark.parametrize("family", PAIRS)
def test_ring_wraps_and_rejected_entries_do_not_matter(family):
    replay_sim.check_ring_wraps_and_rejected_entries_do_not_matter(PAIRS[family][1]())


@pytest.mark.parametrize("family", PAIRS)
def test_width_one_is_bit_identical_to_plain_decoding(family):
    replay_sim.check_width_one_is_bit_identical_to_plain_decoding(PAIRS[family][1]())


def test_kernels_lower_for_cuda_at_model_shapes():
    """Qwen3-Next GDN (16 value heads, dk = dv = 128) and Nemotron-H Mamba2 (64 heads, P = 64, N = 128),
    16 verify rows of 1 + 3 tokens, E = 4 snapshots."""
    sd, f32, i32, bf16 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32, jnp.bfloat16
    tokens, rows, slots, width = 64, 16, 17, 4
    per_row = (sd((rows,), i32),) * 3 + (sd((rows,), jnp.bool_),)
    cu = sd((rows + 1,), i32)
    gdn_tokens = (sd((tokens, 8, 128), bf16),) * 2 + (sd((tokens, 16, 128), bf16), sd((tokens, 16), f32),
                                                       sd((tokens, 16), f32))
    gdn_pools = (sd((slots, 16, 128, 128), f32), sd((slots, 16, width, 128, 128), f32))
    verify = functools.partial(gdn_pallas.gdn_verify_snapshots, interpret=False)
    assert TRITON_CALL in lower_for_cuda(verify, *gdn_tokens, cu, *gdn_pools, *per_row)
    nh, p, g, n = 64, 64, 8, 128
    ssd_tokens = (sd((tokens, nh, p), bf16), sd((tokens, nh), f32), sd((nh,), f32), sd((tokens, g, n), bf16),
                  sd((tokens, g, n), bf16), sd((nh,), f32))
    ssd_pools = (sd((slots, nh, p, n), f32), sd((slots, nh, width, p, n), f32))
    verify = functools.partial(ssd_pallas.ssd_verify_snapshots, interpret=False)
    assert TRITON_CALL in lower_for_cuda(verify, *ssd_tokens, cu, *ssd_pools, *per_row)
