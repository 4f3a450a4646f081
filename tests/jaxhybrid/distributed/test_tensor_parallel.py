"""Tensor parallelism on 4 host devices (a subprocess: the device count is fixed when JAX starts): TP = 2
and 4 give TP = 1's greedy tokens and logprobs, with the weights and pools really sharded."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.tolerances import assert_close

# the same maths with the heads' partial sums added in another order (the row-parallel projections)
LOGPROB_ATOL = 1e-4


@functools.cache
def tp_runs() -> dict:
    """tp_worker.py's reports at TP = 1, 2 and 4 (one subprocess, shared with test_multihost.py)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    worker = Path(__file__).with_name("tp_worker.py")
    done = subprocess.run([sys.executable, str(worker), "1", "2", "4"], env=env, capture_output=True, text=True,
                          timeout=280, cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_tp_2_and_4_equal_one_device():
    runs = tp_runs()
    one = runs["1"]
    assert one["state_devices"] == 1
    for tp in ("2", "4"):
        run = runs[tp]
        assert run["tokens"] == one["tokens"]
        for key in ("logprobs", "prompt_logprobs"):
            assert_close(np.concatenate(run[key]), np.concatenate(one[key]), LOGPROB_ATOL, f"tp={tp} {key}")
        # GDN state [S, HV=4, K, V] and MLP up_proj [128, 256] split over tp; 2 kv heads split only at tp = 2
        assert run["state_spec"] == [None, "tp", None, None], run["state_spec"]
        assert run["param_spec"] == [None, "tp"], run["param_spec"]
        assert run["state_devices"] == int(tp)
    assert runs["2"]["kv_spec"] == [None, None, "tp", None]
    assert "tp" not in runs["4"]["kv_spec"]  # 2 kv heads do not split 4 ways: replicated
