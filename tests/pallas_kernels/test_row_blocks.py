"""`in_row_blocks`: the blocked loop gives the whole-batch result for any block size, rows in order."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.pools import ROW_BLOCK_BYTES, in_row_blocks, scatter_slots


def _rows(pool, slots, x):
    """Read each row's page, add x, write it back (the null slot stays 0), return the read."""
    page = pool[slots]
    return scatter_slots(pool, slots, page + x[:, None]), page * 2


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 12), rows_per_block=st.sampled_from([1, 2, 3, 4, 64]), seed=st.integers(0, 2**16))
def test_blocks_equal_the_whole_batch(rows, rows_per_block, seed):
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(rng.standard_normal((16, 3)), jnp.float32).at[0].set(0)
    slots = jnp.asarray(rng.permutation(np.arange(1, 16))[:rows], jnp.int32).at[-1].set(0)  # a padding row
    x = jnp.asarray(rng.standard_normal(rows), jnp.float32)
    whole, reads = _rows(pool, slots, x)
    blocked, blocked_reads = in_row_blocks(_rows, pool, (slots, x), ROW_BLOCK_BYTES // rows_per_block)
    np.testing.assert_array_equal(blocked, whole)
    np.testing.assert_array_equal(blocked_reads, reads)
