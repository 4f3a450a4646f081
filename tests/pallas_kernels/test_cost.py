"""Every Pallas kernel's CostEstimate against a count written out by hand at a tiny shape, read back through
`pallas_kernels.cost.kernel_cost` from the op's jaxpr (interpret mode: the same pallas_calls as on GPU)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.conv1d import conv1d_prefill
from pallas_kernels.cost import Cost, kernel_cost
from pallas_kernels.gdn import gdn_decode, gdn_materialize, gdn_prefill, gdn_verify, gdn_verify_snapshots
from pallas_kernels.mamba2 import ssd_decode, ssd_materialize, ssd_prefill, ssd_verify

F32, I32 = jnp.float32, jnp.int32


def spec(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def estimate(op, *args, **kwargs) -> Cost:
    return kernel_cost(jax.make_jaxpr(lambda *a: op(*a, **kwargs, backend="interpret"))(*args))


# GDN: 1 qk head, 2 value heads, K = 4, V = 8; a K x V state of every head is 2 * 4 * 8 = 64 numbers.
H, HV, DK, DV, SLOTS = 1, 2, 4, 8, 6
STATE = HV * DK * DV


def gdn_tokens(tokens):
    return spec(tokens, H, DK), spec(tokens, H, DK), spec(tokens, HV, DV), spec(tokens, HV), spec(tokens, HV)


def gdn_rings(entries):
    return spec(SLOTS, H, entries, DK), spec(SLOTS, HV, entries, DV), spec(SLOTS, HV, entries)


def test_gdn_verify_counts_its_tokens_and_half_the_committed_window():
    # 2 rows of 4 tokens (K = 3 drafts), rings of E = 8 entries: W = 8 - 4 = 4, so a row folds 2 on average
    rows = spec(2, dtype=I32)
    got = estimate(gdn_verify, *gdn_tokens(8), spec(3, dtype=I32), spec(SLOTS, HV, DK, DV), *gdn_rings(8),
                   rows, rows, rows, spec(2, dtype=bool))
    tokens, folded = 8, 2 * 2
    assert got.kernels == 1
    assert got.flops == 7 * tokens * STATE + 3 * folded * STATE
    assert got.transcendentals == (tokens + folded) * HV
    token_bytes = tokens * (2 * H * DK + HV * DV + 2 * HV) * 4  # q^, k^ (f32 once normalised), v, g, beta
    outputs = 2 * tokens * HV * DV * 4  # o and delta, f32
    ring_entry = (H * DK + HV * DV + HV) * 4
    assert got.bytes_accessed == token_bytes + outputs + folded * ring_entry + 2 * STATE * 4  # 2 states read


def test_gdn_decode_reads_and_writes_each_rows_state_and_folds_nothing():
    got = estimate(gdn_decode, *gdn_tokens(2), spec(3, dtype=I32), spec(SLOTS, HV, DK, DV), spec(2, dtype=I32))
    assert got.flops == 7 * 2 * STATE and got.transcendentals == 2 * HV
    token_bytes = 2 * (2 * H * DK + HV * DV + 2 * HV) * 4 + 2 * 2 * HV * DV * 4
    assert got.bytes_accessed == token_bytes + 2 * 2 * STATE * 4


def test_gdn_snapshots_write_a_whole_state_per_token():
    rows = spec(2, dtype=I32)
    got = estimate(gdn_verify_snapshots, *gdn_tokens(8), spec(3, dtype=I32), spec(SLOTS, HV, DK, DV),
                   spec(SLOTS, HV, 8, DK, DV), rows, rows, rows, spec(2, dtype=bool))
    assert got.flops == 7 * 8 * STATE
    assert got.bytes_accessed >= (2 + 8) * STATE * 4  # two live states read, eight stored


def test_gdn_materialize_folds_half_the_ring_per_entry():
    entries = spec(3, dtype=I32)
    got = estimate(gdn_materialize, spec(SLOTS, HV, DK, DV), *gdn_rings(8), entries, entries, entries, entries)
    assert got.flops == 3 * 3 * 4 * STATE  # 3 entries x E // 2 = 4 folds
    assert got.bytes_accessed == 2 * 3 * STATE * 4 + 3 * 4 * (H * DK + HV * DV + HV) * 4


def test_gdn_prefill_sums_flas_chunked_count_over_its_three_calls():
    tokens, chunk = 32, 16
    got = estimate(gdn_prefill, *gdn_tokens(tokens), spec(2, dtype=I32), spec(SLOTS, HV, DK, DV),
                   spec(1, dtype=I32), spec(1, dtype=bool), chunk_size=chunk)
    assert got.kernels == 3
    # per token and value head: K K^T (2CK), w and u (2CK + 2CV), v_new and the update (4KV), the output
    # q h (2KV), q k^T (2CK) and its product with v_new (2CV)
    assert got.flops == tokens * HV * (2 * chunk * DK + 2 * chunk * (DK + DV) + 4 * DK * DV
                                       + 2 * DK * DV + 2 * chunk * (DK + DV))
    assert got.bytes_accessed >= tokens * (2 * H * DK + 2 * HV * DV) * 4 + 2 * STATE * 4  # q, k, v in, o out


# Mamba2: 2 heads of P = 4 over one group of N = 8
NH, G, P, N = 2, 1, 4, 8


def ssd_tokens(tokens):
    return spec(tokens, NH, P), spec(tokens, NH), spec(NH), spec(tokens, G, N), spec(tokens, G, N), spec(NH)


def test_ssd_decode_and_verify_count_the_state_steps():
    token = NH * (5 * P * N + 3 * P)  # decay, dt x, rank-1 update, h C and D x per head
    got = estimate(ssd_decode, *ssd_tokens(2), spec(3, dtype=I32), spec(SLOTS, NH, P, N), spec(2, dtype=I32))
    assert (got.kernels, got.flops, got.transcendentals) == (1, 2 * token, 2 * NH)
    assert got.bytes_accessed >= 2 * 2 * NH * P * N * 4  # two states read and written
    rows = spec(2, dtype=I32)
    rings = spec(SLOTS, NH, 8, P), spec(SLOTS, NH, 8), spec(SLOTS, G, 8, N)
    got = estimate(ssd_verify, *ssd_tokens(8), spec(3, dtype=I32), spec(SLOTS, NH, P, N), *rings, rows, rows,
                   rows, spec(2, dtype=bool))
    assert got.flops == 8 * token + 2 * 2 * NH * (3 * P * N + P)  # each row folds (8 - 4) // 2 entries


def test_ssd_materialize_folds_half_the_ring_per_entry():
    entries = spec(2, dtype=I32)
    rings = spec(SLOTS, NH, 6, P), spec(SLOTS, NH, 6), spec(SLOTS, G, 6, N)
    got = estimate(ssd_materialize, spec(SLOTS, NH, P, N), *rings, spec(NH), entries, entries, entries, entries)
    assert got.flops == 2 * 3 * NH * (3 * P * N + P)


def test_ssd_prefill_counts_c_b_per_group_and_the_scan_per_head():
    tokens, block_t = 32, 16
    got = estimate(ssd_prefill, *ssd_tokens(tokens), spec(2, dtype=I32), spec(SLOTS, NH, P, N), spec(1, dtype=I32),
                   spec(1, dtype=bool), chunk_size=block_t)
    assert got.kernels == 2
    assert got.flops == 2 * tokens * G * block_t * N + tokens * NH * (2 * block_t * P + 4 * P * N)
    assert got.transcendentals == tokens * NH * (block_t + 2)


@pytest.mark.parametrize(("rows", "new", "pairs"), [(2, 1, 2 * 8), (1, 8, 8 * 9 // 2)])
def test_attention_counts_causal_pairs_of_rows_ending_at_the_tables_span(rows, new, pairs):
    # HQ = 2 query heads on 1 KV head, Dh = 4; blocks of 4 keys, 2 a row: every row ends at key 8
    tokens, hq, dh = rows * new, 2, 4
    q, kv = spec(tokens, hq, dh), spec(tokens, 1, dh)
    pool = spec(5, 4, 1, dh)
    got = estimate(ragged_paged_attention, q, kv, kv, pool, pool, spec(tokens, dtype=I32), spec(rows, 2, dtype=I32),
                   spec(rows + 1, dtype=I32), spec(rows, dtype=I32), scale=0.5, num_splits=1)
    assert got.kernels == 1
    assert got.flops == 4 * pairs * hq * dh and got.transcendentals == pairs * hq
    keys_values = 2 * rows * 8 * dh * 4
    assert got.bytes_accessed == 2 * tokens * hq * dh * 4 + rows * 2 * 4 + keys_values  # q, o, table, K/V


def test_conv1d_counts_its_taps_and_the_silu():
    tokens, dim, width = 8, 4, 4
    got = estimate(conv1d_prefill, spec(tokens, dim), spec(dim, width), None, spec(3, dtype=I32),
                   spec(SLOTS, width - 1, dim), spec(2, dtype=I32), spec(2, dtype=bool))
    assert got.flops == tokens * dim * (2 * width + 1) and got.transcendentals == tokens * dim
    assert got.bytes_accessed >= 2 * tokens * dim * 4 + 2 * 2 * (width - 1) * dim * 4


def test_a_pallas_call_without_an_estimate_is_an_error():
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    call = pl.pallas_call(copy, out_shape=spec(8), interpret=True, name="bare")
    with pytest.raises(ValueError, match="'bare' carries no cost_estimate"):
        kernel_cost(jax.make_jaxpr(call)(spec(8)))


def test_scan_multiplies_and_cond_picks_a_branch():
    def one(x):
        return ssd_decode(*x, backend="interpret")[0]

    args = (*ssd_tokens(2), spec(3, dtype=I32), spec(SLOTS, NH, P, N), spec(2, dtype=I32))
    single = kernel_cost(jax.make_jaxpr(one)(args))

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c, one(x)), 0, length=5)[1]

    def either(flag, x):
        return jax.lax.cond(flag, lambda: one(x), lambda: jnp.zeros((2, NH, P)))

    assert kernel_cost(jax.make_jaxpr(scanned)(args)) == single.times(5)
    assert kernel_cost(jax.make_jaxpr(either)(spec(dtype=bool), args)) == single
    assert kernel_cost(jax.make_jaxpr(either)(spec(dtype=bool), args), branch=min) == Cost()


def test_under_shard_map_a_kernel_is_costed_on_its_devices_channels():
    tokens, dim, width = 8, 8, 4
    mesh = AbstractMesh((2,), ("tp",))
    channels, whole, windows = PartitionSpec(None, "tp"), PartitionSpec(), PartitionSpec(None, None, "tp")
    specs = (channels, PartitionSpec("tp"), whole, windows, whole, whole)
    shapes = ((tokens, dim, F32), (dim, width, F32), (3, I32), (SLOTS, width - 1, dim, F32), (2, I32), (2, bool))
    args = [spec(*shape, dtype=dtype) for *shape, dtype in shapes]
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p)) for a, p in zip(args, specs,
                                                                                                     strict=True)]

    def conv(x, weight, cu, window, slots, has_initial):
        return conv1d_prefill(x, weight, None, cu, window, slots, has_initial, backend="interpret")

    sharded = jax.shard_map(conv, mesh=mesh, in_specs=specs, out_specs=(channels, windows), check_vma=False)
    with jax.sharding.use_abstract_mesh(mesh):
        per_device = kernel_cost(jax.make_jaxpr(sharded)(*args))
    assert per_device.flops == tokens * (dim // 2) * (2 * width + 1)  # half the channels
