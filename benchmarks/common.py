"""What the benchmarks share: where results go, the machine they ran on, and how a plot is drawn off-screen."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The machine and software a run measured: cores and load, and jax's version and backend if it was used."""
    info = {"machine": platform.machine(), **cpu(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
            "python": platform.python_version()}
    if "jax" in sys.modules:  # benchmarks of the pure-Python scheduler never import it
        jax = sys.modules["jax"]
        info |= {"jax": jax.__version__, "backend": jax.default_backend()}
    return info


def cpu() -> dict[str, Any]:
    """The CPU's model and its bf16 matrix instructions: GEMM libraries differ most there (oneDNN takes AMX tiles
    where it finds them), so a ratio against a torch peer holds for that kind of CPU only."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return {"cpu": platform.processor()}
    field = lambda key: next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")
    flags = field("flags").split()
    return {"cpu": field("model name"), "cpu_bf16": [f for f in ("avx512_bf16", "amx_bf16") if f in flags]}


def write_results(name: str, results: Any, meta: dict[str, Any], **extra: Any) -> Path:
    """`benchmarks/results/NAME.json`: `{"meta": machine() | meta, "results": results, **extra}`."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"meta": machine() | meta, "results": results, **extra}, indent=1))
    print(f"wrote {path}")
    return path


@contextlib.contextmanager
def figure(path: Path, *subplots: Any, dpi: int = 120, **options: Any) -> Iterator[tuple[Any, Any]]:
    """`plt.subplots(*subplots, **options)` drawn off-screen and saved to `path` when the block ends."""
    import matplotlib  # the `train` extra: only benchmarks and the tiny recipe plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*subplots, **options)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
