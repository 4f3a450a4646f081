"""GDN ReplaySSM verify/decode and materialise against plain recurrent decoding."""

import numpy as np
import replay_sim
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.gdn import gdn_decode, gdn_materialise, gdn_recurrent, gdn_verify

H, HV, K, V, S = 1, 2, 8, 8, 6


class GdnReplay(replay_sim.ReplayOp):
    """pools = (state_pool, ring_k, ring_u, ring_g)."""

    num_slots = S

    @staticmethod
    def tokens(rng, n):
        return (
            rng.standard_normal((n, H, K), np.float32),
            rng.standard_normal((n, H, K), np.float32),
            rng.standard_normal((n, HV, V), np.float32),
            -rng.exponential(0.3, (n, HV)).astype(np.float32),
            rng.uniform(0, 1, (n, HV)).astype(np.float32),
        )

    @staticmethod
    def make_pools(width, rng):
        """Random S0 per slot, garbage rings (committed = 0 makes them irrelevant), zero null slot."""
        pools = [
            rng.standard_normal((S, HV, K, V), np.float32),
            rng.standard_normal((S, H, width, K), np.float32),
            rng.standard_normal((S, HV, width, V), np.float32),
            -rng.exponential(0.3, (S, HV, width)).astype(np.float32),
        ]
        for pool in pools:
            pool[0] = 0
        return pools

    @staticmethod
    def oracle(stream, state, length):
        """Plain recurrent decoding of the first `length` stream tokens from `state`: (o, final)."""
        o, final = gdn_recurrent(*stream, np.array([0, length], np.int32), state[None])
        return np.asarray(o), np.asarray(final)[0]

    def verify(self, packed, cu, pools, slots, ring_start, committed, flush):
        o, *pools = gdn_verify(*packed, cu, *pools, slots, ring_start, committed, flush,
                             max_query_len=self.max_query_len, backend=self.backend)
        return o, pools

    def decode(self, packed, cu, state_pool, slots):
        return gdn_decode(*packed, cu, state_pool, slots, backend=self.backend)

    def materialise(self, pools, src, dst, ring_start, num_entries):
        return gdn_materialise(*pools, src, dst, ring_start, num_entries, backend=self.backend)


@settings(max_examples=6, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_verify_matches_recurrent_decoding(max_drafts, seed, data):
    replay_sim.check_verify_matches_recurrent_decoding(GdnReplay(), max_drafts, seed, data)



@settings(max_examples=4, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_a_tight_query_bound_changes_nothing(max_drafts, seed, data):
    """The model passes max_query_len = 1 + K (a row's most tokens) so the reference steps no further."""
    op = GdnReplay(max_query_len=1 + max_drafts)
    replay_sim.check_verify_matches_recurrent_decoding(op, max_drafts, seed, data)


def test_ring_wraps_and_rejected_entries_do_not_matter():
    replay_sim.check_ring_wraps_and_rejected_entries_do_not_matter(GdnReplay())


def test_width_one_is_bit_identical_to_plain_decoding():
    replay_sim.check_width_one_is_bit_identical_to_plain_decoding(GdnReplay(backend=None))
