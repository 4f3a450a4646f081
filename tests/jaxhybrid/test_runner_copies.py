"""The compiled step updates the pools in place: no copy of a whole slot pool, KV pool or token history.

XLA copies a donated buffer when a value read from it is still needed after an in-place write, or when a
branch passes it through; each such copy costs a pass over the pool every step, and the step time then
grows with the pools. The test counts copy instructions of pool-sized arrays in the compiled HLO."""

import re

import pytest

from jaxhybrid.models.plan_transfer import pack_plan
from jaxhybrid.models.stack import layer_segments
from jaxhybrid.sample.sampler import batch_constraints
from jaxhybrid.worker.buckets import padding_plan
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for

SLOTS, BLOCKS = 96, 200  # sizes no other array of the step has


@pytest.mark.parametrize("family, k, rows", [("qwen3_next", 3, 2), ("qwen3_next", 0, 8), ("nemotron_h", 0, 2),
                                             ("qwen3_5", 3, 2)])  # qwen3_5: a scanned segment of 3 GDN layers
def test_the_step_copies_no_pool(family, k, rows):
    engine = engine_for(fixture_model(family), k=k, ring_size=4, budget=16, max_num_seqs=rows,
                        num_state_slots=SLOTS, num_blocks=BLOCKS)
    runner, config = engine.runner, engine.config
    plan = padding_plan(config, 16, rows, config.block_table_buckets[0], 16)
    buffer, layout = pack_plan(plan)
    constraints = batch_constraints([], plan.row_kind.shape[0])
    hlo = runner._step.lower(runner.param_leaves, runner.state, runner.carried, layout, buffer,
                             constraints).compile().as_text()
    # a pool is [pages, ...] (the MTP layer's, the token history), [repeats, pages, ...] (a segment's stack) or
    # [repeats * pages, ...] (a stack seen flat inside the scan)
    repeats = {segment.repeats for segment in layer_segments(runner.model.config.layers)}
    pages = "|".join(str(r * n) for r in repeats | {1} for n in (SLOTS, BLOCKS))
    copies = [line.strip()[:160] for line in hlo.splitlines()
              if re.search(rf"= \w+\[(\d+,)?({pages}),[^=]*\bcopy\(", line)]
    assert not copies, copies
