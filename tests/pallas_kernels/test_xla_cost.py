"""`pallas_kernels.cost`'s per-instruction view of a compiled program (`hlo_costs`, `xla_cost` with a branch
policy) and the per-kernel sums (`kernel_costs`), on small programs compiled for the host."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.cost import (
    Branch,
    Cost,
    cheapest,
    hlo_costs,
    kernel_cost,
    kernel_costs,
    most_kernels,
    shape_bytes,
    xla_cost,
    xla_costs,
)
from pallas_kernels.mamba2 import ssd_decode
from tests.pallas_kernels.test_cost import NH, SLOTS, P, spec, ssd_tokens
from tests.pallas_kernels.test_cost import N as STATE

N = 256  # the matrices' side


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def branchy(flag, x, w):
    """A cheap branch (a sum over x) and a dear one (a matmul reading w), and an op outside the cond."""
    return jax.lax.cond(flag, lambda: x @ w, lambda: x * 2.0) + 1.0


ARGS = (jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((N, N), jnp.float32),
        jax.ShapeDtypeStruct((N, N), jnp.float32))


def test_instruction_costs_add_up_to_xlas_own_analysis_of_a_program_without_conditionals():
    program = compiled(lambda x, w: jnp.tanh(x @ w) + x, *ARGS[1:])
    whole = xla_cost(program)
    parts = sum((cost for _, cost in xla_costs(program, cheapest)), Cost())
    assert whole.bytes_accessed > 0
    assert parts.flops == pytest.approx(whole.flops) and parts.bytes_accessed == pytest.approx(whole.bytes_accessed)


def test_a_conditional_counts_the_branch_the_policy_picks_where_xla_takes_the_dearest():
    program = compiled(branchy, *ARGS)
    dearest = xla_cost(program)  # XLA: each property's maximum over the branches
    steady = xla_cost(program, cheapest)
    assert steady.flops < dearest.flops and steady.bytes_accessed < dearest.bytes_accessed
    matmul = 2 * N ** 3
    assert dearest.flops - steady.flops == pytest.approx(matmul, rel=0.01)
    picked = xla_cost(program, lambda branches: max(range(len(branches)), key=lambda i: branches[i].cost.flops))
    assert picked.flops == pytest.approx(dearest.flops)


def test_a_fusion_that_gathers_rows_of_a_table_is_charged_the_rows_not_the_table():
    table, rows = (4096, 1024), 8
    program = compiled(lambda t, i: jnp.take(t, i, axis=0) * 2.0 + 1.0, jax.ShapeDtypeStruct(table, jnp.float32),
                       jax.ShapeDtypeStruct((rows,), jnp.int32))
    whole = 4096 * 1024 * 4
    assert xla_cost(program).bytes_accessed > whole  # XLA: the whole table read
    assert xla_cost(program, cheapest).bytes_accessed < 3 * rows * 1024 * 4  # the rows read and written, the indices


STACKED_GATHER = """HloModule m

%fused (p0: f32[1,4096,1024], p1: s32[8,1]) -> f32[8,1,1024] {
  %p0 = f32[1,4096,1024]{2,1,0} parameter(0)
  %b = f32[4096,1024]{1,0} bitcast(%p0)
  %p1 = s32[8,1]{1,0} parameter(1)
  %g = f32[8,1,1024]{2,1,0} gather(%b, %p1), offset_dims={1,2}, collapsed_slice_dims={}, GATHER_DIMS
  ROOT %m = f32[8,1,1024]{2,1,0} multiply(%g, %g)
}

ENTRY %main (a: f32[1,4096,1024], i: s32[8,1]) -> f32[8,1,1024] {
  %a = f32[1,4096,1024]{2,1,0} parameter(0)
  %i = s32[8,1]{1,0} parameter(1)
  ROOT %f = f32[8,1,1024]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%fused
}
""".replace("GATHER_DIMS", "start_index_map={0}, index_vector_dim=1, slice_sizes={1,1024}")


def test_a_gather_through_a_bitcast_of_a_stacked_operand_is_charged_its_slices():
    # a layer's entry of stacked params ([1, ...] bitcast to the layer's shape), gathered row by row
    (found,) = hlo_costs(STACKED_GATHER, cheapest)
    assert found[1].bytes_accessed == 2 * 8 * 1024 * 4 + 8 * 4  # the rows read and written, the indices


def test_shape_bytes_reads_printed_shapes():
    assert shape_bytes("bf16[512,2048,128]{2,1,0}") == 512 * 2048 * 128 * 2
    assert shape_bytes("(s32[], f32[2,3]{1,0})") == 4 + 24 and shape_bytes("f8e4m3fn[4]{0}") == 4


def test_each_instruction_keeps_its_op_name():
    names = [name for name, _ in xla_costs(compiled(branchy, *ARGS), cheapest)]
    assert any("cond" in name for name in names) and all(isinstance(name, str) for name in names)


def test_hlo_costs_reads_the_text_a_module_prints():
    program = compiled(branchy, *ARGS)
    (module,) = program.runtime_executable().hlo_modules()
    assert hlo_costs(module.to_string(), cheapest) == xla_costs(program, cheapest)


def test_most_kernels_takes_the_branch_with_kernels_and_otherwise_the_cheapest():
    dear, cheap = Cost(bytes_accessed=10.0), Cost(bytes_accessed=1.0)
    without = [Branch([("a", dear)], 0), Branch([("b", cheap)], 0)]
    with_kernels = [Branch([("a", cheap)], 0), Branch([("b", dear)], 3)]
    assert most_kernels(without) == cheapest(without) == 1
    assert most_kernels(with_kernels) == 1 and cheapest(with_kernels) == 0


def test_kernel_costs_sum_per_kernel_name_and_add_up_to_kernel_cost():
    def two(x):
        out = ssd_decode(*x, backend="interpret")[0]
        return jax.lax.scan(lambda c, _: (c, ssd_decode(*x, backend="interpret")[0]), 0, length=3)[1], out

    args = (*ssd_tokens(2), spec(3, dtype=jnp.int32), spec(SLOTS, NH, P, STATE), spec(2, dtype=jnp.int32))
    jaxpr = jax.make_jaxpr(two)(args)
    per_name = kernel_costs(jaxpr)
    assert len(per_name) == 1  # the same kernel: one name, 4 launches
    (cost,) = per_name.values()
    assert cost.kernels == 4 and cost == kernel_cost(jaxpr)
