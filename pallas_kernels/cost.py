"""The cost of a jitted program: XLA's cost model for its XLA ops, the Pallas kernels' own estimates for them.

XLA cannot see the kernels on GPU: jax's Triton lowering drops a pallas_call's cost_estimate, and XLA's cost
model counts the custom call it becomes as 0 FLOPs and 0 bytes. So a program's cost is `xla_cost` of its compiled module
plus `kernel_cost` of its jaxpr, the sum of the `pl.CostEstimate` every pallas_call carries.

The walk reads each pallas_call equation of the jaxpr, through every sub-jaxpr (jit, shard_map,
custom_jvp/vjp, remat, loops, conditionals). Inside shard_map a kernel sees one device's shards, so its
estimate, and the sum, is per device. A scan counts its body `length` times; a while loop (fori_loop with a
traced trip count) counts it once; a cond counts the branch `branch` picks (max: its costliest, by FLOPs
then bytes; min: its cheapest).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax


class Cost(NamedTuple):
    """FLOPs, transcendentals and bytes accessed of some kernels, and how many launches they are."""

    flops: float = 0
    transcendentals: float = 0
    bytes_accessed: float = 0
    kernels: float = 0

    def __add__(self, other: Cost) -> Cost:  # type: ignore[override]
        return Cost(*(a + b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> Cost:
        return Cost(*(n * a for a in self))


def _estimate(eqn: Any) -> Cost:
    estimate = eqn.params.get("cost_estimate")
    if estimate is None:
        raise ValueError(f"pallas_call {eqn.params.get('name')!r} carries no cost_estimate")
    return Cost(estimate.flops, estimate.transcendentals, estimate.bytes_accessed, 1)


def _jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs in one equation parameter (a Jaxpr, a ClosedJaxpr, or a tuple of them)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value, "consts"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _jaxprs(item)


def kernel_cost(jaxpr: Any, branch: Callable[[Iterable[Cost]], Cost] = max) -> Cost:
    """The summed CostEstimates of the pallas_calls in `jaxpr` (a Jaxpr or ClosedJaxpr, e.g. `jax.make_jaxpr`'s
    or a `Traced.jaxpr`); raises ValueError for a pallas_call without one."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr
    total = Cost()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            total += _estimate(eqn)
        elif name == "cond":
            total += branch(kernel_cost(b, branch) for b in eqn.params["branches"])
        else:
            inner = sum((kernel_cost(j, branch) for p in eqn.params.values() for j in _jaxprs(p)), Cost())
            total += inner.times(eqn.params["length"] if name == "scan" else 1)
    return total


def xla_cost(compiled: jax.stages.Compiled) -> Cost:
    """XLA's HloCostAnalysis of a compiled program's optimised modules (one device's, after SPMD partitioning).

    `Compiled.cost_analysis()` is None for a deviceless compile (`pallas_kernels.aot`), so the same analysis
    runs on the modules' HLO through the host's client. It counts a Triton custom call as 0 FLOPs and 0 bytes:
    `ssd_decode` at Nemotron-H-8B's shapes (256 rows, 300 slots) compiled alone costs 2.1 MFLOP and 2.525 GB
    there, all of it the output's zero-padding fusion and a copy of the (undonated) 1.26 GB pool."""
    from jax._src.lib import _jax  # noqa: PLC0415 - the analysis behind Compiled.cost_analysis, on any client

    client, total = jax.devices("cpu")[0].client, Cost()
    for module in compiled.runtime_executable().hlo_modules():
        found = _jax.hlo_module_cost_analysis(client, module)
        total += Cost(found.get("flops", 0), found.get("transcendentals", 0), found.get("bytes accessed", 0))
    return total
