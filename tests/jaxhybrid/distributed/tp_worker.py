"""Run in a fresh process with 4 host devices (XLA_FLAGS set by the test): greedy tokens, their logprobs
and prompt logprobs at tensor_parallel_size 1, 2 and 4 on the embedded model, and the pools' shardings."""

import json
import sys

import jax

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.models.pools import KVPool, RecurrentPool

PROMPTS = ["def read_config(path):\n", "import os\nimport sys\n", "class Parser:\n    def __init__(self):\n"]


def spec(array: jax.Array) -> list | None:
    """The mesh axis each array axis is split over (None: not split); None on one device."""
    return list(array.sharding.spec) if hasattr(array.sharding, "spec") else None


def make_llm(tp: int) -> LLM:
    return LLM(tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
               num_blocks=64, num_state_slots=16, token_buckets=(32,), row_buckets=(4,),
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def generate(llm: LLM) -> dict:
    """Greedy tokens, logprobs and prompt logprobs of PROMPTS, and how the pools and weights are sharded."""
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    state = llm.engine.runner.state
    recurrent = next(p for p in state.layers if isinstance(p, RecurrentPool))
    kv = next(p for p in state.layers if isinstance(p, KVPool))
    return {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                     for o in outputs],
        "prompt_logprobs": [[p[t].logprob for p, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
                            for o in outputs],
        "state_spec": spec(recurrent.state), "kv_spec": spec(kv.k),
        "state_devices": len(recurrent.state.sharding.device_set),
        "state_local_devices": len(recurrent.state.addressable_shards),
        "param_spec": spec(llm.engine.runner.params["layers_0"]["mlp"]["up_proj"]["kernel"]),
    }


if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    print(json.dumps({tp: generate(make_llm(tp)) for tp in map(int, sys.argv[1:])}))
