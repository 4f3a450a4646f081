"""The layer stack as scanned segments: the cut reproduces the model's layers and finds the published
periods, and a scan over the repeats gives the same bits as the unrolled stack, in a forward pass and through
the engine (decode, MTP verify, prefix hits and publishes on the stacked pools); on CPU the unrolled step reads
each layer's weights in place."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.aot_step import PRESETS
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.models.config import ATTENTION, GDN, MOE
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.model import Model, full_forward, init_params
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.models.plan_transfer import pack_plan
from jaxhybrid.models.stack import (
    flatten_params,
    is_stacked,
    layer_location,
    layer_segments,
    per_layer,
    unflatten_params,
)
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.sampler import batch_constraints
from jaxhybrid.worker.buckets import padding_plan
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, run_to_completion

SCANNED, UNROLLED = ModelOps(scan_layers=True), ModelOps(scan_layers=False)


def _concatenated(segments) -> tuple:
    return tuple(layer for segment in segments for layer in segment.period * segment.repeats)


@given(st.lists(st.sampled_from([("a",), ("b",), ("a", "b")]), max_size=40))
def test_the_segments_are_the_layers_in_order(layers):
    segments = layer_segments(tuple(layers))
    assert _concatenated(segments) == tuple(layers)
    assert [s.first for s in segments] == [sum(s.num_layers for s in segments[:k]) for k in range(len(segments))]
    for i in range(len(layers)):  # each layer's stacked place holds that layer's kinds
        k, j, _ = layer_location(i, segments)
        assert segments[k].period[j] == layers[i]


@given(st.lists(st.sampled_from([("a",), ("b",)]), min_size=1, max_size=6), st.integers(2, 9))
def test_a_periodic_stack_is_one_segment_at_most_one_period_long(period, repeats):
    segments = layer_segments(tuple(period) * repeats)
    assert _concatenated(segments) == tuple(period) * repeats
    assert sum(len(s.period) for s in segments) <= len(period)  # the program holds at most one period


def test_the_published_models_compile_one_period():
    qwen = load_config(PRESETS / "qwen3_next_80b_a3b_instruct.yaml")  # full attention every 4th layer
    assert [(s.period, s.repeats) for s in layer_segments(qwen.layers)] == [(qwen.layers[:4], 12)]
    # Nemotron-H-8B: "M-M-M-M*-M-" four times, then "M-" four times
    nemotron = load_config(PRESETS / "nemotron_h_8b_base_8k.yaml")
    assert [(len(s.period), s.repeats) for s in layer_segments(nemotron.layers)] == [(11, 4), (2, 4)]


def _repeated_moe_config():
    cfg = fixture_model("qwen3_next").config  # 4 experts, MTP
    return dataclasses.replace(cfg, layers=((GDN, MOE),) * 3 + ((ATTENTION, MOE),) * 2)


def test_scanned_and_unrolled_forward_give_the_same_bits():
    cfg = _repeated_moe_config()
    params = init_params(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    outputs = [jax.jit(lambda p, t, ops=ops: full_forward(Model(cfg, p, ops=ops).module, p, t, 16, with_mtp=True))(
        params, tokens) for ops in (SCANNED, UNROLLED)]
    for scanned, unrolled in zip(*outputs, strict=True):
        assert np.array_equal(np.asarray(scanned), np.asarray(unrolled))


def test_per_layer_params_undo_the_stacking():
    model = fixture_model("qwen3_5")  # layers 0-2 stacked in one segment
    layers = per_layer(model.params, layer_segments(model.config.layers))
    stacked = model.params["segment_0"]["layers_0"]["gdn"]["A_log"]
    assert [np.array_equal(layers[f"layers_{i}"]["gdn"]["A_log"], stacked[i]) for i in range(3)] == [True] * 3


def test_the_engine_gives_the_same_tokens_and_logprobs_scanned_or_unrolled():
    model = fixture_model("qwen3_5")
    rng = np.random.default_rng(1)
    anchor = tuple(int(t) for t in rng.integers(0, model.config.vocab_size, 40))
    prompts = [Prompt(anchor + tuple(int(t) for t in rng.integers(0, model.config.vocab_size, n)), 32)
               for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    for ops in (SCANNED, UNROLLED):
        engine = engine_for(Model(model.config, model.params, ops=ops), k=3, ring_size=4)
        outputs = {}
        for wave in ([0], [1, 2]):  # the later ones start from the first one's checkpoint
            for i in wave:
                engine.add_request(str(i), prompts[i], params)
            outputs |= run_to_completion(engine)
        results.append([(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs])
                        for o in (outputs[str(i)] for i in range(len(prompts)))])
        assert engine.stats.hit_copies > 0 and engine.stats.accepted_tokens > 0  # hits and verify both ran
    assert results[0] == results[1]


def test_the_cpu_layer_views_share_the_stacks_memory_and_restack_to_the_params():
    params = fixture_model("qwen3_5").params
    leaves, layout = flatten_params(params, repeat_views=True)
    restacked = unflatten_params(leaves, layout)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b) and a.shape == b.shape, params, restacked))
    views = iter(leaves)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not is_stacked(path):
            assert next(views) is leaf
            continue
        stride = leaf[0].nbytes
        pointers = [next(views).unsafe_buffer_pointer() for _ in range(leaf.shape[0])]
        if leaf.ndim >= 3 and stride % 64 == 0:  # each weight matrix aliased, never copied
            assert pointers == [leaf.unsafe_buffer_pointer() + r * stride for r in range(leaf.shape[0])]
    assert next(views, None) is None


def _compiled_step(model: Model) -> str:
    engine = engine_for(model, k=0, ring_size=4, budget=16, max_num_seqs=2)
    runner, config = engine.runner, engine.config
    buffer, layout = pack_plan(padding_plan(config, 16, 2, config.block_table_buckets[0], 16))
    constraints = batch_constraints([], 2)
    return runner._step.lower(runner.param_leaves, runner.state, runner.carried, layout, buffer,
                              constraints).compile().as_text()


def test_the_unrolled_cpu_step_never_holds_a_stack_of_layer_weights():
    """An unrolled step on CPU reads each layer's weights from its view in place (XLA folds each repeat's slice of
    the restacked views back to the view); a scanned step takes, and slices, the stacks."""
    model = fixture_model("qwen3_5")  # layers 0-2 stacked in one segment
    hlo_dtype = {"float32": "f32", "bfloat16": "bf16"}
    stacks = {f"= {hlo_dtype[leaf.dtype.name]}[{','.join(map(str, leaf.shape))}]"
              for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]
              if is_stacked(path) and leaf.ndim >= 3}
    pattern = re.compile("|".join(map(re.escape, stacks)))
    assert not pattern.findall(_compiled_step(Model(model.config, model.params, ops=UNROLLED)))
    assert pattern.findall(_compiled_step(Model(model.config, model.params, ops=SCANNED)))  # the check can fail
