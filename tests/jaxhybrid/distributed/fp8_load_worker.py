"""Loads the FP8 fixtures straight into shards on 4 host devices (run by test_fp8.py in a subprocess: the device
count is fixed when JAX starts) and prints one JSON report per (fixture, tp).

CPU devices report no memory statistics, so the loader's placement (`weights._to_device`) is instrumented: after
each tensor is placed, the bytes of every live array's shards on each device are summed, and the report holds
the largest such sum over what each device held before (`peak`), each device's share of the loaded params
(`share`) and the largest shard of one tensor (`largest_shard`); what a jitted write holds while it runs is not
seen (the stack it writes into is donated). It also says whether the sharded load equals the one-device load
put in the tensor-parallel layout and placed by `param_shardings` (the runner's way, `shard_params`), leaf by
leaf, values and placements, and whether params saved by `save_params` and restored onto the mesh do too.
"""

import gc
import json
import math
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxhybrid.models import weights
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.tensor_parallel import make_mesh, shard_params

HF_FIXTURES = Path(__file__).parents[2] / "fixtures" / "hf"  # run as a script: tests/ is not importable


def _shard_bytes(array: jax.Array) -> int:
    # from the sharding alone: an array's `addressable_shards` are arrays too, which `jax.live_arrays` would count
    return math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize


def _device_bytes() -> dict:
    held: dict = {}
    for array in jax.live_arrays():
        for device in array.sharding.device_set:
            held[device] = held.get(device, 0) + _shard_bytes(array)
    return held


def refuses_direct_calls(model: weights.Model) -> bool:
    """Whether the model's own forward refuses params in a tensor-parallel layout (it reads the checkpoint's)."""
    try:
        model([[1, 2]])
    except ValueError as error:
        return "laid out for tensor parallelism" in str(error)
    return False


def report(family: str, tp: int) -> dict:
    mesh = make_mesh(tp)
    placed, peaks = [], [0]
    to_device = weights._to_device

    def watched(array, dtype, sharding):
        value = to_device(array, dtype, sharding)
        placed.append(_shard_bytes(value))
        held = _device_bytes()
        peaks.append(max(held.get(device, 0) - baseline.get(device, 0) for device in mesh.devices.flat))
        return value

    one_device = weights.load_model(HF_FIXTURES / family)
    expected = shard_params(one_device.params, load_config(HF_FIXTURES / family), mesh)
    with tempfile.TemporaryDirectory() as saved:
        weights.save_params(one_device, saved)
        restored = weights.load_model(saved, mesh=mesh)
    del one_device
    gc.collect()
    baseline = _device_bytes()  # the reference params, held throughout
    weights._to_device = watched
    try:
        sharded = weights.load_model(HF_FIXTURES / family, mesh=mesh).params
    finally:
        weights._to_device = to_device
    share = max(sum(_shard_bytes(leaf) for leaf in jax.tree.leaves(sharded) if device in leaf.sharding.device_set)
                for device in mesh.devices.flat)
    same = lambda params: all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(
        np.asarray(a.astype(np.float32)), np.asarray(b.astype(np.float32)))) and a.sharding.is_equivalent_to(
        b.sharding, a.ndim), params, expected)))
    return {"peak": max(peaks), "share": share, "largest_shard": max(placed),
            "same_as_runner_layout": same(sharded), "restored_same": same(restored.params),
            "tp_layout": restored.tp_layout, "refuses_direct_calls": refuses_direct_calls(restored),
            "fp8_leaves": sum(leaf.dtype == np.dtype("float8_e4m3fn") for leaf in jax.tree.leaves(sharded)),
            "split_fp8_leaves": sum(leaf.dtype == np.dtype("float8_e4m3fn") and not leaf.sharding.is_fully_replicated
                                    for leaf in jax.tree.leaves(sharded))}


if __name__ == "__main__":
    runs = {f"{family}/{tp}": report(family, int(tp)) for case in sys.argv[1:]
            for family, sizes in [case.split("=")] for tp in sizes.split(",")}
    print(json.dumps(runs))
