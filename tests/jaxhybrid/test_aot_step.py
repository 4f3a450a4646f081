"""The pieces of the deviceless step compile (`benchmarks/aot_step.py`) that need no CUDA plugin: abstract
params shaped as a real init, a runner over them that allocates nothing and lowers the program a real
runner lowers, per-device pool sizing and weight bytes under tensor parallelism."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxhybrid.engine.args import EngineArgs
from jaxhybrid.engine.builder import scheduler_config
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.model import Model, abstract_params, init_params
from jaxhybrid.models.tensor_parallel import AXIS, param_shardings
from jaxhybrid.worker.buckets import plan_shapes
from jaxhybrid.worker.memory import param_bytes, pool_budget, size_pools
from jaxhybrid.worker.runner import Runner

PRESETS = Path(__file__).parents[2] / "configs" / "models"
TINY = ("tiny_qwen3_next", "tiny_nemotron_h", "tiny_qwen3_5_text")


def tiny(name: str):
    return load_config(PRESETS / f"{name}.yaml")


def small_config(cfg, **overrides):
    args = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=32, num_state_slots=12,
                token_buckets=(8, 16), row_buckets=(2, 4))
    return scheduler_config(EngineArgs(**{**args, **overrides}), cfg, lambda: 0, dtype=jnp.dtype(jnp.bfloat16))


@pytest.mark.parametrize("name", TINY)
def test_abstract_params_have_a_real_inits_tree_shapes_and_dtypes(name):
    cfg = tiny(name)
    real = init_params(cfg, dtype=jnp.bfloat16)
    abstract = abstract_params(cfg, jnp.bfloat16)
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    described = lambda tree: [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(tree)]
    assert described(abstract) == described(real)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(abstract))


def test_an_abstract_runner_allocates_nothing_and_lowers_a_real_runners_step():
    cfg = tiny("tiny_qwen3_next")
    config = small_config(cfg)
    real = Runner(Model(cfg, init_params(cfg, dtype=jnp.bfloat16)), config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # where the real params are (aot_step: the target)
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=device),
                          abstract_params(cfg, jnp.bfloat16))
    abstract = Runner(Model(cfg, params), config)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves((abstract.state, abstract.carried)))
    assert jax.tree.structure(abstract.state) == jax.tree.structure(real.state)
    bucket = plan_shapes(config)[-1]
    # the same program; only the abstract arguments carry their device in the signature (real ones are
    # uncommitted)
    unplaced = lambda lowered: re.sub(r"(, )?sdy\.sharding = #sdy\.sharding<[^>]*>", "", lowered.as_text()).replace(
        "{, ", "{").replace(" {}", "")
    assert unplaced(abstract.lower(bucket)) == unplaced(real.lower(bucket))


def test_the_buckets_lowered_are_the_executables_precompile_compiles():
    cfg = tiny("tiny_nemotron_h")
    config = small_config(cfg, row_buckets=(4,))  # each compile takes half a minute on CI's cores
    shapes = plan_shapes(config)
    assert len(shapes) == 1 + 2  # T 8: L 8; T 16: L 8, 16
    abstract = Runner(Model(cfg, abstract_params(cfg, jnp.bfloat16)), config)
    lowered = {bucket: abstract.lower(bucket).as_text() for bucket in shapes}
    assert len(set(lowered.values())) == len(shapes)  # one program per bucket
    real = Runner(Model(cfg, init_params(cfg, dtype=jnp.bfloat16)), config)
    assert real.precompile(progress=False) == len(shapes) == real.compiled_buckets()


def test_expert_stacks_split_on_their_intermediate_axis():
    cfg = tiny("tiny_qwen3_next")  # 4 experts [E, D, I] and [E, I, D], I = 32
    params = abstract_params(cfg, jnp.bfloat16)
    moe = param_shardings(params, cfg, AbstractMesh((2,), (AXIS,)))["segment_0"]["layers_0"]["moe"]
    # stacked on the segment's repeats axis first
    assert [moe[name].spec for name in ("gate_proj", "up_proj", "down_proj")] == [
        P(None, None, None, AXIS), P(None, None, None, AXIS), P(None, None, AXIS, None)]


def test_tensor_parallel_pools_are_sized_by_one_devices_share():
    cfg = tiny("tiny_qwen3_next")  # 2 kv heads, 2 GDN key heads: every pool splits 2 ways
    params = abstract_params(cfg, jnp.bfloat16)
    total, one_device = param_bytes(params, cfg, None), param_bytes(params, cfg, AbstractMesh((2,), (AXIS,)))
    assert total == sum(leaf.size * 2 for leaf in jax.tree.leaves(params))
    assert total / 2 < one_device < total  # the norms, router and embeddings stay whole on each device
    budget = pool_budget(0.9, 2**26, one_device)
    whole = size_pools(cfg, budget, block_size=16, ring_size=1, num_spec_tokens=0, max_num_seqs=256,
                       max_model_len=256)
    sizes = {tp: scheduler_config(EngineArgs(tensor_parallel_size=tp, max_model_len=256, max_num_seqs=256,
                                             backend="reference"), cfg, lambda: budget, dtype=jnp.dtype(jnp.bfloat16))
             for tp in (1, 2)}
    assert (sizes[1].num_blocks, sizes[1].num_state_slots) == (whole.num_blocks, whole.num_state_slots)
    # half a block and half a slot per device: twice of both fit the same device budget
    assert sizes[2].num_blocks >= 2 * sizes[1].num_blocks - 2
    assert sizes[2].num_state_slots > sizes[1].num_state_slots
