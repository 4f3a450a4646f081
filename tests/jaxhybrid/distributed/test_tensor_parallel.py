"""Tensor parallelism on 4 host devices (a subprocess: the device count is fixed when JAX starts): TP = 2 and 4
give TP = 1's greedy tokens and logprobs with the Pallas kernels (interpreted, in shard_map), and TP = 2 does
with the reference ops, on a Qwen3-Next-style model (GDN, MTP) and a Nemotron-H-style one (Mamba2), through prefix
hits, publishes and materializations, with the weights and pools really split by heads (4 ways on a model
four heads wide); and the head-aligned conv layout, which needs no devices."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.tensor_parallel import layout_orders, to_tp_layout
from tests.jaxhybrid.distributed.tp_worker import MODELS
from tests.jaxhybrid.distributed.workers import LOGPROB_ATOL, WORKER_TIMEOUT, split_axis, tp_runs
from tests.tolerances import assert_close

# each case's TP sizes: the Pallas kernels (the GPU's path) at 2 and 4, the reference ops at 2 (4 ways
# replicates the same heads, which the interpret cases and the wide model's case check)
CASES = {"qwen3_next/reference": ("2",), "qwen3_next/interpret": ("2", "4"), "nemotron_h/reference": ("2",),
         "nemotron_h/interpret": ("2", "4")}
pytestmark = pytest.mark.timeout(WORKER_TIMEOUT + 60)


def tp_reports(case: str) -> dict:
    """One case's reports at TP = 1 and its CASES sizes (a subprocess per case keeps each test well inside its
    timeout)."""
    return tp_runs(f"{case}={','.join(('1', *CASES[case]))}")[case]


@pytest.mark.parametrize("case", CASES)
def test_tp_gives_one_devices_tokens_and_logprobs(case):
    runs = tp_reports(case)
    one = runs["1"]
    assert one["state_devices"] == 1
    # the slot-indexed page ops ran too: prefix hits copied in, states published and materialized
    assert min(one["page_ops"].values()) > 0, one["page_ops"]
    for tp in CASES[case]:
        run = runs[tp]
        assert run["state_devices"] == int(tp)
        assert run["page_ops"] == one["page_ops"]
        assert run["tokens"] == one["tokens"], f"tp={tp}"
        for key in ("logprobs", "prompt_logprobs"):
            assert_close(np.concatenate(run[key]), np.concatenate(one[key]), LOGPROB_ATOL, f"{case} tp={tp} {key}")


# The axis each array splits on with its heads: pools [S, heads, ...], conv pools on their channels, the
# KV pools on kv heads, projections into a mixer by output columns, out of it by input rows.
SPLIT_AXES = {"state": 1, "window": 2, "conv_ring": 3, "kv": 2, "in_proj": 1, "conv1d": 0, "out_proj": 0,
              "q_proj": 1, "o_proj": 0, "mlp": 1}


@pytest.mark.parametrize("case", CASES)
def test_weights_and_pools_split_by_heads_where_tp_divides_them(case):
    runs = tp_reports(case)
    # both models have 2 GDN key heads (Mamba2 groups) and 2 kv heads: split 2 ways, replicated 4 ways
    two = runs["2"]["specs"]
    assert {name: split_axis(two[name]) for name in SPLIT_AXES} == SPLIT_AXES
    assert [split_axis(spec) for spec in two["rings"] + two["mtp_kv"]] == [1] * 3 + [2] * len(two["mtp_kv"])
    if "4" in runs:
        four = runs["4"]["specs"]
        assert {name: split_axis(four[name]) for name in SPLIT_AXES} == {name: None for name in SPLIT_AXES} | {"mlp": 1}
        assert [split_axis(spec) for spec in four["rings"] + four["mtp_kv"]] == [None] * (3 + len(four["mtp_kv"]))


def test_a_model_four_heads_wide_splits_every_mixer_four_ways():
    runs = tp_runs("qwen3_next_wide/interpret=1,4")["qwen3_next_wide/interpret"]
    one, four = runs["1"], runs["4"]
    specs = four["specs"]
    assert {name: split_axis(specs[name]) for name in SPLIT_AXES} == SPLIT_AXES
    assert [split_axis(spec) for spec in specs["rings"] + specs["mtp_kv"]] == [1] * 3 + [2] * len(specs["mtp_kv"])
    assert four["page_ops"] == one["page_ops"] and min(one["page_ops"].values()) > 0
    assert four["tokens"] == one["tokens"]
    for key in ("logprobs", "prompt_logprobs"):
        assert_close(np.concatenate(four[key]), np.concatenate(one[key]), LOGPROB_ATOL, f"wide tp=4 {key}")


def channels(offset: int, heads: range, head_dim: int) -> list[int]:
    """The channels of these heads in a part that starts at `offset` and holds its heads one after another."""
    return [offset + h * head_dim + j for h in heads for j in range(head_dim)]


def shard_heads(count: int, shard: int, shards: int) -> range:
    return range(shard * count // shards, (shard + 1) * count // shards)


def leaf_at(tree: dict, name: str):
    for key in name.split("/"):
        tree = tree[key]
    return tree


def indexed_params(orders: dict, kind: str) -> dict:
    """A params tree of a mixer's permuted leaves, each holding its own channel index along the permuted axis."""
    tree: dict = {}
    for name, (axis, order) in orders.items():
        *path, leaf = name.split("/")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        index = np.arange(order.size)
        node[leaf] = index if name.endswith("bias") else np.stack([index] * 3, axis=1 - axis)
    return {"layers_0": {kind: tree}}


