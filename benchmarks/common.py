"""What the benchmarks share: where results go, the machine a run was measured on, and how a plot is saved."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    """The run's machine: the cores this process may use (both sides of a peer comparison are pinned the same
    way), the load it ran under, and the interpreter."""
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cores": len(os.sched_getaffinity(0)), "load_average": os.getloadavg()}


def write_results(name: str, meta: dict, results: Any) -> Path:
    """`results/<name>.json`: {"meta": the machine and `meta`, "results": `results`}."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"meta": {**machine(), **meta}, "results": results}, indent=1))
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
