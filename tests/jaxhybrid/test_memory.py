"""Pool sizing from a memory budget: slot pages counted as the engine allocates them, budgets respected with room
for the largest step's temporaries; compiled steps kept within the host's memory-map limit."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxhybrid.engine import builder
from jaxhybrid.engine.args import CLI_DEFAULTS, EngineArgs
from jaxhybrid.engine.builder import build_engine, scheduler_config
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.models.pools import RecurrentPool, init_device_state, layer_pools
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.worker import runner as runner_module
from jaxhybrid.worker.buckets import plan_shapes
from jaxhybrid.worker.memory import memory_maps, size_pools, slot_bytes
from jaxhybrid.worker.runner import Runner, step_temporaries
from scheduler import SchedulerConfig
from scheduler.replay import ring_rows
from tests.hf_fixtures import HF_FIXTURES, fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, run_to_completion


def _page_nbytes(cfg, ring_size: int, k: int, history_len: int) -> int:
    """One slot of every slot pool the engine allocates (activations in a 2-byte dtype)."""
    state = init_device_state(cfg, num_blocks=2, block_size=16, num_slots=1, ring_entries=ring_rows(ring_size, k),
                              history_len=history_len, dtype=jnp.float16, snapshots=ring_size == 0)
    pools = [pool for pool in layer_pools(state) if isinstance(pool, RecurrentPool)] + [state.token_history]
    return sum(leaf.nbytes for leaf in jax.tree.leaves(pools))


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "qwen3_5_text"])
@pytest.mark.parametrize("ring_size, k", [(1, 0), (16, 3), (0, 3)])
def test_a_slot_counts_state_ring_and_window(family, ring_size, k):
    cfg = fixture_model(family).config
    assert slot_bytes(cfg, ring_size, k, history_len=100) == _page_nbytes(cfg, ring_size, k, history_len=100)


def test_pools_fill_the_budget_and_make_a_valid_scheduler_config():
    cfg = fixture_model("qwen3_next").config
    sizes = size_pools(cfg, 64 << 20, block_size=16, ring_size=16, num_spec_tokens=3, max_num_seqs=64,
                       max_model_len=4096)
    used = sizes.num_blocks * sizes.bytes_per_block + sizes.num_state_slots * sizes.bytes_per_slot
    assert used <= 64 << 20 < used + sizes.bytes_per_block
    assert sizes.max_num_seqs == 64 and sizes.num_state_slots > 2 * 64
    SchedulerConfig(block_size=16, max_num_seqs=sizes.max_num_seqs, max_model_len=4096, num_blocks=sizes.num_blocks,
                    num_state_slots=sizes.num_state_slots, num_spec_tokens=3, ring_size=16)
    assert "KV blocks" in sizes.describe()


def test_pools_leave_the_largest_step_room_for_its_temporaries(monkeypatch):
    model = fixture_model("qwen3_next")
    args, budget, measured = EngineArgs(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256), 64 << 20, []

    def temporaries(config: SchedulerConfig) -> int:
        with monkeypatch.context() as no_runner:  # measured on abstract arguments, before any runner exists
            no_runner.setattr(runner_module, "Runner", None)
            measured.append(step_temporaries(model, config))
        return measured[-1]

    plain = scheduler_config(args, model.config, lambda: budget, dtype=model.dtype)
    config = scheduler_config(args, model.config, lambda: budget, dtype=model.dtype, step_temporaries=temporaries)
    runner = Runner(model, config)
    compiled = runner.lower(plan_shapes(config)[-1]).compile().memory_analysis()
    # measured over pools of the fewest pages, the same as over the real pools: none grows with the pools
    assert compiled.temp_size_in_bytes == measured[0] > 0
    pool_bytes = lambda config: sum(leaf.nbytes for leaf in jax.tree.leaves(Runner(model, config).state))  # noqa: E731
    assert pool_bytes(config) + compiled.temp_size_in_bytes <= budget < pool_bytes(plain) + compiled.temp_size_in_bytes
    assert config.num_blocks < plain.num_blocks


def test_an_engine_on_a_device_with_a_memory_limit_keeps_the_step_s_temporaries_out_of_its_pools(monkeypatch):
    args = EngineArgs(HF_FIXTURES / "nemotron_h", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      skip_tokenizer_init=True)
    monkeypatch.setattr(builder, "device_memory_budget", lambda utilization, weights: 32 << 20)
    plain = build_engine(args).config
    measured = []
    monkeypatch.setattr(builder, "reports_memory", lambda: True)
    monkeypatch.setattr(builder, "step_temporaries",
                        lambda *args: measured.append(step_temporaries(*args)) or measured[-1])
    limited = build_engine(args).config
    assert len(measured) == 1 and measured[0] > 0
    assert limited.num_blocks < plain.num_blocks


def test_scarce_slots_cap_max_num_seqs_and_a_tiny_budget_names_the_problem():
    cfg = fixture_model("nemotron_h").config
    per_slot = slot_bytes(cfg, 16, 3)
    sizes = size_pools(cfg, 40 * per_slot, block_size=16, ring_size=16, num_spec_tokens=3, max_num_seqs=256,
                       max_model_len=64)
    assert sizes.max_num_seqs in range(1, 20)  # capped from 256 to what the slots hold
    assert sizes.num_state_slots >= 1 + 2 * sizes.max_num_seqs + 1
    with pytest.raises(ValueError, match="max_model_len 4096"):
        size_pools(cfg, 10 * per_slot, block_size=16, ring_size=16, num_spec_tokens=3, max_num_seqs=8,
                   max_model_len=4096)


@given(budget_slots=st.integers(6, 4000), max_model_len=st.integers(16, 4096), cache_fraction=st.floats(0, 0.9))
@example(budget_slots=60, max_model_len=4096, cache_fraction=0.1)
def test_the_pools_always_hold_one_request_of_max_model_len(budget_slots, max_model_len, cache_fraction):
    """Whatever the budget left after the running requests' slots, the cached states' share never takes the
    blocks one request of max_model_len needs (the null block besides)."""
    cfg = fixture_model("nemotron_h").config
    per_slot = slot_bytes(cfg, 16, 3)
    try:
        sizes = size_pools(cfg, budget_slots * per_slot, block_size=16, ring_size=16, num_spec_tokens=3,
                           max_num_seqs=64, max_model_len=max_model_len, cache_fraction=cache_fraction)
    except ValueError:
        return  # too small even for one request: named by the error (the test above)
    assert sizes.num_blocks >= 1 + -(-(max_model_len + 3) // 16)
    assert sizes.num_state_slots >= 1 + 2 * sizes.max_num_seqs + 1 and sizes.max_num_seqs >= 1


def test_default_ladders_keep_two_token_steps_and_the_server_s_compiled_steps_few():
    """Tokens from 2 (XLA:CPU turns one-row bf16 matmuls into whole-weight converts); rows and logits from 8,
    so that the server's defaults at 64 sequences compile few enough steps to fit Linux's memory-map limit."""
    cfg = fixture_model("qwen3_next").config
    args = dataclasses.replace(EngineArgs(max_num_seqs=64, num_blocks=64, num_state_slots=160), **CLI_DEFAULTS)
    config = scheduler_config(args, cfg, lambda: 0, dtype=jnp.dtype(jnp.bfloat16))
    assert config.token_buckets[0] == 2 and config.row_buckets[0] == config.logits_buckets[0] == 8
    assert len(plan_shapes(config)) <= 42  # ~1,400 maps each for an 8-layer model, against 65,530


def test_precompile_stops_with_a_clear_error_before_the_memory_maps_run_out(monkeypatch):
    """Past vm.max_map_count XLA:CPU's next compile dies with SIGSEGV: after its first step precompile
    projects the maps the rest will take and refuses, and the engine still steps."""
    model = fixture_model("qwen3_next")
    engine = engine_for(model, token_buckets=(16, 64), logits_buckets=(16, 64))  # 3 shapes
    held, limit = memory_maps()
    assert 0 < held < limit
    readings = iter([(held, held + 2000), (held + 1500, held + 2000)])  # 1,500 maps per compiled step
    monkeypatch.setattr("jaxhybrid.worker.runner.memory_maps", lambda: next(readings))
    with pytest.raises(RuntimeError, match=r"compiling 3 step shapes needs about .* vm.max_map_count"):
        engine.precompile(progress=False)
    engine.add_request("a", Prompt((1, 2, 3)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(run_to_completion(engine)["a"].outputs[0].token_ids) == 2
