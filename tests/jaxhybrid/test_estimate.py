"""`benchmarks/estimate.py`'s pure pieces: units (per TP group and per GPU), bytes by kind and by part of the
model, the expected step time at published kernel efficiencies, the weights a step reads, and the full stack's
cost from models of a few layers."""

from pathlib import Path

import jax.numpy as jnp
import pytest

from benchmarks.estimate import (
    DENSE,
    EFFICIENCY,
    EXPERTS,
    KINDS,
    KV,
    OTHER,
    STATE,
    StepCost,
    bytes_by_kind,
    depth_models,
    expected_seconds,
    expert_fraction,
    extrapolate,
    group_label,
    kernel_kind,
    op_group,
    rates,
    weight_bytes,
)
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.model import abstract_params
from pallas_kernels.cost import Cost

PRESETS = Path(__file__).parents[2] / "configs" / "models"


def test_a_rate_is_the_tp_groups_and_per_gpu_is_that_over_tp():
    found = rates(tokens=256, seconds=0.02, tp=4)
    assert found["tokens_per_s_per_tp_group"] == pytest.approx(12800)
    assert found["tokens_per_s_per_gpu"] == pytest.approx(3200)
    assert rates(256, 0.02, 1)["tokens_per_s_per_gpu"] == pytest.approx(12800)
    assert group_label(4) == "4-GPU group" and group_label(1) == "GPU"


def test_expected_time_takes_each_kinds_bytes_at_its_efficiency():
    peak = dict(flops=1e12, bandwidth=1e9)
    efficiency = {STATE: (0.5, ""), KV: (0.25, "")}
    # 1 GB at half the bandwidth (2 s) + 1 GB at a quarter (4 s); FLOPs 1 s
    assert expected_seconds(1e12, {STATE: 1e9, KV: 1e9}, peak, efficiency) == pytest.approx(6.0)
    assert expected_seconds(1e13, {STATE: 1e9, KV: 1e9}, peak, efficiency) == pytest.approx(10.0)  # FLOPs at peak
    assert set(EFFICIENCY) == set(KINDS) and all(0 < f <= 1 for f, _ in EFFICIENCY.values())


def test_bytes_by_kind_add_up_to_xla_and_the_kernels():
    kernels = {"gdn_replay_block_v=32_write_final=False": Cost(bytes_accessed=5.0),
               "conv1d_prefill_block_t=32_block_d=128": Cost(bytes_accessed=1.0),
               "ragged_paged_attention_block_m=16_group=8_num_splits=1": Cost(bytes_accessed=20.0),
               "ssd_decode_block_p=64": Cost(bytes_accessed=2.0)}
    found = bytes_by_kind(60.0, kernels, {EXPERTS: 38.0, DENSE: 2.0})
    assert found == {EXPERTS: 38.0, DENSE: 2.0, STATE: 8.0, KV: 20.0, OTHER: 20.0}
    assert sum(found.values()) == 60.0 + 28.0


@pytest.mark.parametrize(("name", "kind"), [("gdn_materialize_block_v=32", STATE), ("ssd_verify_block_p=64", STATE),
                                            ("conv1d_prefill_block_t=32_block_d=128", STATE),
                                            ("ragged_paged_attention_block_m=16_group=8_num_splits=1", KV),
                                            ("something_else", OTHER)])
def test_a_kernel_is_of_the_kind_its_name_says(name, kind):
    assert kernel_kind(name) == kind


@pytest.mark.parametrize(("op_name", "part"), [
    ("jit(run_step)/HybridLM/layers_0/moe/cond/branch_1_fun/gmd,gdi->gmi/dot_general", "MoE"),
    ("jit(run_step)/HybridLM/layers_12/gdn/shard_map/jit(conv1d_replay)/select_n", "GDN"),
    ("jit(run_step)/HybridLM/layers_3/attention/q_proj/dot_general", "attention"),
    ("jit(run_step)/HybridLM/layers_3/add", "norms, residuals"),
    ("jit(run_step)/HybridLM.mtp_hidden/mtp/layers_0/moe/scatter-add", "MTP MoE"),
    ("jit(run_step)/HybridLM/embed_tokens/jit(_take)/select_n", "embedding"),
    ("jit(run_step)/HybridLM.logits/lm_head/dot_general", "LM head"),
    ("jit(run_step)/cond/branch_1_fun/reduce", "sampling, plan"),
    ("broadcast.152", "unnamed (XLA's copies, fills)"), ("", "unnamed (XLA's copies, fills)")])
