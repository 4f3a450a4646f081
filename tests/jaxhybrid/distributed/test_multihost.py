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
def test_two_processes_give_the_single_process_output(tmp_path):
    worker, port = "tests.jaxhybrid.distributed.multihost_worker", str(free_port())
    processes = []
    for rank in (0, 1):  # files, not pipes: a process blocked on a full pipe would stall the other's collectives
        with open(tmp_path / f"{rank}.out", "w") as out, open(tmp_path / f"{rank}.err", "w") as err:
            processes.append(subprocess.Popen([sys.executable, "-m", worker, port, str(rank), str(WORKER_TIMEOUT)],
                                              env=worker_env(1), cwd=ROOT, stdout=out, stderr=err))
    try:
        for p in processes:  # a hung worker prints its threads' stacks and exits at WORKER_TIMEOUT
            p.wait(timeout=WORKER_TIMEOUT + 60)
    finally:
        for p in processes:
            p.kill()
    done = [((tmp_path / f"{rank}.out").read_text(), (tmp_path / f"{rank}.err").read_text()) for rank in (0, 1)]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(f"rank {rank}: {err[-3000:]}"
                                                                  for rank, (_, err) in enumerate(done))
    leader, follower = (json.loads(out.splitlines()[-1]) for out, _ in done)
    assert follower["steps"] == leader["steps"] > 0  # every step ran on both processes
    one = tp_runs("qwen3_next/reference=1")["qwen3_next/reference"]["1"]
    assert leader["tokens"] == one["tokens"]
    for key in ("logprobs", "prompt_logprobs"):
        assert_close(np.concatenate(leader[key]), np.concatenate(one[key]), LOGPROB_ATOL, key)
    # the pools span both processes' devices; each process holds its own shard
    assert leader["state_devices"] == 2 and leader["state_local_devices"] == 1
    assert split_axis(leader["specs"]["state"]) == 1 and split_axis(leader["specs"]["in_proj"]) == 1
