"""Two local processes under `jax.distributed` (multihost.py): process 0 schedules and broadcasts its plans,
process 1 follows, the engine runs tensor parallel over both processes' devices, and the output equals one
process's (tp_worker.py's TP = 1 run; the same maths with the heads' partial sums added in another order)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.jaxhybrid.distributed.workers import (
    LOGPROB_ATOL,
    WORKER_TIMEOUT,
    split_axis,
    tp_runs,
    worker_env,
)
from tests.tolerances import assert_close

ROOT = Path(__file__).parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(2 * WORKER_TIMEOUT + 60)  # the two processes, then (uncached) the one-process run
def test_two_processes_give_the_single_process_output():
    env = worker_env(1)
    worker, port = "tests.jaxhybrid.distributed.multihost_worker", str(free_port())
    processes = [subprocess.Popen([sys.executable, "-m", worker, port, str(rank)], env=env, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        done = [p.communicate(timeout=WORKER_TIMEOUT) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, (_, err) in zip(processes, done, strict=True):
        assert p.returncode == 0, err[-3000:]
    leader, follower = (json.loads(out.splitlines()[-1]) for out, _ in done)
    assert follower["steps"] == leader["steps"] > 0  # every step ran on both processes
    one = tp_runs("qwen3_next/reference=1")["qwen3_next/reference"]["1"]
    assert leader["tokens"] == one["tokens"]
    for key in ("logprobs", "prompt_logprobs"):
        assert_close(np.concatenate(leader[key]), np.concatenate(one[key]), LOGPROB_ATOL, key)
    # the pools span both processes' devices; each process holds its own shard
    assert leader["state_devices"] == 2 and leader["state_local_devices"] == 1
    assert split_axis(leader["specs"]["state"]) == 1 and split_axis(leader["specs"]["in_proj"]) == 1
