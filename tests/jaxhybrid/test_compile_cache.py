"""A restart with a warm compilation cache recompiles nothing: a second process that loads the model and
precompiles every bucket finds each program in the cache the first one filled. The cache is keyed by the
lowered program, so this also holds every lowering to the same text from process to process."""

import json
import subprocess
import sys

import pytest

START = """
import json, sys
from jax import monitoring
events = []
monitoring.register_event_listener(lambda event, **_: events.append(event))
from jaxhybrid import LLM
llm = LLM(compilation_cache_dir=sys.argv[1], precompile=True, max_num_seqs=4, max_num_batched_tokens=16,
          max_model_len=64, token_buckets=(16,), row_buckets=(2, 4), num_blocks=16, num_state_slots=8,
          speculative_config={"method": "mtp", "num_speculative_tokens": 1})
count = lambda name: events.count("/jax/compilation_cache/" + name)
print(json.dumps({"hits": count("cache_hits"), "misses": count("cache_misses"),
                  "buckets": llm.engine.runner.compiled_buckets()}))
"""


@pytest.mark.timeout(600)
def test_a_warm_restart_compiles_nothing(tmp_path):
    starts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", START, str(tmp_path)], capture_output=True, text=True,
                              timeout=280, check=True)
        starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = starts
    assert cold["misses"] > 0 and cold["buckets"] >= 2, cold
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"] + cold["hits"], starts
