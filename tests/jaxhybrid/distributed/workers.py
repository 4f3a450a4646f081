"""The TP and multi-host tests' subprocesses: their environment and time bound, one worker run per set of cases,
and how their reports are compared."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from jaxhybrid.models.tensor_parallel import AXIS

# the same maths with the heads' partial sums added in another order (the row-parallel projections)
LOGPROB_ATOL = 1e-4
# a worker compiles the whole engine once per TP size: about a minute on a quiet machine, several on a loaded one;
# these bounds only catch a hang
WORKER_TIMEOUT = 840


def worker_env(num_devices: int) -> dict:
    """A subprocess's environment: `num_devices` CPU devices, and the step compiled without most XLA
    optimisations (compiling is most of these tests' time; TP and one device compare at any level)."""
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
            "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


@functools.cache
def tp_runs(*cases: str) -> dict:
    """tp_worker.py's reports {case: {tp: report}} for arguments "model/backend=1,2,4", from one subprocess."""
    worker = Path(__file__).with_name("tp_worker.py")
    done = subprocess.run([sys.executable, str(worker), *cases], env=worker_env(4), capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT, cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def split_axis(spec: list | None) -> int | None:
    """The array axis split over the mesh (None: replicated or on one device)."""
    return spec.index(AXIS) if spec and AXIS in spec else None
