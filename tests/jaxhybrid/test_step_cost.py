"""A whole engine step's kernel cost (`pallas_kernels.cost.kernel_cost` over `Runner.trace`): every layer's
pallas_calls found, each costed as its op's own estimate, and the roofline arithmetic of
`benchmarks/estimate.py` on hand-computed numbers."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks.estimate import checkpoint_steps, expected_tokens, step_seconds
from jaxhybrid.engine.args import EngineArgs
from jaxhybrid.engine.builder import scheduler_config
from jaxhybrid.models.config import ATTENTION, GDN
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.model import Model, abstract_params
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.worker.runner import Runner
from pallas_kernels.attention import cost as attention_cost
from pallas_kernels.cost import Cost, kernel_cost
from pallas_kernels.gdn import cost as gdn_cost
from scheduler.replay import ring_rows

PRESETS = Path(__file__).parents[2] / "configs" / "models"


def spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_a_decode_steps_kernels_are_each_layers_decode_kernels():
    cfg = load_config(PRESETS / "tiny_qwen3_next.yaml")  # 3 GDN layers, 1 attention layer
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=32, num_state_slots=12,
                      token_buckets=(8, 16), row_buckets=(2, 4), backend="interpret")
    config = scheduler_config(args, cfg, lambda: 0, dtype=jnp.dtype(jnp.bfloat16))
    model = Model(cfg, abstract_params(cfg, jnp.bfloat16), ops=ModelOps(backend="interpret"),
                  block_size=config.block_size)
    tokens, rows, blocks = 8, 4, config.block_table_buckets[-1]
    jaxpr = Runner(model, config).trace((tokens, rows, blocks, 8)).jaxpr
    kinds = [kind for layer in cfg.layers for kind in layer]
    gdn_layers, attention_layers = kinds.count(GDN), kinds.count(ATTENTION)
    # each GDN layer: materialize (its loop counted once) and the decode rows' replay; prefill path: conv1d and the
    # three chunked-prefill calls
    decode, with_prefill = kernel_cost(jaxpr, min), kernel_cost(jaxpr)
    assert decode.kernels == 2 * gdn_layers + attention_layers
    assert with_prefill.kernels == (2 + 4) * gdn_layers + attention_layers

    g, heads = cfg.gdn, cfg.attention
    entries = ring_rows(config.ring_size, 0)
    pool = spec(config.num_state_slots, g.num_v_heads, g.head_k_dim, g.head_v_dim)
    rings = (spec(config.num_state_slots, g.num_k_heads, entries, g.head_k_dim),
             spec(config.num_state_slots, g.num_v_heads, entries, g.head_v_dim),
             spec(config.num_state_slots, g.num_v_heads, entries))
    # decode and verify rows come first with 1 + k tokens at most: their ops see the bucket's first R (1 + k)
    decode_tokens = min(tokens, rows * (1 + config.num_spec_tokens))
    assert decode_tokens < tokens  # this bucket has tokens the replay must not see
    qk, v = spec(decode_tokens, g.num_k_heads, g.head_k_dim), spec(decode_tokens, g.num_v_heads, g.head_v_dim)
    gates = spec(decode_tokens, g.num_v_heads)
    replay = gdn_cost.replay(qk, qk, v, gates, gates, pool, *rings, rows, write_final=False)
    materialize = gdn_cost.materialize(*rings, pool, 1)
    attention = attention_cost.attention(spec(tokens, heads.num_heads, heads.head_dim),
                                         spec(config.num_blocks, config.block_size, heads.num_kv_heads, heads.head_dim),
                                         spec(rows, blocks, dtype=jnp.int32), 1)
    per_op = [(gdn_layers, replay), (gdn_layers, materialize), (attention_layers, attention)]
    assert decode.flops == sum(n * c.flops for n, c in per_op)
    assert decode.transcendentals == sum(n * c.transcendentals for n, c in per_op)


def test_a_step_takes_its_flops_at_peak_or_its_bytes_at_full_bandwidth():
    peak = dict(flops=1e12, bandwidth=1e9)
    assert step_seconds(Cost(flops=2e12, bytes_accessed=1e9), peak) == 2.0  # compute-bound
    assert step_seconds(Cost(flops=1e12, bytes_accessed=3e9), peak) == 3.0  # memory-bound


@pytest.mark.parametrize(("acceptance", "drafts", "expected"), [(0.5, 3, 1.875), (0.7, 0, 1.0), (1.0, 3, 4.0),
                                                               (0.0, 3, 1.0)])
def test_a_verify_step_emits_one_token_plus_each_accepted_draft(acceptance, drafts, expected):
    assert expected_tokens(acceptance, drafts) == pytest.approx(expected)


def test_the_checkpoint_prefills_the_anchor_once():
    # 512 + 16 x 64 = 1536 tokens fit one 2048-token step; 16 x 576 = 9216 need 5
    assert checkpoint_steps(512, 16, 64, 2048) == (1, 5)
    assert checkpoint_steps(512, 256, 64, 2048) == (9, 72)