def permute_and_undo(cfg, kind: str, shards: int) -> dict:
    """The mixer's params in the head-aligned layout; asserts that un-permuting them gives the original."""
    orders = layout_orders(cfg, kind, shards)
    params = indexed_params(orders, kind)
    permuted = to_tp_layout(params, cfg, shards)["layers_0"][kind]
    for name, (axis, order) in orders.items():
        undone = np.take(leaf_at(permuted, name), np.argsort(order), axis=axis)
        assert np.array_equal(undone, leaf_at(params["layers_0"][kind], name)), name
    return permuted


def test_gdn_layout_gives_each_shard_its_heads_q_k_v_channels():
    base = load_config(MODELS["qwen3_next"])
    gdn = dataclasses.replace(base.gdn, num_k_heads=4, num_v_heads=8)
    shards = 4
    permuted = permute_and_undo(dataclasses.replace(base, gdn=gdn), "gdn", shards)
    conv, qkvz = np.split(permuted["conv1d"][:, 0], shards), np.split(permuted["in_proj_qkvz"]["kernel"][0], shards)
    ba = np.split(permuted["in_proj_ba"]["kernel"][0], shards)
    for shard in range(shards):
        k_heads, v_heads = shard_heads(gdn.num_k_heads, shard, shards), shard_heads(gdn.num_v_heads, shard, shards)
        # GVA: value head h reads key head h // (HV / HK), which must sit on the same device
        assert all(h // (gdn.num_v_heads // gdn.num_k_heads) in k_heads for h in v_heads)
        qkv = (channels(0, k_heads, gdn.head_k_dim) + channels(gdn.key_dim, k_heads, gdn.head_k_dim)
               + channels(2 * gdn.key_dim, v_heads, gdn.head_v_dim))
        assert conv[shard].tolist() == qkv
        assert qkvz[shard].tolist() == qkv + channels(gdn.conv_dim, v_heads, gdn.head_v_dim)  # then z
        assert ba[shard].tolist() == channels(0, v_heads, 1) + channels(gdn.num_v_heads, v_heads, 1)


def test_mamba2_layout_gives_each_shard_its_groups_x_b_c_channels():
    base = load_config(MODELS["nemotron_h"])
    m = dataclasses.replace(base.mamba2, num_heads=8, n_groups=4)
    shards, inner, width = 2, m.intermediate_size, m.n_groups * m.state_size
    permuted = permute_and_undo(dataclasses.replace(base, mamba2=m), "mamba2", shards)
    conv, proj = np.split(permuted["conv1d_bias"], shards), np.split(permuted["in_proj"]["kernel"][0], shards)
    for shard in range(shards):
        heads, groups = shard_heads(m.num_heads, shard, shards), shard_heads(m.n_groups, shard, shards)
        assert all(h // (m.num_heads // m.n_groups) in groups for h in heads)  # a head's group is on its device
        xbc = (channels(0, heads, m.head_dim) + channels(inner, groups, m.state_size)
               + channels(inner + width, groups, m.state_size))
        assert conv[shard].tolist() == xbc
        z, dt = channels(0, heads, m.head_dim), channels(inner + m.conv_dim, heads, 1)
        assert proj[shard].tolist() == z + [inner + c for c in xbc] + dt


def test_layout_leaves_replicated_mixers_and_other_params_alone():
    cfg = load_config(MODELS["qwen3_next"])  # 2 GDN key heads: split 2 ways, replicated 4 ways
    params = indexed_params(layout_orders(cfg, "gdn", 2), "gdn")
    params["layers_0"]["mlp"] = {"up_proj": {"kernel": np.arange(12).reshape(3, 4)}}
    for tp in (1, 4):
        for leaf, original in zip(*(jax.tree.leaves(tree) for tree in (to_tp_layout(params, cfg, tp), params)),
                                  strict=True):
            assert np.array_equal(leaf, original)