def test_an_xla_instruction_belongs_to_the_part_its_op_name_names(op_name, part):
    assert op_group(op_name) == part


def test_few_tokens_touch_few_experts_and_many_touch_almost_all():
    assert expert_fraction(1, 10, 512) == pytest.approx(10 / 512)
    assert expert_fraction(256, 10, 512) == pytest.approx(1 - (1 - 10 / 512) ** 256)
    assert 0.99 < expert_fraction(256, 10, 512) < 1


def test_the_full_stacks_cost_is_the_base_plus_each_kinds_extra_layers():
    layers = ("gdn",) * 3 + ("attention",) + ("gdn",) * 3 + ("attention",)
    kinds, one_more, counts = depth_models(layers)
    assert kinds == ("gdn", "attention") and counts == {"gdn": 6, "attention": 2}
    # one more layer of a kind, placed where it repeats no period (a repeat would stack its params)
    assert one_more == {"gdn": ("gdn", "attention", "gdn"), "attention": ("attention", "gdn", "attention")}

    def cost(stack):  # linear: 10 outside the layers, 3 a GDN layer and 5 an attention layer, by part
        return {"fixed": Cost(bytes_accessed=10.0), "gdn": Cost(bytes_accessed=3.0 * stack.count("gdn")),
                "attention": Cost(bytes_accessed=5.0 * stack.count("attention"))}

    found = extrapolate(cost(kinds), {k: cost(s) for k, s in one_more.items()}, counts)
    assert {k: v.bytes_accessed for k, v in found.items()} == {k: v.bytes_accessed for k, v in cost(layers).items()}


def test_a_step_cost_survives_its_json_and_totals_both_sides():
    cost = StepCost({"MoE": Cost(1.0, 0.0, 2.0)}, {"gdn_replay": Cost(3.0, 1.0, 4.0, 36)})
    assert StepCost.from_json(cost.to_json()) == cost
    assert cost.total == Cost(4.0, 1.0, 6.0, 36)


def test_a_step_reads_each_param_once_the_embeddings_rows_and_the_experts_its_tokens_route_to():
    cfg = load_config(PRESETS / "tiny_qwen3_next.yaml")
    params = abstract_params(cfg, jnp.bfloat16)
    tokens, rows, hidden, vocab = 8, 4, cfg.hidden_size, cfg.vocab_size
    stacks = sum(3 * cfg.moe.num_experts * hidden * cfg.moe.intermediate_size * 2 for layer in cfg.layers
                 if "moe" in layer)
    plain = weight_bytes(params, cfg, tokens, rows, drafts=0)
    # every expert stack at the share of experts 8 tokens of top-2 of 4 reach
    assert plain[EXPERTS] == pytest.approx(stacks * expert_fraction(tokens, cfg.moe.top_k, cfg.moe.num_experts))
    drafted = weight_bytes(params, cfg, tokens, rows, drafts=3)
    # 3 drafts: the MTP layer runs 3 times, the LM head 3 more, the embedding reads 8 + 2 x 4 more rows
    mtp = sum(leaf.size * 2 for path, leaf in _leaves(params) if "mtp" in path and not _routed(path, leaf))
    lm_head = hidden * vocab * 2
    embedding_rows = (tokens + 2 * rows) * hidden * 2
    assert drafted[DENSE] - plain[DENSE] == pytest.approx(3 * mtp + 3 * lm_head + embedding_rows)
    assert drafted[EXPERTS] > plain[EXPERTS]


def _leaves(params):
    import jax  # noqa: PLC0415

    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]


def _routed(path, leaf):
    return "moe" in path and "shared" not in path and leaf.ndim >= 3
