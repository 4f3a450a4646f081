"""The Mamba2 ops as a `replay_sim.ReplayOp`: verify/decode/materialize against plain recurrent decoding."""

import numpy as np
import replay_sim

from pallas_kernels.mamba2 import ssd_decode, ssd_materialize, ssd_recurrent, ssd_verify

NH, P, G, N, S = 4, 8, 2, 8, 6
_RNG = np.random.default_rng(0)
A = -np.exp(_RNG.uniform(-1, 1, NH)).astype(np.float32)
D = _RNG.standard_normal(NH).astype(np.float32)


class SsdReplay(replay_sim.ReplayOp):
    """pools = (state_pool, ring_x, ring_dt, ring_B)."""

    num_slots = S

    @staticmethod
    def tokens(rng, n):
        return (
            rng.standard_normal((n, NH, P), np.float32),
            rng.uniform(0.01, 1.0, (n, NH)).astype(np.float32),
            rng.standard_normal((n, G, N), np.float32),
            rng.standard_normal((n, G, N), np.float32),
        )

    @staticmethod
    def make_pools(width, rng, dims=(S, NH, P, G, N)):
        """Random S0 per slot, garbage rings (committed = 0 makes them irrelevant), zero null slot.

        dims: (S, NH, P, G, N) of the pools.
        """
        num_slots, num_heads, head_dim, num_groups, state_size = dims
        pools = [
            rng.standard_normal((num_slots, num_heads, head_dim, state_size), np.float32),
            rng.standard_normal((num_slots, num_heads, width, head_dim), np.float32),
            rng.uniform(0.01, 1.0, (num_slots, num_heads, width)).astype(np.float32),
            rng.standard_normal((num_slots, num_groups, width, state_size), np.float32),
        ]
        for pool in pools:
            pool[0] = 0
        return pools

    @staticmethod
    def oracle(stream, state, length):
        """Plain recurrent decoding of the first `length` stream tokens from `state`: (y, final)."""
        x, dt, b, c = stream
        y, final = ssd_recurrent(x, dt, A, b, c, D, np.array([0, length], np.int32), state[None])
        return np.asarray(y), np.asarray(final)[0]

    def verify(self, packed, cu, pools, slots, ring_start, committed, flush):
        x, dt, b, c = packed
        y, *pools = ssd_verify(x, dt, A, b, c, D, cu, *pools, slots, ring_start, committed, flush,
                             max_query_len=self.max_query_len, max_committed=self.max_committed,
                             backend=self.backend)
        return y, pools

    def decode(self, packed, cu, state_pool, slots):
        x, dt, b, c = packed
        return ssd_decode(x, dt, A, b, c, D, cu, state_pool, slots, backend=self.backend)

    def materialize(self, pools, src, dst, ring_start, num_entries):
        return ssd_materialize(*pools, A, src, dst, ring_start, num_entries,
                               max_committed=self.max_committed, backend=self.backend)
