"""Greedy output is token for token the argmax continuation of the full forward, whatever the engine does
on the way: prefix caching on or off, MTP with K in {0, 1, 3} (random MTP weights: acceptance varies),
ReplaySSM windows 1, 4 and 16 and the snapshot baseline (W = 0), checkpoint markers present or absent, a
consumer paired with its producer in one step or arriving later, small and large chunk budgets, a request
alone or mixed with others, preemptions forced by a small KV pool, and the engine one step ahead of the
device or serial. After every workload each block and slot is free or cached. Most settings run the GDN and
Mamba2 prefill/decode/verify ops through the C++ FFI kernels, the others the pure-JAX reference (FFI_RINGS); some
run the layer stack unrolled, each layer reading its weights in place (UNROLLED_RINGS).

Every engine setting runs every workload, one after another on the same engine (later workloads also hit
the prefixes that earlier ones cached).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxhybrid.engine.core import Engine
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.models.model import Model
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.sample.params import SamplingParams
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, greedy_continuation, run_to_completion

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _workloads(vocab_size: int) -> dict[str, list[list[tuple[str, Prompt]]]]:
    """Each workload is a list of waves: a wave is added once the previous wave has finished. Every
    workload has prompts of its own, so its checkpoints are not already cached by the ones before."""
    workloads = {}
    for seed, (workload, marked, waves) in enumerate([("alone", False, ["a", "b", "y"]),
                                                      ("mixed", False, ["abcxy"]),
                                                      ("markers paired", True, ["abcxy"]),
                                                      ("markers staggered", True, ["a", "bcxy"])]):
        rng = np.random.default_rng(seed)
        tokens = lambda n, rng=rng: tuple(int(t) for t in rng.integers(0, vocab_size, n))
        anchor = tokens(40)
        prompts = {"a": anchor + tokens(7), "b": anchor + tokens(21), "c": anchor + tokens(13), "x": tokens(29),
                   "y": tokens(70)}
        prompts = {name: Prompt(p, 32 if marked and name in "abc" else None) for name, p in prompts.items()}
        workloads[workload] = [[(name, prompts[name]) for name in wave] for wave in waves]
    return workloads


def _check_engine(engine: Engine, model) -> dict[str, int]:
    """Run every workload; returns what happened on the way (hits, pairings, preemptions)."""
    seen = {"request preemptions": 0}
    for workload, waves in _workloads(model.config.vocab_size).items():
        before = dataclasses.replace(engine.stats)
        for w, wave in enumerate(waves):
            for name, prompt in wave:
                engine.add_request(f"{workload}/{w}/{name}", prompt, GREEDY)
            outputs = run_to_completion(engine)
            seen["request preemptions"] += sum(output.metrics.num_preemptions for output in outputs.values())
            for name, prompt in wave:
                got = outputs[f"{workload}/{w}/{name}"].outputs[0].token_ids
                assert got == greedy_continuation(model, prompt, NEW_TOKENS), f"{workload}: {name}"
        seen[f"{workload} pairs"] = engine.stats.pair_copies - before.pair_copies
        seen[f"{workload} hits"] = engine.stats.hit_copies - before.hit_copies
    seen["preemptions"] = engine.scheduler.num_preemptions
    seen["accepted"] = engine.stats.accepted_tokens
    return seen


SETTINGS = [  # (cache mode, K, ring size W, chunk budget, KV blocks): each value of each dimension at least once
    ("align", 0, 1, 16, 160),
    ("align", 1, 4, 64, 12),    # 12 blocks cannot hold three requests: preemptions
    ("align", 3, 0, 16, 160),   # W = 0: the snapshot-every-position baseline
    ("none", 3, 16, 64, 160),
    ("none", 0, 16, 16, 12),
]


FAMILIES = ["qwen3_next", "qwen3_5_text", "qwen3_5", "nemotron_h"]
# the ring sizes at which a family's prefill/decode/verify ops run the C++ FFI kernels (pallas_kernels/cpu_ffi.py):
# two GDN families at every ring, Mamba2 at 1 and 4; qwen3_5_text keeps the reference at every ring, nemotron_h at 16
# (a setting's serial and one-step-ahead runs share their compiles)
FFI_RINGS = {"qwen3_next": (1, 4, 16), "qwen3_5": (1, 4, 16), "nemotron_h": (1, 4)}
# the ring sizes at which a family's layers run unrolled, each reading its weights in place (ModelOps.scan_layers
# off; only qwen3_5's fixture has a segment that repeats)
UNROLLED_RINGS = {"qwen3_5": (4, 16)}
# the engine schedules one step ahead by default: every family runs every setting that way; the serial loop
# (the debugging switch) runs every setting with one family each, in turn, since the loops share the model
# code and test_engine_async.py compares the two loops directly
CASES = ([(family, *setting, True) for setting in SETTINGS for family in FAMILIES]
         + [(FAMILIES[i % len(FAMILIES)], *setting, False) for i, setting in enumerate(SETTINGS)])


@pytest.mark.parametrize("family, cache_mode, k, ring_size, budget, num_blocks, async_scheduling", CASES)
def test_greedy_output_equals_the_full_forward(family, cache_mode, k, ring_size, budget, num_blocks,
                                               async_scheduling):
    model = fixture_model(family)
    ffi = ring_size in FFI_RINGS.get(family, ())
    ops = ModelOps(cpu_kernels="ffi" if ffi else "reference",
                   scan_layers=ring_size not in UNROLLED_RINGS.get(family, ()))
    assert (ops.state_backend() == "ffi") == ffi
    if k and not model.config.mtp_layers:
        k = 0  # nemotron_h has no MTP head: the same setting without drafts
    engine = engine_for(Model(model.config, model.params, ops=ops), k=k, ring_size=ring_size, cache_mode=cache_mode,
                        budget=budget, num_blocks=num_blocks, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    seen = _check_engine(engine, model)
    # the settings exercise what they claim to
    assert (seen["preemptions"] > 0) == (num_blocks < 100), seen
    assert seen["request preemptions"] == seen["preemptions"], seen  # each preemption, on its request's metrics
    if cache_mode == "align":
        assert seen["markers staggered hits"] >= 2, seen  # b and c start from a's checkpoint
        assert (seen["markers paired pairs"] > 0) == (budget >= 64), seen  # a 16-token budget cannot pair
    if k:
        assert 0 < seen["accepted"], seen
