"""Tensor parallelism on 4 host devices (a subprocess: the device count is fixed when JAX starts): TP = 2 and 4
give TP = 1's greedy tokens and logprobs (the reference ops on one device) with the Pallas kernels (interpreted,
in shard_map), and TP = 2 does with the reference ops, on a Qwen3-Next-style model (GDN, MTP) and a
Nemotron-H-style one (Mamba2), through prefix hits, publishes and materializations, with the weights and pools
really split by heads (4 ways on a model four heads wide); and the head-aligned conv layout, which needs no
devices. Two local processes under `jax.distributed` (multihost.py) give the same output as one: process 0
schedules and broadcasts its plans, process 1 follows, the engine runs tensor parallel over both processes'
devices; that test lives in this file so that its one-process baseline is the qwen3_next/reference case's TP = 1
run, computed once."""

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.tensor_parallel import layout_orders, to_tp_layout
from tests.jaxhybrid.distributed.tp_worker import MODELS
from tests.jaxhybrid.distributed.workers import LOGPROB_ATOL, WORKER_TIMEOUT, split_axis, tp_runs, worker_env
from tests.tolerances import assert_close

# each case's TP sizes: the Pallas kernels (the GPU's path) at 2 and 4, the reference ops at 2 (4 ways
# replicates the same heads, which the interpret cases and the wide model's case check)
CASES = {"qwen3_next/reference": ("2",), "qwen3_next/interpret": ("2", "4"), "nemotron_h/reference": ("2",),
         "nemotron_h/interpret": ("2", "4")}
pytestmark = pytest.mark.timeout(WORKER_TIMEOUT + 60)


def tp_reports(case: str) -> dict:
    """One case's reports at its CASES sizes, and as "1" its model's one-device run with the reference ops: the
    baseline of both backends' cases (on one device the two backends agree far inside LOGPROB_ATOL, so a TP
    error still shows). One subprocess per model runs all its cases, well inside the timeout."""
    model = case.split("/")[0]
    arguments = [f"{name}={','.join(('1',) * name.endswith('/reference') + sizes)}"
                 for name, sizes in CASES.items() if name.startswith(f"{model}/")]
    runs = tp_runs(*arguments)
    return {"1": runs[f"{model}/reference"]["1"]} | {tp: runs[case][tp] for tp in CASES[case]}


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
        assert run["tp_layout"] == int(tp)  # loaded straight into the mesh's shards, not laid out again
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(2 * WORKER_TIMEOUT + 60)  # the two processes, then (uncached) the one-process run
def test_two_processes_give_the_single_process_output(tmp_path):
    worker, port = "tests.jaxhybrid.distributed.multihost_worker", str(free_port())
    processes = []
    for rank in (0, 1):  # files, not pipes: a process blocked on a full pipe would stall the other's collectives
        with open(tmp_path / f"{rank}.out", "w") as out, open(tmp_path / f"{rank}.err", "w") as err:
            processes.append(subprocess.Popen([sys.executable, "-m", worker, port, str(rank), str(WORKER_TIMEOUT)],
                                              env=worker_env(1), cwd=Path(__file__).parents[3], stdout=out,
                                              stderr=err))
    try:
        for p in processes:  # a hung worker prints its threads' stacks and exits at WORKER_TIMEOUT
            p.wait(timeout=WORKER_TIMEOUT + 60)
    finally:
        for p in processes:
            p.kill()
    done = [((tmp_path / f"{rank}.out").read_text(), (tmp_path / f"{rank}.err").read_text()) for rank in (0, 1)]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(f"rank {rank}: {err[-3000:]}"
                                                                  for rank, (_, err) in enumerate(done))
    leader, follower = (json.loads(out.splitlines()[-1]) for out, _ in done)
    assert follower["steps"] == leader["steps"] > 0  # every step ran on both processes
    # the same maths as one process's, with the heads' partial sums added in another order
    one = tp_reports("qwen3_next/reference")["1"]
    assert leader["tokens"] == one["tokens"]
    for key in ("logprobs", "prompt_logprobs"):
        assert_close(np.concatenate(leader[key]), np.concatenate(one[key]), LOGPROB_ATOL, key)
    # the pools span both processes' devices; each process holds its own shard
    assert leader["state_devices"] == 2 and leader["state_local_devices"] == 1
    assert split_axis(leader["specs"]["state"]) == 1 and split_axis(leader["specs"]["in_proj"]) == 1


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
