"""Run in a fresh process with 4 host devices (XLA_FLAGS set by the test): for each `CASE=TP,TP,...` argument,
greedy tokens, their logprobs and prompt logprobs at those tensor_parallel_sizes, and how the weights and
pools are sharded. A case is a model and a kernel backend; the default model is Qwen3-Next-style with MTP,
`qwen3_next_wide` the same shape with 4 GDN key heads and 4 kv heads (random weights), which TP = 4 splits."""

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.models.export import export_hf_checkpoint
from jaxhybrid.models.hf_config import parse_hf_config
from jaxhybrid.models.model import init_params
from jaxhybrid.models.pools import RecurrentPool, layer_pools
from jaxhybrid.models.stack import layer_location, layer_segments, segment_key
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR
from pallas_kernels.conv1d import conv1d_prefill

MODELS = {"qwen3_next": DEFAULT_MODEL_DIR, "nemotron_h": Path(__file__).parents[2] / "fixtures" / "hf" / "nemotron_h"}
# with a state cached every 16 tokens: the second prompt's decode crosses 16 (a materialization), the last one
# prefills in two chunks and publishes; the second call's prompt then starts from its cached 32-token prefix
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(100, 113)), list(range(30, 70))]
REUSING_PROMPTS = [[*range(30, 66), 7, 8, 9]]


def spec(array: jax.Array) -> list | None:
    """The mesh axis each array axis is split over (None: not split); None on one device."""
    return list(array.sharding.spec) if hasattr(array.sharding, "spec") else None


def write_wide_model(directory: Path) -> Path:
    """The default model's config with every mixer 4 heads wide, random weights, as a HuggingFace checkpoint."""
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config |= {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_attention_heads": 8,
               "num_key_value_heads": 4}
    export_hf_checkpoint(init_params(parse_hf_config(config)), config, directory)
    return directory


def make_llm(tp: int, model: str = "qwen3_next", backend: str | None = None) -> LLM:
    mtp = {"method": "mtp", "num_speculative_tokens": 2} if model.startswith("qwen3_next") else None
    return LLM(MODELS[model], skip_tokenizer_init=True, backend=backend, tensor_parallel_size=tp, max_num_seqs=4,
               max_num_batched_tokens=32, max_model_len=96, num_blocks=64, num_state_slots=16, mamba_block_size=16,
               token_buckets=(32,), row_buckets=(4,), speculative_config=mtp)


def shardings(llm: LLM) -> dict:
    """The specs of the first recurrent and attention layers' pools and params, and of an MLP kernel, each as
    one layer's (without the leading repeats axis of a segment's stacked params, and of its pools where the
    segment repeats)."""
    runner, cfg = llm.engine.runner, llm.model.config
    segments = layer_segments(cfg.layers)

    def first(kind: str) -> tuple[dict, Any]:  # (the layer's params, its pool) as one layer's
        k, j, _ = layer_location(next(i for i, kinds in enumerate(cfg.layers) if kind in kinds), segments)
        params = jax.tree.map(lambda w: w.sharding.spec[1:] if hasattr(w.sharding, "spec") else None,
                              runner.params[segment_key(k)][f"layers_{j}"][kind])
        unstack = (lambda s: s[1:]) if segments[k].repeats > 1 else (lambda s: s)
        pool = jax.tree.map(lambda a: unstack(list(a.sharding.spec)) if hasattr(a.sharding, "spec") else None,
                            runner.state.layers[k][j])
        return params, pool

    (mixer, pool), (attention, kv) = first("gdn" if cfg.gdn else "mamba2"), first("attention")
    listed = lambda s: None if s is None else list(s)
    return {
        "state": pool.state, "window": pool.window, "conv_ring": pool.conv_ring, "rings": list(pool.rings),
        "kv": kv.k, "mtp_kv": [spec(p.k) for p in runner.state.mtp],
        "in_proj": listed(mixer["in_proj_qkvz" if cfg.gdn else "in_proj"]["kernel"]),
        "conv1d": listed(mixer["conv1d"]), "out_proj": listed(mixer["out_proj"]["kernel"]),
        "q_proj": listed(attention["q_proj"]["kernel"]), "o_proj": listed(attention["o_proj"]["kernel"]),
        "mlp": listed(first("mlp")[0]["up_proj"]["kernel"]),
    }


def settle_interpret_mode() -> None:
    """Interpret one tiny kernel before any engine: the first interpreted kernel registers a JAX config value,
    which changes the tracing context between an engine's first two steps and compiles its step twice."""
    conv1d_prefill(jnp.zeros((1, 8)), jnp.zeros((8, 4)), None, jnp.array([0, 1]), jnp.zeros((2, 3, 8)), jnp.array([1]),
                   jnp.array([False]), backend="interpret")


def generate(llm: LLM) -> dict:
    """Greedy tokens and logprobs of PROMPTS then REUSING_PROMPTS, PROMPTS' prompt logprobs (which would skip the
    prefix cache), how many slot pages the steps copied and materialized, and how the pools and weights are split."""
    greedy = dict(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    first = llm.generate(PROMPTS, SamplingParams(**greedy, prompt_logprobs=1), use_tqdm=False)
    outputs = first + llm.generate(REUSING_PROMPTS, SamplingParams(**greedy), use_tqdm=False)
    stats = llm.engine.stats
    state = next(p for p in layer_pools(llm.engine.runner.state) if isinstance(p, RecurrentPool)).state
    return {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                     for o in outputs],
        "prompt_logprobs": [[p[t].logprob for p, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
                            for o in first],
        "page_ops": {"hit_copies": stats.hit_copies, "publishes": stats.publishes,
                     "materializations": stats.materializations},
        "state_devices": len(state.sharding.device_set), "state_local_devices": len(state.addressable_shards),
        "specs": shardings(llm), "tp_layout": llm.model.tp_layout,
    }


if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    settle_interpret_mode()
    report = {}
    for arg in sys.argv[1:]:  # e.g. nemotron_h/interpret=1,2,4
        case, sizes = arg.split("=")
        model, backend = case.split("/")
        if model == "qwen3_next_wide" and model not in MODELS:  # written only for its case: it takes seconds
            MODELS[model] = write_wide_model(Path(tempfile.mkdtemp()) / "wide")
        report[case] = {tp: generate(make_llm(int(tp), model, backend)) for tp in sizes.split(",")}
    print(json.dumps(report))
