"""`bash benchmarks/gpu_session.sh --dry-run`: on CPU, the GPU session's files, flags and wheels, pytest's collection
of the GPU tests, and each python step's code path on tiny shapes, so that a typo cannot waste a lent GPU's run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)  # three python steps side by side, each importing jax and compiling: ~1 min on 2 cores
def test_dry_run_passes(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", "benchmarks/gpu_session.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    session = (tmp_path / "session.txt").read_text()
    assert "every step passed" in session and "budget: " in session
    kernels = json.loads((tmp_path / "gpu_kernels.json").read_text())["results"]
    assert len(kernels) == 8 and not [r["error"] for r in kernels if "error" in r]
    step = json.loads((tmp_path / "gpu_step.json").read_text())["results"]
    assert step and all("step_ms" in r for r in step)
    assert len(list(tmp_path.iterdir())) <= 8  # a lent machine returns at most 8 files from $OUT
