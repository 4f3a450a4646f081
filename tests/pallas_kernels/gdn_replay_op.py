"""The GDN ops as a `replay_sim.ReplayOp`: verify/decode/materialize against plain recurrent decoding."""

import numpy as np
import replay_sim

from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_recurrent, gdn_verify

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
                             max_query_len=self.max_query_len, max_committed=self.max_committed,
                             backend=self.backend)
        return o, pools

    def decode(self, packed, cu, state_pool, slots):
        return gdn_decode(*packed, cu, state_pool, slots, backend=self.backend)

    def materialize(self, pools, src, dst, ring_start, num_entries):
        return gdn_materialize(*pools, src, dst, ring_start, num_entries,
                               max_committed=self.max_committed, backend=self.backend)
