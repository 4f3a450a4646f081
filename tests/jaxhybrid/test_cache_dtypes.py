"""--kv-cache-dtype and --mamba-ssm-cache-dtype: vLLM's spellings, the pools' dtypes and sizes, the capacity line at
start-up, and engines running end to end with each (fp8 KV at scale 1 exact on values e4m3 holds)."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.engine.args import EngineArgs
from jaxhybrid.engine.builder import scheduler_config
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.flags import make_parser
from jaxhybrid.models.cache_dtypes import cache_dtypes, checkpoint_kv_scales
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.model import Model
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.models.pools import KV_CACHE_DTYPES, CacheDtypes, KVPool, RecurrentPool, init_device_state, layer_pools
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.worker.memory import size_pools, slot_bytes
from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.attention.reference import quantize
from scheduler.replay import ring_rows
from tests.hf_fixtures import HF_FIXTURES, fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, run_to_completion

FP8 = jnp.float8_e4m3fn


def _flag_parser():
    return make_parser("jaxhybrid", "", {})


@pytest.mark.parametrize("flag, value", [("--kv-cache-dtype", "fp8"), ("--kv-cache-dtype", "fp8_e4m3"),
                                         ("--mamba-ssm-cache-dtype", "bfloat16"),
                                         ("--mamba-ssm-cache-dtype", "float32")])
def test_vllms_spellings_parse(flag, value):
    args = _flag_parser().parse_args([flag, value])
    assert value in (args.kv_cache_dtype, args.mamba_ssm_cache_dtype)


@pytest.mark.parametrize("flag, value", [("--kv-cache-dtype", "fp8_e5m2"), ("--kv-cache-dtype", "fp8_inc"),
                                         ("--mamba-ssm-cache-dtype", "float16")])
def test_other_dtypes_are_refused_in_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        _flag_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"invalid choice: '{value}'" in error
    with pytest.raises(ValueError, match=flag[2:].replace("-", "_")):
        EngineArgs(**{flag[2:].replace("-", "_"): value})


def _pools_of(cfg, cache: CacheDtypes, ring_size: int = 16, k: int = 0) -> tuple[list[KVPool], list[RecurrentPool]]:
    state = jax.eval_shape(lambda: init_device_state(cfg, num_blocks=2, block_size=16, num_slots=1,
                                                     ring_entries=ring_rows(ring_size, k), dtype=jnp.bfloat16,
                                                     snapshots=ring_size == 0, cache=cache))
    pools = layer_pools(state) + list(state.mtp)
    return [p for p in pools if isinstance(p, KVPool)], [p for p in pools if isinstance(p, RecurrentPool)]


def _nbytes(leaf: jax.ShapeDtypeStruct) -> int:
    return math.prod(leaf.shape) * leaf.dtype.itemsize


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("ring_size", [16, 0])
def test_pool_dtypes_and_sizes_follow_the_flags(family, ring_size):
    """fp8 KV blocks and bf16 states as allocated, and as `size_pools` and `slot_bytes` count them."""
    cfg = load_config(HF_FIXTURES / family)
    kv, recurrent = _pools_of(cfg, CacheDtypes("fp8", "bfloat16"), ring_size, k=1)
    assert {leaf.dtype for p in kv for leaf in p} == {jnp.dtype(FP8)}
    assert {p.state.dtype for p in recurrent} == {jnp.dtype(jnp.bfloat16)}
    assert {r.dtype for p in recurrent for r in p.rings} == {jnp.dtype(jnp.float32)}  # the rings stay f32
    slot = sum(_nbytes(leaf) for p in recurrent for leaf in jax.tree.leaves(p))  # one slot: num_slots = 1
    assert slot_bytes(cfg, ring_size, 1, 2, state_bytes=2) == slot
    sizes = size_pools(cfg, 64 * 2**20, block_size=16, ring_size=ring_size, num_spec_tokens=1, max_num_seqs=8,
                       max_model_len=256, kv_bytes=1, state_bytes=2)
    assert sizes.bytes_per_block == sum(_nbytes(leaf) for p in kv for leaf in p) // 2  # two blocks allocated
    auto = size_pools(cfg, 64 * 2**20, block_size=16, ring_size=ring_size, num_spec_tokens=1, max_num_seqs=8,
                      max_model_len=256)
    assert 2 * sizes.bytes_per_block == auto.bytes_per_block and sizes.bytes_per_slot < auto.bytes_per_slot
    assert sizes.num_blocks > 2 * auto.num_blocks and sizes.num_state_slots > auto.num_state_slots


def test_auto_is_the_models_kv_dtype_and_float32_states():
    kv, recurrent = _pools_of(load_config(HF_FIXTURES / "qwen3_next"), CacheDtypes("auto", "auto"))
    assert kv[0].k.dtype == jnp.bfloat16 and recurrent[0].state.dtype == jnp.float32


def test_start_up_reports_the_capacity_gained(caplog):
    args = EngineArgs(kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    cfg = load_config(HF_FIXTURES / "nemotron_h")
    with caplog.at_level(logging.INFO, logger="jaxhybrid"):
        config = scheduler_config(args, cfg, lambda: 64 * 2**20, dtype=jnp.dtype(jnp.bfloat16))
    auto = scheduler_config(dataclasses.replace(args, kv_cache_dtype="auto", mamba_ssm_cache_dtype="auto"), cfg,
                            lambda: 64 * 2**20, dtype=jnp.dtype(jnp.bfloat16))
    kv_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache fp8"))
    assert f"the blocks of bfloat16 ({config.num_blocks} vs {auto.num_blocks})" in kv_line
    state_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("recurrent states"))
    assert f"{config.num_state_slots} vs {auto.num_state_slots} slots" in state_line


def test_checkpoint_kv_scales_are_read_where_present():
    assert checkpoint_kv_scales(HF_FIXTURES / "nemotron_h_fp8") == (1.0, 1.0)
    assert checkpoint_kv_scales(HF_FIXTURES / "nemotron_h") is None
    assert cache_dtypes("auto", "auto", HF_FIXTURES / "nemotron_h_fp8") == CacheDtypes()


def _on_fp8_grid(q, k, v, *args, **kwargs):
    """The attention op on K/V rounded to e4m3's values first: what an fp8 pool at scale 1 stores."""
    grid = lambda x: quantize(x, FP8).astype(x.dtype)  # noqa: E731
    return ragged_paged_attention(q, grid(k), grid(v), *args, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def _run(cache: CacheDtypes, attention=ragged_paged_attention) -> list[list[tuple[int, float]]]:
    """Greedy (token, logprob) lists of two prompts (one of them chunked) on one small engine: one compile."""
    base = fixture_model("nemotron_h")
    model = Model(base.config, base.params, ops=ModelOps(attention=attention, cache=cache))
    engine = engine_for(model, budget=16, num_blocks=24, num_state_slots=12, max_num_seqs=2, max_model_len=48,
                        async_scheduling=False)
    rng = np.random.default_rng(0)
    for i, length in enumerate((9, 21)):
        engine.add_request(f"r{i}", Prompt(tuple(int(t) for t in rng.integers(0, 256, length))), GREEDY)
    outputs = run_to_completion(engine)
    pools = layer_pools(engine.runner.state)
    assert {p.k.dtype for p in pools if isinstance(p, KVPool)} == {jnp.dtype(KV_CACHE_DTYPES[cache.kv] or jnp.float32)}
    assert {p.state.dtype for p in pools if isinstance(p, RecurrentPool)} == {cache.state_dtype()}
    return [[(t, p[t].logprob) for t, p in zip(out.token_ids, out.logprobs, strict=True)]
            for out in (outputs[f"r{i}"].outputs[0] for i in range(2))]


def test_engine_with_fp8_kv_and_bf16_states_is_exact_on_representable_kv():
    """Both settings end to end (a chunked prefill, decodes reading fp8 KV and bf16 states): against a float32 KV
    cache holding the same e4m3 values, with the same bf16 states, the same tokens and logprobs."""
    fp8 = _run(CacheDtypes("fp8", "bfloat16"))
    assert fp8 == _run(CacheDtypes("auto", "bfloat16"), _on_fp8_grid)
    assert all(len(run) == GREEDY.max_tokens for run in fp8)
